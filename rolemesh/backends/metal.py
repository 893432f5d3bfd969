"""The ``metal`` backend: the Mac's GPU as one device, ``gpu:0``.

llama.cpp's Metal backend uses the system's default GPU, so there is exactly
one device and nothing to pin.  On Apple silicon the GPU shares the host's
memory: its total is ``sysctl -n hw.memsize`` and its free figure is what
``vm_stat`` counts as free plus inactive pages.  Utilization, temperature and
power need root (``powermetrics``) and are left unknown.
"""

from __future__ import annotations

import re
from typing import Any, Dict, List, Mapping, Optional, Sequence

import attr
from twisted.internet.defer import Deferred, succeed
from zope.interface import implementer

from rolemesh.backends.commands import (
    CommandBackend,
    ParseError,
    first_line,
    load_json,
)
from rolemesh.base.devices import DeviceMetrics, DeviceRef
from rolemesh.base.interfaces import IBackendReactor, IDeviceBackend

SYSTEM_PROFILER = ("system_profiler", "SPDisplaysDataType", "-json")
SYSCTL_MEMSIZE = ("sysctl", "-n", "hw.memsize")
VM_STAT = ("vm_stat",)

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?B)\b", re.IGNORECASE)
_SIZES = {"B": 1, "KB": 1 << 10, "MB": 1 << 20, "GB": 1 << 30, "TB": 1 << 40}
_VENDORS = {"apple": "Apple", "amd": "AMD", "ati": "AMD", "intel": "Intel", "nvidia": "NVIDIA"}
_PAGE_SIZE = re.compile(r"page size of (\d+) bytes")
_PAGES = re.compile(r"^Pages ([^:]+):\s+(\d+)\.?\s*$")


@attr.s(auto_attribs=True, frozen=True)
class MacGpu:
    """One GPU as ``system_profiler SPDisplaysDataType`` describes it."""

    model: str
    vendor: Optional[str] = None
    vram_bytes: Optional[int] = None
    unified: bool = True
    cores: Optional[int] = None


def _size(text: Any) -> Optional[int]:
    match = _SIZE.match(str(text or ""))
    if not match:
        return None
    return int(float(match.group(1)) * _SIZES[match.group(2).upper()])


def _vendor(raw: Any) -> Optional[str]:
    text = str(raw or "").lower().replace("sppci_vendor_", "")
    for key, name in _VENDORS.items():
        if text.startswith(key):
            return name
    return str(raw) if raw else None


def parse_system_profiler(text: str) -> List[MacGpu]:
    """``system_profiler SPDisplaysDataType -json`` -> the GPUs it lists (Apple silicon: unified)."""
    data = load_json(text, "system_profiler")
    entries = data.get("SPDisplaysDataType") if isinstance(data, Mapping) else None
    if not isinstance(entries, list):
        raise ParseError("system_profiler: no SPDisplaysDataType list in its output")
    gpus = []
    for entry in entries:
        if not isinstance(entry, Mapping):
            continue
        model = entry.get("sppci_model") or entry.get("_name")
        if not model:
            continue
        vendor = _vendor(entry.get("spdisplays_vendor") or entry.get("sppci_vendor"))
        dedicated = _size(entry.get("spdisplays_vram") or entry.get("_spdisplays_vram"))
        cores = str(entry.get("sppci_cores") or "")
        gpus.append(
            MacGpu(
                model=str(model),
                vendor=vendor,
                vram_bytes=dedicated,
                unified=dedicated is None,
                cores=int(cores) if cores.isdigit() else None,
            )
        )
    return gpus


def pick_gpu(gpus: Sequence[MacGpu]) -> Optional[MacGpu]:
    """The GPU Metal's default device is: Apple silicon, else the discrete GPU, else the first."""
    for gpu in gpus:
        if gpu.vendor == "Apple":
            return gpu
    for gpu in gpus:
        if not gpu.unified:
            return gpu
    return gpus[0] if gpus else None


