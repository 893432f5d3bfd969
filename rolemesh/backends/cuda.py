"""The ``cuda`` backend: NVIDIA GPUs through NVML (pynvml), ``nvidia-smi`` as the fallback.

NVML is a blocking C library, so every sample runs in the reactor's thread
pool; only one NVML sample is in flight at a time, so a wedged driver cannot
eat the pool.  ``pynvml`` is imported when the backend discovers devices, never
at module import, and the agent works without it as long as ``nvidia-smi``
answers.

Devices are ``gpu:<i>`` with ``i`` the NVML index, which is PCI bus order; a
GPU in MIG mode is replaced by its MIG instances, ``gpu:<i>.<j>``, which are
pinned by their ``MIG-...`` uuid.  CUDA numbers devices fastest-first unless
told otherwise, so the pin also sets ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` to make
``CUDA_VISIBLE_DEVICES=<i>`` mean the GPU NVML calls ``i``.
"""

from __future__ import annotations

import re
import shutil
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import attr
from twisted.internet.defer import Deferred, fail
from twisted.python.failure import Failure
from zope.interface import implementer

from rolemesh.backends.commands import (
    DEFAULT_TIMEOUT_S,
    MIB,
    CommandBackend,
    ParseError,
    Reading,
    Result,
    ToolError,
    checked,
    first_line,
    integer,
    match_readings,
    missing_metrics,
    number,
    run_async,
    run_sync,
)
from rolemesh.base.devices import DeviceMetrics, DeviceRef
from rolemesh.base.interfaces import IBackendReactor, IDeviceBackend

NVIDIA_SMI_FIELDS = (
    "index",
    "uuid",
    "name",
    "memory.total",
    "memory.used",
    "memory.free",
    "utilization.gpu",
    "temperature.gpu",
    "power.draw",
)
NVIDIA_SMI_QUERY = (
    "nvidia-smi",
    "--query-gpu=" + ",".join(NVIDIA_SMI_FIELDS),
    "--format=csv,noheader,nounits",
)
NVIDIA_SMI_LIST = ("nvidia-smi", "-L")

_NO_DEVICES = re.compile(r"no devices were found", re.IGNORECASE)
_GPU_LINE = re.compile(r"^GPU (\d+): (.*?)\s*\(UUID: (GPU-[^)\s]+)\)")
_MIG_LINE = re.compile(r"^\s+MIG\s+(\S+)\s+Device\s+(\d+):\s*\(UUID: (MIG-[^)\s]+)\)")


@attr.s(auto_attribs=True, frozen=True)
class MigEntry:
    """One MIG instance as ``nvidia-smi -L`` lists it under its GPU."""

    parent_index: int
    index: int
    uuid: str
    profile: Optional[str] = None
    parent_model: Optional[str] = None


def allocatable(total: Optional[int], used: Optional[int], free: Optional[int]) -> Optional[int]:
    """``nvidia-smi``'s total less what the driver reserves: its ``used``
    leaves that reserve out (drivers since 510), so used + free is what CUDA
    can allocate; older drivers count it as used, and the sum is the total."""
    if total is None or used is None or free is None:
        return total
    return min(total, used + free)


def parse_nvidia_smi_csv(text: str) -> List[Reading]:
    """``nvidia-smi --query-gpu=<NVIDIA_SMI_FIELDS> --format=csv,noheader,nounits`` -> readings (bytes)."""
    readings: List[Reading] = []
    unexpected: List[str] = []
    for raw in text.splitlines():
        line = raw.strip()
        if not line:
            continue
        if _NO_DEVICES.search(line):
            return []
        parts = [p.strip() for p in line.split(",")]
        if len(parts) < len(NVIDIA_SMI_FIELDS) or not parts[0].isdigit():
            unexpected.append(line)
            continue
        tail = parts[-6:]
        uuid = parts[1] if parts[1].startswith(("GPU-", "MIG-")) else None
        total, used, free = (integer(v, MIB) for v in tail[:3])
        readings.append(
            Reading(
                index=int(parts[0]),
                uuid=uuid,
                name=", ".join(parts[2:-6]) or None,
                memory_total_bytes=allocatable(total, used, free),
                memory_used_bytes=used,
                memory_free_bytes=free,
                utilization_pct=number(tail[3]),
                temperature_c=number(tail[4]),
                power_w=number(tail[5]),
            )
        )
    if not readings and unexpected:
        raise ParseError(f"nvidia-smi: unexpected output: {first_line(unexpected[0])}")
    return readings


