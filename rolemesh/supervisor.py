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
"""

from __future__ import annotations

import collections
import os
import re
import signal
import socket
import sys
from typing import Any, Callable, Deque, Dict, List, Mapping, Optional, Sequence, Tuple

import attr
from twisted.application.service import Service
from twisted.internet import defer
from twisted.internet.defer import Deferred
from twisted.internet.protocol import ProcessProtocol
from twisted.internet.task import LoopingCall
from twisted.logger import Logger
from twisted.python.failure import Failure

from rolemesh import diagnosis, errors
from rolemesh.backends.groups import group_name, pin_child
from rolemesh.backoff import load_retry_delay, restart_delay
from rolemesh.config import ModelConfig, NodeConfig
from rolemesh.devices import DeviceRef
from rolemesh.interfaces import IDeviceBackend
from rolemesh.llama_args import build_argv
from rolemesh.pidfiles import PidFiles
from rolemesh.reactor import UsesReactor

log = Logger()

STOPPED = "stopped"
STARTING = "starting"
READY = "ready"
STOPPING = "stopping"
FAILED = "failed"

#: Lines of child output kept per device, for errors and the logs endpoint.
LOG_LINES = 1000
#: Lines of log tail put into a crash message.
ERROR_TAIL_LINES = 12
#: Lines of one start attempt kept for its failure message.
ATTEMPT_LINES = 200
#: A child up at least this long before it fails starts a fresh failure count.
STABLE_AFTER_S = 30.0
#: While stopping, SIGTERM is repeated this often until the grace is over.
TERM_REPEAT_S = 0.25
#: How often a port collision between pick and bind is retried.
BIND_RETRIES = 3
#: Output that means the child is about to answer; it triggers a probe at once.
_READY_HINTS = (b"listening on http", b"model loaded", b"all slots are idle")
#: llama-server's error lines (``0.00.005.256 E srv ...``) and crashes.  Its
#: warnings are mostly per-request noise (prompt-cache notes); they stay in
#: the ring buffer that the logs endpoint serves.
_IMPORTANT = re.compile(rb"^\s*[\d.]+ E |error|failed|assert|abort", re.IGNORECASE)
_BIND_FAILURE = re.compile(r"couldn't bind|address already in use", re.IGNORECASE)


def _seconds(delay: float) -> int:
    """Retry-After seconds for a delay: whole seconds, at least 1."""
    return max(1, int(delay + 0.999))


def _killed_from_outside(exit: diagnosis.Exit) -> bool:
    """SIGKILL/SIGTERM/SIGINT while loading came from outside (a person, the
    OOM killer): worth one more try at once, like a crash of a ready child."""
    return exit.signal in (signal.SIGKILL, signal.SIGTERM, signal.SIGINT)


def exit_of(reason: Failure) -> diagnosis.Exit:
    """How a child ended, from ``processEnded``'s reason."""
    return diagnosis.Exit(getattr(reason.value, "signal", None), getattr(reason.value, "exitCode", None))


