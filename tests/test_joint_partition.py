"""The compiler path's lowering: a choice of saved values becomes a forward graph and a backward graph
with recompute nodes at their first use, run under ``torch.compile`` (aot_eager), gradients exact."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from recompute_graph.joint_partition import POLICIES, last_partition, recompute_backend


class Block(nn.Module):
    """Linear, BatchNorm (a buffer update), GELU, dropout (random), LayerNorm, tanh."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.bn, self.b = nn.Linear(16, 32), nn.BatchNorm1d(32), nn.Linear(32, 32)
        self.drop, self.norm, self.head = nn.Dropout(0.2), nn.LayerNorm(32), nn.Linear(32, 4)

    def forward(self, x):
        h = self.drop(torch.nn.functional.gelu(self.bn(self.a(x))))
        return self.head(torch.tanh(self.norm(self.b(h))))


def compiled_step(model, x, policy):
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=recompute_backend(policy))
    torch.manual_seed(0)
    compiled(x).square().mean().backward()
    return last_partition()


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_every_policy_trains_exactly(policy):
    torch.manual_seed(0)
    model, x = Block().train(), torch.randn(8, 16)
    reference = copy.deepcopy(model)
    torch.manual_seed(0)
    reference(x).square().mean().backward()
    partition = compiled_step(model, x, policy)
    largest = max(p.grad.abs().max().item() for p in reference.parameters())
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert (p.grad - q.grad).abs().max().item() <= 1e-5 * largest, name
    for b, c in zip(model.buffers(), reference.buffers()):  # BatchNorm statistics updated once
        torch.testing.assert_close(b, c)
    if policy == "save_all":
        assert partition.recomputed == ()
    else:
        assert partition.recomputed


def test_recompute_nodes_sit_right_before_their_first_use_and_random_ops_are_never_recomputed():
    torch.manual_seed(0)
    partition = compiled_step(Block().train(), torch.randn(8, 16), "save_nothing")
    nodes = list(partition.backward_graph.graph.nodes)
    position = {n: i for i, n in enumerate(nodes)}
    recomputed = set(partition.recomputed)
    for node in nodes:
        if node.name not in recomputed:
            continue
        first_use = min(position[u] for u in node.users)
        between = nodes[position[node] + 1:first_use]
        assert all(n.name in recomputed for n in between), f"{node.name} is computed before it is needed"
    aten = torch.ops.aten
    assert not any(n.target in (aten.native_dropout.default, aten.bernoulli.default) for n in nodes)
    mask_readers = [n for n in nodes if n.target is aten.native_dropout_backward.default]
    assert mask_readers and all(n.args[1].op == "placeholder" for n in mask_readers)  # the saved mask
    assert all(f"    {name} = " in partition.backward_code  # the reader sees each recomputation
               for name in partition.recomputed)


def test_more_recomputation_saves_fewer_bytes():
    torch.manual_seed(0)

    def saved_bytes(policy):
        partition = compiled_step(Block().train(), torch.randn(64, 16), policy)
        graph = partition.forward_graph.graph
        by_name = {n.name: n for n in graph.nodes}
        return sum(by_name[s].meta["val"].untyped_storage().nbytes() for s in partition.saved
                   if s in by_name and not s.startswith("primals"))
    assert saved_bytes("save_nothing") < saved_bytes("save_compute_bound") < saved_bytes("save_all")


@pytest.mark.parametrize("name", ["gpt2", "resnet18", "unet"])
def test_zoo_models_under_torch_compile_train_exactly(name):
    import models_zoo
    from recompute_graph.losses import default_training_loss
    model, inputs = models_zoo.get_model(name, "tiny")
    reference = copy.deepcopy(model)
    torch.manual_seed(0)
    default_training_loss(reference(*inputs)).backward()
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=recompute_backend("save_nothing"))
    torch.manual_seed(0)
    default_training_loss(compiled(*inputs)).backward()
    assert last_partition().recomputed
    largest = max(p.grad.abs().max().item() for p in reference.parameters() if p.grad is not None)
    for p, q in zip(model.parameters(), reference.parameters()):
        assert (p.grad is None) == (q.grad is None)
        if q.grad is not None:
            assert (p.grad - q.grad).abs().max().item() <= 1e-5 * largest
