"""Unit tests of ``rolemesh.children.telemetry`` and of how the node, the metrics, the
heartbeat and the API carry it: the parsers (hypothesis), the sampler against
a stub child (``treq.testing.StubTreq``, a fake clock), load progress, typed
issues, the shipped Grafana dashboard and Prometheus alert rules."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
from typing import Any, Dict, List, Optional

import yaml
from hypothesis import given
from hypothesis import strategies as st
from jsonschema import Draft202012Validator
from prometheus_client.parser import text_string_to_metric_families
from treq.testing import StubTreq
from twisted.trial.unittest import SkipTest, SynchronousTestCase
from twisted.web.resource import Resource

from rolemesh.children.state import READY
from rolemesh.children.telemetry import (
    BACKEND_METRICS_STALE,
    LOAD_STEPS,
    ChildTelemetry,
    SlotState,
    TelemetrySampler,
    export_name,
    generated_since,
    load_progress,
    parse_prometheus,
    parse_slots,
    summarize,
)
from rolemesh.node.payloads import heartbeat_payload
from rolemesh.schemas import load_schema
from tests.api.test_metrics import Harness as MetricsHarness
from tests.fixtures import REPO
from tests.node.test_node import NodeHarness

ROOT = REPO
DASHBOARD = os.path.join(ROOT, "deploy", "grafana", "rolemesh-node.json")
ALERTS = os.path.join(ROOT, "deploy", "prometheus", "rolemesh-node-alerts.yml")
HEARTBEAT_SCHEMA = Draft202012Validator(load_schema("heartbeat"))
NO_PROMTOOL = ("promtool not found: install Debian's prometheus package "
               "(apt-get install -y --no-install-recommends prometheus) to run this check")


def child_metrics(processing: int = 0, deferred: int = 0, predicted: int = 0, prompt: int = 0) -> str:
    """``/metrics`` as llama-server (11434) writes it."""
    counters = [("prompt_tokens_total", "Number of prompt tokens processed, excluding cached tokens", prompt),
                ("prompt_tokens_cached_total", "Number of prompt tokens reused from the cache", 0),
                ("prompt_seconds_total", "Total time spent processing prompts", 0.25),
                ("tokens_predicted_total", "Number of generation tokens processed", predicted),
                ("tokens_predicted_seconds_total", "Total time spent generating tokens", 1.5),
                ("n_decode_total", "Total number of llama_decode() calls", 12),
                ("n_tokens_max", "Largest observed sequence length (prompt + generation)", 40)]
    gauges = [("prompt_tokens_seconds", "Average prompt throughput in tokens/s", 0),
              ("predicted_tokens_seconds", "Average generation throughput in tokens/s", 812.5),
              ("requests_processing", "Number of requests processing", processing),
              ("requests_deferred", "Number of requests deferred", deferred),
              ("n_busy_slots_per_decode", "Average number of busy slots per llama_decode() call", 1)]
    out = []
    for kind, items in (("counter", counters), ("gauge", gauges)):
        for name, text, value in items:
            out += [f"# HELP llamacpp:{name} {text}", f"# TYPE llamacpp:{name} {kind}", f"llamacpp:{name} {value}"]
    return "\n".join(out) + "\n"


def child_slots(busy: int, total: int = 4, decoded: int = 0, task: int = 7) -> List[Dict[str, Any]]:
    """``/slots`` as llama-server writes it (``only_metrics``)."""
    out = []
    for i in range(total):
        slot: Dict[str, Any] = {"id": i, "n_ctx": 1024, "speculative": False, "is_processing": i < busy}
        if i < busy or decoded:
            slot.update({"id_task": task + i, "n_prompt_tokens": 9, "n_prompt_tokens_processed": 9,
                         "n_prompt_tokens_cache": 0, "params": {},
                         "next_token": [{"has_next_token": i < busy, "has_new_line": False, "n_remain": -1,
                                         "n_decoded": decoded}]})
        out.append(slot)
    return out


class FakeChild(Resource):
    """A llama-server's /metrics and /slots; tests change what it says."""

    isLeaf = True

    def __init__(self) -> None:
        super().__init__()
        self.metrics = child_metrics()
        self.slots: Any = child_slots(0)
        self.status = 200
        self.requests: List[bytes] = []

    def render_GET(self, request: Any) -> bytes:  # noqa: N802 - twisted.web's name
        self.requests.append(request.path)
        request.setResponseCode(self.status)
        if request.path == b"/metrics":
            return self.metrics.encode()
        return json.dumps(self.slots).encode()


