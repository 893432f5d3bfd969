"""Deltas to the dispatcher (``POST /v1/nodes/events``): coalesced, numbered,
bounded, healed by the full heartbeat, and off for a dispatcher without the
route -- on a Clock, through StubTreq to :class:`tests.fixtures.fake_dispatcher.FakeDispatcher`."""

from __future__ import annotations

from typing import Any

import attr
from jsonschema import Draft202012Validator
from twisted.trial.unittest import SynchronousTestCase

from rolemesh.fleet.dispatcher import (
    MAX_ASKED_INTERVAL_S,
    MIN_ASKED_INTERVAL_S,
    REGISTERED,
    UNREACHABLE,
    asked_interval,
)
from rolemesh.node import feed as ne
from rolemesh.node.feed import NodeEvent, NodeFeed
from rolemesh.node.payloads import HEARTBEAT_SCHEMA_VERSION
from rolemesh.schemas import load_schema
from tests.fleet.test_dispatcher import INTERVAL, Harness

FULL = 30.0
SCHEMAS = {
    "register": Draft202012Validator(load_schema("registration")),
    "heartbeat": Draft202012Validator(load_schema("heartbeat")),
    "events": Draft202012Validator(load_schema("events")),
}


class EventsHarness(Harness):
    def __init__(self, **kwargs: Any) -> None:
        self.feed_events: list[NodeEvent] = []
        feed = NodeFeed()
        kwargs.setdefault("full_interval", FULL)
        super().__init__(feed=feed, **kwargs)
        feed._reactor = self.clock
        feed.subscribe(self.feed_events.append)
        self.feed = feed

    def change(self, device: str = "cpu:0", type: str = ne.READY, model: str = "qwen-7b", **fields: Any) -> None:
        fields.setdefault("state", "ready" if type == ne.READY else "starting")
        self.feed.publish(type, device, model, **fields)

    def deltas(self) -> list[dict[str, Any]]:
        """The events bodies with events in them (not the empty probes)."""
        return [r.body for r in self.fake.events if r.body["events"]]


