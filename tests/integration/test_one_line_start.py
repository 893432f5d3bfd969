"""``rolemesh-node-agent --model x.gguf`` serves model ``x`` (issue 26):
no config file, every key at its default (port 8090 on 127.0.0.1, the
llama-server installed next to the agent), a real llama-server child.
With ``--config`` too, the ``--model`` file is added to the config's models
and stays there across a reload (SIGHUP)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from typing import List

import yaml
from twisted.trial.unittest import SkipTest, SynchronousTestCase

from tests.fixtures.llama import free_port, http_request
from tests.integration.harness import require_llama_server, tiny_model, wait_until, write_fake_llama_server_bin

DEFAULT_PORT = 8090


def port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


class OneLineStartTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.dir = os.path.abspath(self.mktemp())
        os.makedirs(self.dir)
        # The default state_dir, under an XDG_STATE_HOME of the test's own.
        self.env = {**os.environ, "XDG_STATE_HOME": os.path.join(self.dir, "xdg-state")}

    def agent(self, argv: List[str], url: str) -> subprocess.Popen:
        log = open(os.path.join(self.dir, "agent.log"), "ab")
        self.addCleanup(log.close)
        process = subprocess.Popen([sys.executable, "-m", "rolemesh.cli", *argv], stdout=log,
                                   stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=self.env, cwd=self.dir)

        def stop() -> None:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
                try:
                    process.wait(30)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait(10)

        self.addCleanup(stop)

        def healthy() -> bool:
            if process.poll() is not None:
                raise AssertionError(f"agent exited with {process.returncode}:\n{self.log()[-3000:]}")
            try:
                return http_request("GET", url + "/health", timeout=1)[0] == 200
            except OSError:
                return False

        wait_until(healthy, 60, what="agent /health")
        return process

    def log(self) -> str:
        with open(os.path.join(self.dir, "agent.log"), "rb") as f:
            return f.read().decode("utf-8", "replace")

    def models(self, url: str) -> List[str]:
        status, _, body = http_request("GET", url + "/v1/models")
        self.assertEqual(status, 200, body)
        return [m["id"] for m in json.loads(body)["data"]]

    def test_model_alone_serves_it_by_its_file_name(self) -> None:
        require_llama_server()
        if not port_free(DEFAULT_PORT):
            raise SkipTest(f"port {DEFAULT_PORT} (the default listen_port) is taken on this host")
        path = tiny_model(os.path.join(self.dir, "models"), "x", seed=13)
        url = f"http://127.0.0.1:{DEFAULT_PORT}"
        process = self.agent(["--model", path], url)
        self.assertEqual(self.models(url), ["x"])
        status, _, body = http_request("POST", url + "/v1/completions", {"model": "x", "prompt": "hi",
                                                                         "max_tokens": 2}, timeout=60)
        self.assertEqual(status, 200, body)
        self.assertEqual(json.loads(body)["model"], "x")
        process.send_signal(signal.SIGTERM)
        self.assertEqual(process.wait(30), 0, self.log()[-3000:])

    def test_with_a_config_it_is_added_and_a_reload_keeps_it(self) -> None:
        model = os.path.join(self.dir, "from-config.gguf")
        extra = os.path.join(self.dir, "extra.gguf")
        for path in (model, extra):
            open(path, "wb").close()
        port = free_port()
        config = os.path.join(self.dir, "node.yaml")
        with open(config, "w", encoding="utf-8") as f:
            yaml.safe_dump({"listen_port": port, "backend": "cpu", "state_dir": os.path.join(self.dir, "state"),
                            "llama_server_bin": write_fake_llama_server_bin(self.dir),
                            "models": [{"model_id": "c", "path": model}]}, f)
        self.env["FAKE_LLAMA"] = ""
        url = f"http://127.0.0.1:{port}"
        process = self.agent(["--config", config, "--model", extra], url)
        self.assertEqual(self.models(url), ["c", "extra"])
        status, _, body = http_request("POST", url + "/v1/completions", {"model": "extra", "prompt": "hi"},
                                       timeout=60)
        self.assertEqual(status, 200, body)
        process.send_signal(signal.SIGHUP)
        wait_until(lambda: "config reloaded (SIGHUP)" in self.log(), 30, what="the reload")
        self.assertEqual(self.models(url), ["c", "extra"])
        self.assertNotIn("removed", self.log().split("config reloaded (SIGHUP)", 1)[1].splitlines()[0])
