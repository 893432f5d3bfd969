"""The agent's own routes: the probes (``/health``, ``/ready``), the model
list, and the node's endpoints (inventory, registration, a device's logs,
the events stream, metrics, reload, and the operator's load and unload).
Each reads the node through its views (``Node.has_device`` ...), never a
supervisor.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Dict, Generator, Optional

from twisted.internet import defer
from twisted.web.iweb import IRequest

from rolemesh.api.answers import bad_request, json_answer, parse_body, request_body
from rolemesh.api.keys import ApiKeys
from rolemesh.api.readiness import Readiness
from rolemesh.base import errors
from rolemesh.children.adapters import adapter_entries
from rolemesh.config.file import NodeConfig
from rolemesh.node.feed import SSEClient
from rolemesh.node.node import Lease, Node
from rolemesh.node.reload import ReloadResult

#: Lines the logs endpoint returns at most.
MAX_LOG_TAIL = 1000
#: A quiet events stream gets a comment line this often (seconds).
SSE_KEEPALIVE_S = 15.0
#: Bytes of events waiting for a reader that does not read before it is cut off.
SSE_MAX_BACKLOG = 256 * 1024
_CREATED = int(time.time())


class NodeRoutes:
    """The routes answered from the node itself (every route of
    rolemesh/api/app.py's table that is not relayed to a child)."""

    def __init__(
        self,
        config: NodeConfig,
        node: Node,
        keys: ApiKeys,
        registration: Optional[Callable[[], Dict[str, Any]]] = None,
        render_metrics: Optional[Callable[[], bytes]] = None,
        readiness: Optional[Callable[[], Readiness]] = None,
        reload: Optional[Callable[[str], ReloadResult]] = None,
    ) -> None:
        self.node = node
        self._keys = keys
        self._registration = registration
        self._render_metrics = render_metrics
        self._readiness = readiness
        self._reload = reload
        self.use_config(config)

    def use_config(self, config: NodeConfig) -> None:
        """Answer with ``config`` (its models, its body limit) from the next request on."""
        self.config = config

    def _device(self, device: str) -> None:
        """404 unless ``device`` is a device (or device group) of this node."""
        if not self.node.has_device(device):
            raise errors.ApiError(404, f"no device {device[:64]!r} on this node", "invalid_request_error",
                                  "device_not_found")

    # -- the probes and the model list ----------------------------------------------------

    def health(self, request: IRequest) -> bytes:
        return json_answer(request, 200, {"status": "ok", "draining": self.node.draining})

    def ready(self, request: IRequest) -> bytes:
        """200 when the agent can take work, else 503 naming what fails (no auth)."""
        if self._readiness is None:
            raise errors.ApiError(404, "readiness is not available", "invalid_request_error", "not_found")
        readiness = self._readiness()
        return json_answer(request, 200 if readiness.ready else 503, readiness.to_json())

    def models(self, request: IRequest) -> bytes:
        self._keys.authorize(request)
        data = []
        listed = [(model, False) for model in self.config.models]
        # Removed by a reload but still busy: listed (as leaving) until idle.
        listed.extend((model, True) for model in self.node.leaving_models())
        for model, leaving in listed:
            where = self.node.loaded_on(model.model_id)
            entry = {
                "id": model.model_id,
                "object": "model",
                "created": _CREATED,
                "owned_by": "rolemesh",
                "roles": list(model.roles),
                "loaded_on": [n for n in where if self.node.device_ready(n)],
                "loading_on": [n for n in where if not self.node.device_ready(n)],
            }
            progress = {n: self.node.load_progress(n) for n in where if not self.node.device_ready(n)}
            entry["load_progress"] = {n: p for n, p in progress.items() if p is not None}
            entry.update({k: v for k, v in self.node.model_memory(model).items() if k != "model_id"})
            # What llama-server's own entries carry (its names, tags, modalities).
            entry["aliases"] = list(model.names)
            entry["tags"] = list(model.tags)
            entry["architecture"] = {"input_modalities": ["text", "image"] if model.mmproj else ["text"],
                                     "output_modalities": ["text"]}
            if leaving:
                entry["leaving"] = True
            data.append(entry)
            data.extend(adapter_entries(entry, model))
        return json_answer(request, 200, {"object": "list", "data": data})

    def root(self, request: IRequest) -> bytes:
        """``GET /`` (and the ``HEAD /`` clients probe with): the node answers,
        and says where its API is; no key, nothing more."""
        return json_answer(request, 200, {"service": "rolemesh-node-agent", "api": "/v1",
                                          "models": "/v1/models", "health": "/health"})

    def preflight(self, request: IRequest) -> bytes:
        """A CORS preflight (``OPTIONS``, any path): 200 without a key, as
        llama-server answers it; the allowed origin gets the
        ``Access-Control-*`` headers (the listener adds the origin itself)."""
        if request.responseHeaders.hasHeader(b"access-control-allow-origin"):
            request.setHeader(b"access-control-allow-credentials", b"true")
            request.setHeader(b"access-control-allow-methods", b"GET, POST, DELETE, OPTIONS")
            asked = request.getHeader(b"access-control-request-headers")
            request.setHeader(b"access-control-allow-headers", asked if asked else b"*")
            request.setHeader(b"access-control-max-age", b"86400")
        request.setResponseCode(200)
        request.setHeader(b"content-type", b"text/plain")
        return b""

    # -- the node's endpoints ----------------------------------------------------------------

    def reload(self, request: IRequest) -> bytes:
        """Re-read the config files; 400 with the one-line error if invalid."""
        self._keys.authorize(request)
        if self._reload is None:
            raise errors.ApiError(404, "reload is not available", "invalid_request_error", "not_found")
        result = self._reload("POST /v1/node/reload")
        if not result.ok:
            raise bad_request(result.error or "reload failed", "invalid_config")
        return json_answer(request, 200, result.to_json())

    def inventory(self, request: IRequest) -> bytes:
        self._keys.authorize(request)
        return json_answer(request, 200, self.node.inventory())

    def registration(self, request: IRequest) -> bytes:
        self._keys.authorize(request)
        if self._registration is None:
            raise errors.ApiError(404, "registration payload not available", "invalid_request_error", "not_found")
        return json_answer(request, 200, self._registration())

    def device_logs(self, request: IRequest, device: str) -> bytes:
        self._keys.authorize(request)
        self._device(device)
        raw = (request.args.get(b"tail") or [b"100"])[0]
        try:
            tail = int(raw)
        except ValueError:
            tail = -1
        if not 0 <= tail <= MAX_LOG_TAIL:
            raise bad_request(f"tail must be an integer from 0 to {MAX_LOG_TAIL}", "invalid_tail")
        return json_answer(request, 200, {"device": device, "lines": self.node.device_log_tail(device, tail)})

    def events_stream(self, request: IRequest) -> "defer.Deferred[None]":
        """Server-Sent Events: one ``data:`` line of JSON per node event (rolemesh.node.feed)."""
        self._keys.authorize(request)
        request.setHeader(b"content-type", b"text/event-stream; charset=utf-8")
        request.setHeader(b"cache-control", b"no-cache")
        request.setHeader(b"x-accel-buffering", b"no")
        request.write(b": rolemesh node events\n\n")
        SSEClient(request, self.node.feed, self.node.reactor, keepalive_s=SSE_KEEPALIVE_S,
                  max_backlog=SSE_MAX_BACKLOG)
        return defer.Deferred(lambda d: None)  # open until the client goes (Klein cancels it then)

    def metrics(self, request: IRequest) -> bytes:
        self._keys.authorize(request)
        if self._render_metrics is None:
            raise errors.ApiError(404, "metrics are not enabled", "invalid_request_error", "not_found")
        request.setHeader(b"content-type", b"text/plain; version=0.0.4; charset=utf-8")
        return self._render_metrics()

    # -- the operator's routes: warm or free a device ------------------------------------------

    @defer.inlineCallbacks
    def load(self, request: IRequest, device: str) -> Generator["defer.Deferred[Lease]", Lease, bytes]:
        """Load a model on a device, queued like a request (429 when full)."""
        self._keys.authorize(request)
        self._device(device)
        payload = parse_body(request_body(request, self.config.max_request_body_bytes),
                             self.config.max_request_body_bytes)
        model = self.node.resolve(payload["model"])
        lease = yield self.node.acquire(model, device=device)
        lease.release()
        return json_answer(request, 200, {"device": device, "model": model.model_id,
                                          **self.node.device_snapshot(device)})

    @defer.inlineCallbacks
    def unload(self, request: IRequest, device: str) -> Generator["defer.Deferred[None]", None, bytes]:
        """Stop a device's child once the requests ahead of this one are done."""
        self._keys.authorize(request)
        self._device(device)
        yield self.node.unload(device)
        return json_answer(request, 200, {"device": device, **self.node.device_snapshot(device)})
