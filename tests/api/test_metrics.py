"""Unit tests of ``rolemesh.api.metrics`` (a real Node and real supervisors on a
fake reactor, a fake backend) and of the log observers in ``rolemesh.base.logs``."""

from __future__ import annotations

import io
import json
import os
import re
from types import SimpleNamespace
from typing import Any, Dict, List, Optional

from hypothesis import given
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families
from twisted.logger import Logger, LogLevel
from twisted.trial.unittest import SynchronousTestCase

from rolemesh.api.metrics import ENDPOINTS, NodeMetrics
from rolemesh.base import errors
from rolemesh.base.logs import make_observer
from tests.fixtures import REPO
from tests.fixtures.fakes import make_config
from tests.node.test_node import NodeHarness

ROOT = REPO
METRICS_DOC = os.path.join(ROOT, "docs", "operations", "metrics.md")
OPERATIONS_DIR = os.path.join(ROOT, "docs", "operations")
GiB = 1 << 30


class Harness:
    """A Node with ``count`` fake devices, real supervisors, and NodeMetrics."""

    def __init__(self, count: int = 2, dispatcher: Any = None, **top: Any) -> None:
        top.setdefault("max_pending_requests_per_device", 2)
        nodes = NodeHarness([{"model_id": "a", "roles": ["chat"]}, {"model_id": "b", "alias": "bee"}],
                            devices=count, **top)
        self.config, self.reactor, self.probe = nodes.config, nodes.reactor, nodes.probe
        self.signals, self.backend, self.supervisors = nodes.signals, nodes.backend, nodes.supervisors
        self.node = nodes.node
        self.root = SimpleNamespace(dispatcher=dispatcher)
        self.metrics = NodeMetrics(self.node, self.root)
        self.node.startService()

    def ready(self, *served: str) -> None:
        self.probe.ready = set(served)
        self.reactor.advance(0.5)

    def scrape(self) -> Dict[str, Any]:
        """Family name -> family, from the rendered text."""
        text = self.metrics.render().decode("utf-8")
        return {f.name: f for f in text_string_to_metric_families(text)}


def value(families: Dict[str, Any], sample_name: str, **labels: str) -> Optional[float]:
    """The value of the one sample with that name and exactly those labels (None if absent)."""
    found = [s.value for f in families.values() for s in f.samples if s.name == sample_name and s.labels == labels]
    assert len(found) <= 1, (sample_name, labels, found)
    return found[0] if found else None


def samples(families: Dict[str, Any], sample_name: str) -> List[Any]:
    return [s for f in families.values() for s in f.samples if s.name == sample_name]


_ODD = st.sampled_from([None, "", 3, True, [1], "/v1/evil?x=1"])
_SECONDS = st.one_of(st.floats(min_value=-1, max_value=700),
                     st.sampled_from([None, float("nan"), float("inf"), 2, "1"]))
#: ``request`` and ``queue_wait`` events, good and bad, as the API and the node send them.
REQUEST_EVENTS = st.one_of(
    st.fixed_dictionaries({
        "event": st.just("request"),
        "endpoint": st.one_of(st.sampled_from(list(ENDPOINTS) + ["/v1/completions", "v1/embeddings"]), _ODD),
        "model": st.one_of(st.sampled_from(["a", "b", "bee", "zzz"]), _ODD),
        "status": st.one_of(st.sampled_from([200, 400, 429, 499, 502, 504, 99, 600]), _ODD),
        "duration": _SECONDS,
        "ttfb": _SECONDS,
    }),
    st.fixed_dictionaries({
        "event": st.just("queue_wait"),
        "device": st.one_of(st.sampled_from(["gpu:0", "gpu:1", "gpu:9"]), _ODD),
        "seconds": _SECONDS,
    }),
)
_PER_REQUEST = re.compile(
    r"^(# (HELP|TYPE) )?(rolemesh_requests|rolemesh_request_duration_seconds|rolemesh_request_ttfb_seconds"
    r"|rolemesh_queue_wait_seconds)(_[a-z]+)?[ {]")


def _request_lines(text: bytes) -> List[str]:
    """The per-request families' lines of a scrape, ``_created`` values blanked."""
    lines = [line for line in text.decode("utf-8").splitlines() if _PER_REQUEST.match(line)]
    return [re.sub(r"^(\w+_created(\{.*\})?) .*$", r"\1 <created>", line) for line in lines]


