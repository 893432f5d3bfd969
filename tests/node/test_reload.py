"""Reload without restart, and ``GET /ready``: the pure decisions, then the
whole service tree on fakes (config files re-read from a temporary folder,
fake children, a Clock)."""

from __future__ import annotations

import os
import re
import signal
from typing import Any, Dict, List

import attr
from hypothesis import given
from hypothesis import strategies as st
from twisted.logger import capturedLogs
from twisted.trial.unittest import SynchronousTestCase

from rolemesh.api.readiness import decide
from rolemesh.children.state import READY, STOPPED, STOPPING
from rolemesh.config.file import TOP_LEVEL_KEYS, NodeConfig
from rolemesh.node.node import Lease
from rolemesh.node.reload import LIVE_KEYS, RESTART_KEYS, ReloadResult, effective, leaving, needs_new_child, plan
from tests.fixtures import REPO
from tests.fixtures.fakes import make_config
from tests.fixtures.service_harness import ServiceHarness
from tests.fleet.test_dispatcher import TOKEN, Harness

KEY = "sk-reload-first-key-0123456789"
NEW_KEY = "sk-reload-second-key-987654321"


def base(**top: Any) -> Dict[str, Any]:
    config: Dict[str, Any] = {
        "api_keys": [KEY],
        "llama_server_startup_timeout_s": 10.0,
        "llama_server_probe_interval_s": 0.5,
        "llama_server_stop_timeout_s": 5.0,
        "models": [
            {"model_id": "a", "roles": ["chat"], "ctx_size": 512},
            {"model_id": "b", "roles": ["chat"]},
        ],
    }
    config.update(top)
    return config


# ----------------------------------------------------------------------
# Pure decisions


class LeavingTests(SynchronousTestCase):
    def test_the_pending_models_a_config_no_longer_has_once_each_in_order(self) -> None:
        config = make_config(models=[{"model_id": "a"}])
        before = make_config(models=[{"model_id": "a"}, {"model_id": "b"}, {"model_id": "c"}])
        gone_b, gone_c, kept = (before.model(i) for i in ("b", "c", "a"))
        self.assertEqual(leaving(config, [gone_c, kept, gone_b, gone_c, gone_b]), (gone_c, gone_b))
        self.assertEqual(leaving(config, [kept]), ())
        self.assertEqual(leaving(config, []), ())


class PlanTests(SynchronousTestCase):
    def config(self, models: List[Dict[str, Any]], **top: Any) -> NodeConfig:
        return make_config(models, **top)

    def test_models_added_removed_restarted_updated(self) -> None:
        old = self.config([{"model_id": "a", "ctx_size": 512}, {"model_id": "b"}, {"model_id": "c"}])
        new = self.config([{"model_id": "a", "ctx_size": 1024}, {"model_id": "b", "roles": ["x"]},
                           {"model_id": "d"}])
        p = plan(old, new)
        self.assertEqual((p.added, p.removed, p.restarted, p.updated), (("d",), ("c",), ("a",), ("b",)))
        self.assertEqual(p.needs_restart, ())
        self.assertTrue(p.changed)

    def test_live_and_restart_keys(self) -> None:
        old = self.config([], listen_port=8090, request_timeout_s=600, api_keys=["k1"], dispatcher_token="t1")
        new = self.config([], listen_port=8091, request_timeout_s=30, api_keys=["k2"], dispatcher_token="t2")
        p = plan(old, new)
        self.assertEqual(p.needs_restart, ("listen_port", "advertise_url"))  # derived from the port
        self.assertIn("request_timeout_s", p.applied)
        self.assertIn("dispatcher_token", p.applied)
        text = repr(ReloadResult(True, plan=p).to_json()) + p.summary()
        for secret in ("k1", "k2", "t1", "t2"):
            self.assertNotIn(f"'{secret}'", text)

    def test_effective_keeps_the_running_value_of_restart_keys(self) -> None:
        old = self.config([{"model_id": "a"}], listen_port=8090, backend="cpu")
        new = self.config([{"model_id": "b"}], listen_port=9999, backend="cuda")
        running = effective(old, new)
        self.assertEqual((running.listen_port, running.backend), (8090, "cpu"))
        self.assertEqual([m.model_id for m in running.models], ["b"])

    def test_argv_change_versus_agent_only_change(self) -> None:
        a = make_config([{"model_id": "a", "ctx_size": 512, "roles": ["chat"]}]).model("a")
        self.assertTrue(needs_new_child(a, attr.evolve(a, ctx_size=1024)))
        self.assertTrue(needs_new_child(a, attr.evolve(a, path="/models/other.gguf")))
        self.assertTrue(needs_new_child(a, attr.evolve(a, alias="alpha")))
        self.assertFalse(needs_new_child(a, attr.evolve(a, roles=("chat", "code"))))
        self.assertFalse(needs_new_child(a, attr.evolve(a, preload=True, idle_unload_s=60.0)))

    @given(st.lists(st.sampled_from(["a", "b", "c", "d"]), unique=True),
           st.lists(st.sampled_from(["a", "b", "c", "d"]), unique=True),
           st.integers(1, 65535), st.integers(1, 65535))
    def test_plan_partitions_models(self, before: List[str], after: List[str], p1: int, p2: int) -> None:
        old = make_config([{"model_id": m} for m in before], listen_port=p1)
        new = make_config([{"model_id": m} for m in after], listen_port=p2)
        p = plan(old, new)
        self.assertEqual(set(p.added), set(after) - set(before))
        self.assertEqual(set(p.removed), set(before) - set(after))
        self.assertEqual(p.needs_restart, () if p1 == p2 else ("listen_port", "advertise_url"))
        self.assertEqual(plan(new, new).changed, False)
        running = effective(old, new)
        for key in RESTART_KEYS:
            self.assertEqual(getattr(running, key), getattr(old, key))


