"""Unit tests of rolemesh.base.events: the one observer mechanism."""

from __future__ import annotations

from typing import Any, List, Tuple

from twisted.trial.unittest import SynchronousTestCase

from rolemesh.base.events import Events, Outbox


class EventsTests(SynchronousTestCase):
    def test_observers_are_told_in_order_with_the_fields(self) -> None:
        seen: List[Tuple[str, str, Any]] = []
        events = Events(lambda event, **fields: seen.append(("first", event, fields)))
        events.subscribe(lambda event, **fields: seen.append(("second", event, fields)))
        events.emit("load", device="gpu:0", seconds=1.5)
        self.assertEqual(seen, [("first", "load", {"device": "gpu:0", "seconds": 1.5}),
                                ("second", "load", {"device": "gpu:0", "seconds": 1.5})])

    def test_an_observer_that_raises_is_logged_and_the_others_are_still_told(self) -> None:
        seen: List[str] = []

        def broken(event: str, **fields: Any) -> None:
            raise RuntimeError("observer bug")

        events = Events(broken)
        events.subscribe(lambda event, **fields: seen.append(event))
        events.emit("crash")
        events.emit("restart")
        self.assertEqual(seen, ["crash", "restart"])
        self.assertEqual(len(self.flushLoggedErrors(RuntimeError)), 2)

    def test_unsubscribe_stops_the_observer_and_is_idempotent(self) -> None:
        seen: List[str] = []

        def observer(event: str, **fields: Any) -> None:
            seen.append(event)

        events = Events()
        unsubscribe = events.subscribe(observer)
        self.assertIn(observer, events)
        events.emit("a")
        unsubscribe()
        unsubscribe()
        events.emit("b")
        self.assertEqual(seen, ["a"])
        self.assertNotIn(observer, events)
        self.assertEqual(len(events), 0)

    def test_an_observer_may_unsubscribe_while_being_told(self) -> None:
        seen: List[str] = []
        events = Events()
        handle: List[Any] = []
        handle.append(events.subscribe(lambda event, **fields: (seen.append("once"), handle[0]())))
        events.subscribe(lambda event, **fields: seen.append("always"))
        events.emit("x")
        events.emit("y")
        self.assertEqual(seen, ["once", "always", "always"])


class OutboxTests(SynchronousTestCase):
    def test_actions_of_a_transition_run_when_the_outermost_one_ends_in_order(self) -> None:
        outbox = Outbox()
        ran: List[str] = []
        outbox.enter()
        outbox.later(lambda: ran.append("first"))
        outbox.enter()  # a nested transition
        outbox.later(lambda: ran.append("second"))
        outbox.leave()
        self.assertEqual(ran, [], "not while the outer transition runs")
        outbox.leave()
        self.assertEqual(ran, ["first", "second"])

    def test_outside_a_transition_an_action_runs_at_once(self) -> None:
        ran: List[str] = []
        Outbox().later(lambda: ran.append("now"))
        self.assertEqual(ran, ["now"])

    def test_what_an_action_sets_off_queues_behind_the_rest(self) -> None:
        outbox = Outbox()
        ran: List[str] = []

        def first() -> None:
            ran.append("first")
            outbox.enter()  # the action calls back into the state machine
            outbox.later(lambda: ran.append("set off by first"))
            outbox.leave()
            ran.append("first done")

        outbox.enter()
        outbox.later(first)
        outbox.later(lambda: ran.append("second"))
        outbox.leave()
        self.assertEqual(ran, ["first", "first done", "second", "set off by first"])

    def test_an_action_that_raises_leaves_the_rest_for_the_next_transition(self) -> None:
        outbox = Outbox()
        ran: List[str] = []
        outbox.enter()
        outbox.later(lambda: 1 / 0)  # type: ignore[func-returns-value]
        outbox.later(lambda: ran.append("kept"))
        self.assertRaises(ZeroDivisionError, outbox.leave)
        outbox.enter()
        outbox.leave()
        self.assertEqual(ran, ["kept"])