def parse_memsize(text: str) -> int:
    """``sysctl -n hw.memsize`` -> bytes."""
    value = text.strip()
    if not value.isdigit():
        raise ParseError(f"sysctl hw.memsize: expected a byte count, got: {first_line(text) or 'no output'}")
    return int(value)


def parse_vm_stat(text: str) -> Dict[str, int]:
    """``vm_stat`` -> bytes per page kind (``free``, ``inactive``, ``speculative``...)."""
    page = _PAGE_SIZE.search(text)
    if not page:
        raise ParseError(f"vm_stat: no page size in its output: {first_line(text) or 'no output'}")
    size = int(page.group(1))
    out = {}
    for line in text.splitlines():
        match = _PAGES.match(line.strip())
        if match:
            out[match.group(1).strip().lower()] = int(match.group(2)) * size
    return out


def available_bytes(pages: Mapping[str, int]) -> Optional[int]:
    """Memory the GPU could still get: free plus inactive pages (what psutil calls available)."""
    if "free" not in pages:
        return None
    return pages["free"] + pages.get("inactive", 0)


@implementer(IDeviceBackend)
class MetalBackend(CommandBackend):
    """The Mac's default GPU as ``gpu:0``."""

    name = "metal"

    def __init__(self, reactor: Optional[IBackendReactor] = None, **kwargs: Any) -> None:
        super().__init__(reactor, **kwargs)
        self._unified: Optional[bool] = None

    def discover(self) -> List[DeviceRef]:
        """One device; BackendUnavailable off macOS (no system_profiler) or when it lists no GPU."""
        try:
            gpus = parse_system_profiler(self._discover_output(SYSTEM_PROFILER))
        except ParseError as e:
            raise self._unavailable(str(e)) from None
        gpu = pick_gpu(gpus)
        if gpu is None:
            raise self._unavailable("system_profiler lists no GPU")
        total = gpu.vram_bytes
        if gpu.unified:
            try:
                total = parse_memsize(self._discover_output(SYSCTL_MEMSIZE))
            except ParseError as e:
                raise self._unavailable(str(e)) from None
        self._unified = gpu.unified
        return [
            DeviceRef(
                backend="metal",
                index=0,
                name="gpu:0",
                vendor=gpu.vendor,
                model=gpu.model,
                memory_total_bytes=total,
            )
        ]

    def sample(self, devices: Sequence[DeviceRef]) -> "Deferred[List[DeviceMetrics]]":
        """Unified memory from vm_stat; a discrete GPU reports only its total."""
        devices = list(devices)
        unified = self._unified if self._unified is not None else all(d.vendor == "Apple" for d in devices)
        if not unified:
            now = self._clock()
            return succeed(
                [
                    DeviceMetrics(device=d.name, sampled_at=now, memory_total_bytes=d.memory_total_bytes)
                    for d in devices
                ]
            )

        def to_metrics(text: str) -> List[DeviceMetrics]:
            free = available_bytes(parse_vm_stat(text))
            now = self._clock()
            out = []
            for d in devices:
                total = d.memory_total_bytes
                used = None if total is None or free is None else max(0, total - free)
                out.append(
                    DeviceMetrics(
                        device=d.name,
                        sampled_at=now,
                        memory_total_bytes=total,
                        memory_used_bytes=used,
                        memory_free_bytes=None if free is None else min(free, total or free),
                    )
                )
            return out

        return self._sample_output(VM_STAT).addCallback(to_metrics)

    def child_environment(self, device: DeviceRef, base_environment: Mapping[str, str]) -> Dict[str, str]:
        """The parent's environment unchanged: there is one GPU and nothing to pin."""
        return dict(base_environment)

    def child_arguments(self, device: DeviceRef) -> Dict[str, Any]:
        """Nothing."""
        return {}


__all__ = [
    "MacGpu",
    "MetalBackend",
    "SYSCTL_MEMSIZE",
    "SYSTEM_PROFILER",
    "VM_STAT",
    "available_bytes",
    "parse_memsize",
    "parse_system_profiler",
    "parse_vm_stat",
    "pick_gpu",
]
