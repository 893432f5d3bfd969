"""Tenants, bands and prefix affinity from the request's key and headers
through the node: config, the 429 cap, affinity between two devices."""

from __future__ import annotations

from typing import Any, Dict

from twisted.trial.unittest import SynchronousTestCase

from rolemesh.base import errors
from rolemesh.config.file import ConfigError
from rolemesh.node.payloads import heartbeat_payload
from rolemesh.scheduling.fairqueue import BATCH, INTERACTIVE, Share
from rolemesh.scheduling.prefix import prefix_hashes
from rolemesh.scheduling.tenants import Tenants
from tests.api.test_app import CHAT, ApiHarness, ApiTestCase, json_answer
from tests.fixtures import REPO
from tests.fixtures.fakes import make_config
from tests.node.test_node import MODELS, NodeHarness

KEYS = [{"name": "web", "key": "k-web", "weight": 3},
        {"name": "nightly", "key": "k-night", "priority": "batch", "max_concurrent": 2},
        {"name": "disp", "key": "k-disp", "tenant_header": True},
        "k-bare"]


class ConfigTests(SynchronousTestCase):
    def test_entries_and_bare_keys(self) -> None:
        config = make_config(MODELS, api_keys=KEYS)
        self.assertEqual(config.api_keys, ("k-web", "k-night", "k-disp", "k-bare"))
        self.assertEqual([t.name for t in config.tenants], ["web", "nightly", "disp"])
        t = Tenants(config)
        self.assertEqual(t.share(0, None, None), Share("web", INTERACTIVE, 3.0))
        self.assertEqual(t.share(1, None, None), Share("nightly", BATCH, 1.0, 2))
        self.assertEqual(t.share(1, None, b"interactive").band, INTERACTIVE)
        self.assertEqual(t.share(3, None, None).tenant, "key3", "a bare key: named by its position")
        self.assertEqual(t.share(0, b"someone", None).tenant, "web", "this key may not name the tenant")
        self.assertEqual(t.share(2, b"alice", b"batch"), Share("alice", BATCH))
        self.assertEqual(t.share(2, b"nightly", None).max_concurrent, 2, "a named tenant keeps its cap")
        self.assertEqual(t.label("alice"), "other")
        self.assertEqual(t.label("key3"), "key3")
        self.assertEqual(Tenants(make_config(MODELS)).share(None, b"bob", None).tenant, "bob", "no keys: anyone")
        self.assertNotIn("k-web", repr(config), "keys never in a repr")

    def test_mistakes_are_one_line_errors(self) -> None:
        cases = {
            "api_keys[0].key: required": [{"name": "x"}],
            "api_keys[0].weight: expected": [{"name": "x", "key": "k", "weight": 0}],
            "api_keys[0].priority: expected": [{"name": "x", "key": "k", "priority": "urgent"}],
            "api_keys[0].max_concurrent: expected": [{"name": "x", "key": "k", "max_concurrent": -1}],
            "api_keys[0].colour: unknown key": [{"name": "x", "key": "k", "colour": 1}],
            "api_keys[0].name: expected": [{"name": "other", "key": "k"}],
            "used twice": [{"name": "x", "key": "k"}, {"name": "x", "key": "k2"}],
        }
        for message, keys in cases.items():
            with self.assertRaises(ConfigError) as raised:
                make_config(MODELS, api_keys=keys)
            self.assertIn(message, str(raised.exception))
            self.assertNotIn("\n", str(raised.exception))

    def test_bad_headers_are_400(self) -> None:
        t = Tenants(make_config(MODELS, api_keys=KEYS))
        for tenant, priority, code in ((None, b"urgent", "invalid_priority"), (b"a b", None, "invalid_tenant"),
                                       (b"x" * 65, None, "invalid_tenant")):
            with self.assertRaises(errors.ApiError) as raised:
                t.share(2, tenant, priority)
            self.assertEqual((raised.exception.status, raised.exception.code), (400, code))


