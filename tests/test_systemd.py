"""systemd's notify protocol over a real AF_UNIX datagram socket bound in a
temporary folder (the fake ``NOTIFY_SOCKET``), on a ``task.Clock``; and the
unit file shipped in deploy/systemd/."""

from __future__ import annotations

import configparser
import os
import shutil
import socket
import subprocess
import tempfile
from typing import Any, Dict, List, Optional

from hypothesis import given
from hypothesis import strategies as st
from twisted.internet.task import Clock
from twisted.logger import capturedLogs
from twisted.trial.unittest import SkipTest, SynchronousTestCase

from rolemesh.systemd import (
    MAX_STATUS_CHARS,
    STATUS_INTERVAL_S,
    SystemdNotifier,
    message,
    notify_address,
    status_line,
    watchdog_interval,
)
from tests.fixtures.service_harness import ServiceHarness

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
UNIT = os.path.join(REPO, "deploy", "systemd", "rolemesh-node.service")


class FakeNotifySocket:
    """What systemd listens on: a datagram socket bound in a temporary folder."""

    def __init__(self, abstract: bool = False) -> None:
        self.directory = tempfile.mkdtemp(prefix="rm-sd-")
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        if abstract:
            name = "rolemesh-test-" + os.path.basename(self.directory)
            self.sock.bind("\0" + name)
            self.env_value = "@" + name
        else:
            path = os.path.join(self.directory, "notify")
            self.sock.bind(path)
            self.env_value = path
        self.sock.setblocking(False)

    def messages(self) -> List[Dict[str, str]]:
        """Every datagram received so far, each as its KEY=value fields."""
        out: List[Dict[str, str]] = []
        while True:
            try:
                data = self.sock.recv(4096)
            except BlockingIOError:
                return out
            fields = {}
            for line in data.decode().split("\n"):
                key, _, value = line.partition("=")
                fields[key] = value
            out.append(fields)

    def close(self) -> None:
        self.sock.close()
        shutil.rmtree(self.directory, ignore_errors=True)


def keys(messages: List[Dict[str, str]]) -> List[str]:
    return [key for m in messages for key in m]