class DocumentedKeysTests(SynchronousTestCase):
    """docs/operations/reload.md lists exactly the keys a reload applies live."""

    def test_live_keys_match_the_docs(self) -> None:
        path = os.path.join(REPO, "docs", "operations", "reload.md")
        with open(path, encoding="utf-8") as f:
            text = f.read()
        match = re.search(r"\*\*Keys applied live:\*\*(.*?)\n- ", text, re.DOTALL)
        assert match is not None, "no 'Keys applied live' bullet in docs/operations/reload.md"
        documented = set(re.findall(r"`([a-z_]+)`", match.group(1)))
        # Four config keys feed the one api_keys field (and its mapping entries the tenants field).
        fields = {"api_keys" if name.startswith("api_key") else name for name in documented}
        self.assertEqual(fields, set(LIVE_KEYS) - {"tenants"})
        self.assertTrue(documented <= {k.name for k in TOP_LEVEL_KEYS}, documented)


class ReadinessDecisionTests(SynchronousTestCase):
    def test_ready_when_everything_holds(self) -> None:
        r = decide(listening=True, devices=2, preloading=0, draining=False, dispatcher_state="registered")
        self.assertTrue(r.ready)
        self.assertIsNone(r.to_json()["failing"])

    def test_names_the_first_failing_condition(self) -> None:
        cases: List[Any] = [
            (dict(listening=False), "listening"),
            (dict(devices=0), "devices"),
            (dict(preloading=2), "preload"),
            (dict(draining=True), "draining"),
            (dict(dispatcher_state="unreachable"), "dispatcher"),
        ]
        for change, name in cases:
            facts: Dict[str, Any] = dict(listening=True, devices=1, preloading=0, draining=False,
                                         dispatcher_state="registered")
            facts.update(change)
            r = decide(**facts)
            self.assertFalse(r.ready)
            self.assertTrue(r.to_json()["failing"].startswith(name + ":"), r.to_json())

    def test_standalone_needs_no_dispatcher(self) -> None:
        self.assertTrue(decide(listening=True, devices=1, preloading=0, draining=False).ready)


# ----------------------------------------------------------------------
# The service tree


