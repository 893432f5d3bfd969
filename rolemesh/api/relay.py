"""The proxied OpenAI routes: check a request, ask the node for a device
(:meth:`rolemesh.node.node.Node.lease_now`, else :meth:`~rolemesh.node.node.Node.acquire`),
relay it to that device's llama-server (:class:`rolemesh.http.proxy.Proxy`), and
record it (its log line and its ``request`` event) once the answer is out.
"""

from __future__ import annotations

import functools
import itertools
import re
import time
import uuid
from typing import Any, Callable, Generator, Iterator, List, Mapping, Optional, Sequence, Tuple, Union

import attr
from twisted.internet import defer
from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.logger import Logger, LogLevel
from twisted.python.failure import Failure
from twisted.web.http_headers import Headers

from rolemesh.api.answers import form_model, parse_body, request_body
from rolemesh.api.held_state import COMPLETION, CONVERSATION, CONVERSATION_ID, HeldState, Holder, completion_id
from rolemesh.api.keys import ApiKeys
from rolemesh.api.routes import FORM_BODY, GENERATE, INSTANCES_BODY, Route
from rolemesh.base import errors
from rolemesh.base.events import Events
from rolemesh.base.interfaces import ProxiedRequest, RouteRequest
from rolemesh.base.logs import emit, one_write
from rolemesh.children.adapters import instances_with_lora, with_lora
from rolemesh.config.file import ModelConfig, NodeConfig
from rolemesh.config.vertex_ai import predict_model
from rolemesh.http.proxy import CLIENT_GONE, STALLED, STREAM_ENDS, Forward, Proxy, RequestShape, UpstreamUnreachable
from rolemesh.node.node import Lease, Node, Pin
from rolemesh.scheduling.fairqueue import Share
from rolemesh.scheduling.tenants import Tenants

#: The API's log namespace (the request log line's, whichever module writes it).
log = Logger(namespace="rolemesh.api")

#: The request log line and metrics wait up to this long after the answer:
#: the answer goes out first, and the requests finished meanwhile are
#: recorded in one wake-up (at a few hundred requests a second, a dozen).
#: Flushed at shutdown, after the drain.
RECORD_DELAY_S = 0.05
#: The request log line (its fields are JSON keys with ``log_format: json``).
REQUEST_LOG_FORMAT = "{method} {path} {model} -> {status} on {device} in {duration_ms:.1f} ms"
#: ... of a request that never reached a device (refused, or ended while it waited
#: for one), and of one whose model is not known either; the fields are the same.
UNPLACED_LOG_FORMAT = "{method} {path} {model} -> {status} on no device in {duration_ms:.1f} ms"
UNRESOLVED_LOG_FORMAT = "{method} {path} -> {status} on no device in {duration_ms:.1f} ms"
_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:-]{1,64}$")


def request_ids() -> Iterator[str]:
    """Request ids for requests that bring none: 32 hex digits, a random
    64-bit prefix per process and a counter, unique across restarts and
    nodes as uuid4's are, without ``os.urandom`` per request."""
    prefix = uuid.uuid4().hex[:16]
    return (f"{prefix}{n:016x}" for n in itertools.count(1))


_request_ids = request_ids()


def request_id(request: RouteRequest) -> str:
    """The request's id: its ``X-Request-Id`` if it is a sane one, else a
    fresh one; either way echoed in the answer's ``X-Request-Id``."""
    given = (request.getHeader(b"x-request-id") or b"").decode("latin-1")  # bytes: the raw header value
    rid = given if given and _REQUEST_ID.fullmatch(given) else next(_request_ids)
    request.setHeader(b"x-request-id", rid.encode("ascii"))
    return rid


class _Record:
    """What the request log line and the observers say of one proxied request."""

    __slots__ = ("endpoint", "request_id", "started", "model", "device", "status", "ttfb", "path", "method")

    def __init__(self, endpoint: str, request_id: str, started: float, path: str = "",
                 method: str = "POST") -> None:
        self.endpoint = endpoint
        #: The route's path (the request log line's), and the method.
        self.path = path or f"/v1/{endpoint}"
        self.method = method
        self.request_id = request_id
        self.started = started
        self.model: Optional[str] = None
        self.device: Optional[str] = None
        self.status = 500
        self.ttfb: Optional[float] = None

    def first_byte(self) -> None:
        if self.ttfb is None:
            self.ttfb = time.monotonic() - self.started


