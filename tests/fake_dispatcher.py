"""A fake RoleMesh dispatcher for tests: a Klein app that records what it gets.

Use it in memory (``treq.testing.StubTreq(fake.resource())``) for unit tests
on a ``task.Clock``, or over real HTTP on loopback (``fake.listen(reactor)``)
for integration tests.  Flip its modes to misbehave:

- ``refuse``: answer every request 503 (overloaded / not ready);
- ``fail``: answer 500;
- ``hang``: never answer (the client's timeout must fire); ``release()``
  answers the hung requests with 503;
- ``reject_auth``: answer 401 (also done when ``token`` is set and the
  request's bearer token differs);
- ``forget()``: drop every registration, so heartbeats get ``forget_status``
  (404, or 410) until the node registers again;
- ``deregister_route = False``: behave like a dispatcher without
  ``/v1/nodes/deregister`` (404);
- ``events_route = False``: a dispatcher of the old protocol, without
  ``/v1/nodes/events`` (404);
- ``drop_events``: answer events 503 (a delta lost on the way);
- ``ask_interval``: a number put in every answer as ``heartbeat_interval_s``.

Besides the record, it keeps the view a dispatcher would (``view``: node_id
-> device -> its state and model, from heartbeats and events by the rules of
docs/dispatcher-protocol.md), and ``missed``: node_ids whose heartbeat's
``last_seq`` named an events body it never got.

Every request is recorded, misbehaving or not, in ``received``.
"""

from __future__ import annotations

import json
from typing import Any

import attr
from klein import Klein
from twisted.internet.defer import Deferred
from twisted.web.server import Site

from rolemesh.dispatcher import DEREGISTER_PATH, EVENTS_PATH, HEARTBEAT_PATH, REGISTER_PATH


@attr.s(auto_attribs=True, frozen=True)
class Received:
    """One request as the fake dispatcher saw it."""

    kind: str  # "register", "heartbeat", "deregister" or "events"
    method: str
    path: str
    #: Header names lower-cased, each with all its values.
    headers: dict[str, list[str]]
    #: The parsed JSON body, or None when it was not JSON.
    body: Any
    raw: bytes
    #: ``clock.seconds()`` when received, if the fake was given a clock.
    at: float | None = None

    def header(self, name: str) -> str | None:
        values = self.headers.get(name.lower())
        return values[0] if values else None