class ServiceTestCase(SynchronousTestCase):
    def harness(self, config: Dict[str, Any], **kw: Any) -> ServiceHarness:
        h = ServiceHarness(config, **kw)
        self.addCleanup(h.cleanup)
        return h

    def acquire(self, h: ServiceHarness, model_id: str) -> Lease:
        results: List[Any] = []
        h.root.node.acquire(h.root.config.model(model_id)).addBoth(results.append)
        h.answer(h.root.config.model(model_id).served_name)
        self.assertTrue(results and isinstance(results[0], Lease), results)
        return results[0]

    def model_ids(self, h: ServiceHarness, key: str = KEY) -> List[str]:
        code, body = h.call("GET", "/v1/models", key=key)
        self.assertEqual(code, 200, body)
        return [m["id"] for m in body["data"]]

    def reload(self, h: ServiceHarness, key: str = KEY) -> Any:
        return h.call("POST", "/v1/node/reload", key=key)


class ReadyRouteTests(ServiceTestCase):
    def test_flips_with_listening_preload_and_drain(self) -> None:
        h = self.harness(base(models=[{"model_id": "a", "preload": True}]))
        code, body = h.call("GET", "/ready")
        self.assertEqual((code, body["failing"]), (503, "listening: the API port is not bound yet"))
        h.start()
        code, body = h.call("GET", "/ready")
        self.assertEqual(code, 503)
        self.assertEqual(body["failing"], "preload: still preloading 1 model(s)")
        h.answer("a")
        code, body = h.call("GET", "/ready")
        self.assertEqual((code, body["ready"]), (200, True))
        h.root.node.drain(1.0)
        code, body = h.call("GET", "/ready")
        self.assertEqual((code, body["failing"]), (503, "draining: draining for shutdown"))

    def test_needs_no_api_key_but_health_and_ready_only(self) -> None:
        h = self.harness(base())
        h.start()
        self.assertEqual(h.call("GET", "/ready")[0], 200)
        self.assertEqual(h.call("GET", "/v1/models")[0], 401)
        self.assertEqual(h.call("POST", "/ready")[0], 405)

    def test_dispatcher_not_registered_is_not_ready(self) -> None:
        h = self.harness(base())
        h.start()

        class Dispatcher:
            state = "unreachable"

        h.root.dispatcher = Dispatcher()
        code, body = h.call("GET", "/ready")
        self.assertEqual(code, 503)
        self.assertEqual(body["failing"], "dispatcher: not registered with the dispatcher (unreachable)")
        Dispatcher.state = "registered"
        self.assertEqual(h.call("GET", "/ready")[0], 200)


