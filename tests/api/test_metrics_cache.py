"""``GET /metrics`` from a cache (``NodeMetrics.render``): after every kind of
change to what the metrics show -- events, the scheduler's books, children
starting, crashing and backing off, sampling ticks, telemetry, the prompt
tally, the dispatcher, drains and reloads, the clock alone -- a scrape is
byte for byte the uncached render (``render_uncached``: ``generate_latest``
over the registry); a scrape of nothing new renders nothing again.

The same steps run with one part or family made never to re-render: each
such fault is caught, so the steps reach every input."""

from __future__ import annotations

import re
from types import SimpleNamespace
from typing import Any, Callable, Dict, List, Optional, Tuple

from hypothesis import given, settings
from hypothesis import strategies as st
from treq.testing import StubTreq
from twisted.trial.unittest import SynchronousTestCase

from rolemesh.api import live_metrics
from rolemesh.base import errors
from rolemesh.base.devices import DeviceMetrics
from rolemesh.children.telemetry import TelemetrySampler
from rolemesh.scheduling.fairqueue import Share
from tests.api.test_metrics import Harness
from tests.children.test_telemetry import FakeChild, child_metrics, child_slots
from tests.fixtures.fakes import make_config

GiB = 1 << 30
#: What every config of these tests shares (NodeHarness's timings, Harness's limit).
TOP = dict(max_pending_requests_per_device=2, idle_unload_s=30, llama_server_startup_timeout_s=10.0,
           llama_server_probe_interval_s=0.5, llama_server_stop_timeout_s=5.0)
MODELS = [{"model_id": "a", "roles": ["chat"]}, {"model_id": "b", "alias": "bee"}]
#: Configs a reload switches between: models added, removed, a command changed, tenants named.
CONFIGS = [
    lambda: make_config(MODELS, **TOP),
    lambda: make_config(MODELS + [{"model_id": "c"}], **TOP),
    lambda: make_config(MODELS[:1], **TOP),
    lambda: make_config([dict(MODELS[0], ctx_size=1024), MODELS[1]], **TOP),
    lambda: make_config(MODELS, api_keys=[{"name": "t1", "key": "key-one"}, {"name": "t2", "key": "key-two"}],
                        **TOP),
]