def _prometheus_client_render(h: Harness, events: List[Dict[str, Any]]) -> bytes:
    """What the per-request families rendered as prometheus_client's own
    Counter and Histograms (how rolemesh.api.metrics kept them before), fed the
    same events."""
    from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

    from rolemesh.api.metrics import QUEUE_WAIT_BUCKETS, REQUEST_BUCKETS, TTFB_BUCKETS
    from rolemesh.children.telemetry import finite_number

    registry = CollectorRegistry(auto_describe=False)
    requests = Counter("rolemesh_requests",
                       "Proxied requests by model, endpoint and HTTP status (499: client went away).",
                       ["model", "endpoint", "status"], registry=registry)
    duration = Histogram("rolemesh_request_duration_seconds", "Proxied request latency, arrival to last byte.",
                         ["model", "endpoint"], buckets=REQUEST_BUCKETS, registry=registry)
    ttfb = Histogram("rolemesh_request_ttfb_seconds",
                     "Proxied request time to first byte from llama-server (queueing and model load included).",
                     ["model", "endpoint"], buckets=TTFB_BUCKETS, registry=registry)
    wait = Histogram("rolemesh_queue_wait_seconds",
                     "Seconds a request waited in its device's queue before it could run (model load not included).",
                     ["device"], buckets=QUEUE_WAIT_BUCKETS, registry=registry)
    m = h.metrics
    for device in h.node.supervisors:
        wait.labels(device=device)
    for fields in events:
        if fields["event"] == "queue_wait":
            device, seconds = fields["device"], finite_number(fields["seconds"])
            if isinstance(device, str) and device in h.node.supervisors and seconds is not None:
                wait.labels(device=device).observe(max(0.0, seconds))
            continue
        labels = dict(model=m._model(fields["model"]), endpoint=m._endpoint(fields["endpoint"]))
        requests.labels(status=m._status(fields["status"]), **labels).inc()
        for histogram, key in ((duration, "duration"), (ttfb, "ttfb")):
            seconds = finite_number(fields[key])
            if seconds is not None and seconds >= 0:
                histogram.labels(**labels).observe(seconds)
    return generate_latest(registry)


class FormatTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.h = Harness()

    def test_output_parses_and_names_are_prefixed(self) -> None:
        families = self.h.scrape()
        self.assertTrue(families)
        for name in families:
            self.assertTrue(name.startswith("rolemesh_"), name)
        for expected in (
            "rolemesh_requests",
            "rolemesh_request_duration_seconds",
            "rolemesh_request_ttfb_seconds",
            "rolemesh_queue_full",
            "rolemesh_model_loads",
            "rolemesh_model_load_duration_seconds",
            "rolemesh_model_load_failures",
            "rolemesh_model_load_timeouts",
            "rolemesh_child_crashes",
            "rolemesh_child_restarts",
            "rolemesh_child_state",
            "rolemesh_device_in_flight",
            "rolemesh_device_queue_depth",
            "rolemesh_device_memory_total_bytes",
            "rolemesh_device_metrics_sample_age_seconds",
            "rolemesh_device_metrics_stale",
        ):
            self.assertIn(expected, families)
        self.assertEqual(families["rolemesh_model_loads"].type, "counter")
        self.assertEqual(families["rolemesh_model_load_duration_seconds"].type, "histogram")
        self.assertEqual(families["rolemesh_child_state"].type, "gauge")

    def test_render_returns_bytes_from_its_own_registry(self) -> None:
        from prometheus_client import REGISTRY

        self.assertIsInstance(self.h.metrics.render(), bytes)
        self.assertIsNot(self.h.metrics.registry, REGISTRY)
        self.assertIsNone(
            REGISTRY.get_sample_value(
                "rolemesh_requests_total", {"model": "a", "endpoint": "completions", "status": "200"}
            )
        )
        # Two agents in one process do not collide.
        other = Harness()
        other.metrics.observe("request", endpoint="completions", model="a", status=200, duration=0.1)
        self.assertIsNone(
            value(self.h.scrape(), "rolemesh_requests_total", model="a", endpoint="completions", status="200")
        )

    def test_hooks_itself_into_node_and_supervisors(self) -> None:
        self.assertIn(self.h.metrics.observe, self.h.node.events)
        for supervisor in self.h.supervisors:
            self.assertIn(self.h.metrics.observe, supervisor.events)

    def test_node_info_and_draining(self) -> None:
        families = self.h.scrape()
        self.assertEqual(
            value(
                families,
                "rolemesh_node_info",
                node_id="test-node",
                backend="fake",
                version=__import__("rolemesh").__version__,
            ),
            1.0,
        )
        self.assertEqual(value(families, "rolemesh_node_draining"), 0.0)
        self.h.node.drain(1.0)
        self.assertEqual(value(self.h.scrape(), "rolemesh_node_draining"), 1.0)


class RequestTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.h = Harness()
        self.m = self.h.metrics

    def test_counters_move_by_status_including_429_and_503(self) -> None:
        self.m.observe("request", endpoint="chat/completions", model="a", status=200, duration=1.5, ttfb=0.2)
        self.m.observe("request", endpoint="chat/completions", model="a", status=200, duration=0.7, ttfb=0.1)
        self.m.observe("request", endpoint="chat/completions", model="a", status=429, duration=0.001, ttfb=None)
        self.m.observe("request", endpoint="embeddings", model="b", status=503, duration=10.0, ttfb=None)
        families = self.h.scrape()
        total = "rolemesh_requests_total"
        self.assertEqual(value(families, total, model="a", endpoint="chat/completions", status="200"), 2)
        self.assertEqual(value(families, total, model="a", endpoint="chat/completions", status="429"), 1)
        self.assertEqual(value(families, total, model="b", endpoint="embeddings", status="503"), 1)
        self.assertIsNone(value(families, total, model="b", endpoint="embeddings", status="200"))

        latency = dict(model="a", endpoint="chat/completions")
        self.assertEqual(value(families, "rolemesh_request_duration_seconds_count", **latency), 3)
        self.assertAlmostEqual(value(families, "rolemesh_request_duration_seconds_sum", **latency), 2.201)
        self.assertEqual(value(families, "rolemesh_request_duration_seconds_bucket", le="1.0", **latency), 2)
        # ttfb only for requests that got a first byte
        self.assertEqual(value(families, "rolemesh_request_ttfb_seconds_count", **latency), 2)
        self.assertAlmostEqual(value(families, "rolemesh_request_ttfb_seconds_sum", **latency), 0.3)
        self.assertIsNone(value(families, "rolemesh_request_ttfb_seconds_count", model="b", endpoint="embeddings"))

    def test_unknown_model_endpoint_and_status_are_bounded(self) -> None:
        self.m.observe("request", endpoint="chat/completions", model=None, status=404, duration=0.01, ttfb=None)
        self.m.observe("request", endpoint="chat/completions", model="../../etc/passwd\n", status=404, duration=0.01)
        self.m.observe("request", endpoint="/v1/evil?x=1", model="x" * 300, status="200", duration="slow")
        self.m.observe("request", endpoint="completions", model="a", status=99999, duration=-1.0, ttfb=float("nan"))
        self.m.observe("queue_full", model="made-up-by-a-client")
        families = self.h.scrape()
        total = "rolemesh_requests_total"
        self.assertEqual(value(families, total, model="unknown", endpoint="chat/completions", status="404"), 2)
        self.assertEqual(value(families, total, model="unknown", endpoint="unknown", status="unknown"), 1)
        self.assertEqual(value(families, total, model="a", endpoint="completions", status="unknown"), 1)
        self.assertEqual(value(families, "rolemesh_queue_full_total", model="unknown"), 1)
        allowed_models = {"a", "b", "unknown"}
        for family in families.values():
            for sample in family.samples:
                if "model" in sample.labels:
                    self.assertIn(sample.labels["model"], allowed_models)
                if "endpoint" in sample.labels:
                    self.assertIn(sample.labels["endpoint"], set(ENDPOINTS) | {"unknown"})
                if "status" in sample.labels:
                    self.assertRegex(sample.labels["status"], r"^([1-5]\d\d|unknown)$")
        # an invalid duration is not observed
        self.assertIsNone(
            value(families, "rolemesh_request_duration_seconds_count", model="unknown", endpoint="unknown")
        )
        self.assertIsNone(value(families, "rolemesh_request_ttfb_seconds_count", model="a", endpoint="completions"))

    def test_alias_endpoint_forms_are_normalised(self) -> None:
        self.m.observe("request", endpoint="/v1/completions", model="a", status=200, duration=0.1)
        self.assertEqual(
            value(self.h.scrape(), "rolemesh_requests_total", model="a", endpoint="completions", status="200"), 1
        )

    def test_unknown_events_are_ignored(self) -> None:
        self.m.observe("something_new", device="gpu:0", model="a")
        self.m.observe("child_state", device="gpu:0", state="ready", model="a")
        self.h.scrape()

    def test_observer_errors_are_caught_and_logged(self) -> None:
        class Broken:
            def inc(self, labels: Any) -> None:
                raise RuntimeError("metrics bug")

        self.m.requests = Broken()  # type: ignore[assignment]
        self.m.observe("request", endpoint="completions", model="a", status=200, duration=0.1)
        self.m.observe("queue_full", model="a")  # other metrics still work
        self.assertEqual(len(self.flushLoggedErrors(RuntimeError)), 1)
        self.assertEqual(value(self.h.scrape(), "rolemesh_queue_full_total", model="a"), 1)

    @given(st.lists(REQUEST_EVENTS, max_size=25))
    def test_per_request_families_render_as_prometheus_client_would(self, events: List[Dict[str, Any]]) -> None:
        """The per-request families are plain numbers read at scrape time;
        their text is prometheus_client's Counter and Histogram's, line for
        line (``_created`` times aside), whatever the events."""
        h = Harness()
        for fields in events:
            h.metrics.observe(fields["event"], **{k: v for k, v in fields.items() if k != "event"})
        self.assertEqual(_request_lines(h.metrics.render()), _request_lines(_prometheus_client_render(h, events)))

    def test_supervisor_listener_errors_are_caught_and_logged(self) -> None:
        class Broken:
            def observe(self, *_: Any) -> None:
                raise RuntimeError("histogram bug")

        self.m.load_duration = Broken()  # type: ignore[assignment]
        d = self.h.node.acquire(self.h.config.model("a"))
        self.h.ready("a")
        self.successResultOf(d).release()  # the request path is unaffected
        self.assertEqual(len(self.flushLoggedErrors(RuntimeError)), 1)
        self.assertEqual(value(self.h.scrape(), "rolemesh_model_loads_total", device="gpu:0", model="a"), 1)

    def test_a_broken_collector_part_does_not_break_the_scrape(self) -> None:
        self.h.node.scheduler = None  # type: ignore[assignment]
        families = self.h.scrape()
        self.assertNotIn("rolemesh_device_in_flight", families)
        self.assertIn("rolemesh_child_state", families)
        self.assertIn("rolemesh_device_memory_total_bytes", families)
        self.assertEqual(len(self.flushLoggedErrors(AttributeError)), 1)


