"""Which third-party models change a plain Python value of theirs in forward, and whether at every call.

Runs each conformance model's forward twice in training mode and prints the plain attributes (int, float,
str, bool, None) the first and the second call changed. ``optimize()`` refuses a model whose second call
changes one again (``ChangingStateError``: a step counter in forward); a value set by the first call only
is planned. Usage: ``python scripts/changing_state_scan.py [NAME ...]`` (default: every conformance model).
"""
from __future__ import annotations

import sys
import warnings

import torch

from models_zoo import third_party
from recompute_graph.model_state import PlainValues, preserved_state


def main(names: list[str]) -> None:
    warnings.simplefilter("ignore")
    third_party.import_timm()
    every_call = []
    for name in names or list(third_party.CONFORMANCE_MODELS):
        if not third_party.available(name):
            print(f"{name}: not installed")
            continue
        model, call = third_party.build(name)
        args, kwargs = (call, {}) if isinstance(call, tuple) else ((), call)
        model.train()
        with preserved_state(model, rng=True), torch.enable_grad():
            before = PlainValues(model)
            model(*args, **kwargs)
            first = PlainValues(model)
            model(*args, **kwargs)
            changed = first.changed_since(before), PlainValues(model).changed_since(first)
        if changed[1]:
            every_call.append(name)
        if any(changed):
            print(f"{name}: first call {changed[0][:4]}; second call {changed[1][:4]}", flush=True)
    print(f"{len(names or third_party.CONFORMANCE_MODELS)} models; changed at every call: {every_call or 'none'}")


if __name__ == "__main__":
    main(sys.argv[1:])
