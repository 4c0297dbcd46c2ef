"""Saved plans: JSON round trip, reuse by optimize() when the traced graph matches, a warning that says
why when it does not, and typed errors for bad files."""
from __future__ import annotations

import json
import warnings

import pytest
import torch

import models_zoo
from recompute_graph import (CompilerFallbackWarning, InfeasibleBudgetError, PlanFileError, PlanMismatchWarning,
                             RecomputedModule, RecomputePlan, optimize)
from recompute_graph.costs import profile_model
from recompute_graph.planner import make_plan
from recompute_graph.saved_plans import mismatch_reason, structure_fingerprint


@pytest.fixture(scope="module")
def unet_plan(tmp_path_factory):
    model, inputs = models_zoo.get_model("unet", "tiny")
    _, graph = profile_model(model, inputs, timing="flops")
    plan = make_plan(graph, 0.6, "dp_exact")
    path = tmp_path_factory.mktemp("plans") / "unet-plan.json"
    plan.save(str(path))
    return plan, path


def test_a_saved_plan_loads_back_with_the_same_schedule_graph_and_prediction(unet_plan):
    plan, path = unet_plan
    loaded = RecomputePlan.load(str(path))
    assert loaded.schedule == plan.schedule
    assert loaded.graph.fingerprint() == plan.graph.fingerprint()
    assert loaded.predicted_peak_bytes == plan.predicted_peak_bytes
    assert loaded.predicted_compute_overhead == pytest.approx(plan.predicted_compute_overhead)
    data = json.loads(path.read_text())
    assert data["structure_fingerprint"] == structure_fingerprint(plan.graph)
    assert len(data["recomputed_nodes"]) == len(plan.recomputed_nodes) > 0


def test_the_structure_fingerprint_ignores_times_but_not_shapes(unet_plan):
    plan, _ = unet_plan
    model, inputs = models_zoo.get_model("unet", "tiny")
    _, measured = profile_model(model, inputs, timing="measure", repeats=1, warmup=0)
    assert measured.fingerprint() != plan.graph.fingerprint()       # other times
    assert mismatch_reason(plan.graph, measured) is None              # same structure
    _, bigger = profile_model(*models_zoo.get_model("unet", "tiny", batch=3), timing="flops")
    reason = mismatch_reason(plan.graph, bigger)
    assert "output_bytes" in reason and "shapes" in reason


def test_optimize_reuses_a_matching_plan_without_solving_and_trains_exactly(unet_plan, monkeypatch):
    plan, path = unet_plan
    model, inputs = models_zoo.get_model("unet", "tiny")
    import recompute_graph.api as api
    monkeypatch.setattr(api, "make_plan", lambda *a, **k: pytest.fail("solved instead of reusing the plan"))
    with warnings.catch_warnings():
        warnings.simplefilter("error", PlanMismatchWarning)
        warnings.simplefilter("error", CompilerFallbackWarning)
        optimized = optimize(model, 0.6, example_inputs=inputs, plan=path)
    # optimize's default path ("auto") runs a plan of the executor's graph on the executor
    assert isinstance(optimized, RecomputedModule)
    assert optimized.recompute_plan.schedule == plan.schedule
    assert "reused saved plan" in optimized.recompute_plan.description
    torch.manual_seed(1)
    model.zero_grad()
    model(*inputs).square().mean().backward()
    expected = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    torch.manual_seed(1)
    optimized(*inputs).square().mean().backward()
    for p, e in zip(model.parameters(), expected):
        torch.testing.assert_close(p.grad, e)


def test_a_plan_for_other_shapes_or_a_smaller_budget_is_not_reused_and_the_warning_says_why(unet_plan):
    plan, path = unet_plan
    model, inputs = models_zoo.get_model("unet", "tiny", batch=3)
    with pytest.warns(PlanMismatchWarning, match="shapes or dtypes"):
        optimized = optimize(model, 0.6, example_inputs=inputs, plan=str(path), timing="flops")
    assert "reused" not in optimized.recompute_plan.description
    model, inputs = models_zoo.get_model("unet", "tiny")
    with pytest.warns(PlanMismatchWarning, match="needs a budget of"):
        try:
            optimize(model, int(plan.predicted_peak_bytes * 0.9), example_inputs=inputs, plan=plan, timing="flops")
        except InfeasibleBudgetError:  # the new plan may not fit either; the warning is what is tested
            pass


@pytest.mark.parametrize("content, message", [
    (None, "no plan file"),
    ("{not json", "is not JSON"),
    ('{"format": "something else"}', "not a saved recompute_graph plan"),
    ('{"format": "recompute_graph.RecomputePlan/1", "solver": "x"}', "incomplete or malformed"),
])
def test_bad_plan_files_raise_plan_file_error_before_anything_is_traced(tmp_path, content, message):
    path = tmp_path / "plan.json"
    if content is not None:
        path.write_text(content)
    model, inputs = models_zoo.get_model("mlp", "tiny")
    with pytest.raises(PlanFileError, match=message):
        optimize(model, 0.5, example_inputs=inputs, plan=path)
