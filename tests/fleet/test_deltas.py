"""The deltas to the dispatcher (rolemesh.fleet.deltas) alone: a fake
host and POST, a real DispatcherLink and NodeFeed, on a Clock."""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from rolemesh.base.backoff import Backoff
from rolemesh.fleet.deltas import DeltaSender
from rolemesh.fleet.link import DispatcherLink
from rolemesh.fleet.protocol import EVENTS_PATH, RequestKind
from rolemesh.node import feed as ne
from rolemesh.node.feed import DeltaBuffer, NodeFeed

COALESCE = 0.2


class FakeHost:
    """The dispatcher client, as the deltas see it."""

    def __init__(self) -> None:
        self.running = True
        self.interval = 5.0
        self.soon: List[float] = []
        self.reports: List[Tuple[str, bool]] = []
        self.bodies: List[str] = []

    @property
    def beat_interval(self) -> float:
        return 30.0

    def beat_soon(self, within: float) -> None:
        self.soon.append(within)

    def report(self, kind: RequestKind, ok: bool) -> None:
        self.reports.append((str(kind), ok))

    def take_interval(self, body: str) -> None:
        self.bodies.append(body)


class Harness:
    def __init__(self, answer: Tuple[Optional[int], str, str] = (204, "", "")) -> None:
        self.clock = Clock()
        self.host = FakeHost()
        self.link = DispatcherLink("http://d.test", self.clock, Backoff(1.0, 5.0), 60.0)
        self.link.node_id = "node-a"
        self.link.registered = True
        self.feed = NodeFeed(self.clock)
        self.answer = answer
        self.sent: List[Tuple[str, Dict[str, Any], float]] = []
        self.deltas = DeltaSender(self.host, self.link, self.post, self.clock, self.feed, COALESCE, 5.0)
        self.deltas.start()

    async def post(self, path: str, payload: Dict[str, Any], timeout: float) -> Tuple[Optional[int], str, str]:
        self.sent.append((path, payload, timeout))
        return self.answer

    def change(self, device: str = "cpu:0", model: str = "m") -> None:
        self.feed.publish(ne.READY, device, model, state="ready")

    def events(self) -> List[List[Dict[str, Any]]]:
        return [payload["events"] for _, payload, _ in self.sent]


class RegistrationTests(SynchronousTestCase):
    def test_an_answer_that_says_events_needs_no_probe(self) -> None:
        h = Harness()
        h.deltas.registered('{"events": true}')
        self.assertEqual((h.deltas.events_accepted, h.sent), (True, []))
        self.assertEqual(h.host.bodies, ['{"events": true}'], "its heartbeat interval is learnt too")

    def test_otherwise_an_empty_events_body_asks(self) -> None:
        h = Harness()
        h.deltas.registered("{}")
        [(path, payload, timeout)] = h.sent
        self.assertEqual((path, payload["seq"], payload["events"], payload["node_id"], timeout),
                         (EVENTS_PATH, 1, [], "node-a", 5.0))
        self.assertTrue(h.deltas.events_accepted)
        self.assertEqual(h.host.reports, [("events", True)])
        self.assertEqual(h.link.last_success, 0.0)

    def test_a_dispatcher_without_the_route_gets_heartbeats_only(self) -> None:
        h = Harness(answer=(404, "", ""))
        h.deltas.registered("")
        self.assertIs(h.deltas.events_accepted, False)
        self.assertEqual(h.host.soon, [5.0], "the next heartbeat within the short interval")
        h.change()
        h.clock.advance(1)
        self.assertEqual(len(h.sent), 1, "only the probe")


class DeltaTests(SynchronousTestCase):
    def accepted(self, **kwargs: Any) -> Harness:
        h = Harness(**kwargs)
        h.deltas.registered('{"events": true}')
        return h

    def test_a_burst_is_one_message_after_the_window(self) -> None:
        h = self.accepted()
        for model in ("a", "b", "c"):
            h.change(model=model)
        h.change(device="cpu:1")
        h.clock.advance(COALESCE - 0.01)
        self.assertEqual(h.sent, [])
        h.clock.advance(0.01)
        [events] = h.events()
        self.assertEqual([(e["device"], e["model"]) for e in events], [("cpu:0", "c"), ("cpu:1", "m")])
        self.assertEqual(h.deltas.events_seq, 1)

    def test_nothing_is_held_while_not_registered_or_not_taken(self) -> None:
        h = self.accepted()
        h.link.registered = False
        h.change()
        h.clock.advance(1)
        self.assertEqual((h.sent, len(h.deltas.buffer)), ([], 0))

    def test_routing_types_only(self) -> None:
        h = self.accepted()
        h.feed.publish(ne.DISPATCHER_DOWN, None, None, dispatcher="x", state="unreachable")
        h.clock.advance(1)
        self.assertEqual(h.sent, [])

    def test_more_changes_than_kept_ask_for_the_full_state(self) -> None:
        h = self.accepted()
        h.deltas.buffer = DeltaBuffer(limit=2)
        for device in ("cpu:0", "cpu:1", "cpu:2"):
            h.change(device=device)
        h.clock.advance(COALESCE)
        self.assertEqual((h.sent, h.host.soon), ([], [0]))

    def test_a_node_the_dispatcher_forgot_registers_again(self) -> None:
        h = self.accepted(answer=(410, "", ""))
        h.change()
        h.clock.advance(COALESCE)
        self.assertEqual((h.link.registered, h.host.soon, h.deltas.events_failed), (False, [0], 1))

    def test_a_failed_delta_is_dropped_not_queued(self) -> None:
        h = self.accepted(answer=(None, "no answer within 5s", ""))
        h.change()
        h.clock.advance(COALESCE)
        self.assertEqual((len(h.sent), h.deltas.events_failed, h.deltas.events_accepted), (1, 1, True))
        h.clock.advance(10)
        self.assertEqual(len(h.sent), 1)

    def test_the_full_state_supersedes_what_waits_and_says_the_last_seq(self) -> None:
        h = self.accepted()
        h.change()
        h.clock.advance(COALESCE)
        h.change(device="cpu:1")
        body = h.deltas.full_state({"node_id": "node-a"})
        self.assertEqual(body["last_seq"], 1)
        self.assertEqual(len(h.deltas.buffer), 0)

    def test_the_full_state_is_unchanged_while_events_are_not_taken(self) -> None:
        h = Harness()
        self.assertEqual(h.deltas.full_state({"node_id": "node-a"}), {"node_id": "node-a"})

    def test_stop_leaves_nothing_behind(self) -> None:
        h = self.accepted()
        h.change()
        h.deltas.stop()
        h.change()
        self.assertEqual((h.clock.getDelayedCalls(), len(h.deltas.buffer)), ([], 0))
        h.clock.advance(1)
        self.assertEqual(h.sent, [])
