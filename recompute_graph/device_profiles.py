"""Device throughputs for FLOP-based time estimates (``timing="flops"``, meta planning, the joint graph's
pricing): a roofline, ``seconds = max(flops / flops_per_second, bytes / bytes_per_second)``."""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["DeviceProfile", "DEVICE_PROFILES"]


@dataclass(frozen=True)
class DeviceProfile:
    """Throughput of a device for FLOP-based time estimates (roofline: compute- or memory-bound)."""

    name: str
    flops_per_second: float
    bytes_per_second: float

    def seconds(self, flops: int, bytes_moved: int) -> float:
        return max(flops / self.flops_per_second, bytes_moved / self.bytes_per_second)


DEVICE_PROFILES = {
    # Sustained (not peak) rates, rough: good enough to rank recomputation choices.
    "cpu": DeviceProfile("cpu", 5.0e10, 1.0e10),
    "a100": DeviceProfile("a100", 1.5e14, 1.5e12),
    "h100": DeviceProfile("h100", 4.0e14, 2.5e12),
    "h200": DeviceProfile("h200", 4.0e14, 3.6e12),
}