class CapTests(ApiTestCase):
    def setUp(self) -> None:
        self.h = ApiHarness(auto=False, api_keys=KEYS, max_pending_requests_per_device=8)
        self.h.keys = ["k-night"]
        self.h.node_h.load("a")

    def answer_all(self) -> None:
        """Answer every upstream attempt not answered yet, until none is left."""
        h = self.h
        while True:
            waiting = [a for a in h.agent.attempts if not a.deferred.called]
            if not waiting:
                return
            for attempt in waiting:
                attempt.respond(json_answer(attempt))
            h.treq.flush()

    def test_over_max_concurrent_is_429_tenant_limit(self) -> None:
        h = self.h
        first = h.send("POST", "/v1/chat/completions", {"model": "a", **CHAT})
        second = h.send("POST", "/v1/chat/completions", {"model": "a", **CHAT})
        h.treq.flush()
        self.assertEqual(h.node.scheduler.tenant_pending, {"nightly": 2})
        error = self.assertError(h.chat({"model": "a", **CHAT}), 429, "tenant_limit")
        self.assertIn("nightly", error["message"])
        other = h.send("POST", "/v1/chat/completions", {"model": "a", **CHAT}, key="k-web")
        h.treq.flush()
        self.assertEqual(len(h.node_h.book().queue), 2, "another tenant is not capped: it queues")
        self.answer_all()
        for d in (first, second, other):
            self.assertEqual(h.finish(d).code, 200)
        self.assertEqual(h.node.scheduler.tenant_pending, {})
        again = h.send("POST", "/v1/chat/completions", {"model": "a", **CHAT})
        h.treq.flush()
        self.answer_all()
        self.assertEqual(h.finish(again).code, 200, "below the cap again once those ended")

    def test_the_answer_has_retry_after(self) -> None:
        h = self.h
        h.send("POST", "/v1/chat/completions", {"model": "a", **CHAT})
        h.send("POST", "/v1/chat/completions", {"model": "a", **CHAT})
        h.treq.flush()
        answer = h.chat({"model": "a", **CHAT})
        self.assertEqual(answer.code, 429)
        self.assertEqual(answer.header("retry-after"), "1")


class BandTests(ApiTestCase):
    def test_the_priority_header_orders_the_queue(self) -> None:
        h = ApiHarness(auto=False, api_keys=KEYS, max_pending_requests_per_device=8)
        h.keys = ["k-web"]
        h.node_h.load("a")
        h.send("POST", "/v1/chat/completions", {"model": "a", **CHAT})  # runs
        h.send("POST", "/v1/chat/completions", {"model": "a", **CHAT}, headers={"X-RoleMesh-Priority": "batch"})
        h.send("POST", "/v1/chat/completions", {"model": "a", **CHAT}, key="k-disp",
               headers={"X-RoleMesh-Tenant": "alice"})
        h.treq.flush()
        queue = list(h.node_h.book().queue)
        self.assertEqual([(t.share.tenant, t.share.band) for t in queue],
                         [("alice", INTERACTIVE), ("web", BATCH)])
        self.assertError(h.chat({"model": "a", **CHAT}, headers={"X-RoleMesh-Priority": "now"}), 400,
                         "invalid_priority")


class AffinityTests(SynchronousTestCase):
    """Two devices holding the model: a conversation's next turn goes where its last went."""

    def setUp(self) -> None:
        self.h = NodeHarness(devices=2, models=[{"model_id": "a", "server_args": {"parallel": 4}}],
                             max_pending_requests_per_device=8)
        self.h.load("a", device="gpu:0")
        self.h.load("a", device="gpu:1")

    def conversation(self, n: int, turns: int) -> Dict[str, Any]:
        messages = [{"role": "system", "content": f"document {n}"}]
        for t in range(turns):
            messages += [{"role": "user", "content": f"q{t}"}, {"role": "assistant", "content": f"a{t}"}]
        return {"model": "a", "messages": messages + [{"role": "user", "content": "next"}]}

    def lease(self, payload: Any) -> Any:
        lease = self.h.node.lease_now(self.h.model("a"), prompt=payload)
        self.assertIsNotNone(lease)
        return lease

    def test_turns_stick_to_their_device(self) -> None:
        h = self.h
        first = [self.lease(self.conversation(n, 0)) for n in range(4)]
        devices = [lease.device for lease in first]
        self.assertEqual(sorted(devices), ["gpu:0", "gpu:0", "gpu:1", "gpu:1"], "spread while new")
        for lease in first:
            lease.release()
        for turn in range(1, 4):
            leases = [self.lease(self.conversation(n, turn)) for n in (3, 2, 1, 0)]
            self.assertEqual([lease.device for lease in leases], devices[::-1], f"turn {turn}")
            for lease in leases:
                lease.release()
        self.assertEqual(h.node.cache_hit_rates()["a"], 12 / 16)
        self.assertEqual(h.node.inventory()["prefix_memory"]["hits"], 12)

    def test_without_affinity_the_least_busy(self) -> None:
        h = NodeHarness(devices=2, models=[{"model_id": "a", "server_args": {"parallel": 4}}],
                        max_pending_requests_per_device=8, prefix_affinity=False)
        h.load("a", device="gpu:0")
        h.load("a", device="gpu:1")
        a = h.node.lease_now(h.model("a"), prompt=self.conversation(0, 0))
        a.release()
        b = h.node.lease_now(h.model("a"), prompt=self.conversation(1, 0))
        again = h.node.lease_now(h.model("a"), prompt=self.conversation(0, 1))
        self.assertEqual((a.device, b.device, again.device), ("gpu:0", "gpu:0", "gpu:1"))
        self.assertEqual(len(h.node.prefixes), 0)

    def test_a_busier_device_by_more_than_the_bound_is_left(self) -> None:
        h = self.h
        first = self.lease(self.conversation(0, 0))
        held = [h.node.lease_now(h.model("a")) for _ in range(2)]  # no prompt: the least busy, gpu:1 then gpu:0
        self.assertEqual(sorted(lease.device for lease in held), ["gpu:0", "gpu:1"])
        extra = [h.node.acquire(h.model("a"), device=first.device) for _ in range(2)]
        self.assertEqual(h.book(first.device).pending, 4)
        elsewhere = h.node.lease_now(h.model("a"), prompt=self.conversation(0, 1))
        self.assertNotEqual(elsewhere.device, first.device, "4 pending vs 1: more than the bound of 2")
        self.assertTrue(all(self.successResultOf(d) for d in extra))

    def test_a_stopped_child_loses_its_prefixes(self) -> None:
        h = self.h
        lease = self.lease(self.conversation(0, 0))
        lease.release()
        h.sup(lease.device).stop()
        h.reap(lease.device)
        self.assertIsNone(h.node.prefixes.lookup(prefix_hashes(self.conversation(0, 1))))

    def test_one_device_costs_no_hashing(self) -> None:
        h = NodeHarness(models=[{"model_id": "a"}])
        h.load("a")
        lease = h.node.lease_now(h.model("a"), prompt=self.conversation(0, 0))
        self.assertIsNotNone(lease)
        self.assertEqual(h.node.prefixes.lookups, 0)
        self.assertEqual(h.node.cache_hit_rates(), {"a": None})


