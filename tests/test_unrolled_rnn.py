"""``optimize(..., unroll_rnns=True)``: an ``nn.LSTM`` (``nn.GRU``, ``nn.RNN``) run step by step, so that plans
split its time steps."""
import copy
import pickle

import pytest
import torch
from torch import nn

import recompute_graph as rg
from recompute_graph.unrolled_rnn import STEP_BY_STEP, StepByStepLSTM, rnns_unrolled, unroll_rnns
from recompute_graph.verification import parameter_gradient_error, verify

CONFIGURATIONS = [dict(), dict(batch_first=True), dict(num_layers=3, dropout=0.3), dict(bias=False),
                  dict(bidirectional=True, num_layers=2, batch_first=True)]


@pytest.mark.parametrize("kind", [nn.LSTM, nn.GRU, nn.RNN], ids=lambda k: k.__name__)
@pytest.mark.parametrize("config", CONFIGURATIONS, ids=lambda c: ",".join(c) or "default")
@pytest.mark.parametrize("initial_state", [False, True])
def test_the_step_loop_computes_what_the_fused_module_does(kind, config, initial_state):
    """Outputs, final states and gradients equal the fused op's to float32 rounding; dropout between
    layers draws the same masks (the relative error would be of order 1 otherwise)."""
    torch.manual_seed(0)
    fused = kind(16, 32, **config)
    stepped = copy.deepcopy(fused)
    assert unroll_rnns(stepped) == [stepped] and type(stepped) is STEP_BY_STEP[kind]
    x = torch.randn(4, 20, 16) if config.get("batch_first") else torch.randn(20, 4, 16)
    states = 2 * fused.num_layers if fused.bidirectional else fused.num_layers
    hx = torch.randn(states, 4, 32) if initial_state else None
    hx = (hx, torch.randn(states, 4, 32)) if initial_state and kind is nn.LSTM else hx
    results = []
    for module in (fused, stepped):
        torch.manual_seed(1)
        out, finals = module(x, hx)
        finals = finals if kind is nn.LSTM else (finals,)
        (out.square().sum() + sum(f.sum() for f in finals)).backward()
        results.append((out, *finals))
    for a, b in zip(*results):
        assert a.shape == b.shape and torch.allclose(a, b, atol=1e-6, rtol=0)
    assert parameter_gradient_error(stepped, fused) < 1e-5
    assert stepped.state_dict().keys() == fused.state_dict().keys()


def test_unbatched_and_packed_inputs():
    torch.manual_seed(0)
    fused = nn.LSTM(8, 16)
    stepped = copy.deepcopy(fused)
    unroll_rnns(stepped)
    x = torch.randn(12, 8)
    assert torch.allclose(fused(x)[0], stepped(x)[0], atol=1e-6)
    packed = nn.utils.rnn.pack_padded_sequence(torch.randn(12, 3, 8), [12, 9, 4])
    assert torch.equal(fused(packed)[0].data, stepped(packed)[0].data)  # the fused op itself
    # the fused op's weight list (weak references) follows pickling and dtype casts
    stepped = pickle.loads(pickle.dumps(stepped)).double()
    assert type(stepped) is StepByStepLSTM and repr(stepped) == "StepByStepLSTM(8, 16)"
    assert stepped(packed.double())[0].data.dtype == torch.float64


class Classifier(nn.Module):
    def __init__(self, kind: type = nn.LSTM) -> None:
        super().__init__()
        self.rnn = kind(16, 64, num_layers=2, batch_first=True)
        self.head = nn.Linear(64, 4)

    def forward(self, x):
        h, _ = self.rnn(x)
        return self.head(h[:, -1])