class PureTests(SynchronousTestCase):
    def test_notify_address(self) -> None:
        self.assertEqual(notify_address({"NOTIFY_SOCKET": "/run/systemd/notify"}), "/run/systemd/notify")
        self.assertEqual(notify_address({"NOTIFY_SOCKET": "@abstract"}), "\0abstract")
        self.assertIsNone(notify_address({}))
        self.assertIsNone(notify_address({"NOTIFY_SOCKET": ""}))
        self.assertIsNone(notify_address({"NOTIFY_SOCKET": "relative/path"}))
        self.assertIsNone(notify_address({"NOTIFY_SOCKET": "@"}))

    def test_watchdog_interval_is_half_the_timeout(self) -> None:
        self.assertEqual(watchdog_interval({"WATCHDOG_USEC": "30000000"}, pid=7), 15.0)
        self.assertEqual(watchdog_interval({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": "7"}, pid=7), 15.0)

    def test_no_watchdog_when_unset_invalid_or_for_another_process(self) -> None:
        self.assertIsNone(watchdog_interval({}, pid=7))
        self.assertIsNone(watchdog_interval({"WATCHDOG_USEC": "soon"}, pid=7))
        self.assertIsNone(watchdog_interval({"WATCHDOG_USEC": "0"}, pid=7))
        self.assertIsNone(watchdog_interval({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": "8"}, pid=7))

    def test_status_line_names_devices_models_and_draining(self) -> None:
        devices: List[Dict[str, Any]] = [
            {"device": "gpu:0", "state": "ready", "model": "qwen", "in_flight": 1, "queued": 2},
            {"device": "gpu:1", "state": "stopped", "model": None, "in_flight": 0, "queued": 0},
        ]
        line = status_line(devices, draining=True, dispatcher="registered")
        self.assertEqual(
            line,
            "draining; 2 devices; gpu:0 ready: qwen (1 in flight, 2 queued); gpu:1 stopped; dispatcher registered",
        )
        self.assertEqual(status_line(devices[1:]), "1 device; gpu:1 stopped")

    @given(st.lists(st.tuples(st.sampled_from(["READY", "STATUS", "X"]), st.text()), max_size=5))
    def test_message_is_one_key_value_per_line(self, fields: List[Any]) -> None:
        lines = message(fields).decode("utf-8").split("\n") if fields else []
        self.assertEqual(len(lines), len(fields))
        for line, (key, _) in zip(lines, fields):
            self.assertTrue(line.startswith(key + "="))

    @given(st.lists(st.fixed_dictionaries({
        "device": st.text(min_size=1, max_size=20), "state": st.sampled_from(["ready", "stopped", "starting"]),
        "model": st.one_of(st.none(), st.text(max_size=200)), "in_flight": st.integers(0, 9),
        "queued": st.integers(0, 9)}), max_size=20))
    def test_status_line_is_bounded(self, devices: List[Dict[str, Any]]) -> None:
        self.assertLessEqual(len(status_line(devices)), MAX_STATUS_CHARS)


class NotifierTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.socket = FakeNotifySocket()
        self.addCleanup(self.socket.close)
        self.clock = Clock()
        self.status = "1 device; cpu:0 stopped"

    def notifier(self, **env: str) -> SystemdNotifier:
        environ = {"NOTIFY_SOCKET": self.socket.env_value, **env}
        n = SystemdNotifier(lambda: self.status, environ=environ, pid=4242, reactor=self.clock)
        self.addCleanup(n.close)
        return n

    def test_ready_status_watchdog_stopping_in_order(self) -> None:
        n = self.notifier(WATCHDOG_USEC="4000000", WATCHDOG_PID="4242")
        n.ready()
        self.clock.advance(2.0)  # half of WATCHDOG_USEC
        self.status = "1 device; cpu:0 ready: tiny"
        self.clock.advance(STATUS_INTERVAL_S)
        n.stopping()
        got = self.socket.messages()
        self.assertEqual(got[0], {"READY": "1", "STATUS": "1 device; cpu:0 stopped"})
        self.assertEqual(got[1], {"WATCHDOG": "1"})
        self.assertIn({"STATUS": "1 device; cpu:0 ready: tiny"}, got)
        self.assertEqual(got[-1], {"STOPPING": "1", "STATUS": "draining: finishing in-flight requests"})
        self.assertEqual(keys(got).count("READY"), 1)

    def test_status_is_sent_only_when_it_changes(self) -> None:
        n = self.notifier()
        n.ready()
        self.socket.messages()
        self.clock.advance(STATUS_INTERVAL_S * 3)
        self.assertEqual(self.socket.messages(), [])
        self.status = "draining"
        self.clock.advance(STATUS_INTERVAL_S)
        self.assertEqual(self.socket.messages(), [{"STATUS": "draining"}])

    def test_no_watchdog_without_watchdog_usec(self) -> None:
        n = self.notifier()
        n.ready()
        self.clock.advance(3600)
        self.assertNotIn("WATCHDOG", keys(self.socket.messages()))

    def test_watchdog_keeps_pinging_while_draining_and_stops_at_close(self) -> None:
        n = self.notifier(WATCHDOG_USEC="1000000")
        n.ready()
        n.stopping()
        self.socket.messages()
        self.clock.advance(0.5)
        self.assertEqual(self.socket.messages(), [{"WATCHDOG": "1"}])
        n.close()
        self.clock.advance(10)
        self.assertEqual(self.socket.messages(), [])
        self.assertEqual(self.clock.getDelayedCalls(), [])

    def test_abstract_socket(self) -> None:
        abstract = FakeNotifySocket(abstract=True)
        self.addCleanup(abstract.close)
        n = SystemdNotifier(lambda: "ok", environ={"NOTIFY_SOCKET": abstract.env_value}, reactor=self.clock)
        self.addCleanup(n.close)
        n.ready()
        self.assertEqual(abstract.messages(), [{"READY": "1", "STATUS": "ok"}])

    def test_without_notify_socket_nothing_happens(self) -> None:
        made: List[str] = []
        n = SystemdNotifier(lambda: "ok", environ={"WATCHDOG_USEC": "1000000"}, reactor=self.clock,
                            make_socket=lambda address: made.append(address))
        n.ready()
        n.stopping()
        self.clock.advance(10)
        self.assertFalse(n.enabled)
        self.assertEqual(made, [])
        self.assertEqual(self.clock.getDelayedCalls(), [])

    def test_a_socket_that_is_gone_is_logged_once_and_never_raises(self) -> None:
        n = self.notifier(WATCHDOG_USEC="1000000")
        self.socket.close()
        with capturedLogs() as events:
            n.ready()
            self.clock.advance(0.5)
            self.clock.advance(0.5)
        warnings = [e for e in events if "cannot notify" in e.get("log_format", "")]
        self.assertEqual(len(warnings), 1)
        self.assertEqual(len(n.sent), 0)

    def test_a_failing_status_function_still_sends_ready(self) -> None:
        def broken() -> str:
            raise RuntimeError("boom")

        n = SystemdNotifier(broken, environ={"NOTIFY_SOCKET": self.socket.env_value}, reactor=self.clock)
        self.addCleanup(n.close)
        with capturedLogs() as events:
            n.ready()
            self.clock.advance(STATUS_INTERVAL_S)
        self.assertEqual(self.socket.messages(), [{"READY": "1"}])
        self.assertTrue(any("STATUS= line failed" in e.get("log_format", "") for e in events))
        self.assertEqual(len(self.flushLoggedErrors(RuntimeError)), 2)


class ServiceNotifyTests(SynchronousTestCase):
    """The whole service tree tells systemd: READY, STATUS, WATCHDOG, STOPPING."""

    def test_service_sequence(self) -> None:
        sock = FakeNotifySocket()
        self.addCleanup(sock.close)
        env = {"NOTIFY_SOCKET": sock.env_value, "WATCHDOG_USEC": "2000000", "WATCHDOG_PID": str(os.getpid())}
        h = ServiceHarness({"models": [{"model_id": "tiny", "preload": True}]}, environ=env)
        self.addCleanup(h.cleanup)
        h.start()
        h.answer("tiny")
        h.reactor.advance(1.0)  # half of WATCHDOG_USEC
        h.reactor.advance(STATUS_INTERVAL_S)
        done: List[Any] = []
        h.stop().addBoth(done.append)
        for process in h.live_children():
            process.exit(0)
        h.reactor.advance(1)
        self.assertEqual(done, [None])
        got = sock.messages()
        sequence = keys(got)
        self.assertEqual(sequence[:2], ["READY", "STATUS"])
        first = {k: sequence.index(k) for k in ("READY", "STATUS", "WATCHDOG", "STOPPING")}
        self.assertTrue(first["READY"] < first["STATUS"] < first["WATCHDOG"] < first["STOPPING"], sequence)
        statuses = [m["STATUS"] for m in got if "STATUS" in m]
        self.assertIn("1 device; gpu:0 ready: tiny", statuses)
        # Once the agent stopped, nothing keeps pinging.
        h.reactor.advance(10)
        self.assertEqual(sock.messages(), [])


def read_unit(path: str) -> Dict[str, Dict[str, List[str]]]:
    """A systemd unit file as section -> key -> values (keys may repeat)."""
    sections: Dict[str, Dict[str, List[str]]] = {}
    current: Optional[Dict[str, List[str]]] = None
    with open(path, encoding="utf-8") as f:
        for raw in f:
            line = raw.strip()
            if not line or line.startswith(("#", ";")):
                continue
            if line.startswith("[") and line.endswith("]"):
                current = sections.setdefault(line[1:-1], {})
                continue
            assert current is not None, f"{path}: {line!r} outside a section"
            key, sep, value = line.partition("=")
            assert sep, f"{path}: not key=value: {line!r}"
            current.setdefault(key.strip(), []).append(value.strip())
    return sections


def seconds(value: str) -> float:
    units = {"s": 1, "min": 60, "m": 60, "h": 3600}
    for suffix, factor in sorted(units.items(), key=lambda kv: -len(kv[0])):
        if value.endswith(suffix):
            return float(value[: -len(suffix)]) * factor
    return float(value)


class UnitFileTests(SynchronousTestCase):
    """The shipped unit: Type=notify and what the docs promise."""

    def setUp(self) -> None:
        self.unit = read_unit(UNIT)
        self.service = self.unit["Service"]

    def one(self, key: str) -> str:
        values = self.service.get(key)
        self.assertTrue(values, f"[Service] {key} missing")
        assert values is not None
        return values[-1]

    def test_notify_type_and_kill_mode(self) -> None:
        self.assertEqual(self.one("Type"), "notify")
        self.assertEqual(self.one("NotifyAccess"), "main")
        self.assertEqual(self.one("KillMode"), "mixed")
        self.assertIn("WatchdogSec", self.service)
        self.assertEqual(self.one("ExecReload"), "/bin/kill -HUP $MAINPID")

    def test_stop_timeout_covers_the_drain(self) -> None:
        from rolemesh.config.file import NodeConfig

        defaults = NodeConfig(node_id="x")
        drain = defaults.shutdown_grace_s + defaults.llama_server_stop_timeout_s
        self.assertGreater(seconds(self.one("TimeoutStopSec")), drain)

    def test_secrets_come_from_credentials_not_the_unit(self) -> None:
        self.assertIn("LoadCredential", self.service)
        environment_files = self.service.get("EnvironmentFile", [])
        self.assertTrue(environment_files)
        text = open(UNIT, encoding="utf-8").read()
        self.assertNotIn("sk-", text)
        example = os.path.join(REPO, "deploy", "systemd", "rolemesh-node.env.example")
        self.assertTrue(os.path.exists(example))

    def test_hardening_leaves_gpu_devices_reachable(self) -> None:
        self.assertEqual(self.one("NoNewPrivileges"), "yes")
        self.assertIn(self.one("ProtectSystem"), ("strict", "full"))
        # PrivateDevices=yes would hide /dev/nvidia*, /dev/kfd, /dev/dri.
        self.assertNotEqual(self.service.get("PrivateDevices", ["no"])[-1], "yes")
        self.assertNotIn("DevicePolicy", self.service)

    def test_exec_start_runs_the_agent_with_the_config(self) -> None:
        exec_start = self.one("ExecStart")
        self.assertIn("rolemesh-node-agent", exec_start)
        self.assertIn("--config", exec_start)

    def test_configparser_reads_it(self) -> None:
        parser = configparser.ConfigParser(strict=False, interpolation=None)
        parser.optionxform = str  # type: ignore[assignment,method-assign]
        parser.read(UNIT, encoding="utf-8")
        self.assertEqual(set(parser.sections()), {"Unit", "Service", "Install"})

    def test_systemd_analyze_verify(self) -> None:
        analyze = shutil.which("systemd-analyze")
        if analyze is None:
            raise SkipTest("systemd-analyze is not installed (apt-get install systemd)")
        directory = tempfile.mkdtemp(prefix="rm-unit-")
        self.addCleanup(shutil.rmtree, directory, True)
        # The unit names an absolute ExecStart; verify checks it exists, so
        # point it at a stand-in in the temporary folder.
        stand_in = os.path.join(directory, "rolemesh-node-agent")
        with open(stand_in, "w") as f:
            f.write("#!/bin/sh\n")
        os.chmod(stand_in, 0o755)
        text = open(UNIT, encoding="utf-8").read()
        unit = os.path.join(directory, "rolemesh-node.service")
        with open(unit, "w", encoding="utf-8") as f:
            f.write(text.replace("/opt/rolemesh/venv/bin/rolemesh-node-agent", stand_in))
        result = subprocess.run([analyze, "verify", unit], capture_output=True, text=True, timeout=60,
                                env={**os.environ, "SYSTEMD_LOG_LEVEL": "warning"})
        problems = [line for line in (result.stdout + result.stderr).splitlines()
                    if "rolemesh-node.service" in line]
        self.assertEqual(problems, [], result.stdout + result.stderr)
        self.assertEqual(result.returncode, 0, result.stdout + result.stderr)