class HangingGet:
    """A ``get`` that never answers (a child too busy to reply)."""

    def __init__(self) -> None:
        self.calls: List[str] = []
        self.cancelled = 0

    def __call__(self, url: str, **_: Any) -> Any:
        from twisted.internet.defer import Deferred

        self.calls.append(url)

        def cancel(d: Any) -> None:
            self.cancelled += 1

        return Deferred(cancel)


# ----------------------------------------------------------------------
# Parsers (pure)


class ParserTests(SynchronousTestCase):
    def test_prometheus_families_keep_names_types_and_values(self) -> None:
        families = {f.name: f for f in parse_prometheus(child_metrics(processing=3, predicted=120))}
        self.assertEqual(families["tokens_predicted"].type, "counter")
        self.assertEqual(families["requests_processing"].type, "gauge")
        self.assertEqual(families["requests_processing"].samples[0].value, 3)
        self.assertEqual(families["tokens_predicted"].samples[0].name, "tokens_predicted_total")

    def test_other_prefixes_are_ignored_and_garbage_is_an_error(self) -> None:
        self.assertEqual(parse_prometheus("# TYPE other gauge\nother 1\n"), ())
        self.assertRaises(ValueError, parse_prometheus, "llamacpp:x{ 1 2 3\n")

    def test_slots(self) -> None:
        slots = parse_slots(child_slots(busy=2, decoded=5))
        self.assertEqual([s.is_processing for s in slots], [True, True, False, False])
        self.assertEqual(slots[0], SlotState(0, 1024, True, 7, 5, 9))
        self.assertEqual(parse_slots(child_slots(busy=0))[3], SlotState(3, 1024, False))
        for bad in ({"id": 1}, [{"no": "id"}], ["x"], None):
            self.assertRaises(ValueError, parse_slots, bad)

    @given(st.lists(st.fixed_dictionaries({
        "id": st.integers(0, 64), "is_processing": st.booleans() | st.none() | st.integers(),
        "n_ctx": st.integers(-5, 1 << 20) | st.none() | st.text(max_size=3),
        "id_task": st.integers(0, 99) | st.none() | st.booleans(),
        "next_token": st.lists(st.dictionaries(st.sampled_from(["n_decoded", "x"]),
                                               st.integers(-5, 10**6) | st.floats() | st.text(max_size=2)),
                               max_size=2),
    }), max_size=8))
    def test_any_slot_list_parses_into_sane_records(self, body: List[Dict[str, Any]]) -> None:
        for slot in parse_slots(body):
            self.assertGreaterEqual(slot.n_decoded, 0)
            self.assertIsInstance(slot.is_processing, bool)

    @given(st.text(max_size=200))
    def test_any_text_parses_or_is_a_value_error(self, text: str) -> None:
        try:
            families = parse_prometheus(text)
        except ValueError:
            return
        for family in families:
            for sample in family.samples:
                self.assertEqual(sample.value, sample.value)  # never NaN

    @given(st.lists(st.tuples(st.integers(0, 7), st.integers(0, 3), st.integers(0, 10**6)), max_size=8),
           st.lists(st.tuples(st.integers(0, 7), st.integers(0, 3), st.integers(0, 10**6)), max_size=8))
    def test_generated_since_is_never_negative(self, before: List[Any], after: List[Any]) -> None:
        old = [SlotState(i, 64, True, t, n) for i, t, n in before]
        new = [SlotState(i, 64, True, t, n) for i, t, n in after]
        self.assertGreaterEqual(generated_since(old, new), 0)
        self.assertEqual(generated_since([], new), sum(n for _, _, n in after))

    def test_export_names(self) -> None:
        self.assertEqual(export_name("requests_processing"), "rolemesh_llamacpp_requests_processing")
        self.assertEqual(export_name("a:b-c"), "rolemesh_llamacpp_a_b_c")


