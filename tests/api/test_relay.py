"""rolemesh/api/relay.py: the relayed routes' steps, called directly (the
same over HTTP, through Klein and the fast channel: tests/api/test_app.py), and
the request log."""

from __future__ import annotations

import io
import json
from typing import Any, Dict, List, Optional

from twisted.internet.task import Clock
from twisted.logger import capturedLogs
from twisted.trial.unittest import SynchronousTestCase
from twisted.web.test.requesthelper import DummyRequest

from rolemesh.api.keys import ApiKeys
from rolemesh.api.relay import RECORD_DELAY_S, Relay, RequestLog, _Record, request_id
from rolemesh.api.routes import Route
from rolemesh.base import errors
from rolemesh.base.errors import ApiError
from tests.api.test_app import CHAT, ApiHarness

CHAT_ROUTE = Route("POST", "/v1/chat/completions", "relay.serve", relayed="chat/completions")


class Request(DummyRequest):
    """A DummyRequest whose producer (the upstream connection) pushes, as a transport's does."""

    def registerProducer(self, producer: Any, streaming: bool) -> None:  # noqa: N802 - IRequest's name
        self.producer = producer

    def unregisterProducer(self) -> None:  # noqa: N802 - IRequest's name
        self.producer = None

    @property
    def code(self) -> int:
        return self.responseCode or 200

    def loseConnection(self) -> None:  # noqa: N802 - IRequest's name
        self.lost = True


def request(body: Any = None, headers: Optional[Dict[bytes, bytes]] = None) -> DummyRequest:
    r = Request([b""])
    r.method = b"POST"
    for name, value in (headers or {}).items():
        r.requestHeaders.setRawHeaders(name, [value])
    r.content = io.BytesIO(body if isinstance(body, bytes) else json.dumps(body).encode() if body is not None else b"")
    return r


class RequestIdTests(SynchronousTestCase):
    def test_a_sane_one_is_kept_and_echoed(self) -> None:
        r = request(headers={b"x-request-id": b"trace-7"})
        self.assertEqual(request_id(r), "trace-7")
        self.assertEqual(r.responseHeaders.getRawHeaders(b"x-request-id"), [b"trace-7"])

    def test_else_a_fresh_one(self) -> None:
        ids = {request_id(request(headers={b"x-request-id": b"bad id"})) for _ in range(3)}
        self.assertEqual(len(ids), 3)
        for rid in ids:
            self.assertRegex(rid, r"^[0-9a-f]{32}$")


class RequestLogTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.clock = Clock()
        self.seen: List[Dict[str, Any]] = []
        self.log = RequestLog(lambda: self.clock, [lambda event, **f: self.seen.append(dict(f, event=event))])

    def record(self, status: int) -> _Record:
        record = _Record("chat/completions", f"id-{status}", 10.0)
        record.model, record.device, record.status = "a", "gpu:0", status
        return record

    def test_written_a_moment_later_together(self) -> None:
        with capturedLogs() as events:
            self.log.later(self.record(200), 10.5)
            self.log.later(self.record(404), 10.75)
            self.assertEqual((self.seen, self.clock.getDelayedCalls()[0].getTime()), ([], RECORD_DELAY_S))
            self.clock.advance(RECORD_DELAY_S)
        self.assertEqual([(s["status"], s["duration"]) for s in self.seen], [(200, 0.5), (404, 0.75)])
        lines = [e for e in events if e.get("request_id")]
        self.assertEqual([(e["log_namespace"], e["status"]) for e in lines],
                         [("rolemesh.api", 200), ("rolemesh.api", 404)])
        self.assertEqual(self.clock.getDelayedCalls(), [])

    def test_flush_writes_them_now(self) -> None:
        self.log.later(self.record(200), 11.0)
        self.log.flush()
        self.assertEqual([s["status"] for s in self.seen], [200])
        self.assertEqual(self.clock.getDelayedCalls(), [])
        self.log.flush()
        self.assertEqual(len(self.seen), 1)


class RelayTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.h = ApiHarness()
        self.keys = ApiKeys()
        self.seen: List[Dict[str, Any]] = []
        self.relay = Relay(self.h.config, self.h.node, self.h.proxy, self.keys,
                           [lambda event, **f: self.seen.append(f)])

    def refused(self, r: DummyRequest) -> ApiError:
        failure = self.failureResultOf(self.relay.serve(r, CHAT_ROUTE), ApiError)
        self.h.reactor.advance(RECORD_DELAY_S)
        self.assertEqual(self.seen[-1]["status"], failure.value.status)
        return failure.value  # type: ignore[no-any-return]

    def test_relayed_to_the_devices_child(self) -> None:
        self.h.node_h.load("a")
        r = request({"model": "a", **CHAT})
        self.successResultOf(self.relay.serve(r, CHAT_ROUTE))
        self.assertEqual(json.loads(b"".join(r.written)), {"object": "chat.completion", "model": "a"})
        attempt = self.h.agent.attempts[-1]
        self.assertEqual((attempt.method, attempt.url), (b"POST", b"http://127.0.0.1:20000/v1/chat/completions"))
        self.assertEqual(json.loads(attempt.body)["messages"], CHAT["messages"])
        self.h.reactor.advance(RECORD_DELAY_S)
        self.assertEqual((self.seen[-1]["model"], self.seen[-1]["status"], self.seen[-1]["endpoint"]),
                         ("a", 200, "chat/completions"))

    def test_refusals(self) -> None:
        self.assertEqual(self.refused(request({"model": "nope"})).code, "model_not_found")
        self.assertEqual(self.refused(request(b"[]")).status, 400)
        self.keys.use(["k"])
        self.assertEqual(self.refused(request({"model": "a"})).code, "invalid_api_key")
        self.keys.use([])
        self.h.node.draining = True
        self.assertEqual(self.refused(request({"model": "a"})).code, errors.shutting_down().code)

    def test_use_config_changes_the_limits(self) -> None:
        import attr

        self.relay.use_config(attr.evolve(self.h.config, max_request_body_bytes=10))
        self.assertEqual(self.refused(request({"model": "a", **CHAT})).status, 413)
