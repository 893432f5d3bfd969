"""Tests for the dispatcher protocol: payload builders, schemas, backoff and
the :class:`DispatcherClient` service, all on a ``task.Clock`` with
``StubTreq`` in front of :class:`tests.fixtures.fake_dispatcher.FakeDispatcher`."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Sequence
from itertools import count
from typing import Any

import attr
from hypothesis import given, settings
from hypothesis import strategies as st
from jsonschema import Draft202012Validator
from jsonschema.exceptions import ValidationError
from treq.testing import StubTreq
from twisted.internet.defer import fail
from twisted.internet.error import ConnectionRefusedError
from twisted.internet.task import Clock
from twisted.internet.testing import MemoryReactorClock
from twisted.logger import capturedLogs, formatEvent
from twisted.trial.unittest import SynchronousTestCase
from twisted.web.resource import Resource

from rolemesh import __version__
from rolemesh.base.devices import DeviceMetrics, DeviceRef
from rolemesh.children.state import DeviceState
from rolemesh.config.file import BACKEND_NAMES, LoraAdapter, ModelConfig, NodeConfig
from rolemesh.fleet.dispatcher import (
    REGISTERED,
    UNREACHABLE,
    UNREGISTERED,
    Backoff,
    DispatcherClient,
)
from rolemesh.node.payloads import (
    CAPABILITIES,
    DEVICE_STATES,
    device_state,
    heartbeat_payload,
    model_capabilities,
    registration_payload,
)
from rolemesh.schemas import load_schema
from tests.fixtures import REPO
from tests.fixtures.fake_dispatcher import FakeDispatcher

TOKEN = "tok-9f3c1e2d-very-secret"
BASE = "http://dispatcher.test:9000"
INTERVAL = 5.0

REGISTRATION_SCHEMA = Draft202012Validator(load_schema("registration"))
HEARTBEAT_SCHEMA = Draft202012Validator(load_schema("heartbeat"))

CONFIG = NodeConfig(
    node_id="node-a",
    advertise_url="http://10.0.0.5:8090",
    max_pending_requests_per_device=3,
    dispatcher_base_url=BASE,
    dispatcher_token=TOKEN,
    api_keys=("client-key-should-not-leak",),
    models=(
        ModelConfig(model_id="qwen-7b", path="/models/qwen.gguf", roles=("chat", "code")),
        ModelConfig(model_id="nomic-embed", path="/models/nomic.gguf", roles=("embed",), alias="embed",
                    server_args=(("embeddings", True), ("pooling", "mean"))),
    ),
)
DEVICES = (
    DeviceRef(backend="cpu", index=0, name="cpu:0", vendor="GenuineIntel", model="Xeon",
              memory_total_bytes=64 * 2**30, cpus=(0, 1, 2, 3)),
)
#: A node whose first model has two LoRA adapters (issue 28): each a model id of its own.
ADAPTER_CONFIG = attr.evolve(CONFIG, models=(
    attr.evolve(CONFIG.models[0], lora_adapters=(LoraAdapter("qwen-7b:sql", "/models/sql.gguf", 1.0),
                                                 LoraAdapter("qwen-7b:terse", "/models/terse.gguf", 0.5))),
    CONFIG.models[1],
))


def messages(events: Sequence[dict[str, Any]]) -> list[str]:
    return [formatEvent(e) for e in events]


def count_containing(events: Sequence[dict[str, Any]], text: str) -> int:
    return sum(1 for m in messages(events) if text in m)


class RecordingHTTP:
    """A treq-like client whose every request fails to connect."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, dict[str, Any]]] = []

    def post(self, url: str, **kwargs: Any) -> Any:
        self.calls.append((url, kwargs))
        return fail(ConnectionRefusedError("127.0.0.1:9"))


class Harness:
    """A client wired to a fake dispatcher through StubTreq, on a Clock."""

    def __init__(self, token: str | None = TOKEN, http: Any = None, fake: FakeDispatcher | None = None,
                 base: str = BASE, **kwargs: Any) -> None:
        self.clock = Clock()
        self.fake = fake if fake is not None else FakeDispatcher(clock=self.clock)
        self.stub = StubTreq(self.fake.resource())
        self.seq = count(1)
        self.results: list[tuple[str, bool]] = []
        kwargs.setdefault("random", lambda: 0.5)
        kwargs.setdefault("on_result", lambda kind, ok: self.results.append((kind, ok)))
        self.client = DispatcherClient(
            base, token, self.registration, self.heartbeat, INTERVAL,
            reactor=self.clock, http=http if http is not None else self.stub, **kwargs,
        )

    def registration(self) -> dict[str, Any]:
        return registration_payload(CONFIG, "cpu", DEVICES, __version__)

    def heartbeat(self) -> dict[str, Any]:
        now = self.clock.seconds()
        metrics = DeviceMetrics(device="cpu:0", sampled_at=now - 1.0, memory_total_bytes=64 * 2**30,
                                memory_used_bytes=2**30, memory_free_bytes=63 * 2**30, utilization_pct=12.5)
        state = device_state("cpu:0", "ready", now=now, model="qwen-7b", port=41234, pid=4242,
                             in_flight=1, queued=0, pending_limit=3, metrics=metrics)
        return heartbeat_payload(CONFIG.node_id, next(self.seq), now, [state])

    def start(self) -> None:
        self.client.startService()
        self.advance(0)

    def advance(self, seconds: float, step: float = 0.25) -> None:
        """Move the clock forward in small steps, pumping the in-memory HTTP."""
        self.clock.advance(0)
        self.stub.flush()
        remaining = seconds
        while remaining > 1e-9:
            delta = min(step, remaining)
            self.clock.advance(delta)
            self.stub.flush()
            remaining -= delta
        self.clock.advance(0)
        self.stub.flush()

    def stop(self) -> list[Any]:
        results: list[Any] = []
        self.client.stopService().addBoth(results.append)
        self.stub.flush()
        return results

    def times(self, kind: str) -> list[float]:
        return [r.at for r in self.fake.of_kind(kind) if r.at is not None]