class SummaryTests(SynchronousTestCase):
    def sample(self, now: float, busy: int, decoded: int, predicted: int, generation: int = 1,
               previous: Optional[ChildTelemetry] = None) -> ChildTelemetry:
        return summarize("gpu:0", "a", generation, now, parse_prometheus(child_metrics(busy, 1, predicted)),
                         parse_slots(child_slots(busy, decoded=decoded)), previous)

    def test_slots_queue_and_counters(self) -> None:
        record = self.sample(10.0, busy=4, decoded=3, predicted=100)
        self.assertEqual((record.slots_total, record.slots_busy, record.slots_free), (4, 4, 0))
        self.assertEqual((record.requests_processing, record.requests_deferred), (4, 1))
        self.assertEqual((record.generated_tokens_total, record.prompt_tokens_total), (100, 0))
        self.assertIsNone(record.tokens_per_s, "no rate from a single sample")
        self.assertIsNone(record.kv_cache_usage_ratio, "this build reports no KV figure")

    def test_rate_counts_tokens_of_running_streams(self) -> None:
        """The counter moves only when a request ends; the slots show running ones."""
        first = self.sample(10.0, busy=4, decoded=10, predicted=100)
        second = self.sample(12.0, busy=4, decoded=60, predicted=100, previous=first)
        self.assertEqual(second.tokens_per_s, 4 * 50 / 2.0)

    def test_rate_counts_finished_requests_from_the_counter(self) -> None:
        first = self.sample(10.0, busy=0, decoded=0, predicted=100)
        second = self.sample(11.0, busy=0, decoded=0, predicted=600, previous=first)
        self.assertEqual(second.tokens_per_s, 500.0)

    def test_a_new_child_starts_afresh(self) -> None:
        first = self.sample(10.0, busy=0, decoded=0, predicted=1000)
        second = self.sample(11.0, busy=0, decoded=0, predicted=5, generation=2, previous=first)
        self.assertIsNone(second.tokens_per_s)

    def test_kv_cache_where_reported(self) -> None:
        text = child_metrics() + "# TYPE llamacpp:kv_cache_usage_ratio gauge\nllamacpp:kv_cache_usage_ratio 0.25\n"
        record = summarize("gpu:0", "a", 1, 1.0, parse_prometheus(text), None)
        self.assertEqual(record.kv_cache_usage_ratio, 0.25)
        self.assertEqual((record.slots_total, record.slots_busy), (None, 0), "without /slots: busy from /metrics")


# ----------------------------------------------------------------------
# Load progress (pure)

LOAD_LINES = [
    "0.00.000.911 I srv  llama_server: initializing ...",
    "0.00.003.959 I srv    load_model: loading model '/models/a.gguf'",
    "llama_model_loader: loaded meta data with 24 key-value pairs and 21 tensors from /models/a.gguf",
    "print_info: file size   = 478.76 KiB (32.00 BPW)",
    "load_tensors: loading model tensors, this can take a while... (mmap = true)",
    "load_tensors: offloaded 3/3 layers to GPU",
    "llama_context: constructing llama_context",
]


#: What llama-server 11434 prints while loading (its default verbosity).
REAL_LOAD_LINES = [
    "0.00.000.911 I srv  llama_server: initializing ...",
    "0.00.003.959 I srv    load_model: loading model 'tiny.gguf'",
    "0.00.006.898 W llama_context: n_ctx_seq (2048) > n_ctx_train (256) -- possible training context overflow",
    "0.00.009.335 I cmn          init: llama threadpool init, n_threads = 2",
    "0.00.010.236 I srv    load_model: initializing, n_slots = 4, n_ctx_slot = 256, kv_unified = 'false'",
    "0.00.011.765 I srv  llama_server: model loaded",
    "0.00.011.769 I srv  llama_server: listening on http://127.0.0.1:38111",
]


