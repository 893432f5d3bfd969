"""The HTTP API: OpenAI-compatible routes and the node's own endpoints.

Routes are thin: parse and check the request, ask the node for a device
(:meth:`rolemesh.node.Node.acquire`), hand the bytes to the proxy.  Every
error leaves here in OpenAI's shape (``{"error": {"message", "type",
"code"}}``) with its status; nothing a client sends produces a traceback.
"""

from __future__ import annotations

import functools
import hmac
import itertools
import json
import re
import time
import uuid
from typing import Any, Callable, Dict, Generator, Iterator, List, Mapping, Optional, Sequence, Tuple, Union, cast
from urllib.parse import unquote_to_bytes

from klein import Klein
from twisted.internet import defer
from twisted.internet.interfaces import IDelayedCall
from twisted.logger import Logger, LogLevel
from twisted.python.failure import Failure
from twisted.web.iweb import IRequest
from twisted.web.resource import IResource, Resource
from werkzeug.exceptions import HTTPException, MethodNotAllowed, NotFound

from rolemesh import errors
from rolemesh.adapters import adapter_entries, with_lora
from rolemesh.config import NodeConfig
from rolemesh.events import Events
from rolemesh.fast_channel import FastRoute
from rolemesh.interfaces import ProxiedRequest, RouteRequest
from rolemesh.logs import emit, one_write
from rolemesh.node import Lease, Node
from rolemesh.node_events import SSEClient
from rolemesh.proxy import CLIENT_GONE, STALLED, Forward, Proxy, UpstreamUnreachable
from rolemesh.readiness import Readiness
from rolemesh.reload import ReloadResult
from rolemesh.supervisor import READY, DeviceSupervisor
from rolemesh.tenants import Tenants

log = Logger()

#: Longest model name accepted; longer ones are a client bug, not a lookup.
MAX_MODEL_NAME = 256
#: Lines the logs endpoint returns at most.
MAX_LOG_TAIL = 1000
#: The request log line and metrics wait up to this long after the answer:
#: the answer goes out first, and the requests finished meanwhile are
#: recorded in one wake-up (at a few hundred requests a second, a dozen).
#: Flushed at shutdown, after the drain.
RECORD_DELAY_S = 0.05
#: ``(endpoint, path)`` of the routes relayed to llama-server.
PROXIED_ROUTES = (("chat/completions", "/v1/chat/completions"), ("completions", "/v1/completions"),
                  ("embeddings", "/v1/embeddings"))
#: The routes that need no key (liveness and readiness probes).
OPEN_ROUTES = frozenset({b"/health", b"/ready"})
#: The request log line (its fields are JSON keys with ``log_format: json``).
REQUEST_LOG_FORMAT = "POST /v1/{endpoint} {model} -> {status} on {device} in {duration_ms:.1f} ms"
#: ... of a request that never reached a device (refused, or ended while it waited
#: for one), and of one whose model is not known either; the fields are the same.
UNPLACED_LOG_FORMAT = "POST /v1/{endpoint} {model} -> {status} on no device in {duration_ms:.1f} ms"
UNRESOLVED_LOG_FORMAT = "POST /v1/{endpoint} -> {status} on no device in {duration_ms:.1f} ms"
#: A quiet events stream gets a comment line this often (seconds).
SSE_KEEPALIVE_S = 15.0
#: Bytes of events waiting for a reader that does not read before it is cut off.
SSE_MAX_BACKLOG = 256 * 1024
_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:-]{1,64}$")
_CREATED = int(time.time())


def request_ids() -> Iterator[str]:
    """Request ids for requests that bring none: 32 hex digits, a random
    64-bit prefix per process and a counter, unique across restarts and
    nodes as uuid4's are, without ``os.urandom`` per request."""
    prefix = uuid.uuid4().hex[:16]
    return (f"{prefix}{n:016x}" for n in itertools.count(1))


_request_ids = request_ids()