class NodeEventTests(SynchronousTestCase):
    """Metrics driven by the real node and supervisors."""

    def test_queue_depth_in_flight_and_queue_full(self) -> None:
        h = Harness(count=1, max_pending_requests_per_device=2)
        a = h.config.model("a")
        families = h.scrape()
        self.assertEqual(value(families, "rolemesh_device_in_flight", device="gpu:0"), 0)
        self.assertEqual(value(families, "rolemesh_device_queue_depth", device="gpu:0"), 0)
        self.assertEqual(value(families, "rolemesh_device_pending_limit", device="gpu:0"), 2)
        self.assertEqual(value(families, "rolemesh_queue_full_total", model="a"), 0)
        first = h.node.acquire(a)
        second = h.node.acquire(a)
        third = h.node.acquire(a)
        self.assertEqual(self.failureResultOf(third, errors.ApiError).value.status, 429)
        families = h.scrape()
        self.assertEqual(value(families, "rolemesh_device_in_flight", device="gpu:0"), 1)
        self.assertEqual(value(families, "rolemesh_device_queue_depth", device="gpu:0"), 1)
        self.assertEqual(value(families, "rolemesh_queue_full_total", model="a"), 1)
        self.assertEqual(value(families, "rolemesh_queue_full_total", model="b"), 0)
        h.ready("a")
        self.successResultOf(first).release()
        self.successResultOf(second).release()
        families = h.scrape()
        self.assertEqual(value(families, "rolemesh_device_in_flight", device="gpu:0"), 0)
        self.assertEqual(value(families, "rolemesh_device_queue_depth", device="gpu:0"), 0)

    def test_a_child_of_a_command_a_reload_replaced_is_stale(self) -> None:
        h = Harness()
        d = h.node.acquire(h.config.model("a"), device="gpu:0")
        h.ready("a")
        lease = self.successResultOf(d)
        self.assertEqual(value(h.scrape(), "rolemesh_child_stale", device="gpu:0"), 0)
        h.node.reconfigure(make_config([{"model_id": "a", "roles": ["chat"], "ctx_size": 1024},
                                        {"model_id": "b", "alias": "bee"}], max_pending_requests_per_device=2))
        families = h.scrape()
        self.assertEqual((value(families, "rolemesh_child_stale", device="gpu:0"),
                          value(families, "rolemesh_child_stale", device="gpu:1")), (1, 0))
        lease.release()

    def test_a_removed_model_still_serving_shows_on_its_device(self) -> None:
        h = Harness()
        d = h.node.acquire(h.config.model("b"), device="gpu:0")
        h.ready("bee")
        lease = self.successResultOf(d)
        h.node.reconfigure(make_config([{"model_id": "a", "roles": ["chat"]}], max_pending_requests_per_device=2))
        families = h.scrape()
        self.assertEqual(value(families, "rolemesh_child_model", device="gpu:0", model="b"), 1)
        self.assertEqual(value(families, "rolemesh_child_model", device="gpu:1", model="b"), None)
        lease.release()

    def test_load_counted_with_duration_and_child_state(self) -> None:
        h = Harness()
        families = h.scrape()
        self.assertEqual(value(families, "rolemesh_child_state", device="gpu:0", state="stopped"), 1)
        self.assertEqual(value(families, "rolemesh_model_loads_total", device="gpu:0", model="a"), 0)
        d = h.node.acquire(h.config.model("a"), device="gpu:0")
        families = h.scrape()
        self.assertEqual(value(families, "rolemesh_child_state", device="gpu:0", state="starting"), 1)
        self.assertEqual(value(families, "rolemesh_child_state", device="gpu:0", state="stopped"), 0)
        self.assertEqual(value(families, "rolemesh_child_model", device="gpu:0", model="a"), 1)
        h.reactor.advance(0.5)  # not ready yet
        h.ready("a")
        self.successResultOf(d).release()
        families = h.scrape()
        self.assertEqual(value(families, "rolemesh_child_state", device="gpu:0", state="ready"), 1)
        self.assertEqual(value(families, "rolemesh_child_state", device="gpu:1", state="stopped"), 1)
        self.assertEqual(value(families, "rolemesh_child_model", device="gpu:0", model="a"), 1)
        self.assertEqual(value(families, "rolemesh_child_model", device="gpu:0", model="b"), 0)
        self.assertEqual(value(families, "rolemesh_model_loads_total", device="gpu:0", model="a"), 1)
        self.assertEqual(value(families, "rolemesh_model_loads_total", device="gpu:1", model="a"), 0)
        labels = dict(device="gpu:0", model="a")
        self.assertEqual(value(families, "rolemesh_model_load_duration_seconds_count", **labels), 1)
        self.assertAlmostEqual(value(families, "rolemesh_model_load_duration_seconds_sum", **labels), 1.0)
        self.assertEqual(value(families, "rolemesh_model_load_duration_seconds_bucket", le="1.0", **labels), 1)
        self.assertEqual(value(families, "rolemesh_model_load_duration_seconds_bucket", le="0.5", **labels), 0)
        # scraping again does not count the load twice
        self.assertEqual(value(h.scrape(), "rolemesh_model_loads_total", device="gpu:0", model="a"), 1)

    def test_load_failure_timeout_crash_and_restart(self) -> None:
        h = Harness(count=1)
        a, b = h.config.model("a"), h.config.model("b")
        # a child that exits while loading: a load failure, 503 model_load_failed
        d = h.node.acquire(a)
        h.reactor.last.exit(1)
        self.assertEqual(self.failureResultOf(d, errors.ApiError).value.status, 503)
        # a child that never becomes ready: a load timeout
        d = h.node.acquire(b)
        h.reactor.advance(10.0)
        self.assertEqual(self.failureResultOf(d, errors.ApiError).value.code, "model_load_timeout")
        h.reactor.last.exit(0, signal=9)
        # a ready child that crashes
        h.reactor.advance(100)
        d = h.node.acquire(a)
        h.ready("a")
        self.successResultOf(d).release()
        h.reactor.last.exit(1)
        families = h.scrape()
        self.assertEqual(value(families, "rolemesh_model_load_failures_total", device="gpu:0", model="a"), 1)
        self.assertEqual(value(families, "rolemesh_model_load_failures_total", device="gpu:0", model="b"), 0)
        self.assertEqual(value(families, "rolemesh_model_load_timeouts_total", device="gpu:0", model="b"), 1)
        self.assertEqual(value(families, "rolemesh_model_load_timeouts_total", device="gpu:0", model="a"), 0)
        self.assertEqual(value(families, "rolemesh_model_loads_total", device="gpu:0", model="a"), 1)
        self.assertEqual(value(families, "rolemesh_child_crashes_total", device="gpu:0", model="a"), 1)
        self.assertEqual(value(families, "rolemesh_child_restarts_total", device="gpu:0", model="a"), 1)
        sup = h.supervisors[0]
        self.assertEqual((sup.loads, sup.load_failures, sup.load_timeouts, sup.crashes, sup.restarts), (1, 1, 1, 1, 1))

    def test_counts_from_before_metrics_existed_are_not_claimed(self) -> None:
        h = Harness(count=1)
        h.supervisors[0].loads = 5  # as if loads happened before NodeMetrics was built
        fresh = NodeMetrics(h.node, h.root)
        d = h.node.acquire(h.config.model("a"))
        h.ready("a")
        self.successResultOf(d).release()
        text = fresh.render().decode()
        families = {f.name: f for f in text_string_to_metric_families(text)}
        self.assertEqual(value(families, "rolemesh_model_loads_total", device="gpu:0", model="a"), 1)

    def test_idle_unload_counted(self) -> None:
        h = Harness(count=1, idle_unload_s=30)
        d = h.node.acquire(h.config.model("a"))
        h.ready("a")
        self.successResultOf(d).release()
        h.reactor.advance(30)
        h.reactor.last.exit(0)
        families = h.scrape()
        self.assertEqual(value(families, "rolemesh_idle_unloads_total", device="gpu:0", model="a"), 1)
        self.assertEqual(value(families, "rolemesh_child_state", device="gpu:0", state="stopped"), 1)
        self.assertEqual(value(families, "rolemesh_child_model", device="gpu:0", model="a"), 0)

    def test_a_model_backing_off_says_where_until_when_and_after_how_many_failures(self) -> None:
        h = Harness(count=2)
        h.reactor.advance(1000)
        d = h.node.acquire(h.config.model("a"), device="gpu:0")
        h.reactor.last.exit(1)  # the load ends on its own: 15 s of back-off on gpu:0
        self.failureResultOf(d)
        families = h.scrape()
        self.assertEqual(value(families, "rolemesh_model_backoff_until_seconds", device="gpu:0", model="a"), 1015)
        self.assertEqual(value(families, "rolemesh_model_backoff_failures", device="gpu:0", model="a"), 1)
        for device, model in (("gpu:0", "b"), ("gpu:1", "a"), ("gpu:1", "b")):
            self.assertEqual(value(families, "rolemesh_model_backoff_until_seconds", device=device, model=model), 0)
            self.assertEqual(value(families, "rolemesh_model_backoff_failures", device=device, model=model), 0)
        h.reactor.advance(15)
        families = h.scrape()
        self.assertEqual(value(families, "rolemesh_model_backoff_until_seconds", device="gpu:0", model="a"), 0)
        self.assertEqual(value(families, "rolemesh_model_backoff_failures", device="gpu:0", model="a"), 0)

    def test_idle_unload_for_an_unknown_device_is_not_a_label(self) -> None:
        h = Harness(count=1)
        h.metrics.observe("idle_unload", device="gpu:99", model="a")
        found = samples(h.scrape(), "rolemesh_idle_unloads_total")
        self.assertEqual({s.labels["device"] for s in found}, {"gpu:0"})
        self.assertEqual({s.value for s in found}, {0})


