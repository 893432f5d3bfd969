"""Shared set-up for integration tests: models, configs, an agent process."""

from __future__ import annotations

import atexit
import http.client
import json
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Any, Dict, List, Optional

import yaml
from twisted.trial.unittest import SkipTest

from tests.fixtures.llama import NO_LLAMA_SERVER_REASON, free_port, http_request, llama_server_binary
from tests.fixtures.llama import write_fake_llama_server_bin as write_fake_llama_server_bin  # noqa: F401
from tests.fixtures.tiny_gguf import write_corrupt_gguf, write_tiny_gguf

_MODELS: Dict[str, str] = {}


def require_llama_server() -> str:
    binary = llama_server_binary()
    if binary is None:
        raise SkipTest(NO_LLAMA_SERVER_REASON)
    return binary


def tiny_model(directory: str, name: str, seed: int, quant: str = "F32") -> str:
    """A tiny GGUF at ``directory/name.gguf`` (written once per directory);
    ``quant`` as in :func:`write_tiny_gguf` (F32, Q8_0, Q4_0)."""
    path = os.path.join(directory, f"{name}.gguf")
    if path not in _MODELS:
        os.makedirs(directory, exist_ok=True)
        write_tiny_gguf(path, seed=seed, name=name, quant=quant)
        _MODELS[path] = path
    return path


def corrupt_model(directory: str) -> str:
    path = os.path.join(directory, "corrupt.gguf")
    os.makedirs(directory, exist_ok=True)
    write_corrupt_gguf(path)
    return path


def mem_total_bytes() -> int:
    with open("/proc/meminfo", encoding="ascii") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no MemTotal in /proc/meminfo")


def pid_alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie counts as dead)."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("State:"):
                    return "Z" not in line.split()[1]
    except OSError:
        return False
    return False


def wait_until(predicate, timeout: float, interval: float = 0.02, what: str = "condition") -> float:
    """Poll ``predicate`` until true; return seconds waited or raise AssertionError."""
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout:
            raise AssertionError(f"{what} not reached within {timeout}s")
        time.sleep(interval)
    return time.monotonic() - start


def children_of(pid: int) -> List[int]:
    """Pids whose parent is ``pid`` (from /proc)."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", encoding="ascii", errors="replace") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(entry))
    return out


class AgentProcess:
    """``rolemesh-node-agent`` as a subprocess with a generated config."""

    def __init__(self, directory: str, config: Dict[str, Any], env: Optional[Dict[str, str]] = None,
                 own_state_dir: bool = True):
        """``own_state_dir`` False leaves ``state_dir`` to the config (else
        the default, under ``XDG_STATE_HOME``)."""
        self.directory = directory
        os.makedirs(directory, exist_ok=True)
        self.port = free_port()
        config = {
            "node_id": "it-node",
            "listen_port": self.port,
            **({"state_dir": os.path.join(directory, "state")} if own_state_dir else {}),
            "llama_server_probe_interval_s": 0.05,
            "backend": "cpu",
            **config,
        }
        self.config_path = os.path.join(directory, "agent.yaml")
        with open(self.config_path, "w", encoding="utf-8") as f:
            yaml.safe_dump(config, f)
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = os.path.join(directory, "agent.log")
        self._log = open(self.log_path, "ab")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "rolemesh.cli", "--config", self.config_path],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**os.environ, **(env or {})},
        )
        try:
            wait_until(self._healthy, 30, what="agent /health")
        except AssertionError:
            self.stop()
            raise AssertionError("agent did not start:\n" + self.log_text()[-3000:])

    def _healthy(self) -> bool:
        if self.process.poll() is not None:
            raise AssertionError(f"agent exited with {self.process.returncode}:\n" + self.log_text()[-3000:])
        try:
            return http_request("GET", self.url + "/health", timeout=1)[0] == 200
        except OSError:
            return False

    def request(self, method: str, path: str, body: Any = None, **kw: Any):
        return http_request(method, self.url + path, body, **kw)

    def inventory(self) -> Dict[str, Any]:
        import json

        status, _, body = self.request("GET", "/v1/node/inventory")
        assert status == 200, body
        return json.loads(body)

    def child_pids(self) -> List[int]:
        return [d["pid"] for d in self.inventory()["devices"] if d["pid"]]

    def log_text(self) -> str:
        with open(self.log_path, "rb") as f:
            return f.read().decode("utf-8", "replace")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30) -> Optional[int]:
        if self.process.poll() is None:
            self.process.send_signal(sig)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
        self._log.close()
        return self.process.returncode


class Stream(threading.Thread):
    """A streamed completion through the agent (``body``, POSTed to
    ``/v1/completions``) until ``stop()``; with ``repeat`` one after another,
    since a small model on a fast device ends each one quickly."""

    def __init__(self, port: int, body: Dict[str, Any], repeat: bool = False) -> None:
        super().__init__(daemon=True)
        self.port, self.body, self.repeat = port, body, repeat
        self.first, self.stopping = threading.Event(), threading.Event()
        self.status: Optional[int] = None  # of the latest answer
        self.error: Optional[BaseException] = None

    def run(self) -> None:
        try:
            self.one()
            while self.repeat and not self.stopping.is_set():
                self.one()
        except BaseException as e:  # noqa: BLE001 - reported by the test
            self.error = e
        finally:
            self.first.set()

    def one(self) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=120)
        try:
            conn.request("POST", "/v1/completions", body=json.dumps(self.body),
                         headers={"Content-Type": "application/json"})
            response = conn.getresponse()
            self.status = response.status
            if response.status != 200:
                raise AssertionError(f"stream answered {response.status}: {response.read()[:300]!r}")
            while not self.stopping.is_set():
                line = response.readline()
                if not line:
                    break
                if line.startswith(b"data:"):
                    self.first.set()
        finally:
            conn.close()

    def stop(self) -> None:
        self.stopping.set()


def shared_agent(agents: Dict[bool, AgentProcess], fast_path: bool, name: str, top: Dict[str, Any],
                 preload: bool) -> AgentProcess:
    """One agent per test class and path (``fast_path``), with one tiny model
    ``tiny-a``: started by the class's first test (trial has no setUpClass),
    again if it died, and stopped when trial exits."""
    agent = agents.get(fast_path)
    if agent is None or agent.process.poll() is not None:
        directory = os.path.abspath(f"_{name}_{int(fast_path)}")
        agent = agents[fast_path] = AgentProcess(directory, {
            **top, "fast_path": fast_path,
            "models": [{"model_id": "tiny-a", "path": tiny_model(directory, "a", 1), "preload": preload}]})
        atexit.register(agent.stop)
    return agent
