"""The HTTP API: OpenAI-compatible routes and the node's own endpoints.

Every route is declared once, in :data:`ROUTES`; :mod:`rolemesh.api.routes`
builds from it both Klein's routes and the fast path's dispatch.
:class:`NodeAPI` composes the parts that answer them: the relayed OpenAI
routes (:class:`rolemesh.api.relay.Relay`: parse and check the request, ask
the node for a device, hand the bytes to the proxy), the agent's own routes
(:class:`rolemesh.api.node_routes.NodeRoutes`), the API keys
(:class:`rolemesh.api.keys.ApiKeys`) and the error answers
(:class:`rolemesh.api.answers.ErrorAnswers`).  Every error leaves in
OpenAI's shape (``{"error": {"message", "type", "code"}}``) with its status;
nothing a client sends produces a traceback.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Mapping, Optional, Sequence, Tuple
from urllib.parse import unquote_to_bytes, urlsplit

from twisted.web.resource import IResource
from werkzeug.exceptions import HTTPException, MethodNotAllowed, NotFound

from rolemesh.api.answers import ErrorAnswers, Utf8Guard
from rolemesh.api.held import HeldRoutes
from rolemesh.api.keys import ApiKeys
from rolemesh.api.node_routes import NodeRoutes
from rolemesh.api.readiness import Readiness
from rolemesh.api.relay import Relay
from rolemesh.api.routes import (
    FORM_BODY,
    GENERATE,
    INSTANCES_BODY,
    JSON_BODY,
    PASSTHROUGH,
    TOKENS,
    Route,
    fast_dispatch,
    klein_app,
    open_paths,
    relayed_routes,
)
from rolemesh.api.upstream import Upstream
from rolemesh.base import errors
from rolemesh.config.file import NodeConfig, is_loopback
from rolemesh.http.fast_channel import FastRoute
from rolemesh.http.proxy import Proxy
from rolemesh.node.node import Node
from rolemesh.node.reload import ReloadResult


def is_loopback_origin(origin: bytes) -> bool:
    """Whether a browser's ``Origin`` is on this machine's loopback (any
    scheme and port): what ``cors_allowed_origins: [localhost]`` allows."""
    try:
        host = urlsplit(origin.decode("ascii")).hostname
    except (UnicodeDecodeError, ValueError):
        return False
    return host is not None and is_loopback(host)


def _relayed(endpoint: str, *paths: str, use: str = GENERATE, body: str = JSON_BODY,
             fast: bool = True) -> Tuple[Route, ...]:
    """``POST`` routes relayed to llama-server under one endpoint name (its
    log lines and metrics), one per path that llama-server takes for it."""
    return tuple(Route("POST", path, "relay.serve", fast=fast, relayed=endpoint, use=use, body=body)
                 for path in paths)


#: The methods ``/upstream/<model>/...`` forwards (OPTIONS is the preflight's).
UPSTREAM_METHODS = ("GET", "POST", "PUT", "PATCH", "DELETE")  # GET takes HEAD too (werkzeug)

#: Every route of the API: the one place a route is declared (Klein's
#: routes and the fast path's dispatch are both built from it).  The fast
#: ones are what every inference request takes and the GETs a client asks
#: between them (so a pooled connection stays on the fast path).
ROUTES: Tuple[Route, ...] = (
    Route("GET", "/health", "node_routes.health", fast=True, open=True),
    Route("GET", "/v1/health", "node_routes.health", fast=True, open=True),
    Route("GET", "/ready", "node_routes.ready", fast=True, open=True),
    Route("GET", "/", "node_routes.root", open=True),
    Route("POST", "/v1/node/reload", "node_routes.reload"),
    Route("GET", "/v1/models", "node_routes.models", fast=True),
    Route("GET", "/models", "node_routes.models", fast=True),
    Route("GET", "/v1/node/inventory", "node_routes.inventory"),
    Route("GET", "/v1/node/registration", "node_routes.registration"),
    Route("GET", "/v1/node/devices/<device>/logs", "node_routes.device_logs"),
    Route("GET", "/v1/node/events", "node_routes.events_stream"),
    Route("GET", "/metrics", "node_routes.metrics", fast=True),
    Route("POST", "/v1/node/devices/<device>/load", "node_routes.load"),
    Route("POST", "/v1/node/devices/<device>/unload", "node_routes.unload"),
    # OpenAI: chat, completions, embeddings, Responses, and the un-prefixed forms llama-server
    # serves the same (its /completions and /embeddings are its native ones, below).
    *_relayed("chat/completions", "/v1/chat/completions", "/chat/completions"),
    *_relayed("completions", "/v1/completions"),
    *_relayed("embeddings", "/v1/embeddings"),
    *_relayed("responses", "/v1/responses", "/responses"),
    # Anthropic Messages.
    *_relayed("messages", "/v1/messages"),
    # llama-server's own: native completion and embedding, fill-in-the-middle, rerank.
    *_relayed("completion", "/completion", "/completions"),
    *_relayed("embedding", "/embedding", "/embeddings"),
    *_relayed("infill", "/infill"),
    *_relayed("rerank", "/v1/rerank", "/rerank", "/v1/reranking", "/reranking"),
    # Google Vertex AI's prediction protocol (rolemesh/config/vertex_ai.py): each child serves it.
    *_relayed("predict", "/predict", body=INSTANCES_BODY),
    *_relayed("audio/transcriptions", "/v1/audio/transcriptions", "/audio/transcriptions", body=FORM_BODY,
              fast=False),
    # Token utilities: the model's child, no generation slot.
    *_relayed("messages/count_tokens", "/v1/messages/count_tokens", use=TOKENS),
    *_relayed("responses/input_tokens", "/v1/responses/input_tokens", "/responses/input_tokens", use=TOKENS),
    *_relayed("chat/completions/input_tokens", "/v1/chat/completions/input_tokens",
              "/chat/completions/input_tokens", use=TOKENS),
    *_relayed("tokenize", "/tokenize", use=TOKENS),
    *_relayed("detokenize", "/detokenize", use=TOKENS),
    *_relayed("apply-template", "/apply-template", use=TOKENS),
    # Follow-ups to state one child holds: a live completion's control, resumable streams.
    Route("POST", "/v1/chat/completions/control", "held.control", relayed="chat/completions/control", use=TOKENS,
          fast=False),
    Route("GET", "/v1/stream", "held.stream", relayed="stream", use=TOKENS, fast=False),
    Route("DELETE", "/v1/stream", "held.stream", relayed="stream", use=TOKENS, fast=False),
    Route("POST", "/v1/streams/lookup", "held.lookup", relayed="streams/lookup", use=TOKENS, fast=False),
    # Everything else a child serves (its web UI, /slots, /props, /metrics), by model.
    *(Route(method, path, "upstream.serve", relayed="upstream", use=PASSTHROUGH)
      for path in ("/upstream/<model>/", "/upstream/<model>/<path:rest>") for method in UPSTREAM_METHODS),
    Route("GET", "/upstream/<model>", "upstream.to_slash"),
    # What llama-server serves that reaches outside a child (its built-in tools, its web UI's
    # proxy): 403 with the reason, here as under /upstream/<model>/.
    *(Route(method, path, "upstream.refuse") for path in ("/tools", "/cors-proxy") for method in ("GET", "POST")),
)
# A CORS preflight (OPTIONS, any path) is no route: NodeRoutes.preflight answers
# every one, without a key, in front of Klein (the request itself needs the key).
#: What Klein answers a failure with, tried in this order (the fast path: ErrorAnswers.fast_error).
ERROR_HANDLERS: Tuple[Tuple[Tuple[type, ...], str], ...] = (
    ((errors.ApiError,), "answers.api_error"),
    ((NotFound,), "answers.not_found"),
    ((MethodNotAllowed,), "answers.not_allowed"),
    ((HTTPException,), "answers.http_exception"),
    ((Exception,), "answers.unexpected"),
)
#: ``(endpoint, path)`` of the routes relayed to llama-server.
PROXIED_ROUTES = relayed_routes(ROUTES)
#: The routes that need no key (liveness and readiness probes).
OPEN_ROUTES = open_paths(ROUTES)


class NodeAPI:
    """The API over a :class:`Node` and a :class:`Proxy`: the routes of
    :data:`ROUTES`, answered by its parts, and the listener's head check."""

    app = klein_app(ROUTES, ERROR_HANDLERS)

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
        self.keys = ApiKeys(config.api_keys)
        self.answers = ErrorAnswers(self.keys, OPEN_ROUTES)
        self.relay = Relay(config, node, proxy, self.keys, observers)
        self.upstream = Upstream(self.relay, self.keys)
        self.held = HeldRoutes(self.relay)
        self.node_routes = NodeRoutes(config, node, self.keys, registration=registration,
                                      render_metrics=render_metrics, readiness=readiness, reload=reload)
        #: Told ("request", **fields) of each finished proxied request.
        self.events = self.relay.log.events
        self.use_config(config)
        #: What refuse_head looks routes up in: the fast routes' keys, and Klein's map.
        self._fast_route_keys = frozenset(route.key for route in ROUTES if route.fast)
        self._routes = self.app.url_map.bind("localhost")

    def use_config(self, config: NodeConfig) -> None:
        """Serve with ``config`` from the next request on (a reload: models,
        keys, limits)."""
        self.config = config
        origins = config.cors_allowed_origins
        self._cors_origins = frozenset(o.encode("utf-8") for o in origins if o != "localhost")
        self._cors_loopback = "localhost" in origins
        self.keys.use(config.api_keys)
        self.relay.use_config(config)
        self.node_routes.use_config(config)

    def resource(self) -> IResource:
        return Utf8Guard(self.app.resource(), self.cors_origin, self.node_routes.preflight)

    def cors_origin(self, origin: bytes) -> Optional[bytes]:
        """``origin`` itself where ``cors_allowed_origins`` allows it (``*``:
        any, reflected as llama-server does; ``localhost``: any on a
        loopback host), else None."""
        allowed = self._cors_origins
        if b"*" in allowed or origin in allowed or self._cors_loopback and is_loopback_origin(origin):
            return origin
        return None

    def fast_routes(self) -> Dict[Tuple[bytes, bytes], FastRoute]:
        """The routes :class:`~rolemesh.http.fast_channel.FastChannel` serves, by
        ``(method, path)``: the ``fast`` ones of :data:`ROUTES`, with what
        Klein adds (its error handlers) done by the fast path's own."""
        return fast_dispatch(ROUTES, self, self.answers.fast_error)

    def flush_records(self) -> None:
        """Record the finished requests now (shutdown: the timer would not run)."""
        self.relay.log.flush()

    def refuse_head(self, method: bytes, path: bytes, headers: Mapping[bytes, bytes]) -> Optional[errors.ApiError]:
        """The listener asks this of every request head, before its body is
        read (a :class:`~rolemesh.base.interfaces.HeadPolicy`): 401 without a
        valid key (every route but ``/health`` and ``/ready``), then 404
        for no route -- the answers the routes would give, so no body of
        such a request is ever held.  None: the route answers.  A CORS
        preflight (``OPTIONS``) needs no key, nor does a GET under
        ``/upstream/`` (a browser's first look at a child's web UI: the
        route serves its static files without one, and nothing else)."""
        if method == b"OPTIONS":
            return None  # a CORS preflight, answered in front of the routes (NodeRoutes.preflight)
        if path not in OPEN_ROUTES and not (
                path.startswith(b"/upstream/") and method in (b"GET", b"HEAD")):
            error = self.keys.error(headers.get(b"authorization"), headers.get(b"x-api-key"))
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
