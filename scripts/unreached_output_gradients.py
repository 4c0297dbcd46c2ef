"""What the zero gradients of unreached outputs cost a language model's step on the compiler path.

A ``transformers`` causal LM given ``labels`` returns its own loss beside the logits. Training
backpropagates the loss alone, so the logits get no gradient from outside. AOTAutograd's backward
takes one tangent per differentiable output, and autograd filled the logits' tangent with zeros when
the backward started, one logits-sized tensor that eager PyTorch never makes (1.244 of eager's peak,
session 46). The compiler path now folds such tangents away (``recompute_graph.zero_gradients``):
a store-all step should be at or under eager's peak.

Prints the allocator's peak of one eager step, of a store-all plan's step on the compiler path (its
prediction beside it), the logits' bytes, and ``torch.compile(backend="aot_eager")``'s peak (whose
min-cut partitioner also recomputes cheap ops, so it is not a store-all step). On the CPU by
``torch.profiler``'s memory events; ``--device cuda``: by ``torch.cuda.max_memory_allocated``.
Usage: ``python scripts/unreached_output_gradients.py [LAYERS] [WIDTH] [VOCAB] [TOKENS] [--device D]``
(default 4 256 50257 256, batch 2, cpu).
"""
from __future__ import annotations

import sys
import warnings
from typing import Any, Callable

import torch

import recompute_graph as rg
from models_zoo import third_party
from recompute_graph.losses import default_training_loss
from recompute_graph.measure import allocator_peak_memory


def peak_bytes(step: Callable[[], Any], device: torch.device) -> int:
    """Peak bytes ``step()`` allocates above what was allocated before it, by the allocator."""
    if device.type != "cuda":
        return allocator_peak_memory(step)
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    step()
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - before


def main(layers: int, width: int, vocab: int, tokens: int, device: torch.device) -> None:
    warnings.simplefilter("ignore")
    third_party.import_timm()  # (transformers' import needs torchvision's fake ops skipped)
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=layers, n_embd=width, n_head=4, n_positions=tokens,
                                       vocab_size=vocab)).to(device)
    ids = torch.randint(0, vocab, (2, tokens), device=device)
    call = dict(input_ids=ids, labels=ids)
    if device.type == "cuda":  # a first step: CUDA's kernels and workspaces set up
        default_training_loss(model(**call)).backward()
        model.zero_grad(set_to_none=True)
    eager = peak_bytes(lambda: default_training_loss(model(**call)).backward(), device)
    model.zero_grad(set_to_none=True)
    report = rg.verify(model, 1.0, example_kwargs=call, compiler=True,
                       **({"device": device} if device.type == "cuda" else {}))
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="aot_eager")
    default_training_loss(compiled(**call)).backward()
    model.zero_grad(set_to_none=True)
    aot_eager = peak_bytes(lambda: default_training_loss(compiled(**call)).backward(), device)
    logits = 2 * tokens * vocab * 4
    print(f"eager {eager:,} B; store-all on the compiler path {report.measured_peak_bytes:,} B "
          f"({report.measured_peak_bytes / eager:.3f} of eager, predicted {report.predicted_peak_bytes:,} B); "
          f"logits {logits:,} B; excess {report.measured_peak_bytes - eager:,} B; "
          f"aot_eager {aot_eager:,} B ({aot_eager / eager:.3f})")


if __name__ == "__main__":
    arguments = sys.argv[1:]
    where = torch.device("cpu")
    if "--device" in arguments:
        at = arguments.index("--device")
        where = torch.device(arguments[at + 1])
        del arguments[at:at + 2]
    values = [int(a) for a in arguments]
    main(*(values + [4, 256, 50257, 256][len(values):]), device=where)