class HeartbeatTests(SynchronousTestCase):
    def test_the_heartbeat_carries_the_hit_rates_and_validates(self) -> None:
        import json
        import os

        import jsonschema

        schema_path = os.path.join(REPO,
                                   "rolemesh", "schemas", "heartbeat.schema.json")
        with open(schema_path, encoding="utf-8") as f:
            schema = json.load(f)
        body = heartbeat_payload("n", 1, 0.0, [], {"a": 0.75, "b": None})
        jsonschema.validate(body, schema)
        self.assertEqual(body["cache_hit_rate"], {"a": 0.75, "b": None})
        self.assertNotIn("cache_hit_rate", heartbeat_payload("n", 1, 0.0, []))



#: A first turn and a second turn, as the Anthropic and the Responses APIs shape them (their prefixes:
#: Anthropic ``system`` + ``messages``, Responses ``instructions`` + ``input``).
OTHER_APIS = {
    "/v1/messages": lambda n, turn: {"model": "a", "max_tokens": 4, "system": f"You help with project {n}.",
                                     "messages": [{"role": "user", "content": "hello"}] + (
                                         [{"role": "assistant", "content": "hi"},
                                          {"role": "user", "content": "more"}] if turn else [])},
    "/v1/responses": lambda n, turn: {"model": "a", "instructions": f"You help with project {n}.",
                                      "input": [{"role": "user", "content": "hello"}] + (
                                          [{"role": "assistant", "content": "hi"},
                                           {"role": "user", "content": "more"}] if turn else [])},
}


class OtherApisSchedulingTests(SynchronousTestCase):
    """Bands, caps and prefix affinity hold on /v1/messages and /v1/responses as on chat."""

    def test_the_priority_header_orders_the_queue(self) -> None:
        for path, body in OTHER_APIS.items():
            h = ApiHarness(auto=False, api_keys=KEYS, max_pending_requests_per_device=8)
            h.keys = ["k-web"]
            h.node_h.load("a")
            h.send("POST", path, body(0, 0))  # runs
            h.send("POST", path, body(1, 0), headers={"X-RoleMesh-Priority": "batch"})
            h.send("POST", path, body(2, 0), key="k-disp", headers={"X-RoleMesh-Tenant": "alice"})
            h.treq.flush()
            self.assertEqual([(t.share.tenant, t.share.band) for t in h.node_h.book().queue],
                             [("alice", INTERACTIVE), ("web", BATCH)], path)

    def test_a_second_turn_goes_where_the_first_went_though_that_device_is_busier(self) -> None:
        for path, body in OTHER_APIS.items():
            h = ApiHarness(devices=2, api_keys=KEYS, models=[{"model_id": "a", "server_args": {"parallel": 4}}],
                           max_pending_requests_per_device=8)
            h.keys = ["k-web"]
            h.node_h.load("a", device="gpu:0")
            h.node_h.load("a", device="gpu:1")
            first = h.call("POST", path, body(7, 0))
            self.assertEqual(first.code, 200, first.body)
            child = h.agent.attempts[-1].url  # turn 1's child
            device = next(d for d in ("gpu:0", "gpu:1") if h.node.supervisors[d].endpoint.base_url in child.decode())
            busy = self.successResultOf(h.node.acquire(h.node_h.model("a"), device=device))  # now the busier one
            second = h.call("POST", path, body(7, 1))
            self.assertEqual(second.code, 200, second.body)
            self.assertEqual(h.agent.attempts[-1].url, child, f"{path}: turn 2 on turn 1's (busier) device")
            self.assertEqual(h.node.inventory()["prefix_memory"]["hits"], 1, path)
            busy.release()
