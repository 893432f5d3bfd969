"""The ``rocm`` backend: AMD GPUs through ``amd-smi`` JSON, ``rocm-smi`` JSON as the fallback.

amd-smi's JSON has changed shape between releases: a bare list of GPU objects
(ROCm 6.0-6.2) or ``{"gpu_data": [...]}`` (later); figures are plain numbers,
``{"value": v, "unit": u}`` mappings or ``"N/A"``.  The parsers accept all of
them.  amd-smi's "MB" is MiB.

Pinning: the ROCm runtime applies ``ROCR_VISIBLE_DEVICES`` first and then reads
``HIP_VISIBLE_DEVICES`` (and ``CUDA_VISIBLE_DEVICES``, ``GPU_DEVICE_ORDINAL``)
as indices *into what is left*.  So the child gets
``ROCR_VISIBLE_DEVICES=<i>`` and ``HIP_VISIBLE_DEVICES=0``, and inherited
``CUDA_VISIBLE_DEVICES`` / ``GPU_DEVICE_ORDINAL`` are dropped, since a stale
value there would hide the only visible GPU.  ``<i>`` is amd-smi's (or
rocm-smi's) index, which is the ROCr enumeration order on a standard install.
"""

from __future__ import annotations

import re
from typing import Any, Dict, List, Mapping, Optional, Sequence

from twisted.internet.defer import Deferred
from zope.interface import implementer

from rolemesh.backends import BackendUnavailable
from rolemesh.backends.commands import (
    MIB,
    CommandBackend,
    ParseError,
    Reading,
    integer,
    load_json,
    match_readings,
    number,
)
from rolemesh.base.devices import DeviceMetrics, DeviceRef
from rolemesh.base.interfaces import IDeviceBackend

AMD_SMI_STATIC = ("amd-smi", "static", "--json")
AMD_SMI_METRIC = ("amd-smi", "metric", "--json")
ROCM_SMI_DISCOVER = ("rocm-smi", "--showproductname", "--showmeminfo", "vram", "--showuniqueid", "--json")
ROCM_SMI_METRIC = ("rocm-smi", "--showmeminfo", "vram", "--showuse", "--showtemp", "--showpower", "--json")

_UNITS = {"b": 1, "kb": 1024, "kib": 1024, "mb": MIB, "mib": MIB, "gb": 1024 * MIB, "gib": 1024 * MIB}
_CARD = re.compile(r"^card(\d+)$")
#: Variables ROCm reads as indices into what ROCR_VISIBLE_DEVICES leaves visible.
_RELATIVE_PINS = ("CUDA_VISIBLE_DEVICES", "GPU_DEVICE_ORDINAL")


def _section(item: Mapping[str, Any], key: str) -> Mapping[str, Any]:
    value = item.get(key)
    return value if isinstance(value, Mapping) else {}


def _dig(item: Any, *path: str) -> Any:
    for key in path:
        if not isinstance(item, Mapping):
            return None
        item = item.get(key)
    return item


def amd_bytes(value: Any) -> Optional[int]:
    """An amd-smi memory figure in bytes: ``{"value": 16368, "unit": "MB"}`` -> 16368 MiB; "N/A" -> None."""
    unit = "mb"
    if isinstance(value, Mapping):
        unit = str(value.get("unit") or "MB").lower()
    return integer(value, _UNITS.get(unit, MIB))


def _amd_items(text: str, tool: str) -> List[Mapping[str, Any]]:
    data = load_json(text, tool)
    if isinstance(data, Mapping) and "gpu_data" in data:
        data = data["gpu_data"]
    elif isinstance(data, Mapping) and "gpu" in data:
        data = [data]
    if not isinstance(data, list):
        raise ParseError(f"{tool}: expected a list of GPUs or {{\"gpu_data\": [...]}}")
    return [item for item in data if isinstance(item, Mapping) and number(item.get("gpu")) is not None]


def _first(*values: Any) -> Optional[float]:
    for v in values:
        n = number(v)
        if n is not None:
            return n
    return None


def parse_amd_smi_static(text: str) -> List[Reading]:
    """``amd-smi static --json`` -> index, name (market name), uuid where given, VRAM size."""
    out = []
    for item in _amd_items(text, "amd-smi static"):
        vram = _section(item, "vram")
        size = vram.get("size")
        total = amd_bytes(size) if size is not None else integer(vram.get("vram_size_mb"), MIB)
        if total is None and vram.get("vram_size") is not None:
            total = amd_bytes(vram.get("vram_size"))
        name = _dig(item, "asic", "market_name")
        uuid = item.get("uuid") or _dig(item, "asic", "uuid")
        out.append(
            Reading(
                index=int(number(item["gpu"]) or 0),
                uuid=str(uuid) if uuid and uuid != "N/A" else None,
                name=str(name) if name and name != "N/A" else None,
                memory_total_bytes=total,
            )
        )
    return out


