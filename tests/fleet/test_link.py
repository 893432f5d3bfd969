"""The dispatcher client's connection state machine (rolemesh.fleet.link)
on a Clock: states, delays, and a log that speaks once per change."""

from __future__ import annotations

from typing import Any

from twisted.internet.task import Clock
from twisted.logger import capturedLogs, formatEvent
from twisted.trial.unittest import SynchronousTestCase

from rolemesh.base.backoff import Backoff
from rolemesh.fleet.link import DispatcherLink
from rolemesh.fleet.protocol import (
    AUTH,
    REGISTERED,
    REJECTED,
    TRANSIENT,
    UNREACHABLE,
    UNREGISTERED,
    RequestKind,
)
from rolemesh.node.feed import DISPATCHER_DOWN, DISPATCHER_UP, NodeEvent, NodeFeed


def link(clock: Clock) -> DispatcherLink:
    return DispatcherLink("http://d.test", clock, Backoff(1.0, 8.0, lambda: 1.0), 60.0)


class StateTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.clock = Clock()
        self.link = link(self.clock)

    def test_starts_unregistered_never_answered(self) -> None:
        self.assertEqual((self.link.state, self.link.last_success, self.link.registered), (UNREGISTERED, None, False))

    def test_success_is_registered_only_once_registered(self) -> None:
        self.clock.advance(3)
        self.link.succeeded()
        self.assertEqual((self.link.state, self.link.last_success), (UNREGISTERED, 3.0))
        self.link.registered = True
        self.link.succeeded()
        self.assertEqual(self.link.state, REGISTERED)

    def test_transient_failures_back_off_and_refusals_retry_slowly(self) -> None:
        delays = [self.link.failed(RequestKind.HEARTBEAT, TRANSIENT, None, "refused") for _ in range(5)]
        self.assertEqual(delays, [1.0, 2.0, 4.0, 8.0, 8.0])  # random() = 1: the ceiling, capped
        self.assertEqual(self.link.state, UNREACHABLE)
        self.assertEqual(self.link.failed(RequestKind.REGISTER, AUTH, 401, ""), 60.0)
        self.link.succeeded()
        self.assertEqual(self.link.failed(RequestKind.HEARTBEAT, TRANSIENT, None, "refused"), 1.0, "reset")

    def test_forgotten_registers_again_at_once_and_counts_as_an_answer(self) -> None:
        self.link.registered = True
        self.link.failed(RequestKind.HEARTBEAT, TRANSIENT, 503, "")
        self.clock.advance(2)
        self.link.forgotten()
        self.assertEqual((self.link.state, self.link.registered, self.link.last_success), (UNREGISTERED, False, 2.0))
        self.assertEqual(self.link.failed(RequestKind.HEARTBEAT, TRANSIENT, None, ""), 1.0, "the back-off was reset")

    def test_deregistered_forgets_that_the_dispatcher_may_know_us(self) -> None:
        self.link.registered = self.link.maybe_known = True
        self.link.deregistered()
        self.assertEqual((self.link.registered, self.link.maybe_known, self.link.state), (False, False, UNREGISTERED))


class LogTests(SynchronousTestCase):
    def lines(self, events: Any) -> list[str]:
        return [formatEvent(e) for e in events]

    def test_one_line_per_kind_of_failure_and_one_on_recovery(self) -> None:
        clock = Clock()
        subject = link(clock)
        with capturedLogs() as events:
            for _ in range(3):
                subject.failed(RequestKind.HEARTBEAT, TRANSIENT, None, "ConnectionRefusedError")
                clock.advance(1)
            subject.failed(RequestKind.HEARTBEAT, REJECTED, 418, "teapot")
            clock.advance(1)
            subject.succeeded()
            subject.succeeded()
        lines = self.lines(events)
        self.assertEqual(len(lines), 3, lines)
        self.assertIn("dispatcher unreachable (ConnectionRefusedError)", lines[0])
        self.assertIn("rejected the heartbeat request (HTTP 418: teapot)", lines[1])
        self.assertIn("accepts this node again after 4.0s", lines[2])
        self.assertEqual(events[0]["log_namespace"], "rolemesh.fleet.dispatcher.DispatcherClient")

    def test_recovery_from_an_outage_says_how_long_and_how_many(self) -> None:
        clock = Clock()
        subject = link(clock)
        with capturedLogs() as events:
            subject.failed(RequestKind.REGISTER, TRANSIENT, None, "x")
            clock.advance(2.5)
            subject.failed(RequestKind.REGISTER, TRANSIENT, None, "x")
            subject.succeeded()
        self.assertIn("reachable again after 2.5s and 2 failed attempts", self.lines(events)[-1])


class TellTests(SynchronousTestCase):
    def test_up_and_down_on_change_never_unregistered(self) -> None:
        clock = Clock()
        subject = link(clock)
        feed = NodeFeed(clock)
        told: list[NodeEvent] = []
        feed.subscribe(told.append)
        subject.tell(feed)  # unregistered: nothing
        subject.registered = True
        subject.succeeded()
        subject.tell(feed)
        subject.tell(feed)  # no change
        subject.failed(RequestKind.HEARTBEAT, TRANSIENT, None, "")
        subject.tell(feed)
        subject.tell(None)  # no feed: nothing, no error
        self.assertEqual([e.type for e in told], [DISPATCHER_UP, DISPATCHER_DOWN])
