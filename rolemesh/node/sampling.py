"""The node's metrics tick: every ``metrics_interval`` seconds the typed
issues are checked, the children's telemetry is sampled (never waited for)
and the backend measures the devices; each device's free memory goes to the
scheduler (a group's: its members' sum, or their least on a shared pool).

A failed or slow device sample keeps the last figures, marked stale with
the reason; an error in the bookkeeping is logged and the loop goes on.
"""

from __future__ import annotations

from typing import Any, Callable, Container, Dict, List, Mapping, Optional, Sequence

from twisted.internet import defer
from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IReactorTime
from twisted.internet.task import LoopingCall
from twisted.logger import Logger
from twisted.python.failure import Failure

from rolemesh.base.devices import DeviceMetrics, DeviceRef
from rolemesh.event_loop.reactor import UsesReactor

log = Logger(namespace="rolemesh.device_sampling")

#: Seconds between device metrics samples, and the bound on one sample.
METRICS_INTERVAL_S = 5.0
METRICS_TIMEOUT_S = 10.0


class DeviceSampler(UsesReactor[IReactorTime]):
    """The metrics loop and the last device sample (:attr:`metrics`)."""

    def __init__(
        self,
        sample: Callable[[Sequence[DeviceRef]], "Deferred[List[DeviceMetrics]]"],
        devices: Callable[[], Sequence[DeviceRef]],
        groups: Mapping[str, List[str]],
        lanes: Container[str],
        set_free_memory: Callable[[str, Optional[int]], None],
        shared_memory: Callable[[], bool],
        changed: Callable[[], None],
        check_feed: Callable[[], None],
        sample_telemetry: Callable[[], object],
        metrics: Optional[Dict[str, DeviceMetrics]] = None,
        interval: float = METRICS_INTERVAL_S,
        reactor: Optional[IReactorTime] = None,
    ) -> None:
        #: The backend's sampler (``IDeviceBackend.sample``).
        self._sample_devices = sample
        #: The node's devices (read each time: a test may replace them).
        self._devices = devices
        self._groups = groups
        #: The lanes the scheduler keeps books for.
        self._lanes = lanes
        self._set_free_memory = set_free_memory
        self._shared_memory = shared_memory
        #: Told after every sample, good or failed (a device's total may come from it).
        self._changed = changed
        self._check_feed = check_feed
        self._sample_telemetry = sample_telemetry
        #: The last sample per device (stale ones marked so).
        self.metrics: Dict[str, DeviceMetrics] = {} if metrics is None else metrics
        self._interval = interval
        self._reactor = reactor
        self._loop: Optional[LoopingCall] = None
        #: A device sample is under way (the next tick skips it).
        self.sampling = False

    def start(self) -> None:
        """Sample now, then every ``interval`` seconds."""
        self._loop = LoopingCall(self.tick)
        self._loop.clock = self.reactor
        self._loop.start(self._interval, now=True)

    def stop(self) -> None:
        if self._loop is not None and self._loop.running:
            self._loop.stop()

    def tick(self) -> "Deferred[None]":
        """One metrics tick: the children's telemetry (on its own, never
        waited for) and the device sample."""
        self._check_feed()  # typed issues raised or cleared, queue pressure, since the last sample
        try:
            self._sample_telemetry()
        except Exception:
            log.failure("telemetry sample failed to start")
        return self.sample_metrics()

    def sample_metrics(self) -> "Deferred[None]":
        """Take one metrics sample; a failed or slow one marks samples stale."""
        if self.sampling:
            return defer.succeed(None)
        self.sampling = True
        try:
            d = self._sample_devices(self._devices())
        except Exception as e:
            d = defer.fail(e)
        d.addTimeout(METRICS_TIMEOUT_S, self.reactor)
        d.addCallbacks(self._got, self._failed)
        # An error in the bookkeeping is logged, not dropped; the loop goes on.
        d.addErrback(lambda f: log.failure("device metrics bookkeeping failed", f))
        return d.addBoth(self._done)

    def _got(self, samples: List[DeviceMetrics]) -> None:
        self._changed()
        for sample in samples:
            previous = self.metrics.get(sample.device)
            if sample.stale and previous is not None:
                # The backend could not measure this device this time:
                # keep the last figures, say they are stale and why.
                sample = previous.marked_stale(sample.error or "sample failed")
            self.metrics[sample.device] = sample
            if sample.device in self._lanes:
                self._set_free_memory(sample.device, sample.memory_free_bytes)
        for group, members in self._groups.items():
            self._set_free_memory(group, group_free_memory(members, self.metrics, self._shared_memory()))

    def _failed(self, f: Failure) -> None:
        why = "timed out" if f.check(defer.TimeoutError, defer.CancelledError) else f.getErrorMessage()
        log.warn("device metrics sample failed: {why}", why=why)
        now = self.reactor.seconds()
        self._changed()
        for device in self._devices():
            previous = self.metrics.get(device.name) or DeviceMetrics(
                device.name, now, memory_total_bytes=device.memory_total_bytes
            )
            self.metrics[device.name] = previous.marked_stale(why)

    def _done(self, _: Any) -> None:
        self.sampling = False


def group_free_memory(members: Sequence[str], metrics: Mapping[str, DeviceMetrics], shared: bool) -> Optional[int]:
    """A device group's free memory: its members' sum (their least on a
    shared pool); None unless every member's is known."""
    free = [metrics[m].memory_free_bytes if m in metrics else None for m in members]
    known = [f for f in free if f is not None]
    if len(known) < len(free):
        return None
    return min(known) if shared else sum(known)