# ----------------------------------------------------------------------
# Backoff (pure)

unit = st.floats(min_value=0.0, max_value=1.0, exclude_max=True)


class BackoffTests(SynchronousTestCase):
    @given(
        base=st.floats(min_value=0.01, max_value=10.0),
        factor=st.floats(min_value=1.0, max_value=1000.0),
        draws=st.lists(unit, min_size=1, max_size=60),
    )
    def test_delays_within_full_jitter_bounds(self, base: float, factor: float, draws: list[float]) -> None:
        """The n-th delay lies in [0, min(cap, base * 2**n)]."""
        cap = base * factor
        values = iter(draws)
        backoff = Backoff(base, cap, random=lambda: next(values))
        for n in range(len(draws)):
            delay = backoff.next_delay()
            self.assertGreaterEqual(delay, 0.0)
            self.assertLessEqual(delay, min(cap, base * 2.0 ** min(n, 1000)))

    @given(base=st.floats(min_value=0.01, max_value=10.0), factor=st.floats(min_value=1.0, max_value=1000.0),
           n=st.integers(min_value=1, max_value=200))
    def test_ceiling_grows_then_caps(self, base: float, factor: float, n: int) -> None:
        cap = base * factor
        backoff = Backoff(base, cap, random=lambda: 0.999999)
        ceilings = []
        for _ in range(n):
            ceilings.append(backoff.ceiling)
            backoff.next_delay()
        self.assertEqual(ceilings[0], base)
        for before, after in zip(ceilings[:-1], ceilings[1:]):  # noqa: RUF007 (3.9 has no pairwise)
            self.assertEqual(after, min(cap, before * 2))
        self.assertTrue(all(c <= cap for c in ceilings))
        if n > 12 and factor < 2**11:
            self.assertEqual(ceilings[-1], cap)

    @given(draws=st.lists(unit, min_size=1, max_size=30))
    def test_reset_on_success(self, draws: list[float]) -> None:
        values = iter(draws)
        backoff = Backoff(0.5, 8.0, random=lambda: next(values))
        for _ in draws:
            backoff.next_delay()
        self.assertEqual(backoff.attempts, len(draws))
        backoff.reset()
        self.assertEqual((backoff.ceiling, backoff.attempts), (0.5, 0))

    def test_jitter_spans_the_range(self) -> None:
        self.assertEqual(Backoff(1.0, 4.0, random=lambda: 0.0).next_delay(), 0.0)
        self.assertAlmostEqual(Backoff(1.0, 4.0, random=lambda: 0.999999).next_delay(), 1.0, places=5)
        self.assertEqual(Backoff(1.0, 4.0, random=lambda: 0.5).next_delay(), 0.5)

    def test_grows_without_overflow(self) -> None:
        backoff = Backoff(1e-3, 30.0, random=lambda: 0.5)
        for _ in range(5000):
            delay = backoff.next_delay()
        self.assertEqual(delay, 15.0)

    def test_invalid_parameters(self) -> None:
        for base, cap in ((0.0, 1.0), (-1.0, 1.0), (2.0, 1.0), (1.0, float("inf")), (float("nan"), 1.0)):
            self.assertRaises(ValueError, Backoff, base, cap)


# ----------------------------------------------------------------------
# Payloads and schemas (pure)

names = st.from_regex(r"[a-z][a-z0-9._-]{0,15}", fullmatch=True)
opt_int = st.none() | st.integers(min_value=0, max_value=2**50)
opt_num = st.none() | st.floats(min_value=0, max_value=1e6, allow_nan=False)

device_refs = st.builds(
    DeviceRef,
    backend=st.sampled_from(["cuda", "rocm", "cpu"]),
    index=st.integers(min_value=0, max_value=15),
    name=st.builds(lambda k, i: f"{k}:{i}", st.sampled_from(["gpu", "cpu"]), st.integers(0, 15)),
    uuid=st.none() | st.uuids().map(str),
    vendor=st.none() | names,
    model=st.none() | st.text(max_size=20),
    memory_total_bytes=opt_int,
    cpus=st.lists(st.integers(min_value=0, max_value=255), max_size=8).map(tuple),
)
model_configs = st.builds(
    ModelConfig,
    model_id=names,
    path=st.just("/models/m.gguf"),
    roles=st.lists(names, max_size=4).map(tuple),
    alias=st.none() | names,
)