def parse_nvidia_smi_list(text: str) -> List[MigEntry]:
    """``nvidia-smi -L`` -> the MIG instances it lists, each with its parent GPU's index."""
    entries: List[MigEntry] = []
    parent: Optional[Tuple[int, str]] = None
    for line in text.splitlines():
        gpu = _GPU_LINE.match(line)
        if gpu:
            parent = (int(gpu.group(1)), gpu.group(2).strip())
            continue
        mig = _MIG_LINE.match(line)
        if mig and parent is not None:
            entries.append(
                MigEntry(
                    parent_index=parent[0],
                    index=int(mig.group(2)),
                    uuid=mig.group(3),
                    profile=mig.group(1),
                    parent_model=parent[1],
                )
            )
    return entries


def is_mig(device: DeviceRef) -> bool:
    """Whether ``device`` is a MIG instance (pinned by uuid rather than index)."""
    return bool(device.uuid and device.uuid.startswith("MIG-"))


def devices_from_smi(readings: Sequence[Reading], migs: Sequence[MigEntry]) -> List[DeviceRef]:
    """DeviceRefs from ``nvidia-smi`` answers: whole GPUs, or a GPU's MIG instances when it has some."""
    out: List[DeviceRef] = []
    for r in readings:
        children = [m for m in migs if m.parent_index == r.index]
        if not children:
            out.append(r.ref("cuda", "NVIDIA"))
            continue
        for m in children:
            out.append(
                DeviceRef(
                    backend="cuda",
                    index=r.index,
                    name=f"gpu:{r.index}.{m.index}",
                    uuid=m.uuid,
                    vendor="NVIDIA",
                    model=f"{r.name or m.parent_model} MIG {m.profile}",
                )
            )
    return out


# -- NVML ---------------------------------------------------------------------------------------------


def import_pynvml() -> Any:
    """Import the ``pynvml`` module (from the ``nvidia-ml-py`` package) only when asked."""
    import pynvml

    return pynvml


def _text(value: Any) -> str:
    return value.decode("utf-8", errors="replace") if isinstance(value, bytes) else str(value)


def nvml_memory(nvml: Any, handle: Any) -> Tuple[int, int, int]:
    """(total, used, free) bytes, ``total`` being what processes can allocate.

    The v2 call (where the binding and driver have it) reports apart the
    memory the driver keeps for itself -- 615 MiB of an H200's 143771 MiB,
    which ``nvidia-smi`` counts in its total and CUDA does not -- so that is
    taken off the total; v1 counts it as used.
    """
    v2 = getattr(nvml, "nvmlMemory_v2", None)
    if v2 is not None:
        try:
            mem = nvml.nvmlDeviceGetMemoryInfo(handle, version=v2)
        except (nvml.NVMLError, TypeError):  # driver without the _v2 entry point, or an old binding
            pass
        else:
            reserved = int(getattr(mem, "reserved", 0) or 0)
            return int(mem.total) - reserved, int(mem.used), int(mem.free)
    mem = nvml.nvmlDeviceGetMemoryInfo(handle)
    return int(mem.total), int(mem.used), int(mem.free)


def _optional(nvml: Any, read: Callable[[], Any]) -> Optional[float]:
    try:
        value = read()
    except (nvml.NVMLError, AttributeError):
        return None
    return None if value is None else float(value)


def nvml_reading(nvml: Any, handle: Any, index: int, uuid: Optional[str]) -> Reading:
    """One device's figures; memory must answer, utilization/temperature/power may be None."""
    total, used, free = nvml_memory(nvml, handle)
    return Reading(
        index=index,
        uuid=uuid,
        memory_total_bytes=total,
        memory_used_bytes=used,
        memory_free_bytes=free,
        utilization_pct=_optional(nvml, lambda: nvml.nvmlDeviceGetUtilizationRates(handle).gpu),
        temperature_c=_optional(
            nvml, lambda: nvml.nvmlDeviceGetTemperature(handle, getattr(nvml, "NVML_TEMPERATURE_GPU", 0))
        ),
        power_w=_optional(nvml, lambda: nvml.nvmlDeviceGetPowerUsage(handle) / 1000.0),
    )


def _mig_enabled(nvml: Any, handle: Any) -> bool:
    try:
        current = nvml.nvmlDeviceGetMigMode(handle)[0]
    except (nvml.NVMLError, AttributeError, TypeError, IndexError):
        return False
    return bool(current == getattr(nvml, "NVML_DEVICE_MIG_ENABLE", 1))


def _mig_handles(nvml: Any, handle: Any) -> List[Tuple[int, Any]]:
    try:
        count = int(nvml.nvmlDeviceGetMaxMigDeviceCount(handle))
    except (nvml.NVMLError, AttributeError):
        return []
    found = []
    for j in range(count):
        try:
            found.append((j, nvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, j)))
        except nvml.NVMLError:  # an empty slot answers NOT_FOUND
            continue
    return found


