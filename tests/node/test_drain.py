"""The drain (rolemesh.node.drain): its own rules on a Clock and stand-in books,
then through the node (requests waiting, loading, in flight)."""

from __future__ import annotations

from typing import Any, Dict, List, Tuple

import attr
from twisted.internet.task import Clock
from twisted.logger import capturedLogs
from twisted.trial.unittest import SynchronousTestCase

from rolemesh.base import errors
from rolemesh.children.state import STARTING
from rolemesh.node.drain import Drain
from tests.node.test_node import NodeHarness


@attr.s(auto_attribs=True)
class Book:
    pending: int = 0


class DrainPartTests(SynchronousTestCase):
    """Drain alone: the books' pending counts say when all is idle."""

    def setUp(self) -> None:
        self.clock = Clock()
        self.books: Dict[str, Book] = {"gpu:0": Book(), "gpu:1": Book()}
        self.refused: List[None] = []
        self.events: List[Tuple[str, Dict[str, Any]]] = []
        self.drain = Drain(self.books, lambda: self.refused.append(None),
                           lambda event, **fields: self.events.append((event, fields)), reactor=self.clock)

    def test_idle_books_drain_at_once_after_refusing_the_waiting(self) -> None:
        self.assertFalse(self.drain.draining)
        self.successResultOf(self.drain.drain(30))
        self.assertTrue(self.drain.draining)
        self.assertEqual((self.refused, self.events), ([None], [("draining", {})]))
        self.assertEqual(self.clock.getDelayedCalls(), [], "no grace timer when nothing runs")

    def test_fires_once_the_last_request_ends_and_stops_its_timer(self) -> None:
        self.books["gpu:0"].pending, self.books["gpu:1"].pending = 2, 1
        self.assertEqual(self.drain.in_flight(), 3)
        d = self.drain.drain(30)
        self.assertNoResult(d)
        self.books["gpu:0"].pending = 0
        self.drain.quiet()
        self.assertNoResult(d)
        self.books["gpu:1"].pending = 0
        self.drain.quiet()
        self.successResultOf(d)
        self.assertEqual([c for c in self.clock.getDelayedCalls() if c.active()], [])
        self.drain.quiet()  # nothing left to fire: harmless

    def test_the_grace_ends_the_wait_and_says_what_was_pending(self) -> None:
        self.books["gpu:1"].pending = 1
        d = self.drain.drain(30)
        self.clock.advance(29.9)
        self.assertNoResult(d)
        with capturedLogs() as logged:
            self.clock.advance(0.1)
        self.successResultOf(d)
        self.assertEqual([e["busy"] for e in logged if "busy" in e], [{"gpu:1": 1}])
        self.books["gpu:1"].pending = 0
        self.drain.quiet()  # a late end is harmless

    def test_quiet_without_a_drain_does_nothing(self) -> None:
        self.drain.quiet()
        self.assertFalse(self.drain.draining)
        self.assertEqual(self.refused, [])


class DrainTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.h = NodeHarness()

    def test_idle_node_drains_at_once(self) -> None:
        self.successResultOf(self.h.node.drain(30))
        self.assertTrue(self.h.node.draining)

    def test_drain_fires_when_in_flight_requests_finish(self) -> None:
        h = self.h
        d1 = h.node.acquire(h.model("a"))
        d2 = h.node.acquire(h.model("a"))
        h.answer("alpha")
        lease = self.successResultOf(d1)
        drained = h.node.drain(30)
        # The queued request had not begun: refused at once, not left to the end.
        self.assertEqual(self.failureResultOf(d2, errors.ApiError).value.code, "shutting_down")
        self.assertEqual(h.node.in_flight(), 1)
        self.assertNoResult(drained)
        lease.release()
        self.successResultOf(drained)
        self.assertEqual([c for c in h.reactor.getDelayedCalls() if c.active()
                          and getattr(c, "func", None) == h.node.drainer._timeout], [])

    def test_request_waiting_on_a_load_is_refused_when_the_drain_begins(self) -> None:
        h = self.h
        waiting = h.node.acquire(h.model("a"))
        self.assertEqual(h.sup().state, STARTING)
        drained = h.node.drain(30)
        failure = self.failureResultOf(waiting, errors.ApiError)
        self.assertEqual((failure.value.status, failure.value.code), (503, "shutting_down"))
        self.successResultOf(drained)
        self.assertEqual(h.node.in_flight(), 0)
        h.answer("alpha")  # the load finishing later harms nothing
        self.assertTrue(h.idle())

    def test_drain_gives_up_after_the_grace(self) -> None:
        h = self.h
        d = h.node.acquire(h.model("a"))
        h.answer("alpha")
        lease = self.successResultOf(d)
        drained = h.node.drain(30)
        h.reactor.advance(29.9)
        self.assertNoResult(drained)
        h.reactor.advance(0.1)
        self.successResultOf(drained)
        lease.release()  # a late release is harmless
