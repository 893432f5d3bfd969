"""Pinning one llama-server child to several devices (a device group).

Every backend knows how to pin a child to one device
(``IDeviceBackend.child_environment`` / ``child_arguments``); a group's
child gets all of its members at once, built from those single-device pins:

- GPUs: the visibility variable lists every member --
  ``CUDA_VISIBLE_DEVICES=0,1``, ``ROCR_VISIBLE_DEVICES=0,1`` (with
  ``HIP_VISIBLE_DEVICES`` counting 0..n-1 inside it),
  ``ONEAPI_DEVICE_SELECTOR=level_zero:0,1``, ``GGML_VK_VISIBLE_DEVICES=0,1``
  -- and ``--tensor-split`` defaults to the members' memory ratio.
- ``cpu`` devices: the union of their core sets, by ``--cpu-range`` (or
  ``--cpu-mask``) and ``--threads``, and the exec wrapper's affinity.

Pure functions; the supervisor calls :func:`pin_child` when it spawns.
"""

from __future__ import annotations

from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from rolemesh.backends.cpu import cpu_mask, cpu_range
from rolemesh.base.devices import DeviceRef
from rolemesh.base.interfaces import IDeviceBackend

#: Separates member names in a group's name: ``cuda:0+cuda:1``.
GROUP_SEPARATOR = "+"


def group_name(members: Sequence[str]) -> str:
    """The name of the group of ``members`` (one member: its own name)."""
    return GROUP_SEPARATOR.join(members)


def _join(values: Sequence[Optional[str]]) -> Optional[str]:
    """``["level_zero:0", "level_zero:1"]`` -> ``"level_zero:0,1"``; ``["0", "1"]`` -> ``"0,1"``."""
    present = [v for v in values if v is not None]
    if not present:
        return None
    prefixes = {v.rpartition(":")[0] for v in present}
    if len(prefixes) == 1 and all(":" in v for v in present):
        prefix = prefixes.pop()
        return prefix + ":" + ",".join(v.rpartition(":")[2] for v in present)
    return ",".join(dict.fromkeys(present))


def group_environment(backend: IDeviceBackend, members: Sequence[DeviceRef], base: Mapping[str, str]) -> Dict[str, str]:
    """The child environment pinned to every member."""
    envs = [backend.child_environment(d, base) for d in members]
    if len(envs) == 1:
        return envs[0]
    out = dict(envs[0])
    for key in sorted(set().union(*envs)):
        values = [e.get(key) for e in envs]
        if len(set(values)) > 1:
            joined = _join(values)
            if joined is None:
                out.pop(key, None)
            else:
                out[key] = joined
    if getattr(backend, "name", None) == "rocm":
        # HIP_VISIBLE_DEVICES counts within ROCR_VISIBLE_DEVICES: 0..n-1.
        out["HIP_VISIBLE_DEVICES"] = ",".join(str(i) for i in range(len(members)))
    return out


def memory_split(members: Sequence[DeviceRef]) -> Optional[Tuple[float, ...]]:
    """The members' memory ratio (``--tensor-split``), or None when a total is unknown."""
    totals = [d.memory_total_bytes for d in members]
    if len(members) < 2 or any(not t for t in totals):
        return None
    whole = float(sum(t for t in totals if t))
    return tuple(round(t / whole, 3) for t in totals if t)


def group_cpus(members: Sequence[DeviceRef]) -> Tuple[int, ...]:
    """The union of the members' core sets (empty if any member is the whole host)."""
    if any(not d.cpus for d in members):
        return ()
    return tuple(sorted(set().union(*(d.cpus for d in members))))


_CORE_FLAGS = ("cpu-range", "cpu-mask", "threads")


def group_arguments(backend: IDeviceBackend, members: Sequence[DeviceRef]) -> Dict[str, Any]:
    """llama-server flags the group wants unless the model sets them."""
    if len(members) == 1:
        return dict(backend.child_arguments(members[0]))
    out: Dict[str, Any] = {}
    if all(d.backend == "cpu" for d in members):
        # the members' own flags (``device: none``) but the union of their cores
        out.update((k, v) for k, v in backend.child_arguments(members[0]).items() if k not in _CORE_FLAGS)
        cpus = group_cpus(members)
        if cpus:
            rng = cpu_range(cpus)
            out.update({"cpu-range": rng} if rng else {"cpu-mask": cpu_mask(cpus)})
            out["threads"] = len(cpus)
        return out
    for d in members:  # anything a member asks for that is not per-device
        for flag, value in backend.child_arguments(d).items():
            out.setdefault(flag, value)
    split = memory_split(members)
    if split is not None:
        out["tensor-split"] = list(split)
    return out


def pin_child(
    backend: IDeviceBackend, members: Sequence[DeviceRef], base: Mapping[str, str]
) -> Tuple[Dict[str, Any], Dict[str, str], Tuple[int, ...]]:
    """(default flags, environment, core set) for a child on ``members``."""
    cpus: Tuple[int, ...] = members[0].cpus if len(members) == 1 else group_cpus(members)
    return group_arguments(backend, members), group_environment(backend, members, base), cpus


def groups_of(models: Sequence[Any]) -> List[Tuple[str, ...]]:
    """The distinct device groups (two or more devices) the models name, in order."""
    seen: Dict[Tuple[str, ...], None] = {}
    for m in models:
        if len(m.devices) > 1:
            seen.setdefault(tuple(m.devices), None)
    return list(seen)