class LoadProgressTests(SynchronousTestCase):
    def test_steps_bytes_and_layers(self) -> None:
        progress = load_progress(["[rolemesh] starting a on gpu:0: llama-server ..."] + LOAD_LINES, "a", 5.0)
        self.assertEqual(progress.step, "creating_context")
        self.assertEqual((progress.steps_done, progress.steps_total), (3, len(LOAD_STEPS)))
        self.assertEqual(progress.file_bytes, int(478.76 * 1024))
        self.assertEqual((progress.layers_offloaded, progress.layers_total), (3, 3))
        self.assertEqual(progress.to_json(7.5)["elapsed_s"], 2.5)

    def test_the_steps_of_the_pinned_build(self) -> None:
        steps = [load_progress(REAL_LOAD_LINES[:i], "a", 0.0).step for i in range(1, len(REAL_LOAD_LINES) + 1)]
        self.assertEqual(steps, ["spawned", "loading_model", "creating_context", "warming_up", "initializing_slots",
                                 "loaded", "loaded"])

    def test_only_the_latest_start_counts(self) -> None:
        lines = LOAD_LINES + ["main: model loaded", "[rolemesh] starting b on gpu:0: llama-server ..."]
        progress = load_progress(lines, "b", 9.0)
        self.assertEqual((progress.step, progress.steps_done, progress.file_bytes), ("spawned", 0, None))

    @given(st.lists(st.sampled_from(LOAD_LINES + REAL_LOAD_LINES + ["noise"]),
                    max_size=20))
    def test_steps_only_move_forward(self, lines: List[str]) -> None:
        done = [load_progress(lines[:i], "a", 0.0).steps_done for i in range(len(lines) + 1)]
        self.assertEqual(done, sorted(done))


# ----------------------------------------------------------------------
# The sampler and the node


class NodeTelemetry:
    """A node (fake children and clock) whose telemetry asks a FakeChild."""

    def __init__(self, parallel: int = 4, **top: Any) -> None:
        self.nodes = NodeHarness([{"model_id": "a", "server_args": {"parallel": parallel}}], **top)
        self.child = FakeChild()
        self.stub = StubTreq(self.child)
        self.node = self.nodes.node
        self.node.telemetry = TelemetrySampler(self.node.supervisors, reactor=self.nodes.reactor, get=self.stub.get)
        self.reactor = self.nodes.reactor

    def sample(self) -> Any:
        d = self.node.telemetry.sample()
        self.stub.flush()
        return d


class SamplerTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.h = NodeTelemetry()

    def test_nothing_is_asked_without_a_ready_child(self) -> None:
        self.successResultOf(self.h.sample())
        self.assertEqual(self.h.child.requests, [])
        self.assertIsNone(self.h.node.telemetry.latest("gpu:0"))

    def test_a_ready_child_is_sampled(self) -> None:
        h = self.h
        h.nodes.load("a")
        h.child.metrics = child_metrics(processing=4, predicted=10)
        h.child.slots = child_slots(busy=4, decoded=5)
        self.successResultOf(h.sample())
        self.assertEqual(sorted(h.child.requests), [b"/metrics", b"/slots"])
        record = h.node.telemetry.latest("gpu:0")
        assert record is not None
        self.assertEqual((record.model, record.slots_total, record.slots_busy, record.stale), ("a", 4, 4, False))

    def test_a_failing_child_is_marked_stale_and_never_restarted(self) -> None:
        h = self.h
        h.nodes.load("a")
        self.successResultOf(h.sample())
        pid = h.nodes.sup().pid
        h.child.status = 500
        self.successResultOf(h.sample())
        record = h.node.telemetry.latest("gpu:0")
        assert record is not None
        self.assertTrue(record.stale)
        self.assertIn("HTTP 500", record.error or "")
        self.assertEqual(record.slots_total, 4, "the last good figures are kept")
        self.assertEqual((h.nodes.sup().state, h.nodes.sup().pid, h.nodes.sup().restarts), (READY, pid, 0))
        self.assertEqual(h.nodes.child().signals, [])
        (issue,) = [i for i in h.node.device_states()[0]["issues"] if i["code"] == BACKEND_METRICS_STALE]
        self.assertEqual(issue["model"], "a")
        h.child.status = 200
        self.successResultOf(h.sample())
        self.assertFalse(h.node.telemetry.latest("gpu:0").stale)  # type: ignore[union-attr]

    def test_a_child_that_does_not_answer_times_out(self) -> None:
        h = self.h
        h.nodes.load("a")
        hanging = HangingGet()
        h.node.telemetry = TelemetrySampler(h.node.supervisors, reactor=h.reactor, get=hanging, timeout=2.0)
        d = h.node.telemetry.sample()
        self.assertNoResult(d)
        h.node.telemetry.sample()  # the next tick does not pile up a second request
        self.assertEqual(len(hanging.calls), 2, "one /metrics and one /slots")
        h.reactor.advance(2.0)
        self.successResultOf(d)
        self.assertEqual(hanging.cancelled, 2)
        record = h.node.telemetry.latest("gpu:0")
        assert record is not None
        self.assertTrue(record.stale)
        self.assertEqual(record.error, "no answer within 2s")
        self.assertEqual(h.nodes.sup().state, READY)

    def test_garbage_answers_are_stale_not_errors(self) -> None:
        h = self.h
        h.nodes.load("a")
        h.child.slots = {"not": "a list"}
        self.successResultOf(h.sample())
        self.assertIn("/slots", h.node.telemetry.latest("gpu:0").error)  # type: ignore[union-attr, operator]

    def test_slots_off_falls_back_to_metrics(self) -> None:
        """A model whose server_args turn /slots off (llama-server answers 501)."""
        h = self.h
        h.nodes.load("a")
        child = FakeChild()
        child.metrics = child_metrics(processing=2)

        class NoSlots(Resource):
            isLeaf = True

            def render_GET(self, request: Any) -> bytes:  # noqa: N802
                if request.path == b"/slots":
                    request.setResponseCode(501)
                    return b'{"error": {"code": 501, "message": "This server does not support slots endpoint."}}'
                return child.render_GET(request)

        stub = StubTreq(NoSlots())
        h.node.telemetry = TelemetrySampler(h.node.supervisors, reactor=h.reactor, get=stub.get)
        h.node.telemetry.sample()
        stub.flush()
        record = h.node.telemetry.latest("gpu:0")
        assert record is not None
        self.assertEqual((record.stale, record.slots_total, record.slots_busy), (False, None, 2))

    def test_a_new_child_drops_the_old_figures(self) -> None:
        h = self.h
        h.nodes.load("a")
        self.successResultOf(h.sample())
        h.nodes.child().exit(signal=signal.SIGSEGV)
        self.assertIsNone(h.node.telemetry.latest("gpu:0"))

    def test_the_metrics_tick_samples_telemetry(self) -> None:
        h = self.h
        h.nodes.load("a")
        h.node.startService()
        self.addCleanup(h.node.stopService)
        h.stub.flush()
        self.assertIn(b"/slots", h.child.requests)


