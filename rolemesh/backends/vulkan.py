"""The ``vulkan`` backend: any GPU with a Vulkan driver, listed by ``vulkaninfo --summary``.

Devices are ``gpu:<i>`` with ``i`` the Vulkan physical-device index (the
``GPU<i>`` of vulkaninfo, the order ggml's ``GGML_VK_VISIBLE_DEVICES`` uses),
so names can skip numbers.

Decided: software devices (``PHYSICAL_DEVICE_TYPE_CPU``: llvmpipe, SwiftShader)
are never devices here, even when they are all there is; llama.cpp on llvmpipe
is slower than its own CPU code, so such a host should run ``backend: cpu`` and
discovery says so.  The same GPU listed twice (two drivers, e.g. RADV and
AMDVLK) is kept once, under its first index, matched by ``deviceUUID``.

Memory comes from the full ``vulkaninfo`` text: the device-local heaps' sizes
make the total, and with ``VK_EXT_memory_budget`` the heaps' ``budget`` (what
this process could still allocate, other processes' use already taken off)
gives the free figure.  Without the extension only the total is known.
"""

from __future__ import annotations

import re
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import attr
from twisted.internet.defer import Deferred
from zope.interface import implementer

from rolemesh.backends.commands import (
    PCI_VENDORS,
    CommandBackend,
    ParseError,
    ToolError,
    checked,
    first_line,
)
from rolemesh.base.devices import DeviceMetrics, DeviceRef
from rolemesh.base.interfaces import IBackendReactor, IDeviceBackend

VULKANINFO_SUMMARY = ("vulkaninfo", "--summary")
VULKANINFO_FULL = ("vulkaninfo",)

_GPU = re.compile(r"^GPU(\d+):\s*$")
_KEY = re.compile(r"^\s+(\w+)\s*=\s*(.*?)\s*$")
_HEAP = re.compile(r"^\s+memoryHeaps\[(\d+)\]:\s*$")
_HEAP_FIELD = re.compile(r"^\s+(size|budget|usage)\s*=\s*(\d+)")
CPU_TYPE = "PHYSICAL_DEVICE_TYPE_CPU"


@attr.s(auto_attribs=True, frozen=True)
class VulkanDevice:
    """One ``GPU<i>`` entry of ``vulkaninfo --summary``."""

    index: int
    name: str
    device_type: str
    vendor_id: Optional[int] = None
    uuid: Optional[str] = None
    driver: Optional[str] = None

    @property
    def vendor(self) -> Optional[str]:
        """The vendor's name where the PCI id is known, else the id in hex."""
        if self.vendor_id is None:
            return None
        return PCI_VENDORS.get(self.vendor_id, f"0x{self.vendor_id:04x}")

    @property
    def software(self) -> bool:
        """Whether this is a CPU (software) implementation such as llvmpipe."""
        return self.device_type == CPU_TYPE


@attr.s(auto_attribs=True, frozen=True)
class Heap:
    """One memory heap of one device; budget/usage only with VK_EXT_memory_budget."""

    size: int
    device_local: bool = False
    budget: Optional[int] = None
    usage: Optional[int] = None


def _hex(value: Optional[str]) -> Optional[int]:
    try:
        return int(value, 16) if value else None
    except ValueError:
        return None


def parse_vulkaninfo_summary(text: str) -> List[VulkanDevice]:
    """``vulkaninfo --summary`` -> the devices under its ``Devices:`` heading."""
    devices: List[VulkanDevice] = []
    in_devices = False
    current: Optional[int] = None
    fields: Dict[str, str] = {}

    def flush() -> None:
        if current is not None and "deviceName" in fields:
            devices.append(
                VulkanDevice(
                    index=current,
                    name=fields["deviceName"],
                    device_type=fields.get("deviceType", ""),
                    vendor_id=_hex(fields.get("vendorID")),
                    uuid=fields.get("deviceUUID"),
                    driver=fields.get("driverName"),
                )
            )

    for line in text.splitlines():
        if line.strip() == "Devices:":
            in_devices = True
            continue
        if not in_devices:
            continue
        gpu = _GPU.match(line)
        if gpu:
            flush()
            current, fields = int(gpu.group(1)), {}
            continue
        key = _KEY.match(line)
        if key and current is not None:
            fields[key.group(1)] = key.group(2)
    flush()
    if not in_devices and text.strip():
        raise ParseError(f"vulkaninfo: no Devices section: {first_line(text)}")
    return devices


def usable_devices(devices: Sequence[VulkanDevice]) -> Tuple[List[VulkanDevice], List[str]]:
    """(hardware devices, one note per device left out): no software devices, no duplicates."""
    chosen: List[VulkanDevice] = []
    notes: List[str] = []
    seen: Dict[str, int] = {}
    for device in devices:
        if device.software:
            notes.append(f"GPU{device.index} ({device.name}) is a software device; skipped")
            continue
        if device.uuid and device.uuid in seen:
            notes.append(f"GPU{device.index} ({device.name}) is GPU{seen[device.uuid]} again; skipped")
            continue
        if device.uuid:
            seen[device.uuid] = device.index
        chosen.append(device)
    return chosen, notes