class PromptTokenTests(SynchronousTestCase):
    def test_the_nodes_tally_per_device_and_model(self) -> None:
        h = Harness(count=2)
        h.node.prompt_cache.add("gpu:1", "a", 21, 5)
        h.node.prompt_cache.add("gpu:1", "a", 4, 5)
        families = h.scrape()
        self.assertEqual(value(families, "rolemesh_prompt_tokens_cached_total", device="gpu:1", model="a"), 25)
        self.assertEqual(value(families, "rolemesh_prompt_tokens_processed_total", device="gpu:1", model="a"), 10)
        self.assertEqual(value(families, "rolemesh_prompt_tokens_cached_total", device="gpu:0", model="a"), 0)
        self.assertEqual(families["rolemesh_prompt_tokens_cached"].type, "counter")

    def test_a_model_a_reload_removed_keeps_its_series(self) -> None:
        h = Harness(count=1)
        h.node.prompt_cache.add("gpu:0", "b", 1, 2)
        h.node.reconfigure(make_config([{"model_id": "a"}], max_pending_requests_per_device=2))
        families = h.scrape()
        self.assertEqual(value(families, "rolemesh_prompt_tokens_processed_total", device="gpu:0", model="b"), 2,
                         "a counter never goes back")


class PreCreatedCounterTests(SynchronousTestCase):
    """docs/operations/metrics.md: the per-model and per-(device, model) counters
    exist at 0 for every configured pair from the start."""

    def documented(self) -> Dict[str, List[str]]:
        """Counter name -> label names, for the counters labelled by model (and device) alone."""
        with open(METRICS_DOC, encoding="utf-8") as f:
            rows = re.findall(r"^\| `(rolemesh_\w+_total)` \| counter \| ([^|]*) \|", f.read(), re.M)
        found = {name: re.findall(r"`(\w+)`", labels) for name, labels in rows}
        return {name: labels for name, labels in found.items() if labels in (["model"], ["device", "model"])}

    def test_every_documented_counter_exists_at_0_for_every_pair_from_the_start(self) -> None:
        counters = self.documented()
        self.assertIn("rolemesh_queue_timeouts_total", counters)
        self.assertIn("rolemesh_idle_unloads_total", counters)
        h = Harness(count=2)
        families = h.scrape()
        for name, labels in counters.items():
            want = [{"model": m} for m in ("a", "b")] if labels == ["model"] else [
                {"device": d, "model": m} for d in ("gpu:0", "gpu:1") for m in ("a", "b")]
            for labelset in want:
                self.assertEqual(value(families, name, **labelset), 0, (name, labelset))

    def test_a_model_a_reload_adds_is_counted_from_the_reload_on(self) -> None:
        h = Harness(count=1)
        h.node.reconfigure(make_config([{"model_id": "a"}, {"model_id": "c"}], max_pending_requests_per_device=2))
        families = h.scrape()
        for name, labels in self.documented().items():
            labelset = {"model": "c"} if labels == ["model"] else {"device": "gpu:0", "model": "c"}
            self.assertEqual(value(families, name, **labelset), 0, name)


