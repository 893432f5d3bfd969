"""One supervisor per device, owning that device's llama-server child.

The supervisor is the only place that changes a child's state.  Callers ask
for an outcome -- ``ensure(model)`` ("have this model ready, tell me where")
or ``stop()`` -- and get a Deferred; they never read the state and act on it
later, so a switch can never race a concurrent load.

States::

    stopped --ensure--> starting --probe ok--> ready
       ^                  |  |                   |
       |        exit/timeout  +--ensure(other)---+--> stopping --reaped--> stopped
       |                  v                                              (or starting,
       +----(retry)---- failed                                            if a switch)

A child that exits while starting fails its waiters at once with the tail of
its log; one that never becomes ready is killed after the startup timeout; a
ready child that crashes moves the device to ``stopped`` (or ``failed`` with a
capped exponential back-off if it keeps crashing) and the next ``ensure``
starts it again.

This module is the state machine only; it composes the mechanism and the
policy, as ``twisted.runner.procmon`` keeps them apart:
:mod:`rolemesh.children.process` (spawning, output, signals),
:mod:`rolemesh.children.attempt` (one spawn: its process, pid file, load watch),
:mod:`rolemesh.children.probes` (readiness and inference probes, load bounds),
:mod:`rolemesh.children.restart_policy` (back-off, safe mode),
:mod:`rolemesh.children.waiters` (who waits for a load or a stop),
:mod:`rolemesh.children.failures` (what each failure is called and says),
:mod:`rolemesh.children.views` (the endpoint and snapshot shown) and
:mod:`rolemesh.children.record` (its base: the state, counters and last
failure it shows, and their telling).  What happens is
told through :attr:`DeviceSupervisor.events` (:mod:`rolemesh.base.events`) once
the transition that caused it is complete: observers -- the node, the metrics
-- that call back into the supervisor see a settled state.
"""

from __future__ import annotations

import functools
import os
from typing import Any, Callable, List, Mapping, Optional, Sequence, Tuple, TypeVar, cast

from twisted.application.service import Service
from twisted.internet import defer
from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IDelayedCall
from twisted.logger import Logger
from twisted.python.failure import Failure

from rolemesh.backends.groups import group_name
from rolemesh.base import errors
from rolemesh.base.devices import DeviceRef
from rolemesh.base.events import Events
from rolemesh.base.interfaces import IAgentReactor, IDeviceBackend
from rolemesh.children import diagnosis
from rolemesh.children import failures as child_failures
from rolemesh.children.attempt import ChildAttempt, start_command
from rolemesh.children.failures import ERROR_TAIL_LINES
from rolemesh.children.health import ChildHealth
from rolemesh.children.pidfiles import PidFiles
from rolemesh.children.probes import (
    ChildProbes,
    InferenceProbe,
    ReadinessProbe,
)
from rolemesh.children.process import (
    ChildProcess,
    Launcher,
    OutputRing,
    pick_free_port,
    wrap_argv,
)
from rolemesh.children.record import DeviceRecord
from rolemesh.children.restart_policy import (
    BackOff,
    RestartPolicy,
    retry_after_seconds,
)
from rolemesh.children.state import FAILED, READY, STARTING, STOPPED, STOPPING, DeviceState
from rolemesh.children.views import ChildEndpoint
from rolemesh.children.waiters import Waiters
from rolemesh.config.file import ModelConfig, NodeConfig

__all__ = ["DeviceSupervisor"]

log = Logger(namespace="rolemesh.supervisor")


_F = TypeVar("_F", bound=Callable[..., Any])


def _transition(method: _F) -> _F:
    """Run ``method`` as one transition: the events and waiter results it
    produces are delivered once it (and any transition it nests) returned."""

    @functools.wraps(method)
    def run(self: "DeviceSupervisor", *args: Any, **kwargs: Any) -> Any:
        self._outbox.enter()
        try:
            return method(self, *args, **kwargs)
        finally:
            self._outbox.leave()

    return cast(_F, run)


