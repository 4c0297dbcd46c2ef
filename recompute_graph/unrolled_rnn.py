"""``nn.LSTM``, ``nn.GRU`` and ``nn.RNN`` run step by step, so that a plan can keep or recompute each time
step (``optimize(..., unroll_rnns=True)``).

A fused recurrent layer is one op: one node of every graph, which keeps all ``T`` steps' gates for its
backward. No plan can recompute part of it, so a model made of one (the BPTT setting of Gruslys et al.
2016) had a floor of its whole store-all step. With ``unroll_rnns`` each such module of the model runs
as a loop like ATen's CPU kernels (``aten/src/ATen/native/RNN.cpp``), per layer, direction and step:

- LSTM: ``gates = linear(h, w_hh, b_hh) + linear(x[t], w_ih, b_ih)`` chunked in the order i, f, g, o;
  ``c = f * c + i * g``, ``h = o * tanh(c)``;
- GRU: ``r, z`` from the sums of the chunked input and hidden gates, ``n = tanh(i_n + h_n * r)``,
  ``h = (h - n) * z + n``;
- RNN: ``h = tanh(linear(h, w_hh, b_hh) + linear(x[t], w_ih, b_ih))`` (or ``relu``);

between layers, in training, ``dropout`` on the stacked outputs, as the kernels draw it. The export and
compiler graphs then hold ``T`` steps a plan can split. (The kernels project every step's input at
once; one tensor of all ``T`` steps' input gates would live through the whole forward and set a floor
of its own. Each step reads ``x[t]``, not an item of ``x.unbind(0)``: the executor holds an item's
gradient until ``unbind``'s backward stacks them, which its simulator did not see, 6 % under the
allocator on a GRU.)

Invariants: the parameters are the module's own (``weight_ih_l0`` ...: the state dict and optimizers
are unchanged); outputs, final states and gradients equal the fused op's on the CPU up to float
rounding (float32: about 1e-7); a ``PackedSequence`` input or an LSTM's ``proj_size > 0`` runs the fused
op, unchanged. The swap is of the module's class (:class:`StepByStepLSTM` ..., no longer an
``nn.RNNBase`` for ``isinstance``: Dynamo refuses to trace those) and lasts as long as the optimized
module uses the model; :func:`rnns_unrolled` swaps the classes back when planning fails.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch import nn
from torch.nn.utils.rnn import PackedSequence

__all__ = ["StepByStepLSTM", "StepByStepGRU", "StepByStepRNN", "unroll_rnns", "rnns_unrolled"]


class _StepByStep(nn.Module):
    """A fused recurrent module (its attributes as they are) whose forward is the step loop of the module
    docstring; ``fused`` is the class it was."""

    fused: type[nn.RNNBase] = nn.RNNBase

    def flatten_parameters(self) -> None:
        """Nothing to flatten: the steps read the parameters one by one (older code calls this in forward)."""

    __getstate__ = nn.RNNBase.__getstate__  # the fused op's weight list holds weak references: not pickled

    def __setstate__(self, state: dict) -> None:
        nn.Module.__setstate__(self, state)
        self._init_flat_weights()

    def _apply(self, fn, recurse=True):  # noqa: ANN001 - nn.Module's signature
        """``.to()``, ``.half()`` ...: then point the fused op's weight list at the new parameters."""
        result = nn.Module._apply(self, fn, recurse)
        self._init_flat_weights()
        return result

    def forward(self, input, hx=None):  # noqa: A002 - the fused module's own argument name
        """The fused module's call: ``(output, h_n)``, an LSTM's ``(output, (h_n, c_n))``."""
        if isinstance(input, PackedSequence) or getattr(self, "proj_size", 0) > 0:
            return self.fused.forward(self, input, hx)
        lstm = self.mode == "LSTM"
        batched = input.dim() == 3
        x = input if batched else input.unsqueeze(1)
        if self.batch_first and batched:
            x = x.transpose(0, 1)
        directions = 2 if self.bidirectional else 1
        if hx is None:
            h0 = c0 = x.new_zeros(self.num_layers * directions, x.shape[1], self.hidden_size)
        else:
            h0, c0 = ((h if batched else h.unsqueeze(1) for h in hx) if lstm
                      else (hx if batched else hx.unsqueeze(1), None))
        finals_h, finals_c = [], []
        for layer in range(self.num_layers):
            outputs = []
            for direction in range(directions):
                suffix = f"_l{layer}{'_reverse' if direction else ''}"
                index = layer * directions + direction
                out, h, c = self._layer(x, h0[index], c0[index] if lstm else None, suffix, reverse=direction == 1)
                outputs.append(out)
                finals_h.append(h)
                finals_c.append(c)
            x = outputs[0] if directions == 1 else torch.cat(outputs, dim=-1)
            if self.dropout and self.training and layer < self.num_layers - 1:
                x = nn.functional.dropout(x, self.dropout, training=True)
        output = x.transpose(0, 1) if self.batch_first and batched else x
        finals = [torch.stack(finals_h), *([torch.stack(finals_c)] if lstm else [])]
        if not batched:
            output, finals = output.squeeze(1), [f.squeeze(1) for f in finals]
        return output, (tuple(finals) if lstm else finals[0])

    def _layer(self, x: torch.Tensor, h: torch.Tensor, c: torch.Tensor | None, suffix: str,
               reverse: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        weights = (getattr(self, f"weight_ih{suffix}"), getattr(self, f"weight_hh{suffix}"),
                   getattr(self, f"bias_ih{suffix}") if self.bias else None,
                   getattr(self, f"bias_hh{suffix}") if self.bias else None)
        inputs = [x[t] for t in range(x.shape[0])]
        steps = range(len(inputs) - 1, -1, -1) if reverse else range(len(inputs))
        outputs: list[torch.Tensor] = [None] * len(inputs)  # type: ignore[list-item]
        for t in steps:
            h, c = self._cell(inputs[t], h, c, *weights)
            outputs[t] = h
        return torch.stack(outputs), h, c

    def _cell(self, x: torch.Tensor, h: torch.Tensor, c: torch.Tensor | None, w_ih: torch.Tensor,
              w_hh: torch.Tensor, b_ih: torch.Tensor | None, b_hh: torch.Tensor | None
              ) -> tuple[torch.Tensor, torch.Tensor | None]:
        linear = nn.functional.linear
        if self.mode == "LSTM":
            i, f, g, o = (linear(h, w_hh, b_hh) + linear(x, w_ih, b_ih)).chunk(4, 1)
            c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
            return torch.sigmoid(o) * torch.tanh(c), c
        if self.mode == "GRU":
            input_r, input_z, input_n = linear(x, w_ih, b_ih).chunk(3, 1)
            hidden_r, hidden_z, hidden_n = linear(h, w_hh, b_hh).chunk(3, 1)
            reset, update = torch.sigmoid(hidden_r + input_r), torch.sigmoid(hidden_z + input_z)
            new = torch.tanh(input_n + hidden_n * reset)
            return (h - new) * update + new, None
        pre = linear(h, w_hh, b_hh) + linear(x, w_ih, b_ih)
        return (torch.tanh(pre) if self.mode == "RNN_TANH" else torch.relu(pre)), None


class StepByStepLSTM(_StepByStep):
    fused = nn.LSTM


class StepByStepGRU(_StepByStep):
    fused = nn.GRU


class StepByStepRNN(_StepByStep):
    fused = nn.RNN


#: the fused class each step loop replaces
STEP_BY_STEP = {nn.LSTM: StepByStepLSTM, nn.GRU: StepByStepGRU, nn.RNN: StepByStepRNN}

for _loop, _fused in ((StepByStepLSTM, nn.LSTM), (StepByStepGRU, nn.GRU), (StepByStepRNN, nn.RNN)):
    # the fused op's helpers (argument checks, the weight list, ``extra_repr``), but those calling super()
    for _name, _method in {**vars(nn.RNNBase), **vars(_fused)}.items():
        if (callable(_method) and not _name.startswith("__") and _name not in vars(_StepByStep)
                and "__class__" not in getattr(getattr(_method, "__code__", None), "co_freevars", ())):
            setattr(_loop, _name, _method)


def unroll_rnns(model: nn.Module) -> list[nn.Module]:
    """Make each ``nn.LSTM``, ``nn.GRU`` and ``nn.RNN`` of ``model`` (exactly those classes, not subclasses)
    its step loop (:data:`STEP_BY_STEP`); returns the modules swapped."""
    swapped = [m for m in model.modules() if type(m) in STEP_BY_STEP]
    for module in swapped:
        module.__class__ = STEP_BY_STEP[type(module)]
    return swapped


@contextlib.contextmanager
def rnns_unrolled(model: nn.Module, enabled: bool = True) -> Iterator[list[nn.Module]]:
    """:func:`unroll_rnns` for the block; on an exception the classes are swapped back (nothing is left
    half-applied), else they stay swapped."""
    swapped = unroll_rnns(model) if enabled else []
    try:
        yield swapped
    except BaseException:
        for module in swapped:
            module.__class__ = module.fused
        raise
