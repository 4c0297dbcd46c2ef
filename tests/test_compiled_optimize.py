"""``optimize(model, budget, compiler=...)``: the compiler path (torch.compile with our budgeted
partitioner) behind the one call users make, checked against eager autograd on the zoo and on model
code nobody here wrote, with its errors and its fallback to the schedule executor."""
import copy
import logging
import re
import warnings

import pytest
import torch
from torch import nn

import models_zoo
import recompute_graph as rg
from recompute_graph.measure import allocator_peak_memory, default_loss
from recompute_graph.verification import parameter_gradient_error


def _step(module, inputs, kwargs=None):
    module.zero_grad(set_to_none=True)
    torch.manual_seed(0)
    default_loss(module(*inputs, **(kwargs or {}))).backward()


def _buffers_equal(model, reference):
    return all(torch.equal(a, b) for a, b in zip(model.buffers(), reference.buffers()))


# BatchNorm here; GPT-2's dropout masks are checked by the meta-plan test below
@pytest.mark.parametrize("name, fraction", [("resnet18", 0.9)])
def test_the_compiler_path_trains_exactly_and_planning_leaves_the_model_as_it_was(name, fraction):
    torch._dynamo.reset()
    model, inputs = models_zoo.get_model(name, "tiny")
    reference = copy.deepcopy(model)
    generator_state = torch.get_rng_state()
    optimized = rg.optimize(model, fraction, example_inputs=inputs, compiler=True)
    assert isinstance(optimized, rg.CompiledRecomputedModule)
    assert torch.equal(torch.get_rng_state(), generator_state)  # the planning call's dropout drew nothing
    assert _buffers_equal(model, reference) and all(p.grad is None for p in model.parameters())
    plan = optimized.recompute_plan
    assert plan is not None and plan.recomputed_nodes and "compiled, plan:" in repr(optimized)
    assert len(optimized.lowerings) == 1 and "def forward" in optimized.backward_code
    for _ in range(2):  # two steps: BatchNorm statistics updated once per step, the same dropout masks
        _step(reference, inputs)
        _step(optimized, inputs)
        assert parameter_gradient_error(model, reference) == 0.0 and _buffers_equal(model, reference)
    assert len(optimized.lowerings) == 1  # planned once, on the example call
    measured = allocator_peak_memory(lambda: _step(optimized, inputs))
    assert measured <= plan.budget_bytes
    assert measured * 0.9 <= plan.predicted_step_peak_bytes <= measured * 1.2
    assert optimized.state_dict().keys() == model.state_dict().keys()


def test_eval_and_no_grad_run_the_plain_forward_and_an_unplanned_module_plans_on_its_first_training_call():
    torch._dynamo.reset()
    model, inputs = models_zoo.get_model("mlp", "tiny")
    optimized = rg.optimize(model, 0.9, compiler=True)
    assert optimized.recompute_plan is None and "on first training call" in repr(optimized)
    with torch.no_grad():
        torch.testing.assert_close(optimized(*inputs), model(*inputs), rtol=0, atol=0)
    optimized.eval()
    assert not model.training
    optimized(*inputs)
    assert optimized.recompute_plan is None  # neither compiled nor planned
    optimized.train()
    reference = copy.deepcopy(model)
    _step(reference, inputs)
    _step(optimized, inputs)
    assert optimized.recompute_plan is not None and parameter_gradient_error(model, reference) == 0.0


def test_an_infeasible_budget_raises_the_typed_error_and_changes_nothing():
    torch._dynamo.reset()
    model, inputs = models_zoo.get_model("resnet18", "tiny")
    reference = copy.deepcopy(model)
    with pytest.raises(rg.InfeasibleBudgetError) as caught:
        rg.optimize(model, 0.05, example_inputs=inputs, compiler=True)
    assert caught.value.min_budget_bytes > caught.value.budget_bytes
    assert _buffers_equal(model, reference)
    optimized = rg.optimize(model, caught.value.min_budget_bytes, example_inputs=inputs, compiler=True)
    assert optimized.recompute_plan.min_budget_bytes <= caught.value.min_budget_bytes


def test_bad_compiler_arguments_are_refused_before_any_work():
    model, inputs = models_zoo.get_model("mlp", "tiny")
    with pytest.raises(ValueError, match="compiler="):
        rg.optimize(model, 0.5, compiler="inductor")
    with pytest.raises(ValueError, match="does not take cost_graph"):
        rg.optimize(model, 0.5, example_inputs=inputs, compiler=True,
                    cost_graph=rg.optimize(model, 1.0, example_inputs=inputs).recompute_plan.graph)
    with pytest.raises(ValueError, match="timing"):
        rg.optimize(model, 0.5, compiler=True, timing="flops")


