"""Arguments and output shared by the subcommands."""
from __future__ import annotations

import argparse
import json
from typing import Any

__all__ = ["budget_argument", "add_model_arguments", "add_output_flags", "print_json", "profile_positional_model"]


def budget_argument(text: str) -> Any:
    """``--budget``: an int of bytes, a size string (``1.5GiB``) or a fraction in (0, 1]."""
    if text.isdigit():
        return int(text)
    try:
        value = float(text)
    except ValueError:
        from ..units import parse_bytes
        try:
            parse_bytes(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"cannot parse budget {text!r}: give bytes (123456789), a size "
                                             "(1.5GiB, 800MB) or a fraction in (0, 1]") from None
        return text
    if 0 < value <= 1:
        return value
    raise argparse.ArgumentTypeError(f"budget {text!r}: a float must be a fraction in (0, 1]; give bytes as "
                                     "an integer or a size such as 1.5GiB")


def add_model_arguments(parser: argparse.ArgumentParser, default: str | None = None) -> None:
    """MODEL (a zoo name or package.module:factory), --preset, --size KEY=VALUE, --timing, --unroll-rnns."""
    kwargs: dict[str, Any] = {"nargs": "?", "default": default} if default else {}
    parser.add_argument("model", metavar="MODEL", **kwargs,
                        help="a zoo model (resnet18/34/50/101/152, unet, gpt2, vgg19, mlp, rnn) or "
                             "package.module:factory returning (model, example_inputs)"
                             + (f" (default {default})" if default else ""))
    parser.add_argument("--preset", default="small", help="zoo size preset: tiny, small or paper (default small)")
    parser.add_argument("--size", action="append", default=[], metavar="KEY=VALUE",
                        help="override a size of the zoo model or pass a factory argument (repeatable)")
    parser.add_argument("--timing", choices=("measure", "flops"), default="measure",
                        help="node times: measured (default) or estimated from FLOPs")
    parser.add_argument("--unroll-rnns", action="store_true",
                        help="plan nn.LSTM/GRU/RNN step by step (optimize(..., unroll_rnns=True))")


def loaded_model(args: argparse.Namespace) -> tuple[Any, Any, str]:
    """``model_specs.load_model`` for MODEL, --preset and --size, with its recurrent layers made step
    loops under --unroll-rnns; ``(model, example_inputs, label)``."""
    from ..model_specs import load_model, parse_sizes
    from ..unrolled_rnn import unroll_rnns
    model, inputs, label = load_model(args.model, args.preset, parse_sizes(args.size))
    if getattr(args, "unroll_rnns", False):
        unroll_rnns(model)
    return model, inputs, label


def add_output_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print one JSON object on the last line")
    parser.add_argument("-q", "--quiet", action="store_true", help="no progress bars")


def print_json(result: dict[str, Any]) -> None:
    print(json.dumps(result))


def profile_positional_model(args: argparse.Namespace, command: str, solvers: list[str], device: Any = None
                             ) -> tuple[Any, Any, str, Any, Any]:
    """For ``bench`` and ``plot``: check the solver names (``auto`` aside), load MODEL (which must take
    positional inputs), move it and its tensor inputs to ``device`` when given, put it in training mode
    and profile it there; ``(model, inputs, label, traced, graph)``."""
    from ..costs import profile_model
    from ..solvers import get_solver
    for name in solvers:
        if name != "auto":
            get_solver(name)
    model, inputs, label = loaded_model(args)
    if isinstance(inputs, dict):
        raise ValueError(f"{args.model} returns keyword inputs: `{command}` takes models called with positional "
                         "inputs; `recompute-graph plan` and optimize(..., example_kwargs=) take keyword inputs")
    if device is not None:
        import torch
        model = model.to(device)
        inputs = tuple(t.to(device) if isinstance(t, torch.Tensor) else t for t in inputs)
    model.train()
    traced, graph = profile_model(model, inputs, timing=args.timing, progress=not args.quiet, name=label)
    return model, inputs, label, traced, graph