@st.composite
def device_states(draw: Any, now: float) -> dict[str, Any]:
    name = draw(st.builds(lambda i: f"gpu:{i}", st.integers(0, 7)))
    metrics = draw(st.none() | st.builds(
        DeviceMetrics,
        device=st.just(name),
        sampled_at=st.floats(min_value=now - 3600, max_value=now + 5),
        memory_total_bytes=opt_int, memory_used_bytes=opt_int, memory_free_bytes=opt_int,
        utilization_pct=st.none() | st.floats(min_value=0, max_value=100),
        temperature_c=st.none() | st.floats(min_value=-40, max_value=120),
        power_w=opt_num, stale=st.booleans(), error=st.none() | st.text(max_size=40),
    ))
    state = draw(st.sampled_from(DEVICE_STATES))
    loaded = state in ("starting", "ready", "stopping")
    return device_state(
        name, state, now=now,
        model=draw(names) if loaded else None,
        port=draw(st.integers(1024, 65535)) if loaded else None,
        pid=draw(st.integers(2, 2**22)) if loaded else None,
        in_flight=draw(st.integers(0, 8)), queued=draw(st.integers(0, 8)),
        pending_limit=draw(st.integers(1, 16)), restarts=draw(st.integers(0, 100)),
        metrics=metrics,
    )