def nvml_discover(nvml: Any) -> Tuple[List[DeviceRef], Dict[str, Any], List[str]]:
    """(devices, handle per device name, notes) from an initialised NVML."""
    devices: List[DeviceRef] = []
    handles: Dict[str, Any] = {}
    notes: List[str] = []
    for i in range(int(nvml.nvmlDeviceGetCount())):
        try:
            handle = nvml.nvmlDeviceGetHandleByIndex(i)
            model = _text(nvml.nvmlDeviceGetName(handle))
            uuid = _text(nvml.nvmlDeviceGetUUID(handle))
            if not _mig_enabled(nvml, handle):
                devices.append(
                    DeviceRef(
                        backend="cuda",
                        index=i,
                        name=f"gpu:{i}",
                        uuid=uuid,
                        vendor="NVIDIA",
                        model=model,
                        memory_total_bytes=nvml_memory(nvml, handle)[0],
                    )
                )
                handles[f"gpu:{i}"] = handle
                continue
            migs = _mig_handles(nvml, handle)
            if not migs:
                notes.append(f"gpu:{i} ({model}) is in MIG mode with no MIG instances; skipped")
            for j, mig in migs:
                name = f"gpu:{i}.{j}"
                try:
                    mig_model = _text(nvml.nvmlDeviceGetName(mig))
                except nvml.NVMLError:
                    mig_model = f"{model} MIG"
                devices.append(
                    DeviceRef(
                        backend="cuda",
                        index=i,
                        name=name,
                        uuid=_text(nvml.nvmlDeviceGetUUID(mig)),
                        vendor="NVIDIA",
                        model=mig_model,
                        memory_total_bytes=nvml_memory(nvml, mig)[0],
                    )
                )
                handles[name] = mig
        except nvml.NVMLError as e:
            notes.append(f"gpu:{i} skipped: NVML: {e}")
    return devices, handles, notes


def nvml_readings(
    nvml: Any, devices: Sequence[DeviceRef], handles: Mapping[str, Any]
) -> List[Union[Reading, str]]:
    """Per device, a Reading or the one-line NVML error that stopped it (runs in a thread)."""
    out: List[Union[Reading, str]] = []
    for device in devices:
        try:
            handle = handles.get(device.name)
            if handle is None:
                handle = (
                    nvml.nvmlDeviceGetHandleByUUID(device.uuid)
                    if device.uuid
                    else nvml.nvmlDeviceGetHandleByIndex(device.index)
                )
            out.append(nvml_reading(nvml, handle, device.index, device.uuid))
        except nvml.NVMLError as e:
            out.append(f"{device.name}: NVML: {e}")
    return out