def pick_free_port(host: str = "127.0.0.1") -> int:
    """Ask the kernel for a free TCP port (the child binds it a moment later;
    a collision in between is detected from the child's output and retried)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


CHILD_EXEC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "child_exec.py")


def wrap_argv(argv: List[str], parent_pid: int, cpus: Tuple[int, ...] = ()) -> List[str]:
    """Prefix ``argv`` with the exec wrapper (new process group, parent-death
    signal, core pinning)."""
    wrapper = [sys.executable, "-S", "-E", CHILD_EXEC, "--parent", str(parent_pid)]
    if cpus:
        wrapper += ["--cpus", ",".join(str(c) for c in cpus)]
    return wrapper + ["--"] + list(argv)


def http_probe(http: Any, timeout: float = 2.0, clock: Any = None) -> Callable[[str, str], "Deferred[bool]"]:
    """A readiness probe: ``GET /health`` is 200 and ``GET /v1/models`` lists
    the model under its served name.  ``http`` is a treq-like client.

    treq's ``timeout`` bounds only the wait for headers; with ``clock`` the
    whole probe, body reads included, is bounded too (twice ``timeout``).
    """

    def probe(base_url: str, served_name: str) -> "Deferred[bool]":
        client = http

        @defer.inlineCallbacks
        def run():
            response = yield client.get(base_url + "/health", timeout=timeout)
            yield response.content()
            if response.code != 200:
                return False
            response = yield client.get(base_url + "/v1/models", timeout=timeout)
            if response.code != 200:
                yield response.content()
                return False
            body = yield response.json()
            return any(
                served_name == entry.get("id") or served_name in (entry.get("aliases") or ())
                for entry in body.get("data", ())
                if isinstance(entry, dict)
            )

        d = run()
        return d if clock is None else d.addTimeout(2 * timeout, clock)

    return probe


#: Inference probes failed in a row before the child is replaced.
INFERENCE_PROBE_FAILURES = 3
#: Bound on one inference probe (a 1-token answer from an idle child).
INFERENCE_PROBE_TIMEOUT_S = 30.0


def inference_probe(http: Any, clock: Any, timeout: float = INFERENCE_PROBE_TIMEOUT_S
                    ) -> Callable[[str, ModelConfig], "Deferred[bool]"]:
    """A probe that asks for real work: a 1-token completion (an embedding
    for a model served with ``embeddings``) answered 200 within ``timeout``.
    A child can answer ``/health`` while its GPU is broken; this cannot."""

    def probe(base_url: str, model: ModelConfig) -> "Deferred[bool]":
        embeds = any(flag in ("embeddings", "embedding") and value not in (None, False)
                     for flag, value in model.server_args)
        body: Dict[str, Any] = {"model": model.served_name}
        if embeds:
            path = "/v1/embeddings"
            body["input"] = "ok"
        else:
            path = "/v1/completions"
            body.update(prompt="ok", max_tokens=1)
        d = http.post(base_url + path, json=body, timeout=timeout)
        d.addCallback(lambda response: response.content().addCallback(lambda _: response.code == 200))
        return d.addTimeout(timeout, clock)

    return probe


@attr.s(auto_attribs=True, frozen=True)
class ChildEndpoint:
    """Where a ready child answers, and which child it is."""

    model_id: str
    base_url: str
    port: int
    pid: int
    generation: int


class _ChildProtocol(ProcessProtocol):
    """Drains the child's output line by line and reports its end."""

    def __init__(self, supervisor: "DeviceSupervisor", generation: int) -> None:
        self._supervisor = supervisor
        self._generation = generation
        self._partial: Dict[int, bytes] = {1: b"", 2: b""}

    def childDataReceived(self, fd: int, data: bytes) -> None:
        self._supervisor._load_progressed(self._generation)
        buffered = self._partial.get(fd, b"") + data
        *lines, self._partial[fd] = buffered.split(b"\n")
        if len(self._partial[fd]) > 8192:  # a runaway line: keep it, bounded
            lines.append(self._partial[fd])
            self._partial[fd] = b""
        for line in lines:
            self._supervisor._child_output(self._generation, fd, line.rstrip(b"\r"))

    def processEnded(self, reason: Failure) -> None:
        for fd, rest in self._partial.items():
            if rest:
                self._supervisor._child_output(self._generation, fd, rest)
        self._supervisor._child_ended(self._generation, reason)


