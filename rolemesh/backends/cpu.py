"""The ``cpu`` backend: the host as one device, or split into core groups.

Big CPU servers run one llama-server per NUMA node or core group; with
``cpu_devices: numa`` or ``cpu_devices: N`` each group is its own device and
its child is pinned with ``--cpu-range`` (or ``--cpu-mask`` for a group that is
not contiguous) and ``--threads``.  All cpu devices share the host's memory
figures.  Only the cores this process may run on (its affinity) are split, so
a container limited to some cores splits those.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from twisted.internet.defer import Deferred, succeed
from twisted.internet.interfaces import IReactorTime
from zope.interface import implementer

from rolemesh.backends import BackendUnavailable
from rolemesh.base.devices import DeviceMetrics, DeviceRef
from rolemesh.base.interfaces import IDeviceBackend
from rolemesh.config.file import CpuDevices, check_cpu_devices
from rolemesh.event_loop.reactor import UsesReactor


def parse_meminfo(text: str) -> Dict[str, int]:
    """``/proc/meminfo`` -> bytes per field (``MemTotal``, ``MemAvailable``...)."""
    result = {}
    for line in text.splitlines():
        name, _, rest = line.partition(":")
        parts = rest.split()
        if not parts:
            continue
        try:
            value = int(parts[0])
        except ValueError:
            continue
        if len(parts) > 1 and parts[1].lower() == "kb":
            value *= 1024
        result[name.strip()] = value
    return result


def parse_proc_stat(text: str) -> Dict[int, Tuple[int, int]]:
    """``/proc/stat`` -> ``{cpu: (busy_jiffies, total_jiffies)}``; -1 is all CPUs."""
    result = {}
    for line in text.splitlines():
        if not line.startswith("cpu"):
            continue
        fields = line.split()
        name = fields[0][3:]
        try:
            cpu = -1 if name == "" else int(name)
            values = [int(v) for v in fields[1:]]
        except ValueError:
            continue
        if len(values) < 4:
            continue
        idle = values[3] + (values[4] if len(values) > 4 else 0)  # idle + iowait
        total = sum(values[:8])  # guest time is already counted in user/nice
        result[cpu] = (total - idle, total)
    return result


def parse_cpu_list(text: str) -> Tuple[int, ...]:
    """``"0-3,8,10-11"`` (sysfs cpulist format) -> ``(0, 1, 2, 3, 8, 10, 11)``."""
    cpus: List[int] = []
    for part in text.strip().split(","):
        part = part.strip()
        if not part:
            continue
        lo, _, hi = part.partition("-")
        cpus.extend(range(int(lo), int(hi or lo) + 1))
    return tuple(cpus)


def parse_cpuinfo(text: str) -> Tuple[Optional[str], Optional[str]]:
    """``/proc/cpuinfo`` -> (vendor, model name) of the first processor; None where absent."""
    vendor = model = None
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key, value = key.strip(), value.strip()
        if key == "vendor_id" and vendor is None:
            vendor = value or None
        elif key == "model name" and model is None:
            model = value or None
        if vendor and model:
            break
    return vendor, model


def split_cores(cores: Sequence[int], groups: int) -> List[Tuple[int, ...]]:
    """Split ``cores`` into ``groups`` contiguous groups as evenly as possible."""
    check_cpu_devices("cpu_devices", groups)
    if groups > len(cores):
        raise BackendUnavailable(
            f"cpu_devices: {groups} groups asked for, but only {len(cores)} cores are available"
        )
    size, extra = divmod(len(cores), groups)
    out, start = [], 0
    for i in range(groups):
        end = start + size + (1 if i < extra else 0)
        out.append(tuple(cores[start:end]))
        start = end
    return out


def cpu_range(cpus: Sequence[int]) -> Optional[str]:
    """``--cpu-range`` takes ``lo-hi``; a non-contiguous set returns None."""
    if not cpus:
        return None
    lo, hi = min(cpus), max(cpus)
    return f"{lo}-{hi}" if hi - lo + 1 == len(set(cpus)) else None


def cpu_mask(cpus: Sequence[int]) -> str:
    """``--cpu-mask`` takes a hex bit mask of the allowed cores."""
    mask = 0
    for c in cpus:
        mask |= 1 << c
    return f"{mask:x}"


def numa_groups(node_cpus: Mapping[int, Sequence[int]], allowed: Sequence[int]) -> List[Tuple[int, ...]]:
    """One group per NUMA node with allowed cores, in node order; none at all -> one group of all."""
    permitted = set(allowed)
    groups = []
    for node in sorted(node_cpus):
        cpus = tuple(c for c in node_cpus[node] if c in permitted)
        if cpus:
            groups.append(cpus)
    return groups or [tuple(allowed)]


def _read(path: str) -> str:
    with open(path, encoding="ascii", errors="replace") as f:
        return f.read()


def _allowed_cores() -> List[int]:
    getaffinity = getattr(os, "sched_getaffinity", None)
    if getaffinity is not None:
        return sorted(getaffinity(0))
    return list(range(os.cpu_count() or 1))


def _sysconf_memory() -> Optional[int]:
    try:
        return int(os.sysconf("SC_PHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):
        return None


#: llama-server's "offload to no device" (``--device none``).
NO_OFFLOAD: Dict[str, Any] = {"device": "none"}
#: CUDA's "no device visible".  (Other GPU runtimes are not hidden: their
#: children keep their buffers in RAM through ``--device none``.)
HIDE_GPUS: Dict[str, str] = {"CUDA_VISIBLE_DEVICES": ""}


@implementer(IDeviceBackend)
class CpuBackend(UsesReactor[IReactorTime]):
    """The host's CPUs as one or more devices."""

    name = "cpu"

    def __init__(
        self,
        cpu_devices: Optional[CpuDevices] = None,
        reactor: Optional[IReactorTime] = None,
        read: Callable[[str], str] = _read,
        allowed_cores: Optional[Callable[[], Sequence[int]]] = None,
        sysfs_root: str = "/sys",
        proc_root: str = "/proc",
    ) -> None:
        self._cpu_devices = None if cpu_devices is None else check_cpu_devices("cpu_devices", cpu_devices)
        self._reactor = reactor
        self._read = read
        self._allowed = allowed_cores or _allowed_cores
        self._sysfs = sysfs_root
        self._proc = proc_root
        self._last_stat: Dict[int, Tuple[int, int]] = {}

    def _clock(self) -> float:
        return float(self.reactor.seconds())

    def _proc_text(self, name: str) -> Optional[str]:
        try:
            return self._read(os.path.join(self._proc, name))
        except OSError:
            return None

    def _node_cpus(self) -> Dict[int, Tuple[int, ...]]:
        node_dir = os.path.join(self._sysfs, "devices", "system", "node")
        try:
            names = os.listdir(node_dir)
        except OSError:
            return {}
        nodes = {}
        for entry in names:
            if not (entry.startswith("node") and entry[4:].isdigit()):
                continue
            try:
                nodes[int(entry[4:])] = parse_cpu_list(self._read(os.path.join(node_dir, entry, "cpulist")))
            except (OSError, ValueError):
                continue
        return nodes

    def _groups(self) -> List[Tuple[int, ...]]:
        allowed = tuple(self._allowed())
        if self._cpu_devices is None:
            return [()]
        if self._cpu_devices == "numa":
            return numa_groups(self._node_cpus(), allowed)
        return split_cores(allowed, int(self._cpu_devices))

    def _memory(self) -> Tuple[Optional[int], Optional[int]]:
        text = self._proc_text("meminfo")
        if text is None:
            return _sysconf_memory(), None
        mem = parse_meminfo(text)
        return mem.get("MemTotal"), mem.get("MemAvailable", mem.get("MemFree"))

    def discover(self) -> List[DeviceRef]:
        """``cpu:0`` (the whole host), or one device per NUMA node / core group."""
        total, _ = self._memory()
        vendor, model = parse_cpuinfo(self._proc_text("cpuinfo") or "")
        stat = self._proc_text("stat")
        self._last_stat = parse_proc_stat(stat) if stat else {}  # so the first sample has a delta
        return [
            DeviceRef(
                backend="cpu",
                index=i,
                name=f"cpu:{i}",
                vendor=vendor,
                model=model,
                memory_total_bytes=total,
                cpus=cpus,
            )
            for i, cpus in enumerate(self._groups())
        ]

    def sample(self, devices: Sequence[DeviceRef]) -> "Deferred[List[DeviceMetrics]]":
        """Host memory for every device; utilization of each device's cores since the last sample."""
        now = self._clock()
        total, free = self._memory()
        text = self._proc_text("stat")
        stat = parse_proc_stat(text) if text else {}
        previous, self._last_stat = self._last_stat, stat
        out = []
        for device in devices:
            cpus = device.cpus or (-1,)
            busy = sum(stat[c][0] - previous.get(c, (0, 0))[0] for c in cpus if c in stat and c in previous)
            whole = sum(stat[c][1] - previous.get(c, (0, 0))[1] for c in cpus if c in stat and c in previous)
            util = round(min(100.0, max(0.0, 100.0 * busy / whole)), 1) if whole > 0 else None
            out.append(
                DeviceMetrics(
                    device=device.name,
                    sampled_at=now,
                    memory_total_bytes=total,
                    memory_used_bytes=None if total is None or free is None else total - free,
                    memory_free_bytes=free,
                    utilization_pct=util,
                )
            )
        return succeed(out)

    def child_environment(self, device: DeviceRef, base_environment: Mapping[str, str]) -> Dict[str, str]:
        """The parent's environment with no NVIDIA GPU visible: with ``--device
        none`` alone a CUDA build still opens a CUDA context on GPU 0 (518 MiB
        of an H200's memory, measured), which no device's figures count."""
        return {**base_environment, **HIDE_GPUS}

    def child_arguments(self, device: DeviceRef) -> Dict[str, Any]:
        """``device: none`` (a GPU build of llama-server would otherwise offload
        to whatever GPU it finds, outside the memory this device accounts for),
        plus ``cpu-range`` (or ``cpu-mask``) and ``threads`` for a core group."""
        if not device.cpus:
            return dict(NO_OFFLOAD)
        rng = cpu_range(device.cpus)
        pin = {"cpu-range": rng} if rng else {"cpu-mask": cpu_mask(device.cpus)}
        return {**NO_OFFLOAD, **pin, "threads": len(device.cpus)}
