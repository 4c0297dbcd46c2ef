"""Classes of other libraries that this one recognizes, without importing those libraries.

A class is looked up in ``sys.modules``: when its library was never imported, no model can be an
instance of it, and the answer is False without paying for the import (``transformers`` takes seconds).
"""
from __future__ import annotations

import sys

from torch import nn

__all__ = ["is_transformers_model", "is_peft_model"]


def _is_instance(module: nn.Module, module_name: str, class_name: str) -> bool:
    imported = sys.modules.get(module_name)
    return imported is not None and isinstance(module, getattr(imported, class_name, ()))


def is_transformers_model(module: nn.Module) -> bool:
    """Whether ``module`` is a ``transformers.PreTrainedModel``."""
    return _is_instance(module, "transformers.modeling_utils", "PreTrainedModel")


def is_peft_model(module: nn.Module) -> bool:
    """Whether ``module`` is a ``peft.PeftModel`` (a model wrapped with adapters such as LoRA)."""
    return _is_instance(module, "peft.peft_model", "PeftModel")