class RequestLog:
    """The proxied requests' log lines and ``request`` events, written a
    moment after each answer (:data:`RECORD_DELAY_S`) with the others
    finished meanwhile: one wake-up for all of them, after their answers
    went out."""

    def __init__(self, reactor: Callable[[], IReactorTime], observers: Sequence[Callable[..., None]] = ()) -> None:
        #: The clock, asked when first needed (the node's reactor, resolved lazily).
        self._reactor = reactor
        #: Told ("request", **fields) of each finished proxied request.
        self.events = Events(*observers)
        #: Finished requests not yet logged, with when they ended.
        self._unrecorded: List[Tuple[_Record, float]] = []
        self._flush: Optional[IDelayedCall] = None

    def later(self, record: _Record, ended: float) -> None:
        """Log and observe ``record`` (ended at ``ended``) a moment from now."""
        self._unrecorded.append((record, ended))
        if len(self._unrecorded) == 1:
            self._flush = self._reactor().callLater(RECORD_DELAY_S, self._record_all)

    def _record_all(self) -> None:
        records, self._unrecorded = self._unrecorded, []
        with one_write():  # the batch's log lines in one write
            for record, ended in records:
                self._record(record, ended)

    def flush(self) -> None:
        """Record the finished requests now (shutdown: the timer would not run)."""
        if self._flush is not None and self._flush.active():
            self._flush.cancel()
        self._flush = None
        self._record_all()

    def _record(self, record: _Record, ended: float) -> None:
        """The request log line (``log.info``'s event, built here once) and
        the ``request`` event."""
        duration = ended - record.started
        form = (REQUEST_LOG_FORMAT if record.device is not None
                else UNPLACED_LOG_FORMAT if record.model is not None else UNRESOLVED_LOG_FORMAT)
        emit(log, LogLevel.info, form, {
            "duration_ms": duration * 1000, "endpoint": record.endpoint, "model": record.model,
            "method": record.method, "path": record.path,
            "status": record.status, "duration": duration, "ttfb": record.ttfb, "device": record.device,
            "request_id": record.request_id})
        self.events.emit("request", endpoint=record.endpoint, model=record.model, status=record.status,
                         duration=duration, ttfb=record.ttfb)


