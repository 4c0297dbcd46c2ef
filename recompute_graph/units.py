"""Byte sizes: parsing ``"1.5GiB"`` / ``"800MB"`` and formatting for people; budgets (bytes, a size string or
a fraction of what a store-all step needs, docs/concepts.md)."""
from __future__ import annotations

import math
import re
from typing import Union

__all__ = ["parse_bytes", "format_bytes", "Budget", "parse_budget"]

Budget = Union[int, float, str]

_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_bytes(text: str) -> int:
    """Parse a size such as ``"1.5GiB"``, ``"800MB"``, ``"4096"`` into whole bytes (rounded down).

    Decimal units (kB, MB, GB, TB) are powers of 1000, binary ones (KiB, MiB, GiB, TiB) powers of 1024.
    Raises ``ValueError`` naming the accepted forms when the text is not a positive size.
    """
    match = _SIZE.match(text)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise ValueError(f"cannot parse size {text!r}: use a number of bytes optionally followed by one of "
                         "B, kB, MB, GB, TB (powers of 1000) or KiB, MiB, GiB, TiB (powers of 1024), "
                         "e.g. '1.5GiB' or '800MB'")
    value = float(match.group(1)) * _UNITS[unit]
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"size {text!r} must be positive")
    return int(value)


def format_bytes(n: float) -> str:
    """``1536 -> '1.5 KiB'``: binary units, three significant digits."""
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        # 1023.7 MiB would print as "1.02e+03 MiB" at three digits: it is the next unit's 1 instead
        if unit == "TiB" or abs(n) < (1024 if unit == "B" else 999.5):
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.3g} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


_BUDGET_FORMS = ("a positive int of bytes, a size string such as '1.5GiB' or '800MB', or a float in "
                 "(0, 1] meaning that fraction of the store-all peak")


def parse_budget(budget: Budget) -> tuple[str, float]:
    """``("bytes", n)`` or ``("fraction", f)``; ValueError listing the accepted forms otherwise."""
    if isinstance(budget, bool):
        raise ValueError(f"budget {budget!r} is not valid: use {_BUDGET_FORMS}")
    if isinstance(budget, int):
        if budget <= 0:
            raise ValueError(f"budget {budget} must be positive: use {_BUDGET_FORMS}")
        return "bytes", budget
    if isinstance(budget, float):
        if not (math.isfinite(budget) and 0 < budget <= 1):
            raise ValueError(f"budget {budget!r} is not valid: use {_BUDGET_FORMS}")
        return "fraction", budget
    if isinstance(budget, str):
        try:
            return "bytes", parse_bytes(budget)
        except ValueError:
            raise ValueError(f"cannot parse budget {budget!r}: use {_BUDGET_FORMS}") from None
    raise ValueError(f"budget of type {type(budget).__name__} is not valid: use {_BUDGET_FORMS}")
