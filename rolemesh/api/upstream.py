"""``/upstream/<model>/<path>``: any method and path to that model's child.

llama-swap's convention: what the node does not route itself -- a child's
web UI, its ``/slots``, ``/props`` and ``/metrics`` -- reaches the child of a
model by name, behind the key, loading the model if no device holds it.
Routes that change a child's state or reach outside it are refused 403
(:data:`REFUSED`): the node owns its children's slots, adapters and models,
and a child is no proxy to the world.

A browser's first look at the UI carries no key (it has not been asked for
one yet): the UI's static files are served without it, as llama-server
serves them, but only from a child that is ready -- a keyless request never
loads a model (it gets a page that says so) -- and every API call of the UI
stays behind the key, which the UI sends once the user enters it in its
settings.
"""

from __future__ import annotations

import json
import time
from typing import Optional, Tuple

from twisted.internet import defer
from twisted.web.http_headers import Headers

from rolemesh.api.answers import request_body
from rolemesh.api.keys import ApiKeys
from rolemesh.api.relay import Relay, _Exchange, _Record, request_id
from rolemesh.api.routes import GENERATE, TOKENS, Route
from rolemesh.base import errors
from rolemesh.base.interfaces import ProxiedRequest
from rolemesh.http.proxy import RequestShape
from rolemesh.scheduling.fairqueue import DEFAULT_SHARE

#: ``(method or None for any, path or path prefix ending in /)`` a child
#: serves that change its state or reach outside it: refused 403.
REFUSED: Tuple[Tuple[Optional[bytes], str], ...] = (
    (b"POST", "/props"),
    (b"POST", "/slots"),
    (b"POST", "/slots/"),
    (b"POST", "/lora-adapters"),
    (None, "/tools"),
    (None, "/cors-proxy"),
    (None, "/models/load"),
    (None, "/models/unload"),
)
#: The paths of a child's API (the rest of what it serves is its web UI's
#: static files, which a keyless GET may have).
API_PATHS = ("/v1/", "/props", "/slots", "/metrics", "/health", "/models", "/lora-adapters", "/completion",
             "/completions", "/chat/", "/embedding", "/infill", "/tokenize", "/detokenize", "/apply-template",
             "/rerank", "/reranking", "/responses", "/tools", "/cors-proxy")
#: Child paths that generate (a POST to one takes a generation slot, queued
#: like chat); every other passthrough takes none.
GENERATING = ("/v1/chat/completions", "/chat/completions", "/v1/completions", "/completion", "/completions",
              "/v1/messages", "/v1/responses", "/responses", "/infill", "/v1/embeddings", "/embedding",
              "/embeddings", "/v1/rerank", "/rerank", "/v1/reranking", "/reranking")
#: Request headers a passthrough hands the child (never the key: the child has none).
FORWARDED_HEADERS = (b"content-type", b"accept", b"if-none-match", b"if-modified-since", b"range")

#: What a keyless GET gets where the model is not loaded.
NOT_LOADED_PAGE = """<!doctype html>
<html><head><meta charset="utf-8"><title>{model}: not loaded</title></head>
<body><h1>{model} is not loaded on this node</h1>
<p>A request without the node's API key never loads a model. Load it with a keyed request
(for example <code>POST /v1/node/devices/&lt;device&gt;/load</code>, or any inference request for
<code>{model}</code>), then reload this page.</p></body></html>
"""


def refusal(method: bytes, path: str) -> Optional[errors.ApiError]:
    """403 for a child route the passthrough does not reach (:data:`REFUSED`)."""
    for refused_method, refused in REFUSED:
        if refused_method is not None and refused_method != method:
            continue
        if path == refused or (refused.endswith("/") and path.startswith(refused)) or path.startswith(refused + "/"):
            shown = path[:100]
            return errors.ApiError(403, f"{method.decode('ascii', 'replace')} {shown} changes a child's state or "
                                        "reaches outside it; the node does not pass it through",
                                   "permission_error", "forbidden")
    return None


def is_api_path(path: str) -> bool:
    return path.startswith(API_PATHS)


class Upstream:
    """The passthrough routes (``use=PASSTHROUGH`` in rolemesh/api/app.py's table)."""

    def __init__(self, relay: Relay, keys: ApiKeys) -> None:
        self._relay = relay
        self._keys = keys

    def to_slash(self, request: ProxiedRequest, model: str) -> bytes:
        """``/upstream/<model>``: the UI's relative links need the slash."""
        request.setResponseCode(308)
        request.setHeader(b"location", b"/upstream/%s/" % model.encode("utf-8"))
        return b""

    def refuse(self, request: ProxiedRequest) -> bytes:
        """``/tools``, ``/cors-proxy`` at the top: llama-server's, refused here as under the passthrough."""
        self._keys.authorize(request)
        path = request.path.decode("ascii", "replace")  # type: ignore[attr-defined]  # twisted.web's
        error = refusal(request.method, path)  # type: ignore[attr-defined]
        assert error is not None, path
        raise error

    def serve(self, request: ProxiedRequest, route: Route, model: str, rest: str = "") -> "defer.Deferred[None]":
        method = request.method  # type: ignore[attr-defined]  # a twisted.web request (Klein's)
        path = "/" + rest
        relay = self._relay
        record = _Record("upstream", request_id(request), time.monotonic(), f"/upstream/{model[:64]}{path[:200]}",
                         method.decode("ascii", "replace"))
        try:
            error, key = self._keys.index(request.getHeader(b"authorization"), request.getHeader(b"x-api-key"))
            keyless = error is not None
            if keyless and (method not in (b"GET", b"HEAD") or is_api_path(path)):
                raise error  # type: ignore[misc]  # not None: keyless
            refused = refusal(method, path)
            if refused is not None:
                raise refused
            share = relay.admit(request) if not keyless else DEFAULT_SHARE
            if keyless and relay.node.draining:
                raise errors.shutting_down()
            config = relay.config
            body = request_body(request, config.max_request_body_bytes)
            served, _ = relay.node.resolve_request(model)
            record.model = served.model_id
        except Exception:
            return defer.fail().addBoth(relay._proxied, request, record)
        generates = method == b"POST" and path in GENERATING
        streaming = False
        if generates:
            try:
                streaming = json.loads(body).get("stream") is True
            except (ValueError, AttributeError, RecursionError):
                pass  # the child answers it (400)
        query = request.uri.partition(b"?")[2]  # type: ignore[attr-defined]  # twisted.web's
        target = path + ("?" + query.decode("ascii", "replace") if query else "")
        headers = Headers({name: [value] for name in FORWARDED_HEADERS
                           if (value := request.getHeader(name)) is not None})
        shape = RequestShape(method=method, headers=headers)
        exchange = _Exchange(relay, request, target, body, streaming, record, shape, generates)
        placed = relay.place(exchange, served, share, None, GENERATE if generates else TOKENS, load=not keyless)
        if placed is None:  # keyless, and no child of it is ready: say so, load nothing
            request.setResponseCode(503)
            request.setHeader(b"content-type", b"text/html; charset=utf-8")
            request.setHeader(b"retry-after", b"5")
            record.status = 503
            relay.log.later(record, time.monotonic())
            page = NOT_LOADED_PAGE.format(model=served.model_id).encode("utf-8")
            return defer.succeed(page)  # type: ignore[arg-type]  # Klein writes the bytes
        return placed
