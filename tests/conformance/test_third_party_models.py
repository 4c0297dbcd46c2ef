"""Conformance on model code nobody here wrote: torchvision, timm, transformers and diffusers models at small
sizes.

The CI subset (``third_party.FAST_SUBSET``, chosen for the patterns that broke before: ViT shape reads,
EfficientNet's in-place dropout on a view, T5's writes through views) runs under ``auto`` at 0.8 and 0.5
of the activation memory; two models also run under every solver that applies, at 0.5. Every row checks the
gradients against the original (relative to the model's largest gradient, 1e-5), BatchNorm buffers
updated once, the allocator-measured peak within the budget and the prediction within 10 %. The whole
sweep (every model, every solver) is ``python scripts/conformance.py``, which writes docs/conformance.md.
"""
from __future__ import annotations

import pytest

from models_zoo import third_party
from models_zoo.conformance import check_model

EVERY_SOLVER = ("auto", "store_all", "chen_sqrt", "chen_greedy", "dp_exact", "dp_approx", "chain_dp", "revolve",
                "ilp")
ALL_SOLVERS_ON = ("hf_gpt2", "tv_vit")


def describe(row) -> str:
    return (f"{row.model} at {row.fraction} under {row.solver} ({row.chosen}): error {row.error!r}, gradient "
            f"error {row.gradient_error:.2e}, buffers {row.buffer_mismatches}, missing {row.missing_gradients}, "
            f"measured {row.measured_peak_bytes} of budget {row.budget_bytes}, predicted {row.predicted_peak_bytes}")


@pytest.mark.parametrize("name", third_party.FAST_SUBSET)
def test_third_party_models_train_exactly_within_their_budgets(name):
    if not third_party.available(name):
        pytest.skip(f"{third_party.CONFORMANCE_MODELS[name][0]} is not installed")
    rows = check_model(name, solvers=("auto",))
    assert len(rows) == 2
    if name in ALL_SOLVERS_ON:  # every other solver at half the activation memory, where all of them recompute
        rows += check_model(name, fractions=(0.5,), solvers=EVERY_SOLVER[1:])
        assert len(rows) == 2 + len(EVERY_SOLVER) - 1
    ran = [row for row in rows if not row.skipped]
    assert ran, "no solver ran"
    for row in rows:
        assert row.passed, describe(row)
    # the plans recompute something somewhere: the suite is not store-all in disguise
    assert any(row.chosen != "store_all" for row in ran)


#: through ``optimize()``'s default path (``compiler="auto"``): EfficientNet's in-place dropout on a view,
#: ViT's shape reads, T5's writes through views, GPT-2's logging inside its loss
DEFAULT_PATH_MODELS = ("tv_efficientnet_b0", "tv_vit", "hf_t5", "hf_gpt2")


@pytest.mark.parametrize("name", DEFAULT_PATH_MODELS)
def test_third_party_models_train_exactly_on_optimizes_default_path(name):
    """Each model is captured whole and runs on the compiler path (no fallback to the executor), with
    the same checks as above: gradients, buffers, the allocator-measured peak within the budget and
    the prediction within 10 %."""
    if not third_party.available(name):
        pytest.skip(f"{third_party.CONFORMANCE_MODELS[name][0]} is not installed")
    (row,) = check_model(name, fractions=(0.8,), solvers=("auto",), compiler="auto")
    assert row.passed and not row.skipped, describe(row)
    assert row.path == "compiler", f"{name} fell back to the schedule executor"


def test_layerdrop_trains_exactly_with_its_encoder_as_one_node():
    """wav2vec2's LayerDrop decides in Python, from a random number, whether a layer runs: no single
    graph is the model's. It was refused (torch.fx drew ``torch.rand([])`` once while tracing); the draw
    is a node now, so the encoder that branches on it is one opaque node of the executor's graph, which
    draws at each step as eager PyTorch does."""
    if not third_party.available("hf_wav2vec2"):
        pytest.skip("transformers is not installed")
    import transformers

    import recompute_graph as rg
    model, call = third_party.build("hf_wav2vec2")
    layerdrop = transformers.Wav2Vec2Model(model.config.__class__(**{**model.config.to_dict(), "layerdrop": 0.5}))
    optimized = rg.optimize(layerdrop.train(), 0.95, example_kwargs=call, timing="flops")
    assert "encoder" in [node.name for node in optimized.recompute_plan.graph.nodes if node.opaque]
    for seed in (0, 1):  # (other layers dropped under each seed)
        report = rg.verify(layerdrop, 0.95, example_kwargs=call, seed=seed, optimized=optimized)
        assert report.gradient_error < 1e-6 and report.measured_peak_bytes <= report.budget_bytes, report


#: patterns of the models added later (``third_party.SECOND_SET``) that broke before their fixes: a
#: stochastic-depth mask drawn from a shape, recomputed at HF Swin's floor (lowering raised
#: ``StopIteration``, and the step fell back to the executor); BEiT's relative-position bias on the
#: attention scores (predicted 17 % over the allocator). DeepLabV3 (BatchNorm statistics 1 ulp off
#: under AOTAutograd's decompositions, tests/test_verify.py) runs in the sweep only, at 50 s the
#: slowest row here (``python scripts/compiler_conformance.py --optimize --second-set``); Stable Diffusion's
#: conditional UNet from ``diffusers`` (cross-attention, GroupNorm, timestep embeddings)
SECOND_SET_CASES = (("hf_swin", 0.5), ("timm_beit", 0.5), ("diffusers_unet2d_cond", 0.5))