class ReportingTests(SynchronousTestCase):
    def test_heartbeat_and_inventory_carry_slots_queue_and_rate(self) -> None:
        h = NodeTelemetry()
        h.nodes.load("a")
        h.child.slots = child_slots(busy=1, decoded=2)
        self.successResultOf(h.sample())
        h.reactor.advance(2)
        h.child.metrics = child_metrics(processing=3, deferred=1)
        h.child.slots = child_slots(busy=3, decoded=12)
        self.successResultOf(h.sample())
        (state,) = h.node.device_states()
        self.assertEqual((state["slots_total"], state["slots_busy"], state["slots_free"]), (4, 3, 1))
        self.assertEqual(state["queue_depth"], 1, "the child's deferred requests count as queued")
        self.assertEqual(state["tokens_per_s"], 4 * 10 / 2, "four slots decoded 10 more tokens each in 2 s")
        self.assertEqual(state["issues"], [])
        payload = heartbeat_payload("n", 1, h.reactor.seconds(), h.node.device_states())
        HEARTBEAT_SCHEMA.validate(payload)
        self.assertEqual(payload["schema_version"], 2)
        (device,) = h.node.inventory()["devices"]
        self.assertEqual(device["slots"]["busy"], 3)
        self.assertEqual(device["slots"]["requests_deferred"], 1)
        self.assertEqual(device["throughput"]["tokens_per_s"], 20.0)
        self.assertIsNone(device["load"])

    def test_typed_issues_from_the_supervisor(self) -> None:
        h = NodeTelemetry()
        h.nodes.load("a")
        h.reactor.advance(7)
        h.nodes.child().exit(signal=signal.SIGILL)
        (state,) = h.node.device_states()
        (issue,) = state["issues"]
        self.assertEqual((issue["code"], issue["model"], issue["at"]), ("illegal_instruction", "a", 7.5))
        self.assertIn("SIGILL", issue["message"])
        HEARTBEAT_SCHEMA.validate(heartbeat_payload("n", 1, 8.0, h.node.device_states()))

    def test_a_model_serving_only_in_safe_mode_is_an_issue(self) -> None:
        h = NodeTelemetry()
        d = h.node.acquire(h.nodes.model("a"))
        h.reactor.advance(2)
        h.nodes.child().exit(signal=signal.SIGILL)  # retried at once with --no-repack
        h.nodes.answer("a")
        self.successResultOf(d).release()
        (state,) = h.node.device_states()
        (issue,) = state["issues"]
        self.assertEqual((issue["code"], issue["model"], issue["at"]), ("safe_mode", "a", 2.0))
        self.assertIn("--no-repack", issue["message"])
        HEARTBEAT_SCHEMA.validate(heartbeat_payload("n", 1, 8.0, h.node.device_states()))

    def test_device_metrics_stale_is_an_issue(self) -> None:
        h = NodeTelemetry()
        h.nodes.backend.fail_with = RuntimeError("nvml gone")
        self.successResultOf(h.node.sample_metrics())
        codes = [i["code"] for i in h.node.device_states()[0]["issues"]]
        self.assertEqual(codes, ["device_metrics_stale"])

    def test_load_progress_while_starting(self) -> None:
        h = NodeTelemetry()
        h.reactor.advance(3)
        h.node.acquire(h.nodes.model("a"))
        h.reactor.advance(1)
        for line in LOAD_LINES:
            h.nodes.child().output(line + "\n")
        load = h.node.device_states()[0]["load"]
        self.assertEqual((load["model"], load["since"], load["elapsed_s"], load["step"]),
                         ("a", 3.0, 1.0, "creating_context"))
        self.assertEqual(h.node.inventory()["devices"][0]["load"], load)
        HEARTBEAT_SCHEMA.validate(heartbeat_payload("n", 1, 4.0, h.node.device_states()))
        h.nodes.answer("a")
        self.assertIsNone(h.node.device_states()[0]["load"])


class GroupTests(SynchronousTestCase):
    def test_a_device_group_child_reports_in_the_groups_inventory(self) -> None:
        from tests.scheduling.test_placement import Harness as PlacementHarness  # noqa: PLC0415

        h = PlacementHarness()
        child = FakeChild()
        stub = StubTreq(child)
        h.node.telemetry = TelemetrySampler(h.node.supervisors, reactor=h.reactor, get=stub.get)
        lease = h.lease("G")
        self.assertEqual(lease.device, "gpu:0+gpu:1")
        child.slots = child_slots(busy=1, total=2)
        h.node.telemetry.sample()
        stub.flush()
        (group,) = h.node.inventory()["groups"]
        self.assertEqual((group["slots_total"], group["slots_busy"], group["slots"]["busy"]), (2, 1, 1))
        self.assertEqual(group["issues"], [])


