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
    assert plan.store_all_peak_bytes < 0.8 * float32.store_all_peak_bytes


def test_a_plan_made_on_the_first_call_follows_the_autocast_setting_of_that_call():
    model, inputs = models_zoo.get_model("gpt2", "tiny")
    optimized = optimize(model, 0.75, timing="flops", loss_fn=default_loss)
    autocast_gradients(optimized, inputs)
    mixed = optimized.recompute_plan
    optimized.zero_grad()
    default_loss(optimized(*inputs)).backward()
    full = optimized.recompute_plan
    assert mixed is not full and mixed.store_all_peak_bytes < full.store_all_peak_bytes
