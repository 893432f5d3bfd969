"""The ``sycl`` backend: Intel GPUs through oneAPI's Level Zero, listed by ``sycl-ls``.

``sycl-ls`` lists every SYCL device; only Level Zero GPUs become devices,
``gpu:<i>`` with ``i`` the Level Zero index, and the child is pinned with
``ONEAPI_DEVICE_SELECTOR=level_zero:<i>``.  ``sycl-ls`` runs without an
inherited ``ONEAPI_DEVICE_SELECTOR``, so the indices are the unfiltered ones the
pin means.  Memory totals and metrics come from ``xpu-smi`` where it is
installed (its device ids are taken to follow the Level Zero order, and are only
used when both tools count the same GPUs); without it the devices report no
figures.
"""

from __future__ import annotations

import os
import re
from typing import Any, Dict, List, Mapping, Optional, Sequence

import attr
from twisted.internet.defer import Deferred, succeed
from zope.interface import implementer

from rolemesh.backends.commands import (
    MIB,
    CommandBackend,
    ParseError,
    Reading,
    ToolError,
    checked,
    first_line,
    integer,
    load_json,
    match_readings,
    number,
)
from rolemesh.base.devices import DeviceMetrics, DeviceRef
from rolemesh.base.interfaces import IBackendReactor, IDeviceBackend

SYCL_LS = ("sycl-ls",)
XPU_SMI_DISCOVERY = ("xpu-smi", "discovery", "-j")
#: xpu-smi metric ids: 0 GPU utilization, 1 power, 3 core temperature, 18 memory used (MiB).
XPU_SMI_METRICS = "0,1,3,18"

_NEW = re.compile(r"^\[(?P<backend>\w+):(?P<kind>\w+)\]\[\w+:(?P<index>\d+)\]\s*(?P<rest>.*)$")
_OLD = re.compile(r"^\[(?P<backend>\w+):(?P<kind>\w+):(?P<index>\d+)\]\s*(?P<rest>.*)$")
_DRIVER = re.compile(r"\s*\[[^\]]*\]\s*$")
_VERSION = re.compile(r"\s+\d+(?:\.\d+)+\s*$")


@attr.s(auto_attribs=True, frozen=True)
class SyclDevice:
    """One line of ``sycl-ls``: backend (``level_zero``, ``opencl``...), kind, index, names."""

    backend: str
    kind: str
    index: int
    platform: str
    name: str


def xpu_smi_dump(device_ids: Sequence[int]) -> List[str]:
    """The argv for one ``xpu-smi dump`` of utilization, power, temperature and memory used."""
    return ["xpu-smi", "dump", "-d", ",".join(str(i) for i in device_ids), "-m", XPU_SMI_METRICS, "-n", "1"]


def xpu_smi_device(device_id: int) -> List[str]:
    """The argv for ``xpu-smi discovery`` of one device (it carries the memory size)."""
    return ["xpu-smi", "discovery", "-d", str(device_id), "-j"]


def parse_sycl_ls(text: str) -> List[SyclDevice]:
    """``sycl-ls`` (both the ``[level_zero:gpu][level_zero:0]`` and older ``[ext_oneapi_level_zero:gpu:0]``
    forms) -> its devices."""
    devices = []
    other = []
    for raw in text.splitlines():
        line = raw.strip()
        if not line:
            continue
        match = _NEW.match(line) or _OLD.match(line)
        if not match:
            if not line.lower().startswith("warning"):
                other.append(line)
            continue
        backend = match.group("backend")
        if backend.startswith("ext_oneapi_"):
            backend = backend[len("ext_oneapi_"):]
        platform, _, name = match.group("rest").partition(", ")
        name = _VERSION.sub("", _DRIVER.sub("", name)).strip()
        devices.append(
            SyclDevice(
                backend=backend,
                kind=match.group("kind"),
                index=int(match.group("index")),
                platform=platform.strip(),
                name=name or platform.strip(),
            )
        )
    if not devices and other:
        raise ParseError(f"sycl-ls: unexpected output: {first_line(other[0])}")
    return devices


def level_zero_gpus(devices: Sequence[SyclDevice]) -> List[SyclDevice]:
    """The Level Zero GPUs among ``sycl-ls``'s devices, by index."""
    gpus = [d for d in devices if d.backend == "level_zero" and d.kind == "gpu"]
    return sorted(gpus, key=lambda d: d.index)


def _xpu_entry(entry: Mapping[str, Any]) -> Optional[Reading]:
    index = number(entry.get("device_id"))
    if index is None:
        return None
    return Reading(
        index=int(index),
        uuid=str(entry["uuid"]) if entry.get("uuid") else None,
        name=str(entry["device_name"]) if entry.get("device_name") else None,
        memory_total_bytes=integer(entry.get("memory_physical_size_byte")),
        memory_free_bytes=integer(entry.get("memory_free_size_byte")),
    )


def parse_xpu_discovery(text: str) -> List[Reading]:
    """``xpu-smi discovery -j`` (a ``device_list``) or ``discovery -d N -j`` (one device) -> readings."""
    data = load_json(text, "xpu-smi discovery")
    if isinstance(data, Mapping) and isinstance(data.get("device_list"), list):
        entries = data["device_list"]
    elif isinstance(data, Mapping):
        entries = [data]
    elif isinstance(data, list):
        entries = data
    else:
        raise ParseError("xpu-smi discovery: expected a device_list")
    readings = [_xpu_entry(e) for e in entries if isinstance(e, Mapping)]
    return [r for r in readings if r is not None]


