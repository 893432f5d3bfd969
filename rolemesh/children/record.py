"""What a device supervisor shows and tells: its record.

The state, the model, the child's port, pid and generation, the counters
and the last failure, the read-only views made of them (the endpoint, the
snapshot, the logs) and the events that tell every change.  The node, the
views, the metrics and the heartbeat read this; only the supervisor (its
one subclass, :class:`rolemesh.children.supervisor.DeviceSupervisor`)
writes it, and only inside a transition, so what it tells waits in the
outbox until the transition is complete.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Dict, List, Optional

import attr

from rolemesh.base.events import Events, Outbox
from rolemesh.base.interfaces import IAgentReactor
from rolemesh.children import views as child_views
from rolemesh.children.process import OutputRing
from rolemesh.children.restart_policy import RestartPolicy
from rolemesh.children.state import READY, STOPPED, DeviceState
from rolemesh.children.views import ChildEndpoint, EndpointCache
from rolemesh.config.file import ModelConfig
from rolemesh.event_loop.reactor import UsesReactor

__all__ = ["CHILD_STATE", "COUNTED_EVENTS", "DeviceRecord", "StateChange"]

#: The event of every state change: fields ``device``, ``state``,
#: ``previous``, ``model`` (its id or None) and ``model_config``.
CHILD_STATE = "child_state"
#: Events counted at the source -> the supervisor attribute that counts them.
#: Each has fields ``device`` and ``model`` (the model id); ``load`` also
#: ``seconds`` (spawn to ready).
COUNTED_EVENTS = {
    "load": "loads",
    "load_failure": "load_failures",
    "load_timeout": "load_timeouts",
    "crash": "crashes",
    "restart": "restarts",
    "safe_mode_retry": "safe_mode_retries",
}


@attr.s(auto_attribs=True, frozen=True)
class StateChange:
    """What a :meth:`DeviceRecord.subscribe` listener is told."""

    supervisor: "DeviceRecord"
    state: DeviceState
    previous: DeviceState
    model: Optional[ModelConfig]

    @property
    def name(self) -> str:
        return self.supervisor.name


class DeviceRecord(UsesReactor[IAgentReactor]):
    """A device's state, model, counters and last failure; its views and events."""

    name: str  # the device name; never None here
    #: Every state change and counted event (see CHILD_STATE, COUNTED_EVENTS).
    events: Events
    output: OutputRing
    policy: RestartPolicy

    def _init_record(self) -> None:
        self.state = STOPPED
        self.model: Optional[ModelConfig] = None
        self.port: Optional[int] = None
        self.pid: Optional[int] = None
        self.generation = 0
        #: Counters (read them, never write them): see COUNTED_EVENTS.
        self.restarts = self.loads = self.load_failures = self.load_timeouts = 0
        self.crashes = self.safe_mode_retries = 0
        #: When the last load was retried in safe mode (reactor seconds).
        self.safe_mode_since: Optional[float] = None
        self.last_load_seconds: Optional[float] = None
        #: The last failure (None while there is none): its message, a stable
        #: code a dispatcher can act on (``model_load_failed``,
        #: ``model_load_timeout``, ``child_crashed``, ``illegal_instruction``,
        #: ``unhealthy``...) and when it happened (reactor seconds).
        self.last_error: Optional[str] = None
        self.last_error_code: Optional[str] = None
        self.last_error_at: Optional[float] = None
        #: The model a switch starts once the current child is gone.
        self._target: Optional[ModelConfig] = None
        self._endpoints = EndpointCache()
        #: What a transition has to tell, delivered once it is complete.
        self._outbox = Outbox()

    # -- telling others ---------------------------------------------------------

    def subscribe(self, listener: Callable[[StateChange], None]) -> Callable[[], None]:
        """Call ``listener(change)`` after every state change, once the
        transition is complete; returns a function that unsubscribes it."""

        def on_event(event: str, **fields: Any) -> None:
            if event == CHILD_STATE:
                listener(StateChange(self, fields["state"], fields["previous"], fields["model_config"]))

        return self.events.subscribe(on_event)

    def _emit(self, event: str, **fields: Any) -> None:
        self._outbox.later(functools.partial(self.events.emit, event, **fields))

    def _count(self, event: str, **fields: Any) -> None:
        """Count ``event`` (one of COUNTED_EVENTS) here and tell observers."""
        attribute = COUNTED_EVENTS[event]
        setattr(self, attribute, getattr(self, attribute) + 1)
        model_id = self.model.model_id if self.model is not None else None
        self._emit(event, device=self.name, model=model_id, **fields)

    def _set_state(self, state: DeviceState) -> None:
        if state == self.state:
            return
        previous, self.state = self.state, state
        model = self.model
        self._emit(CHILD_STATE, device=self.name, state=state, previous=previous,
                   model=model.model_id if model is not None else None, model_config=model)
        self._state_changed()

    def _state_changed(self) -> None:
        """After each change of state, once told (the supervisor's hook)."""

    def _note_error(self, code: Optional[str], message: Optional[str]) -> None:
        self.last_error = message
        self.last_error_code = code
        self.last_error_at = None if code is None else self.reactor.seconds()

    # -- reading (see rolemesh.children.views) ----------------------------------------

    @property
    def logs(self) -> List[str]:
        """The device's last LOG_LINES lines of child output (read only)."""
        return self.output.lines

    @property
    def endpoint(self) -> Optional[ChildEndpoint]:
        if self.state != READY or self.model is None or self.port is None:
            return None
        return self._endpoints.get(self.model.model_id, self.port, self.pid, self.generation)

    @property
    def loading_or_loaded(self) -> Optional[str]:
        """The model id the device has (or is getting), else None."""
        target = self._target
        return child_views.loading_or_loaded(self.state, self.model.model_id if self.model is not None else None,
                                             target.model_id if target is not None else None)

    def snapshot(self) -> Dict[str, Any]:
        return child_views.snapshot(self.state, self.model.model_id if self.model else None, self.port, self.pid,
                                    self.restarts, self.last_error)

    @property
    def warnings(self) -> List[str]:
        """Things an operator should fix though the device serves."""
        return list(self.policy.safe_mode.values())

    def log_tail(self, lines: int) -> List[str]:
        return self.output.tail(lines)
