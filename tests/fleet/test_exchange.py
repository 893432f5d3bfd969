"""One bounded, token-free POST to the dispatcher (rolemesh.fleet.exchange),
through StubTreq and hand-made clients, on a Clock."""

from __future__ import annotations

import json
from typing import Any

from treq.testing import StubTreq
from twisted.internet.defer import CancelledError, Deferred, fail
from twisted.internet.error import ConnectionRefusedError
from twisted.internet.task import Clock
from twisted.python.failure import Failure
from twisted.trial.unittest import SynchronousTestCase
from twisted.web.client import ResponseNeverReceived
from twisted.web.resource import Resource

from rolemesh import __version__
from rolemesh.fleet.exchange import DispatcherExchange

TOKEN = "tok-abc-secret"


class Echo(Resource):
    """Answers ``code`` with the request's path, headers and body in JSON."""

    isLeaf = True

    def __init__(self, code: int = 200, extra: bytes = b"") -> None:
        super().__init__()
        self.code = code
        self.extra = extra

    def render_POST(self, request: Any) -> bytes:
        request.setResponseCode(self.code)
        seen = {
            "path": request.path.decode(),
            "authorization": (request.getHeader(b"authorization") or b"").decode(),
            "agent": (request.getHeader(b"user-agent") or b"").decode(),
            "body": json.loads(request.content.read()),
        }
        return json.dumps(seen).encode() + self.extra


class Hanging:
    """Never answers; cancelled, it fails as twisted.web's Agent does."""

    def __init__(self) -> None:
        self.cancelled = 0

    def post(self, url: str, **kwargs: Any) -> Deferred[Any]:
        def cancel(d: Deferred[Any]) -> None:
            self.cancelled += 1
            d.errback(ResponseNeverReceived([Failure(CancelledError())]))

        return Deferred(cancel)


class Refusing:
    def post(self, url: str, **kwargs: Any) -> Deferred[Any]:
        return fail(ConnectionRefusedError(f"refused, and it says {TOKEN}"))


class ExchangeTests(SynchronousTestCase):
    def post(self, exchange: DispatcherExchange, clock: Clock, timeout: float = 2.0, advance: float = 0.0) -> Any:
        d = Deferred.fromCoroutine(exchange.post("/v1/nodes/heartbeat", {"node_id": "n"}, timeout))
        clock.advance(advance)
        return self.successResultOf(d)

    def test_posts_json_with_the_bearer_token_and_the_agent(self) -> None:
        clock = Clock()
        exchange = DispatcherExchange("http://d.test/base", TOKEN, clock, http=StubTreq(Echo()))
        code, detail, body = self.post(exchange, clock)
        seen = json.loads(body)
        self.assertEqual(code, 200)
        self.assertEqual((seen["path"], seen["body"]), ("/base/v1/nodes/heartbeat", {"node_id": "n"}))
        self.assertEqual(seen["authorization"], f"Bearer {TOKEN}")
        self.assertEqual(seen["agent"], f"rolemesh-node-agent/{__version__}")
        self.assertNotIn(TOKEN, detail, "the detail is scrubbed, the body kept for the client to read")
        self.assertEqual(clock.getDelayedCalls(), [], "the timer is cancelled once answered")

    def test_no_token_no_authorization(self) -> None:
        clock = Clock()
        exchange = DispatcherExchange("http://d.test", None, clock, http=StubTreq(Echo()))
        self.assertEqual(json.loads(self.post(exchange, clock)[2])["authorization"], "")
        self.assertNotIn("Authorization", exchange.headers())

    def test_a_hang_is_no_answer_within_the_timeout(self) -> None:
        clock = Clock()
        http = Hanging()
        exchange = DispatcherExchange("http://d.test", TOKEN, clock, http=http)
        self.assertEqual(self.post(exchange, clock, timeout=1.5, advance=1.5), (None, "no answer within 1.5s", ""))
        self.assertEqual(http.cancelled, 1)

    def test_a_failure_is_described_without_the_token(self) -> None:
        clock = Clock()
        exchange = DispatcherExchange("http://d.test", TOKEN, clock, http=Refusing())
        code, detail, body = self.post(exchange, clock)
        self.assertEqual((code, body), (None, ""))
        self.assertIn("ConnectionRefusedError", detail)
        self.assertIn("***", detail)
        self.assertNotIn(TOKEN, detail)

    def test_details_are_bounded_and_bodies_kept_longer(self) -> None:
        clock = Clock()
        exchange = DispatcherExchange("http://d.test", None, clock, http=StubTreq(Echo(500, b" " + b"x" * 1000)))
        code, detail, body = self.post(exchange, clock)
        self.assertEqual((code, len(detail)), (500, 200))
        self.assertGreater(len(body), 1000)

    def test_the_token_may_change_and_close_without_a_pool_succeeds(self) -> None:
        clock = Clock()
        exchange = DispatcherExchange("http://d.test", "old", clock, http=StubTreq(Echo()))
        exchange.token = "new"
        self.assertEqual(exchange.headers()["Authorization"], "Bearer new")
        self.assertEqual(exchange.scrub("new and old"), "*** and old")
        self.assertIsNone(self.successResultOf(exchange.close()))