def parse_xpu_dump(text: str) -> List[Reading]:
    """``xpu-smi dump -m 0,1,3,18`` CSV -> readings by device id (the last row per device wins)."""
    columns: Optional[List[str]] = None
    rows: Dict[int, Reading] = {}
    for raw in text.splitlines():
        cells = [c.strip() for c in raw.split(",")]
        if columns is None:
            if "DeviceId" in cells:
                columns = [c.lower() for c in cells]
            continue
        if len(cells) != len(columns):
            continue
        row = dict(zip(columns, cells))
        index = number(row.get("deviceid"))
        if index is None:
            continue

        rows[int(index)] = Reading(
            index=int(index),
            memory_used_bytes=integer(_cell(row, "memory used"), MIB),
            utilization_pct=number(_cell(row, "gpu utilization")),
            temperature_c=number(_cell(row, "core temperature")),
            power_w=number(_cell(row, "gpu power")),
        )
    if columns is None:
        if text.strip():
            raise ParseError(f"xpu-smi dump: no header line: {first_line(text)}")
        return []
    return [rows[i] for i in sorted(rows)]


def _cell(row: Mapping[str, str], words: str) -> Optional[str]:
    return next((value for column, value in row.items() if words in column), None)


def _without_selector(env: Mapping[str, str]) -> Dict[str, str]:
    return {k: v for k, v in env.items() if k != "ONEAPI_DEVICE_SELECTOR"}


@implementer(IDeviceBackend)
class SyclBackend(CommandBackend):
    """Intel GPUs over Level Zero; xpu-smi for figures where present."""

    name = "sycl"

    def __init__(self, reactor: Optional[IBackendReactor] = None, **kwargs: Any) -> None:
        super().__init__(reactor, **kwargs)
        self._xpu = False
        #: One-line remarks from discovery for ``--check``.
        self.notes: List[str] = []

    def discover(self) -> List[DeviceRef]:
        """Level Zero GPUs; BackendUnavailable when sycl-ls is missing, fails or lists none."""
        self.notes = []
        try:
            result = self._run_sync(SYCL_LS, self._timeout, env=_without_selector(os.environ))
            gpus = level_zero_gpus(parse_sycl_ls(checked("sycl-ls", result)))
        except (ToolError, ParseError) as e:
            raise self._unavailable(str(e)) from None
        if not gpus:
            raise self._unavailable("sycl-ls lists no Level Zero GPU")
        figures = self._xpu_figures(len(gpus))
        devices = []
        for gpu in gpus:
            reading = figures.get(gpu.index)
            devices.append(
                DeviceRef(
                    backend="sycl",
                    index=gpu.index,
                    name=f"gpu:{gpu.index}",
                    uuid=reading.uuid if reading else None,
                    vendor="Intel",
                    model=gpu.name,
                    memory_total_bytes=reading.memory_total_bytes if reading else None,
                )
            )
        return devices

    def _xpu_figures(self, count: int) -> Dict[int, Reading]:
        if not self._has("xpu-smi"):
            self.notes.append("xpu-smi is not on PATH: no memory figures")
            return {}
        try:
            listed = parse_xpu_discovery(checked("xpu-smi", self._run_sync(XPU_SMI_DISCOVERY, self._timeout)))
        except (ToolError, ParseError) as e:
            self.notes.append(f"xpu-smi discovery failed: {e}")
            return {}
        if len(listed) != count:
            self.notes.append(f"xpu-smi lists {len(listed)} GPUs, sycl-ls {count}: not matching them")
            return {}
        out = {}
        for reading in listed:
            try:
                detail = parse_xpu_discovery(
                    checked("xpu-smi", self._run_sync(xpu_smi_device(reading.index), self._timeout))
                )
            except (ToolError, ParseError) as e:
                self.notes.append(f"xpu-smi discovery -d {reading.index} failed: {e}")
                detail = []
            if detail:
                reading = attr.evolve(
                    reading,
                    uuid=reading.uuid or detail[0].uuid,
                    memory_total_bytes=detail[0].memory_total_bytes,
                )
            out[reading.index] = reading
        self._xpu = True
        return out

    def sample(self, devices: Sequence[DeviceRef]) -> "Deferred[List[DeviceMetrics]]":
        """Figures from one ``xpu-smi dump``; without xpu-smi, records that only carry the total."""
        devices = list(devices)
        if not self._xpu:
            now = self._clock()
            return succeed(
                [
                    DeviceMetrics(device=d.name, sampled_at=now, memory_total_bytes=d.memory_total_bytes)
                    for d in devices
                ]
            )
        d = self._sample_output(xpu_smi_dump([dev.index for dev in devices]))
        d.addCallback(parse_xpu_dump)
        d.addCallback(
            lambda readings: match_readings(devices, readings, self._clock(), "xpu-smi", use_uuid=False)
        )
        return d

    def child_environment(self, device: DeviceRef, base_environment: Mapping[str, str]) -> Dict[str, str]:
        """The parent's environment plus ``ONEAPI_DEVICE_SELECTOR=level_zero:<i>``."""
        env = dict(base_environment)
        env["ONEAPI_DEVICE_SELECTOR"] = f"level_zero:{device.index}"
        return env

    def child_arguments(self, device: DeviceRef) -> Dict[str, Any]:
        """Nothing: the selector leaves one GPU visible."""
        return {}