def parse_amd_smi_metric(text: str) -> List[Reading]:
    """``amd-smi metric --json`` -> VRAM total/used/free, gfx activity, temperature, socket power."""
    out = []
    for item in _amd_items(text, "amd-smi metric"):
        mem = _section(item, "mem_usage")
        temps = _section(item, "temperature")
        power = _section(item, "power")
        usage = _section(item, "usage")
        out.append(
            Reading(
                index=int(number(item["gpu"]) or 0),
                memory_total_bytes=amd_bytes(mem.get("total_vram")),
                memory_used_bytes=amd_bytes(mem.get("used_vram")),
                memory_free_bytes=amd_bytes(mem.get("free_vram")),
                utilization_pct=number(usage.get("gfx_activity")),
                temperature_c=_first(temps.get("edge"), temps.get("hotspot"), temps.get("junction")),
                power_w=_first(
                    power.get("socket_power"),
                    power.get("average_socket_power"),
                    power.get("current_socket_power"),
                ),
            )
        )
    return out


def _field(card: Mapping[str, Any], *names: str) -> Any:
    lowered = {k.lower(): v for k, v in card.items()}
    for name in names:
        value = lowered.get(name.lower())
        if value not in (None, "", "N/A"):
            return value
    return None


def parse_rocm_smi(text: str) -> List[Reading]:
    """``rocm-smi ... --json`` -> one reading per ``cardN`` key (VRAM, use, temperature, power, name)."""
    data = load_json(text, "rocm-smi")
    if not isinstance(data, Mapping):
        raise ParseError("rocm-smi: expected a JSON object keyed by card")
    out = []
    for key, card in data.items():
        match = _CARD.match(str(key))
        if not match or not isinstance(card, Mapping):
            continue  # "system" and the like
        name = _field(card, "Card Series", "Card series", "Device Name", "Card Model", "Card model")
        uuid = _field(card, "Unique ID", "GUID")
        out.append(
            Reading(
                index=int(match.group(1)),
                uuid=str(uuid) if uuid is not None else None,
                name=str(name) if name is not None else None,
                memory_total_bytes=integer(_field(card, "VRAM Total Memory (B)")),
                memory_used_bytes=integer(_field(card, "VRAM Total Used Memory (B)")),
                utilization_pct=number(_field(card, "GPU use (%)")),
                temperature_c=_first(
                    _field(card, "Temperature (Sensor edge) (C)"),
                    _field(card, "Temperature (Sensor junction) (C)"),
                ),
                power_w=_first(
                    _field(card, "Average Graphics Package Power (W)"),
                    _field(card, "Current Socket Graphics Package Power (W)"),
                ),
            )
        )
    return sorted(out, key=lambda r: r.index)


def devices_from_readings(readings: Sequence[Reading]) -> List[DeviceRef]:
    """``gpu:<i>`` DeviceRefs for AMD readings."""
    return [
        r.ref("rocm", "AMD")
        for r in readings
    ]


@implementer(IDeviceBackend)
class RocmBackend(CommandBackend):
    """AMD GPUs through amd-smi, or rocm-smi where amd-smi is missing or fails."""

    name = "rocm"
    source: Optional[str] = None

    def discover(self) -> List[DeviceRef]:
        """AMD GPUs present; BackendUnavailable when neither tool answers with a GPU."""
        reasons = []
        for tool, argv, parse in (
            ("amd-smi", AMD_SMI_STATIC, parse_amd_smi_static),
            ("rocm-smi", ROCM_SMI_DISCOVER, parse_rocm_smi),
        ):
            try:
                readings = parse(self._discover_output(argv))
            except (BackendUnavailable, ParseError) as e:
                reasons.append(str(e).replace("rocm: ", "", 1))
                continue
            if readings:
                self.source = tool
                return devices_from_readings(readings)
            reasons.append(f"{tool} lists no GPU")
        raise self._unavailable("; ".join(reasons))

    def sample(self, devices: Sequence[DeviceRef]) -> "Deferred[List[DeviceMetrics]]":
        """Metrics per device in order, from the tool discovery used."""
        devices = list(devices)
        argv: Sequence[str] = AMD_SMI_METRIC
        parse, tool = parse_amd_smi_metric, "amd-smi"
        if self.source == "rocm-smi":
            argv, parse, tool = ROCM_SMI_METRIC, parse_rocm_smi, "rocm-smi"
        d = self._sample_output(argv)
        d.addCallback(parse)
        # amd-smi metric carries no uuid and rocm-smi's "Unique ID" is not amd-smi's: match by index.
        d.addCallback(lambda readings: match_readings(devices, readings, self._clock(), tool, use_uuid=False))
        return d

    def child_environment(self, device: DeviceRef, base_environment: Mapping[str, str]) -> Dict[str, str]:
        """The parent's environment plus ``ROCR_VISIBLE_DEVICES=<i>``, ``HIP_VISIBLE_DEVICES=0``."""
        env = {k: v for k, v in base_environment.items() if k not in _RELATIVE_PINS}
        env["ROCR_VISIBLE_DEVICES"] = str(device.index)
        env["HIP_VISIBLE_DEVICES"] = "0"
        return env

    def child_arguments(self, device: DeviceRef) -> Dict[str, Any]:
        """Nothing: the one visible GPU is llama-server's default."""
        return {}


__all__ = [
    "AMD_SMI_METRIC",
    "AMD_SMI_STATIC",
    "ROCM_SMI_DISCOVER",
    "ROCM_SMI_METRIC",
    "RocmBackend",
    "amd_bytes",
    "devices_from_readings",
    "parse_amd_smi_metric",
    "parse_amd_smi_static",
    "parse_rocm_smi",
]