class DeviceSupervisor(Service, UsesReactor):
    """Owns one device's llama-server child: spawn, readiness, switch, stop."""

    name: str  # the device name; never None here

    def __init__(
        self,
        device: DeviceRef,
        backend: IDeviceBackend,
        config: NodeConfig,
        binary: str,
        *,
        reactor: Any = None,
        probe: Optional[Callable[[str, str], "Deferred[bool]"]] = None,
        inference: Optional[Callable[[str, ModelConfig], "Deferred[bool]"]] = None,
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
        self._backend = backend
        self._config = config
        self._binary = binary
        self._reactor = reactor
        self._probe = probe
        self._inference = inference
        self._inference_failures = 0
        self._pick_port = pick_port
        self._signal_group = signal_group
        self._pidfiles = pidfiles
        self._environ = environ
        self._wrap = wrap

        self.state = STOPPED
        self.model: Optional[ModelConfig] = None
        self.port: Optional[int] = None
        self.pid: Optional[int] = None
        self.generation = 0
        #: Counters for metrics and inventory (read them, never write them).
        self.restarts = 0
        self.loads = 0
        self.load_failures = 0
        self.load_timeouts = 0
        self.crashes = 0
        #: Loads retried with ``--no-repack`` after a SIGILL, and when the last was.
        self.safe_mode_retries = 0
        self.safe_mode_since: Optional[float] = None
        self.last_load_seconds: Optional[float] = None
        self.last_error: Optional[str] = None
        #: What kind of failure ``last_error`` is (a stable code a dispatcher
        #: can act on: ``model_load_failed``, ``model_load_timeout``,
        #: ``child_crashed``, ``illegal_instruction``, ``unhealthy``) and when
        #: it happened (reactor seconds); both None while there is none.
        self.last_error_code: Optional[str] = None
        self.last_error_at: Optional[float] = None
        self.logs: Deque[str] = collections.deque(maxlen=LOG_LINES)

        self._transport: Any = None
        self._target: Optional[ModelConfig] = None
        self._waiters: List[Tuple[str, Deferred]] = []
        self._stop_waiters: List[Deferred] = []
        self._probe_loop: Optional[LoopingCall] = None
        self._probe_in_flight: Optional[Deferred] = None
        self._startup_timer: Any = None
        self._stall_timer: Any = None
        self._kill_timer: Any = None
        self._term_deadline = 0.0
        self._started_at = 0.0
        self._ready_at: Optional[float] = None
        self._bind_retries = 0
        self._stop_reason: Optional[str] = None
        self._failures: Dict[str, int] = {}
        #: Models that died of SIGILL at load here: they run with --no-repack.
        self._safe_mode: Dict[str, str] = {}
        #: This start attempt's output, for its failure message.
        self._attempt: Deque[str] = collections.deque(maxlen=ATTEMPT_LINES)
        self._retry_at: Dict[str, float] = {}
        self._closing = False
        self._listeners: List[Callable[["DeviceSupervisor"], None]] = []

    # -- plumbing -----------------------------------------------------------

    @property
    def _probe_fn(self) -> Callable[[str, str], "Deferred[bool]"]:
        if self._probe is None:
            from rolemesh.http_client import quiet_treq

            self._probe = http_probe(quiet_treq(self.reactor, persistent=False, connect_timeout=2.0),
                                     clock=self.reactor)
        return self._probe

    @property
    def _inference_fn(self) -> Callable[[str, ModelConfig], "Deferred[bool]"]:
        if self._inference is None:
            from rolemesh.http_client import quiet_treq

            self._inference = inference_probe(quiet_treq(self.reactor, persistent=False, connect_timeout=2.0),
                                              self.reactor)
        return self._inference

    def subscribe(self, listener: Callable[["DeviceSupervisor"], None]) -> None:
        """Call ``listener(self)`` after every state change."""
        self._listeners.append(listener)

    def _set_state(self, state: str) -> None:
        if state == self.state:
            return
        self.state = state
        for listener in list(self._listeners):
            try:
                listener(self)
            except Exception:
                log.failure("state listener failed", device=self.name)

    @property
    def endpoint(self) -> Optional[ChildEndpoint]:
        if self.state != READY or self.model is None or self.port is None:
            return None
        return ChildEndpoint(
            self.model.model_id, f"http://127.0.0.1:{self.port}", self.port, self.pid or 0, self.generation
        )

    @property
    def loading_or_loaded(self) -> Optional[str]:
        """The model id the device has (or is getting), else None."""
        if self.state in (STARTING, READY) and self.model is not None:
            return self.model.model_id
        if self.state == STOPPING and self._target is not None:
            return self._target.model_id
        return None

    def snapshot(self) -> Dict[str, Any]:
        return {
            "state": self.state,
            "model": self.model.model_id if self.model and self.state != STOPPED else None,
            "port": self.port if self.state in (STARTING, READY, STOPPING) else None,
            "pid": self.pid if self.state in (STARTING, READY, STOPPING) else None,
            "restarts": self.restarts,
            "last_error": self.last_error,
        }

    @property
    def warnings(self) -> List[str]:
        """Things an operator should fix though the device serves."""
        return list(self._safe_mode.values())

    def log_tail(self, lines: int) -> List[str]:
        if lines <= 0:
            return []
        return list(self.logs)[-lines:]

    # -- the public verbs ------------------------------------------------------

    def ensure(self, model: ModelConfig) -> "Deferred[ChildEndpoint]":
        """Fire with the endpoint of a ready child serving ``model``.

        Concurrent callers for the model being loaded share one load.  Asking
        for another model switches the child; the scheduler only does that
        once the device has no requests in flight.
        """
        if self._closing:
            return defer.fail(errors.shutting_down())
        endpoint = self.endpoint
        if endpoint is not None and self.model == model:
            return defer.succeed(endpoint)
        retry_at = self._retry_at.get(model.model_id, 0.0)
        wait = retry_at - self.reactor.seconds()
        if self.state in (FAILED, STOPPED) and wait > 0:
            # Backing off: answer at once and spawn nothing, so that clients'
            # automatic retries do not each start a failing child.
            return defer.fail(
                errors.model_load_failed(
                    diagnosis.shorten(
                        f"model {model.model_id!r} failed {self._failures.get(model.model_id, 0)} times in a row "
                        f"on {self.name}; next attempt in {_seconds(wait)}s. Last error: "
                        f"{self.last_error or 'unknown'}"
                    ),
                    retry_after=_seconds(wait),
                )
            )
        d: Deferred = Deferred(lambda d: self._cancel_waiter(d))
        if self.state == STARTING and self.model == model:
            self._waiters.append((model.model_id, d))
            return d
        self._fail_waiters(
            errors.model_load_failed(f"load on {self.name} superseded by a switch to {model.model_id!r}"),
            keep=model.model_id,
        )
        self._waiters.append((model.model_id, d))
        self._target = model
        if self.state in (STARTING, READY):
            self._stop_child("switching to " + model.model_id)
        elif self.state in (STOPPED, FAILED):
            self._start_target()
        # STOPPING: _child_ended starts the target once the old child is reaped.
        return d

    def stop(self) -> "Deferred[None]":
        """Stop the child (TERM, then KILL after the grace); fires once reaped."""
        self._target = None
        self._fail_waiters(errors.model_load_failed(f"model load on {self.name} cancelled: device stopped"))
        if self.state in (STOPPED, FAILED):
            return defer.succeed(None)
        d: Deferred = Deferred()
        self._stop_waiters.append(d)
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
        endpoint = self.endpoint
        if endpoint is None or self.model is None:
            return defer.succeed(False)
        if generation is not None and generation != self.generation:
            return defer.succeed(False)
        generation = self.generation
        model_id = self.model.model_id
        d = self._probe_fn(endpoint.base_url, self.model.served_name)

        def judged(ok: Any) -> bool:
            if ok is True or self.generation != generation or self.state != READY:
                return False
            log.warn("llama-server on {device} failed a health probe after {after}; restarting",
                     device=self.name, after=after)
            self.restarts += 1
            self._note_error("unhealthy", f"llama-server for {model_id!r} failed a health probe "
                                          f"after {after} on {self.name}; restarted")
            self._stop_child(f"unhealthy after {after}")
            return True

        return d.addErrback(lambda _: False).addCallback(judged)

    def check_inference(self) -> "Deferred[bool]":
        """Ask the ready child for a 1-token answer (the opt-in
        ``inference_probe_interval_s``); after INFERENCE_PROBE_FAILURES
        failures in a row it is replaced.  Fires True if it answered."""
        endpoint, model = self.endpoint, self.model
        if endpoint is None or model is None:
            return defer.succeed(False)
        generation = self.generation
        d = self._inference_fn(endpoint.base_url, model)

        def judged(ok: Any) -> bool:
            if generation != self.generation or self.state != READY:
                return False
            if ok is True:
                self._inference_failures = 0
                return True
            self._inference_failures += 1
            log.warn("llama-server for {model} on {device} failed an inference probe ({count} of {limit} in a row)",
                     model=model.model_id, device=self.name, count=self._inference_failures,
                     limit=INFERENCE_PROBE_FAILURES)
            if self._inference_failures >= INFERENCE_PROBE_FAILURES:
                self.restarts += 1
                self._note_error("inference_probe_failed",
                                 f"llama-server for {model.model_id!r} answered /health but failed "
                                 f"{INFERENCE_PROBE_FAILURES} inference probes in a row on {self.name}; restarted")
                self._stop_child("failed its inference probes")
            return False

        return d.addErrback(lambda _: False).addCallback(judged)

    def startService(self) -> None:
        super().startService()
        self._closing = False

    def stopService(self) -> "Deferred[None]":
        super().stopService()
        self._closing = True
        return self.stop()

    # -- starting -------------------------------------------------------------

    def _start_target(self) -> None:
        model, self._target = self._target, None
        assert model is not None
        self.model = model
        self.generation += 1
        self._bind_retries = 0
        self._spawn()

    def _spawn(self) -> None:
        model = self.model
        assert model is not None
        self.port = self._pick_port()
        base = os.environ if self._environ is None else self._environ
        defaults, env, cpus = pin_child(self._backend, self.members, base)
        argv = build_argv(self._binary, model, self.port, device_defaults=defaults)
        if model.model_id in self._safe_mode:
            argv.append("--" + diagnosis.SAFE_FLAG)
        self._attempt.clear()
        self._inference_failures = 0
        wrapped = self._wrap(argv, os.getpid(), cpus)
        self.logs.append(f"[rolemesh] starting {model.model_id} on {self.name}: {' '.join(argv)}")
        log.info("starting llama-server for {model} on {device} (port {port})",
                 model=model.model_id, device=self.name, port=self.port)
        self._started_at = self.reactor.seconds()
        self._ready_at = None
        self._stop_reason = None
        self._set_state(STARTING)
        try:
            self._transport = self.reactor.spawnProcess(
                _ChildProtocol(self, self.generation), wrapped[0], wrapped, env=env
            )
        except Exception as e:  # e.g. the interpreter vanished: fail, don't wedge
            self._transport = None
            self._record_failure()
            self.load_failures += 1
            self._load_failed(errors.model_load_failed(f"cannot start llama-server on {self.name}: {e}"))
            return
        self.pid = self._transport.pid
        if self._pidfiles is not None:
            self._pidfiles.write(self.name, self.pid, argv)
        self._probe_loop = LoopingCall(self._probe_once)
        self._probe_loop.clock = self.reactor
        self._probe_loop.start(self._config.llama_server_probe_interval_s, now=False)
        self._startup_timer = self.reactor.callLater(
            self._config.llama_server_startup_timeout_s, self._startup_timed_out
        )
        self._stall_timer = self.reactor.callLater(self._config.llama_server_stall_timeout_s, self._stalled)

    def _probe_once(self) -> None:
        if self.state != STARTING or self._probe_in_flight is not None or self.model is None:
            return
        generation = self.generation
        try:
            d = self._probe_fn(f"http://127.0.0.1:{self.port}", self.model.served_name)
        except Exception:
            log.failure("readiness probe raised", device=self.name)
            return
        self._probe_in_flight = d

        def done(ok: Any) -> None:
            self._probe_in_flight = None
            if ok is True and generation == self.generation and self.state == STARTING:
                self._became_ready()

        def failed(_: Failure) -> None:
            self._probe_in_flight = None  # not up yet (or cancelled): keep polling

        d.addCallbacks(done, failed).addErrback(lambda f: log.failure("readiness bookkeeping failed", f,
                                                                      device=self.name))

    def _stop_timers(self) -> None:
        if self._probe_in_flight is not None:
            self._probe_in_flight.cancel()
        if self._probe_loop is not None and self._probe_loop.running:
            self._probe_loop.stop()
        self._probe_loop = None
        for timer in (self._startup_timer, self._stall_timer):
            if timer is not None and timer.active():
                timer.cancel()
        self._startup_timer = self._stall_timer = None

    def _became_ready(self) -> None:
        self._stop_timers()
        self._ready_at = self.reactor.seconds()
        self.loads += 1
        self.last_load_seconds = self._ready_at - self._started_at
        assert self.model is not None
        log.info("llama-server for {model} ready on {device} in {seconds:.2f}s (pid {pid})",
                 model=self.model.model_id, device=self.name, seconds=self._ready_at - self._started_at,
                 pid=self.pid)
        self._note_error(None, None)
        self._set_state(READY)
        endpoint = self.endpoint
        waiters, self._waiters = self._waiters, []
        for model_id, d in waiters:
            if model_id == self.model.model_id:
                d.callback(endpoint)
            else:  # superseded by a later switch request; cannot happen via the scheduler
                d.errback(errors.model_load_failed(f"model {model_id!r} was superseded on {self.name}"))

    def _startup_timed_out(self) -> None:
        self._startup_timer = None
        timeout = self._config.llama_server_startup_timeout_s
        self._load_timed_out(f"did not become ready within {timeout:g}s (llama_server_startup_timeout_s)")

    def _stalled(self) -> None:
        """Loading made no progress (no output at all) for the stall window:
        fail now rather than at the outer startup bound."""
        self._stall_timer = None
        window = self._config.llama_server_stall_timeout_s
        self._load_timed_out(f"stalled: printed nothing for {window:g}s while loading (llama_server_stall_timeout_s)")

    def _load_progressed(self, generation: int) -> None:
        """Any output of a loading child is progress (llama.cpp prints its
        load steps, and dots while it reads tensors): the stall window restarts."""
        if generation == self.generation and self._stall_timer is not None and self._stall_timer.active():
            self._stall_timer.reset(self._config.llama_server_stall_timeout_s)

    def _load_timed_out(self, what: str) -> None:
        assert self.model is not None
        self._stop_timers()
        line = diagnosis.decisive_line(self._attempt, self.model.path, self.model.model_id)
        message = diagnosis.shorten(
            f"model {self.model.model_id!r} {what} on {self.name}" + (f"; last error: {line}" if line else "")
        )
        delay = self._record_failure(load=True)
        self.load_timeouts += 1
        self._note_error("model_load_timeout", message)
        self._stop_child("load timed out", kill_now=True, reason=FAILED)
        self._fail_waiters(errors.model_load_timeout(message, retry_after=_seconds(delay)))

    # -- output and exit ------------------------------------------------------

    def _child_output(self, generation: int, fd: int, line: bytes) -> None:
        text = line.decode("utf-8", "replace")
        self.logs.append(text)
        if generation == self.generation:
            self._attempt.append(text)
        starting = generation == self.generation and self.state == STARTING
        # Every line goes to the ring buffer (the logs endpoint, error tails).
        # The log gets all of a start and a stop, but from a ready child only
        # errors: llama-server prints ~9 lines per request, and logging each
        # costs more CPU than relaying the request.
        if self.state != READY or _IMPORTANT.search(line):
            model = self.model.model_id if self.model else None
            log.info("{device} {model}: {line}", device=self.name, model=model, line=text, stream=fd)
        if starting and any(h in line for h in _READY_HINTS):
            self._probe_once()

    def _record_failure(self, load: bool = False) -> float:
        """Count a failure in a row; returns the back-off before the next try."""
        assert self.model is not None
        model_id = self.model.model_id
        now = self.reactor.seconds()
        if self._ready_at is not None and now - self._ready_at >= STABLE_AFTER_S:
            self._failures[model_id] = 0
        failures = self._failures.get(model_id, 0) + 1
        self._failures[model_id] = failures
        delay = load_retry_delay(failures) if load else restart_delay(failures)
        self._retry_at[model_id] = now + delay
        return delay

    def _child_ended(self, generation: int, reason: Failure) -> None:
        if generation != self.generation:
            return
        was = self.state
        self._stop_timers()
        if self._kill_timer is not None and self._kill_timer.active():
            self._kill_timer.cancel()
        self._kill_timer = None
        self._transport = None
        if self._pidfiles is not None:
            self._pidfiles.remove(self.name)
        exit = exit_of(reason)
        how = exit.how
        self.logs.append(f"[rolemesh] llama-server {how}")
        assert self.model is not None
        model = self.model

        if was == STARTING:
            if any(_BIND_FAILURE.search(line) for line in self._attempt) and self._bind_retries < BIND_RETRIES:
                self._bind_retries += 1
                log.warn("port {port} was taken before llama-server bound it; retrying on another port",
                         port=self.port)
                self._spawn()
                return
            if exit.is_sigill and self._may_retry_safely(model):
                self._spawn()
                return
            message = diagnosis.load_failure(model.model_id, self.name, exit, self._attempt, model.path)
            delay = self._record_failure(load=not _killed_from_outside(exit))
            self.load_failures += 1
            self._load_failed(
                errors.model_load_failed(message, retry_after=_seconds(delay)),
                exit.error_code("model_load_failed"),
            )
        elif was == READY:
            delay = self._record_failure()
            self.crashes += 1
            self.restarts += 1
            meaning = f" ({exit.meaning})" if exit.meaning else ""
            line = diagnosis.decisive_line(list(self.logs)[-ERROR_TAIL_LINES:], model.path, model.model_id)
            self._note_error(
                exit.error_code("child_crashed"),
                diagnosis.shorten(f"llama-server for {model.model_id!r} {how} unexpectedly{meaning}"
                                  + (f": {line}" if line else "")),
            )
            log.error("{message}", message=self.last_error, device=self.name, model=model.model_id)
            self._set_state(FAILED if delay > 0 else STOPPED)
        else:  # STOPPING: the end we asked for
            if self._ready_at is not None and self.reactor.seconds() - self._ready_at >= STABLE_AFTER_S:
                self._failures[model.model_id] = 0
            log.info("llama-server for {model} on {device} stopped ({how})",
                     model=model.model_id, device=self.name, how=how)
            self._set_state(self._stop_reason or STOPPED)

        stop_waiters, self._stop_waiters = self._stop_waiters, []
        for d in stop_waiters:
            d.callback(None)
        if self._target is not None and not self._closing:
            self._start_target()

    def _may_retry_safely(self, model: ModelConfig) -> bool:
        """After a SIGILL at load: retry once with --no-repack (llama.cpp's
        repacked kernels are where AMX / AVX-512 code runs) unless the model
        already runs that way.  Said in the log, inventory and metrics."""
        if model.model_id in self._safe_mode or any(
            flag == diagnosis.SAFE_FLAG and value not in (None, False) for flag, value in model.server_args
        ):
            return False
        self._safe_mode[model.model_id] = (
            f"model {model.model_id!r} died of SIGILL (illegal instruction) while loading on {self.name} and "
            f"now runs with --{diagnosis.SAFE_FLAG}: this llama-server build uses CPU instructions this machine "
            "cannot run; install the portable build (scripts/install-llama-server.sh)"
        )
        self.safe_mode_retries += 1
        self.safe_mode_since = self.reactor.seconds()
        log.warn("{message}; retrying once", message=self._safe_mode[model.model_id], device=self.name,
                 model=model.model_id)
        return True

    def _note_error(self, code: Optional[str], message: Optional[str]) -> None:
        self.last_error = message
        self.last_error_code = code
        self.last_error_at = None if code is None else self.reactor.seconds()

    def _load_failed(self, error: errors.ApiError, code: Optional[str] = None) -> None:
        self._note_error(code or error.code, error.message)
        log.error("{message}", message=error.message, device=self.name)
        self._set_state(FAILED)
        self._fail_waiters(error)

    def _fail_waiters(self, error: errors.ApiError, keep: Optional[str] = None) -> None:
        """Fail every waiter, except those for model ``keep``."""
        waiters = self._waiters
        self._waiters = [(m, d) for (m, d) in waiters if m == keep]
        for model_id, d in waiters:
            if model_id != keep:
                d.errback(error)

    def _cancel_waiter(self, d: Deferred) -> None:
        # Deferred.cancel() errbacks with CancelledError once we return.
        self._waiters = [(m, w) for (m, w) in self._waiters if w is not d]

    # -- stopping -------------------------------------------------------------

    def _signal(self, sig: int) -> None:
        if self.pid is None:
            return
        try:
            self._signal_group(self.pid, sig)
        except ProcessLookupError:
            pass
        except OSError as e:
            log.warn("cannot signal llama-server pid {pid}: {error}", pid=self.pid, error=e.strerror)

    def _stop_child(self, why: str, kill_now: bool = False, reason: Optional[str] = None) -> None:
        self._stop_timers()
        self._stop_reason = reason
        self._set_state(STOPPING)
        if self._transport is None:  # never spawned: nothing to reap
            self._child_ended(self.generation, Failure(ProcessLookupError("not running")))
            return
        log.info("stopping llama-server on {device}: {why}", device=self.name, why=why)
        if kill_now:
            self._signal(signal.SIGKILL)
            return
        self._signal(signal.SIGTERM)
        self._term_deadline = self.reactor.seconds() + self._config.llama_server_stop_timeout_s
        self._kill_timer = self.reactor.callLater(
            min(TERM_REPEAT_S, self._config.llama_server_stop_timeout_s), self._terminate_again
        )

    def _terminate_again(self) -> None:
        """SIGTERM again until the grace is over, then SIGKILL: a child that
        has just become ready sometimes misses the first SIGTERM."""
        remaining = self._term_deadline - self.reactor.seconds()
        if remaining <= 1e-9:
            self._escalate()
            return
        self._signal(signal.SIGTERM)
        self._kill_timer = self.reactor.callLater(min(TERM_REPEAT_S, remaining), self._terminate_again)

    def _escalate(self) -> None:
        self._kill_timer = None
        log.warn("llama-server on {device} ignored SIGTERM for {grace:g}s; sending SIGKILL",
                 device=self.name, grace=self._config.llama_server_stop_timeout_s)
        self._signal(signal.SIGKILL)
