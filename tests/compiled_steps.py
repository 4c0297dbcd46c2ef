"""One seeded training step of a compiled model against eager autograd, for the compiler path's tests."""
import copy

import torch
from torch import nn

from recompute_graph.joint_lowering import last_lowering
from recompute_graph.measure import allocator_peak_memory
from recompute_graph.verification import parameter_gradient_error


def square_loss(out):
    return (out[0] if isinstance(out, tuple) else out).float().square().mean()


def measured_and_predicted_peaks(model, inputs, backend):
    """``(allocator-measured peak, predicted step peak)`` of a training step (``square_loss``) of
    ``torch.compile(model, backend)``, measured after one step has compiled and planned it."""
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=backend)

    def step():
        model.zero_grad(set_to_none=True)
        square_loss(compiled(*inputs)).backward()
    step()
    return allocator_peak_memory(step), last_lowering().plan.predicted_step_peak_bytes


def compiled_step_matches_eager(model, inputs, backend):
    """One seeded step of ``torch.compile(model, backend)`` against eager autograd: the largest gradient
    error relative to each parameter's largest gradient, and whether every buffer ends equal."""
    model.zero_grad(set_to_none=True)
    reference = copy.deepcopy(model)
    torch.manual_seed(0)
    square_loss(reference(*inputs)).backward()
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=backend)
    torch.manual_seed(0)
    square_loss(compiled(*inputs)).backward()
    error = parameter_gradient_error(model, reference)
    buffers_equal = all(torch.equal(a, b) for a, b in zip(model.buffers(), reference.buffers()))
    return error, buffers_equal


class WideHead(nn.Module):
    """VGG's pattern: large classifier weights after a small body; a weight's gradient is made by
    the backward of the matmul that reads the weight's transpose (a unit with no predecessors)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh())
        self.head = nn.Sequential(nn.Linear(64, 1024), nn.Tanh(), nn.Linear(1024, 1024), nn.Tanh(),
                                  nn.Linear(1024, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x).exp())
