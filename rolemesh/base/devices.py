"""Immutable records describing devices and their sampled metrics."""

from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

import attr


@attr.s(auto_attribs=True, frozen=True)
class DeviceRef:
    """One device a llama-server child can be pinned to.

    ``name`` is what config, logs and the API use (``gpu:0``, ``cpu:1``);
    ``index`` is the backend's own index used for pinning.  ``cpus`` is the
    core set of a ``cpu`` device (empty = the whole host).
    """

    backend: str
    index: int
    name: str
    uuid: Optional[str] = None
    vendor: Optional[str] = None
    model: Optional[str] = None
    memory_total_bytes: Optional[int] = None
    cpus: Tuple[int, ...] = ()

    def to_json(self) -> Dict[str, Any]:
        data = attr.asdict(self)
        data["cpus"] = list(self.cpus)
        return data


@attr.s(auto_attribs=True, frozen=True)
class DeviceMetrics:
    """One metrics sample of one device; ``None`` = the backend cannot tell.

    ``sampled_at`` is a POSIX timestamp from the reactor's clock.  A failed
    sample keeps the last good figures and sets ``stale`` with the error.
    """

    device: str
    sampled_at: float
    memory_total_bytes: Optional[int] = None
    memory_used_bytes: Optional[int] = None
    memory_free_bytes: Optional[int] = None
    utilization_pct: Optional[float] = None
    temperature_c: Optional[float] = None
    power_w: Optional[float] = None
    stale: bool = False
    error: Optional[str] = None

    def to_json(self, now: Optional[float] = None) -> Dict[str, Any]:
        data = attr.asdict(self)
        if now is not None:
            data["sample_age_s"] = round(max(0.0, now - self.sampled_at), 3)
        return data

    def marked_stale(self, error: str) -> "DeviceMetrics":
        return attr.evolve(self, stale=True, error=error)
