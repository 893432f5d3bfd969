"""Both ways to run the agent handle signals the same way: the console script
(``rolemesh-node-agent``) and ``twistd -n rolemesh-node``.  twistd starts
the service before the reactor runs and the reactor installs its own
handlers then, so handlers installed in ``startService`` were lost there."""

from __future__ import annotations

import http.client
import json
import os
import signal
import subprocess
import sys
import time
from typing import Any, Dict, List

import yaml
from twisted.trial.unittest import SynchronousTestCase

from tests.fixtures.llama import free_port, read_sse
from tests.integration.harness import AgentProcess, pid_alive, wait_until, write_fake_llama_server_bin

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
CHECKOUT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def console_script(config_path: str) -> List[str]:
    return [sys.executable, "-m", "rolemesh.cli", "--config", config_path]


def twistd(config_path: str, *options: str) -> List[str]:
    # ``python -m twisted.scripts.twistd`` does nothing (the module has no
    # ``__main__`` block); this is what the ``twistd`` script runs.
    return [sys.executable, "-c", "from twisted.scripts.twistd import run; run()", *options, "-n", "--pidfile=",
            "rolemesh-node", "--config", config_path]


class EntryPointAgent(AgentProcess):
    """:class:`AgentProcess` started by a given command line."""

    def __init__(self, directory: str, config: Dict[str, Any], command: Any, env: Dict[str, str]) -> None:
        self.directory = directory
        os.makedirs(directory, exist_ok=True)
        self.port = free_port()
        config = {"node_id": "it-node", "listen_port": self.port, "state_dir": os.path.join(directory, "state"),
                  "llama_server_probe_interval_s": 0.05, "backend": "cpu", **config}
        self.config_path = os.path.join(directory, "agent.yaml")
        with open(self.config_path, "w", encoding="utf-8") as f:
            yaml.safe_dump(config, f)
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = os.path.join(directory, "agent.log")
        self._log = open(self.log_path, "ab")
        path = os.pathsep.join([CHECKOUT] + [p for p in [os.environ.get("PYTHONPATH")] if p])
        self.process = subprocess.Popen(command(self.config_path), stdout=self._log, stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL, cwd=directory,
                                        env={**os.environ, "PYTHONPATH": path, **env})
        try:
            wait_until(self._healthy, 30, what="agent /health")
        except AssertionError:
            self.stop()
            raise AssertionError("agent did not start:\n" + self.log_text()[-3000:])


class SignalTestsMixin:
    command: Any
    #: The reactor class the entry point runs the agent on.
    reactor: str

    def agent(self, flags: str, **top: Any) -> EntryPointAgent:
        self.dir = os.path.abspath(self.mktemp())  # type: ignore[attr-defined]
        os.makedirs(self.dir)
        model = os.path.join(self.dir, "m.gguf")
        open(model, "wb").close()
        config = {"llama_server_bin": write_fake_llama_server_bin(self.dir),
                  "models": [{"model_id": "m", "path": model}], **top}
        agent = EntryPointAgent(self.dir, config, type(self).command, {"FAKE_LLAMA": flags})
        self.addCleanup(agent.stop)  # type: ignore[attr-defined]
        return agent

    def start_stream(self, agent: EntryPointAgent, tokens: int) -> Any:
        conn = http.client.HTTPConnection("127.0.0.1", agent.port, timeout=30)
        conn.request("POST", "/v1/chat/completions", json.dumps({**CHAT, "stream": True, "max_tokens": tokens}),
                     {"Content-Type": "application/json"})
        response = conn.getresponse()
        assert response.readline().startswith(b"data: ")
        return conn, response

    def test_first_sigterm_drains_the_stream(self) -> None:
        agent = self.agent("slow_tokens=0.05", shutdown_grace_s=30)
        conn, response = self.start_stream(agent, 40)
        child = agent.child_pids()[0]
        agent.process.send_signal(signal.SIGTERM)
        wait_until(lambda: "draining 1 request(s) in flight" in agent.log_text(), 10, what="the drain")
        events = read_sse(response.read())
        conn.close()
        self.assertEqual(events[-1], "[DONE]", "the in-flight stream finished")  # type: ignore[attr-defined]
        self.assertEqual(agent.process.wait(30), 0, agent.log_text()[-2000:])  # type: ignore[attr-defined]
        wait_until(lambda: not pid_alive(child), 5, what="child gone")
        self.assertIn("node agent stopped", agent.log_text())  # type: ignore[attr-defined]

    def test_runs_on_its_event_loop(self) -> None:
        agent = self.agent("")
        self.assertIn(f"event loop: {self.reactor}\n", agent.log_text())  # type: ignore[attr-defined]
        conn = http.client.HTTPConnection("127.0.0.1", agent.port, timeout=30)
        for _ in range(3):  # answered over and over on the same connection
            conn.request("POST", "/v1/chat/completions", json.dumps({**CHAT, "max_tokens": 2}),
                         {"Content-Type": "application/json"})
            response = conn.getresponse()
            self.assertEqual(response.status, 200)  # type: ignore[attr-defined]
            json.loads(response.read())
        conn.close()

    def test_second_sigterm_skips_the_drain(self) -> None:
        agent = self.agent("slow_tokens=0.2", shutdown_grace_s=120)
        conn, response = self.start_stream(agent, 1000)
        child = agent.child_pids()[0]
        agent.process.send_signal(signal.SIGTERM)
        wait_until(lambda: "draining 1 request(s) in flight" in agent.log_text(), 10, what="the drain")
        started = time.monotonic()
        agent.process.send_signal(signal.SIGTERM)
        try:
            status = agent.process.wait(30)
        except subprocess.TimeoutExpired:
            self.fail("the second SIGTERM did not skip the 120 s drain:\n" + agent.log_text()[-3000:])  # type: ignore[attr-defined]
        self.assertEqual(status, 0, agent.log_text()[-2000:])  # type: ignore[attr-defined]
        self.assertLess(time.monotonic() - started, 30)  # type: ignore[attr-defined]
        self.assertIn("second signal: skipping the drain", agent.log_text())  # type: ignore[attr-defined]
        conn.close()
        wait_until(lambda: not pid_alive(child), 5, what="child gone")