class _BreaksTheGraph(nn.Module):
    """Code Dynamo will not put in a graph (here an explicit graph break; in the wild, a call into a C
    extension or a print): torch.compile cannot capture the step as one graph, torch.fx can."""

    def __init__(self, breaks: bool = True) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(16, 64), nn.Linear(64, 16)
        self.breaks = breaks

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        if self.breaks:
            torch._dynamo.graph_break()
        return self.b(torch.tanh(h))


def test_a_model_that_cannot_be_captured_whole_is_refused_or_falls_back_with_a_warning_that_says_why():
    torch._dynamo.reset()
    torch.manual_seed(0)
    model, x = _BreaksTheGraph(), torch.randn(32, 16)
    with pytest.raises(rg.TraceError, match="could not be compiled"):
        rg.optimize(model, 0.9, example_inputs=(x,), compiler=True)
    with pytest.warns(rg.CompilerFallbackWarning, match="compiler path failed"):
        optimized = rg.optimize(model, 0.9, example_inputs=(x,), compiler="auto")
    assert isinstance(optimized, rg.RecomputedModule)
    reference = copy.deepcopy(model)
    _step(reference, (x,))
    _step(optimized, (x,))
    assert parameter_gradient_error(model, reference) == 0.0
    lazy = rg.optimize(model, 0.9, compiler="auto")  # no example: the fallback happens on the first call
    with pytest.warns(rg.CompilerFallbackWarning):
        _step(lazy, (x,))
    assert lazy.delegate is not None and lazy.recompute_plan is lazy.delegate.recompute_plan
    assert parameter_gradient_error(model, reference) == 0.0


def test_a_recompilation_that_cannot_be_captured_falls_back_on_the_call_that_needs_it():
    """A Python attribute the forward reads changes after planning: Dynamo's guard fails and the
    recompilation meets a graph break inside the training call itself, not in a trial."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model, x = _BreaksTheGraph(breaks=False), torch.randn(32, 16)
    optimized = rg.optimize(model, 0.9, example_inputs=(x,))
    assert isinstance(optimized, rg.CompiledRecomputedModule) and optimized.delegate is None
    model.breaks = True
    reference = copy.deepcopy(model)
    with pytest.warns(rg.CompilerFallbackWarning, match="could not be compiled"):
        _step(optimized, (x,))
    assert optimized.delegate is not None and "compiler path failed" in repr(optimized)
    _step(reference, (x,))
    assert parameter_gradient_error(model, reference) == 0.0
    model.breaks = False
    strict = rg.optimize(model, 0.9, example_inputs=(x,), compiler=True)  # the compiler path only: an error
    model.breaks = True
    with pytest.raises(rg.TraceError, match="could not be compiled"):
        _step(strict, (x,))


_LOG = logging.getLogger("recompute_graph.tests")


class _Logs(nn.Module):
    """Logs inside its forward, as ``transformers``' GPT-2 loss does (``logger.warning_once``)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = _mlp()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _LOG.warning("a message inside the forward")
        return self.net(x)