class PayloadTests(SynchronousTestCase):
    def test_the_schemas_name_the_same_sets_as_the_code(self) -> None:
        """The shipped contract and the code say one thing: the device states
        are the supervisor's, the backends config.BACKEND_NAMES, the
        capabilities CAPABILITIES."""
        registration, heartbeat = load_schema("registration"), load_schema("heartbeat")
        device = heartbeat["$defs"]["device_state"]["properties"]
        self.assertEqual(device["state"]["enum"], [str(s) for s in DeviceState])
        self.assertEqual(list(DEVICE_STATES), [str(s) for s in DeviceState])
        self.assertEqual(registration["properties"]["backend"]["enum"], list(BACKEND_NAMES))
        self.assertEqual(registration["properties"]["capabilities"]["items"]["enum"], list(CAPABILITIES))

    def test_registration_fields(self) -> None:
        payload = registration_payload(CONFIG, "cpu", DEVICES, "9.9.9")
        REGISTRATION_SCHEMA.validate(payload)
        self.assertEqual(payload["node_id"], "node-a")
        self.assertEqual(payload["advertise_url"], "http://10.0.0.5:8090")
        self.assertEqual(payload["agent_version"], "9.9.9")
        self.assertEqual(payload["backend"], "cpu")
        self.assertEqual(payload["devices"], [DEVICES[0].to_json()])
        self.assertEqual(payload["served_models"], [
            {"model_id": "qwen-7b", "alias": None, "roles": ["chat", "code"],
             "capabilities": ["chat.completions", "completions", "streaming"]},
            {"model_id": "nomic-embed", "alias": "embed", "roles": ["embed"],
             "capabilities": ["chat.completions", "completions", "embeddings", "streaming"]},
        ])
        self.assertEqual(payload["capabilities"],
                         ["chat.completions", "completions", "embeddings", "streaming"])
        self.assertEqual(tuple(payload["capabilities"]), CAPABILITIES)

    def test_each_lora_adapter_is_a_served_model_of_its_own(self) -> None:
        memory = {"qwen-7b": {"memory_estimate": {"total_bytes": 5 << 30}, "devices": ["cpu:0"],
                              "fits_on": ["cpu:0"]}}
        payload = registration_payload(ADAPTER_CONFIG, "cpu", DEVICES, "1", memory=memory)
        REGISTRATION_SCHEMA.validate(payload)
        served = payload["served_models"]
        self.assertEqual([m["model_id"] for m in served], ["qwen-7b", "qwen-7b:sql", "qwen-7b:terse", "nomic-embed"])
        base, sql = served[0], served[1]
        self.assertEqual(sql, {"model_id": "qwen-7b:sql", "alias": None, "roles": [],
                               "capabilities": base["capabilities"], "devices": ["cpu:0"], "fits_on": ["cpu:0"],
                               "base_model": "qwen-7b"})
        self.assertNotIn("base_model", base)
        self.assertEqual(base["memory_estimate_bytes"], 5 << 30)  # the base's child holds the adapters
        self.assertNotIn("/models/", json.dumps(payload))
        without_memory = registration_payload(ADAPTER_CONFIG, "cpu", DEVICES, "1")["served_models"][2]
        self.assertEqual(without_memory, {"model_id": "qwen-7b:terse", "alias": None, "roles": [],
                                          "capabilities": base["capabilities"], "base_model": "qwen-7b"})

    def test_capabilities_follow_the_childs_command_line(self) -> None:
        # llama-server answers /v1/embeddings with 501 unless started with
        # --embeddings: a node whose models are not started so does not offer it.
        chat_only = attr.evolve(CONFIG, models=(CONFIG.models[0],))
        payload = registration_payload(chat_only, "cpu", DEVICES, "1")
        REGISTRATION_SCHEMA.validate(payload)
        self.assertEqual(payload["capabilities"], ["chat.completions", "completions", "streaming"])
        self.assertNotIn("embeddings", payload["served_models"][0]["capabilities"])
        spelled = attr.evolve(CONFIG.models[0], server_args=(("embedding", True),))
        self.assertIn("embeddings", model_capabilities(spelled), "llama-server's other spelling")
        off = attr.evolve(CONFIG.models[1], server_args=(("embeddings", False),))
        self.assertNotIn("embeddings", model_capabilities(off))
        self.assertEqual(payload["max_pending_requests_per_device"], 3)

    def test_no_secrets_or_paths_in_payloads(self) -> None:
        text = json.dumps([registration_payload(CONFIG, "cpu", DEVICES, "1"), Harness().heartbeat()])
        for secret in (TOKEN, "client-key-should-not-leak", "/models/"):
            self.assertNotIn(secret, text)

    def test_heartbeat_fields(self) -> None:
        metrics = DeviceMetrics(device="cpu:0", sampled_at=100.0, utilization_pct=50.0)
        entry = device_state("cpu:0", "ready", now=102.5, model="qwen-7b", port=4000, pid=99,
                             in_flight=1, queued=1, pending_limit=2, restarts=1, metrics=metrics)
        payload = heartbeat_payload("node-a", 7, 102.5, [entry])
        HEARTBEAT_SCHEMA.validate(payload)
        self.assertEqual((payload["node_id"], payload["seq"], payload["time"]), ("node-a", 7, 102.5))
        (device,) = payload["devices"]
        self.assertEqual(device["metrics"]["sample_age_s"], 2.5)
        self.assertEqual(device["metrics"]["stale"], False)
        self.assertEqual(
            {k: v for k, v in device.items() if k != "metrics"},
            {"device": "cpu:0", "state": "ready", "model": "qwen-7b", "port": 4000, "pid": 99,
             "in_flight": 1, "queued": 1, "pending_limit": 2, "restarts": 1},
        )

    def test_heartbeat_converts_metrics_records_and_copies(self) -> None:
        metrics = DeviceMetrics(device="cpu:0", sampled_at=10.0).marked_stale("nvml gone")
        entry = dict(device_state("cpu:0", "stopped", now=10.0, pending_limit=2), metrics=metrics)
        payload = heartbeat_payload("n", 1, 12.0, [entry])
        HEARTBEAT_SCHEMA.validate(payload)
        self.assertEqual(payload["devices"][0]["metrics"]["sample_age_s"], 2.0)
        self.assertEqual(payload["devices"][0]["metrics"]["error"], "nvml gone")
        self.assertIs(entry["metrics"], metrics)

    @settings(max_examples=150)
    @given(models=st.lists(model_configs, max_size=5), devices=st.lists(device_refs, max_size=4),
           backend=st.sampled_from(["cuda", "rocm", "metal", "sycl", "vulkan", "cpu"]),
           pending=st.integers(1, 64))
    def test_generated_registrations_validate(self, models: list[ModelConfig], devices: list[DeviceRef],
                                              backend: str, pending: int) -> None:
        config = attr.evolve(CONFIG, models=tuple(models), max_pending_requests_per_device=pending)
        payload = registration_payload(config, backend, devices, __version__)
        REGISTRATION_SCHEMA.validate(payload)
        self.assertEqual(json.loads(json.dumps(payload)), payload)

    @settings(max_examples=150)
    @given(data=st.data(), now=st.floats(min_value=1e9, max_value=2e9), seq=st.integers(0, 2**40))
    def test_generated_heartbeats_validate(self, data: Any, now: float, seq: int) -> None:
        states = data.draw(st.lists(device_states(now), max_size=6))
        payload = heartbeat_payload("node-a", seq, now, states)
        HEARTBEAT_SCHEMA.validate(payload)
        self.assertEqual(json.loads(json.dumps(payload)), payload)

    def test_schemas_are_strict(self) -> None:
        good_reg = registration_payload(CONFIG, "cpu", DEVICES, "1")
        good_hb = Harness().heartbeat()
        bad = [
            (REGISTRATION_SCHEMA, dict(good_reg, token=TOKEN)),
            (REGISTRATION_SCHEMA, {k: v for k, v in good_reg.items() if k != "served_models"}),
            (REGISTRATION_SCHEMA, dict(good_reg, backend="auto")),
            (REGISTRATION_SCHEMA, dict(good_reg, served_models=[{"model_id": "x", "roles": []}])),
            (REGISTRATION_SCHEMA, dict(good_reg, advertise_url="10.0.0.5:8090")),
            (HEARTBEAT_SCHEMA, dict(good_hb, seq="1")),
            (HEARTBEAT_SCHEMA, dict(good_hb, devices=[dict(good_hb["devices"][0], state="loading")])),
            (HEARTBEAT_SCHEMA, dict(good_hb, devices=[dict(good_hb["devices"][0], in_flight=-1)])),
            (HEARTBEAT_SCHEMA, dict(good_hb, devices=[dict(good_hb["devices"][0], extra=1)])),
        ]
        for validator, payload in bad:
            self.assertRaises(ValidationError, validator.validate, payload)

    def test_documented_examples_validate(self) -> None:
        """The examples in docs/dispatcher-protocol.md match the shipped schemas."""
        path = os.path.join(REPO,
                            "docs", "dispatcher-protocol.md")
        with open(path, encoding="utf-8") as f:
            text = f.read()
        blocks = re.findall(r"<!-- schema: (\w+) -->\n```json\n(.*?)```", text, re.DOTALL)
        self.assertEqual(sorted(name for name, _ in blocks), ["events", "heartbeat", "registration"])
        for name, body in blocks:
            Draft202012Validator(load_schema(name)).validate(json.loads(body))

    def test_load_schema(self) -> None:
        for name in ("registration", "heartbeat", "events"):
            Draft202012Validator.check_schema(load_schema(name))
        self.assertRaises(ValueError, load_schema, "../config")