@pytest.mark.parametrize("kind,compiler", [(nn.LSTM, "auto"), (nn.GRU, False)], ids=["lstm-compiler", "gru-executor"])
def test_a_recurrent_model_plans_below_what_the_fused_op_allows_and_trains_like_it(kind, compiler):
    """The fused ``nn.LSTM`` is one node that keeps all its steps' gates: the smallest plan was 0.98 of
    store-all, and the error now says to unroll. Unrolled, a plan at 0.6 recomputes steps, the
    allocator's peak stays within the budget with the prediction within 10 %, and the gradients are
    the fused model's to float rounding. The compiler path captures the step loop (Dynamo refuses
    ``nn.LSTM`` itself)."""
    torch.manual_seed(0)
    model = Classifier(kind)
    reference = copy.deepcopy(model)
    x = torch.randn(16, 16, 16)
    with pytest.raises(rg.InfeasibleBudgetError, match=rf"holds an nn.{kind.__name__}, .* unroll_rnns=True"):
        rg.optimize(model, 0.6, example_inputs=(x,), compiler=compiler, timing="flops")
    assert type(model.rnn) is kind
    optimized = rg.optimize(model, 0.6, example_inputs=(x,), compiler=compiler, unroll_rnns=True)
    assert type(model.rnn) is STEP_BY_STEP[kind]
    assert isinstance(optimized, rg.RecomputedModule) == (compiler is False)
    assert len(optimized.recompute_plan.recomputed_nodes) > 50
    report = verify(model, 0.6, example_inputs=(x,), optimized=optimized)
    assert report.ok and abs(report.prediction_error) <= 0.10, report
    reference(x).square().mean().backward()
    optimized(x).square().mean().backward()
    assert parameter_gradient_error(model, reference) < 1e-5


def test_a_failed_plan_leaves_the_lstms_fused():
    model = Classifier()
    with pytest.raises(rg.InfeasibleBudgetError):
        rg.optimize(model, 0.01, example_inputs=(torch.randn(4, 8, 16),), compiler=False, unroll_rnns=True,
                    timing="flops")
    assert type(model.rnn) is nn.LSTM
    with pytest.raises(RuntimeError), rnns_unrolled(model):
        assert type(model.rnn) is StepByStepLSTM
        raise RuntimeError
    assert type(model.rnn) is nn.LSTM


def test_unroll_rnns_before_torch_compile_with_the_budget_backend():
    """``rg.unroll_rnns(model)`` then ``torch.compile(model, backend=rg.backend(f))``: Dynamo captures the
    step loop (the fused module it refuses), and the backend plans its steps."""
    torch.manual_seed(0)
    model = Classifier(nn.GRU)
    reference = copy.deepcopy(model)
    x = torch.randn(16, 20, 16)
    assert rg.unroll_rnns(model) == [model.rnn]
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=rg.backend(0.5), dynamic=False)
    compiled(x).square().mean().backward()
    reference(x).square().mean().backward()
    assert parameter_gradient_error(model, reference) < 1e-5
    assert rg.last_lowering().plan.recomputed_nodes


def test_a_plan_made_on_meta_with_unrolled_rnns_is_reused_by_optimize(tmp_path):
    """``plan_for(..., unroll_rnns=True)`` plans the step loop without weights; ``optimize`` with the
    same flag finds the same structure and reuses the plan as is."""
    import warnings

    def build():
        torch.manual_seed(0)
        return Classifier(nn.GRU), (torch.randn(16, 16, 16),)
    plan = rg.plan_for(build, 0.6, unroll_rnns=True)
    assert plan.recomputed_nodes
    plan.save(tmp_path / "plan.json")
    model, inputs = build()
    with warnings.catch_warnings():
        warnings.simplefilter("error", rg.PlanMismatchWarning)
        optimized = rg.optimize(model, 0.6, example_inputs=inputs, compiler=False, unroll_rnns=True,
                                plan=tmp_path / "plan.json")
    assert optimized.recompute_plan.recomputed_nodes == plan.recomputed_nodes


def classifier(kind: str = "LSTM", steps: int = 16) -> tuple[nn.Module, tuple[torch.Tensor]]:
    """A factory for the command line (``test_unrolled_rnn:classifier``)."""
    torch.manual_seed(0)
    return Classifier(getattr(nn, kind)), (torch.randn(16, int(steps), 16),)


def test_the_command_line_plans_and_checks_a_recurrent_model_step_by_step(tmp_path, capsys):
    """``--unroll-rnns`` on ``plan`` and ``check``: without it the fused LSTM cannot go under 0.98."""
    import json
    from recompute_graph.cli import main

    def run(*argv):
        code = main([*argv, "--json", "-q"])
        return code, json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    plan = ("plan", "test_unrolled_rnn:classifier", "--budget", "0.6", "--timing", "flops",
            "-o", str(tmp_path / "p.json"))
    code, fused = run(*plan)
    assert code == 1 and fused["status"] == "INFEASIBLE"
    code, unrolled = run(*plan, "--unroll-rnns")
    assert code == 0 and unrolled["feasible"] and unrolled["recomputed_nodes"] > 50
    code, checked = run("check", "test_unrolled_rnn:classifier", "--size", "kind=GRU", "--budget", "0.6",
                        "--timing", "flops", "--unroll-rnns")
    assert code == 0 and checked["ok"] and checked["gradient_error"] < 1e-5