def parse_vulkan_heaps(text: str) -> Dict[int, List[Heap]]:
    """Full ``vulkaninfo`` text -> the memory heaps of each ``GPU<i>`` section."""
    out: Dict[int, List[Heap]] = {}
    gpu: Optional[int] = None
    heap: Optional[Dict[str, Any]] = None

    def flush() -> None:
        if gpu is not None and heap is not None and "size" in heap:
            out.setdefault(gpu, []).append(
                Heap(
                    size=heap["size"],
                    device_local=heap.get("local", False),
                    budget=heap.get("budget"),
                    usage=heap.get("usage"),
                )
            )

    for line in text.splitlines():
        header = _GPU.match(line)
        if header:
            flush()
            gpu, heap = int(header.group(1)), None
            continue
        if gpu is None:
            continue
        start = _HEAP.match(line)
        if start:
            flush()
            heap = {}
            continue
        if heap is None:
            continue
        if line and not line[0].isspace():  # memoryTypes:, the next section...
            flush()
            heap = None
            continue
        field = _HEAP_FIELD.match(line)
        if field:
            heap[field.group(1)] = int(field.group(2))
        elif "MEMORY_HEAP_DEVICE_LOCAL_BIT" in line:
            heap["local"] = True
    flush()
    return out


def heap_totals(heaps: Sequence[Heap]) -> Tuple[Optional[int], Optional[int]]:
    """(total, free) bytes of the device-local heaps; free is None without a budget."""
    local = [h for h in heaps if h.device_local] or list(heaps)
    if not local:
        return None, None
    total = sum(h.size for h in local)
    if any(h.budget is None for h in local):
        return total, None
    free = sum(max(0, min(h.budget or 0, h.size) - (h.usage or 0)) for h in local)
    return total, free


@implementer(IDeviceBackend)
class VulkanBackend(CommandBackend):
    """GPUs with a Vulkan driver; software devices are left out."""

    name = "vulkan"

    def __init__(self, reactor: Optional[IBackendReactor] = None, **kwargs: Any) -> None:
        super().__init__(reactor, **kwargs)
        #: One-line remarks from discovery (skipped devices) for ``--check``.
        self.notes: List[str] = []

    def discover(self) -> List[DeviceRef]:
        """Hardware Vulkan devices; BackendUnavailable when there are none."""
        try:
            listed = parse_vulkaninfo_summary(self._discover_output(VULKANINFO_SUMMARY))
        except ParseError as e:
            raise self._unavailable(str(e)) from None
        chosen, self.notes = usable_devices(listed)
        if not chosen:
            if listed:
                names = ", ".join(d.name for d in listed)
                raise self._unavailable(f"only software devices found ({names}); use backend: cpu")
            raise self._unavailable("vulkaninfo lists no device")
        try:
            heaps = parse_vulkan_heaps(checked("vulkaninfo", self._run_sync(VULKANINFO_FULL, self._timeout)))
        except ToolError as e:
            self.notes.append(f"no memory figures: {e}")
            heaps = {}
        return [
            DeviceRef(
                backend="vulkan",
                index=d.index,
                name=f"gpu:{d.index}",
                uuid=d.uuid,
                vendor=d.vendor,
                model=d.name,
                memory_total_bytes=heap_totals(heaps.get(d.index, []))[0],
            )
            for d in chosen
        ]

    def sample(self, devices: Sequence[DeviceRef]) -> "Deferred[List[DeviceMetrics]]":
        """Memory per device from one full ``vulkaninfo`` run (free needs VK_EXT_memory_budget)."""
        devices = list(devices)

        def to_metrics(text: str) -> List[DeviceMetrics]:
            heaps = parse_vulkan_heaps(text)
            now = self._clock()
            out = []
            for d in devices:
                total, free = heap_totals(heaps.get(d.index, []))
                total = total if total is not None else d.memory_total_bytes
                out.append(
                    DeviceMetrics(
                        device=d.name,
                        sampled_at=now,
                        memory_total_bytes=total,
                        memory_used_bytes=None if free is None or total is None else max(0, total - free),
                        memory_free_bytes=free,
                    )
                )
            return out

        return self._sample_output(VULKANINFO_FULL).addCallback(to_metrics)

    def child_environment(self, device: DeviceRef, base_environment: Mapping[str, str]) -> Dict[str, str]:
        """The parent's environment plus ``GGML_VK_VISIBLE_DEVICES=<i>``."""
        env = dict(base_environment)
        env["GGML_VK_VISIBLE_DEVICES"] = str(device.index)
        return env

    def child_arguments(self, device: DeviceRef) -> Dict[str, Any]:
        """Nothing: one device is visible."""
        return {}