# ----------------------------------------------------------------------
# The client service


class ScheduleTests(SynchronousTestCase):
    def test_registers_then_heartbeats_on_schedule(self) -> None:
        h = Harness()
        h.start()
        self.assertEqual(h.client.state, REGISTERED)
        h.advance(3 * INTERVAL)
        self.assertEqual(h.times("register"), [0.0])
        self.assertEqual(h.times("heartbeat"), [5.0, 10.0, 15.0])
        self.assertEqual([r.body["seq"] for r in h.fake.heartbeats], [1, 2, 3])
        self.assertEqual(h.fake.registrations[0].body, h.registration())
        for r in h.fake.registrations:
            REGISTRATION_SCHEMA.validate(r.body)
        for r in h.fake.heartbeats:
            HEARTBEAT_SCHEMA.validate(r.body)
            self.assertEqual(r.body["time"], r.at)
        self.assertEqual((h.client.heartbeats_ok, h.client.heartbeats_failed), (3, 0))
        self.assertEqual(h.client.last_success, 15.0)
        self.assertEqual(h.results, [("register", True)] + [("heartbeat", True)] * 3)

    def test_the_dispatcher_gets_the_adapter_model_ids(self) -> None:
        class AdapterHarness(Harness):
            def registration(self) -> dict[str, Any]:
                return registration_payload(ADAPTER_CONFIG, "cpu", DEVICES, __version__)

        h = AdapterHarness()
        h.start()
        body = h.fake.registrations[0].body
        REGISTRATION_SCHEMA.validate(body)
        self.assertEqual({m["model_id"]: m.get("base_model") for m in body["served_models"]},
                         {"qwen-7b": None, "qwen-7b:sql": "qwen-7b", "qwen-7b:terse": "qwen-7b",
                          "nomic-embed": None})

    def test_requests_are_json_posts_to_the_protocol_paths(self) -> None:
        h = Harness(base=BASE + "/")
        h.start()
        h.advance(INTERVAL)
        self.assertEqual([(r.method, r.path) for r in h.fake.received],
                         [("POST", "/v1/nodes/register"), ("POST", "/v1/nodes/heartbeat")])
        for r in h.fake.received:
            self.assertTrue(str(r.header("content-type")).startswith("application/json"))

    def test_start_does_not_wait_for_the_dispatcher(self) -> None:
        h = Harness()
        h.fake.hang = True
        h.client.startService()  # returns at once; nothing raised
        h.advance(0)
        self.assertEqual(h.client.state, UNREGISTERED)
        self.assertEqual(len(h.fake.registrations), 1)
        h.fake.release()

    def test_restart_after_stop_registers_again(self) -> None:
        h = Harness()
        h.start()
        self.assertEqual(h.stop(), [None])
        h.client.startService()
        h.advance(INTERVAL)
        self.assertEqual([r.kind for r in h.fake.received],
                         ["register", "deregister", "register", "heartbeat"])