def test_a_logging_call_inside_the_forward_does_not_break_the_graph():
    """Dynamo breaks the graph at a ``logging.Logger`` call unless told to ignore it; the compiler
    path ignores them (as ``torch.export`` does), so the model is captured whole."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model, x = _Logs(), torch.randn(512, 32)
    reference = copy.deepcopy(model)
    optimized = rg.optimize(model, 0.8, example_inputs=(x,), compiler=True)
    assert optimized.recompute_plan.recomputed_nodes
    _step(reference, (x,))
    _step(optimized, (x,))
    assert parameter_gradient_error(model, reference) == 0.0
    assert not torch._dynamo.config.ignore_logging_functions  # Dynamo's setting is put back after each call


def test_under_a_dispatch_mode_a_training_call_runs_the_plain_forward_with_a_warning():
    """torch.compile does not run under a torch dispatch mode (a FlopCounterMode, a memory tracker):
    such a call runs the original forward, exactly, and says so; the next call is compiled again."""
    from recompute_graph.measure import StorageTracker
    torch._dynamo.reset()
    torch.manual_seed(0)
    model, x = _mlp(), torch.randn(512, 32)
    reference = copy.deepcopy(model)
    optimized = rg.optimize(model, 0.8, example_inputs=(x,))
    with StorageTracker(), pytest.warns(rg.CompilerFallbackWarning, match="dispatch mode"):
        _step(optimized, (x,))
    _step(reference, (x,))
    assert parameter_gradient_error(model, reference) == 0.0
    _step(optimized, (x,))
    assert optimized.delegate is None and len(optimized.lowerings) == 1
    assert parameter_gradient_error(model, reference) == 0.0


def test_a_call_nothing_in_which_requires_grad_is_refused_by_the_compiler_path_and_falls_back():
    """All parameters frozen and inputs without grad: torch.compile makes no backward graph, so there is
    nothing to plan on the compiler path (the trial would otherwise report another signature's plan)."""
    torch._dynamo.reset()
    model, x = _mlp().requires_grad_(False), torch.randn(512, 32)
    with pytest.raises(rg.TraceError, match="nothing to plan"):
        rg.optimize(model, 0.8, example_inputs=(x,), compiler=True)
    with pytest.warns(rg.CompilerFallbackWarning, match="nothing to plan"):  # nothing to recompute: all of it
        optimized = rg.optimize(model, 1.0, example_inputs=(x,))
    assert isinstance(optimized, rg.RecomputedModule)
    torch.testing.assert_close(optimized(x), model(x))
    with pytest.raises(rg.InfeasibleBudgetError, match=r"Nothing in this call requires grad.*x\.requires_grad_"):
        rg.optimize(model, 0.5, example_inputs=(x,), compiler=False)
    x.requires_grad_()  # gradients with respect to the input alone: planned and exact
    optimized = rg.optimize(model, 0.6, example_inputs=(x,), compiler=False)
    assert optimized.recompute_plan.recomputed_nodes
    (expected,) = torch.autograd.grad(model(x).square().sum(), x)
    (actual,) = torch.autograd.grad(optimized(x).square().sum(), x)
    assert torch.equal(actual, expected)


class _UnusedDropout(nn.Module):
    """A dropout whose result nothing reads, then one that is used: in eager PyTorch the second draws
    after the first; torch.compile drops the first as dead code, so the second draws the first's mask."""

    def __init__(self) -> None:
        super().__init__()
        self.drop = nn.Dropout(0.3)
        self.linear = nn.Linear(32, 32)

    def forward(self, x):
        self.drop(x)
        return self.linear(self.drop(x))


def test_an_unused_dropout_is_refused_by_the_compiler_path_and_the_executor_trains_it_exactly():
    torch._dynamo.reset()
    torch.manual_seed(0)
    model, x = _UnusedDropout(), torch.randn(64, 32)
    with pytest.raises(rg.TraceError, match="other random numbers"):
        rg.optimize(model, 1.0, example_inputs=(x,), compiler=True)
    with pytest.warns(rg.CompilerFallbackWarning, match="unused dropout"):
        optimized = rg.optimize(model, 1.0, example_inputs=(x,))
    assert isinstance(optimized, rg.RecomputedModule)
    reference = copy.deepcopy(model)
    for module in (reference, optimized):
        torch.manual_seed(1)
        default_loss(module(x)).backward()
    assert parameter_gradient_error(model, reference) == 0


def test_an_infeasible_budget_on_a_path_that_falls_back_is_the_executors_to_report():
    """The compiler path's floor was reported, though it would fall back (the unused dropout is found
    after planning); at that floor the executor, whose floor was higher, raised again (Canine, PegasusX)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model, x = _UnusedDropout(), torch.randn(64, 32)
    with pytest.warns(rg.CompilerFallbackWarning, match="unused dropout"), \
            pytest.raises(rg.InfeasibleBudgetError) as raised:
        rg.optimize(model, 0.05, example_inputs=(x,))
    executor_floor = raised.value.min_budget_bytes
    with pytest.raises(rg.InfeasibleBudgetError) as raised:
        rg.optimize(model, 0.05, example_inputs=(x,), compiler=False)
    assert raised.value.min_budget_bytes == executor_floor
    with pytest.warns(rg.CompilerFallbackWarning):
        optimized = rg.optimize(model, executor_floor, example_inputs=(x,))
    assert isinstance(optimized, rg.RecomputedModule)


class _InPlaceDropoutOnAChannelsLastView(nn.Module):
    """EfficientNet's in-place dropout on a flattened activation, here one with channels-last strides
    (a LayerNorm over channels, permuted back): torch.compile's decomposition fills the mask in another
    element order than eager ``dropout_``, and trained 58 % off in a plan at the floor (found by
    tests/test_fuzz_compiled.py)."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(4)
        self.drop = nn.Dropout(0.3, inplace=True)
        self.head = nn.Conv2d(4, 2, 1)

    def forward(self, x):
        u = self.norm(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2) * 1.0
        return self.head(self.drop(u.flatten(2)).unflatten(2, u.shape[2:]))


def test_a_dropout_whose_compiled_mask_differs_from_eager_is_refused_by_both_paths():
    """The executor's graph comes from torch.export here (the write through a view), whose
    decomposition draws the same other mask: refused there too, so nothing trains it wrong."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model, x = _InPlaceDropoutOnAChannelsLastView(), torch.randn(4, 4, 16, 16)
    with pytest.raises(rg.TraceError, match="compiled output differs"):
        rg.optimize(model, 1.0, example_inputs=(x,), compiler=True)
    with pytest.warns(rg.CompilerFallbackWarning, match="other random numbers"), \
            pytest.raises(rg.TraceError, match="draws different random numbers"):
        rg.optimize(model, 1.0, example_inputs=(x,))


def test_third_party_model_code_trains_exactly_through_optimize_on_the_compiler_path():
    """timm's ViT: attention reads views of one qkv storage, shapes read in Python."""
    from models_zoo import third_party
    from models_zoo.conformance import call_of
    if not third_party.available("timm_vit_tiny"):
        pytest.skip("timm is not installed")
    torch._dynamo.reset()
    model, call = third_party.build("timm_vit_tiny")
    args, kwargs = call_of(call)
    reference = copy.deepcopy(model)
    optimized = rg.optimize(model, 0.8, example_inputs=args or None, example_kwargs=kwargs or None,
                            compiler=True)
    _step(reference, args, kwargs)
    _step(optimized, args, kwargs)
    assert optimized.recompute_plan.recomputed_nodes
    assert parameter_gradient_error(model, reference) < 1e-5 and _buffers_equal(model, reference)


def test_a_plan_made_on_meta_tensors_is_saved_and_reused_by_the_compiler_path(tmp_path):
    """``plan_for(..., compiler=True)`` plans the joint graph without the weights or the device; the
    real model's joint graph has the same structure, so the saved plan is reused, not solved again."""
    import warnings
    torch._dynamo.reset()
    plan = rg.plan_for(lambda: models_zoo.get_model("gpt2", "tiny"), 0.8, compiler=True)
    assert plan.recomputed_nodes
    path = tmp_path / "gpt2_tiny.plan.json"
    plan.save(str(path))
    torch.manual_seed(0)
    model, inputs = models_zoo.get_model("gpt2", "tiny")
    reference = copy.deepcopy(model)
    generator_state = torch.get_rng_state()
    with warnings.catch_warnings():
        warnings.simplefilter("error", rg.PlanMismatchWarning)
        optimized = rg.optimize(model, 0.8, example_inputs=inputs, plan=path)  # the default path: "auto"
    assert isinstance(optimized, rg.CompiledRecomputedModule)  # a plan of the joint graph chose the compiler
    assert torch.equal(torch.get_rng_state(), generator_state)  # the trial forward's dropouts drew nothing
    assert optimized.recompute_plan.description.startswith("reused saved plan")
    assert optimized.recompute_plan.schedule == plan.schedule
    # the loss is priced on meta by the liveness of its storages, as the allocator prices it on the
    # device (left unpriced on meta, a guess of one logits-sized tensor for three, the plan on meta
    # chose a schedule the device's graph then found 2 % over the budget)
    assert plan.graph.loss_bytes == optimized.recompute_plan.graph.loss_bytes > 0
    _step(reference, inputs)
    _step(optimized, inputs)
    assert parameter_gradient_error(model, reference) == 0.0
    torch._dynamo.reset()
    shorter = (inputs[0][:, : inputs[0].shape[1] // 2],)  # another sequence length: another structure
    with pytest.warns(rg.PlanMismatchWarning, match="saved plan not reused"):
        rg.optimize(model, 0.8, example_inputs=shorter, compiler=True, plan=path)


def _mlp() -> nn.Module:
    layers = [nn.Linear(32, 256), nn.GELU()] + [m for _ in range(3) for m in (nn.Linear(256, 256), nn.GELU())]
    return nn.Sequential(*layers, nn.Linear(256, 1))


def test_many_models_of_one_class_and_many_shapes_of_one_model_are_each_compiled_and_planned():
    """Dynamo keeps compiled code per code object and fails a ``fullgraph`` compile after 8 of them
    (``recompile_limit``): the ninth ``nn.Sequential`` optimized in one process raised
    ``FailOnRecompileLimitHit`` when each module compiled the model's own ``forward``. Each signature
    of each module now compiles a call of its own."""
    torch.manual_seed(0)
    x = torch.randn(512, 32)
    for _ in range(9):  # nine models of one class, each on the compiler path and exact
        model = _mlp()
        reference = copy.deepcopy(model)
        optimized = rg.optimize(model, 0.8, example_inputs=(x,))
        assert isinstance(optimized, rg.CompiledRecomputedModule) and len(optimized.lowerings) == 1
        assert optimized.recompute_plan.recomputed_nodes
        _step(reference, (x,))
        _step(optimized, (x,))
        assert parameter_gradient_error(model, reference) == 0.0
    lazy = rg.optimize(model, 0.8)  # one model, nine batch sizes: nine signatures, each planned once
    for rows in range(504, 513):
        _step(reference, (x[:rows],))
        _step(lazy, (x[:rows],))
        assert parameter_gradient_error(model, reference) == 0.0
    _step(lazy, (x[:510],))  # a signature seen before is not planned again
    assert len(lazy.lowerings) == 9 and isinstance(lazy, rg.CompiledRecomputedModule)


@pytest.mark.parametrize("compiler", [True, False])
def test_planning_runs_with_full_collections_deferred_and_hands_the_collector_back(compiler, monkeypatch):
    """Both paths capture, price and plan with the older objects frozen out of the collector and full
    collections held back (``collector.full_collections_deferred``): ``make_plan`` runs before the pool,
    so what it sees is the planning call's setting, not the pool's own."""
    import gc
    from recompute_graph import planner
    from recompute_graph.collector import DEFERRED_FULL_COLLECTION_THRESHOLD
    torch._dynamo.reset()
    thresholds, seen, make_plan = gc.get_threshold(), [], planner.make_plan

    def watched(*args, **kwargs):
        seen.append((gc.get_freeze_count(), gc.get_threshold()[2]))
        return make_plan(*args, **kwargs)
    # both paths plan through planner.make_plan_for_call, which calls the planner's make_plan
    monkeypatch.setattr(planner, "make_plan", watched)
    model, inputs = models_zoo.get_model("mlp", "tiny")
    rg.optimize(model, 0.9, example_inputs=inputs, compiler=compiler)
    assert seen and seen[0][0] > 0 and seen[0][1] == DEFERRED_FULL_COLLECTION_THRESHOLD
    assert gc.get_freeze_count() == 0 and gc.get_threshold() == thresholds


def test_torch_compiles_planning_and_a_recompilations_run_with_full_collections_deferred(monkeypatch):
    """``torch.compile(model, backend=rg.backend(...))`` plans inside the user's step, and again when a new
    input shape recompiles: each planning sees the collector deferred, and hands it back after."""
    import gc
    from recompute_graph import planner
    from recompute_graph.collector import DEFERRED_FULL_COLLECTION_THRESHOLD
    torch._dynamo.reset()
    thresholds, seen, make_plan = gc.get_threshold(), [], planner.make_plan

    def watched(*args, **kwargs):
        seen.append((gc.get_freeze_count(), gc.get_threshold()[2]))
        return make_plan(*args, **kwargs)
    monkeypatch.setattr(planner, "make_plan", watched)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))
    compiled = torch.compile(model, backend=rg.backend(0.9, on_infeasible="floor"), dynamic=False)
    planned = []
    for batch in (4, 6):  # the second shape recompiles
        default_loss(compiled(torch.randn(batch, 8))).backward()
        assert gc.get_freeze_count() == 0 and gc.get_threshold() == thresholds
        planned.append(len(seen))
    assert 0 < planned[0] < planned[1]
    assert all(frozen > 0 and threshold == DEFERRED_FULL_COLLECTION_THRESHOLD for frozen, threshold in seen)


def test_dynamos_failure_to_log_its_metrics_is_dropped_only_while_compiling_with_ignored_logging():
    """Torch 2.11's Dynamo cannot write a config whose ``ignore_logging_functions`` holds functions as
    JSON, and logged that with a traceback at every compilation of a planned module (on the H200).
    Only that record, only inside the block; the ignored calls are Dynamo's only inside it too."""
    from recompute_graph.compiled_module import ignored_logging_calls, logging_calls_ignored
    records = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())
    log = logging.getLogger("torch._dynamo.metrics_context")
    handler, level = Keep(), log.level
    log.addHandler(handler)
    log.setLevel(logging.ERROR)
    try:
        with logging_calls_ignored(ignored_logging_calls()):
            assert logging.Logger.warning in torch._dynamo.config.ignore_logging_functions
            log.error("Unexpected exception logging compilation metrics")
            log.error("Unexpected exception logging runtime metrics")
            log.error("another error")
        log.error("Unexpected exception logging compilation metrics")
    finally:
        log.removeHandler(handler)
        log.setLevel(level)
    assert records == ["another error", "Unexpected exception logging compilation metrics"]
    assert logging.Logger.warning not in torch._dynamo.config.ignore_logging_functions