def _json(request: RouteRequest, status: int, body: Any) -> bytes:
    request.setResponseCode(status)
    request.setHeader(b"content-type", b"application/json")
    return json.dumps(body).encode("utf-8")


def _error(request: RouteRequest, error: errors.ApiError) -> bytes:
    for name, value in errors.answer_headers(error):
        request.setHeader(name, value)
    return _json(request, error.status, error.body())


def _bad_request(message: str, code: str = "invalid_request") -> errors.ApiError:
    return errors.ApiError(400, message, "invalid_request_error", code)


def parse_body(body: bytes, limit: int) -> Dict[str, Any]:
    """Check a proxied request body and return it parsed (pure: no I/O)."""
    if len(body) > limit:
        raise errors.ApiError(
            413,
            f"request body is {len(body)} bytes; the limit is {limit} (max_request_body_bytes)",
            "invalid_request_error",
            "request_too_large",
        )
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError:
        raise _bad_request("request body is not UTF-8") from None
    try:
        payload = json.loads(text)
    except ValueError as e:
        raise _bad_request(f"request body is not valid JSON: {e}") from None
    except RecursionError:  # "[[[[..." nested past the parser's depth limit
        raise _bad_request("request body is not valid JSON: nested too deeply") from None
    if not isinstance(payload, dict):
        raise _bad_request("request body must be a JSON object")
    model = payload.get("model")
    if model is None:
        raise _bad_request('request body has no "model"', "missing_model")
    if not isinstance(model, str) or not model:
        raise _bad_request('"model" must be a non-empty string', "invalid_model")
    if len(model) > MAX_MODEL_NAME:
        raise _bad_request(f'"model" is longer than {MAX_MODEL_NAME} characters', "invalid_model")
    return payload


class _Utf8Guard(Resource):
    """Answers a URL path or Host header that is not UTF-8 (or a Host that is
    no IDNA name) with a JSON 400.

    Klein answers those itself in plain text, and logs each as an error.
    """

    isLeaf = True

    def __init__(self, inner: IResource) -> None:
        super().__init__()
        self._inner = inner

    def render(self, request: IRequest) -> Union[bytes, int]:
        try:
            b"/".join(request.prepath + request.postpath).decode("utf-8")
            request.getRequestHostname().decode("utf-8").encode("idna")  # werkzeug's routing needs an IDNA name
        except UnicodeError:
            return _error(request, errors.ApiError(400, "the URL path or Host header is not valid UTF-8",
                                                   "invalid_request_error", "invalid_url"))
        return self._inner.render(request)


class _Record:
    """What the request log line and the observers say of one proxied request."""

    __slots__ = ("endpoint", "request_id", "started", "model", "device", "status", "ttfb")

    def __init__(self, endpoint: str, request_id: str, started: float) -> None:
        self.endpoint = endpoint
        self.request_id = request_id
        self.started = started
        self.model: Optional[str] = None
        self.device: Optional[str] = None
        self.status = 500
        self.ttfb: Optional[float] = None

    def first_byte(self) -> None:
        if self.ttfb is None:
            self.ttfb = time.monotonic() - self.started


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

    __slots__ = ("api", "request", "path", "body", "streaming", "record", "result", "_lease", "_forward",
                 "_waiting")

    def __init__(self, api: "NodeAPI", request: ProxiedRequest, path: str, body: bytes, streaming: bool,
                 record: _Record) -> None:
        self.api = api
        self.request = request
        self.path = path
        self.body = body
        self.streaming = streaming
        self.record = record
        self.result: "defer.Deferred[None]" = defer.Deferred(self._cancel)
        self._lease: Optional[Lease] = None
        #: The relay under way, or the Deferred waited for (at most one of the two).
        self._forward: Optional[Forward] = None
        self._waiting: "Optional[defer.Deferred[Any]]" = None

    def wait(self, acquired: "defer.Deferred[Lease]") -> None:
        """Relay once ``acquired`` fires (queued, or waiting for a load)."""
        self._waiting = acquired
        acquired.addCallbacks(self.relay, self._ended)

    def relay(self, lease: Lease) -> None:
        """Send the request to the lease's child."""
        self._waiting = None
        self._lease = lease
        self.record.device = lease.device
        config = self.api.config
        try:
            forward = self.api.proxy.start(
                self.request, lease.endpoint.base_url, self.path, self.body, self.streaming,
                config.request_timeout_s, self.record.first_byte, config.stream_idle_timeout_s, self._forwarded)
        except Exception:  # a bug: the request is still answered (500) and the device freed
            self._relayed(Failure())
            return
        if not forward.done:  # else it ended already (an answer the relay had at once)
            self._forward = forward

    def _forwarded(self, outcome: Union[str, Failure]) -> None:
        self._forward = None
        if isinstance(outcome, Failure) or outcome == STALLED:  # the rare ends: retried, or the child probed
            lease = self._lease
            assert lease is not None
            waiting = self._waiting = self.api._after(outcome, lease, self.request, self.path, self.body,
                                                      self.streaming, self.record)
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
        failed = self.api._proxied(outcome, self.request, self.record)
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


