"""Running in a fleet, end to end: the agent as a process with real
llama-server children on tiny generated models, and the fake dispatcher over
real HTTP in a process of its own.

- ``GET /ready`` flips: 503 until preloading is done and the dispatcher has
  the node, 503 while the dispatcher is down, 200 again once it is back,
  503 while draining;
- a reload under load loses no request: a model added answers, a model
  removed leaves ``/v1/models`` at once and its child exits once its last
  request is done, a model whose command changed restarts, keys rotate, the
  dispatcher gets a fresh registration, a restart-only key is named.

A request is held in flight, deterministically, by stopping its llama-server
child with SIGSTOP (and resuming it with SIGCONT).
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from typing import Any, Dict, List, Optional, Tuple

import yaml
from twisted.trial.unittest import SynchronousTestCase

from tests.fixtures.llama import free_port, http_request
from tests.integration.fake_dispatcher_server import FakeDispatcherProcess
from tests.integration.harness import AgentProcess, pid_alive, require_llama_server, tiny_model, wait_until
from tests.integration.test_dispatcher_real import DispatcherCase

INTERVAL = 0.5
TOKEN = "fleet-token"
KEY_1 = "sk-fleet-first-key-0123456789"
KEY_2 = "sk-fleet-second-key-987654321"


def chat(model: str, tokens: int = 4) -> Dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": "hello"}], "max_tokens": tokens}


def ready(agent: AgentProcess) -> Tuple[int, Dict[str, Any]]:
    status, _, body = agent.request("GET", "/ready", timeout=5)
    return status, json.loads(body)


class InFlight:
    """One request sent from a thread, answered later."""

    def __init__(self, agent: AgentProcess, body: Dict[str, Any], key: Optional[str] = None) -> None:
        self.result: List[Tuple[int, bytes]] = []
        headers = {"Authorization": f"Bearer {key}"} if key else {}

        def send() -> None:
            status, _, raw = http_request("POST", agent.url + "/v1/chat/completions", body, headers=headers,
                                          timeout=120)
            self.result.append((status, raw))

        self.thread = threading.Thread(target=send, daemon=True)
        self.thread.start()

    def wait(self, timeout: float = 60) -> Tuple[int, bytes]:
        self.thread.join(timeout)
        assert self.result, "no answer"
        return self.result[0]


def inventory(agent: AgentProcess, key: Optional[str] = None) -> Dict[str, Any]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    status, _, raw = agent.request("GET", "/v1/node/inventory", headers=headers)
    assert status == 200, raw
    return json.loads(raw)


def in_flight(agent: AgentProcess, device: str, key: Optional[str] = None) -> int:
    for d in inventory(agent, key)["devices"]:
        if d["device"] == device:
            return d["in_flight"]
    raise AssertionError(f"no device {device}")


class ReadyFlipsTests(DispatcherCase):
    dispatcher_token = TOKEN

    def test_start_preload_dispatcher_down_and_drain(self) -> None:
        fake = self.start_dispatcher()
        agent = AgentProcess(self.dir, {
            "heartbeat_interval_s": INTERVAL,
            "full_heartbeat_interval_s": INTERVAL,
            "dispatcher_base_url": f"http://127.0.0.1:{self.dispatcher_port}",
            "dispatcher_token": TOKEN,
            "shutdown_grace_s": 30,
            "models": [{"model_id": "tiny-a", "path": self.model, "preload": True}],
        })
        self.addCleanup(agent.stop)

        # Start: not ready until the preload is done and the dispatcher has the node.
        seen: List[str] = []

        def became_ready() -> bool:
            status, body = ready(agent)
            if status == 200:
                return True
            seen.append(body["failing"].split(":")[0])
            return False

        wait_until(became_ready, 60, interval=0.01, what="/ready 200")
        self.assertTrue(set(seen) <= {"preload", "dispatcher"}, seen)
        device = agent.inventory()["devices"][0]
        self.assertEqual((device["state"], device["model"]), ("ready", "tiny-a"), "ready before the preload was")
        self.assertTrue(fake.received("register"), "ready before registering")

        # Dispatcher down: not ready, and it says why; local serving goes on.
        fake.stop()
        wait_until(lambda: ready(agent)[0] == 503, 20, interval=0.05, what="/ready 503 with the dispatcher down")
        status, body = ready(agent)
        self.assertTrue(body["failing"].startswith("dispatcher: not registered"), body)
        self.assertEqual(agent.request("GET", "/health")[0], 200)
        self.assertEqual(agent.request("POST", "/v1/chat/completions", chat("tiny-a"), timeout=60)[0], 200)

        # It comes back (a fresh process that forgot the node): ready again.
        self.start_dispatcher()
        wait_until(lambda: ready(agent)[0] == 200, 30, interval=0.05, what="/ready 200 after the dispatcher is back")

        # Drain: hold a request in flight (its child stopped), then SIGTERM.
        child = agent.child_pids()[0]
        os.kill(child, signal.SIGSTOP)
        resumed = False
        try:
            held = InFlight(agent, chat("tiny-a"))
            wait_until(lambda: in_flight(agent, "cpu:0") == 1, 10, what="the request in flight")
            agent.process.send_signal(signal.SIGTERM)
            wait_until(lambda: ready(agent)[0] == 503, 10, interval=0.02, what="/ready 503 while draining")
            status, body = ready(agent)
            self.assertEqual(body["failing"], "draining: draining for shutdown")
            self.assertEqual(agent.request("GET", "/health")[0], 200)
            os.kill(child, signal.SIGCONT)
            resumed = True
            self.assertEqual(held.wait()[0], 200)
        finally:
            if not resumed:
                os.kill(child, signal.SIGCONT)
        self.assertEqual(agent.process.wait(30), 0)


class ReloadUnderLoadTests(SynchronousTestCase):
    def setUp(self) -> None:
        require_llama_server()
        self.dir = os.path.abspath(self.mktemp())
        self.paths = {name: tiny_model(self.dir, name, seed) for seed, name in enumerate("abc", 1)}
        self.dispatcher_port = free_port()

    def config(self, models: List[Dict[str, Any]], keys: List[str], **top: Any) -> Dict[str, Any]:
        return {
            "cpu_devices": 2,
            "api_keys": keys,
            "heartbeat_interval_s": INTERVAL,
            "full_heartbeat_interval_s": INTERVAL,
            "dispatcher_base_url": f"http://127.0.0.1:{self.dispatcher_port}",
            "dispatcher_token": TOKEN,
            "max_pending_requests_per_device": 16,
            "models": [{"path": self.paths[m["model_id"]], **m} for m in models],
            **top,
        }

    def rewrite(self, agent: AgentProcess, config: Dict[str, Any]) -> None:
        with open(agent.config_path, encoding="utf-8") as f:
            current = yaml.safe_load(f)
        current.update(config)
        with open(agent.config_path, "w", encoding="utf-8") as f:
            yaml.safe_dump(current, f)

    def reload(self, agent: AgentProcess, key: str) -> Tuple[int, Dict[str, Any]]:
        status, _, raw = agent.request("POST", "/v1/node/reload", headers={"Authorization": f"Bearer {key}"},
                                       timeout=30)
        return status, json.loads(raw)

    def models(self, agent: AgentProcess, key: str) -> List[str]:
        status, _, raw = agent.request("GET", "/v1/models", headers={"Authorization": f"Bearer {key}"})
        self.assertEqual(status, 200, raw)
        return [m["id"] + (" (leaving)" if m.get("leaving") else "") for m in json.loads(raw)["data"]]

    def test_reload_under_load_loses_no_request(self) -> None:
        fake = FakeDispatcherProcess(self.dispatcher_port, token=TOKEN, log_path=f"{self.dir}/dispatcher.log")
        self.addCleanup(fake.stop)
        agent = AgentProcess(self.dir, self.config(
            [{"model_id": "a", "ctx_size": 256}, {"model_id": "b"}], [KEY_1],
            preload=[{"model": "a", "device": "cpu:0"}, {"model": "b", "device": "cpu:1"}],
        ))
        self.addCleanup(agent.stop)
        wait_until(lambda: ready(agent)[0] == 200, 60, interval=0.05, what="/ready 200")
        devices = {d["device"]: d for d in inventory(agent, KEY_1)["devices"]}
        self.assertEqual((devices["cpu:0"]["model"], devices["cpu:1"]["model"]), ("a", "b"))
        b_child = devices["cpu:1"]["pid"]
        a_child = devices["cpu:0"]["pid"]

        # Load: two clients asking for model a all along, with the current key.
        key = [KEY_1]
        stop = threading.Event()
        answers: List[Tuple[int, str, int, bytes]] = []

        def client(n: int) -> None:
            while not stop.is_set():
                used = key[0]
                status, _, raw = http_request("POST", agent.url + "/v1/chat/completions", chat("a"),
                                              headers={"Authorization": f"Bearer {used}"}, timeout=120)
                answers.append((n, used, status, raw))

        clients = [threading.Thread(target=client, args=(n,), daemon=True) for n in range(2)]
        for thread in clients:
            thread.start()
        self.addCleanup(stop.set)
        wait_until(lambda: len(answers) >= 4, 60, what="load running")

        # A request for b is in flight (its child stopped) when b is removed.
        os.kill(b_child, signal.SIGSTOP)
        resumed = False
        try:
            held = InFlight(agent, chat("b"), key=KEY_1)
            wait_until(lambda: in_flight(agent, "cpu:1", KEY_1) == 1, 10, what="b's request in flight")
            since = time.time()
            self.rewrite(agent, self.config(
                [{"model_id": "a", "ctx_size": 512}, {"model_id": "c"}], [KEY_1, KEY_2], listen_port=free_port(),
                preload=[{"model": "a", "device": "cpu:0"}],
            ))
            status, body = self.reload(agent, KEY_1)
            self.assertEqual(status, 200, body)
            self.assertEqual(body["models"]["added"], ["c"])
            self.assertEqual(body["models"]["removed"], ["b"])
            self.assertEqual(body["models"]["restart_on_next_use"], ["a"])
            self.assertIn("listen_port", body["needs_restart"])
            self.assertIn("needs a restart", agent.log_text())
            # b leaves /v1/models once idle: while its request runs it is listed as leaving.
            self.assertEqual(self.models(agent, KEY_1), ["a", "c", "b (leaving)"])
            self.assertTrue(pid_alive(b_child), "b's child stopped under its request")
            os.kill(b_child, signal.SIGCONT)
            resumed = True
            status, raw = held.wait()
            self.assertEqual(status, 200, raw)
        finally:
            if not resumed:
                os.kill(b_child, signal.SIGCONT)
        wait_until(lambda: not pid_alive(b_child), 20, what="b's child gone once idle")
        self.assertEqual(self.models(agent, KEY_1), ["a", "c"])

        # The new model answers; a restarted with its new command.
        status, _, raw = agent.request("POST", "/v1/chat/completions", chat("c"),
                                       headers={"Authorization": f"Bearer {KEY_2}"}, timeout=120)
        self.assertEqual(status, 200, raw)
        self.assertEqual(json.loads(raw)["model"], "c")
        wait_until(lambda: not pid_alive(a_child), 30, what="a's old child replaced")
        def ready_a() -> list:
            return [d for d in inventory(agent, KEY_2)["devices"] if d["model"] == "a" and d["state"] == "ready"]

        wait_until(ready_a, 30, what="a ready again with its new command")  # its preload: started, then ready
        serving_a = ready_a()
        with open(f"/proc/{serving_a[0]['pid']}/cmdline", "rb") as f:
            argv = f.read().split(b"\0")
        self.assertEqual(argv[argv.index(b"--ctx-size") + 1], b"512")

        # The dispatcher got a fresh registration with the new models.
        def registered_again() -> bool:
            for r in fake.received("register"):
                served = [m["model_id"] for m in r["body"]["served_models"]]
                if r["at"] >= since and served == ["a", "c"]:
                    return True
            return False

        wait_until(registered_again, 10, interval=0.05, what="a fresh registration")

        # Keys rotate: clients move to the new key, then the old one goes.
        key[0] = KEY_2
        wait_until(lambda: {n for n, used, _, _ in answers if used == KEY_2} == {0, 1}, 60,
                   what="every client on the new key")
        self.rewrite(agent, self.config([{"model_id": "a", "ctx_size": 512}, {"model_id": "c"}], [KEY_2]))
        status, body = self.reload(agent, KEY_2)
        self.assertEqual(status, 200, body)
        self.assertEqual(agent.request("GET", "/v1/models", headers={"Authorization": f"Bearer {KEY_1}"})[0], 401)
        settled = len(answers)
        wait_until(lambda: len(answers) >= settled + 4, 60, what="load after the rotation")

        # An invalid file changes nothing and says why.
        with open(agent.config_path, "a", encoding="utf-8") as f:
            f.write("no_such_key: 1\n")
        status, body = self.reload(agent, KEY_2)
        self.assertEqual(status, 400)
        self.assertIn("no_such_key", body["error"]["message"])
        self.assertEqual(self.models(agent, KEY_2), ["a", "c"])

        stop.set()
        for thread in clients:
            thread.join(120)
        failed = [(n, status, raw[:200]) for n, _, status, raw in answers if status != 200]
        self.assertEqual(failed, [], f"{len(failed)} of {len(answers)} requests failed")
        self.assertGreater(len(answers), 12)


class SighupTests(SynchronousTestCase):
    def test_sighup_reloads_and_a_bad_file_is_logged_not_fatal(self) -> None:
        require_llama_server()
        directory = os.path.abspath(self.mktemp())
        a, b = tiny_model(directory, "a", 1), tiny_model(directory, "b", 2)
        agent = AgentProcess(directory, {"models": [{"model_id": "a", "path": a}]})
        self.addCleanup(agent.stop)

        def served() -> List[str]:
            status, _, raw = agent.request("GET", "/v1/models")
            return [m["id"] for m in json.loads(raw)["data"]]

        with open(agent.config_path, encoding="utf-8") as f:
            config = yaml.safe_load(f)
        config["models"].append({"model_id": "b", "path": b})
        with open(agent.config_path, "w", encoding="utf-8") as f:
            yaml.safe_dump(config, f)
        agent.process.send_signal(signal.SIGHUP)
        wait_until(lambda: served() == ["a", "b"], 10, what="model b after SIGHUP")
        self.assertIn("config reloaded (SIGHUP): models added: b", agent.log_text())

        with open(agent.config_path, "a", encoding="utf-8") as f:
            f.write("models: [\n")
        agent.process.send_signal(signal.SIGHUP)
        wait_until(lambda: "config reload (SIGHUP) failed" in agent.log_text(), 10, what="the error logged")
        self.assertIn("invalid YAML", agent.log_text())
        self.assertEqual(served(), ["a", "b"])
        self.assertIsNone(agent.process.poll())
        self.assertEqual(agent.stop(), 0)
