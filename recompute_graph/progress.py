"""Progress bars for long work (profiling, budget sweeps, benchmarks): tqdm on stderr when enabled and
installed, else a bar that does nothing. Pure Python."""
from __future__ import annotations

import sys
from typing import Any

__all__ = ["progress_bar"]


class _SilentBar:
    def update(self, count: int = 1) -> None:
        pass

    def set_postfix_str(self, text: str) -> None:
        pass

    def close(self) -> None:
        pass

    def __enter__(self) -> "_SilentBar":
        return self

    def __exit__(self, *exc: Any) -> None:
        pass


def progress_bar(total: int, description: str, enabled: bool = True, unit: str = "node") -> Any:
    """A tqdm bar of ``total`` steps on stderr (removed when done), or a silent one when ``enabled`` is
    False or tqdm is missing. Use as a context manager; call ``update()`` per step."""
    if not enabled:
        return _SilentBar()
    try:
        from tqdm.auto import tqdm
    except ImportError:  # pragma: no cover - tqdm is a dependency, but a bar is never worth a crash
        return _SilentBar()
    return tqdm(total=total, desc=description, unit=unit, leave=False, file=sys.stderr, dynamic_ncols=True)