class ModelsRouteTests(SynchronousTestCase):
    def test_v1_models_says_how_far_a_load_has_got(self) -> None:
        from tests.api.test_app import ApiHarness  # noqa: PLC0415 - heavy; only this test needs it

        h = ApiHarness()
        h.node.acquire(h.config.model("a"))
        h.node_h.child().output(LOAD_LINES[1] + "\n")
        body = h.call("GET", "/v1/models").json()
        entry = next(m for m in body["data"] if m["id"] == "a")
        self.assertEqual(entry["loading_on"], ["gpu:0"])
        self.assertEqual(entry["load_progress"]["gpu:0"]["step"], "loading_model")


# ----------------------------------------------------------------------
# /metrics


class MetricsTests(SynchronousTestCase):
    def harness(self) -> Any:
        h = MetricsHarness(count=1)
        child = FakeChild()
        stub = StubTreq(child)
        h.node.telemetry = TelemetrySampler(h.node.supervisors, reactor=h.reactor, get=stub.get)
        d = h.node.acquire(h.config.model("a"))
        h.ready("a")
        self.successResultOf(d).release()
        child.metrics = child_metrics(processing=2, predicted=50)
        child.slots = child_slots(busy=2, total=2, decoded=4)
        h.node.telemetry.sample()
        stub.flush()
        h.reactor.advance(1)
        child.slots = child_slots(busy=2, total=2, decoded=9)
        h.node.telemetry.sample()
        stub.flush()
        return h

    def test_child_series_are_relabelled_with_device_and_model(self) -> None:
        text = self.harness().metrics.render().decode()
        families = {f.name: f for f in text_string_to_metric_families(text)}
        self.assertNotIn("llamacpp:", text)
        labels = {key for f in families.values() for sample in f.samples for key in sample.labels}
        self.assertNotIn("port", labels, "never the child's port")
        generated = families["rolemesh_llamacpp_tokens_predicted"]
        self.assertEqual(generated.type, "counter")
        self.assertEqual([(s.labels, s.value) for s in generated.samples if s.name.endswith("_total")],
                         [({"device": "gpu:0", "model": "a"}, 50.0)])
        self.assertEqual(families["rolemesh_llamacpp_requests_processing"].type, "gauge")
        self.assertEqual(families["rolemesh_device_slots"].samples[0].value, 2)
        self.assertEqual(families["rolemesh_device_slots_busy"].samples[0].value, 2)
        self.assertEqual(families["rolemesh_device_telemetry_stale"].samples[0].value, 0)

    def test_queue_wait_is_a_histogram_per_device(self) -> None:
        h = MetricsHarness(count=1)
        first = h.node.acquire(h.config.model("a"))
        h.ready("a")
        lease = self.successResultOf(first)
        second = h.node.acquire(h.config.model("a"))
        h.reactor.advance(3)
        lease.release()
        self.successResultOf(second).release()
        families = h.scrape()
        wait = families["rolemesh_queue_wait_seconds"]
        self.assertEqual(wait.type, "histogram")
        count = [s.value for s in wait.samples if s.name.endswith("_count") and s.labels == {"device": "gpu:0"}]
        total = [s.value for s in wait.samples if s.name.endswith("_sum") and s.labels == {"device": "gpu:0"}]
        self.assertEqual((count, total), ([2.0], [3.0]))

    def test_promtool_check_metrics(self) -> None:
        promtool = shutil.which("promtool")
        if promtool is None:
            raise SkipTest(NO_PROMTOOL)
        text = self.harness().metrics.render()
        result = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, timeout=60)
        self.assertEqual(result.returncode, 0, (result.stdout + result.stderr).decode())


# ----------------------------------------------------------------------
# Dashboard and alert rules (files users import)