@implementer(IDeviceBackend)
class CudaBackend(CommandBackend):
    """NVIDIA GPUs: NVML when it loads, ``nvidia-smi`` CSV when it does not."""

    name = "cuda"

    def __init__(
        self,
        reactor: Optional[IBackendReactor] = None,
        *,
        load_nvml: Optional[Callable[[], Any]] = import_pynvml,
        to_thread: Optional[Callable[..., Deferred]] = None,
        run_sync: Callable[..., Result] = run_sync,
        run_async: Callable[..., "Deferred[Result]"] = run_async,
        which: Callable[[str], Optional[str]] = shutil.which,
        timeout: float = DEFAULT_TIMEOUT_S,
    ) -> None:
        super().__init__(reactor, run_sync=run_sync, run_async=run_async, which=which, timeout=timeout)
        self._load_nvml = load_nvml
        self._to_thread = to_thread
        self._nvml: Any = None
        self._handles: Dict[str, Any] = {}
        self._busy = False
        #: ``"nvml"`` or ``"nvidia-smi"`` once :meth:`discover` has run.
        self.source: Optional[str] = None
        #: One-line remarks from discovery (skipped GPUs, why NVML was not used) for ``--check``.
        self.notes: List[str] = []

    def _init_nvml(self) -> Any:
        if self._load_nvml is None:
            self.notes.append("NVML disabled")
            return None
        try:
            nvml = self._load_nvml()
        except Exception as e:  # ImportError, or a broken binding: fall back either way
            self.notes.append(f"NVML not loaded: {first_line(str(e)) or type(e).__name__}")
            return None
        try:
            nvml.nvmlInit()
        except Exception as e:  # NVMLError_LibraryNotFound, DriverNotLoaded, ...
            self.notes.append(f"NVML not initialised: {first_line(str(e)) or type(e).__name__}")
            return None
        return nvml

    def discover(self) -> List[DeviceRef]:
        """NVIDIA devices present; BackendUnavailable when neither NVML nor nvidia-smi answers."""
        self.notes = []
        nvml = self._init_nvml()
        if nvml is not None:
            try:
                devices, handles, notes = nvml_discover(nvml)
            except nvml.NVMLError as e:
                self.notes.append(f"NVML discovery failed: {e}")
            else:
                self.notes.extend(notes)
                if devices:
                    self._nvml, self._handles, self.source = nvml, handles, "nvml"
                    return devices
                self._shutdown(nvml)
                raise self._unavailable("NVML found no usable NVIDIA GPU" + _notes_suffix(notes))
            self._shutdown(nvml)
        try:
            text = checked("nvidia-smi", self._run_sync(NVIDIA_SMI_QUERY, self._timeout))
            readings = parse_nvidia_smi_csv(text)
        except (ToolError, ParseError) as e:
            why = "; ".join(self.notes + [str(e)])
            raise self._unavailable(why) from None
        try:
            listing = checked("nvidia-smi", self._run_sync(NVIDIA_SMI_LIST, self._timeout))
            migs = parse_nvidia_smi_list(listing)
        except ToolError:
            migs = []
        devices = devices_from_smi(readings, migs)
        if not devices:
            raise self._unavailable("nvidia-smi lists no GPU")
        self.source = "nvidia-smi"
        return devices

    @staticmethod
    def _shutdown(nvml: Any) -> None:
        try:
            nvml.nvmlShutdown()
        except Exception:  # nothing useful to do about a failed shutdown
            pass

    def close(self) -> None:
        """Shut NVML down (the agent calls this once, when it stops)."""
        if self._nvml is not None:
            self._shutdown(self._nvml)
            self._nvml = None

    def _thread(self, f: Callable[..., Any], *args: Any) -> Deferred:
        if self._to_thread is not None:
            return self._to_thread(f, *args)
        from twisted.internet.threads import deferToThreadPool

        reactor = self.reactor
        return deferToThreadPool(reactor, reactor.getThreadPool(), f, *args)

    def sample(self, devices: Sequence[DeviceRef]) -> "Deferred[List[DeviceMetrics]]":
        """Metrics per device in order, from NVML in a thread or from nvidia-smi in a child process."""
        devices = list(devices)
        if self.source == "nvml":
            return self._sample_nvml(devices)
        d = self._sample_output(NVIDIA_SMI_QUERY)
        d.addCallback(parse_nvidia_smi_csv)
        d.addCallback(self._smi_metrics, devices)
        return d

    def _sample_nvml(self, devices: List[DeviceRef]) -> "Deferred[List[DeviceMetrics]]":
        if self._busy:
            return fail(ToolError("cuda: the previous NVML sample has not finished"))
        self._busy = True

        # Cancelling the answer (a caller's timeout) cannot stop the thread; the busy flag stays
        # up until the thread itself is done, so a wedged driver holds one thread, not all.
        answer: Deferred = Deferred()

        def finished(result: Any) -> None:
            self._busy = False
            if answer.called:
                return
            if isinstance(result, Failure):
                answer.errback(result)
            else:
                answer.callback(result)

        def to_metrics(results: List[Union[Reading, str]]) -> List[DeviceMetrics]:
            now = self._clock()
            return [
                r.metrics(device, now) if isinstance(r, Reading) else missing_metrics(device, now, r)
                for device, r in zip(devices, results)
            ]

        self._thread(nvml_readings, self._nvml, devices, dict(self._handles)).addBoth(finished)
        return answer.addCallback(to_metrics)

    def _smi_metrics(self, readings: List[Reading], devices: List[DeviceRef]) -> List[DeviceMetrics]:
        now = self._clock()
        whole = [d for d in devices if not is_mig(d)]
        found = {m.device: m for m in match_readings(whole, readings, now, "nvidia-smi")}
        # nvidia-smi --query-gpu has no per-MIG figures: say nothing rather than the parent's.
        return [
            found[d.name]
            if d.name in found
            else DeviceMetrics(device=d.name, sampled_at=now, memory_total_bytes=d.memory_total_bytes)
            for d in devices
        ]

    def child_environment(self, device: DeviceRef, base_environment: Mapping[str, str]) -> Dict[str, str]:
        """The parent's environment plus the CUDA pin (index in PCI bus order, or the MIG uuid)."""
        env = dict(base_environment)
        env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
        env["CUDA_VISIBLE_DEVICES"] = str(device.uuid) if is_mig(device) else str(device.index)
        return env

    def child_arguments(self, device: DeviceRef) -> Dict[str, Any]:
        """Nothing: with one GPU visible, llama-server's defaults already use it."""
        return {}


def _notes_suffix(notes: Sequence[str]) -> str:
    return f" ({'; '.join(notes)})" if notes else ""
