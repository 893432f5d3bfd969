"""An agent that is SIGKILLed (the OOM killer, ``kill -9``, a crashed
container runtime) runs no shutdown code at all: its llama-server children
must still go, by the kernel's parent-death signal (rolemesh.children.wrapper)."""

from __future__ import annotations

import os
import signal

from twisted.trial.unittest import SynchronousTestCase

from tests.integration.harness import (
    AgentProcess,
    children_of,
    pid_alive,
    require_llama_server,
    tiny_model,
    wait_until,
    write_fake_llama_server_bin,
)

#: Seconds within which every child must be gone after the agent's SIGKILL.
BOUND_S = 10.0


class OrphanTests(SynchronousTestCase):
    def sigkill_and_assert_no_child_left(self, agent: AgentProcess, expected: int) -> None:
        wait_until(lambda: len([d for d in agent.inventory()["devices"] if d["state"] == "ready"]) == expected,
                   60, what=f"{expected} ready children")
        children = agent.child_pids()
        self.assertEqual(len(children), expected)
        self.assertEqual(sorted(children), sorted(children_of(agent.process.pid)),
                         "the children are the agent's own (the exec wrapper kept their pids)")
        self.addCleanup(lambda: [os.kill(p, signal.SIGKILL) for p in children if pid_alive(p)])
        agent.process.send_signal(signal.SIGKILL)
        agent.process.wait(BOUND_S)
        wait_until(lambda: not any(pid_alive(p) for p in children), BOUND_S,
                   what=f"llama-server pids {children} gone after the agent's SIGKILL")

    def test_fake_children_on_two_devices(self) -> None:
        directory = os.path.abspath(self.mktemp())
        os.makedirs(directory)
        model = os.path.join(directory, "m.gguf")
        open(model, "wb").close()
        config = {"llama_server_bin": write_fake_llama_server_bin(directory), "cpu_devices": 2,
                  "models": [{"model_id": "m", "path": model}],
                  "preload": [{"model": "m", "device": "cpu:0"}, {"model": "m", "device": "cpu:1"}]}
        agent = AgentProcess(directory, config, env={"FAKE_LLAMA": ""})
        self.addCleanup(agent.stop)
        self.sigkill_and_assert_no_child_left(agent, 2)

    def test_real_llama_server(self) -> None:
        binary = require_llama_server()
        directory = os.path.abspath(self.mktemp())
        model = tiny_model(os.path.join(directory, "models"), "orphan", seed=7)
        config = {"llama_server_bin": binary, "models": [{"model_id": "m", "path": model, "ctx_size": 256,
                                                          "preload": True}]}
        agent = AgentProcess(directory, config)
        self.addCleanup(agent.stop)
        self.sigkill_and_assert_no_child_left(agent, 1)
