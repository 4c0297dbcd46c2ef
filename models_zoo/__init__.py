"""Our own model definitions for tests and benchmarks.

``get_model(name, preset="small", **sizes) -> (model, example_inputs)``: ``preset`` picks a size
(``"tiny"`` for unit tests, ``"small"`` for CPU demos, ``"paper"`` for the sizes used in the papers);
any keyword in ``sizes`` overrides the preset (``batch`` and the input size are among them).
``example_inputs`` is a tuple of tensors to call the model with.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from .mlp import MLPChain
from .resnet import ResNet
from .rnn import UnrolledLSTM
from .transformer import GPT2
from .unet import UNet
from .vgg import VGG19

__all__ = ["get_model", "get_model_on", "MODEL_NAMES", "PRESETS", "MLPChain", "ResNet", "UNet", "GPT2", "VGG19",
           "UnrolledLSTM"]


def _resnet(depth: int) -> Callable[..., tuple[nn.Module, tuple[torch.Tensor, ...]]]:
    def build(batch: int, image_size: int, width: int = 64, num_classes: int = 1000):
        return ResNet(depth, width, num_classes), (torch.randn(batch, 3, image_size, image_size),)
    return build


def _unet(batch: int, image_size: int, depth: int = 4, width: int = 64, num_classes: int = 2):
    return UNet(depth, width, 3, num_classes), (torch.randn(batch, 3, image_size, image_size),)


def _gpt2(batch: int, seq_len: int, layers: int = 12, width: int = 768, heads: int = 12,
          vocab_size: int = 50257, dropout: float = 0.1):
    model = GPT2(layers, width, heads, seq_len, vocab_size, dropout)
    return model, (torch.randint(0, vocab_size, (batch, seq_len)),)


def _vgg19(batch: int, image_size: int, width: int = 64, num_classes: int = 1000, hidden: int = 4096):
    return VGG19(width, num_classes, image_size, hidden), (torch.randn(batch, 3, image_size, image_size),)


def _mlp(batch: int, depth: int = 8, width: int = 1024, out_features: int = 10):
    return MLPChain(depth, width, None, out_features), (torch.randn(batch, width),)


def _rnn(batch: int, steps: int = 100, input_size: int = 64, hidden_size: int = 256, out_features: int = 10):
    return UnrolledLSTM(steps, input_size, hidden_size, out_features), (torch.randn(steps, batch, input_size),)


_BUILDERS: dict[str, Callable[..., Any]] = {
    "resnet18": _resnet(18), "resnet34": _resnet(34), "resnet50": _resnet(50), "resnet101": _resnet(101),
    "resnet152": _resnet(152), "unet": _unet, "gpt2": _gpt2, "vgg19": _vgg19, "mlp": _mlp, "rnn": _rnn,
}
_RESNET = {"tiny": dict(batch=4, image_size=32, width=4, num_classes=10),
           "small": dict(batch=8, image_size=224, width=16, num_classes=100),
           "paper": dict(batch=32, image_size=224, width=64, num_classes=1000)}
PRESETS: dict[str, dict[str, dict[str, Any]]] = {
    **{name: _RESNET for name in ("resnet18", "resnet34", "resnet50", "resnet101", "resnet152")},
    "unet": {"tiny": dict(batch=2, image_size=32, depth=2, width=8),
             "small": dict(batch=4, image_size=128, depth=4, width=16),
             "paper": dict(batch=8, image_size=576, depth=4, width=64)},
    "gpt2": {"tiny": dict(batch=2, seq_len=32, layers=2, width=32, heads=4, vocab_size=97),
             "small": dict(batch=4, seq_len=128, layers=4, width=256, heads=4, vocab_size=5000),
             "paper": dict(batch=8, seq_len=1024, layers=12, width=768, heads=12, vocab_size=50257)},
    "vgg19": {"tiny": dict(batch=4, image_size=32, width=2, num_classes=10, hidden=32),
              "small": dict(batch=8, image_size=64, width=16, num_classes=100, hidden=512),
              "paper": dict(batch=32, image_size=224, width=64, num_classes=1000, hidden=4096)},
    "mlp": {"tiny": dict(batch=64, depth=4, width=32), "small": dict(batch=64, depth=16, width=1024),
            "paper": dict(batch=256, depth=32, width=4096)},
    "rnn": {"tiny": dict(batch=8, steps=8, input_size=32, hidden_size=32),
            "small": dict(batch=16, steps=100, input_size=64, hidden_size=256),
            "paper": dict(batch=64, steps=1000, input_size=128, hidden_size=512)},
}
MODEL_NAMES = tuple(_BUILDERS)


def get_model(name: str, preset: str = "small", *, seed: int | None = 0,
              **sizes: Any) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """Build zoo model ``name`` at ``preset`` size (overridden by ``sizes``) and example inputs.

    ``seed`` (default 0) makes weights and inputs reproducible; ``None`` leaves the RNG alone.
    """
    if name not in _BUILDERS:
        raise ValueError(f"unknown zoo model {name!r}; available: {', '.join(MODEL_NAMES)}")
    if preset not in PRESETS[name]:
        raise ValueError(f"unknown preset {preset!r} for {name!r}; available: {', '.join(PRESETS[name])}")
    arguments = {**PRESETS[name][preset], **sizes}
    if seed is not None:
        torch.manual_seed(seed)
    try:
        return _BUILDERS[name](**arguments)
    except TypeError as error:
        raise ValueError(f"bad size for zoo model {name!r}: {error}") from None


def get_model_on(name: str, device: "torch.device | str", preset: str = "small",
                 **sizes: Any) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """:func:`get_model` (seed 0) with the model and its example inputs moved to ``device``."""
    model, inputs = get_model(name, preset, **sizes)
    return model.to(device), tuple(t.to(device) for t in inputs)