class FakeDispatcher:
    """The dispatcher side of the protocol, with switchable failure modes."""

    app = Klein()

    def __init__(self, token: str | None = None, clock: Any = None) -> None:
        self.token = token
        self.clock = clock
        self.received: list[Received] = []
        #: node_id -> the registration body the dispatcher holds.
        self.nodes: dict[str, Any] = {}
        self.refuse = False
        self.fail = False
        self.hang = False
        self.reject_auth = False
        self.forget_status = 404
        self.deregister_route = True
        self.events_route = True
        self.drop_events = False
        self.ask_interval: float | None = None
        #: node_id -> device -> {"state", "model", "seq"}: what this dispatcher believes.
        self.view: dict[str, dict[str, dict[str, Any]]] = {}
        #: node_id -> the seqs of events bodies received.
        self.seqs: dict[str, set[int]] = {}
        #: node_id -> the last_seq of the last full heartbeat taken.
        self.healed_to: dict[str, int] = {}
        #: node_ids whose heartbeat said a delta had been missed.
        self.missed: list[str] = []
        self._hung: list[Deferred[Any]] = []

    # -- test helpers ---------------------------------------------------

    def resource(self) -> Any:
        """The Klein resource, e.g. for ``StubTreq``."""
        return self.app.resource()

    def listen(self, reactor: Any, port: int = 0, interface: str = "127.0.0.1") -> Any:
        """Serve over real HTTP; returns the ``IListeningPort`` (see :meth:`url`)."""
        site = Site(self.resource())
        site.noisy = False
        return reactor.listenTCP(port, site, interface=interface)

    @staticmethod
    def url(listening_port: Any) -> str:
        """The base URL of a port returned by :meth:`listen`."""
        address = listening_port.getHost()
        return f"http://{address.host}:{address.port}"

    def forget(self) -> None:
        """Lose every registration, like a dispatcher that restarted."""
        self.nodes.clear()

    def release(self) -> None:
        """Answer every hung request with 503 so no connection lingers."""
        hung, self._hung = self._hung, []
        for d in hung:
            if not d.called:
                d.callback(None)

    def of_kind(self, kind: str) -> list[Received]:
        return [r for r in self.received if r.kind == kind]

    @property
    def registrations(self) -> list[Received]:
        return self.of_kind("register")

    @property
    def heartbeats(self) -> list[Received]:
        return self.of_kind("heartbeat")

    @property
    def deregistrations(self) -> list[Received]:
        return self.of_kind("deregister")

    @property
    def events(self) -> list[Received]:
        return self.of_kind("events")

    def take_heartbeat(self, body: dict[str, Any]) -> None:
        """A full heartbeat replaces the node's view; ``last_seq`` says which deltas it covers."""
        node_id = body["node_id"]
        last_seq = body.get("last_seq")
        if isinstance(last_seq, int):
            got = self.seqs.get(node_id, set())
            since = self.healed_to.get(node_id, 0)
            if any(seq not in got for seq in range(since + 1, last_seq + 1)):
                self.missed.append(node_id)
            self.healed_to[node_id] = last_seq
        self.view[node_id] = {d["device"]: {"state": d["state"], "model": d["model"]} for d in body["devices"]}

    def take_events(self, body: dict[str, Any]) -> None:
        """A delta updates the devices it names, unless a heartbeat already covered it."""
        node_id, seq = body["node_id"], body["seq"]
        self.seqs.setdefault(node_id, set()).add(seq)
        if seq <= self.healed_to.get(node_id, 0):
            return
        devices = self.view.setdefault(node_id, {})
        for event in body["events"]:
            if event.get("device") is not None and event.get("state") is not None:
                devices[event["device"]] = {"state": event["state"], "model": event["model"]}

    # -- routes ---------------------------------------------------------

    @app.route(REGISTER_PATH, methods=["POST"])
    def register(self, request: Any) -> Any:
        return self._handle(request, "register")

    @app.route(HEARTBEAT_PATH, methods=["POST"])
    def heartbeat(self, request: Any) -> Any:
        return self._handle(request, "heartbeat")

    @app.route(DEREGISTER_PATH, methods=["POST"])
    def deregister(self, request: Any) -> Any:
        return self._handle(request, "deregister")

    @app.route(EVENTS_PATH, methods=["POST"])
    def node_events(self, request: Any) -> Any:
        return self._handle(request, "events")

    def _handle(self, request: Any, kind: str) -> Any:
        raw = request.content.read()
        try:
            body = json.loads(raw)
        except ValueError:
            body = None
        headers = {
            name.decode("latin-1").lower(): [v.decode("latin-1") for v in values]
            for name, values in request.requestHeaders.getAllRawHeaders()
        }
        self.received.append(
            Received(
                kind=kind,
                method=request.method.decode("ascii"),
                path=request.path.decode("utf-8"),
                headers=headers,
                body=body,
                raw=raw,
                at=None if self.clock is None else self.clock.seconds(),
            )
        )
        if self.hang:
            d: Deferred[Any] = Deferred()
            self._hung.append(d)
            d.addCallback(lambda _: self._answer(request, 503, {"error": "released"}))
            return d
        if self.refuse:
            return self._answer(request, 503, {"error": "unavailable"})
        if self.fail:
            return self._answer(request, 500, {"error": "internal error"})
        auth = headers.get("authorization", [None])[0]
        if self.reject_auth or (self.token is not None and auth != f"Bearer {self.token}"):
            return self._answer(request, 401, {"error": "unauthorized"})
        if not isinstance(body, dict) or not isinstance(body.get("node_id"), str):
            return self._answer(request, 400, {"error": "expected a JSON object with node_id"})
        node_id = body["node_id"]
        if kind == "events":
            if not self.events_route:
                return self._answer(request, 404, {"error": "no route"})
            if self.drop_events:
                return self._answer(request, 503, {"error": "dropped"})
            if node_id not in self.nodes:
                return self._answer(request, 410, {"error": "unknown node"})
            self.take_events(body)
            return self._answer(request, 200, {"ok": True})
        if kind == "register":
            self.nodes[node_id] = body
            return self._answer(request, 200, {"ok": True, "node_id": node_id})
        if kind == "heartbeat":
            if node_id not in self.nodes:
                return self._answer(request, self.forget_status, {"error": "unknown node"})
            if isinstance(body.get("devices"), list):
                self.take_heartbeat(body)
            return self._answer(request, 200, {"ok": True})
        if not self.deregister_route or node_id not in self.nodes:
            return self._answer(request, 404, {"error": "unknown node"})
        del self.nodes[node_id]
        return self._answer(request, 200, {"ok": True})

    def _answer(self, request: Any, code: int, body: Any) -> bytes:
        if self.ask_interval is not None and isinstance(body, dict) and code == 200:
            body = dict(body, heartbeat_interval_s=self.ask_interval)
        request.setResponseCode(code)
        request.setHeader(b"Content-Type", b"application/json")
        return json.dumps(body).encode("utf-8")
