"""Two agents on one host (issue 26), as real processes with real
llama-server children.

With default settings both would use the same ``state_dir``: the second
refuses to start, in one line naming the folder, the first agent's pid and
the key to set, exit status 2 -- and the first agent's child is untouched
(before, the second's start-up sweep SIGKILLed it as a leftover).  With a
``state_dir`` each, both serve.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import yaml
from twisted.trial.unittest import SynchronousTestCase

from rolemesh.children import diagnosis
from tests.fixtures.llama import free_port
from tests.integration.harness import AgentProcess, pid_alive, require_llama_server, tiny_model, wait_until


class OneHostTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.binary = require_llama_server()
        self.dir = os.path.abspath(self.mktemp())
        self.model = tiny_model(os.path.join(self.dir, "models"), "host", seed=11)
        # "Default settings": no state_dir in the configs, so the default
        # under XDG_STATE_HOME -- here a folder of the test's own.
        self.env = {"XDG_STATE_HOME": os.path.join(self.dir, "xdg-state")}
        self.default_state_dir = os.path.join(self.env["XDG_STATE_HOME"], "rolemesh-node")

    def config(self, **top):
        return {"llama_server_bin": self.binary, "node_id": "host-node",
                "models": [{"model_id": "m", "path": self.model, "ctx_size": 256, "preload": True}], **top}

    def start(self, name: str, **top) -> AgentProcess:
        agent = AgentProcess(os.path.join(self.dir, name), self.config(**top), env=self.env,
                             own_state_dir="state_dir" in top)
        self.addCleanup(agent.stop)
        wait_until(lambda: any(d["state"] == "ready" for d in agent.inventory()["devices"]), 60,
                   what=f"{name}'s child ready")
        return agent

    def completes(self, agent: AgentProcess) -> None:
        status, _, body = agent.request("POST", "/v1/completions", {"model": "m", "prompt": "hi", "max_tokens": 2},
                                        timeout=60)
        self.assertEqual(status, 200, body)

    def test_a_second_agent_on_the_default_state_dir_refuses_and_touches_nothing(self) -> None:
        first = self.start("first")
        (child,) = first.child_pids()
        path = os.path.join(self.dir, "second.yaml")
        with open(path, "w", encoding="utf-8") as f:
            yaml.safe_dump({**self.config(), "listen_port": free_port(), "backend": "cpu"}, f)
        second = subprocess.run([sys.executable, "-m", "rolemesh.cli", "--config", path], capture_output=True,
                                text=True, timeout=120, env={**os.environ, **self.env}, stdin=subprocess.DEVNULL)
        self.assertEqual(second.returncode, 2, second.stderr)
        self.assertEqual(second.stderr.count("\n"), 1, second.stderr)  # one line, no traceback
        line = second.stderr.strip()
        self.assertTrue(line.startswith("rolemesh-node-agent: state_dir: "), line)
        self.assertIn(self.default_state_dir, line)
        self.assertIn(f"(pid {first.process.pid})", line)
        self.assertIn("state_dir of its own", line)

        self.assertTrue(pid_alive(child), "the first agent's child was killed")
        self.assertEqual(first.child_pids(), [child])
        self.completes(first)
        self.assertNotIn("killed by", first.log_text())

    def test_agents_with_a_state_dir_each_both_serve(self) -> None:
        first = self.start("first", state_dir=os.path.join(self.dir, "state-1"))
        (child,) = first.child_pids()
        second = self.start("second", state_dir=os.path.join(self.dir, "state-2"))
        self.assertNotEqual(second.child_pids(), [child])
        self.completes(first)
        self.completes(second)
        self.assertEqual(first.child_pids(), [child])
        self.assertTrue(pid_alive(child))

    def test_a_child_killed_by_another_process_is_reported_as_such(self) -> None:
        """What the first agent said when the second's sweep SIGKILLed its
        child: no longer "often the kernel's out-of-memory killer"."""
        agent = self.start("first", state_dir=os.path.join(self.dir, "state-1"))
        (child,) = agent.child_pids()
        os.kill(child, signal.SIGKILL)
        seen = []

        def reported() -> bool:
            seen[:] = [agent.inventory()["devices"][0]["last_error"]]
            return bool(seen[0])

        wait_until(reported, 30, what="the crash reported")
        error = seen[0]
        self.assertIn("killed by SIGKILL unexpectedly (a signal from another process, not the agent's", error)
        self.assertNotIn("out-of-memory killer:", error)
        if diagnosis.oom_counter(os.getpid())() is not None:  # this host counts OOM kills
            self.assertIn("not the kernel's out-of-memory killer, whose oom_kill count in the cgroup did not rise",
                          error)