class ConsoleScriptSignalTests(SignalTestsMixin, SynchronousTestCase):
    command = staticmethod(console_script)
    reactor = "AgentEPollReactor"


class TwistdSignalTests(SignalTestsMixin, SynchronousTestCase):
    command = staticmethod(twistd)
    reactor = "EPollReactor"  # twistd's default

    def test_sighup_reloads_under_twistd(self) -> None:
        agent = self.agent("")
        agent.process.send_signal(signal.SIGHUP)
        wait_until(lambda: "config reloaded (SIGHUP)" in agent.log_text(), 10, what="the reload")
        self.assertIsNone(agent.process.poll(), "SIGHUP must not stop the agent")


class TwistdAgentReactorTests(SignalTestsMixin, SynchronousTestCase):
    """Under twistd with ``--reactor rolemesh-epoll`` (the plugin's reactor)."""

    command = staticmethod(lambda config_path: twistd(config_path, "--reactor", "rolemesh-epoll"))
    reactor = "AgentEPollReactor"


class BadConfigTests(SynchronousTestCase):
    """A config mistake is one line on stderr and exit status 2, whichever
    entry point reads it, never a traceback."""

    def run_with(self, command: Any, config: Dict[str, Any]) -> "subprocess.CompletedProcess[str]":
        directory = os.path.abspath(self.mktemp())
        os.makedirs(directory)
        path = os.path.join(directory, "agent.yaml")
        with open(path, "w", encoding="utf-8") as f:
            yaml.safe_dump({"node_id": "n", "backend": "cpu", "state_dir": os.path.join(directory, "state"),
                            "models": [], **config}, f)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([CHECKOUT] + [p for p in [os.environ.get("PYTHONPATH")]
                                                                          if p])}
        return subprocess.run(command(path), capture_output=True, text=True, timeout=60, cwd=directory, env=env,
                              stdin=subprocess.DEVNULL)

    def check(self, command: Any, config: Dict[str, Any], key: str) -> None:
        done = self.run_with(command, config)
        self.assertEqual(done.returncode, 2, done.stdout + done.stderr)
        self.assertNotIn("Traceback", done.stdout + done.stderr)
        lines = done.stderr.splitlines()
        self.assertEqual(len(lines), 1, done.stderr)
        self.assertTrue(lines[0].startswith("rolemesh-node-agent: " + key), lines[0])

    def test_invalid_value(self) -> None:
        for command in (console_script, twistd):
            self.check(command, {"listen_port": "nope"}, "listen_port")

    def test_rejected_when_the_service_is_built(self) -> None:
        for command in (console_script, twistd):
            self.check(command, {"listen_host": "0.0.0.0", "require_auth_off_loopback": True}, "listen_host")

    def test_a_port_that_is_taken(self) -> None:
        import socket

        holder = socket.socket()
        self.addCleanup(holder.close)
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        bin_dir = os.path.abspath(self.mktemp())
        os.makedirs(bin_dir)
        config = {"listen_port": port, "llama_server_bin": write_fake_llama_server_bin(bin_dir)}
        for command in (console_script, twistd):
            done = self.run_with(command, config)
            output = done.stdout + done.stderr
            self.assertEqual(done.returncode, 1, output)
            self.assertNotIn("Traceback", output)
            self.assertEqual(output.count(f"rolemesh-node-agent: cannot start: Couldn't listen on 127.0.0.1:{port}"),
                             1, output)


class GpuCheckScriptTests(SynchronousTestCase):
    """``scripts/gpu-check.sh`` on a host without a GPU: it still records what
    it can, says which backend ``--check`` chose, and its CUDA tests skip."""

    def test_runs_and_keeps_what_it_saw(self) -> None:
        out = os.path.abspath(self.mktemp())
        done = subprocess.run(["bash", os.path.join(CHECKOUT, "scripts", "gpu-check.sh"), out],
                              env={**os.environ, "PYTHON": sys.executable}, capture_output=True, text=True,
                              timeout=300)
        self.assertEqual(done.returncode, 0, done.stdout + done.stderr)
        self.assertIn("== tests.integration.test_cuda_real", done.stdout)
        for name in ("nvidia-smi.txt", "check.txt", "trial.log"):
            self.assertTrue(os.path.exists(os.path.join(out, name)), name)
        with open(os.path.join(out, "check.txt")) as f:
            check = f.read()
        self.assertRegex(check, r"# backend: \w+ \(")
        self.assertRegex(check, r"tiny: [\d.]+ [KMG]iB \(weights")
        with open(os.path.join(out, "trial.log")) as f:
            trial = f.read()
        self.assertRegex(trial, r"PASSED \((skips=\d+, )?successes=\d+\)|PASSED \(skips=\d+\)")
