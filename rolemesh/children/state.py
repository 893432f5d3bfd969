"""The states of a device's llama-server child (see :mod:`rolemesh.children.supervisor`).

A plain enum with no imports of the agent's own, so the supervisor's parts,
the payloads and the metrics can name the states without importing the
supervisor.
"""

from __future__ import annotations

from rolemesh.base.enums import StrEnum

__all__ = ["ALIVE", "FAILED", "READY", "STARTING", "STOPPED", "STOPPING", "DeviceState"]


class DeviceState(StrEnum):
    """A device's state; a ``str`` (its value) wherever it is shown or sent."""

    STOPPED = "stopped"
    STARTING = "starting"
    READY = "ready"
    STOPPING = "stopping"
    FAILED = "failed"


STOPPED = DeviceState.STOPPED
STARTING = DeviceState.STARTING
READY = DeviceState.READY
STOPPING = DeviceState.STOPPING
FAILED = DeviceState.FAILED

#: The states in which a child process exists (its port and pid mean something).
ALIVE = frozenset({STARTING, READY, STOPPING})