class ReloadTests(ServiceTestCase):
    def setUp(self) -> None:
        self.h = self.harness(base())
        self.h.start()

    def write(self, **top: Any) -> None:
        self.h.write(base(**top))

    def test_invalid_file_changes_nothing(self) -> None:
        before = self.h.root.config
        self.h.write_text("models: [\n")
        with capturedLogs() as events:
            code, body = self.reload(self.h)
        self.assertEqual(code, 400)
        self.assertEqual(body["error"]["code"], "invalid_config")
        message = body["error"]["message"]
        self.assertIn("invalid YAML", message)
        self.assertNotIn("\n", message)
        self.assertIs(self.h.root.config, before)
        self.assertEqual(self.model_ids(self.h), ["a", "b"])
        self.assertTrue(any(message in str(e.get("error")) for e in events))

    def test_invalid_value_names_the_key(self) -> None:
        self.h.write(base(models=[{"model_id": "a", "ctx_size": "big"}]))
        code, body = self.reload(self.h)
        self.assertEqual(code, 400)
        self.assertEqual(body["error"]["message"], 'models[0].ctx_size: expected a positive integer, got "big"')

    def test_reload_needs_the_api_key(self) -> None:
        self.assertEqual(self.reload(self.h, key="wrong")[0], 401)

    def test_added_model_is_servable_at_once(self) -> None:
        self.write(models=[{"model_id": "a", "ctx_size": 512}, {"model_id": "b"}, {"model_id": "c"}])
        code, body = self.reload(self.h)
        self.assertEqual(code, 200, body)
        self.assertEqual(body["models"]["added"], ["c"])
        self.assertIn("c", self.model_ids(self.h))
        lease = self.acquire(self.h, "c")
        self.assertEqual(lease.endpoint.model_id, "c")
        lease.release()

    def test_removed_idle_model_leaves_and_its_child_stops(self) -> None:
        self.acquire(self.h, "b").release()
        child = self.h.live_children()[0]
        self.write(models=[{"model_id": "a", "ctx_size": 512}])
        code, body = self.reload(self.h)
        self.assertEqual(body["models"]["removed"], ["b"])
        self.assertEqual(self.model_ids(self.h), ["a"])
        self.assertIn(signal.SIGTERM, child.signals)
        child.exit(0)
        self.assertEqual(self.h.root.node.supervisors["gpu:0"].state, STOPPED)
        code, body = self.h.call("POST", "/v1/chat/completions", {"model": "b"}, key=KEY)
        self.assertEqual(code, 404)

    def test_removed_model_waits_for_its_request_in_flight(self) -> None:
        lease = self.acquire(self.h, "b")
        child = self.h.live_children()[0]
        self.write(models=[{"model_id": "a", "ctx_size": 512}])
        self.reload(self.h)
        self.assertEqual(child.signals, [])
        self.assertEqual(self.h.root.node.supervisors["gpu:0"].state, READY)
        lease.release()
        self.assertIn(signal.SIGTERM, child.signals)

    def test_a_model_removed_and_added_back_unchanged_keeps_its_child_booked(self) -> None:
        """Issue 39: a second request beside a running one is served at once by the same child."""
        p = {"model_id": "p", "server_args": {"parallel": 2}}
        h = self.harness(base(models=[{"model_id": "a"}, p]))
        h.start()
        first = self.acquire(h, "p")
        child = h.live_children()[0]
        h.write(base(models=[{"model_id": "a"}]))
        self.reload(h)
        h.write(base(models=[{"model_id": "a"}, p]))
        self.reload(h)
        second: List[Any] = []
        h.root.node.acquire(h.root.config.model("p")).addBoth(second.append)
        self.assertTrue(second and isinstance(second[0], Lease), "beside the first, at once")
        self.assertIs(second[0].endpoint.pid, child.pid)
        self.assertEqual(child.signals, [])
        first.release()
        second[0].release()

    def listed(self, h: ServiceHarness) -> Dict[str, Any]:
        code, body = h.call("GET", "/v1/models", key=KEY)
        self.assertEqual(code, 200, body)
        return {m["id"]: m for m in body["data"]}

    def test_removed_model_stays_listed_while_its_request_runs_then_leaves(self) -> None:
        # Issue 28: a model that disappears leaves /v1/models once idle, not at once.
        lease = self.acquire(self.h, "b")
        self.write(models=[{"model_id": "a", "ctx_size": 512}])
        self.reload(self.h)
        listed = self.listed(self.h)
        self.assertEqual(list(listed), ["a", "b"])
        self.assertIs(listed["b"]["leaving"], True)
        self.assertNotIn("leaving", listed["a"])
        self.assertEqual(listed["b"]["loaded_on"], ["gpu:0"])
        self.assertEqual(self.h.call("POST", "/v1/chat/completions", {"model": "b"}, key=KEY)[0], 404)
        lease.release()
        self.assertEqual(self.model_ids(self.h), ["a"])

    def test_removed_model_stays_listed_while_a_request_for_it_waits(self) -> None:
        first = self.acquire(self.h, "b")
        child = self.h.live_children()[0]
        waiting: List[Any] = []
        self.h.root.node.acquire(self.h.root.config.model("b")).addBoth(waiting.append)
        self.assertEqual(waiting, [])  # queued behind the first (one slot)
        self.write(models=[{"model_id": "a", "ctx_size": 512}])
        self.reload(self.h)
        first.release()
        self.assertEqual(list(self.listed(self.h)), ["a", "b"])
        self.assertTrue(waiting and isinstance(waiting[0], Lease), waiting)  # it runs on the same child
        self.assertEqual((waiting[0].endpoint.model_id, child.signals), ("b", []))
        self.assertEqual(list(self.listed(self.h)), ["a", "b"])
        waiting[0].release()
        self.assertEqual(self.model_ids(self.h), ["a"])
        self.assertIn(signal.SIGTERM, child.signals)

    def test_removed_model_admitted_at_once_is_listed_until_released(self) -> None:
        self.acquire(self.h, "b").release()
        node = self.h.root.node
        lease = node.lease_now(self.h.root.config.model("b"))
        assert lease is not None
        self.assertIsNone(lease.ticket.context)  # the fast admission: no _Acquisition behind it
        self.write(models=[{"model_id": "a", "ctx_size": 512}])
        self.reload(self.h)
        self.assertEqual([m.model_id for m in node.leaving_models()], ["b"])
        self.assertEqual(list(self.listed(self.h)), ["a", "b"])
        lease.release()
        self.assertEqual(node.leaving_models(), ())
        self.assertEqual(self.model_ids(self.h), ["a"])

    def test_changed_command_restarts_on_next_use_once_idle(self) -> None:
        lease = self.acquire(self.h, "a")
        old_child = self.h.live_children()[0]
        self.assertIn("512", old_child.argv)
        self.write(models=[{"model_id": "a", "ctx_size": 2048}, {"model_id": "b", "roles": ["chat"]}])
        code, body = self.reload(self.h)
        self.assertEqual(body["models"]["restart_on_next_use"], ["a"])
        stale = [d["stale"] for d in self.h.root.node.inventory()["devices"]]
        self.assertEqual(stale, [True], "the child runs a command the config no longer has")
        # A second request for it waits: the old child keeps serving the first.
        waiting: List[Any] = []
        self.h.root.node.acquire(self.h.root.config.model("a")).addBoth(waiting.append)
        self.assertEqual((waiting, old_child.signals), ([], []))
        lease.release()
        self.assertIn(signal.SIGTERM, old_child.signals)
        self.assertEqual(self.h.root.node.supervisors["gpu:0"].state, STOPPING)
        old_child.exit(0)
        self.h.answer("a")
        self.assertTrue(waiting and isinstance(waiting[0], Lease), waiting)
        new_child = self.h.live_children()[0]
        self.assertIn("2048", new_child.argv)
        self.assertEqual([d["stale"] for d in self.h.root.node.inventory()["devices"]], [False])
        waiting[0].release()

    def test_a_changed_idle_unload_s_applies_to_the_running_countdown(self) -> None:
        """idle_unload_s 3 -> none: the idle child is not unloaded 3 s later (issue 39)."""
        h = self.harness(base(models=[{"model_id": "a", "idle_unload_s": 3}]))
        h.start()
        self.acquire(h, "a").release()
        child = h.live_children()[0]
        h.write(base(models=[{"model_id": "a"}]))
        self.assertEqual(self.reload(h)[0], 200)
        h.reactor.advance(10)
        self.assertEqual(child.signals, [], "no idle unload: the reload took idle_unload_s away")
        h.write(base(models=[{"model_id": "a", "idle_unload_s": 2}]))
        self.assertEqual(self.reload(h)[0], 200)
        h.reactor.advance(2)
        self.assertIn(signal.SIGTERM, child.signals)

    def test_changed_command_never_restarts_under_parallel_requests(self) -> None:
        h = self.harness(base(models=[{"model_id": "p", "server_args": {"parallel": 2}}]))
        h.start()
        first = self.acquire(h, "p")
        old_child = h.live_children()[0]
        h.write(base(models=[{"model_id": "p", "ctx_size": 1024, "server_args": {"parallel": 2}}]))
        self.assertEqual(self.reload(h)[1]["models"]["restart_on_next_use"], ["p"])
        # A free slot is not enough: the old child must not be switched under the first request.
        second: List[Any] = []
        h.root.node.acquire(h.root.config.model("p")).addBoth(second.append)
        h.reactor.advance(1)
        self.assertEqual((second, old_child.signals), ([], []))
        first.release()
        self.assertIn(signal.SIGTERM, old_child.signals)
        old_child.exit(0)
        h.answer("p")
        self.assertTrue(second and isinstance(second[0], Lease), second)
        self.assertIn("1024", h.live_children()[0].argv)
        second[0].release()

    def test_requests_admitted_before_a_changed_command_finish_on_its_child_then_one_restart(self) -> None:
        """Issue 39 item 3: two running and one queued under ctx 512; the reload makes it 1024; a new
        request arrives.  The queued old one runs on the old child, the new one waits for all three,
        and the device restarts once, to the new command."""
        old_model = {"model_id": "p", "ctx_size": 512, "server_args": {"parallel": 2}}
        h = self.harness(base(models=[old_model], max_pending_requests_per_device=8))
        h.start()
        running = [self.acquire(h, "p"), self.acquire(h, "p")]
        queued: List[Any] = []
        h.root.node.acquire(h.root.config.model("p")).addBoth(queued.append)
        old_child = h.live_children()[0]
        h.write(base(models=[dict(old_model, ctx_size=1024)], max_pending_requests_per_device=8))
        self.assertEqual(self.reload(h)[1]["models"]["restart_on_next_use"], ["p"])
        new: List[Any] = []
        h.root.node.acquire(h.root.config.model("p")).addBoth(new.append)
        running.pop(0).release()
        self.assertTrue(queued and isinstance(queued[0], Lease), "the queued old request runs on the old child")
        self.assertIs(queued[0].endpoint.pid, old_child.pid)
        self.assertEqual((new, old_child.signals), ([], []), "the new one waits; nothing restarts under them")
        running.pop().release()
        self.assertEqual(old_child.signals, [])
        queued[0].release()
        self.assertEqual(old_child.signals, [signal.SIGTERM], "one restart, once the old ones are done")
        old_child.exit(0)
        h.answer("p")
        self.assertTrue(new and isinstance(new[0], Lease), new)
        (child,) = h.live_children()
        self.assertIn("1024", child.argv)
        self.assertEqual([d["stale"] for d in h.root.node.inventory()["devices"]], [False])
        self.assertEqual(len(h.reactor.processes), 2, "two children in all: the old and the new")
        new[0].release()

    def test_a_request_admitted_under_the_old_command_never_starts_it_again(self) -> None:
        """The old child crashes before the queued old request's turn: it loads the current command."""
        h = self.harness(base(models=[{"model_id": "p", "ctx_size": 512}], max_pending_requests_per_device=8))
        h.start()
        first = self.acquire(h, "p")
        queued: List[Any] = []
        h.root.node.acquire(h.root.config.model("p")).addBoth(queued.append)
        old_child = h.live_children()[0]
        h.write(base(models=[{"model_id": "p", "ctx_size": 1024}], max_pending_requests_per_device=8))
        self.reload(h)
        old_child.exit(signal=signal.SIGKILL)
        first.release()
        h.answer("p")
        self.assertTrue(queued and isinstance(queued[0], Lease), queued)
        self.assertIn("1024", h.live_children()[0].argv)
        queued[0].release()

    def test_a_reload_during_a_switch_to_the_changed_model_costs_one_load(self) -> None:
        """The old child of another model still stopping when the reload comes: the switch starts the new command."""
        h = self.harness(base(models=[{"model_id": "a"}, {"model_id": "p", "ctx_size": 512}]))
        h.start()
        self.acquire(h, "a").release()
        old_child = h.live_children()[0]
        switching: List[Any] = []
        h.root.node.acquire(h.root.config.model("p")).addBoth(switching.append)
        self.assertIn(signal.SIGTERM, old_child.signals)  # a's child stops for the switch
        h.write(base(models=[{"model_id": "a"}, {"model_id": "p", "ctx_size": 1024}]))
        self.reload(h)
        spawned = len(h.reactor.processes)
        old_child.exit(0)
        h.answer("p")
        self.assertTrue(switching and isinstance(switching[0], Lease), switching)
        self.assertEqual(len(h.reactor.processes), spawned + 1, "one load")
        self.assertIn("1024", h.live_children()[0].argv)
        switching[0].release()

    def test_changed_while_loading_the_old_load_serves_its_request_only(self) -> None:
        h = self.harness(base(models=[{"model_id": "p", "server_args": {"parallel": 2}}]))
        h.start()
        first: List[Any] = []
        h.root.node.acquire(h.root.config.model("p")).addBoth(first.append)
        h.write(base(models=[{"model_id": "p", "ctx_size": 1024, "server_args": {"parallel": 2}}]))
        self.reload(h)
        h.answer("p")  # the load begun before the reload finishes
        self.assertTrue(first and isinstance(first[0], Lease), first)
        old_child = h.live_children()[0]
        second: List[Any] = []
        h.root.node.acquire(h.root.config.model("p")).addBoth(second.append)
        self.assertEqual((second, old_child.signals), ([], []))
        first[0].release()
        old_child.exit(0)
        h.answer("p")
        self.assertTrue(second and isinstance(second[0], Lease), second)
        self.assertIn("1024", h.live_children()[0].argv)
        second[0].release()

    def test_changed_roles_keep_the_child(self) -> None:
        self.acquire(self.h, "a").release()
        child = self.h.live_children()[0]
        self.write(models=[{"model_id": "a", "ctx_size": 512, "roles": ["code"]}, {"model_id": "b", "roles": ["chat"]}])
        code, body = self.reload(self.h)
        self.assertEqual(body["models"]["updated"], ["a"])
        self.acquire(self.h, "a").release()
        self.assertEqual(child.signals, [])
        self.assertEqual(self.h.live_children(), [child])

    def test_keys_rotate_for_the_next_request(self) -> None:
        self.write(api_keys=[NEW_KEY])
        code, body = self.reload(self.h)
        self.assertEqual(code, 200)
        self.assertEqual(self.h.call("GET", "/v1/models", key=KEY)[0], 401)
        self.assertEqual(self.h.call("GET", "/v1/models", key=NEW_KEY)[0], 200)
        self.assertNotIn(NEW_KEY, repr(body))

    def test_restart_keys_are_named_and_keep_their_value(self) -> None:
        port = self.h.root.config.listen_port
        self.write(listen_port=port + 1, backend="cuda", request_timeout_s=12)
        with capturedLogs() as events:
            code, body = self.reload(self.h)
        self.assertEqual(code, 200)
        self.assertEqual(body["needs_restart"], ["listen_port", "advertise_url", "backend"])
        self.assertIn("needs a restart: listen_port, advertise_url, backend", body["message"])
        self.assertEqual(body["applied"], ["request_timeout_s"])
        self.assertEqual(self.h.root.config.listen_port, port)
        self.assertTrue(self.h.root.config.advertise_url.endswith(f":{port}"))
        self.assertEqual(self.h.api.config.request_timeout_s, 12)
        self.assertTrue(any("needs a restart" in e.get("log_format", "") for e in events))

    def test_a_model_added_with_preload_and_min_replicas_loads_them_all(self) -> None:
        """As at start-up: ``preload: true, min_replicas: 2`` loads on two devices."""
        h = self.harness(base(models=[{"model_id": "a"}]), devices=2)
        h.start()
        h.write(base(models=[{"model_id": "a"}, {"model_id": "r", "preload": True, "min_replicas": 2}]))
        self.assertEqual(self.reload(h)[1]["models"]["added"], ["r"])
        h.answer("r")
        states = {d["device"]: (d["state"], d["model"]) for d in h.root.node.inventory()["devices"]}
        self.assertEqual(states, {"gpu:0": ("ready", "r"), "gpu:1": ("ready", "r")})

    def test_preload_device_that_is_not_here_is_invalid(self) -> None:
        self.write(preload=[{"model": "a", "device": "gpu:7"}])
        code, body = self.reload(self.h)
        self.assertEqual(code, 400)
        self.assertIn('preload[0].device: "gpu:7" is not a device of this node', body["error"]["message"])

    def test_a_new_device_group_needs_a_restart_and_changes_nothing(self) -> None:
        h = self.harness(base(), devices=2)
        h.start()
        h.write(base(models=[{"model_id": "a", "ctx_size": 512, "devices": ["gpu:0", "gpu:1"]}]))
        code, body = self.reload(h)
        self.assertEqual(code, 400)
        self.assertEqual(body["error"]["message"], "models[0].devices: the device group gpu:0+gpu:1 is new; "
                         "device groups are made at start-up, so this change needs a restart")
        self.assertEqual(self.model_ids(h), ["a", "b"])

    def test_a_model_moved_to_other_devices_leaves_the_old_one_once_idle(self) -> None:
        h = self.harness(base(models=[{"model_id": "a", "devices": ["gpu:0"]}]), devices=2)
        h.start()
        lease = self.acquire(h, "a")
        self.assertEqual(lease.device, "gpu:0")
        old_child = h.live_children()[0]
        h.write(base(models=[{"model_id": "a", "devices": ["gpu:1"]}]))
        code, body = self.reload(h)
        self.assertEqual(code, 200, body)
        self.assertEqual(body["models"]["restart_on_next_use"], ["a"])
        self.assertEqual(old_child.signals, [])  # its request is still running
        lease.release()
        self.assertIn(signal.SIGTERM, old_child.signals)
        old_child.exit(0)
        moved = self.acquire(h, "a")
        self.assertEqual(moved.device, "gpu:1")
        moved.release()

    def test_command_line_overrides_hold_over_a_reload(self) -> None:
        assert self.h.root.reloader is not None
        self.h.root.reloader._overrides = {"log_format": "json"}
        self.h.root.config = self.h.api.config = attr.evolve(self.h.root.config, log_format="json")
        code, body = self.reload(self.h)
        self.assertEqual((code, body["needs_restart"]), (200, []))

    def test_nothing_changed(self) -> None:
        code, body = self.reload(self.h)
        self.assertEqual((code, body["summary"]), (200, "nothing changed"))

    def test_self_reloading_parts_are_asked_every_time(self) -> None:
        seen: List[Any] = []
        assert self.h.root.reloader is not None
        def tls(config: NodeConfig) -> str:
            seen.append(config)
            return "certificate reloaded"

        self.h.root.reloader.add_self_reloading("tls", tls)

        def broken(config: NodeConfig) -> None:
            raise RuntimeError("cannot read cert.pem")

        self.h.root.reloader.add_self_reloading("broken", broken)
        code, body = self.reload(self.h)
        self.assertEqual(code, 200)
        self.assertEqual(seen, [self.h.root.config])
        self.assertEqual(body["notes"], ["tls: certificate reloaded", "broken: cannot read cert.pem"])
        self.assertEqual(len(self.flushLoggedErrors(RuntimeError)), 1)

    def test_sighup_reloads(self) -> None:
        calls: List[Any] = []
        self.h.reactor.callFromThread = lambda f, *a: calls.append((f, a))  # type: ignore[attr-defined]
        previous = signal.getsignal(signal.SIGHUP)
        self.addCleanup(signal.signal, signal.SIGHUP, previous)
        type(self.h.root)._install_reload_signal(self.h.root)
        handler = signal.getsignal(signal.SIGHUP)
        assert callable(handler)
        handler(signal.SIGHUP, None)
        self.assertEqual(calls, [(self.h.root.reload, ("SIGHUP",))])
        self.write(models=[{"model_id": "z"}])
        result = calls[0][0](*calls[0][1])
        self.assertEqual(result.plan.added, ("z",))

    def test_no_reload_while_stopping(self) -> None:
        self.h.stop()
        self.assertEqual(self.h.root.reload().error, "reload: the agent is shutting down")


class ReregisterTests(SynchronousTestCase):
    """After a reload the dispatcher gets a fresh registration (and token)."""

    def test_fresh_registration_with_the_new_token(self) -> None:
        h = Harness()
        h.start()
        h.advance(12)
        self.assertEqual(len(h.fake.of_kind("register")), 1)
        h.client.reregister("the-new-token")
        h.advance(0)
        registers = h.fake.of_kind("register")
        self.assertEqual(len(registers), 2)
        self.assertEqual(registers[-1].headers["authorization"], ["Bearer the-new-token"])
        h.advance(6)
        self.assertEqual(h.fake.of_kind("heartbeat")[-1].headers["authorization"], ["Bearer the-new-token"])
        self.assertNotEqual(TOKEN, "the-new-token")
        h.stop()

    def test_reregister_while_a_request_is_in_flight(self) -> None:
        h = Harness()
        h.fake.hang = True
        h.start()
        h.client.reregister(TOKEN)
        h.fake.hang = False
        h.fake.release()
        h.advance(0)
        self.assertEqual(len(h.fake.of_kind("register")), 2)
        h.stop()
