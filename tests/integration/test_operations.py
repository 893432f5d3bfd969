"""Operator-facing behaviour end to end with a real llama-server: preload,
idle unload, operator load/unload, the logs endpoint, JSON logs, API keys."""

from __future__ import annotations

import json
import os
import socket

from twisted.trial.unittest import SkipTest, SynchronousTestCase

from tests.integration.harness import (
    AgentProcess,
    http_request,
    pid_alive,
    require_llama_server,
    tiny_model,
    wait_until,
)

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


class OperationsTests(SynchronousTestCase):
    def setUp(self):
        require_llama_server()
        self.dir = os.path.abspath(self.mktemp())
        self.a = tiny_model(self.dir, "a", 1)
        self.b = tiny_model(self.dir, "b", 2)

    def agent(self, models, env=None, **top):
        agent = AgentProcess(self.dir, {"models": models, **top}, env=env)
        self.addCleanup(agent.stop)
        return agent

    def device(self, agent):
        return agent.inventory()["devices"][0]

    def test_preload_is_visible_without_any_request(self):
        agent = self.agent([{"model_id": "a", "path": self.a}, {"model_id": "b", "path": self.b, "preload": True}])
        wait_until(lambda: self.device(agent)["state"] == "ready", 15, what="preloaded model ready")
        self.assertEqual(self.device(agent)["model"], "b")

    def test_idle_unload_stops_the_child_and_the_next_request_restarts_it(self):
        agent = self.agent([{"model_id": "a", "path": self.a, "idle_unload_s": 1}])
        status, _, _ = agent.request("POST", "/v1/chat/completions", {"model": "a", **CHAT})
        self.assertEqual(status, 200)
        pid = self.device(agent)["pid"]
        wait_until(lambda: self.device(agent)["state"] == "stopped", 10, what="idle unload")
        wait_until(lambda: not pid_alive(pid), 5, what="child gone")
        status, _, _ = agent.request("POST", "/v1/chat/completions", {"model": "a", **CHAT})
        self.assertEqual(status, 200)
        self.assertNotEqual(self.device(agent)["pid"], pid)

    def test_operator_load_unload_and_logs(self):
        agent = self.agent([{"model_id": "a", "path": self.a}, {"model_id": "b", "path": self.b}])
        status, _, body = agent.request("POST", "/v1/node/devices/cpu:0/load", {"model": "b"})
        self.assertEqual((status, json.loads(body)["state"], json.loads(body)["model"]), (200, "ready", "b"))
        status, _, body = agent.request("GET", "/v1/node/devices/cpu:0/logs?tail=500")
        lines = json.loads(body)["lines"]
        self.assertTrue(any("load_model" in line for line in lines), lines[-5:])  # printed before ready
        status, _, body = agent.request("POST", "/v1/node/devices/cpu:0/unload")
        self.assertEqual((status, json.loads(body)["state"]), (200, "stopped"))
        status, _, _ = agent.request("GET", "/v1/node/devices/..%2F..%2Fetc/logs")
        self.assertEqual(status, 404)

    def test_json_logs_carry_request_fields(self):
        agent = self.agent([{"model_id": "a", "path": self.a}], log_format="json")
        status, headers, _ = agent.request("POST", "/v1/chat/completions", {"model": "a", **CHAT},
                                           headers={"X-Request-Id": "req-42"})
        self.assertEqual((status, headers["x-request-id"]), (200, "req-42"))
        agent.stop()
        records = [json.loads(line) for line in agent.log_text().splitlines() if line.strip()]
        mine = [r for r in records if r.get("request_id") == "req-42"]
        self.assertEqual(len(mine), 1, records[-5:])
        self.assertEqual((mine[0]["model"], mine[0]["status"], mine[0]["device"]), ("a", 200, "cpu:0"))
        self.assertIn("duration", mine[0])

    def test_several_listen_addresses(self):
        """llama-server's ``--host 127.0.0.1,::1``: the agent answers on each address, one port."""
        try:
            with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as probe:
                probe.bind(("::1", 0))
        except OSError:
            raise SkipTest("no IPv6 loopback here")
        agent = self.agent([{"model_id": "a", "path": self.a}], listen_host="127.0.0.1,::1")
        for host in ("127.0.0.1", "[::1]"):
            status, _, body = http_request("GET", f"http://{host}:{agent.port}/v1/models", timeout=5)
            self.assertEqual((status, [m["id"] for m in json.loads(body)["data"]]), (200, ["a"]), host)
        status, _, _ = http_request("POST", f"http://[::1]:{agent.port}/v1/chat/completions",
                                    {"model": "a", **CHAT}, timeout=30)
        self.assertEqual(status, 200)

    def test_api_key_from_the_environment(self):
        agent = self.agent([{"model_id": "a", "path": self.a}], env={"ROLEMESH_IT_KEY": "sekrit-123"},
                           api_key_env="ROLEMESH_IT_KEY")
        self.assertEqual(agent.request("GET", "/health")[0], 200)
        status, headers, body = agent.request("POST", "/v1/chat/completions", {"model": "a", **CHAT})
        self.assertEqual((status, json.loads(body)["error"]["code"]), (401, "invalid_api_key"))
        status, _, _ = agent.request("POST", "/v1/chat/completions", {"model": "a", **CHAT},
                                     headers={"Authorization": "Bearer sekrit-123"})
        self.assertEqual(status, 200)
        self.assertEqual(agent.request("GET", "/v1/node/inventory")[0], 401)
        self.assertEqual(agent.request("GET", "/metrics")[0], 401)
        agent.stop()
        self.assertNotIn("sekrit-123", agent.log_text())