class DeltaTests(SynchronousTestCase):
    def started(self, **kwargs: Any) -> EventsHarness:
        h = EventsHarness(**kwargs)
        h.start()
        self.addCleanup(h.stop)
        return h

    def assertAllValid(self, h: EventsHarness) -> None:
        """Every message the client sent validates against its schema."""
        for r in h.fake.received:
            if r.kind in SCHEMAS:
                errors = [e.message for e in SCHEMAS[r.kind].iter_errors(r.body)]
                self.assertEqual(errors, [], (r.kind, r.body))

    def test_after_registration_it_asks_and_sends_full_state_at_once(self) -> None:
        h = self.started()
        self.assertEqual([r.kind for r in h.fake.received][:1], ["register"])
        self.assertEqual(len(h.fake.heartbeats), 1)  # at once, not an interval later
        self.assertEqual([r.body["events"] for r in h.fake.events], [[]])  # the probe
        self.assertTrue(h.client.events_accepted)
        self.assertEqual(h.client.beat_interval, FULL)
        self.assertAllValid(h)

    def test_a_change_is_sent_within_the_window_with_a_seq(self) -> None:
        h = self.started()
        h.change()
        h.advance(0.25, step=0.05)
        [body] = h.deltas()
        self.assertEqual(body["seq"], 2)  # the probe was 1
        self.assertEqual([(e["type"], e["device"], e["state"]) for e in body["events"]],
                         [("ready", "cpu:0", "ready")])
        at = [r.at for r in h.fake.events if r.body["events"]][0]
        self.assertLessEqual(at, 0.25)
        self.assertAllValid(h)

    def test_a_burst_of_twenty_changes_is_one_message_newest_state_winning(self) -> None:
        h = self.started()
        for i in range(20):
            h.change(f"cpu:{i % 4}", ne.LOAD_STARTED if i < 16 else ne.READY)
        h.advance(1.0, step=0.05)
        bodies = h.deltas()
        self.assertEqual(len(bodies), 1)
        self.assertEqual(sorted((e["device"], e["type"]) for e in bodies[0]["events"]),
                         [(f"cpu:{i}", "ready") for i in range(4)])

    def test_the_full_heartbeat_carries_last_seq_and_comes_at_the_long_interval(self) -> None:
        h = self.started()
        h.change()
        h.advance(0.5, step=0.05)
        h.advance(FULL)
        beats = h.fake.heartbeats
        self.assertEqual(len(beats), 2)
        self.assertEqual(beats[-1].body["last_seq"], 2)
        self.assertEqual(beats[-1].body["schema_version"], 3)
        self.assertAlmostEqual(beats[-1].at - beats[0].at, FULL, delta=0.3)
        self.assertAllValid(h)

    def test_a_dispatcher_of_the_old_protocol_gets_todays_heartbeats(self) -> None:
        h = EventsHarness()
        h.fake.events_route = False
        h.start()
        self.addCleanup(h.stop)
        h.change()
        h.advance(3 * INTERVAL)
        self.assertFalse(h.client.events_accepted)
        self.assertEqual(len(h.fake.events), 1)  # the probe, answered 404; nothing after
        beats = h.fake.heartbeats
        self.assertEqual(len(beats), 4)
        gaps = [b.at - a.at for a, b in zip(beats[1:-1], beats[2:])]  # noqa: RUF007
        self.assertEqual(gaps, [INTERVAL, INTERVAL])
        for beat in beats:
            self.assertNotIn("last_seq", beat.body)
            self.assertEqual(beat.body["schema_version"], HEARTBEAT_SCHEMA_VERSION)
        self.assertAllValid(h)

    def test_a_registration_answer_may_say_no_events(self) -> None:
        h = EventsHarness()
        original = h.fake._answer

        def answer(request: Any, code: int, body: Any) -> bytes:
            if request.path.endswith(b"/register") and code == 200:
                body = dict(body, events=False)
            return original(request, code, body)

        h.fake._answer = answer  # type: ignore[method-assign]
        h.start()
        self.addCleanup(h.stop)
        h.change()
        h.advance(1)
        self.assertEqual(h.fake.events, [])
        self.assertFalse(h.client.events_accepted)

    def test_a_slow_dispatcher_does_not_make_it_queue_without_bound(self) -> None:
        h = self.started()
        h.fake.hang = True
        h.change()
        h.advance(0.3, step=0.05)  # this delta hangs
        for i in range(10_000):
            h.change(f"cpu:{i % 8}", ne.LOAD_STARTED if i % 2 else ne.READY)
        self.assertLessEqual(len(h.client.deltas.buffer), 8)
        h.fake.release()
        h.fake.hang = False
        h.advance(h.client.request_timeout + 1, step=0.05)
        self.assertLessEqual(len(h.deltas()), 3)

    def test_a_lost_delta_is_healed_by_the_next_full_heartbeat(self) -> None:
        h = self.started()
        h.fake.drop_events = True
        h.change(type=ne.LOAD_STARTED)
        h.advance(0.5, step=0.05)
        h.fake.drop_events = False
        self.assertEqual(h.fake.view["node-a"]["cpu:0"]["state"], "ready")  # from the first heartbeat
        h.advance(FULL)
        self.assertIn("node-a", h.fake.missed)  # its last_seq named the body it never got
        self.assertEqual(h.client.state, REGISTERED)

    def test_the_dispatcher_may_ask_for_another_interval_within_bounds(self) -> None:
        h = self.started()
        h.fake.ask_interval = 12
        h.advance(FULL)
        h.advance(3 * 12)
        beats = h.fake.heartbeats
        self.assertEqual(beats[-1].at - beats[-2].at, 12)
        self.assertEqual(asked_interval('{"heartbeat_interval_s": 0.001}'), MIN_ASKED_INTERVAL_S)
        self.assertEqual(asked_interval('{"heartbeat_interval_s": 1e9}'), MAX_ASKED_INTERVAL_S)
        self.assertIsNone(asked_interval('{"heartbeat_interval_s": "fast"}'))
        self.assertIsNone(asked_interval("not json"))

    def test_events_for_a_node_it_forgot_make_it_register_again(self) -> None:
        h = self.started()
        h.fake.forget()
        beats = len(h.fake.heartbeats)
        h.change()
        h.advance(1, step=0.05)
        self.assertEqual(len(h.fake.registrations), 2)
        self.assertEqual(h.client.state, REGISTERED)
        self.assertEqual(len(h.fake.heartbeats), beats + 1)  # the restarted dispatcher has full state at once

    def test_dispatcher_up_and_down_are_node_events(self) -> None:
        h = self.started()
        h.fake.refuse = True
        h.advance(FULL + 1)
        h.fake.refuse = False
        h.advance(INTERVAL * 2)
        told = [(e.type, e.fields["state"]) for e in h.feed_events if e.type.startswith("dispatcher_")]
        self.assertEqual(told, [(ne.DISPATCHER_UP, REGISTERED), (ne.DISPATCHER_DOWN, UNREACHABLE),
                                (ne.DISPATCHER_UP, REGISTERED)])
        self.assertFalse([e for r in h.fake.events for e in r.body["events"] if e["type"].startswith("dispatcher")])

    def test_stop_leaves_nothing_on_the_clock(self) -> None:
        h = self.started()
        h.change()
        self.successResultOf(h.client.stopService())
        h.stub.flush()
        self.assertEqual(h.clock.getDelayedCalls(), [])
        self.assertEqual(len(h.feed), 1)  # only this harness's recorder


