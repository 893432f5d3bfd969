"""``rolemesh-node-agent status`` against a running agent with a real
llama-server (issue 28, item 5): the table, ``--json``, the address and key
read from the agent's own config, and one line with exit status 1 when no
agent answers."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from twisted.trial.unittest import SynchronousTestCase

from tests.fixtures.llama import free_port
from tests.integration.harness import AgentProcess, require_llama_server, tiny_model, wait_until

KEY = "status-test-key"


def status(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rolemesh.cli", "status", *argv], capture_output=True,
                          text=True, timeout=60)


class StatusCommandTests(SynchronousTestCase):
    def test_the_table_of_a_running_agent(self) -> None:
        require_llama_server()
        directory = os.path.abspath(self.mktemp())
        a, b = tiny_model(directory, "a", 1), tiny_model(directory, "b", 2)
        agent = AgentProcess(directory, {"api_key": KEY, "models": [
            {"model_id": "a", "path": a, "preload": True, "roles": ["chat"]}, {"model_id": "b", "path": b}]})
        self.addCleanup(agent.stop)
        auth = {"Authorization": f"Bearer {KEY}"}
        wait_until(lambda: json.loads(agent.request("GET", "/v1/node/inventory", headers=auth)[2])
                   ["devices"][0]["slots_total"] == 1, 20, what="a ready child's slots sampled")

        done = status("--config", agent.config_path)
        self.assertEqual((done.returncode, done.stderr), (0, ""))
        lines = done.stdout.splitlines()
        self.assertEqual(lines[0], f"node it-node at http://127.0.0.1:{agent.port}: backend cpu")
        header = lines[2].split()
        self.assertEqual(header[:4], ["DEVICE", "BACKEND", "MODEL", "STATE"])
        device = lines[3].split()
        self.assertEqual(device[:4], ["cpu:0", "cpu", "a", "ready"])
        self.assertIn("0/1", device)  # slots busy/total from the child's /slots
        self.assertIn("0/2", device)  # queue / pending limit
        self.assertIn("MiB", lines[3])  # the estimate and the measured memory
        models = {line.split()[0]: line.split() for line in lines[5:] if line and not line.startswith("warning")}
        self.assertEqual(models["MODEL"][:3], ["MODEL", "LOADED", "ON"])
        self.assertEqual(models["a"][1], "cpu:0")
        self.assertEqual(models["b"][1:3], ["-", "-"])

        # The demo config as shipped (its model paths are placeholders), with only where this agent
        # listens and its key laid over it: status reads those and nothing else.
        override = os.path.join(directory, "where.yaml")
        with open(override, "w", encoding="utf-8") as f:
            json.dump({"listen_port": agent.port, "api_keys": [KEY]}, f)
        demo = os.path.join(os.path.dirname(__file__), "..", "..", "configs", "demo.yaml")
        done = status("--config", demo, "--config-override", override)
        self.assertEqual((done.returncode, done.stderr), (0, ""))
        self.assertEqual(done.stdout.splitlines()[0], f"node it-node at http://127.0.0.1:{agent.port}: backend cpu")
        self.assertEqual(done.stdout.splitlines()[3].split()[:3], ["cpu:0", "cpu", "a"])

        as_json = status("--url", agent.url, "--api-key", KEY, "--json")
        self.assertEqual(as_json.returncode, 0, as_json.stderr)
        data = json.loads(as_json.stdout)
        self.assertEqual(data["inventory"]["devices"][0]["model"], "a")
        self.assertEqual(sorted(m["id"] for m in data["models"]["data"]), ["a", "b"])

        refused = status("--url", agent.url)
        self.assertEqual(refused.returncode, 1)
        self.assertEqual(refused.stderr, f"rolemesh-node-agent status: the agent at {agent.url} refused the API "
                                         "key (401); give --api-key or --config\n")

    def test_no_agent_is_one_line_and_status_1(self) -> None:
        url = f"http://127.0.0.1:{free_port()}"
        done = status("--url", url)
        self.assertEqual(done.returncode, 1)
        self.assertEqual(len(done.stderr.splitlines()), 1, done.stderr)
        self.assertTrue(done.stderr.startswith(f"rolemesh-node-agent status: no agent answers at {url} ("),
                        done.stderr)
        self.assertEqual(done.stdout, "")
