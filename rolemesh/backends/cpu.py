"""The ``cpu`` backend: the host as one device, or split into core groups.

Big CPU servers run one llama-server per NUMA node or core group; with
``cpu_devices: numa`` or ``cpu_devices: N`` each group is its own device and
its child is pinned with ``--cpu-range`` and ``--threads``.  All cpu devices
share the host's memory figures.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from twisted.internet.defer import Deferred, succeed
from zope.interface import implementer

from rolemesh.backends import BackendUnavailable
from rolemesh.devices import DeviceMetrics, DeviceRef
from rolemesh.interfaces import IDeviceBackend


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
        values = [int(v) for v in fields[1:]]
        idle = values[3] + (values[4] if len(values) > 4 else 0)  # idle + iowait
        total = sum(values[:8])  # guest time is already counted in user/nice
        result[-1 if name == "" else int(name)] = (total - idle, total)
    return result


def parse_cpu_list(text: str) -> Tuple[int, ...]:
    """``"0-3,8,10-11"`` (sysfs cpulist format) -> ``(0, 1, 2, 3, 8, 10, 11)``."""
    cpus: List[int] = []
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        cpus.extend(range(int(lo), int(hi or lo) + 1))
    return tuple(cpus)


def split_cores(cores: Sequence[int], groups: int) -> List[Tuple[int, ...]]:
    """Split ``cores`` into ``groups`` contiguous groups as evenly as possible."""
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
    return f"{lo}-{hi}" if hi - lo + 1 == len(cpus) else None


def cpu_mask(cpus: Sequence[int]) -> str:
    """``--cpu-mask`` takes a hex bit mask of the allowed cores."""
    mask = 0
    for c in cpus:
        mask |= 1 << c
    return f"{mask:x}"


def _read(path: str) -> str:
    with open(path, encoding="ascii", errors="replace") as f:
        return f.read()


@implementer(IDeviceBackend)
class CpuBackend:
    """The host's CPUs as one or more devices."""

    name = "cpu"

    def __init__(
        self,
        cpu_devices: Any = None,
        reactor: Any = None,
        read: Callable[[str], str] = _read,
        allowed_cores: Optional[Callable[[], Sequence[int]]] = None,
        sysfs_root: str = "/sys",
    ) -> None:
        self._cpu_devices = cpu_devices
        self._reactor = reactor
        self._read = read
        self._allowed = allowed_cores or (lambda: sorted(os.sched_getaffinity(0)))
        self._sysfs = sysfs_root
        self._last_stat: Dict[int, Tuple[int, int]] = {}

    def _clock(self) -> float:
        if self._reactor is None:
            from twisted.internet import reactor

            self._reactor = reactor
        return self._reactor.seconds()

    def _groups(self) -> List[Tuple[int, ...]]:
        allowed = tuple(self._allowed())
        if self._cpu_devices is None:
            return [()]
        if self._cpu_devices == "numa":
            node_dir = os.path.join(self._sysfs, "devices", "system", "node")
            try:
                nodes = sorted(
                    int(n[4:]) for n in os.listdir(node_dir) if n.startswith("node") and n[4:].isdigit()
                )
            except OSError:
                nodes = []
            groups = []
            for n in nodes:
                cpus = parse_cpu_list(self._read(os.path.join(node_dir, f"node{n}", "cpulist")))
                cpus = tuple(c for c in cpus if c in allowed)
                if cpus:
                    groups.append(cpus)
            return groups or [allowed]
        return split_cores(allowed, int(self._cpu_devices))

    def discover(self) -> List[DeviceRef]:
        total = parse_meminfo(self._read("/proc/meminfo")).get("MemTotal")
        model = None
        try:
            for line in self._read("/proc/cpuinfo").splitlines():
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
        except OSError:
            pass
        return [
            DeviceRef(
                backend="cpu",
                index=i,
                name=f"cpu:{i}",
                vendor=None,
                model=model,
                memory_total_bytes=total,
                cpus=cpus,
            )
            for i, cpus in enumerate(self._groups())
        ]

    def sample(self, devices: Sequence[DeviceRef]) -> "Deferred[List[DeviceMetrics]]":
        now = self._clock()
        mem = parse_meminfo(self._read("/proc/meminfo"))
        stat = parse_proc_stat(self._read("/proc/stat"))
        previous, self._last_stat = self._last_stat, stat
        total = mem.get("MemTotal")
        free = mem.get("MemAvailable", mem.get("MemFree"))
        out = []
        for device in devices:
            cpus = device.cpus or (-1,)
            busy = sum(stat[c][0] - previous.get(c, (0, 0))[0] for c in cpus if c in stat)
            whole = sum(stat[c][1] - previous.get(c, (0, 0))[1] for c in cpus if c in stat)
            util = round(100.0 * busy / whole, 1) if previous and whole > 0 else None
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
        return dict(base_environment)

    def child_arguments(self, device: DeviceRef) -> Dict[str, Any]:
        if not device.cpus:
            return {}
        rng = cpu_range(device.cpus)
        pin = {"cpu-range": rng} if rng else {"cpu-mask": cpu_mask(device.cpus)}
        return {**pin, "threads": len(device.cpus)}