class DeviceGaugeTests(SynchronousTestCase):
    def test_gauges_reflect_backend_samples(self) -> None:
        h = Harness()
        h.reactor.advance(3.0)
        families = h.scrape()
        for device in ("gpu:0", "gpu:1"):
            self.assertEqual(value(families, "rolemesh_device_memory_total_bytes", device=device), 16 * GiB)
            self.assertEqual(value(families, "rolemesh_device_memory_used_bytes", device=device), 8 * GiB)
            self.assertEqual(value(families, "rolemesh_device_memory_free_bytes", device=device), 8 * GiB)
            self.assertAlmostEqual(value(families, "rolemesh_device_utilization_ratio", device=device), 0.1)
            self.assertEqual(value(families, "rolemesh_device_metrics_sample_age_seconds", device=device), 3.0)
            self.assertEqual(value(families, "rolemesh_device_metrics_stale", device=device), 0)
        # the fake backend does not know temperature or power: no sample, not 0
        self.assertEqual(samples(families, "rolemesh_device_temperature_celsius"), [])
        self.assertEqual(samples(families, "rolemesh_device_power_watts"), [])

    def test_new_sample_values_show_up(self) -> None:
        h = Harness(count=1)
        h.backend.free = 2 * GiB
        h.reactor.advance(5.0)  # the node samples every 5 s
        families = h.scrape()
        self.assertEqual(value(families, "rolemesh_device_memory_free_bytes", device="gpu:0"), 2 * GiB)
        self.assertEqual(value(families, "rolemesh_device_memory_used_bytes", device="gpu:0"), 14 * GiB)

    def test_temperature_and_power_when_known(self) -> None:
        from rolemesh.base.devices import DeviceMetrics

        h = Harness(count=1)
        h.node.metrics["gpu:0"] = DeviceMetrics("gpu:0", 0.0, 16 * GiB, 1 * GiB, 15 * GiB, 55.0, 61.0, 123.5)
        families = h.scrape()
        self.assertEqual(value(families, "rolemesh_device_temperature_celsius", device="gpu:0"), 61.0)
        self.assertEqual(value(families, "rolemesh_device_power_watts", device="gpu:0"), 123.5)
        self.assertAlmostEqual(value(families, "rolemesh_device_utilization_ratio", device="gpu:0"), 0.55)

    def test_failed_sample_is_stale_and_age_grows(self) -> None:
        h = Harness(count=1)
        h.backend.fail_with = RuntimeError("driver gone")
        h.reactor.advance(5.0)
        families = h.scrape()
        self.assertEqual(value(families, "rolemesh_device_metrics_stale", device="gpu:0"), 1)
        self.assertEqual(value(families, "rolemesh_device_metrics_sample_age_seconds", device="gpu:0"), 5.0)
        # the last good figures stay
        self.assertEqual(value(families, "rolemesh_device_memory_free_bytes", device="gpu:0"), 8 * GiB)
        h.reactor.advance(5.0)
        self.assertEqual(value(h.scrape(), "rolemesh_device_metrics_sample_age_seconds", device="gpu:0"), 10.0)

    def test_no_sample_yet_is_stale_with_total_from_discovery(self) -> None:
        h = Harness(count=1)
        h.node.metrics.clear()
        families = h.scrape()
        self.assertEqual(value(families, "rolemesh_device_metrics_stale", device="gpu:0"), 1)
        self.assertEqual(value(families, "rolemesh_device_memory_total_bytes", device="gpu:0"), 16 * GiB)
        self.assertEqual(samples(families, "rolemesh_device_memory_used_bytes"), [])
        self.assertEqual(samples(families, "rolemesh_device_metrics_sample_age_seconds"), [])


