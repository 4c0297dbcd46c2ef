"""``recompute-graph bench`` and the peer systems it measures (peers.py), on tiny models."""
from __future__ import annotations

import json

import pytest
import torch

import models_zoo
from recompute_graph import peers
from recompute_graph.cli import main
from recompute_graph.measure import default_loss, make_training_step, peak_memory, profiler_peak_memory


def gradients(model, inputs):
    torch.manual_seed(0)
    model.zero_grad(set_to_none=True)
    default_loss(model(*inputs)).backward()
    return [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("name, expected_blocks", [("resnet50", 16), ("gpt2", 2), ("unet", 5)])
def test_blocks_are_found_and_checkpointing_them_keeps_gradients(name, expected_blocks):
    model, inputs = models_zoo.get_model(name, "tiny")
    assert len(peers.find_blocks(model)) == expected_blocks
    checkpointed = peers.checkpoint_blocks(model)
    model.eval(), checkpointed.eval()  # no BatchNorm statistics or dropout difference between the two runs
    for a, b in zip(gradients(model, inputs), gradients(checkpointed, inputs)):
        torch.testing.assert_close(a, b)


def test_checkpoint_sequential_peer_needs_a_sequential_and_says_so():
    with pytest.raises(ValueError, match="nn.Sequential"):
        peers.checkpoint_sequentials(torch.nn.Linear(2, 2))
    unet, unet_inputs = models_zoo.get_model("unet", "tiny")
    wrapped = peers.checkpoint_sequentials(unet)
    assert peak_memory(make_training_step(wrapped, unet_inputs)) < peak_memory(make_training_step(unet, unet_inputs))


@pytest.mark.parametrize("name, tolerance", [("gpt2", 0.01), ("unet", 0.10)])
def test_the_profiler_meter_agrees_with_the_storage_meter_on_an_eager_step(name, tolerance):
    # the profiler sees the allocator, so it also counts kernel temporaries (convolution workspaces)
    # that no tensor storage holds: equal on GPT-2, up to 10 % more on the convolutional U-Net
    model, inputs = models_zoo.get_model(name, "tiny")
    step = make_training_step(model, inputs)
    step()
    tracked = peak_memory(step)
    model.zero_grad(set_to_none=True)
    profiled = profiler_peak_memory(step)
    assert tracked <= profiled * 1.001 and profiled - tracked <= tolerance * tracked


def test_bench_measures_our_plans_and_the_peers_against_store_all(capsys):
    code = main(["bench", "unet", "--preset", "tiny", "--timing", "flops", "--fractions", "0.6",
                 "--solvers", "dp_exact", "--peers", "--repeats", "1", "--device", "cpu", "--json", "-q"])
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert code == 0
    rows = {row["label"]: row for row in result["rows"]}
    assert rows["original (store-all autograd)"]["peak_ratio"] == 1.0
    ours = rows["dp_exact @ 60%"]
    assert ours["peak_ratio"] < 0.8 and ours["predicted_peak_bytes"] > 0
    assert rows["torch.utils.checkpoint per block"]["peak_ratio"] < 1.0
    assert rows["torch.compile budget 60%"]["peak_bytes"] is not None
    assert "Rockmate 2" in rows
    assert {v["peer"] for v in result["verdicts"]} == {label for label in ("torch.utils.checkpoint per block",
                                                                         "checkpoint_sequential", "torch.compile budget 60%")
                                                       if rows[label]["peak_bytes"] is not None}
    original = rows["original (store-all autograd)"]["seconds"]
    for row in result["rows"]:  # every row timed in the same rounds: its ratio is to the original's median there
        if row["peak_bytes"] is not None:
            assert row["original_seconds"] == original > 0
            assert row["time_ratio"] == row["seconds"] / original


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error where no GPU is seen")
def test_bench_on_a_device_torch_cannot_see_says_what_to_do(capsys):
    for device, says in (("cuda", "sees no CUDA device"), ("mps", "bench measures on cpu or cuda"),
                         ("gpu0", "give cpu or cuda")):
        code = main(["bench", "mlp", "--preset", "tiny", "--device", device, "--solvers", "-q"])
        assert code == 2 and says in capsys.readouterr().err


def test_bench_measures_our_compiler_path_with_its_prediction(capsys, monkeypatch):
    from recompute_graph import compile_backend
    planned, plan_and_lower = [], compile_backend.plan_and_lower

    def counted(joint, budget, **kwargs):
        planned.append(budget)
        return plan_and_lower(joint, budget, **kwargs)
    monkeypatch.setattr(compile_backend, "plan_and_lower", counted)
    code = main(["bench", "unet", "--preset", "tiny", "--timing", "flops", "--fractions", "0.9", "0.5",
                 "--solvers", "store_all", "--compiled", "--repeats", "2", "--json", "-q"])
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert code == 0
    rows = {row["label"]: row for row in result["rows"]}
    for label in ("ours compiled @ 90%", "ours compiled @ 50%"):
        row = rows[label]
        assert row["peak_ratio"] < 0.9
        assert row["peak_bytes"] * 0.95 <= row["predicted_peak_bytes"] <= row["peak_bytes"] * 1.15
    assert rows["ours compiled @ 50%"]["peak_bytes"] < rows["ours compiled @ 90%"]["peak_bytes"]
    # each compiled row planned once: the timing rounds ran the code compiled for it, none compiled again
    assert planned == [0.9, 0.5]


def test_bench_with_graph_compiler_inductor_compiles_our_graphs_and_the_compile_peers_with_inductor(
        capsys, monkeypatch):
    """``--graph-compiler inductor`` (the GPU's like-for-like table): the ``--compiled`` rows' generated
    graphs go to inductor (``inductor_lowering.inductor_graph_compiler``, the forward and the backward,
    each once for the step and again to measure what inductor's code holds), and torch.compile's peer
    uses inductor as its backend, not ``aot_eager_decomp_partition``."""
    from recompute_graph import inductor_lowering
    compiled, compile_graph = [], inductor_lowering.inductor_graph_compiler

    def counted(gm, example_inputs):
        compiled.append(any(n.name.startswith("tangents") for n in gm.graph.nodes if n.op == "placeholder"))
        return compile_graph(gm, example_inputs)
    monkeypatch.setattr(inductor_lowering, "inductor_graph_compiler", counted)
    backends = []
    monkeypatch.setattr(peers, "compile_with_budget", lambda model, graph_compiler=None: (
        backends.append(graph_compiler), torch.compile(model, backend="eager"))[1])
    code = main(["bench", "mlp", "--preset", "tiny", "--timing", "flops", "--fractions", "0.5", "--solvers",
                 "--compiled", "--peers", "--graph-compiler", "inductor", "--repeats", "1", "--json", "-q"])
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert code == 0
    rows = {row["label"]: row for row in result["rows"]}
    assert rows["ours compiled @ 50%"]["peak_bytes"] and False in compiled and True in compiled
    assert backends == ["inductor"] and rows["torch.compile budget 50%"]["note"] == "inductor"


def test_the_compile_peer_takes_only_the_graph_compilers_it_knows():
    with pytest.raises(ValueError, match="use None .* or 'inductor'"):
        peers.compile_with_budget(torch.nn.Linear(2, 2), "tvm")


def test_each_peer_is_judged_by_our_lowest_peak_within_its_step_time():
    """The issue's target (a peak 25 % below the peer's at a step time no greater) read off the rows."""
    from recompute_graph.commands.bench import peer_verdicts
    rows = [{"label": "original", "kind": "original", "peak_bytes": 700, "seconds": 1.0},
            {"label": "ours @ 36%", "kind": "ours", "peak_bytes": 250, "seconds": 1.40},
            {"label": "ours @ 38%", "kind": "ours", "peak_bytes": 266, "seconds": 1.28},
            {"label": "ours @ 50%", "kind": "ours", "peak_bytes": 340, "seconds": 1.10},
            {"label": "ours @ 20%", "kind": "ours", "peak_bytes": None, "seconds": None},
            {"label": "per block", "kind": "peer", "peak_bytes": 347, "seconds": 1.33},
            {"label": "sequential", "kind": "peer", "peak_bytes": 485, "seconds": 1.00},
            {"label": "Rockmate 2", "peak_bytes": None, "seconds": None}]
    per_block, sequential = peer_verdicts(rows)
    assert per_block["ours"] == "ours @ 38%" and per_block["below"] == pytest.approx(1 - 266 / 347)
    assert per_block["time_of_peer"] == pytest.approx(1.28 / 1.33)
    assert sequential["peer"] == "sequential" and sequential["ours"] is None and sequential["below"] is None