class NodeAPI:
    """Klein routes over a :class:`Node` and a :class:`Proxy`."""

    app = Klein()

    def __init__(
        self,
        config: NodeConfig,
        node: Node,
        proxy: Proxy,
        registration: Optional[Callable[[], Dict[str, Any]]] = None,
        render_metrics: Optional[Callable[[], bytes]] = None,
        observers: Sequence[Callable[..., None]] = (),
        readiness: Optional[Callable[[], Readiness]] = None,
        reload: Optional[Callable[[str], ReloadResult]] = None,
    ) -> None:
        self.node = node
        self.proxy = proxy
        self._registration = registration
        self._render_metrics = render_metrics
        self._readiness = readiness
        self._reload = reload
        self.use_config(config)
        #: What refuse_head looks routes up in: the fast routes' keys, and Klein's map.
        self._fast_route_keys = frozenset(self.fast_routes())
        self._routes = self.app.url_map.bind("localhost")
        #: Told ("request", **fields) of each finished proxied request.
        self.events = Events(*observers)
        #: Finished requests not yet logged, with when they ended (see _record_later).
        self._unrecorded: List[Tuple[_Record, float]] = []
        self._flush: Optional[IDelayedCall] = None

    def use_config(self, config: NodeConfig) -> None:
        """Serve with ``config`` from the next request on (a reload: models,
        keys, limits)."""
        self.config = config
        self._keys = [k.encode("utf-8") for k in config.api_keys]
        self.tenants = Tenants(config)

    def resource(self) -> IResource:
        return _Utf8Guard(self.app.resource())

    # -- cross-cutting ----------------------------------------------------------

    def _key_error(self, header: Optional[bytes]) -> Optional[errors.ApiError]:
        """401 unless ``header`` (the raw Authorization value) carries a configured key."""
        return self._key_index(header)[0]

    def _key_index(self, header: Optional[bytes]) -> Tuple[Optional[errors.ApiError], Optional[int]]:
        """(401 or None, the index of the key ``header`` carries: None without keys)."""
        if not self._keys:
            return None, None
        scheme, _, token = (header or b"").partition(b" ")
        presented = token.strip()
        found = -1
        for i, key in enumerate(self._keys):  # compare with every key: time does not leak which
            if hmac.compare_digest(presented, key):
                found = i
        if scheme.lower() != b"bearer" or found < 0:
            return errors.ApiError(
                401, "missing or invalid API key (send Authorization: Bearer <key>)",
                "invalid_request_error", "invalid_api_key",
            ), None
        return None, found

    def _authorize(self, request: RouteRequest) -> None:
        if getattr(request, "key_checked", False):  # the listener checked it from the head (refuse_head)
            return
        error = self._key_error(request.getHeader(b"authorization"))
        if error is not None:
            raise error

    def refuse_head(self, method: bytes, path: bytes, headers: Mapping[bytes, bytes]) -> Optional[errors.ApiError]:
        """The listener asks this of every request head, before its body is
        read (a :class:`~rolemesh.interfaces.HeadPolicy`): 401 without a
        valid key (every route but ``/health`` and ``/ready``), then 404
        for no route -- the answers the routes would give, so no body of
        such a request is ever held.  None: the route answers."""
        if path not in OPEN_ROUTES:
            error = self._key_error(headers.get(b"authorization"))
            if error is not None:
                return error
        if (method, path) in self._fast_route_keys or self._route_exists(method, path):
            return None
        shown = path.decode("utf-8", "replace")[:200]
        return errors.ApiError(404, f"no route {shown}", "invalid_request_error", "not_found")

    def _route_exists(self, method: bytes, path: bytes) -> bool:
        """Whether Klein has a route for ``path`` (a wrong method or a path
        it redirects count: Klein answers those itself)."""
        try:
            self._routes.match(unquote_to_bytes(path).decode("utf-8"), method.decode("ascii"))
        except NotFound:
            return False
        except (HTTPException, UnicodeDecodeError):  # 405, a redirect, not UTF-8: the routes' answer
            return True
        return True

    @app.handle_errors(errors.ApiError)
    def _api_error(self, request: IRequest, failure: Failure) -> bytes:
        return _error(request, cast(errors.ApiError, failure.value))

    def _unauthorized(self, request: RouteRequest) -> Optional[bytes]:
        """Without a valid key, say 401 before saying which routes exist."""
        try:
            self._authorize(request)
        except errors.ApiError as e:
            return _error(request, e)
        return None

    @app.handle_errors(NotFound)
    def _not_found(self, request: IRequest, failure: Failure) -> bytes:
        denied = self._unauthorized(request)
        if denied is not None:
            return denied
        path = request.path.decode("utf-8", "replace")[:200]
        return _error(request, errors.ApiError(404, f"no route {path}", "invalid_request_error", "not_found"))

    @app.handle_errors(MethodNotAllowed)
    def _not_allowed(self, request: IRequest, failure: Failure) -> bytes:
        if request.path not in OPEN_ROUTES:
            denied = self._unauthorized(request)
            if denied is not None:
                return denied
        allowed = getattr(failure.value, "valid_methods", None) or []
        if allowed:
            request.setHeader(b"allow", ", ".join(allowed).encode())
        method = request.method.decode("ascii", "replace")
        return _error(request, errors.ApiError(405, f"method {method} not allowed here",
                                               "invalid_request_error", "method_not_allowed"))

    @app.handle_errors(HTTPException)
    def _http_exception(self, request: IRequest, failure: Failure) -> bytes:
        e = cast(HTTPException, failure.value)
        new_url = getattr(e, "new_url", None)  # werkzeug's RequestRedirect (e.g. "//" merged): say where to
        if new_url:
            request.setHeader(b"location", new_url.encode("utf-8"))
        return _error(request, errors.ApiError(e.code or 400, e.description or e.name, "invalid_request_error"))

    @app.handle_errors(Exception)
    def _unexpected(self, request: RouteRequest, failure: Failure) -> bytes:
        log.failure("unexpected error answering {path}", failure, path=request.path)
        return _error(request, errors.ApiError(500, "internal error in the node agent", "server_error",
                                               "internal_error"))

    # -- the agent's own routes ---------------------------------------------------------

    @app.route("/health", methods=["GET"])
    def health(self, request: IRequest) -> bytes:
        return _json(request, 200, {"status": "ok", "draining": self.node.draining})

    @app.route("/ready", methods=["GET"])
    def ready(self, request: IRequest) -> bytes:
        """200 when the agent can take work, else 503 naming what fails (no auth)."""
        if self._readiness is None:
            raise errors.ApiError(404, "readiness is not available", "invalid_request_error", "not_found")
        readiness = self._readiness()
        return _json(request, 200 if readiness.ready else 503, readiness.to_json())

    @app.route("/v1/node/reload", methods=["POST"])
    def reload(self, request: IRequest) -> bytes:
        """Re-read the config files; 400 with the one-line error if invalid."""
        self._authorize(request)
        if self._reload is None:
            raise errors.ApiError(404, "reload is not available", "invalid_request_error", "not_found")
        result = self._reload("POST /v1/node/reload")
        if not result.ok:
            raise _bad_request(result.error or "reload failed", "invalid_config")
        return _json(request, 200, result.to_json())

    @app.route("/v1/models", methods=["GET"])
    def models(self, request: IRequest) -> bytes:
        self._authorize(request)
        data = []
        leaving = self.node.leaving_models()  # removed by a reload, still busy: listed until idle
        for model in (*self.config.models, *leaving):
            where = self.node.loaded_on(model.model_id)
            entry = {
                "id": model.model_id,
                "object": "model",
                "created": _CREATED,
                "owned_by": "rolemesh",
                "roles": list(model.roles),
                "loaded_on": [n for n in where if self.node.supervisors[n].state == READY],
                "loading_on": [n for n in where if self.node.supervisors[n].state != READY],
            }
            progress = {n: self.node.load_progress(n) for n in where if self.node.supervisors[n].state != READY}
            entry["load_progress"] = {n: p for n, p in progress.items() if p is not None}
            entry.update({k: v for k, v in self.node.model_memory(model).items() if k != "model_id"})
            if model.alias:
                entry["aliases"] = [model.alias]
            if model in leaving:
                entry["leaving"] = True
            data.append(entry)
            data.extend(adapter_entries(entry, model))
        return _json(request, 200, {"object": "list", "data": data})

    @app.route("/v1/node/inventory", methods=["GET"])
    def inventory(self, request: IRequest) -> bytes:
        self._authorize(request)
        return _json(request, 200, self.node.inventory())

    @app.route("/v1/node/registration", methods=["GET"])
    def registration(self, request: IRequest) -> bytes:
        self._authorize(request)
        if self._registration is None:
            raise errors.ApiError(404, "registration payload not available", "invalid_request_error", "not_found")
        return _json(request, 200, self._registration())

    @app.route("/v1/node/devices/<device>/logs", methods=["GET"])
    def device_logs(self, request: IRequest, device: str) -> bytes:
        self._authorize(request)
        supervisor = self.node.supervisors.get(device)
        if supervisor is None:
            raise errors.ApiError(404, f"no device {device[:64]!r} on this node", "invalid_request_error",
                                  "device_not_found")
        raw = (request.args.get(b"tail") or [b"100"])[0]
        try:
            tail = int(raw)
        except ValueError:
            tail = -1
        if not 0 <= tail <= MAX_LOG_TAIL:
            raise _bad_request(f"tail must be an integer from 0 to {MAX_LOG_TAIL}", "invalid_tail")
        return _json(request, 200, {"device": device, "lines": supervisor.log_tail(tail)})

    @app.route("/v1/node/events", methods=["GET"])
    def events_stream(self, request: IRequest) -> "defer.Deferred[None]":
        """Server-Sent Events: one ``data:`` line of JSON per node event (rolemesh.node_events)."""
        self._authorize(request)
        request.setHeader(b"content-type", b"text/event-stream; charset=utf-8")
        request.setHeader(b"cache-control", b"no-cache")
        request.setHeader(b"x-accel-buffering", b"no")
        request.write(b": rolemesh node events\n\n")
        SSEClient(request, self.node.feed, self.node.reactor, keepalive_s=SSE_KEEPALIVE_S,
                  max_backlog=SSE_MAX_BACKLOG)
        return defer.Deferred(lambda d: None)  # open until the client goes (Klein cancels it then)

    @app.route("/metrics", methods=["GET"])
    def metrics(self, request: IRequest) -> bytes:
        self._authorize(request)
        if self._render_metrics is None:
            raise errors.ApiError(404, "metrics are not enabled", "invalid_request_error", "not_found")
        request.setHeader(b"content-type", b"text/plain; version=0.0.4; charset=utf-8")
        return self._render_metrics()

    # -- proxied OpenAI routes ---------------------------------------------------------

    def fast_routes(self) -> Dict[Tuple[bytes, bytes], FastRoute]:
        """The routes :class:`~rolemesh.fast_channel.FastChannel` serves, by
        ``(method, path)``: the proxied ones, and the GETs a client asks
        between them (so a pooled connection stays on the fast path); the
        same methods as the Klein routes below, with what Klein adds (its
        error handlers) done here."""
        routes: Dict[Tuple[bytes, bytes], FastRoute] = {
            (b"POST", path.encode("ascii")): functools.partial(self._fast_proxy, endpoint, path)
            for endpoint, path in PROXIED_ROUTES}
        for path, route in ((b"/v1/models", self.models), (b"/health", self.health), (b"/ready", self.ready)):
            routes[(b"GET", path)] = functools.partial(self._fast_get, route)
        return routes

    def _fast_proxy(self, endpoint: str, path: str, request: ProxiedRequest) -> "defer.Deferred[Optional[bytes]]":
        return self._proxy(request, endpoint, path).addErrback(self._fast_error, request)

    def _fast_get(self, route: Callable[[Any], bytes], request: ProxiedRequest) -> "defer.Deferred[Optional[bytes]]":
        try:
            body: Optional[bytes] = route(request)
        except Exception:
            body = self._fast_error(Failure(), request)
        return defer.succeed(body)

    def _fast_error(self, failure: Failure, request: ProxiedRequest) -> bytes:
        if failure.check(errors.ApiError):
            return _error(request, cast(errors.ApiError, failure.value))
        if failure.check(defer.CancelledError):
            return failure  # type: ignore[return-value]  # the cancellation goes on failing the Deferred
        return self._unexpected(request, failure)

    @app.route("/v1/chat/completions", methods=["POST"])
    def chat_completions(self, request: IRequest) -> "defer.Deferred[None]":
        # Klein's requests are twisted.web's, ProxiedRequests (see rolemesh/listener.py).
        return self._proxy(cast(ProxiedRequest, request), "chat/completions", "/v1/chat/completions")

    @app.route("/v1/completions", methods=["POST"])
    def completions(self, request: IRequest) -> "defer.Deferred[None]":
        return self._proxy(cast(ProxiedRequest, request), "completions", "/v1/completions")

    @app.route("/v1/embeddings", methods=["POST"])
    def embeddings(self, request: IRequest) -> "defer.Deferred[None]":
        return self._proxy(cast(ProxiedRequest, request), "embeddings", "/v1/embeddings")

    def _body(self, request: RouteRequest) -> bytes:
        if getattr(request, "body_too_large", False):  # the listener did not keep it
            limit = self.config.max_request_body_bytes
            raise errors.ApiError(413, f"request body is larger than {limit} bytes (max_request_body_bytes)",
                                  "invalid_request_error", "request_too_large")
        return request.content.read()  # type: ignore[union-attr]  # None only before the body began

    # -- operator routes: warm or free a device -------------------------------------

    def _supervisor(self, device: str) -> DeviceSupervisor:
        supervisor = self.node.supervisors.get(device)
        if supervisor is None:
            raise errors.ApiError(404, f"no device {device[:64]!r} on this node", "invalid_request_error",
                                  "device_not_found")
        return supervisor

    @app.route("/v1/node/devices/<device>/load", methods=["POST"])
    @defer.inlineCallbacks
    def load(self, request: IRequest, device: str) -> Generator["defer.Deferred[Lease]", Lease, bytes]:
        """Load a model on a device, queued like a request (429 when full)."""
        self._authorize(request)
        supervisor = self._supervisor(device)
        payload = parse_body(self._body(request), self.config.max_request_body_bytes)
        model = self.node.resolve(payload["model"])
        lease = yield self.node.acquire(model, device=device)
        lease.release()
        return _json(request, 200, {"device": device, "model": model.model_id, **supervisor.snapshot()})

    @app.route("/v1/node/devices/<device>/unload", methods=["POST"])
    @defer.inlineCallbacks
    def unload(self, request: IRequest, device: str) -> Generator["defer.Deferred[None]", None, bytes]:
        """Stop a device's child once the requests ahead of this one are done."""
        self._authorize(request)
        supervisor = self._supervisor(device)
        yield self.node.unload(device)
        return _json(request, 200, {"device": device, **supervisor.snapshot()})

    def _request_id(self, request: RouteRequest) -> str:
        given = (request.getHeader(b"x-request-id") or b"").decode("latin-1")  # bytes: the raw header value
        rid = given if given and _REQUEST_ID.fullmatch(given) else next(_request_ids)
        request.setHeader(b"x-request-id", rid.encode("ascii"))
        return rid

    def _record_later(self, record: _Record, ended: float) -> None:
        """Log and observe a finished request a moment later, with the others
        finished meanwhile: one wake-up for all of them, after their answers
        went out."""
        self._unrecorded.append((record, ended))
        if len(self._unrecorded) == 1:
            self._flush = self.node.reactor.callLater(RECORD_DELAY_S, self._record_all)

    def _record_all(self) -> None:
        records, self._unrecorded = self._unrecorded, []
        with one_write():  # the batch's log lines in one write
            for record, ended in records:
                self._record(record, ended)

    def flush_records(self) -> None:
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
            "status": record.status, "duration": duration, "ttfb": record.ttfb, "device": record.device,
            "request_id": record.request_id})
        self.events.emit("request", endpoint=record.endpoint, model=record.model, status=record.status,
                         duration=duration, ttfb=record.ttfb)

    def _proxy(self, request: ProxiedRequest, endpoint: str, path: str) -> "defer.Deferred[None]":
        """Check, place and relay one request (see :class:`_Exchange` for its steps)."""
        record = _Record(endpoint, self._request_id(request), time.monotonic())
        try:
            error, key = self._key_index(request.getHeader(b"authorization"))
            if error is not None:
                raise error
            share = self.tenants.share(key, request.getHeader(b"x-rolemesh-tenant"),
                                       request.getHeader(b"x-rolemesh-priority"))
            if self.node.draining:
                raise errors.shutting_down()
            body = self._body(request)
            payload = parse_body(body, self.config.max_request_body_bytes)
            model = self.node.resolve(payload["model"])
            record.model = model.model_id
            if model.lora_adapters:  # the agent sets the adapters' scales (one attribute test for the others)
                body = with_lora(payload, model)
            prompt = payload if endpoint != "embeddings" else None  # prefix affinity: not for embeddings
            lease = self.node.lease_now(model, share, prompt)
            acquired = self.node.acquire(model, share=share, prompt=prompt) if lease is None else None
        except Exception:
            return defer.fail().addBoth(self._proxied, request, record)
        exchange = _Exchange(self, request, path, body, payload.get("stream") is True, record)
        if acquired is None:
            exchange.relay(lease)  # type: ignore[arg-type]  # not None when acquired is
        else:
            exchange.wait(acquired)
        return exchange.result

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
        self._record_later(record, time.monotonic())  # written RECORD_DELAY_S later: after the answer's end
        return failed

    def _after(self, outcome: Union[str, Failure], lease: Lease, request: ProxiedRequest, path: str, body: bytes,
               streaming: bool, record: "_Record") -> "defer.Deferred[str]":
        """The rare ends of a relay: a child that gave no answer (once more to
        a fresh child, if it was unreachable) or none in time, or went silent
        mid-answer: it is checked.  Fires with the outcome, or fails."""
        if not isinstance(outcome, Failure):
            return self._stalled(lease)
        forward = functools.partial(
            self.proxy.forward, request, path=path, body=body, streaming=streaming,
            timeout=self.config.request_timeout_s, idle_timeout=self.config.stream_idle_timeout_s,
            on_first_byte=record.first_byte)
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

