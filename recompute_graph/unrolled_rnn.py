"""``nn.LSTM`` run step by step, so that a plan can keep or recompute each time step (``unroll_rnns``).

An ``nn.LSTM`` is one fused op: one node of every graph, which keeps all ``T`` steps' gates for its
backward. No plan can recompute part of it, so a model made of one (the BPTT setting of Gruslys et al.
2016) had a floor of about 0.98 of its store-all step. ``optimize(..., unroll_rnns=True)`` runs each
``nn.LSTM`` of the model as a loop like ATen's CPU kernel's (``aten/src/ATen/native/RNN.cpp``): per
layer and direction and step, ``gates = linear(h, w_hh, b_hh) + linear(x[t], w_ih, b_ih)``, the four
gates chunked in the order i, f, g, o, ``c = f * c + i * g``, ``h = o * tanh(c)``; between layers, in
training, ``dropout`` on the stacked outputs, as the kernel draws it. The export and compiler graphs
then hold ``T`` steps a plan can split. (The kernel projects every step's input at once; one tensor of
all ``T`` steps' input gates would live through the whole forward and set a floor of its own.)

Invariants: the parameters are the module's own (``weight_ih_l0`` ...: the state dict and optimizers
are unchanged); outputs, ``(h_n, c_n)`` and gradients equal the fused op's on the CPU up to float
rounding (the kernel adds in the same order, so in float32 they agree to about 1e-7); a
``PackedSequence`` input or ``proj_size > 0`` runs the fused op, unchanged. The swap is of the module's
class (:class:`StepByStepLSTM`, no longer an ``nn.LSTM`` for ``isinstance``) and lasts as long as the
optimized module uses the model; :func:`rnns_unrolled` swaps the classes back when planning fails.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch import nn
from torch.nn.utils.rnn import PackedSequence

__all__ = ["StepByStepLSTM", "unroll_lstms", "rnns_unrolled"]


class StepByStepLSTM(nn.Module):
    """An ``nn.LSTM`` (its attributes as they are) whose forward is the step loop of the module docstring.
    Not a subclass of ``nn.RNNBase``: Dynamo refuses to trace those (``allow_rnn``)."""

    extra_repr = nn.LSTM.extra_repr

    def flatten_parameters(self) -> None:
        """Nothing to flatten: the steps read the parameters one by one (older code calls this in forward)."""

    def forward(self, input, hx=None):  # noqa: A002 - nn.LSTM's own argument name
        """``nn.LSTM``'s call: ``(output, (h_n, c_n))``; below, ``nn.LSTM``'s other methods are copied in."""
        if isinstance(input, PackedSequence) or self.proj_size > 0:
            return nn.LSTM.forward(self, input, hx)
        batched = input.dim() == 3
        x = input if batched else input.unsqueeze(1)
        if self.batch_first and batched:
            x = x.transpose(0, 1)
        directions = 2 if self.bidirectional else 1
        if hx is None:
            zeros = x.new_zeros(self.num_layers * directions, x.shape[1], self.hidden_size)
            h0, c0 = zeros, zeros
        else:
            h0, c0 = (h if batched else h.unsqueeze(1) for h in hx)
        finals_h, finals_c = [], []
        for layer in range(self.num_layers):
            outputs = []
            for direction in range(directions):
                suffix = f"_l{layer}{'_reverse' if direction else ''}"
                index = layer * directions + direction
                out, h, c = self._layer(x, h0[index], c0[index], suffix, reverse=direction == 1)
                outputs.append(out)
                finals_h.append(h)
                finals_c.append(c)
            x = outputs[0] if directions == 1 else torch.cat(outputs, dim=-1)
            if self.dropout and self.training and layer < self.num_layers - 1:
                x = nn.functional.dropout(x, self.dropout, training=True)
        output = x.transpose(0, 1) if self.batch_first and batched else x
        h_n, c_n = torch.stack(finals_h), torch.stack(finals_c)
        if not batched:
            return output.squeeze(1), (h_n.squeeze(1), c_n.squeeze(1))
        return output, (h_n, c_n)

    def _layer(self, x: torch.Tensor, h: torch.Tensor, c: torch.Tensor, suffix: str,
               reverse: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        w_ih, w_hh = getattr(self, f"weight_ih{suffix}"), getattr(self, f"weight_hh{suffix}")
        b_ih = getattr(self, f"bias_ih{suffix}") if self.bias else None
        b_hh = getattr(self, f"bias_hh{suffix}") if self.bias else None
        inputs = x.unbind(0)
        steps = range(len(inputs) - 1, -1, -1) if reverse else range(len(inputs))
        outputs: list[torch.Tensor] = [None] * len(inputs)  # type: ignore[list-item]
        for t in steps:
            gates = nn.functional.linear(h, w_hh, b_hh) + nn.functional.linear(inputs[t], w_ih, b_ih)
            i, f, g, o = gates.chunk(4, 1)
            c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
            h = torch.sigmoid(o) * torch.tanh(c)
            outputs[t] = h
        return torch.stack(outputs), h, c


    __getstate__ = nn.RNNBase.__getstate__  # the fused op's weight list holds weak references: not pickled

    def __setstate__(self, state: dict) -> None:
        nn.Module.__setstate__(self, state)
        self._init_flat_weights()

    def _apply(self, fn, recurse=True):  # noqa: ANN001 - nn.Module's signature
        """``.to()``, ``.half()`` ...: then point the fused op's weight list at the new parameters."""
        result = nn.Module._apply(self, fn, recurse)
        self._init_flat_weights()
        return result


for _name, _method in {**vars(nn.RNNBase), **vars(nn.LSTM)}.items():  # the fused op's helpers
    if (callable(_method) and _name not in vars(StepByStepLSTM) and not _name.startswith("__")
            and "__class__" not in getattr(getattr(_method, "__code__", None), "co_freevars", ())):  # no super()
        setattr(StepByStepLSTM, _name, _method)


def unroll_lstms(model: nn.Module) -> list[nn.Module]:
    """Make each ``nn.LSTM`` of ``model`` (exactly that class, not a subclass of it) a
    :class:`StepByStepLSTM`; returns the modules swapped."""
    swapped = [m for m in model.modules() if type(m) is nn.LSTM]
    for module in swapped:
        module.__class__ = StepByStepLSTM
    return swapped


@contextlib.contextmanager
def rnns_unrolled(model: nn.Module, enabled: bool = True) -> Iterator[list[nn.Module]]:
    """:func:`unroll_lstms` for the block; on an exception the classes are swapped back (nothing is left
    half-applied), else they stay swapped."""
    swapped = unroll_lstms(model) if enabled else []
    try:
        yield swapped
    except BaseException:
        for module in swapped:
            module.__class__ = nn.LSTM
        raise
