"""rolemesh.node.feed: the node's typed events, the delta buffer and the SSE client."""

from __future__ import annotations

import json
from typing import Any, List, Optional

import treq
from twisted.internet import defer
from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from rolemesh.node import feed as ne
from rolemesh.node.feed import DeltaBuffer, NodeEvent, NodeFeed, SSEClient, sse_frame
from tests.api.test_app import ApiTestCase
from tests.fixtures.fakes import make_config
from tests.node.test_node import MODELS, NodeHarness


class Recorder:
    def __init__(self, feed: NodeFeed) -> None:
        self.events: List[NodeEvent] = []
        feed.subscribe(self.events.append)

    def types(self, device: Optional[str] = "gpu:0") -> List[str]:
        return [e.type for e in self.events if device is None or e.device == device]


class FeedFromNodeTests(SynchronousTestCase):
    def started(self, **top: Any) -> NodeHarness:
        h = NodeHarness(**top)
        h.node.startService()
        self.addCleanup(lambda: h.node.running and h.node.stopService())
        return h

    def test_load_ready_unloaded_in_order_with_time_device_model(self) -> None:
        h = self.started(idle_unload_s=60)
        seen = Recorder(h.node.feed)
        h.reactor.advance(100)
        h.load("a")
        h.reactor.advance(60)
        h.reap()
        self.assertEqual([t for t in seen.types() if t != ne.LOAD_PROGRESS],
                         [ne.LOAD_STARTED, ne.READY, ne.UNLOADED])
        first = seen.events[0].to_json()
        self.assertEqual((first["device"], first["model"], first["state"]), ("gpu:0", "a", "starting"))
        self.assertEqual(first["time"], 100.0)
        self.assertEqual(seen.events[-1].to_json()["time"], 160.5)  # the load took one 0.5 s probe tick
        ids = [e.id for e in seen.events]
        self.assertEqual(ids, sorted(ids))

    def test_a_reload_that_replaces_the_running_command_says_so(self) -> None:
        h = self.started()
        seen = Recorder(h.node.feed)
        h.load("a")
        models = [dict(m) for m in MODELS]
        h.node.reconfigure(make_config([dict(models[0], roles=["other"]), *models[1:]]))  # same command
        self.assertNotIn(ne.SUPERSEDED, seen.types())
        h.node.reconfigure(make_config([dict(models[0], ctx_size=4096), *models[1:]]))
        (event,) = [e.to_json() for e in seen.events if e.type == ne.SUPERSEDED]
        self.assertEqual((event["device"], event["model"], event["state"]), ("gpu:0", "a", "ready"))

    def test_a_child_that_dies_loading_is_failed_with_its_diagnosis(self) -> None:
        h = self.started()
        seen = Recorder(h.node.feed)
        h.node.acquire(h.model("a")).addErrback(lambda f: None)
        h.child().output("error: failed to load model\n")
        h.child().exit(1)
        failed = [e for e in seen.events if e.type == ne.FAILED]
        self.assertEqual(len(failed), 1, seen.types())  # one failure, told once
        self.assertEqual(failed[0].fields["code"], h.sup().last_error_code)
        self.assertTrue(failed[0].fields["message"])

    def test_a_load_of_another_model_is_a_switch(self) -> None:
        h = self.started()
        h.load("a")
        seen = Recorder(h.node.feed)
        d = h.node.acquire(h.model("b"))
        h.reap()
        h.answer("b")
        self.successResultOf(d).release()
        switched = [e for e in seen.events if e.type == ne.SWITCHED]
        self.assertEqual([(e.model, e.fields["previous_model"]) for e in switched], [("b", "a")])

    def test_draining_is_told_once_for_the_node(self) -> None:
        h = self.started()
        seen = Recorder(h.node.feed)
        h.node.drain(1.0)
        self.assertEqual([(e.type, e.device) for e in seen.events], [(ne.DRAINING, None)])

    def test_an_issue_is_raised_then_cleared_by_the_periodic_check(self) -> None:
        h = self.started()
        h.load("a")
        seen = Recorder(h.node.feed)
        h.sup().last_error_code, h.sup().last_error = "unhealthy", "the probe failed"
        h.node.feed.check()
        h.node.feed.check()  # nothing new: nothing told
        h.sup().last_error_code = h.sup().last_error = None
        h.node.feed.check()
        self.assertEqual([(e.type, e.fields["code"]) for e in seen.events],
                         [(ne.ISSUE_RAISED, "unhealthy"), (ne.ISSUE_CLEARED, "unhealthy")])
        self.assertEqual(seen.events[0].fields["message"], "the probe failed")

    def test_queue_pressure_crosses_up_then_down_with_hysteresis(self) -> None:
        h = self.started(max_pending_requests_per_device=5)
        h.load("a")
        seen = Recorder(h.node.feed)
        held = []
        for _ in range(5):
            h.node.acquire(h.model("a")).addCallback(held.append)
        h.node.feed.check()  # one running, four queued: 0.8 of the limit
        self.assertEqual([(e.type, e.fields["level"]) for e in seen.events], [(ne.QUEUE_PRESSURE, "high")])
        while held:
            held.pop(0).release()
        self.assertEqual([e.fields["level"] for e in seen.events], ["high", "normal"])

    def test_load_progress_is_read_from_the_childs_output(self) -> None:
        h = self.started()
        seen = Recorder(h.node.feed)
        h.node.acquire(h.model("a")).addErrback(lambda f: None)
        h.child().output("load_tensors: loading model tensors\n")
        h.reactor.advance(ne.PROGRESS_POLL_S)
        progress = [e for e in seen.events if e.type == ne.LOAD_PROGRESS]
        self.assertEqual([e.fields["step"] for e in progress], ["loading_tensors"])
        h.reactor.advance(ne.PROGRESS_POLL_S)  # same step: not told again
        self.assertEqual(len([e for e in seen.events if e.type == ne.LOAD_PROGRESS]), 1)

    def test_an_observer_that_raises_does_not_stop_the_others(self) -> None:
        feed = NodeFeed(Clock())
        seen: List[NodeEvent] = []

        def broken(event: NodeEvent) -> None:
            raise RuntimeError("observer bug")

        feed.subscribe(broken)
        feed.subscribe(seen.append)
        feed.publish(ne.DRAINING)
        self.assertEqual(len(seen), 1)
        self.assertEqual(len(self.flushLoggedErrors(RuntimeError)), 1)