class _OwnLossOrNot(nn.Module):
    """CLIP's pattern (a ``loss`` entry computed on targets the model makes, ``arange``), or a plain
    tuple whose first item is a cross-entropy on the labels (``return_dict=False``), which the default
    loss does not take for the model's own: it squares both items."""

    def __init__(self, structure: str) -> None:
        super().__init__()
        self.structure, self.a, self.b = structure, nn.Embedding(16, 64), nn.Linear(64, 16)

    def forward(self, ids, labels):
        logits = self.b(torch.tanh(self.a(ids)))
        if self.structure == "dict":
            return {"loss": nn.functional.cross_entropy(logits, torch.arange(len(ids))), "logits": logits}
        return nn.functional.cross_entropy(logits, labels), logits


@pytest.mark.parametrize("structure", ["dict", "tuple"])
def test_optimize_prices_the_default_loss_as_the_models_own_forward_says(structure):
    """The compiled graph's flat outputs do not say whether the model returns its own loss; the graph
    alone guesses from a cross-entropy on integer inputs, which is wrong both ways here. ``optimize()``
    runs the model's own forward first and prices the loss training computes: nothing for a ``loss``
    entry, the squares of both outputs for a tuple. The prediction then meets the allocator."""
    torch.manual_seed(0)
    model, ids, labels = _OwnLossOrNot(structure), torch.arange(16), torch.randint(0, 16, (16,))
    optimized = rg.optimize(model, 1.0, example_inputs=(ids, labels), compiler=True)
    graph = optimized.recompute_plan.graph
    assert (graph.loss_bytes == 0) == (structure == "dict"), graph.loss_bytes
    measured = allocator_peak_memory(lambda: default_loss(optimized(ids, labels)).backward())
    assert 0.97 <= optimized.recompute_plan.predicted_step_peak_bytes / measured <= 1.03