class FailureTests(SynchronousTestCase):
    def test_registration_retried_in_background_until_it_works(self) -> None:
        h = Harness()
        h.fake.refuse = True
        h.start()
        h.advance(30)
        self.assertEqual(h.client.state, UNREACHABLE)
        self.assertGreater(len(h.fake.registrations), 5)
        self.assertEqual(h.fake.heartbeats, [])
        self.assertIsNone(h.client.last_success)
        h.fake.refuse = False
        h.advance(INTERVAL)
        self.assertEqual(h.client.state, REGISTERED)
        h.advance(INTERVAL)
        self.assertEqual(len(h.fake.heartbeats), 1)
        self.assertEqual(h.client.registrations_failed, len(h.fake.registrations) - 1)

    def test_backoff_delays_grow_and_cap_at_the_interval(self) -> None:
        h = Harness(random=lambda: 0.999999)
        h.fake.fail = True
        h.start()
        h.advance(60)
        times = h.times("register")
        gaps = [times[i + 1] - times[i] for i in range(len(times) - 1)]
        # Ceilings 1, 2, 4, 5, 5, ... (base 1 s, cap = the interval).
        self.assertEqual(gaps[:5], [1.0, 2.0, 4.0, 5.0, 5.0])
        self.assertTrue(all(g <= INTERVAL + 0.25 for g in gaps))
        # A success resets it: the next failure starts from the base again.
        h.fake.fail = False
        h.advance(INTERVAL)
        start = len(h.fake.received)
        h.fake.fail = True
        h.advance(INTERVAL + 1.0)
        first_failure = h.fake.received[start].at
        assert first_failure is not None
        self.assertEqual([r.at for r in h.fake.received[start:]][:2], [first_failure, first_failure + 1.0])

    @given(draws=st.lists(st.floats(min_value=0.001, max_value=0.999), min_size=8, max_size=8))
    @settings(max_examples=30, deadline=None)
    def test_jittered_retries_stay_within_bounds(self, draws: list[float]) -> None:
        values = iter(draws * 10)
        h = Harness(random=lambda: next(values))
        h.fake.fail = True
        h.start()
        ceilings = [1.0, 2.0, 4.0, 5.0, 5.0, 5.0, 5.0]
        for ceiling in ceilings:
            before = h.clock.seconds()
            calls: list[Any] = list(h.clock.getDelayedCalls())
            delayed = [c for c in calls if c.active()]
            self.assertEqual(len(delayed), 1)
            delay = delayed[0].getTime() - before
            self.assertGreaterEqual(delay, 0.0)
            self.assertLessEqual(delay, ceiling + 1e-9)
            h.clock.advance(delay)
            h.stub.flush()
        self.assertEqual(len(h.fake.registrations), len(ceilings) + 1)

    def test_server_errors_keep_retrying_heartbeats(self) -> None:
        h = Harness()
        h.start()
        h.advance(INTERVAL)
        h.fake.fail = True
        h.advance(20)
        self.assertEqual(h.client.state, UNREACHABLE)
        failed = h.client.heartbeats_failed
        self.assertGreater(failed, 4)
        self.assertEqual(h.fake.registrations[1:], [])  # still registered: heartbeats, not registrations
        h.fake.fail = False
        h.advance(INTERVAL)
        self.assertEqual(h.client.state, REGISTERED)
        self.assertEqual(h.client.heartbeats_failed, failed)
        self.assertIn(("heartbeat", False), h.results)

    def test_hang_is_bounded_by_the_request_timeout(self) -> None:
        h = Harness(request_timeout=2.0)
        h.start()
        h.fake.hang = True
        h.advance(INTERVAL)
        self.assertEqual(h.client.state, REGISTERED)  # waiting for the answer
        h.advance(2.0)
        self.assertEqual(h.client.state, UNREACHABLE)
        self.assertEqual(h.client.heartbeats_failed, 1)
        h.advance(20)
        self.assertGreater(len(h.fake.heartbeats), 3)
        h.fake.hang = False
        h.advance(INTERVAL + 2.0)
        self.assertEqual(h.client.state, REGISTERED)
        self.assertEqual(h.stop(), [None])
        self.assertEqual(h.clock.getDelayedCalls(), [])

    def test_connection_refused_keeps_retrying(self) -> None:
        http = RecordingHTTP()
        h = Harness(http=http)
        with capturedLogs() as events:
            h.start()
            h.advance(30)
        self.assertGreater(len(http.calls), 5)
        self.assertTrue(all(url == BASE + "/v1/nodes/register" for url, _ in http.calls))
        self.assertEqual(h.client.state, UNREACHABLE)
        self.assertEqual(count_containing(events, "dispatcher unreachable"), 1)
        self.assertEqual(count_containing(events, "Connection was refused"), 1)
        self.assertIs(http.calls[0][1]["reactor"], h.clock)

    def test_forgotten_node_registers_again(self) -> None:
        for status in (404, 410):
            h = Harness()
            h.fake.forget_status = status
            h.start()
            h.advance(2 * INTERVAL)
            h.fake.forget()
            with capturedLogs() as events:
                h.advance(INTERVAL)
            self.assertEqual(h.client.state, REGISTERED)
            self.assertEqual([r.kind for r in h.fake.received],
                             ["register", "heartbeat", "heartbeat", "heartbeat", "register"])
            self.assertEqual(h.fake.received[-1].at, h.fake.received[-2].at)  # at once
            self.assertIn(CONFIG.node_id, h.fake.nodes)
            h.advance(2 * INTERVAL)
            self.assertEqual([r.at for r in h.fake.heartbeats][-2:], [20.0, 25.0])
            self.assertEqual([s for s in [r.body["seq"] for r in h.fake.heartbeats]], [1, 2, 3, 4, 5])
            self.assertEqual(count_containing(events, f"(HTTP {status}); registering again"), 1)
            self.assertEqual(count_containing(events, "dispatcher unreachable"), 0)

    def test_dispatcher_restart_that_forgot_the_node(self) -> None:
        h = Harness()
        h.start()
        h.fake.refuse = True
        h.advance(4 * INTERVAL)
        h.fake.refuse = False
        h.fake.forget()
        h.advance(2 * INTERVAL)
        self.assertEqual(h.client.state, REGISTERED)
        self.assertEqual(len(h.fake.registrations), 2)
        self.assertLessEqual(h.times("register")[-1] - 4 * INTERVAL, 2 * INTERVAL)

    def test_auth_rejection_logged_once_and_retried_slowly(self) -> None:
        h = Harness(slow_retry=60.0)
        h.fake.reject_auth = True
        with capturedLogs() as events:
            h.start()
            h.advance(200)
        self.assertEqual(h.times("register"), [0.0, 60.0, 120.0, 180.0])
        self.assertEqual(h.client.state, UNREACHABLE)
        self.assertEqual(count_containing(events, "dispatcher rejected our token"), 1)
        self.assertEqual(count_containing(events, "configuration error"), 1)
        self.assertEqual([e["log_level"].name for e in events if "token" in formatEvent(e)], ["error"])
        h.fake.reject_auth = False
        with capturedLogs() as events:
            h.advance(60)
        self.assertEqual(h.client.state, REGISTERED)
        self.assertEqual(count_containing(events, "accepts this node again"), 1)

    def test_wrong_token_is_rejected_by_a_checking_dispatcher(self) -> None:
        fake = FakeDispatcher(token="the-right-one")
        h = Harness(fake=fake)
        h.start()
        self.assertEqual(h.client.state, UNREACHABLE)
        self.assertEqual(fake.nodes, {})

    def test_wrong_base_url_logged_once_as_rejected(self) -> None:
        h = Harness(base=BASE + "/not-here", slow_retry=30.0)
        with capturedLogs() as events:
            h.start()
            h.advance(100)
        self.assertEqual(count_containing(events, "dispatcher rejected the register request (HTTP 404"), 1)
        self.assertEqual(count_containing(events, "dispatcher unreachable"), 0)
        self.assertEqual(h.client.state, UNREACHABLE)
        self.assertEqual(h.client.registrations_failed, 4)

    def test_broken_payload_builder_logged_once_and_survived(self) -> None:
        h = Harness()
        broken = [True]

        def heartbeat() -> dict[str, Any]:
            if broken[0]:
                raise ZeroDivisionError("bug")
            return h.heartbeat()

        h.client._heartbeat = heartbeat
        with capturedLogs() as events:
            h.start()
            h.advance(3 * INTERVAL)
            broken[0] = False
            h.advance(INTERVAL)
        self.assertEqual(len(self.flushLoggedErrors(ZeroDivisionError)), 1)
        self.assertEqual(count_containing(events, "could not build the heartbeat payload"), 1)
        self.assertEqual(len(h.fake.heartbeats), 1)
        self.assertEqual(h.client.state, REGISTERED)

    def test_on_result_hook_errors_do_not_stop_the_loop(self) -> None:
        def hook(kind: str, ok: bool) -> None:
            raise RuntimeError("metrics broke")

        h = Harness(on_result=hook)
        h.start()
        h.advance(2 * INTERVAL)
        self.assertEqual(len(self.flushLoggedErrors(RuntimeError)), 3)
        self.assertEqual(h.client.heartbeats_ok, 2)