def event(type: str, device: Optional[str] = "gpu:0", **fields: Any) -> NodeEvent:
    return NodeEvent(type, 1.0, device, "a", 1, fields)


class DeltaBufferTests(SynchronousTestCase):
    def test_a_burst_keeps_the_newest_state_per_device(self) -> None:
        buffer = DeltaBuffer()
        for i in range(20):
            buffer.add(event(ne.LOAD_STARTED if i % 2 else ne.READY, f"gpu:{i % 2}", n=i))
        self.assertEqual(buffer.added, 20)
        taken = buffer.take()
        self.assertEqual([(e.device, e.fields["n"]) for e in taken], [("gpu:0", 18), ("gpu:1", 19)])
        self.assertEqual((len(buffer), buffer.added), (0, 0))

    def test_a_failure_keeps_its_diagnosis_past_the_unload_after_it(self) -> None:
        buffer = DeltaBuffer()
        buffer.add(event(ne.FAILED, state="stopped", code="child_crashed", message="signal 9"))
        buffer.add(event(ne.UNLOADED, state="stopped"))
        buffer.add(event(ne.LOAD_STARTED, state="starting"))
        self.assertEqual([e.type for e in buffer.take()], [ne.FAILED, ne.LOAD_STARTED])

    def test_issues_are_kept_per_code(self) -> None:
        buffer = DeltaBuffer()
        buffer.add(event(ne.ISSUE_RAISED, code="x"))
        buffer.add(event(ne.ISSUE_RAISED, code="y"))
        buffer.add(event(ne.ISSUE_CLEARED, code="x"))
        self.assertEqual([(e.type, e.fields["code"]) for e in buffer.take()],
                         [(ne.ISSUE_RAISED, "y"), (ne.ISSUE_CLEARED, "x")])

    def test_past_its_limit_the_oldest_go_and_it_says_so(self) -> None:
        buffer = DeltaBuffer(limit=3)
        for i in range(10):
            buffer.add(event(ne.READY, f"gpu:{i}"))
        self.assertEqual([e.device for e in buffer.take()], ["gpu:7", "gpu:8", "gpu:9"])
        self.assertTrue(buffer.overflowed)
        buffer.clear()
        self.assertFalse(buffer.overflowed)


class FakeTransport:
    def __init__(self) -> None:
        self.aborted = False

    def abortConnection(self) -> None:
        self.aborted = True


