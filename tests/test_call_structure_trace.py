"""The executor's fx graph of one call structure (``call_structure_trace``), where neither the fx graph of
``forward`` as written nor torch.export can be made: a ``transformers`` model whose forward a decorator
wraps in ``(*args, **kwargs)`` and branches on ``return_dict``, and which draws a random number it never
uses (which export drops: PegasusX), was refused with ``ValueError: code: co_varnames is too small``."""
import functools

import pytest
import torch
from torch import nn

import recompute_graph as rg
from recompute_graph.call_structure_trace import call_structure, wrapped_in_varargs
from recompute_graph.errors import CompilerFallbackWarning, TraceError


def _returns_tuple_unless_asked(forward):
    """As ``transformers``' ``@can_return_tuple``: a ``(*args, **kwargs)`` wrapper."""
    @functools.wraps(forward)
    def wrapper(self, *args, **kwargs):
        output = forward(self, *args, **kwargs)
        return output if kwargs.get("return_dict", True) is not False else tuple(output.values())
    return wrapper


class _Decorated(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = nn.Linear(16, 256), nn.Linear(256, 16)

    @_returns_tuple_unless_asked
    def forward(self, x, scale=None, return_dict=None, use_cache=False, **kwargs):
        hidden = torch.relu(self.first(x))
        unused = nn.functional.dropout(hidden, 0.1, self.training)  # noqa: F841 - export drops it
        hidden = nn.functional.dropout(hidden, 0.2, self.training)
        if use_cache:  # a branch on an argument's value: fx's proxy cannot take it
            hidden = hidden * 2
        output = self.second(hidden)
        if scale is not None:
            output = output * scale
        return {"out": output} if return_dict is not False else {"out": output, "hidden": hidden}


def test_a_decorated_forward_branching_on_its_arguments_trains_on_the_executor_exactly():
    torch.manual_seed(0)
    model = _Decorated()
    x = torch.randn(128, 16)
    assert wrapped_in_varargs(type(model).forward)
    with pytest.warns(CompilerFallbackWarning):  # (the compiler path refuses the unused dropout)
        report = rg.verify(model, 0.9, example_inputs=(x,), example_kwargs={"use_cache": True})
    assert report.gradient_error < 1e-6 and report.measured_peak_bytes <= report.budget_bytes
    assert abs(report.prediction_error) <= 0.1


def test_each_call_structure_gets_a_graph_of_its_own():
    torch.manual_seed(0)
    model = _Decorated()
    optimized = rg.optimize(model, 1.0, example_inputs=(torch.randn(8, 16),), compiler=False)
    x, scale = torch.randn(8, 16), torch.randn(8, 16)
    for kwargs in ({}, {"use_cache": True}, {"scale": scale, "return_dict": False}, {"sizes": [2, 3]},
                   {"sizes": [2, 3]}):
        torch.manual_seed(1)
        expected = model(x, **kwargs)
        torch.manual_seed(1)
        got = optimized(x, **kwargs)
        expected, got = (e["out"] if isinstance(e, dict) else e[0] for e in (expected, got))
        assert torch.equal(got, expected), kwargs


def test_a_call_structure_holds_tensors_by_name_and_constants_by_value():
    model = _Decorated()
    x = torch.randn(2, 16)
    structure = call_structure(model, (x,), {"use_cache": True, "extra": (1, "a")})
    assert structure.tensor_names == ("x",)
    assert structure.constants == (("use_cache", True), ("extra", (1, "a")))
    assert call_structure(model, (x,), {"scale": [x]}) is None  # a list of tensors: not a constant
    assert call_structure(model, (x, x, x, x, x), {}) is None  # does not fit the signature


class _WritesIntoAnActivation(nn.Module):
    """transformers' seq2seq models given labels: ``shift_tokens_right`` assigns into an activation,
    which torch.fx's ``Proxy`` did not record (``'Proxy' object does not support item assignment``)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    @_returns_tuple_unless_asked
    def forward(self, x, return_dict=None):
        shifted = x.new_zeros(x.shape)
        shifted[:, 1:] = x[:, :-1]  # (transformers' shift_tokens_right)
        unused = nn.functional.dropout(x, 0.5, self.training)  # noqa: F841
        return {"out": self.linear(shifted)}


def test_a_write_into_an_activation_trains_from_the_graph_of_its_call_structure():
    torch.manual_seed(0)
    report = rg.verify(_WritesIntoAnActivation(), 1.0, example_inputs=(torch.randn(4, 8),), compiler=False)
    assert report.gradient_error < 1e-6 and report.measured_peak_bytes <= report.budget_bytes


class _BranchesOnAValue(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    @_returns_tuple_unless_asked
    def forward(self, x, return_dict=None):
        if x.sum() > 0:  # a branch on a tensor's value: no tracer takes it
            x = x * 2
        return {"out": self.linear(x)}


def test_a_model_no_tracer_can_take_is_refused_with_what_each_said():
    with pytest.raises(TraceError) as raised:
        rg.optimize(_BranchesOnAValue(), 1.0, example_inputs=(torch.randn(4, 8),), compiler=False)
    message = str(raised.value)
    assert "cannot be used as inputs to control flow" in message and "cannot export" in message
    assert "co_varnames" not in message