def _deep_mlp() -> nn.Module:
    return nn.Sequential(*[m for _ in range(6) for m in (nn.Linear(64, 64), nn.GELU(), nn.LayerNorm(64))],
                         nn.Linear(64, 10))


@pytest.mark.parametrize("compiler", [True, False])
def test_a_smaller_last_batch_under_a_fraction_is_planned_within_the_first_calls_bytes(compiler):
    """Half of a 16-row batch's store-all step is below any plan of it (its parameters and gradients
    outweigh its activations): the epoch's last batch raised InfeasibleBudgetError in the middle of
    training. A fraction is of each call's own step, or, where that is infeasible, the bytes an earlier
    call was planned at (``planner.make_plan_for_call``). A byte budget a larger call cannot meet raises,
    naming that call's shapes, and the calls planned before run on."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = _deep_mlp()
    reference = copy.deepcopy(model)
    x = torch.randn(512, 64)
    optimized = rg.optimize(model, 0.5, example_inputs=(x,), compiler=compiler)
    first = optimized.recompute_plan
    with pytest.raises(rg.InfeasibleBudgetError):  # the 16-row step alone, at half its store-all step
        rg.optimize(copy.deepcopy(model), 0.5, example_inputs=(x[:16],), compiler=compiler)
    for rows in (512, 16):
        _step(reference, (x[:rows],))
        _step(optimized, (x[:rows],))
        assert parameter_gradient_error(model, reference) == 0.0
    small = optimized.recompute_plan
    assert small is not first and small.budget_bytes == first.budget_bytes
    measured = allocator_peak_memory(lambda: _step(optimized, (x[:16],)))
    assert measured <= small.budget_bytes and measured * 0.9 <= small.predicted_step_peak_bytes <= measured * 1.1

    bytes_budget = rg.optimize(model, first.budget_bytes, example_inputs=(x,), compiler=compiler)
    with pytest.raises(rg.InfeasibleBudgetError, match=r"unlike those planned before .*\(8192, 64\).*A byte budget"):
        _step(bytes_budget, (torch.randn(8192, 64),))
    assert all(p.grad is None for p in model.parameters())  # nothing of that step ran
    _step(reference, (x,))
    _step(bytes_budget, (x,))
    assert parameter_gradient_error(model, reference) == 0.0


@pytest.mark.parametrize("compiler", [True, False])
def test_many_call_signatures_get_one_warning_that_says_to_pad(compiler, monkeypatch):
    """Batches padded to their own longest sequence make a new call signature, and so a new plan, per
    length: the module says so once, at the ``MANY_SIGNATURES``-th signature (3 here), with the
    planning time spent and how to pad; a signature seen before is not planned again."""
    from recompute_graph import optimized_module
    monkeypatch.setattr(optimized_module, "MANY_SIGNATURES", 3)
    torch._dynamo.reset()
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4))
    optimized = rg.optimize(model, 1.0, compiler=compiler)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for rows in (8, 9, 8, 10, 11, 10):
            _step(optimized, (torch.randn(rows, 16),))
    shown = [w for w in caught if issubclass(w.category, rg.ManyCallSignaturesWarning)]
    assert len(shown) == 1, [str(w.message) for w in caught]
    assert re.search(r"3 call signatures planned so far, \d+ s of planning .*\(10, 16\).*pad_to_multiple_of",
                     str(shown[0].message))
    assert len(optimized._planning_seconds) == 4


class _Upsampling(nn.Module):
    """A segmentation head: features at half resolution, interpolated back up (SegFormer, LRASPP)."""

    def __init__(self, mode: str):
        super().__init__()
        self.mode = mode
        self.c1, self.c2 = nn.Conv2d(3, 16, 3, padding=1), nn.Conv2d(16, 32, 3, stride=2, padding=1)
        self.head = nn.Conv2d(32, 8, 1)

    def forward(self, x):
        h = torch.relu(self.c2(torch.relu(self.c1(x))))
        return nn.functional.interpolate(self.head(h), scale_factor=2, mode=self.mode, align_corners=False)


@pytest.mark.parametrize("mode", ["bilinear", "bicubic"])
def test_interpolation_is_captured_as_its_kernel_and_a_store_all_step_holds_what_eager_holds(mode):
    """AOTAutograd traced interpolation through PyTorch's Python decomposition (four gathers, and four
    input-sized buffers in the backward), which the compiler path's graphs ran as such: a store-all step
    held 1.11 of eager PyTorch's peak here, SegFormer's 1.41. The op is now kept whole
    (``native_kernels``) and PyTorch's decompositions are left as they were."""
    from recompute_graph.joint_capture import capture_joint
    torch.manual_seed(0)
    model, x = _Upsampling(mode), torch.randn(8, 3, 64, 64)
    joint = capture_joint(model, (x,))
    targets = {str(n.target) for n in joint.graph_module.graph.nodes if n.op == "call_function"}
    assert f"aten.upsample_{mode}2d.default" in targets and "aten._unsafe_index.Tensor" not in targets
    assert torch.ops.aten.upsample_bilinear2d.vec.py_kernels  # put back
    eager = allocator_peak_memory(lambda: default_loss(model(x)).backward())
    model.zero_grad(set_to_none=True)
    report = rg.verify(model, 1.0, example_inputs=(x,), compiler=True)
    assert report.gradient_error < 1e-5
    assert report.measured_peak_bytes <= 1.01 * eager
    assert abs(report.prediction_error) <= 0.02