class _Exchange:
    """One proxied request's steps once it is placed: the lease, the relay,
    the lease's release and the record, as plain method calls, firing
    ``result`` at the end.  No chain of Deferreds: this runs for every
    inference request, and the chaining cost more than the steps.  Only the
    rare ends wait on Deferreds: a place in the queue or a load
    (:meth:`wait`), a child that gave no answer (retried once) or went silent
    (probed).  Cancelling ``result`` (the client went away) cancels what it
    waits for: the place in the queue, or the relay (closing the upstream
    connection, which stops the generation)."""

    __slots__ = ("relay", "request", "path", "body", "streaming", "record", "result", "_lease", "_forward",
                 "_waiting", "shape", "counts", "holds")

    def __init__(self, relay: "Relay", request: ProxiedRequest, path: str, body: bytes, streaming: bool,
                 record: _Record, shape: Optional[RequestShape] = None, counts: bool = True) -> None:
        self.relay = relay
        self.request = request
        self.path = path
        self.body = body
        self.streaming = streaming
        self.record = record
        #: How it goes to the child, if not as a JSON POST of an OpenAI route.
        self.shape = shape
        #: Whether its answer's prompt-cache figures count (not for embeddings, reranks, token utilities).
        self.counts = counts
        self.result: "defer.Deferred[None]" = defer.Deferred(self._cancel)
        self._lease: Optional[Union[Lease, Pin]] = None
        #: The relay under way, or the Deferred waited for (at most one of the two).
        self._forward: Optional[Forward] = None
        self._waiting: "Optional[defer.Deferred[Any]]" = None
        #: The conversation id whose stream state its child will hold, if any.
        self.holds: Optional[str] = None

    def wait(self, acquired: "defer.Deferred[Lease]") -> None:
        """Relay once ``acquired`` fires (queued, or waiting for a load)."""
        self._waiting = acquired
        acquired.addCallbacks(self.start, self._ended)

    def start(self, lease: Union[Lease, Pin]) -> None:
        """Send the request to the lease's (or the pin's) child."""
        self._waiting = None
        self._lease = lease
        self.record.device = lease.device
        if self.holds is not None:
            self.relay.held.remember(CONVERSATION, self.holds, holder(lease))
        config = self.relay.config
        try:
            forward = self.relay.proxy.start(
                self.request, lease.endpoint.base_url, self.path, self.body, self.streaming,
                config.request_timeout_s, self.record.first_byte, config.stream_idle_timeout_s, self._forwarded,
                self._prompt_tokens if self.counts else None, self.shape)
        except Exception:  # a bug: the request is still answered (500) and the device freed
            self._relayed(Failure())
            return
        if not forward.done:  # else it ended already (an answer the relay had at once)
            self._forward = forward

    def _prompt_tokens(self, cached: int, processed: int) -> None:
        """The answer's ``timings``: its prompt tokens served from cache and processed."""
        self.relay.node.prompt_cache.add(self.record.device, self.record.model, cached, processed)

    def _forwarded(self, outcome: Union[str, Failure]) -> None:
        self._forward = None
        if isinstance(outcome, Failure) or outcome == STALLED:  # the rare ends: retried, or the child probed
            lease = self._lease
            assert lease is not None
            if isinstance(lease, Pin):  # a token utility: ms of work, not worth a retry or a probe
                if isinstance(outcome, Failure) and outcome.check(UpstreamUnreachable):
                    outcome = Failure(outcome.value.as_api_error())  # type: ignore[union-attr]
                self._relayed(outcome)
                return
            waiting = self._waiting = self.relay._after(outcome, lease, self.request, self.path, self.body,
                                                        self.streaming, self.record, self.shape, self.counts)
            waiting.addBoth(self._relayed)
        else:
            self._relayed(outcome)

    def _relayed(self, outcome: Union[str, Failure]) -> None:
        lease, self._lease = self._lease, None
        if lease is not None:
            lease.release()
        self._ended(outcome)

    def _ended(self, outcome: Union[str, Failure]) -> None:
        self._waiting = None
        failed = self.relay._proxied(outcome, self.request, self.record)
        if self.result.called:  # cancelled, and what it waited for ended later
            return
        if failed is None:
            self.result.callback(None)
        else:
            self.result.errback(failed)

    def _cancel(self, _: "defer.Deferred[None]") -> None:
        if self._forward is not None:
            self._forward.cancel()
        elif self._waiting is not None:
            self._waiting.cancel()


#: The endpoints whose prompt prefix affinity hashes and whose answers' prompt
#: cache figures count: the ones that generate from a prompt.
PREFIXED = frozenset({"chat/completions", "completions", "completion", "messages", "responses", "infill"})
#: How requests of the endpoints that are not OpenAI's chat go and come back.
_SHAPES = {
    "messages": RequestShape(stream_ends=STREAM_ENDS["messages"], api="anthropic"),
    "responses": RequestShape(stream_ends=STREAM_ENDS["responses"], api="responses"),
}


def holder(lease: Union[Lease, Pin]) -> Holder:
    """The child a lease (or a pin) is on, as :class:`Holder` names it."""
    endpoint = lease.endpoint
    return Holder(lease.device, endpoint.model_id, endpoint.pid, endpoint.generation)