class CacheHarness(Harness):
    """Harness with a child's telemetry (a StubTreq'd FakeChild), a
    dispatcher client to set, and the leases the steps hold."""

    def __init__(self) -> None:
        super().__init__(count=2, idle_unload_s=30)
        self.child = FakeChild()
        self.stub = StubTreq(self.child)
        self.node.telemetry = TelemetrySampler(self.node.supervisors, reactor=self.reactor, get=self.stub.get)
        self.client = SimpleNamespace(state="unregistered", last_success=None, heartbeats_ok=0,
                                      heartbeats_failed=0, registrations_ok=0, registrations_failed=0)
        self.leases: List[Any] = []

    # -- the steps: each changes one input (n picks among its variants) -----------------

    def event(self, n: int) -> None:
        m, model, device = self.metrics, "ab?"[n % 3], ("gpu:0", "gpu:1", "gpu:9")[n % 3]
        name = ["request", "queue_wait", "queue_full", "queue_timeout", "idle_unload", "tenant_limit", "load",
                "crash", "restart", "load_failure", "load_timeout", "safe_mode_retry"][n % 12]
        m.observe(name, endpoint=("chat/completions", "embeddings", "/v1/evil")[n % 3], model=model,
                  status=(200, 429, 499, 503)[n % 4], duration=n / 7.0, ttfb=n / 50.0, device=device,
                  seconds=n / 3.0, tenant=("t1", "t2", "someone")[n // 12 % 3])

    def acquire(self, n: int) -> None:
        model = self.config.model("ab"[n % 2]) if self.node.config.models else None
        if model is None or model.model_id not in {m.model_id for m in self.node.config.models}:
            return
        d = self.node.acquire(model, device=(None, "gpu:0", "gpu:1")[n % 3], share=Share(("t1", "t2", "x")[n % 3]))
        d.addCallbacks(self.leases.append, lambda f: f.trap(errors.ApiError))

    def release(self, n: int) -> None:
        if self.leases:
            self.leases.pop(n % len(self.leases)).release()

    def ready(self, n: int) -> None:
        self.probe.ready = set() if n % 4 == 3 else {"a", "bee", "c"}
        self.reactor.advance(0.5)

    def exit(self, n: int) -> None:
        live = [p for p in self.reactor.processes if not p.ended]
        if live:
            live[n % len(live)].exit(*((0, None), (1, None), (0, 9))[n % 3])

    def advance(self, n: int) -> None:
        self.reactor.advance((0.25, 1.0, 5.0, 16.0, 31.0, 120.0)[n % 6])

    def telemetry(self, n: int) -> None:
        self.child.status = 500 if n % 5 == 4 else 200
        self.child.metrics = child_metrics(processing=n % 3, predicted=10 * n, prompt=n)
        self.child.slots = child_slots(busy=n % 3, total=2, decoded=n)
        self.node.telemetry.sample()
        self.stub.flush()

    def prompt_tokens(self, n: int) -> None:
        self.node.prompt_cache.add(("gpu:0", "gpu:1")[n % 2], ("a", "b", "gone")[n % 3], n, 2 * n + 1)

    def prefixes(self, n: int) -> None:
        prefixes = self.node.prefixes
        prefixes.remember([n % 4], "gpu:0")
        prefixes.lookup([n % 3])

    def dispatcher(self, n: int) -> None:
        client = self.client
        if n % 6 == 0:
            self.root.dispatcher = None if self.root.dispatcher is not None else client
        elif n % 6 == 1:
            client.heartbeats_ok += 1
            client.last_success = self.reactor.seconds()
        elif n % 6 == 2:
            client.heartbeats_failed += 1
        elif n % 6 == 3:
            client.registrations_ok += 1
        elif n % 6 == 4:
            client.registrations_failed += 1
        else:
            client.state = live_metrics.DISPATCHER_STATES[n % len(live_metrics.DISPATCHER_STATES)]

    def devices(self, n: int) -> None:
        """The backend's next sample changes, or a sample is put or dropped as a test would."""
        if n % 4 == 0:
            self.backend.free = (n % 8) * GiB
        elif n % 4 == 1:
            self.backend.fail_with = None if self.backend.fail_with is not None else RuntimeError("gone")
        elif n % 4 == 2:
            self.node.metrics["gpu:1"] = DeviceMetrics("gpu:1", self.reactor.seconds() - n, 16 * GiB, n * GiB,
                                                       (16 - n % 16) * GiB, float(n % 100), 40.0 + n, None)
        else:
            self.node.metrics.pop("gpu:0", None)

    def drain(self, n: int) -> None:
        self.node.draining = not self.node.draining

    def reload(self, n: int) -> None:
        self.node.reconfigure(CONFIGS[n % len(CONFIGS)]())


STEPS = ["event", "acquire", "release", "ready", "exit", "advance", "telemetry", "prompt_tokens", "prefixes",
         "dispatcher", "devices", "drain", "reload"]

#: Steps that reach every input: children loading, serving, failing and
#: backing off, the scheduler's books, every event family, the samplers,
#: the dispatcher and the reloads, with the clock moving in between.
SCRIPT: List[Tuple[str, int]] = (
    [("dispatcher", 0)]
    + [("event", n) for n in range(24)]
    + [("acquire", 0), ("acquire", 1), ("acquire", 2), ("advance", 0), ("ready", 0), ("release", 0),
       ("telemetry", 1), ("advance", 1), ("telemetry", 2), ("telemetry", 4), ("advance", 0), ("telemetry", 3),
       ("prompt_tokens", 1), ("prompt_tokens", 5), ("prefixes", 1), ("prefixes", 2),
       ("dispatcher", 1), ("dispatcher", 2), ("dispatcher", 3), ("dispatcher", 4), ("dispatcher", 5),
       ("advance", 1), ("devices", 0), ("advance", 2), ("devices", 1), ("advance", 2), ("devices", 1),
       ("devices", 2), ("devices", 3), ("advance", 2),
       ("release", 0), ("release", 0), ("exit", 0), ("exit", 1), ("acquire", 0), ("exit", 1), ("advance", 3),
       ("acquire", 1), ("ready", 0), ("advance", 4), ("exit", 0), ("exit", 0), ("drain", 0), ("drain", 0),
       ("reload", 1), ("release", 0), ("release", 0), ("advance", 5), ("acquire", 0), ("ready", 0),
       ("reload", 3), ("release", 0), ("reload", 2), ("reload", 4), ("event", 1), ("event", 13), ("event", 17),
       ("acquire", 0), ("acquire", 2), ("ready", 0), ("release", 0), ("advance", 5), ("dispatcher", 0)]
)

#: What the script's scrapes show at one step or another (so that it keeps
#: reaching every kind of state as the agent changes).
REACHED = [
    r'rolemesh_model_backoff_failures\{[^}]*\} [1-9]',
    r'rolemesh_device_telemetry_stale\{[^}]*\} 1',
    r'rolemesh_device_telemetry_stale\{[^}]*\} 0',
    r'rolemesh_llamacpp_tokens_predicted_total\{[^}]*\} [1-9]',
    r'rolemesh_device_metrics_stale\{device="gpu:0"\} 1',
    r'rolemesh_device_temperature_celsius\{',
    r'rolemesh_child_stale\{[^}]*\} 1',
    r'rolemesh_child_model\{device="gpu:[01]",model="b"\} 1',
    r'rolemesh_child_crashes_total\{[^}]*\} [1-9]',
    r'rolemesh_model_load_failures_total\{[^}]*\} [1-9]',
    r'rolemesh_idle_unloads_total\{device="gpu:[01]",model="[ab]"\} [1-9]',
    r'rolemesh_tenant_running\{tenant="t1"\} [1-9]',
    r'rolemesh_tenant_queue_wait_seconds_count\{tenant="t1"\} [1-9]',
    r'rolemesh_device_queue_depth\{[^}]*\} [1-9]',
    r'rolemesh_prefix_hits_total [1-9]',
    r'rolemesh_prompt_tokens_cached_total\{device="gpu:1",model="gone"\} [1-9]',
    r'rolemesh_node_draining 1',
    r'rolemesh_dispatcher_state\{state="unreachable"\} 1',
    r'model="c"',
]


class Mismatch(AssertionError):
    """The cached scrape differs from the uncached render."""


def drive(h: CacheHarness, steps: List[Tuple[str, int]]) -> None:
    """Each step, then the cached scrape against the uncached render."""
    first = h.metrics.render()
    if first != h.metrics.render_uncached():
        raise Mismatch("before any step")
    for i, (step, n) in enumerate(steps):
        getattr(h, step)(n)
        cached, fresh = h.metrics.render(), h.metrics.render_uncached()
        if cached != fresh:
            diff = sorted(set(cached.splitlines()) ^ set(fresh.splitlines()))[:6]
            raise Mismatch(f"after step {i} {step}({n}): {diff}")


class _Stuck:
    """A cached key equal to every key: the part is never rendered again."""

    def __eq__(self, other: object) -> bool:
        return True

    def __ne__(self, other: object) -> bool:
        return False

    __hash__ = None  # type: ignore[assignment]


class _StuckCache(Dict[str, Tuple[Any, bytes]]):
    """LiveCollector's cache, with one part's entry stuck once it is there."""

    def __init__(self, stuck: str) -> None:
        super().__init__()
        self.stuck = stuck

    def get(self, name: str, default: Any = None) -> Any:
        entry = super().get(name, default)
        return (_Stuck(), entry[1]) if entry is not None and name == self.stuck else entry


def _stuck_text(text: Callable[[], bytes]) -> Callable[[], bytes]:
    """A family's ``text`` that keeps its first rendering forever."""
    first: List[bytes] = []

    def stuck() -> bytes:
        if not first:
            first.append(text())
        return first[0]
    return stuck


class CacheTests(SynchronousTestCase):
    def test_every_step_of_the_script_scrapes_as_uncached(self) -> None:
        drive(CacheHarness(), SCRIPT)

    def test_the_script_reaches_every_kind_of_state(self) -> None:
        h, shown = CacheHarness(), set()
        for step, n in SCRIPT:
            getattr(h, step)(n)
            text = h.metrics.render().decode("utf-8")
            shown.update(pattern for pattern in REACHED if re.search(pattern, text))
        self.assertEqual([pattern for pattern in REACHED if pattern not in shown], [])

    @settings(max_examples=30)
    @given(st.lists(st.tuples(st.sampled_from(STEPS), st.integers(0, 60)), max_size=30))
    def test_any_steps_scrape_as_uncached(self, steps: List[Tuple[str, int]]) -> None:
        drive(CacheHarness(), steps)

    def test_a_part_never_rendered_again_is_caught(self) -> None:
        """The script changes what every live part shows: a part whose cached
        text were never replaced would show stale figures, and does not pass."""
        for part in live_metrics.PARTS:
            h = CacheHarness()
            h.metrics.live._cache = _StuckCache(part.name)
            self.assertRaises(Mismatch, drive, h, SCRIPT)

    def test_a_family_never_rendered_again_is_caught(self) -> None:
        for index in range(len(CacheHarness().metrics._families)):
            h = CacheHarness()
            family = h.metrics._families[index]
            family.text = _stuck_text(family.text)  # type: ignore[method-assign]
            self.assertRaises(Mismatch, drive, h, SCRIPT)

    def test_the_created_switch_is_followed(self) -> None:
        from prometheus_client import metrics as prometheus_metrics

        h = CacheHarness()
        drive(h, SCRIPT[:30])
        self.assertIn(b"_created", h.metrics.render())
        self.patch(prometheus_metrics, "_use_created", False)
        self.assertNotIn(b"_created", h.metrics.render())
        self.assertEqual(h.metrics.render(), h.metrics.render_uncached())


class RenderCountTests(SynchronousTestCase):
    """What a scrape renders again: nothing when nothing changed."""

    def setUp(self) -> None:
        self.h = CacheHarness()
        drive(self.h, SCRIPT[:45])  # a ready child with telemetry, a dispatcher, requests counted
        self.metrics = self.h.metrics
        self.text = self.metrics.render()

    def changed(self, scrape: Callable[[], Optional[bytes]]) -> List[str]:
        """The families and live parts a scrape rendered again."""
        families = {f.name: f.text() for f in self.metrics._families}
        parts = dict(self.metrics.live._cache)
        scrape()
        self.assertEqual(self.metrics.render(), self.metrics.render_uncached())
        return sorted([f.name for f in self.metrics._families if f.text() is not families[f.name]]
                      + [name for name, entry in self.metrics.live._cache.items() if entry is not parts.get(name)])

    def test_a_second_scrape_renders_nothing(self) -> None:
        renders = self.metrics.renders
        self.assertEqual(self.changed(self.metrics.render), [])
        self.assertEqual(self.metrics.renders, renders)
        self.assertEqual(self.metrics.render(), self.text)

    def test_the_clock_alone_renders_the_ages_again(self) -> None:
        self.assertEqual(self.changed(lambda: self.h.reactor.advance(0.125)),
                         ["device_age", "dispatcher_since", "telemetry_age"])

    def test_a_request_renders_its_families_again(self) -> None:
        def request() -> None:
            self.metrics.observe("request", endpoint="chat/completions", model="a", status=200, duration=0.1,
                                 ttfb=0.01)
        self.assertEqual(self.changed(request), ["rolemesh_request_duration_seconds",
                                                 "rolemesh_request_ttfb_seconds", "rolemesh_requests"])

    def test_a_lease_renders_the_scheduler_again(self) -> None:
        def lease() -> None:
            self.h.acquire(0)
        self.assertEqual(self.changed(lease), ["scheduler"])
