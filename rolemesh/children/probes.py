"""Asking a llama-server child whether it works: the readiness probe, the
inference probe, and :class:`LoadWatch`, which polls a loading child and
bounds its load (startup timeout) and its silence (stall window).

The probes are plain callables returning Deferreds, so tests inject fakes;
the defaults speak HTTP through treq, created on first use.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Optional, Tuple

from treq.client import HTTPClient
from twisted.internet import defer
from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.internet.task import LoopingCall
from twisted.logger import Logger
from twisted.python.failure import Failure

from rolemesh.base.interfaces import IHTTPClientReactor
from rolemesh.config.file import ModelConfig, NodeConfig

log = Logger(namespace="rolemesh.child_probes")

#: Bound on one inference probe (a 1-token answer from an idle child).
INFERENCE_PROBE_TIMEOUT_S = 30.0
#: Bound on the wait for one readiness probe's headers (the whole probe: twice this).
READINESS_PROBE_TIMEOUT_S = 2.0

#: ``probe(base_url, served_name)``: fires True once the child serves the model.
ReadinessProbe = Callable[[str, str], "Deferred[bool]"]
#: ``probe(base_url, model)``: fires True if the child did real work.
InferenceProbe = Callable[[str, ModelConfig], "Deferred[bool]"]


def http_probe(http: HTTPClient, timeout: float = READINESS_PROBE_TIMEOUT_S,
               clock: Optional[IReactorTime] = None) -> ReadinessProbe:
    """A readiness probe: ``GET /health`` is 200 and ``GET /v1/models`` lists
    the model under its served name.  ``http`` is a treq-like client.

    treq's ``timeout`` bounds only the wait for headers; with ``clock`` the
    whole probe, body reads included, is bounded too (twice ``timeout``).
    """

    @defer.inlineCallbacks
    def run(base_url: str, served_name: str) -> Any:
        response = yield http.get(base_url + "/health", timeout=timeout)
        yield response.content()
        if response.code != 200:
            return False
        response = yield http.get(base_url + "/v1/models", timeout=timeout)
        if response.code != 200:
            yield response.content()
            return False
        body = yield response.json()
        return any(
            served_name == entry.get("id") or served_name in (entry.get("aliases") or ())
            for entry in body.get("data", ())
            if isinstance(entry, dict)
        )

    def probe(base_url: str, served_name: str) -> "Deferred[bool]":
        d = run(base_url, served_name)
        return d if clock is None else d.addTimeout(2 * timeout, clock)

    return probe


def inference_request(model: ModelConfig) -> Tuple[str, Dict[str, Any]]:
    """The path and body of the smallest real work ``model`` can do: one
    token of completion, or an embedding for a model served with ``embeddings``."""
    embeds = any(flag in ("embeddings", "embedding") and value not in (None, False)
                 for flag, value in model.server_args)
    body: Dict[str, Any] = {"model": model.served_name}
    if embeds:
        body["input"] = "ok"
        return "/v1/embeddings", body
    body.update(prompt="ok", max_tokens=1)
    return "/v1/completions", body


def inference_probe(http: HTTPClient, clock: IReactorTime,
                    timeout: float = INFERENCE_PROBE_TIMEOUT_S) -> InferenceProbe:
    """A probe that asks for real work (:func:`inference_request`) answered
    200 within ``timeout``.  A child can answer ``/health`` while its GPU is
    broken; this cannot."""

    def probe(base_url: str, model: ModelConfig) -> "Deferred[bool]":
        path, body = inference_request(model)
        d = http.post(base_url + path, json=body, timeout=timeout)
        d.addCallback(lambda response: response.content().addCallback(lambda _: response.code == 200))
        return d.addTimeout(timeout, clock)

    return probe


class ChildProbes:
    """The two probes of one supervisor: injected, or made on first use with
    a non-persistent treq client on ``clock`` (the reactor)."""

    def __init__(self, clock: Callable[[], IHTTPClientReactor], readiness: Optional[ReadinessProbe] = None,
                 inference: Optional[InferenceProbe] = None) -> None:
        self._clock = clock
        self._readiness = readiness
        self.inference_fn = inference

    def _http(self) -> HTTPClient:
        from rolemesh.http.control_client import quiet_treq

        return quiet_treq(self._clock(), persistent=False, connect_timeout=2.0)

    @property
    def readiness(self) -> ReadinessProbe:
        if self._readiness is None:
            self._readiness = http_probe(self._http(), clock=self._clock())
        return self._readiness

    @property
    def inference(self) -> InferenceProbe:
        if self.inference_fn is None:
            self.inference_fn = inference_probe(self._http(), self._clock())
        return self.inference_fn


class LoadWatch:
    """Watches one loading child until it is ready or has taken too long.

    Polls the readiness probe every ``llama_server_probe_interval_s`` (one
    probe at a time; :meth:`poke` probes at once), calls ``on_ready()`` once
    it says yes, and ``on_timeout(what)`` at ``llama_server_startup_timeout_s``
    or after ``llama_server_stall_timeout_s`` without :meth:`progressed`.
    :meth:`stop` ends all of it; nothing fires after.
    """

    def __init__(self, clock: IReactorTime, config: NodeConfig, probe: Callable[[], "Deferred[bool]"],
                 on_ready: Callable[[], None], on_timeout: Callable[[str], None]) -> None:
        self._clock = clock
        self._config = config
        self._probe = probe
        self._on_ready = on_ready
        self._on_timeout = on_timeout
        self._in_flight: Optional[Deferred] = None
        self._loop: Optional[LoopingCall] = None
        self._startup: Optional[IDelayedCall] = None
        self._stall: Optional[IDelayedCall] = None
        self.active = False

    def start(self) -> None:
        self.active = True
        self._loop = LoopingCall(self.poke)
        self._loop.clock = self._clock
        self._loop.start(self._config.llama_server_probe_interval_s, now=False)
        self._startup = self._clock.callLater(self._config.llama_server_startup_timeout_s, self._timed_out)
        self._stall = self._clock.callLater(self._config.llama_server_stall_timeout_s, self._stalled)

    def stop(self) -> None:
        self.active = False
        if self._in_flight is not None:
            self._in_flight.cancel()
        if self._loop is not None and self._loop.running:
            self._loop.stop()
        self._loop = None
        for timer in (self._startup, self._stall):
            if timer is not None and timer.active():
                timer.cancel()
        self._startup = self._stall = None

    def progressed(self) -> None:
        """Any output of a loading child is progress (llama.cpp prints its
        load steps, and dots while it reads tensors): the stall window restarts."""
        if self._stall is not None and self._stall.active():
            self._stall.reset(self._config.llama_server_stall_timeout_s)

    def poke(self) -> None:
        """Probe now, unless a probe is on its way."""
        if not self.active or self._in_flight is not None:
            return
        try:
            d = self._probe()
        except Exception:
            log.failure("readiness probe raised")
            return
        self._in_flight = d

        def done(ok: object) -> None:
            self._in_flight = None
            if ok is True and self.active:
                self.stop()
                self._on_ready()

        def failed(_: Failure) -> None:
            self._in_flight = None  # not up yet (or cancelled): keep polling

        d.addCallbacks(done, failed).addErrback(lambda f: log.failure("readiness bookkeeping failed", f))

    def _timed_out(self) -> None:
        self._startup = None
        timeout = self._config.llama_server_startup_timeout_s
        self.stop()
        self._on_timeout(f"did not become ready within {timeout:g}s (llama_server_startup_timeout_s)")

    def _stalled(self) -> None:
        """Loading made no progress (no output at all) for the stall window:
        fail now rather than at the outer startup bound."""
        self._stall = None
        window = self._config.llama_server_stall_timeout_s
        self.stop()
        self._on_timeout(f"stalled: printed nothing for {window:g}s while loading (llama_server_stall_timeout_s)")