class LoggingTests(SynchronousTestCase):
    def test_logs_on_state_change_only(self) -> None:
        h = Harness()
        with capturedLogs() as events:
            h.start()
            h.advance(INTERVAL)
            h.fake.refuse = True
            h.advance(30)
            h.fake.refuse = False
            h.advance(2 * INTERVAL)
            h.fake.fail = True
            h.advance(30)
            h.fake.fail = False
            h.advance(2 * INTERVAL)
        self.assertGreater(h.client.heartbeats_failed, 10)
        self.assertEqual(count_containing(events, "dispatcher unreachable"), 2)
        self.assertEqual(count_containing(events, "dispatcher reachable again"), 2)
        self.assertEqual(count_containing(events, "registered with dispatcher"), 1)
        unreachable = [e for e in events if "dispatcher unreachable" in formatEvent(e)]
        self.assertEqual(unreachable[0]["log_level"].name, "warn")
        self.assertEqual(unreachable[0]["request"], "heartbeat")
        self.assertEqual(unreachable[0]["code"], 503)
        again = [e for e in events if "reachable again" in formatEvent(e)]
        self.assertTrue(25.0 <= again[0]["down_s"] <= 35.0, again[0]["down_s"])
        self.assertGreater(again[0]["failed_attempts"], 5)

    def test_token_sent_as_bearer(self) -> None:
        h = Harness()
        h.start()
        h.advance(INTERVAL)
        h.stop()
        self.assertEqual(len(h.fake.received), 3)
        for r in h.fake.received:
            self.assertEqual(r.header("authorization"), f"Bearer {TOKEN}")

    def test_no_authorization_without_token(self) -> None:
        h = Harness(token=None)
        h.start()
        h.advance(INTERVAL)
        self.assertEqual([r.header("authorization") for r in h.fake.received], [None, None])

    def test_token_never_logged(self) -> None:
        class Echo(Resource):
            """A broken dispatcher that echoes our headers in its error bodies."""

            isLeaf = True
            code = 500

            def render_POST(self, request: Any) -> bytes:
                request.setResponseCode(self.code)
                return b"bad: " + (request.getHeader(b"authorization") or b"")

        echo = Echo()
        h = Harness()
        h.stub = StubTreq(echo)
        h.client.exchange.http = h.stub
        with capturedLogs() as events:
            h.start()
            h.advance(10)
            echo.code = 401
            h.advance(70)
            echo.code = 418
            h.advance(70)
            echo.code = 200
            h.advance(70)
            h.client.exchange.http = RecordingHTTP()
            h.advance(20)
            h.stop()
        self.assertGreater(len(events), 5)
        for event in events:
            self.assertNotIn(TOKEN, formatEvent(event))
            self.assertNotIn(TOKEN, repr(event))
        self.assertEqual(count_containing(events, "bad: Bearer ***"), 2)
        self.assertNotIn(TOKEN, repr(h.client))