class DeviceSupervisor(Service, DeviceRecord):
    """Owns one device's llama-server child: spawn, readiness, switch, stop."""

    name: str  # the device name (Service's is Optional); never None here
    #: Finds the reader of a child's cgroup OOM-kill count (tests replace it).
    oom_counter = staticmethod(diagnosis.oom_counter)

    def __init__(
        self,
        device: DeviceRef,
        backend: IDeviceBackend,
        config: NodeConfig,
        binary: str,
        *,
        reactor: Optional[IAgentReactor] = None,
        probe: Optional[ReadinessProbe] = None,
        inference: Optional[InferenceProbe] = None,
        pick_port: Callable[[], int] = pick_free_port,
        signal_group: Callable[[int, int], None] = os.killpg,
        pidfiles: Optional[PidFiles] = None,
        environ: Optional[Mapping[str, str]] = None,
        wrap: Callable[[List[str], int, Tuple[int, ...]], List[str]] = wrap_argv,
        members: Sequence[DeviceRef] = (),
    ) -> None:
        #: The devices the child is pinned to: ``device`` alone, or a device
        #: group's members (then ``device`` is the first, and the supervisor
        #: is named after the group: ``cuda:0+cuda:1``).
        self.members: Tuple[DeviceRef, ...] = tuple(members) or (device,)
        self.name = group_name([d.name for d in self.members])
        self.device = device
        self._config = config
        self._reactor = reactor
        self._pidfiles = pidfiles
        self.launcher = Launcher(binary, backend, self.members, pick_port, environ, wrap, signal_group)
        self.probes = ChildProbes(lambda: self.reactor, probe, inference)
        self.policy = RestartPolicy()
        self.health = ChildHealth(self.name, self.probes, self.policy, self._still_serving, self._replace)
        self.output = OutputRing()
        self.events = Events()
        self._init_state()

    def _init_state(self) -> None:
        self._init_record()
        #: The current (or last) spawn: its process, pid file, load watch, times.
        self._attempt = ChildAttempt(self.name, None, self.output, self._child_ended, self._pidfiles)
        self._closing = False
        #: When the current model's back-off ends, the device stops saying ``failed``.
        self._backoff_end: Optional[IDelayedCall] = None
        #: The callers of ensure and stop, fired through the outbox.
        self.waiters = Waiters(self._outbox)

    # -- the end of a back-off --------------------------------------------------

    def _arm_backoff_end(self) -> None:
        """A failed device waits out its model's back-off, then says
        ``stopped``: a dispatcher that routes by the heartbeat's state sends
        it the request that tries the model again, instead of none for ever."""
        timer, self._backoff_end = self._backoff_end, None
        if timer is not None and timer.active():
            timer.cancel()
        if self.state != FAILED or self.model is None or self._closing:
            return
        left = self.policy.backing_off(self.model.model_id, self.reactor.seconds())
        if left > 0:
            self._backoff_end = self.reactor.callLater(left, self._backoff_over)

    _state_changed = _arm_backoff_end

    @_transition
    def _backoff_over(self) -> None:
        self._backoff_end = None
        if self.state == FAILED and not self._closing:
            self._set_state(STOPPED)

    # -- the public verbs ------------------------------------------------------

    def serving(self, model: ModelConfig) -> Optional[ChildEndpoint]:
        """The endpoint of a ready child serving ``model`` now, else None
        (what :meth:`ensure` fires with at once, without a Deferred)."""
        current = self.model
        if self._closing or current is None or (current is not model and current != model):
            return None
        return self.endpoint

    @_transition
    def ensure(self, model: ModelConfig) -> "Deferred[ChildEndpoint]":
        """Fire with the endpoint of a ready child serving ``model``.

        Concurrent callers for the model being loaded share one load.  Asking
        for another model switches the child; the scheduler only does that
        once the device has no requests in flight.
        """
        if self._closing:
            return defer.fail(errors.shutting_down())
        endpoint = self.serving(model)
        if endpoint is not None:
            return defer.succeed(endpoint)
        refusal = self.refusal(model)
        if refusal is not None:
            # Backing off: answer at once, spawn nothing and leave the child
            # of another model alone, so that clients' automatic retries do
            # not each start a failing child.
            return defer.fail(refusal)
        if self.state == STARTING and self.model == model:
            return self.waiters.for_load(model.model_id)
        self.waiters.fail(
            errors.model_load_failed(f"load on {self.name} superseded by a switch to {model.model_id!r}"),
            keep=model.model_id,
        )
        d = self.waiters.for_load(model.model_id)
        self._target = model
        if self.state in (STARTING, READY):
            self._stop_child("switching to " + model.model_id)
        elif self.state in (STOPPED, FAILED):
            self._start_target()
        # STOPPING: child_ended starts the target once the old child is reaped.
        return d

    def retarget(self, model: ModelConfig) -> None:
        """A reload replaced the command of the model a switch is about to
        start (the old child still stopping): start ``model``'s instead, so
        one reload costs one load, not the old command's and then the new's."""
        target = self._target
        if target is not None and target.model_id == model.model_id and target is not model:
            self._target = model

    def refusal(self, model: ModelConfig) -> Optional[errors.ApiError]:
        """The 503 for ``model`` while it backs off on this device (its
        Retry-After: when it will be tried again), else None.  Only the model
        that failed is refused: another model's request is served."""
        now = self.reactor.seconds()
        self.policy.about(model)  # a back-off of a command a reload replaced refuses nothing
        return child_failures.refusal(model.model_id, self.name, self.policy.backoff(model.model_id, now), now)

    def backoffs(self) -> List[BackOff]:
        """The models backing off on this device now (the inventory, the metrics)."""
        return self.policy.active(self.reactor.seconds())

    @_transition
    def stop(self) -> "Deferred[None]":
        """Stop the child (TERM, then KILL after the grace); fires once reaped."""
        self._target = None
        self.waiters.fail(errors.model_load_failed(f"model load on {self.name} cancelled: device stopped"))
        if self.state in (STOPPED, FAILED):
            return defer.succeed(None)
        d: Deferred[None] = self.waiters.for_stop()
        if self.state != STOPPING:
            self._stop_child("stop requested")
        return d

    def replace_if_unhealthy(self, after: str = "an upstream timeout",
                             generation: Optional[int] = None) -> "Deferred[bool]":
        """After a failed request: probe the child once; one that fails is
        stopped (the next ensure starts a fresh one).  Fires True if it was
        stopped.

        ``generation``: the child the request went to; if that child is
        already gone (replaced meanwhile), nothing is probed or stopped.
        """
        endpoint, model = self.endpoint, self.model
        if endpoint is None or model is None or (generation is not None and generation != self.generation):
            return defer.succeed(False)
        return self.health.after_failure(endpoint, model, self.generation, after)

    def check_inference(self) -> "Deferred[bool]":
        """Ask the ready child for a 1-token answer (the opt-in
        ``inference_probe_interval_s``); after INFERENCE_PROBE_FAILURES
        failures in a row it is replaced.  Fires True if it answered."""
        endpoint, model = self.endpoint, self.model
        if endpoint is None or model is None:
            return defer.succeed(False)
        return self.health.inference(endpoint, model, self.generation)

    def _still_serving(self, generation: int) -> bool:
        return generation == self.generation and self.state == READY

    @_transition
    def _replace(self, code: str, message: str, why: str) -> bool:
        """Replace the ready child that failed its probes (ChildHealth's verdict)."""
        self._count("restart")
        self._note_error(code, message)
        self._stop_child(why, healthy=False)
        return True

    def startService(self) -> None:
        super().startService()
        self._closing = False

    def stopService(self) -> "Deferred[None]":
        super().stopService()
        self._closing = True
        self._arm_backoff_end()  # cancels it
        return self.stop()

    # -- starting -------------------------------------------------------------

    def _start_target(self) -> None:
        model, self._target = self._target, None
        assert model is not None
        self.model = model
        self.generation += 1
        self.policy.bind_retries = 0
        self._spawn()

    def _spawn(self) -> None:
        model = self.model
        assert model is not None
        self.port = self.launcher.pick_port()
        self.policy.about(model)
        argv, env, wrapped = start_command(self.launcher, model, self.port, model.model_id in self.policy.safe_mode,
                                           self.output, self.name)
        self.policy.inference_failures = 0
        attempt = self._attempt = ChildAttempt(self.name, model.model_id, self.output, self._child_ended,
                                               self._pidfiles, self.reactor.seconds())
        self._set_state(STARTING)
        try:
            child = attempt.spawn(self.reactor, self.launcher, wrapped, env, argv, self.oom_counter)
        except Exception as e:  # e.g. the interpreter vanished: fail, don't wedge
            account = self._record_failure(child_failures.spawn_failed(self.name, e))[1]
            self._load_failed(errors.model_load_failed(account.message))
            return
        self.pid = child.pid
        served_name, base_url = model.served_name, f"http://127.0.0.1:{self.port}"
        attempt.watch_load(self.reactor, self._config, lambda: self.probes.readiness(base_url, served_name),
                           self._became_ready, self._load_timed_out)

    @_transition
    def _became_ready(self) -> None:
        self.last_load_seconds = self._attempt.ready(self.reactor.seconds())
        assert self.model is not None
        log.info("llama-server for {model} ready on {device} in {seconds:.2f}s (pid {pid})",
                 model=self.model.model_id, device=self.name, seconds=self.last_load_seconds, pid=self.pid)
        self._count("load", seconds=self.last_load_seconds)
        self.policy.loaded(self.model.model_id)  # its run of failed loads is over
        self._note_error(None, None)
        self._set_state(READY)
        name = self.name
        self.waiters.ready(self.model.model_id, self.endpoint, lambda waited: child_failures.superseded(waited, name))

    @_transition
    def _load_timed_out(self, what: str) -> None:
        assert self.model is not None
        self._attempt.stop_watch()
        backoff, account = self._record_failure(child_failures.timed_out(self.model, what, self.name,
                                                                         self.output.attempt()))
        self._note_error(account.code, account.message)
        self._stop_child("load timed out", kill_now=True, reason=FAILED, healthy=False)
        self.waiters.fail(errors.model_load_timeout(account.message, retry_after=retry_after_seconds(backoff.delay)))

    # -- the end of a child (told by its ChildAttempt) --------------------------------

    def _record_failure(self, account: child_failures.Account) -> Tuple[BackOff, child_failures.Account]:
        """Count a failure of the current model (in the policy's run of its
        history, and as its events); log the back-off it sets, and why."""
        assert self.model is not None
        self.policy.about(self.model)
        backoff = self.policy.record_failure(self.model.model_id, self.reactor.seconds(), account.history,
                                             account.schedule, self._attempt.ready_at, account.code, account.message)
        child_failures.log_backoff(backoff, self.name)
        for event in account.events:
            self._count(event)
        return backoff, account

    @_transition
    def _child_ended(self, attempt: ChildAttempt, child: Optional[ChildProcess], reason: Failure) -> None:
        if attempt is not self._attempt or child is not attempt.child:
            return  # not the current child: nothing it says changes the device
        was = self.state
        exit = attempt.ended(reason)
        lines = self.output.attempt()
        self.output.append(f"[rolemesh] llama-server {exit.how}")
        if was == STOPPING or (child is not None and child.asked_to_stop):
            self._ended_as_asked(exit)  # the end we asked for, whatever its exit status
        elif was == STARTING:
            if not self._ended_while_starting(exit, lines):
                return  # retried at once
        else:  # READY
            self._ended_while_ready(exit)
        self.waiters.stopped()
        if self._target is not None and not self._closing:
            self._start_target()

    def _ended_while_starting(self, exit: diagnosis.Exit, attempt: List[str]) -> bool:
        """A load ended on its own: retry it at once (port taken; SIGILL, once,
        in safe mode) and say False, or fail it."""
        model = self.model
        assert model is not None
        if self.policy.retry_bind(attempt):
            log.warn("port {port} was taken before llama-server bound it; retrying on another port", port=self.port)
            self._spawn()
            return False
        if exit.is_sigill and self._may_retry_safely(model):
            self._spawn()
            return False
        backoff, account = self._record_failure(child_failures.load_ended(model, self.name, exit, attempt))
        self._load_failed(errors.model_load_failed(account.message, retry_after=retry_after_seconds(backoff.delay)),
                          account.code)
        return True

    def _ended_while_ready(self, exit: diagnosis.Exit) -> None:
        model = self.model
        assert model is not None
        account = child_failures.crash(model, exit, self.output.tail(ERROR_TAIL_LINES))
        log.error("{message}", message=account.message, device=self.name, model=model.model_id)
        backoff = self._record_failure(account)[0]
        self._note_error(account.code, account.message)
        self._set_state(FAILED if backoff.delay > 0 else STOPPED)

    def _ended_as_asked(self, exit: diagnosis.Exit) -> None:
        model = self.model
        assert model is not None
        attempt = self._attempt
        self.policy.stopped(model.model_id, self.reactor.seconds(), attempt.ready_at, attempt.stop_healthy)
        log.info("llama-server for {model} on {device} stopped ({how})",
                 model=model.model_id, device=self.name, how=exit.how)
        self._set_state(attempt.stop_reason or STOPPED)

    def _may_retry_safely(self, model: ModelConfig) -> bool:
        """After a SIGILL at load: retry once with --no-repack unless the
        model already runs that way.  Said in the log, inventory and metrics."""
        warning = self.policy.enter_safe_mode(model, self.name)
        if warning is None:
            return False
        self._count("safe_mode_retry")
        self.safe_mode_since = self.reactor.seconds()
        log.warn("{message}; retrying once", message=warning, device=self.name, model=model.model_id)
        return True

    def _load_failed(self, error: errors.ApiError, code: Optional[str] = None) -> None:
        self._note_error(code or error.code, error.message)
        log.error("{message}", message=error.message, device=self.name)
        self._set_state(FAILED)
        self.waiters.fail(error)

    # -- stopping -------------------------------------------------------------

    def _stop_child(self, why: str, kill_now: bool = False, reason: Optional[DeviceState] = None,
                    healthy: bool = True) -> None:
        self._attempt.stopping(reason, healthy)
        self._set_state(STOPPING)
        if not self._attempt.stop(why, kill_now, self._config.llama_server_stop_timeout_s):
            # never spawned: nothing to reap
            self._child_ended(self._attempt, None, Failure(ProcessLookupError("not running")))