class FakeChannel:
    def __init__(self) -> None:
        self.transport = FakeTransport()


class FakeStreamRequest:
    def __init__(self) -> None:
        self.written: List[bytes] = []
        self.producer: Any = None
        self.channel = FakeChannel()
        self.finished: defer.Deferred = defer.Deferred()

    def write(self, data: bytes) -> None:
        self.written.append(data)

    def registerProducer(self, producer: Any, streaming: bool) -> None:
        assert streaming
        self.producer = producer

    def unregisterProducer(self) -> None:
        self.producer = None

    def notifyFinish(self) -> defer.Deferred:
        return self.finished


class SSEClientTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.clock = Clock()
        self.feed = NodeFeed(self.clock)
        self.request = FakeStreamRequest()

    def client(self, **kw: Any) -> SSEClient:
        return SSEClient(self.request, self.feed, self.clock, **kw)

    def test_each_event_is_one_data_line_of_json(self) -> None:
        self.client()
        self.feed.publish(ne.READY, "gpu:0", "a", state="ready")
        frame = self.request.written[0].decode()
        data = [line for line in frame.splitlines() if line.startswith("data: ")]
        self.assertEqual(len(data), 1)
        body = json.loads(data[0][len("data: "):])
        self.assertEqual({k: body[k] for k in ("type", "device", "model", "state")},
                         {"type": "ready", "device": "gpu:0", "model": "a", "state": "ready"})
        self.assertIn("time", body)
        self.assertTrue(frame.endswith("\n\n"))

    def test_a_quiet_stream_gets_keepalive_comments(self) -> None:
        self.client(keepalive_s=15)
        self.clock.advance(15)
        self.assertEqual(self.request.written, [ne.KEEPALIVE_FRAME])
        self.feed.publish(ne.READY, "gpu:0", "a")
        self.clock.advance(15)  # not quiet: no comment
        self.assertEqual(len(self.request.written), 2)

    def test_a_paused_reader_gets_its_backlog_on_resume(self) -> None:
        client = self.client()
        client.pauseProducing()
        self.feed.publish(ne.LOAD_STARTED, "gpu:0", "a")
        self.feed.publish(ne.READY, "gpu:0", "a")
        self.assertEqual(self.request.written, [])
        client.resumeProducing()
        self.assertEqual([json.loads(f.decode().split("data: ")[1])["type"] for f in self.request.written],
                         ["load_started", "ready"])

    def test_a_reader_that_does_not_read_is_cut_off_not_buffered(self) -> None:
        client = self.client(max_backlog=1000)
        client.pauseProducing()
        for _ in range(50):
            self.feed.publish(ne.READY, "gpu:0", "a", message="x" * 50)
        self.assertTrue(client.cut_off)
        self.assertTrue(self.request.channel.transport.aborted)
        self.assertEqual(len(self.feed), 0)  # unsubscribed: nothing more is kept for it
        self.assertIsNone(self.request.producer)

    def test_a_reader_that_leaves_is_unsubscribed(self) -> None:
        self.client()
        self.assertEqual(len(self.feed), 1)
        self.request.finished.callback(None)
        self.assertEqual(len(self.feed), 0)
        self.assertEqual(self.clock.getDelayedCalls(), [])

    def test_frame_has_id_and_event_name(self) -> None:
        frame = sse_frame(NodeEvent(ne.READY, 2.0, "gpu:0", "a", 7)).decode()
        self.assertTrue(frame.startswith("id: 7\nevent: ready\ndata: {"))


class EventsRouteTests(ApiTestCase):
    keys = ("k1",)

    def test_needs_the_key(self) -> None:
        self.assertError(self.h.call("GET", "/v1/node/events", key=None), 401, "invalid_api_key")

    def test_streams_the_nodes_events(self) -> None:
        d = self.h.send("GET", "/v1/node/events")
        self.h.treq.flush()
        response = self.successResultOf(d)
        self.assertEqual(response.code, 200)
        self.assertEqual(response.headers.getRawHeaders("content-type"), ["text/event-stream; charset=utf-8"])
        chunks: List[bytes] = []


        treq.collect(response, chunks.append)
        self.h.node.feed.publish(ne.READY, "gpu:0", "a", state="ready")
        self.h.treq.flush()
        body = b"".join(chunks).decode()
        self.assertIn('"type":"ready"', body)