class DispatcherGaugeTests(SynchronousTestCase):
    def test_absent_without_a_dispatcher(self) -> None:
        families = Harness().scrape()
        self.assertEqual([n for n in families if n.startswith("rolemesh_dispatcher")], [])

    def test_present_with_a_dispatcher(self) -> None:
        client = SimpleNamespace(
            state="registered",
            last_success=None,
            heartbeats_ok=0,
            heartbeats_failed=0,
            registrations_ok=0,
            registrations_failed=0,
        )
        h = Harness(dispatcher=client)
        h.reactor.advance(7.0)
        families = h.scrape()
        # never succeeded: counted from agent start
        self.assertEqual(value(families, "rolemesh_dispatcher_seconds_since_last_success"), 7.0)
        client.heartbeats_ok, client.heartbeats_failed, client.registrations_ok = 4, 2, 1
        client.last_success = 5.0
        client.state = "unreachable"
        h.reactor.advance(3.0)
        families = h.scrape()
        self.assertEqual(value(families, "rolemesh_dispatcher_heartbeats_total", outcome="success"), 4)
        self.assertEqual(value(families, "rolemesh_dispatcher_heartbeats_total", outcome="failure"), 2)
        self.assertEqual(value(families, "rolemesh_dispatcher_registrations_total", outcome="success"), 1)
        self.assertEqual(value(families, "rolemesh_dispatcher_registrations_total", outcome="failure"), 0)
        self.assertEqual(value(families, "rolemesh_dispatcher_seconds_since_last_success"), 5.0)
        self.assertEqual(value(families, "rolemesh_dispatcher_state", state="unreachable"), 1)
        self.assertEqual(value(families, "rolemesh_dispatcher_state", state="registered"), 0)

    def test_dispatcher_set_after_metrics_were_built(self) -> None:
        # service.make_service builds NodeMetrics before it sets root.dispatcher
        h = Harness()
        self.assertNotIn("rolemesh_dispatcher_state", h.scrape())
        h.root.dispatcher = SimpleNamespace(
            state="unregistered", last_success=None, heartbeats_ok=0, heartbeats_failed=0
        )
        families = h.scrape()
        self.assertEqual(value(families, "rolemesh_dispatcher_state", state="unregistered"), 1)
        self.assertEqual(value(families, "rolemesh_dispatcher_heartbeats_total", outcome="success"), 0)

    def test_real_dispatcher_client_attributes(self) -> None:
        from rolemesh.fleet.dispatcher import DispatcherClient

        h = Harness()
        h.root.dispatcher = DispatcherClient(
            "http://127.0.0.1:1", None, dict, dict, 5.0, reactor=h.reactor, http=object()
        )
        families = h.scrape()
        self.assertEqual(value(families, "rolemesh_dispatcher_state", state="unregistered"), 1)
        self.assertEqual(value(families, "rolemesh_dispatcher_heartbeats_total", outcome="failure"), 0)


class DocumentationTests(SynchronousTestCase):
    def test_every_metric_is_in_the_metrics_doc(self) -> None:
        client = SimpleNamespace(
            state="registered",
            last_success=1.0,
            heartbeats_ok=1,
            heartbeats_failed=1,
            registrations_ok=1,
            registrations_failed=0,
        )
        h = Harness(count=1, dispatcher=client, idle_unload_s=1)
        from rolemesh.base.devices import DeviceMetrics

        h.node.metrics["gpu:0"] = DeviceMetrics("gpu:0", 0.0, 16 * GiB, 1 * GiB, 15 * GiB, 55.0, 61.0, 123.5)
        h.metrics.observe("request", endpoint="completions", model="a", status=200, duration=0.1, ttfb=0.05)
        h.metrics.observe("idle_unload", device="gpu:0", model="a")
        d = h.node.acquire(h.config.model("a"))
        h.ready("a")
        self.successResultOf(d).release()
        with open(METRICS_DOC, encoding="utf-8") as f:
            doc = f.read()
        documented = set(re.findall(r"`(rolemesh_[a-z_]+)`", doc))
        families = h.scrape()
        exported = {
            name + "_total" if family.type == "counter" else name
            for name, family in families.items()
            if not name.endswith("_created")
        }
        self.assertEqual(exported - documented, set(), "metrics missing from docs/operations/metrics.md")
        self.assertEqual(documented - exported, set(), "docs/operations/metrics.md names metrics that do not exist")
        # and no other operations page (alerts, troubleshooting, tenants, ...) names one that does not exist
        pages = [os.path.join(OPERATIONS_DIR, name) for name in sorted(os.listdir(OPERATIONS_DIR))]
        for page in pages + [os.path.join(ROOT, "docs", "operations.md")]:
            with open(page, encoding="utf-8") as f:
                named = set(re.findall(r"`(rolemesh_[a-z_]+)`", f.read()))
            self.assertEqual(named - exported, set(), f"{os.path.relpath(page, ROOT)} names metrics that do not exist")
        # and the reference table gives each its type
        for name in exported:
            family = families[name[: -len("_total")] if name.endswith("_total") else name]
            self.assertRegex(doc, rf"\| `{name}` \| {family.type} \|")


