"""What the command line accepts as a model: a zoo name (``resnet50``, ``unet``, ``gpt2``, ...) at a size
preset, or ``package.module:factory``, a callable returning ``(model, example_inputs)``, where
``example_inputs`` is a tuple of positional inputs or a dict of keyword inputs (a ``transformers``
batch: ``{"input_ids": ..., "labels": ...}``)."""
from __future__ import annotations

import importlib
from typing import Any

from torch import nn

__all__ = ["load_model", "parse_sizes"]


def parse_sizes(items: list[str]) -> dict[str, Any]:
    """``["batch=8", "image_size=64"]`` -> ``{"batch": 8, "image_size": 64}`` (ints, floats or strings);
    ValueError for an item without ``=``."""
    sizes: dict[str, Any] = {}
    for item in items:
        key, sep, text = item.partition("=")
        if not sep or not key:
            raise ValueError(f"size {item!r}: write KEY=VALUE, e.g. batch=8")
        for convert in (int, float):
            try:
                sizes[key] = convert(text)
                break
            except ValueError:
                continue
        else:
            sizes[key] = text
    return sizes


def load_model(spec: str, preset: str = "small", sizes: dict[str, Any] | None = None
               ) -> tuple[nn.Module, "tuple[Any, ...] | dict[str, Any]", str]:
    """``(model, example_inputs, label)`` for ``spec``; ``example_inputs`` is a tuple, or a dict of
    keyword inputs when the factory returned one. ValueError saying what is accepted otherwise."""
    sizes = dict(sizes or {})
    if ":" in spec:
        module_name, _, attribute = spec.partition(":")
        try:
            module = importlib.import_module(module_name)
        except ImportError as error:
            raise ValueError(f"cannot import {module_name!r} for model {spec!r}: {error}") from None
        factory = getattr(module, attribute, None)
        if not callable(factory):
            raise ValueError(f"{module_name!r} has no callable {attribute!r} (model {spec!r})")
        built = factory(**sizes)
        if not (isinstance(built, tuple) and len(built) == 2 and isinstance(built[0], nn.Module)):
            raise ValueError(f"{spec} must return (model, example_inputs); it returned {type(built).__name__}")
        model, inputs = built
        if not isinstance(inputs, dict):
            inputs = tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)
        return model, inputs, attribute
    try:
        import models_zoo
    except ImportError:  # pragma: no cover - installed with the package
        raise ValueError(f"unknown model {spec!r}: give package.module:factory") from None
    if spec not in models_zoo.MODEL_NAMES:
        raise ValueError(f"unknown model {spec!r}: give a zoo model ({', '.join(models_zoo.MODEL_NAMES)}) or "
                         "package.module:factory returning (model, example_inputs)")
    model, inputs = models_zoo.get_model(spec, preset, **sizes)
    return model, inputs, spec
