"""Registration and heartbeats end to end: the agent as a process with a real
llama-server child, reporting to the fake dispatcher served over real HTTP on
loopback by a process of its own (so it can really go away and come back as a
fresh process that forgot the node)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import jsonschema
from twisted.trial.unittest import SynchronousTestCase

from rolemesh.schemas import load_schema
from tests.fixtures.llama import free_port
from tests.integration.fake_dispatcher_server import REPO_ROOT, FakeDispatcherProcess
from tests.integration.harness import AgentProcess, mem_total_bytes, require_llama_server, tiny_model, wait_until

INTERVAL = 0.5
TOKEN = "s3cret"
NODE_ID = "it-node"
CHAT = {"model": "tiny-a", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}




class DispatcherCase(SynchronousTestCase):
    """A real tiny model and a real-HTTP fake dispatcher on a fixed port (so
    it can be stopped and started again); no tests of its own."""

    #: The bearer token the fake dispatcher demands.
    dispatcher_token = TOKEN

    def setUp(self) -> None:
        require_llama_server()
        self.dir = os.path.abspath(self.mktemp())
        self.model = tiny_model(self.dir, "a", 1)
        self.dispatcher_port = free_port()

    def start_dispatcher(self) -> FakeDispatcherProcess:
        fake = FakeDispatcherProcess(self.dispatcher_port, token=self.dispatcher_token,
                                     log_path=f"{self.dir}/dispatcher.log")
        self.addCleanup(fake.stop)
        return fake


class DispatcherRealTests(DispatcherCase):
    """One agent (one cpu device, one real tiny model) and a real-HTTP fake dispatcher."""

    def start_agent(self) -> AgentProcess:
        agent = AgentProcess(self.dir, {
            "node_id": NODE_ID,
            "heartbeat_interval_s": INTERVAL,
            "full_heartbeat_interval_s": INTERVAL,  # these tests count heartbeats, deltas or not
            "dispatcher_base_url": f"http://127.0.0.1:{self.dispatcher_port}",
            "dispatcher_token": TOKEN,
            "shutdown_grace_s": 5,
            "models": [{"model_id": "tiny-a", "path": self.model, "roles": ["chat"]}],
        })
        self.addCleanup(agent.stop)
        return agent

    def chat(self, agent: AgentProcess) -> None:
        status, _, body = agent.request("POST", "/v1/chat/completions", CHAT, timeout=30)
        self.assertEqual(status, 200, body)

    def wait_for(self, fake: FakeDispatcherProcess, kind: str, count: int = 1, timeout: float = 10,
                 after: float = 0.0) -> list:
        found: list = []

        def enough() -> bool:
            found[:] = [r for r in fake.received(kind) if r["at"] > after]
            return len(found) >= count

        wait_until(enough, timeout, interval=0.05, what=f"{count} {kind} request(s) at the dispatcher")
        return found

    def assert_token_kept_secret(self, agent: AgentProcess) -> None:
        self.assertNotIn(TOKEN, agent.log_text())
        status, _, raw = agent.request("GET", "/v1/node/registration")
        self.assertEqual(status, 200)
        self.assertNotIn(TOKEN.encode(), raw)

    # ------------------------------------------------------------------

    def test_registers_then_heartbeats_live_metrics_and_loaded_model(self) -> None:
        fake = self.start_dispatcher()
        agent = self.start_agent()
        ready_at = time.time()

        registration = self.wait_for(fake, "register")[0]
        self.assertLessEqual(registration["at"], ready_at + INTERVAL, "registration took longer than one interval")
        status, _, raw = agent.request("GET", "/v1/node/registration")
        self.assertEqual(status, 200)
        self.assertEqual(json.loads(raw), registration["body"])
        jsonschema.validate(registration["body"], load_schema("registration"))
        self.assertEqual(registration["body"]["node_id"], NODE_ID)
        self.assertEqual([m["model_id"] for m in registration["body"]["served_models"]], ["tiny-a"])

        beats = self.wait_for(fake, "heartbeat", count=3)
        heartbeat_schema = load_schema("heartbeat")
        for beat in beats:
            jsonschema.validate(beat["body"], heartbeat_schema)
            self.assertEqual(beat["body"]["node_id"], NODE_ID)
        seqs = [b["body"]["seq"] for b in beats]
        self.assertEqual(seqs, sorted(set(seqs)), "heartbeat seq must increase")
        self.assertGreaterEqual(beats[1]["at"] - registration["at"], INTERVAL * 0.5, "heartbeats too early")
        first = beats[0]["body"]["devices"][0]
        self.assertEqual(first["device"], "cpu:0")
        self.assertIsNotNone(first["metrics"], first)
        self.assertEqual(first["metrics"]["memory_total_bytes"], mem_total_bytes())
        self.assertGreater(first["metrics"]["memory_free_bytes"], 0)
        self.assertFalse(first["metrics"]["stale"])
        self.assertEqual((first["state"], first["model"]), ("stopped", None))

        # After a request, the heartbeats carry the loaded model.
        self.chat(agent)
        answered = time.time()
        loaded: list = []

        def reports_loaded() -> bool:
            for beat in fake.received("heartbeat"):
                device = beat["body"]["devices"][0]
                if beat["at"] > answered and device["model"] == "tiny-a" and device["state"] == "ready":
                    loaded.append(device)
                    return True
            return False

        wait_until(reports_loaded, 5, interval=0.05, what="a heartbeat with the loaded model")
        self.assertIsInstance(loaded[0]["pid"], int)
        self.assertEqual(loaded[0]["pid"], agent.inventory()["devices"][0]["pid"])

        # Metrics are live: a later heartbeat carries a newer sample, with a utilization figure.
        newer: list = []

        def resampled() -> bool:
            for beat in fake.received("heartbeat"):
                metrics = beat["body"]["devices"][0]["metrics"]
                if metrics["sampled_at"] > first["metrics"]["sampled_at"] and metrics["utilization_pct"] is not None:
                    newer.append(metrics)
                    return True
            return False

        wait_until(resampled, 15, interval=0.2, what="a heartbeat with a fresh metrics sample")
        self.assertEqual(newer[0]["memory_total_bytes"], mem_total_bytes())
        self.assertGreaterEqual(newer[0]["utilization_pct"], 0.0)
        self.assertLessEqual(newer[0]["utilization_pct"], 100.0)

        # Every request carried the token as a bearer token (the fake answers 401 otherwise).
        received = fake.received()
        self.assertEqual({r["headers"].get("authorization", [None])[0] for r in received}, {f"Bearer {TOKEN}"})
        self.assertNotIn("unreachable", agent.log_text())
        self.assert_token_kept_secret(agent)
        check = subprocess.run([sys.executable, "-m", "rolemesh.cli", "--config", agent.config_path, "--check"],
                               cwd=REPO_ROOT, capture_output=True, timeout=60)
        self.assertEqual(check.returncode, 0, check.stderr[-2000:])
        self.assertIn(b"dispatcher", check.stdout + check.stderr)
        self.assertNotIn(TOKEN.encode(), check.stdout + check.stderr)

    def test_outage_keeps_serving_and_a_forgetful_restart_reregisters(self) -> None:
        fake = self.start_dispatcher()
        agent = self.start_agent()
        self.wait_for(fake, "register")
        self.wait_for(fake, "heartbeat", count=2)
        self.chat(agent)
        self.assertEqual(fake.stop(), 0)

        # Several intervals without a dispatcher: chat completions keep working throughout.
        down_until = time.monotonic() + 6 * INTERVAL
        chats = []

        def outage_over() -> bool:
            self.chat(agent)
            chats.append(time.monotonic())
            # at least 3 chats however slow the machine: each is a point of the outage that was served
            return time.monotonic() >= down_until and len(chats) >= 3 and "dispatcher unreachable" in agent.log_text()

        wait_until(outage_over, 30, interval=0.1, what="several intervals of dispatcher outage")
        self.assertGreaterEqual(len(chats), 3)
        log = agent.log_text()
        self.assertEqual(log.count("dispatcher unreachable"), 1, log[-3000:])
        self.assertEqual(agent.inventory()["devices"][0]["restarts"], 0)

        # The same address comes back as a fresh dispatcher that has never heard of the node.
        again = self.start_dispatcher()
        started_at = again.info()["started_at"]
        registration = self.wait_for(again, "register")[0]
        self.assertLessEqual(registration["at"] - started_at, 2 * INTERVAL,
                             "no new registration within two intervals of the dispatcher's return")
        status, _, raw = agent.request("GET", "/v1/node/registration")
        self.assertEqual(json.loads(raw), registration["body"])
        self.wait_for(again, "heartbeat", after=registration["at"])  # heartbeats resume
        self.assertEqual(again.info()["nodes"], [NODE_ID])
        self.chat(agent)

        def logged_recovery() -> bool:
            return "dispatcher reachable again" in agent.log_text()

        wait_until(logged_recovery, 5, what="the recovery log line")
        log = agent.log_text()
        self.assertEqual(log.count("dispatcher unreachable"), 1, log[-3000:])
        self.assertEqual(log.count("dispatcher reachable again"), 1, log[-3000:])
        self.assert_token_kept_secret(agent)

    def test_late_dispatcher_gets_registration_and_graceful_stop_deregisters(self) -> None:
        # No dispatcher yet: the agent serves locally and keeps trying in the background.
        agent = self.start_agent()
        self.chat(agent)
        wait_until(lambda: "dispatcher unreachable" in agent.log_text(), 10, what="the unreachable log line")

        fake = self.start_dispatcher()
        started_at = fake.info()["started_at"]
        registration = self.wait_for(fake, "register")[0]
        self.assertLessEqual(registration["at"] - started_at, 2 * INTERVAL)
        self.wait_for(fake, "heartbeat", after=registration["at"])

        self.assertEqual(agent.stop(), 0)
        deregistrations = fake.received("deregister")
        self.assertEqual(len(deregistrations), 1, fake.received())
        self.assertEqual(deregistrations[0]["body"], {"node_id": NODE_ID})
        self.assertEqual(deregistrations[0]["headers"]["authorization"], [f"Bearer {TOKEN}"])
        self.assertEqual(fake.info()["nodes"], [])
        self.assertNotIn(TOKEN, agent.log_text())
