"""What a device supervisor shows of its child: pure read-only views.

The endpoint a ready child answers at (built once per child, though every
request asks for it), the ``snapshot`` the inventory and ``/v1/node/devices``
show, and which model a device has or is getting.  Plain values in, plain
values out: no supervisor, no reactor.
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

import attr

from rolemesh.children.state import ALIVE, READY, STARTING, STOPPED, STOPPING, DeviceState

__all__ = ["ChildEndpoint", "EndpointCache", "loading_or_loaded", "snapshot"]


@attr.s(auto_attribs=True, frozen=True)
class ChildEndpoint:
    """Where a ready child answers, and which child it is."""

    model_id: str
    base_url: str
    port: int
    pid: int
    generation: int


class EndpointCache:
    """The last endpoint built, with what it was built from: asked for on
    every request, a child's endpoint is built once."""

    def __init__(self) -> None:
        self._last: Optional[Tuple[Tuple[str, int, int, int], ChildEndpoint]] = None

    def get(self, model_id: str, port: int, pid: Optional[int], generation: int) -> ChildEndpoint:
        key = (model_id, port, pid or 0, generation)
        cached = self._last
        if cached is None or cached[0] != key:
            endpoint = ChildEndpoint(model_id, f"http://127.0.0.1:{port}", port, key[2], generation)
            cached = self._last = (key, endpoint)
        return cached[1]


def loading_or_loaded(state: DeviceState, model_id: Optional[str], target_id: Optional[str]) -> Optional[str]:
    """The model id a device in ``state`` has (or is getting), else None:
    its model while starting or ready, a switch's target while stopping."""
    if state in (STARTING, READY) and model_id is not None:
        return model_id
    if state == STOPPING and target_id is not None:
        return target_id
    return None


def snapshot(state: DeviceState, model_id: Optional[str], port: Optional[int], pid: Optional[int],
             restarts: int, last_error: Optional[str]) -> Dict[str, Any]:
    """A device's state as the inventory shows it: a stopped device has no
    model, one without a child process no port or pid."""
    alive = state in ALIVE
    return {
        "state": state.value,
        "model": model_id if model_id and state != STOPPED else None,
        "port": port if alive else None,
        "pid": pid if alive else None,
        "restarts": restarts,
        "last_error": last_error,
    }