@pytest.mark.parametrize("name,fraction", SECOND_SET_CASES, ids=[name for name, _ in SECOND_SET_CASES])
def test_later_models_train_exactly_on_optimizes_default_path(name, fraction):
    if not third_party.available(name):
        pytest.skip(f"{third_party.CONFORMANCE_MODELS[name][0]} is not installed")
    (row,) = check_model(name, fractions=(fraction,), solvers=("auto",), compiler="auto")
    assert row.passed and not row.skipped, describe(row)
    assert row.path == "compiler", f"{name} fell back to the schedule executor"


def test_hf_swin_trains_exactly_on_the_schedule_executor():
    """Export's fake CPU flash attention lays its result out otherwise than the real kernel, and the
    exported ``view`` of it failed on the real one (``ProfileError`` while pricing); the export trace
    now reshapes (``export_trace._views_as_reshapes``: the same view wherever one exists)."""
    if not third_party.available("hf_swin"):
        pytest.skip("transformers is not installed")
    (row,) = check_model("hf_swin", fractions=(0.5,), solvers=("auto",))
    assert row.passed and not row.skipped, describe(row)
    assert row.path == "executor"


def test_hf_modernbert_is_predicted_within_five_percent_where_chain_dp_recomputes_residual_adds():
    """At half its activation memory ModernBERT's plan (chain_dp) recomputes residual additions with a
    tape that nothing reads: dead code in the generated backward, with the inputs it read. Priced as
    computations, they made the prediction 8.9 % over the allocator (issue 16 asks for 5 %);
    ``schedule.dead_recomputations`` prices them as what the lowering emits, nothing."""
    if not third_party.available("hf_modernbert"):
        pytest.skip("transformers is not installed")
    (row,) = check_model("hf_modernbert", fractions=(0.5,), solvers=("auto",), compiler="auto")
    assert row.passed and not row.skipped and row.path == "compiler", describe(row)
    assert abs(row.predicted_peak_bytes / row.measured_peak_bytes - 1) <= 0.05, describe(row)


def test_fine_tuning_a_frozen_backbone_is_predicted_as_the_allocator_sees_it():
    """Fine-tuning torchvision's ResNet-18: every parameter but the classifier's frozen, BatchNorms in
    training mode. The backbone is one unit without backward, whose step peaks in the forward, at a
    layer4 convolution's 9.5 MB of kernel temporaries. Priced on top of the unit's peak of stored values
    (4.7 MB, elsewhere), the prediction was 45 % over the allocator; without the running statistics the
    generated forward returns and holds to its end, 0.2 % under."""
    if not third_party.available("tv_resnet18"):
        pytest.skip("torchvision is not installed")
    import recompute_graph as rg
    from recompute_graph.verification import verify
    model, call = third_party.build("tv_resnet18")
    for name, parameter in model.named_parameters():
        parameter.requires_grad_(name.startswith("fc."))
    optimized = rg.optimize(model.train(), 1.0, example_inputs=call)
    assert not isinstance(optimized, rg.RecomputedModule), "fell back to the schedule executor"
    report = verify(model, 1.0, example_inputs=call, optimized=optimized)
    assert report.gradient_error < 1e-5 and not report.buffer_mismatches, report
    assert report.measured_peak_bytes <= report.predicted_peak_bytes <= 1.005 * report.measured_peak_bytes, report


#: models cast whole to bfloat16 through ``optimize()``'s default path: torchvision's ResNet-18 (its
#: BatchNorms were normalized from rounded statistics on recomputation, gradients 9 % off, and their
#: bfloat16 running statistics taken for model outputs, 22 % over the allocator) and GPT-2
REDUCED_PRECISION_CASES = (("tv_resnet18", 0.5), ("hf_gpt2", 0.5))


@pytest.mark.parametrize("name,fraction", REDUCED_PRECISION_CASES, ids=[name for name, _ in REDUCED_PRECISION_CASES])
def test_bfloat16_models_train_exactly_on_optimizes_default_path(name, fraction):
    """The conformance checks in bfloat16, the gradients against ``torch.compile(model,
    backend="aot_eager")``'s (in bfloat16 compiled and eager PyTorch round differently: GPT-2's gradients
    1.5e-2 apart); the rest as in float32 (the whole sweep: ``python scripts/compiler_conformance.py
    --optimize --dtype bfloat16``)."""
    if not third_party.available(name):
        pytest.skip(f"{third_party.CONFORMANCE_MODELS[name][0]} is not installed")
    import torch
    (row,) = check_model(name, fractions=(fraction,), solvers=("auto",), compiler="auto", dtype=torch.bfloat16)
    assert row.passed and not row.skipped and row.compiled_reference_error == 0, describe(row)
    assert row.path == "compiler", f"{name} fell back to the schedule executor"
    assert abs(row.predicted_peak_bytes / row.measured_peak_bytes - 1) <= 0.01, describe(row)