class _NormThenPooled(nn.Module):
    """A layer norm whose gradient arrives transposed (Swin's last norm, pooled over its tokens)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj, self.norm, self.head = nn.Linear(16, 64), nn.LayerNorm(64), nn.Linear(64, 10)

    def forward(self, x):
        h = self.norm(self.proj(x))
        return self.head(nn.functional.adaptive_avg_pool1d(h.transpose(1, 2), 1).flatten(1))


def test_a_layer_norms_gradient_is_traced_contiguous_as_its_kernel_makes_it():
    """``native_layer_norm_backward``'s Meta kernel laid the input's gradient out like the transposed
    gradient it took, where its kernels make it contiguous: the linear's backward then reshaped it
    with a ``clone``, a copy eager PyTorch does not make (``hf_swin``: 1.014 of eager's peak in a
    store-all step, now 1.000). ``native_kernels`` lays it out as the kernel does while AOTAutograd
    traces, and puts the decomposition back."""
    from torch._decomp import decomposition_table
    kernel = decomposition_table[torch.ops.aten.native_layer_norm_backward.default]
    torch.manual_seed(0)
    model, x = _NormThenPooled(), torch.randn(8, 128, 16)
    optimized = rg.optimize(model, 1.0, example_inputs=(x,), compiler=True)
    optimized(x)
    graph = optimized.lowerings[-1].planned_backward_graph.graph
    norm = next(n for n in graph.nodes if "native_layer_norm_backward" in str(n.target))
    gradient = next(u for u in norm.users if u.args[1] == 0)
    assert not any("clone" in str(u.target) for u in gradient.users), [str(u.target) for u in gradient.users]
    assert decomposition_table[torch.ops.aten.native_layer_norm_backward.default] is kernel  # put back
    report = rg.verify(model, 1.0, example_inputs=(x,), compiler=True)
    assert report.gradient_error < 1e-5 and abs(report.prediction_error) <= 0.02


def _store_all_holds_what_eager_holds(model: nn.Module, x: torch.Tensor) -> None:
    """A store-all step of ``model`` on the compiler path: exact, within 1 % of eager PyTorch's peak by
    the allocator, and predicted within 2 %."""
    eager = allocator_peak_memory(lambda: default_loss(model(x)).backward())
    model.zero_grad(set_to_none=True)
    report = rg.verify(model, 1.0, example_inputs=(x,), compiler=True, loss_fn=default_loss)
    assert report.gradient_error < 1e-5
    assert report.measured_peak_bytes <= 1.01 * eager
    assert abs(report.prediction_error) <= 0.02

class _RootMeanSquareNormed(nn.Module):
    """Linear layers between RMS norms written as Llama writes them (``x.pow(2).mean(-1)``): the
    backward of ``pow(x, 2)`` makes ``2 * x``, a value no gradient reaches."""

    def __init__(self, width: int = 64, depth: int = 4) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.scales = nn.ParameterList(nn.Parameter(torch.ones(width)) for _ in range(depth))

    def forward(self, x):
        for layer, scale in zip(self.layers, self.scales):
            x = x + layer(scale * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))
        return x


def test_a_backward_value_no_gradient_reaches_is_made_in_the_backward_not_saved_by_the_forward():
    """The joint graph's nodes that read no gradient were all taken as forward values, so a store-all
    plan saved ``2 * x`` of each norm's ``pow(x, 2)`` beside ``x``: tiny Llama's step held 1.21 of
    eager's peak. A node the forward's outputs do not need, reading only what the backward saves
    anyway, is the backward's, as in PyTorch's own partitioners (``classify_nodes``)."""
    torch.manual_seed(0)
    model, x = _RootMeanSquareNormed(), torch.randn(16, 32, 64)
    _store_all_holds_what_eager_holds(model, x)
    lowered = rg.optimize(model, 1.0, example_inputs=(x,), compiler=True)
    lowered(x)
    lowering = lowered.lowerings[0]
    saved_targets = {str(n.target) for n in lowering.forward_graph.graph.nodes if n.name in lowering.saved}
    assert "aten.rsqrt.default" in saved_targets
    assert "aten.mul.Scalar" not in saved_targets



class _AttentionWithoutDropout(nn.Module):
    """Attention blocks with ``nn.Dropout(0.0)`` after the softmax, as timm's and torchvision's Swin have it."""

    def __init__(self, depth: int = 4) -> None:
        super().__init__()
        self.qkv = nn.ModuleList(nn.Linear(32, 96) for _ in range(depth))
        self.out = nn.ModuleList(nn.Linear(32, 32) for _ in range(depth))
        self.drop = nn.Dropout(0.0)

    def forward(self, x):
        for qkv, out in zip(self.qkv, self.out):
            q, k, v = qkv(x).chunk(3, -1)
            x = x + out(self.drop((q @ k.transpose(-2, -1)).softmax(-1)) @ v)
        return x


def test_a_dropout_of_nothing_is_its_input_as_in_eager_not_a_second_saved_copy():
    """Eager ``nn.Dropout(0.0)`` returns its input itself; AOTAutograd traces a ``clone``, and a store-all
    plan saved the softmax for its backward and the copy for the ``bmm``'s (1.187 of eager's peak here;
    ``timm_swin_tiny`` 1.019, now 1.000). The clone is read as its input
    (``joint_coefficients.drop_backward_copies``)."""
    torch.manual_seed(0)
    _store_all_holds_what_eager_holds(_AttentionWithoutDropout(), torch.randn(4, 64, 32))


class _InplaceActivationOnASlice(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(16, 64), nn.Linear(64, 16)

    def forward(self, x):
        h = self.a(x)
        nn.functional.silu(h[:, :8], inplace=True)
        return self.b(h)


def test_the_copy_of_a_slice_an_inplace_activation_keeps_for_its_backward_is_saved_not_its_base():
    """The ``clone`` a functionalized ``silu_`` keeps of its input is dropped when the backward can read
    the input itself (``joint_coefficients.drop_backward_copies``), but not when the input is a slice: the
    backward would then save the slice's whole base (64 columns for 8)."""
    torch.manual_seed(0)
    model, x = _InplaceActivationOnASlice(), torch.randn(32, 16)
    optimized = rg.optimize(model, 1.0, example_inputs=(x,), compiler=True)
    optimized(x)
    lowering = optimized.lowerings[0]
    assert "clone" in lowering.saved and "addmm" not in lowering.saved
    report = rg.verify(model, 1.0, example_inputs=(x,), compiler=True)
    assert report.gradient_error < 1e-6 and abs(report.prediction_error) <= 0.05


class _NormalizedProjections(nn.Module):
    """XCiT's cross-covariance attention normalizes its queries and keys (``F.normalize``)."""

    def __init__(self, width: int = 64, depth: int = 3) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))

    def forward(self, x):
        for layer in self.layers:
            x = x + nn.functional.normalize(layer(x), dim=-1)
        return x


def test_coefficients_reading_one_value_move_to_the_backward_together():
    """The backward of ``F.normalize`` makes two coefficients of the input's size, in two regions that
    both read the input, which nothing else in the backward reads. Judged alone, neither paid for
    saving the input, so store-all saved both coefficients (XCiT: 1.047 of eager's peak); judged
    together they do, and the backward makes them."""
    torch.manual_seed(0)
    model, x = _NormalizedProjections(), torch.randn(16, 32, 64)
    _store_all_holds_what_eager_holds(model, x)
