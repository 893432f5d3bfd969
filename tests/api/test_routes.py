"""rolemesh/api/routes.py: one table of routes, built into Klein's routes and the
fast path's dispatch."""

from __future__ import annotations

from typing import Any, List, Optional, Tuple

from treq.testing import StubTreq
from twisted.internet import defer
from twisted.python.failure import Failure
from twisted.trial.unittest import SynchronousTestCase
from werkzeug.exceptions import NotFound

from rolemesh.api.routes import Route, check_table, fast_dispatch, klein_app, open_paths, relayed_routes
from tests.fixtures.fakes import stub_answer

TABLE = (
    Route("GET", "/ping", "part.ping", fast=True, open=True),
    Route("GET", "/items/<name>", "part.item"),
    Route("POST", "/v1/relay", "part.relay", fast=True, relayed="relay"),
    Route("GET", "/boom", "part.boom", fast=True),
)


class Part:
    def __init__(self) -> None:
        self.calls: List[Tuple[Any, ...]] = []

    def ping(self, request: Any) -> bytes:
        self.calls.append(("ping",))
        return b"pong"

    def item(self, request: Any, name: str) -> bytes:
        self.calls.append(("item", name))
        return name.encode()

    def relay(self, request: Any, route: Route) -> "defer.Deferred[Optional[bytes]]":
        self.calls.append(("relay", route.relayed, route.path))
        if request is None:
            return defer.fail(ValueError("relay failed"))
        return defer.succeed(b"relayed")

    def boom(self, request: Any) -> bytes:
        raise KeyError("boom")

    def not_found(self, request: Any, failure: Failure) -> bytes:
        request.setResponseCode(404)
        return b"no such route"


class Server:
    app = klein_app(TABLE, [((NotFound,), "part.not_found")])

    def __init__(self) -> None:
        self.part = Part()


def fail(failure: Failure, request: Any) -> bytes:
    return b"failed: " + type(failure.value).__name__.encode()


class RouteRecordTests(SynchronousTestCase):
    def test_key(self) -> None:
        self.assertEqual(TABLE[0].key, (b"GET", b"/ping"))

    def test_bad_routes_are_refused(self) -> None:
        for kw in ({"method": "get", "path": "/x"}, {"method": "GET", "path": "x"},
                   {"method": "GET POST", "path": "/x"},
                   {"method": "GET", "path": "/x/<name>", "fast": True}):
            self.assertRaises(ValueError, Route, handler="part.ping", **kw)

    def test_a_route_declared_twice_is_refused(self) -> None:
        twice = (Route("GET", "/x", "a.b"), Route("GET", "/x", "a.c"))
        self.assertRaises(ValueError, check_table, twice)
        self.assertRaises(ValueError, klein_app, twice)
        self.assertRaises(ValueError, fast_dispatch, twice, Server(), fail)
        check_table((Route("GET", "/x", "a.b"), Route("POST", "/x", "a.c")))

    def test_open_and_relayed(self) -> None:
        self.assertEqual(open_paths(TABLE), frozenset({b"/ping"}))
        self.assertEqual(relayed_routes(TABLE), (("relay", "/v1/relay"),))


class KleinAppTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.server = Server()
        self.treq = StubTreq(self.server.app.resource())

    def get(self, method: str, path: str) -> Tuple[int, bytes]:
        response, body = stub_answer(self.treq, self.treq.request(method, "http://x" + path))
        return response.code, body

    def test_every_route_of_the_table_and_nothing_else(self) -> None:
        rules = sorted((m, r.rule) for r in Server.app.url_map.iter_rules() for m in r.methods or ()
                       if m not in ("HEAD", "OPTIONS"))
        self.assertEqual(rules, sorted((r.method, r.path) for r in TABLE))

    def test_the_handlers_of_the_instance_are_called(self) -> None:
        self.assertEqual(self.get("GET", "/ping"), (200, b"pong"))
        self.assertEqual(self.get("GET", "/items/abc"), (200, b"abc"))
        self.assertEqual(self.get("POST", "/v1/relay"), (200, b"relayed"))
        self.assertEqual(self.server.part.calls, [("ping",), ("item", "abc"), ("relay", "relay", "/v1/relay")])

    def test_the_error_handlers(self) -> None:
        self.assertEqual(self.get("GET", "/nowhere"), (404, b"no such route"))


class FastDispatchTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.server = Server()
        self.routes = fast_dispatch(TABLE, self.server, fail)

    def result(self, d: "defer.Deferred[Any]") -> Any:
        return self.successResultOf(d)

    def test_the_fast_routes_only(self) -> None:
        self.assertEqual(set(self.routes), {(b"GET", b"/ping"), (b"POST", b"/v1/relay"), (b"GET", b"/boom")})

    def test_an_answer_at_once_comes_in_a_fired_deferred(self) -> None:
        self.assertEqual(self.result(self.routes[(b"GET", b"/ping")](object())), b"pong")  # type: ignore[arg-type]

    def test_a_relayed_route_gets_its_route(self) -> None:
        self.assertEqual(self.result(self.routes[(b"POST", b"/v1/relay")](object())), b"relayed")  # type: ignore[arg-type]
        self.assertEqual(self.server.part.calls, [("relay", "relay", "/v1/relay")])

    def test_failures_are_answered_by_fail(self) -> None:
        self.assertEqual(self.result(self.routes[(b"GET", b"/boom")](object())), b"failed: KeyError")  # type: ignore[arg-type]
        self.assertEqual(self.result(self.routes[(b"POST", b"/v1/relay")](None)), b"failed: ValueError")  # type: ignore[arg-type]

    def test_the_handlers_are_the_instances(self) -> None:
        other = Server()
        fast_dispatch(TABLE, other, fail)[(b"GET", b"/ping")](object())  # type: ignore[arg-type]
        self.assertEqual((self.server.part.calls, other.part.calls), ([], [("ping",)]))
