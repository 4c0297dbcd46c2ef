"""Mixed precision: an optimized module under ``torch.autocast`` (bfloat16 on CPU) trains exactly like
the original under autocast, recomputations re-enter the forward's autocast settings, and plans are
priced with the dtypes autocast produces."""
from __future__ import annotations

import pytest
import torch

import models_zoo
from recompute_graph import optimize
from recompute_graph.measure import default_loss


def autocast_gradients(module, inputs):
    torch.manual_seed(0)
    module.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        output = module(*inputs)
    default_loss(output).backward()  # backward outside the autocast block, as in the PyTorch recipes
    return [p.grad.clone() for p in module.parameters()]


@pytest.mark.parametrize("name", ["gpt2", "unet"])  # attention + dropout; convolutions + BatchNorm
def test_gradients_under_autocast_equal_the_originals_and_the_plan_is_priced_in_bfloat16(name):
    model, inputs = models_zoo.get_model(name, "tiny")
    expected = autocast_gradients(model, inputs)
    optimized = optimize(model, 0.7, example_inputs=inputs, autocast=torch.bfloat16, timing="flops",
                         loss_fn=default_loss)
    plan = optimized.recompute_plan
    assert plan.recomputed_nodes
    got = autocast_gradients(optimized, inputs)
    assert optimized.recompute_plan is plan  # the plan made for autocast is the one used under autocast
    for a, b in zip(expected, got):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    float32 = optimize(model, 0.7, example_inputs=inputs, timing="flops", loss_fn=default_loss).recompute_plan
    # activations are priced in bfloat16: half the float32 bytes (the whole peak is not: on a CPU without
    # native bfloat16 the convolutions' backward allocates float32 workspace, 592 KB against 201 KB on
    # the small U-Net, and the parameter gradients stay float32)
    activation_bytes = [sum(n.output_bytes for n in p.graph.nodes) for p in (plan, float32)]
    assert activation_bytes[0] < 0.6 * activation_bytes[1]


def test_a_plan_made_on_the_first_call_follows_the_autocast_setting_of_that_call():
    model, inputs = models_zoo.get_model("gpt2", "tiny")
    optimized = optimize(model, 0.75, timing="flops", loss_fn=default_loss)
    autocast_gradients(optimized, inputs)
    mixed = optimized.recompute_plan
    optimized.zero_grad()
    default_loss(optimized(*inputs)).backward()
    full = optimized.recompute_plan
    assert mixed is not full and mixed.store_all_peak_bytes < full.store_all_peak_bytes


def test_the_compiler_path_under_autocast_trains_like_torch_compile_under_autocast():
    """``optimize(..., autocast=torch.bfloat16, compiler=True)``: the example call is captured under
    autocast, so the joint graph holds bfloat16 activations and its casts. Its gradients are exactly
    those of ``torch.compile`` with AOTAutograd's own partitioner (``aot_eager``) under autocast; both
    differ from eager autocast (0.7 % of the largest gradient on GPT-2 tiny: AOTAutograd traces the
    backward's casts itself), so that is the reference."""
    torch._dynamo.reset()
    model, inputs = models_zoo.get_model("gpt2", "tiny")
    expected = autocast_gradients(torch.compile(model, backend="aot_eager"), inputs)
    torch._dynamo.reset()
    optimized = optimize(model, 0.8, example_inputs=inputs, autocast=torch.bfloat16, compiler=True,
                         loss_fn=default_loss)
    plan = optimized.recompute_plan
    assert plan.recomputed_nodes
    got = autocast_gradients(optimized, inputs)
    assert len(optimized.lowerings) == 1  # the plan made under autocast is the one trained with
    for a, b in zip(expected, got):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    float32 = optimize(model, 0.8, example_inputs=inputs, compiler=True, loss_fn=default_loss).recompute_plan
    activation_bytes = [sum(n.output_bytes for n in p.graph.nodes) for p in (plan, float32)]
    assert activation_bytes[0] < 0.75 * activation_bytes[1]
