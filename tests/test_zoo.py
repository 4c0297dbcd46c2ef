import pytest
import torch

import models_zoo
from models_zoo.resnet import BasicBlock, Bottleneck


def test_every_zoo_model_runs_forward_and_backward_at_tiny_size(zoo_name):
    model, inputs = models_zoo.get_model(zoo_name, "tiny")
    out = model(*inputs)
    out.float().sum().backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


def test_get_model_is_reproducible_and_sizes_override_the_preset():
    a, xa = models_zoo.get_model("mlp", "tiny", width=48)
    b, xb = models_zoo.get_model("mlp", "tiny", width=48)
    assert torch.equal(xa[0], xb[0]) and xa[0].shape == (models_zoo.PRESETS["mlp"]["tiny"]["batch"], 48)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


@pytest.mark.parametrize("depth, block, counts", [(18, BasicBlock, 8), (34, BasicBlock, 16), (50, Bottleneck, 16),
                                                  (101, Bottleneck, 33), (152, Bottleneck, 50)])
def test_resnet_uses_the_papers_block_type_and_count(depth, block, counts):
    model, _ = models_zoo.get_model(f"resnet{depth}", "tiny")
    blocks = [m for m in model.modules() if isinstance(m, (BasicBlock, Bottleneck))]
    assert len(blocks) == counts and all(isinstance(b, block) for b in blocks)


def test_gpt2_ties_output_projection_to_token_embedding():
    model, _ = models_zoo.get_model("gpt2", "tiny")
    assert model.lm_head.weight is model.wte.weight


def test_rnn_reuses_one_cell_for_every_step():
    model, (x,) = models_zoo.get_model("rnn", "tiny", steps=9)
    assert x.shape[0] == 9
    assert sum(isinstance(m, torch.nn.LSTMCell) for m in model.modules()) == 1


def test_unknown_model_or_preset_or_size_is_a_clear_value_error():
    with pytest.raises(ValueError, match="available: .*resnet50"):
        models_zoo.get_model("resnet51")
    with pytest.raises(ValueError, match="preset"):
        models_zoo.get_model("mlp", "huge")
    with pytest.raises(ValueError, match="bad size"):
        models_zoo.get_model("mlp", "tiny", colour=3)