_FUNCTIONS = {
    "sum", "by", "without", "rate", "irate", "increase", "histogram_quantile", "max", "min", "avg", "count",
    "le", "on", "ignoring", "group_left", "group_right", "and", "or", "unless", "bool", "offset", "clamp_min",
    "max_over_time", "min_over_time", "avg_over_time", "changes", "resets", "absent", "time", "vector",
    "topk", "bottomk", "label_replace", "delta", "deriv", "count_over_time", "sum_over_time",
}


def series_in(expr: str) -> set:
    """Metric names an expression reads (everything that looks like one and is not PromQL)."""
    expr = re.sub(r'"[^"]*"', '""', expr)  # label values
    expr = re.sub(r"\{[^}]*\}", "", expr)  # matchers
    expr = re.sub(r"\[[^\]]*\]", "", expr)  # ranges
    expr = re.sub(r"\$\w+", "", expr)  # dashboard variables
    names = set(re.findall(r"[a-zA-Z_:][a-zA-Z0-9_:]*", expr))
    return {n for n in names if n.startswith("rolemesh_")} | {
        n for n in names if n not in _FUNCTIONS and not n.startswith("rolemesh_") and "_" in n}


def dashboard_exprs() -> List[str]:
    with open(DASHBOARD, encoding="utf-8") as f:
        board = json.load(f)
    exprs = []
    for panel in board["panels"]:
        for target in panel.get("targets", ()):
            exprs.append(target["expr"])
    for variable in board.get("templating", {}).get("list", ()):
        query = variable.get("query")
        if isinstance(query, dict):
            query = query.get("query")
        if isinstance(query, str) and query:
            exprs.append(re.sub(r"^label_values\((.*?)(,[^,)]*)?\)$", r"\1", query))
    return exprs


def alert_exprs() -> List[str]:
    with open(ALERTS, encoding="utf-8") as f:
        rules = yaml.safe_load(f)
    return [rule["expr"] for group in rules["groups"] for rule in group["rules"]]


def exported_series(text: str) -> set:
    """Every sample name of a scrape (``_bucket``/``_sum``/``_count``/``_total`` included)."""
    return {s.name for f in text_string_to_metric_families(text) for s in f.samples}


class DeployFileTests(SynchronousTestCase):
    def test_dashboard_panels_the_issue_asks_for(self) -> None:
        with open(DASHBOARD, encoding="utf-8") as f:
            board = json.load(f)
        titles = " | ".join(p["title"].lower() for p in board["panels"])
        for words in ("slots", "queue", "tokens/s", "load failures", "latency", "first byte"):
            self.assertIn(words, titles)

    def test_dashboard_and_alerts_name_only_series_the_agent_exports(self) -> None:
        """Against a unit scrape with a dispatcher and a child's telemetry; the
        integration test checks the same against a real agent and llama-server."""
        from types import SimpleNamespace

        client = SimpleNamespace(state="registered", last_success=1.0, heartbeats_ok=1, heartbeats_failed=0,
                                 registrations_ok=1, registrations_failed=0)
        h = MetricsTests().harness()
        h.root.dispatcher = client
        h.metrics.observe("request", endpoint="chat/completions", model="a", status=200, duration=0.1, ttfb=0.01)
        exported = exported_series(h.metrics.render().decode())
        for expr in dashboard_exprs() + alert_exprs():
            missing = series_in(expr) - exported
            self.assertEqual(missing, set(), expr)

    def test_alert_rules_cover_the_issue(self) -> None:
        names = {rule["alert"] for group in yaml.safe_load(open(ALERTS, encoding="utf-8"))["groups"]
                 for rule in group["rules"]}
        for expected in ("RoleMeshChildCrashLooping", "RoleMeshQueueFull", "RoleMeshDispatcherUnreachable",
                         "RoleMeshDeviceMetricsStale"):
            self.assertIn(expected, names)

    def test_promtool_check_rules(self) -> None:
        promtool = shutil.which("promtool")
        if promtool is None:
            raise SkipTest(NO_PROMTOOL)
        result = subprocess.run([promtool, "check", "rules", ALERTS], capture_output=True, timeout=60)
        self.assertEqual(result.returncode, 0, (result.stdout + result.stderr).decode())