class Relay:
    """The routes relayed to llama-server (``relayed=`` in rolemesh/api/app.py's
    table): :meth:`serve` checks, places and relays one request."""

    def __init__(self, config: NodeConfig, node: Node, proxy: Proxy, keys: ApiKeys,
                 observers: Sequence[Callable[..., None]] = ()) -> None:
        self.node = node
        self.proxy = proxy
        self._keys = keys
        #: The request log: each request's line and ``request`` event.
        self.log = RequestLog(lambda: node.reactor, observers)
        #: Which child holds each live completion's and each resumable stream's state.
        self.held = HeldState()
        self._http: Any = None
        self.use_config(config)

    def use_config(self, config: NodeConfig) -> None:
        """Relay with ``config``'s limits and tenants from the next request on."""
        self.config = config
        self.tenants = Tenants(config)

    @property
    def http(self) -> Any:
        """A treq client to the children, for the node's own small asks (a stream lookup)."""
        if self._http is None:
            from rolemesh.http.control_client import quiet_treq

            self._http = quiet_treq(self.node.reactor, persistent=False, connect_timeout=2.0)
        return self._http

    def serve(self, request: ProxiedRequest, route: Route) -> "defer.Deferred[None]":
        """Check, place and relay one request of ``route`` (see :class:`_Exchange` for its steps)."""
        endpoint = route.relayed or ""
        record = _Record(endpoint, request_id(request), time.monotonic(), route.path)
        try:
            share = self.admit(request)
            body = request_body(request, self.config.max_request_body_bytes)
            if route.body == FORM_BODY:
                payload = None
                content_type = request.getHeader(b"content-type") or b""
                name = form_model(content_type, body, self.config.max_request_body_bytes)
                shape: Optional[RequestShape] = RequestShape(headers=Headers({b"content-type": [content_type]}))
            else:
                payload = parse_body(body, self.config.max_request_body_bytes, model_required=False)
                name = predict_model(payload) if route.body == INSTANCES_BODY else payload.get("model")
                shape = _SHAPES.get(endpoint)
            model, served_as = self.node.resolve_request(name)
            record.model = model.model_id
            if model.lora_adapters and payload is not None:  # the agent sets the adapters' scales
                body = (instances_with_lora(payload, model, served_as) if route.body == INSTANCES_BODY else
                        with_lora(payload, model, served_as))
            prompt = payload if endpoint in PREFIXED else None  # prefix affinity: not for embeddings ...
            streaming = payload is not None and payload.get("stream") is True
            conversation = request.getHeader(b"x-conversation-id") if streaming else None
            if conversation is not None:  # a resumable stream: its child keeps it by this id
                if not CONVERSATION_ID.match(conversation):
                    raise errors.ApiError(400, "X-Conversation-Id must be printable ASCII, at most 256 bytes",
                                          "invalid_request_error", "invalid_conversation_id")
                shape = attr.evolve(shape or RequestShape(), headers=Headers({
                    b"content-type": [b"application/json"], b"accept": [b"*/*"],
                    b"x-conversation-id": [conversation]}))
        except Exception:
            return defer.fail().addBoth(self._proxied, request, record)
        exchange = _Exchange(self, request, route.path, body, streaming, record, shape, endpoint in PREFIXED)
        if conversation is not None:
            exchange.holds = conversation.decode("ascii")
        if streaming and payload is not None and payload.get("reasoning_control") is True:
            # A live completion the client may steer by its id: which child runs it.
            exchange.shape = attr.evolve(shape or RequestShape(), first_read=functools.partial(self._armed, exchange))
        return self.place(exchange, model, share, prompt, route.use)

    def _armed(self, exchange: "_Exchange", first_read: bytes) -> bool:
        """A stream armed with reasoning_control began: remember its id's
        child.  True once the id is in (its first event may come in pieces)."""
        try:
            key, lease = completion_id(first_read), exchange._lease
            if key is not None and lease is not None:
                self.held.remember(COMPLETION, key, holder(lease))
            return key is not None
        except Exception:  # bookkeeping must not break the stream
            log.failure("remembering a completion's child failed")
            return True

    def place(self, exchange: "_Exchange", model: ModelConfig, share: Share,
              prompt: Optional[Mapping[str, Any]], use: str, load: bool = True) -> "defer.Deferred[None]":
        """Relay ``exchange`` to a child of ``model``: a ready one at once
        (pinned, for a use that takes no slot; else leased), else queued (a
        load or a switch).  ``load`` False: only a ready child, never a load
        (None comes back when there is none; a keyless request may not load
        a model)."""
        try:
            pin = self.node.pin_now(model) if use != GENERATE else None
            if pin is None and not load:
                return None  # type: ignore[return-value]  # the caller answers it
            lease: Optional[Union[Lease, Pin]] = pin if pin is not None else self.node.lease_now(model, share, prompt)
            acquired = self.node.acquire(model, share=share, prompt=prompt) if lease is None else None
        except Exception:
            return defer.fail().addBoth(self._proxied, exchange.request, exchange.record)
        if acquired is None:
            exchange.start(lease)  # type: ignore[arg-type]  # not None when acquired is
        else:
            exchange.wait(acquired)
        return exchange.result

    def admit(self, request: RouteRequest) -> Share:
        """The request's tenant and band, once its key is checked (401) and
        the node is not draining (503)."""
        error, key = self._keys.index(request.getHeader(b"authorization"), request.getHeader(b"x-api-key"))
        if error is not None:
            raise error
        share = self.tenants.share(key, request.getHeader(b"x-rolemesh-tenant"),
                                   request.getHeader(b"x-rolemesh-priority"))
        if self.node.draining:
            raise errors.shutting_down()
        return share

    def _proxied(self, result: Union[str, Failure], request: ProxiedRequest, record: "_Record") -> Optional[Failure]:
        """How it ended, for the record; logged and observed once the answer is out."""
        if isinstance(result, Failure):
            if isinstance(result.value, errors.ApiError):
                record.status = result.value.status
            elif result.check(defer.CancelledError):
                record.status = 499
            failed: Optional[Failure] = result
        else:
            record.status = 499 if result == CLIENT_GONE else request.code
            failed = None
        self.log.later(record, time.monotonic())  # written RECORD_DELAY_S later: after the answer's end
        return failed

    def _after(self, outcome: Union[str, Failure], lease: Lease, request: ProxiedRequest, path: str, body: bytes,
               streaming: bool, record: "_Record", shape: Optional[RequestShape] = None,
               counts: bool = True) -> "defer.Deferred[str]":
        """The rare ends of a relay: a child that gave no answer (once more to
        a fresh child, if it was unreachable) or none in time, or went silent
        mid-answer: it is checked.  Fires with the outcome, or fails."""
        if not isinstance(outcome, Failure):
            return self._stalled(lease)
        forward = functools.partial(
            self.proxy.forward, request, path=path, body=body, streaming=streaming,
            timeout=self.config.request_timeout_s, idle_timeout=self.config.stream_idle_timeout_s,
            on_first_byte=record.first_byte, shape=shape,
            on_timings=None if not counts else functools.partial(
                self.node.prompt_cache.add, record.device, record.model))
        return self._not_answered(outcome, lease, forward)

    def _answered(self, outcome: str, lease: Lease) -> Union[str, "defer.Deferred[str]"]:
        return self._stalled(lease) if outcome == STALLED else outcome

    def _stalled(self, lease: Lease) -> "defer.Deferred[str]":
        """The answer went silent mid-way (and was ended): the child is checked."""
        log.warn("llama-server on {device} went silent for {seconds:g}s mid-answer "
                 "(stream_idle_timeout_s); answer ended, child probed",
                 device=lease.device, seconds=self.config.stream_idle_timeout_s)
        return self.node.check_child(lease, "an answer gone silent (stream_idle_timeout_s)").addCallback(
            lambda _: STALLED)

    @defer.inlineCallbacks
    def _not_answered(self, failure: Failure, lease: Lease, forward: Callable[..., "defer.Deferred[str]"]
                      ) -> Generator["defer.Deferred[Any]", Any, str]:
        """The rare path: no answer from the child (retried once), or none in time."""
        try:
            if not failure.check(UpstreamUnreachable):
                failure.raiseException()
            # Nothing was sent: the child died a moment ago.  The node
            # checks it (replaced if it fails) and says where to try once more.
            log.warn("llama-server on {device} unreachable ({error}); retrying once",
                     device=lease.device, error=str(failure.value))
            fresh = yield self.node.retry_endpoint(lease)
            try:
                outcome = yield forward(base_url=fresh.base_url)
            except UpstreamUnreachable as again:
                raise again.as_api_error() from None
        except errors.ApiError as e:
            if e.code == "upstream_timeout":
                yield self.node.check_child(lease, "an upstream timeout")
            raise
        return (yield self._answered(outcome, lease))  # type: ignore[misc]  # a str comes back as it is
