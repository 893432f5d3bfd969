"""Follow-ups to state one child holds (see :mod:`rolemesh.api.held_state`).

``POST /v1/chat/completions/control`` (by the completion's id), ``GET`` and
``DELETE /v1/stream?conv_id=`` and ``POST /v1/streams/lookup`` (by
conversation id) go to the child that served the completion or the stream,
pinned so that no switch replaces it meanwhile, and to no other child: an
id the node never saw, or whose child has since stopped, is a 404 that says
which.  A lookup asks each child that holds some of its ids and merges the
answers; ids no child holds are left out, as llama-server leaves them out.
"""

from __future__ import annotations

import json
import time
from typing import Any, Dict, List, Tuple

from twisted.internet import defer
from twisted.web.http_headers import Headers

from rolemesh.api.answers import bad_request, json_answer, parse_body, request_body
from rolemesh.api.held_state import COMPLETION, CONVERSATION, CONVERSATION_ID
from rolemesh.api.relay import Relay, _Exchange, _Record, request_id
from rolemesh.api.routes import Route
from rolemesh.base import errors
from rolemesh.base.interfaces import ProxiedRequest
from rolemesh.http.proxy import RequestShape
from rolemesh.node.node import Pin

#: Conversation ids one lookup may ask about.
MOST_LOOKED_UP = 256
_ACCEPT = Headers({b"accept": [b"*/*"]})


class HeldRoutes:
    """The routes of rolemesh/api/app.py's table answered by ``held.*``."""

    def __init__(self, relay: Relay) -> None:
        self._relay = relay

    def _pin(self, kind: str, key: str, record: _Record) -> Pin:
        relay = self._relay
        holder = relay.held.holder(kind, key)
        shown = key[:100]
        if holder is None:
            why = ("its stream was not armed with reasoning_control, or it ended before its first event"
                   if kind == COMPLETION else "no stream sent with that X-Conversation-Id was served here")
            raise errors.ApiError(404, f"no {kind} {shown!r} on this node: {why}", "not_found_error", f"unknown_{kind}")
        record.model = holder.model_id
        pin = relay.node.pin_child(holder.device, holder.pid, holder.generation)
        if pin is None:
            relay.held.forget(kind, key)
            raise errors.ApiError(404, f"the child that served {kind} {shown!r} on {holder.device} has stopped; "
                                       "the state it held is gone", "not_found_error", "state_gone")
        return pin

    def control(self, request: ProxiedRequest, route: Route) -> "defer.Deferred[None]":
        """A live completion's control, to the child running it."""
        relay = self._relay
        record = _Record("chat/completions/control", request_id(request), time.monotonic(), route.path)
        try:
            relay.admit(request)
            body = request_body(request, relay.config.max_request_body_bytes)
            key = parse_body(body, relay.config.max_request_body_bytes, model_required=False).get("id")
            if not isinstance(key, str) or not key:
                raise bad_request("'id' must be the id of a streamed completion sent with reasoning_control")
            pin = self._pin(COMPLETION, key, record)
        except Exception:
            return defer.fail().addBoth(relay._proxied, request, record)
        exchange = _Exchange(relay, request, route.path, body, False, record, None, False)
        exchange.start(pin)
        return exchange.result

    def stream(self, request: ProxiedRequest, route: Route) -> "defer.Deferred[None]":
        """A resumable stream's replay (GET) or stop (DELETE), to its child."""
        relay = self._relay
        method = request.method  # type: ignore[attr-defined]  # a twisted.web request (Klein's)
        record = _Record("stream", request_id(request), time.monotonic(), route.path,
                         method.decode("ascii", "replace"))
        try:
            relay.admit(request)
            keys = (request.args or {}).get(b"conv_id") or []  # type: ignore[attr-defined]  # twisted.web's
            if len(keys) != 1 or not CONVERSATION_ID.match(keys[0]):
                raise bad_request("conv_id must name one conversation (printable ASCII, at most 256 bytes)")
            pin = self._pin(CONVERSATION, keys[0].decode("ascii"), record)
        except Exception:
            return defer.fail().addBoth(relay._proxied, request, record)
        query = request.uri.partition(b"?")[2].decode("ascii", "replace")  # type: ignore[attr-defined]
        exchange = _Exchange(relay, request, f"{route.path}?{query}", b"", method == b"GET", record,
                             RequestShape(method=method, headers=_ACCEPT), False)
        exchange.start(pin)
        return exchange.result

    @defer.inlineCallbacks
    def lookup(self, request: ProxiedRequest, route: Route) -> Any:
        """Which of the asked conversations' streams the children hold, from each child that holds some."""
        relay = self._relay
        record = _Record("streams/lookup", request_id(request), time.monotonic(), route.path)
        pins: Dict[Tuple[str, int, int], Tuple[Pin, List[str]]] = {}
        try:
            relay.admit(request)
            body = request_body(request, relay.config.max_request_body_bytes)
            ids = parse_body(body, relay.config.max_request_body_bytes, model_required=False).get("conversation_ids")
            if (not isinstance(ids, list) or len(ids) > MOST_LOOKED_UP
                    or not all(isinstance(i, str) and CONVERSATION_ID.match(i.encode("utf-8")) for i in ids)):
                raise bad_request(f"conversation_ids must be a list of at most {MOST_LOOKED_UP} conversation ids")
            for key in dict.fromkeys(ids):
                holder = relay.held.holder(CONVERSATION, key)
                if holder is None:
                    continue
                child = (holder.device, holder.pid, holder.generation)
                if child not in pins:
                    pin = relay.node.pin_child(*child)
                    if pin is None:
                        relay.held.forget(CONVERSATION, key)
                        continue
                    pins[child] = (pin, [])
                pins[child][1].append(key)
                record.model = holder.model_id
            found: List[Any] = []
            for pin, keys in pins.values():
                record.device = pin.device
                response = yield relay.http.post(pin.endpoint.base_url + route.path,
                                                 json.dumps({"conversation_ids": keys}).encode("utf-8"),
                                                 headers={b"content-type": [b"application/json"]}, timeout=10)
                answer = yield response.json()
                if response.code != 200 or not isinstance(answer, list):
                    raise errors.upstream_error(f"llama-server answered a stream lookup with {response.code}")
                found.extend(answer)
        except Exception:
            yield defer.fail().addBoth(relay._proxied, request, record)
            return None
        finally:
            for pin, _ in pins.values():
                pin.release()
        record.status = 200
        relay.log.later(record, time.monotonic())
        return json_answer(request, 200, found)
