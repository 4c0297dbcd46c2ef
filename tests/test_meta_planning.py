"""Planning without the device: ``plan_for`` prices a model built on ``meta`` (no weights allocated) with
FLOP-based times, and its saved plan applies to the real model unchanged."""
from __future__ import annotations

import warnings

import torch

import models_zoo
from recompute_graph import PlanMismatchWarning, optimize, plan_for
from recompute_graph.measure import default_loss


def test_a_plan_made_on_meta_is_reused_by_the_real_model_with_exact_gradients(tmp_path, monkeypatch):
    built = []

    def build():
        model, inputs = models_zoo.get_model("gpt2", "tiny")
        built.append(model)
        return model, inputs

    # meta tensors show no kernel workspace, which the real model's allocator-level pricing adds:
    # headroom (0.7, not a tight budget) lets the real model reuse the plan as is
    plan = plan_for(build, 0.7, device_profile="h200", loss_fn=default_loss)
    assert all(p.is_meta for p in built[0].parameters())  # nothing was allocated
    assert plan.graph.cost_source.startswith("flop-estimate") and plan.recomputed_nodes
    path = tmp_path / "plan.json"
    plan.save(str(path))

    model, inputs = models_zoo.get_model("gpt2", "tiny")
    import recompute_graph.api as api
    monkeypatch.setattr(api, "make_plan", lambda *a, **k: (_ for _ in ()).throw(AssertionError("solved again")))
    with warnings.catch_warnings():
        warnings.simplefilter("error", PlanMismatchWarning)
        optimized = optimize(model, 0.7, example_inputs=inputs, plan=path, timing="flops", loss_fn=default_loss)
    assert optimized.recompute_plan.schedule == plan.schedule
    torch.manual_seed(0)
    model.zero_grad()
    default_loss(model(*inputs)).backward()
    expected = [p.grad.clone() for p in model.parameters()]
    torch.manual_seed(0)
    model.zero_grad()
    default_loss(optimized(*inputs)).backward()
    for p, e in zip(model.parameters(), expected):
        torch.testing.assert_close(p.grad, e)
