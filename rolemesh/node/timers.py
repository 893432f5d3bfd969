"""Per-device countdowns that run while a device has no request: the idle
unload (``idle_unload_s``: stop the child) and the opt-in inference probe
(``inference_probe_interval_s``: ask the child for real work, see
:meth:`DeviceSupervisor.check_inference`).

Both are armed when a device goes quiet and stopped when a request starts
there; each fires only if the device is still idle and its child ready.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Mapping, Optional

from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.logger import Logger

from rolemesh.children.state import READY, STARTING
from rolemesh.children.supervisor import DeviceSupervisor
from rolemesh.config.file import ModelConfig
from rolemesh.event_loop.reactor import UsesReactor

log = Logger(namespace="rolemesh.device_timers")


class DeviceTimers(UsesReactor[IReactorTime]):
    """The idle-unload and inference-probe timers of every device."""

    def __init__(
        self,
        supervisors: Mapping[str, DeviceSupervisor],
        is_idle: Callable[[str], bool],
        idle_unload_for: Callable[[ModelConfig], Optional[float]],
        running: Callable[[], bool],
        draining: Callable[[], bool],
        emit: Callable[..., None],
        reactor: Optional[IReactorTime] = None,
    ) -> None:
        self._supervisors = supervisors
        #: No request runs or waits on the device (the scheduler's word).
        self._is_idle = is_idle
        #: The current config's idle unload of a model (None: kept loaded).
        self._idle_unload_for = idle_unload_for
        #: The node runs (no timer is armed before it starts or after it stops).
        self._running = running
        self._draining = draining
        self._emit = emit
        self._reactor = reactor
        self._idle: Dict[str, IDelayedCall] = {}
        self._probes: Dict[str, IDelayedCall] = {}

    def device_quiet(self, device: str) -> None:
        """``device`` has no request now: both countdowns begin (where they apply)."""
        self.arm_idle(device)
        self.arm_probe(device)

    def request_started(self, device: str) -> None:
        """A request begins on ``device``: neither countdown runs meanwhile."""
        self.cancel_idle(device)
        self.cancel_probe(device)

    def stop(self) -> None:
        """Cancel every timer (the node stops)."""
        for timers in (self._idle, self._probes):
            for timer in timers.values():
                if timer.active():
                    timer.cancel()
            timers.clear()

    # -- idle unload ------------------------------------------------------------------

    def cancel_idle(self, device: str) -> None:
        timer = self._idle.pop(device, None)
        if timer is not None and timer.active():
            timer.cancel()

    def arm_idle(self, device: str) -> None:
        self.cancel_idle(device)
        supervisor = self._supervisors[device]
        if supervisor.model is None or supervisor.state not in (READY, STARTING) or not self._running():
            return
        seconds = self._idle_unload_for(supervisor.model)
        if seconds is None:
            return
        self._idle[device] = self.reactor.callLater(seconds, self._idle_unload, device)

    def _idle_unload(self, device: str) -> None:
        self._idle.pop(device, None)
        supervisor = self._supervisors[device]
        if not self._is_idle(device) or supervisor.state != READY:
            return
        assert supervisor.model is not None
        model = supervisor.model
        if model.min_replicas > 1:
            copies = sum(1 for s in self._supervisors.values()
                         if s.state == READY and s.model is not None and s.model.model_id == model.model_id)
            if copies <= model.min_replicas:
                log.info("keeping {model} on {device} though idle: {copies} of min_replicas {least}",
                         model=model.model_id, device=device, copies=copies, least=model.min_replicas)
                return
        log.info("unloading {model} from {device}: idle", model=supervisor.model.model_id, device=device)
        self._emit("idle_unload", device=device, model=supervisor.model.model_id)
        supervisor.stop()

    # -- inference probe (opt-in per model) -----------------------------------------------

    def cancel_probe(self, device: str) -> None:
        timer = self._probes.pop(device, None)
        if timer is not None and timer.active():
            timer.cancel()

    def arm_probe(self, device: str) -> None:
        """After ``inference_probe_interval_s`` with no request, the idle
        device's child is asked for real work (see DeviceSupervisor.check_inference)."""
        self.cancel_probe(device)
        supervisor = self._supervisors[device]
        model = supervisor.model
        if model is None or model.inference_probe_interval_s is None or not self._running():
            return
        if supervisor.state not in (READY, STARTING):
            return
        self._probes[device] = self.reactor.callLater(model.inference_probe_interval_s, self._probe, device)

    def _probe(self, device: str) -> None:
        self._probes.pop(device, None)
        supervisor = self._supervisors[device]
        if not self._is_idle(device) or supervisor.state != READY or self._draining():
            return

        def again(_: Any) -> None:
            if self._is_idle(device):
                self.arm_probe(device)

        d = supervisor.check_inference().addCallback(again)
        d.addErrback(lambda f: log.failure("inference probe on {device} failed", f, device=device))
