"""The peer systems, applied to a copy of a model so they can be measured side by side with our plans:

* ``checkpoint_blocks``: ``torch.utils.checkpoint`` (non-reentrant) around every *block*, the most
  frequent class of composite submodule (ResNet's bottlenecks, GPT-2's transformer blocks), as users
  write it by hand;
* ``checkpoint_sequentials``: ``torch.utils.checkpoint.checkpoint_sequential`` on every ``nn.Sequential``
  of at least two modules, with round(√len) segments;
* ``compile_with_budget``: ``torch.compile`` with the min-cut partitioner (``aot_eager_decomp_partition``
  on CPU), run inside ``memory_budget(fraction)`` (``torch._functorch.config.activation_memory_budget``);
* ``rockmate_status``: whether Rockmate 2 (``rockmate``, ``rkgb``) can be imported, and if not, why.

Every function returns a new module sharing nothing with the original but equal weights (deep copy), or
raises ``ValueError`` saying why the peer does not apply to this model.
"""
from __future__ import annotations

import copy
import math
from collections import Counter
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint, checkpoint_sequential

__all__ = ["find_blocks", "checkpoint_blocks", "checkpoint_sequentials", "compile_with_budget", "memory_budget",
           "rockmate_status"]

_CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict)


def find_blocks(model: nn.Module) -> list[str]:
    """Names of the block modules: instances of the most frequent class among composite, non-container
    submodules (ties: the class holding more parameters), outermost instances only; when no such class
    repeats, the composite entries of the model's ``nn.ModuleList``s (U-Net's stages)."""
    composite = [(name, m) for name, m in model.named_modules()
                 if name and not isinstance(m, _CONTAINERS) and any(True for _ in m.children())]
    listed = [f"{name}.{index}" for name, m in model.named_modules() if isinstance(m, nn.ModuleList)
              for index, child in enumerate(m) if any(True for _ in child.children())]
    if not composite:
        return listed
    counts = Counter(type(m) for _, m in composite)
    sizes = Counter()
    for _, m in composite:
        sizes[type(m)] += sum(p.numel() for p in m.parameters())
    block_class = max(counts, key=lambda c: (counts[c], sizes[c]))
    if counts[block_class] < 2:
        return listed
    names = [name for name, m in composite if type(m) is block_class]
    return [n for n in names if not any(n.startswith(other + ".") for other in names if other != n)]


def _checkpointed(forward: Any) -> Any:
    def run(*args: Any, **kwargs: Any) -> Any:
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)
    return run


def checkpoint_blocks(model: nn.Module) -> nn.Module:
    """A copy of ``model`` with every block (``find_blocks``) checkpointed."""
    copied = copy.deepcopy(model)
    names = find_blocks(copied)
    if not names:
        raise ValueError(f"{type(model).__name__} has no repeated composite block to checkpoint")
    for name in names:
        block = copied.get_submodule(name)
        block.forward = _checkpointed(block.forward)
    return copied


def checkpoint_sequentials(model: nn.Module) -> nn.Module:
    """A copy of ``model`` whose ``nn.Sequential`` submodules of two or more modules (outermost ones) run
    through ``checkpoint_sequential`` with round(√len) segments."""
    copied = copy.deepcopy(model)
    found = [(name, m) for name, m in copied.named_modules() if isinstance(m, nn.Sequential) and len(m) >= 2]
    names = [n for n, _ in found]
    outer = [(n, m) for n, m in found if not any(n.startswith(o + ".") for o in names if o != n and o)]
    if not outer:
        raise ValueError(f"{type(model).__name__} has no nn.Sequential of two or more modules")
    for _, sequential in outer:
        segments = max(1, round(math.sqrt(len(sequential))))

        def run(x: torch.Tensor, _sequential: nn.Sequential = sequential, _segments: int = segments) -> Any:
            if not torch.is_grad_enabled():
                return nn.Sequential.forward(_sequential, x)
            return checkpoint_sequential(list(_sequential), _segments, x, use_reentrant=False)
        sequential.forward = run
    return copied


def compile_with_budget(model: nn.Module, graph_compiler: str | None = None) -> nn.Module:
    """A ``torch.compile``d copy of ``model`` with the min-cut partitioner; compile and run it inside
    ``memory_budget(fraction)`` (the setting is read at compilation and is part of the compiled
    artifact's key, so steps outside it would compile again). Each copy gets a backend of its own, so
    that Dynamo's cache never hands one budget's code to another's copy and nothing compiled before
    (other peers, other budgets) is reset. ``graph_compiler``: None (``aot_eager_decomp_partition``: the
    partitioned graphs run op by op) or ``"inductor"`` (inductor's code for them, ``torch.compile``'s
    default)."""
    from torch._dynamo.backends.registry import lookup_backend
    if graph_compiler not in (None, "inductor"):
        raise ValueError(f"graph_compiler={graph_compiler!r}: use None (the graphs run op by op) or 'inductor'")
    partitioned = lookup_backend(graph_compiler or "aot_eager_decomp_partition")

    def backend(graph_module: Any, example_inputs: Any) -> Any:
        return partitioned(graph_module, example_inputs)
    return torch.compile(copy.deepcopy(model), backend=backend)


def memory_budget(fraction: float) -> Any:
    """The context in which ``torch.compile`` plans activations for ``fraction`` of the memory."""
    import torch._functorch.config as functorch_config
    return functorch_config.patch(activation_memory_budget=fraction)


def rockmate_status() -> str:
    """"available" or why Rockmate 2 cannot run here."""
    try:
        import rkgb  # noqa: F401
        import rockmate  # noqa: F401
    except ImportError as error:
        return f"not installed ({error}); pip install rockmate rkgb"
    return "available"
