"""The compiler path's capture: one functional joint graph of the model and its loss, checked against
eager autograd (gradients, loss, buffer updates) on our zoo and on third-party code."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import models_zoo
from recompute_graph.joint_capture import CaptureError, capture_joint
from recompute_graph.losses import default_training_loss


def eager_step(model, inputs, kwargs=None, loss_fn=default_training_loss):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(0)  # the graph draws dropout masks in eager's order: seeded alike, the same masks
    buffers = {n: b.clone() for n, b in model.named_buffers()}
    loss = loss_fn(model(*inputs, **(kwargs or {})))
    loss.backward()
    after = {n: b.clone() for n, b in model.named_buffers()}
    with torch.no_grad():
        for n, b in model.named_buffers():
            b.copy_(buffers[n])
    grads = {n: p.grad for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads, after


def assert_matches_eager(model, inputs, joint, kwargs=None):
    expected_loss, expected_grads, expected_buffers = eager_step(model, inputs, kwargs)
    before = {n: b.clone() for n, b in model.named_buffers()}
    torch.manual_seed(0)
    loss, grads, updates = joint.run(model, inputs, kwargs)
    assert all(torch.equal(b, before[n]) for n, b in model.named_buffers()), "run() wrote into the model"
    torch.testing.assert_close(loss, expected_loss, rtol=1e-5, atol=1e-6)
    largest = max(g.abs().max().item() for g in expected_grads.values() if g is not None)
    for name, expected in expected_grads.items():
        if expected is None:
            assert grads[name] is None, name
            continue
        assert (grads[name] - expected).abs().max().item() <= 1e-5 * largest, name
    for name, value in expected_buffers.items():
        if name in updates:
            torch.testing.assert_close(updates[name], value, rtol=1e-5, atol=1e-6)
        else:
            assert torch.equal(before[name], value), f"{name} changed in eager but is not a buffer update"


@pytest.mark.parametrize("name", ["mlp", "resnet18", "unet", "gpt2"])
def test_the_joint_graph_computes_eager_gradients_and_buffer_updates(name):
    model, inputs = models_zoo.get_model(name, "tiny")
    joint = capture_joint(model, inputs)
    assert joint.forward_nodes and joint.backward_nodes and not joint.forward_nodes & joint.backward_nodes
    assert_matches_eager(model, inputs, joint)
    if any(isinstance(m, nn.BatchNorm2d) for m in model.modules()):
        assert any(n.endswith("running_mean") for n in joint.buffer_updates)
        assert any(n.endswith("num_batches_tracked") for n in joint.buffer_updates)
    assert "aten ops" in repr(joint)


def test_writes_through_views_are_functional_in_the_joint_graph():
    """T5's ``_shift_right`` pattern: ``new_zeros``, a slice ``copy_``, a ``fill_`` on a select, then a
    read of the base. The joint graph has no in-place op left, and its gradients are exact."""
    class ShiftRight(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed, self.head = nn.Embedding(11, 8), nn.Linear(8, 11)

        def forward(self, ids):
            shifted = ids.new_zeros(ids.shape)
            shifted[:, 1:] = ids[:, :-1].clone()
            shifted[:, 0] = 3
            return self.head(self.embed(shifted))

    torch.manual_seed(0)
    model, ids = ShiftRight(), torch.randint(0, 11, (2, 5))
    joint = capture_joint(model, (ids,))
    mutating = [n for n in joint.graph_module.graph.nodes
                if n.op == "call_function" and getattr(n.target, "_schema", None) is not None
                and n.target._schema.is_mutable]
    assert mutating == []
    assert_matches_eager(model, (ids,), joint)


def test_random_nodes_are_marked_and_dropout_has_its_mask_saved():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.5), nn.Linear(16, 4)).train()
    joint = capture_joint(model, (torch.randn(4, 8),))
    assert len(joint.random_nodes) == 1 and "dropout" in next(iter(joint.random_nodes))


def test_data_dependent_control_flow_is_refused_with_the_source_line():
    class Branchy(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(4, 4)

        def forward(self, x):
            if x.sum() > 0:
                return self.linear(x)
            return self.linear(-x)

    with pytest.raises(CaptureError, match="test_joint_capture.py"):
        capture_joint(Branchy(), (torch.randn(2, 4),))


def test_frozen_parameters_are_refused_clearly():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    model[0].weight.requires_grad_(False)
    with pytest.raises(CaptureError, match="do not require grad"):
        capture_joint(model, (torch.randn(2, 4),))


@pytest.mark.parametrize("name", ["tv_vit", "timm_convnext_atto", "hf_t5"])
def test_third_party_models_capture_exactly(name):
    """The patterns that broke the module-level path (ViT's shape read after a permute, T5's writes
    through views, ConvNeXt's kernel temporaries) in one functional graph, gradients exact."""
    from models_zoo import third_party
    from models_zoo.conformance import call_of
    if not third_party.available(name):
        pytest.skip(f"{name} needs a package that is not installed")
    model, call = third_party.build(name)
    args, kwargs = call_of(call)
    joint = capture_joint(model, args, kwargs)
    assert_matches_eager(model, args, joint, kwargs)


def test_flops_are_counted_once_per_signature_and_equal_counting_every_node():
    """``meta_flops`` with a cache by signature (the op, its tensors' shapes, strides and dtypes, its
    other arguments): a deep model's repeated layers are run under ``FlopCounterMode`` once, and every
    node gets the FLOPs it gets counted alone."""
    from recompute_graph.meta_flops import meta_flops
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(6)])
    joint = capture_joint(model, (torch.randn(4, 16),)).graph_module
    nodes = [n for n in joint.graph.nodes if n.op == "call_function"]
    known: dict = {}
    cached = [meta_flops(n, known) for n in nodes]
    assert cached == [meta_flops(n) for n in nodes]
    assert sum(1 for n in nodes if "mm" in str(n.target)) and sum(cached) > 0
    assert len(known) < len(nodes) / 3  # six layers alike: few distinct signatures