class StopTests(SynchronousTestCase):
    def test_deregisters_on_stop(self) -> None:
        h = Harness()
        h.start()
        h.advance(INTERVAL)
        self.assertEqual(h.stop(), [None])
        self.assertEqual(h.fake.deregistrations[-1].body, {"node_id": CONFIG.node_id})
        self.assertEqual(h.fake.nodes, {})
        self.assertEqual(h.clock.getDelayedCalls(), [])
        self.assertEqual(h.client.state, UNREGISTERED)
        self.assertEqual(h.results[-1], ("deregister", True))
        h.advance(3 * INTERVAL)
        self.assertEqual(len(h.fake.received), 3)

    def test_stop_with_dispatcher_without_deregister_route(self) -> None:
        h = Harness()
        h.fake.deregister_route = False
        h.start()
        with capturedLogs() as events:
            self.assertEqual(h.stop(), [None])
        self.assertEqual(len(h.fake.deregistrations), 1)
        self.assertEqual(count_containing(events, "no registration to remove"), 1)

    def test_stop_while_dispatcher_hangs_is_bounded(self) -> None:
        h = Harness(deregister_timeout=1.5)
        h.start()
        h.fake.hang = True
        h.advance(INTERVAL)  # a heartbeat now hangs
        results: list[Any] = []
        with capturedLogs() as events:
            h.client.stopService().addBoth(results.append)
            h.advance(1.25)
            self.assertEqual(results, [])
            h.advance(0.25)
        self.assertEqual(results, [None])
        self.assertEqual(len(h.fake.deregistrations), 1)
        self.assertEqual(h.clock.getDelayedCalls(), [])
        self.assertEqual(count_containing(events, "dispatcher unreachable"), 0)
        self.assertEqual(count_containing(events, "deregistration failed"), 1)
        self.assertEqual(h.client.heartbeats_failed, 0)

    def test_stop_when_dispatcher_refuses_connections(self) -> None:
        http = RecordingHTTP()
        h = Harness(http=http)
        h.start()
        self.assertEqual(h.stop(), [None])
        self.assertEqual([url for url, _ in http.calls][-1], BASE + "/v1/nodes/deregister")

    def test_stop_before_any_registration_sends_nothing(self) -> None:
        h = Harness()
        h.client.startService()
        self.assertEqual(h.stop(), [None])
        self.assertEqual(h.fake.received, [])
        self.assertEqual(h.clock.getDelayedCalls(), [])


class DisplayUrlTests(SynchronousTestCase):
    def test_userinfo_never_shown(self) -> None:
        with capturedLogs() as events:
            h = Harness(base="http://user:pa55@dispatcher.test:9000/rm", http=RecordingHTTP())
            h.start()
        self.assertEqual(h.client.display_url, "http://dispatcher.test:9000/rm")
        self.assertEqual(h.client.base_url, "http://user:pa55@dispatcher.test:9000/rm")
        self.assertNotIn("pa55", repr(h.client))
        self.assertEqual(count_containing(events, "dispatcher unreachable"), 1)
        for event in events:
            self.assertNotIn("pa55", repr(event))
        self.assertEqual(DispatcherClient("https://d:1", None, dict, dict, 1.0, reactor=Clock(),
                                          http=RecordingHTTP()).display_url, "https://d:1")


class DefaultClientTests(SynchronousTestCase):
    def test_default_http_client_uses_the_injected_reactor(self) -> None:
        """Without ``http``, a quiet, non-persistent treq client on our reactor is used."""
        reactor = MemoryReactorClock()
        client = DispatcherClient("http://127.0.0.1:9000", None, lambda: {"node_id": "n"}, dict, INTERVAL,
                                  reactor=reactor, request_timeout=3.0, deregister_timeout=1.0)
        client.startService()
        reactor.advance(0)
        ((host, port, factory, timeout, _),) = reactor.tcpClients
        self.assertEqual((host, port, timeout), ("127.0.0.1", 9000, 3.0))
        wrapped: Any = factory
        self.assertFalse(wrapped._wrappedFactory.noisy)
        results: list[Any] = []
        client.stopService().addBoth(results.append)
        reactor.advance(1.0)
        self.assertEqual(results, [None])
        self.assertEqual(client.state, UNREGISTERED)