class EveryEventValidatesTests(SynchronousTestCase):
    def test_each_event_a_real_node_publishes_fits_the_events_schema(self) -> None:
        """Load, progress, ready, switch, unload, failure, issues, queue
        pressure, a reload's superseded command and drain from a real Node
        on fakes, sent as the client sends them."""
        from rolemesh.node.payloads import events_payload
        from tests.node.test_node import NodeHarness

        h = NodeHarness(max_pending_requests_per_device=5, idle_unload_s=60)
        h.node.startService()
        self.addCleanup(lambda: h.node.running and h.node.stopService())
        seen: list[NodeEvent] = []
        h.node.feed.subscribe(seen.append)
        h.load("a")
        d = h.node.acquire(h.model("b"))
        h.reap()
        h.child().output("load_tensors: loading model tensors\n")
        h.reactor.advance(ne.PROGRESS_POLL_S)
        h.answer("b")
        self.successResultOf(d).release()
        held: list[Any] = []
        for _ in range(5):
            h.node.acquire(h.model("b")).addCallback(held.append)
        h.node.feed.check()
        while held:
            held.pop(0).release()
        h.sup().last_error_code, h.sup().last_error = "unhealthy", "the probe failed"
        h.node.feed.check()
        h.sup().last_error_code = h.sup().last_error = None
        h.node.feed.check()
        h.node.reconfigure(attr.evolve(h.config, models=tuple(
            attr.evolve(m, ctx_size=4096) if m.model_id == "b" else m for m in h.config.models)))  # superseded
        h.node.reconfigure(h.config)  # and back
        h.child().exit(1)  # a crash
        h.node.acquire(h.model("a")).addErrback(lambda f: None)
        h.child().exit(1)  # a failed load
        h.node.drain(1.0)
        types = {e.type for e in seen}
        self.assertEqual(set(ne.ROUTING_TYPES) - types, set())
        body = events_payload("node-a", 7, 1.0, [e.to_json() for e in seen if e.type in ne.ROUTING_TYPES])
        errors = [f"{list(e.path)}: {e.message}" for e in SCHEMAS["events"].iter_errors(body)]
        self.assertEqual(errors, [])