class JsonLogTests(SynchronousTestCase):
    """``log_format: json``: one JSON object per line with the structured fields."""

    def setUp(self) -> None:
        self.stream = io.StringIO()
        self.log = Logger(namespace="rolemesh.api", observer=make_observer("json", self.stream))

    def lines(self) -> List[Dict[str, Any]]:
        text = self.stream.getvalue()
        self.assertTrue(text.endswith("\n"))
        out = []
        for line in text.splitlines():
            record = json.loads(line)
            self.assertIsInstance(record, dict)
            out.append(record)
        return out

    def test_request_fields_become_keys(self) -> None:
        self.log.info(
            "{method} {path} {model} -> {status} on {device} in {duration:.1f} ms",
            method="POST",
            path="/v1/chat/completions",
            model="a",
            status=200,
            device="gpu:0",
            duration=12.345,
            request_id="req-1",
        )
        self.log.warn("queue full for {model}", model="b", device="gpu:1", request_id="req-2", status=429, duration=0.5)
        first, second = self.lines()
        self.assertEqual(first["message"], "POST /v1/chat/completions a -> 200 on gpu:0 in 12.3 ms")
        self.assertEqual(
            (first["device"], first["model"], first["request_id"], first["status"], first["duration"]),
            ("gpu:0", "a", "req-1", 200, 12.345),
        )
        self.assertEqual(first["level"], "info")
        self.assertEqual(first["namespace"], "rolemesh.api")
        self.assertIsInstance(first["time"], float)
        self.assertEqual((second["level"], second["status"], second["request_id"]), ("warn", 429, "req-2"))

    def test_multiline_values_stay_on_one_line(self) -> None:
        self.log.error("child said {line}", line="first\nsecond", device="cpu:0", model=None)
        (record,) = self.lines()
        self.assertEqual(record["line"], "first\nsecond")
        self.assertIsNone(record["model"])
        self.assertEqual(len(self.stream.getvalue().splitlines()), 1)

    def test_odd_values_do_not_break_the_line(self) -> None:
        self.log.info("odd {thing}", thing=object(), devices=["gpu:0", "gpu:1"], nested={"a": {1, 2}})
        (record,) = self.lines()
        self.assertEqual(record["devices"], ["gpu:0", "gpu:1"])
        self.assertIn("odd <object object", record["message"])
        self.assertIsInstance(record["nested"], str)

    def test_failure_events_are_parseable(self) -> None:
        try:
            1 / 0  # noqa: B018
        except ZeroDivisionError:
            self.log.failure("request observer failed", device="gpu:0", model="a", request_id="req-3")
        (record,) = self.lines()
        self.assertEqual(record["level"], "critical")
        self.assertEqual(record["message"], "request observer failed")
        self.assertEqual((record["device"], record["model"], record["request_id"]), ("gpu:0", "a", "req-3"))
        self.assertIn("division", record["error"])
        self.assertIn("ZeroDivisionError", record["traceback"])

    def test_debug_is_filtered_by_default(self) -> None:
        self.log.debug("noise {x}", x=1)
        self.assertEqual(self.stream.getvalue(), "")

    def test_level_can_be_lowered(self) -> None:
        log = Logger(observer=make_observer("json", self.stream, level=LogLevel.debug))
        log.debug("detail {x}", x=1)
        self.assertEqual(self.lines()[0]["x"], 1)


class TextLogTests(SynchronousTestCase):
    def test_text_mode_is_readable(self) -> None:
        stream = io.StringIO()
        log = Logger(namespace="rolemesh.api", observer=make_observer("text", stream))
        log.info(
            "{method} {path} {model} -> {status} on {device} in {duration:.1f} ms",
            method="POST",
            path="/v1/completions",
            model="a",
            status=200,
            device="gpu:0",
            duration=3.0,
            request_id="r",
        )
        try:
            raise ValueError("bad thing")
        except ValueError:
            log.failure("observer failed")
        text = stream.getvalue()
        first = text.splitlines()[0]
        self.assertIn("POST /v1/completions a -> 200 on gpu:0 in 3.0 ms", first)
        self.assertIn("rolemesh.api", first)
        self.assertFalse(first.lstrip().startswith("{"))
        with self.assertRaises(ValueError):
            json.loads(first)
        self.assertIn("observer failed", text)
        self.assertIn("ValueError: bad thing", text)
