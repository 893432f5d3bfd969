"""Fault injection against the agent as a process: kill, stop or starve its
llama-server child, take its port, hang its dispatcher, take away its state
directory.  After each fault the next request succeeds, and once the agent
has stopped no child it ever had is still running.

The real llama-server (tiny generated model) is used wherever the fault needs
no scripting; the fake one (``tests/fixtures/fake_llama_server.py``) where the
child must be slow at a precise moment.  ``once_file=PATH`` in ``FAKE_LLAMA``
makes a fake misbehave only on the start that consumes the marker file, so a
retry by the supervisor gets a well-behaved child.

Every wait is bounded (``wait_until`` or a socket timeout); none is a fixed sleep.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import sys
import threading
import time
from typing import Any, Dict, List, Optional, Tuple

from twisted.trial.unittest import SynchronousTestCase

from tests.fixtures.llama import http_request, read_sse, start_fake_llama_server
from tests.integration.fake_dispatcher_server import FakeDispatcherProcess
from tests.integration.harness import (
    AgentProcess,
    children_of,
    pid_alive,
    require_llama_server,
    tiny_model,
    wait_until,
    write_fake_llama_server_bin,
)

MESSAGES = [{"role": "user", "content": "hello"}]
CHAT = {"model": "m", "messages": MESSAGES, "max_tokens": 4, "ignore_eos": True}
#: Bound on one request that should succeed (a cold start of the tiny model included).
REQUEST_TIMEOUT = 30.0


def _start_time(pid: int) -> Optional[str]:
    """The process's start time in clock ticks (field 22 of /proc/PID/stat): its identity."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


class FaultTestCase(SynchronousTestCase):
    """An agent per test, and every child pid it ever had, checked at the end."""

    def setUp(self) -> None:
        self.dir = os.path.abspath(self.mktemp())
        os.makedirs(self.dir)
        #: pid -> start time of every child seen (inventory or /proc).
        self.seen: Dict[int, Optional[str]] = {}
        self._seen_lock = threading.Lock()

    # -- agent and children ---------------------------------------------------

    def start_agent(self, config: Dict[str, Any], env: Optional[Dict[str, str]] = None) -> AgentProcess:
        agent = AgentProcess(self.dir, config, env)
        stop_watching = threading.Event()
        watcher = threading.Thread(target=self._watch, args=(agent, stop_watching), daemon=True)
        watcher.start()

        def cleanup() -> None:
            stop_watching.set()
            watcher.join(5)
            agent.stop()
            self._kill_survivors()

        self.addCleanup(cleanup)
        return agent

    def _note(self, pids: List[int]) -> None:
        with self._seen_lock:
            for pid in pids:
                if pid and pid not in self.seen:
                    self.seen[pid] = _start_time(pid)

    def _watch(self, agent: AgentProcess, stop: threading.Event) -> None:
        """Record the agent's children from /proc, so short-lived ones count too."""
        while not stop.is_set() and agent.process.poll() is None:
            self._note(children_of(agent.process.pid))
            stop.wait(0.05)

    def child_pids(self, agent: AgentProcess) -> List[int]:
        pids = agent.child_pids()
        self._note(pids)
        return pids

    def device(self, agent: AgentProcess) -> Dict[str, Any]:
        device = agent.inventory()["devices"][0]
        self._note([device["pid"]] if device["pid"] else [])
        return device

    def _same_process_alive(self, pid: int, started: Optional[str]) -> bool:
        return pid_alive(pid) and (started is None or _start_time(pid) == started)

    def _survivors(self) -> List[int]:
        with self._seen_lock:
            items = list(self.seen.items())
        return [pid for pid, started in items if self._same_process_alive(pid, started)]

    def _kill_survivors(self) -> None:
        for pid in self._survivors():
            try:
                os.kill(pid, signal.SIGCONT)
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass

    def stop_and_assert_no_orphans(self, agent: AgentProcess, bound: float = 30.0) -> float:
        """Stop the agent (SIGTERM); assert exit 0 within ``bound`` and no child left. Returns seconds taken."""
        self.child_pids(agent)
        started = time.monotonic()
        code = agent.stop(timeout=bound)
        took = time.monotonic() - started
        self.assertEqual(code, 0, agent.log_text()[-3000:])
        self.assertLess(took, bound)
        self.assertTrue(self.seen, "no child was ever seen")
        try:
            wait_until(lambda: not self._survivors(), 10, what="every child gone")
        except AssertionError:
            raise AssertionError(f"orphaned children {self._survivors()} of {sorted(self.seen)}")
        return took

    # -- requests ---------------------------------------------------------------

    def chat(self, agent: AgentProcess, model: str = "m", **extra: Any) -> Tuple[int, Dict[str, str], bytes]:
        return agent.request("POST", "/v1/chat/completions", {**CHAT, "model": model, **extra},
                             timeout=REQUEST_TIMEOUT)

    def assert_chat_ok(self, agent: AgentProcess, model: str = "m") -> None:
        status, _, body = self.chat(agent, model)
        self.assertEqual(status, 200, body)
        self.assertEqual(json.loads(body)["object"], "chat.completion")

    def assert_error(self, answer: Tuple[int, Dict[str, str], bytes], status: int, code: str) -> Dict[str, Any]:
        got, headers, body = answer
        self.assertEqual(got, status, body)
        error = json.loads(body)["error"]
        self.assertEqual(error["code"], code, body)
        return error

    def in_thread(self, fn: Any) -> Tuple[threading.Thread, list]:
        result: list = []

        def run() -> None:
            try:
                result.append(fn())
            except BaseException as e:  # noqa: BLE001 - reported by the test
                result.append(e)

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        return thread, result

    def joined(self, thread: threading.Thread, result: list, timeout: float = REQUEST_TIMEOUT + 5) -> Any:
        thread.join(timeout)
        self.assertFalse(thread.is_alive(), "request did not end")
        if isinstance(result[0], BaseException):
            raise result[0]
        return result[0]

    # -- configs ------------------------------------------------------------------

    def real_config(self, **top: Any) -> Dict[str, Any]:
        require_llama_server()
        model = tiny_model(self.dir, "m", 1)
        return {"models": [{"model_id": "m", "path": model}], **top}

    def fake_config(self, **top: Any) -> Dict[str, Any]:
        model = os.path.join(self.dir, "m.gguf")
        open(model, "wb").close()
        return {"llama_server_bin": write_fake_llama_server_bin(self.dir), "models": [{"model_id": "m", "path": model}],
                **top}

    def marker(self) -> str:
        """A ``once_file`` marker that exists now (the next fake start consumes it)."""
        path = os.path.join(self.dir, "fault-once")
        open(path, "w").close()
        return path


class ChildFaultTests(FaultTestCase):
    def test_sigkill_idle_child_restarts_on_next_request(self) -> None:
        agent = self.start_agent(self.real_config())
        self.assert_chat_ok(agent)
        before = self.device(agent)
        self.assertEqual(before["state"], "ready")
        os.kill(before["pid"], signal.SIGKILL)
        self.assert_chat_ok(agent)  # at once, whether or not the agent has reaped the child yet
        wait_until(lambda: not pid_alive(before["pid"]), 5, what="the killed child reaped")
        self.assert_chat_ok(agent)
        after = self.device(agent)
        self.assertEqual(after["state"], "ready")
        self.assertNotEqual(after["pid"], before["pid"])
        self.assertGreater(after["restarts"], before["restarts"])
        self.assertFalse(pid_alive(before["pid"]))
        self.stop_and_assert_no_orphans(agent)

    def test_repeated_crashes_back_off_with_retry_after_then_recover(self) -> None:
        """First crash: restarted at once; then 1 s, 2 s, ...: meanwhile 503 model_load_failed + Retry-After."""
        agent = self.start_agent(self.real_config())

        def crash() -> None:
            pid = self.device(agent)["pid"]
            os.kill(pid, signal.SIGKILL)
            wait_until(lambda: not pid_alive(pid) and self.device(agent)["state"] in ("stopped", "failed"), 10,
                       what="the agent noticing the crash")

        def eventually_ok(bound: float) -> float:
            return wait_until(lambda: self.chat(agent)[0] == 200, bound, interval=0.1, what="a 200 again")

        self.assert_chat_ok(agent)
        crash()  # failure 1: no back-off
        self.assert_chat_ok(agent)
        crash()  # failure 2: 1 s
        eventually_ok(10)
        crash()  # failure 3: 2 s
        self.assertEqual(self.device(agent)["state"], "failed")
        answer = self.chat(agent)
        error = self.assert_error(answer, 503, "model_load_failed")
        self.assertIn("next attempt in", error["message"])
        self.assertIn(answer[1].get("retry-after"), ("1", "2"))
        eventually_ok(15)
        self.assertEqual(self.device(agent)["restarts"], 3)
        self.stop_and_assert_no_orphans(agent)

    def test_sigkill_while_loading_fails_the_waiter_then_next_request_loads(self) -> None:
        marker = self.marker()
        agent = self.start_agent(self.fake_config(), env={"FAKE_LLAMA": f"once_file={marker},slow_start=5"})
        thread, result = self.in_thread(lambda: self.chat(agent))
        loading: Dict[str, Any] = {}

        def starting() -> bool:  # the fake took the marker: it runs and answers 503 "Loading model"
            loading.update(self.device(agent))
            return loading["state"] == "starting" and bool(loading["pid"]) and not os.path.exists(marker)

        wait_until(starting, 10, interval=0.02, what="the child in state starting")
        os.kill(loading["pid"], signal.SIGKILL)
        answer = self.joined(thread, result)
        error = self.assert_error(answer, 503, "model_load_failed")
        self.assertIn("SIGKILL", error["message"])
        self.assertIn("retry-after", answer[1])
        self.assert_chat_ok(agent)
        after = self.device(agent)
        self.assertEqual(after["state"], "ready")
        self.assertNotEqual(after["pid"], loading["pid"])
        self.stop_and_assert_no_orphans(agent)

    def test_sigkill_while_streaming_ends_the_stream_with_an_error_event(self) -> None:
        agent = self.start_agent(self.fake_config(), env={"FAKE_LLAMA": "slow_tokens=0.05"})
        self.assert_chat_ok(agent)
        before = self.device(agent)
        conn = http.client.HTTPConnection("127.0.0.1", agent.port, timeout=REQUEST_TIMEOUT)
        self.addCleanup(conn.close)
        conn.request("POST", "/v1/chat/completions", json.dumps({**CHAT, "stream": True, "max_tokens": 1000}),
                     {"Content-Type": "application/json"})
        response = conn.getresponse()
        self.assertEqual(response.status, 200)
        self.assertTrue(response.readline().startswith(b"data: "))
        os.kill(before["pid"], signal.SIGKILL)
        events = read_sse(response.read())
        self.assertGreaterEqual(len(events), 2, events)
        self.assertEqual(events[-1], "[DONE]", events[-3:])
        self.assertEqual(json.loads(events[-2])["error"]["code"], "upstream_error", events[-3:])
        # At once: the stream may end before the agent has reaped the child, and
        # a request sent then must not be refused by the dead port (502).
        self.assert_chat_ok(agent)
        after = self.device(agent)
        self.assertNotEqual(after["pid"], before["pid"])
        self.assertGreater(after["restarts"], before["restarts"])
        self.stop_and_assert_no_orphans(agent)

    def test_sigstopped_child_times_out_then_is_killed_and_replaced(self) -> None:
        agent = self.start_agent(self.real_config(request_timeout_s=3, llama_server_stop_timeout_s=1))
        self.assert_chat_ok(agent)
        before = self.device(agent)
        pid, started = before["pid"], _start_time(before["pid"])

        def resume() -> None:  # runs before the agent's cleanup: never leave a stopped process behind
            if self._same_process_alive(pid, started):
                os.kill(pid, signal.SIGCONT)

        self.addCleanup(resume)
        os.kill(pid, signal.SIGSTOP)
        t0 = time.monotonic()
        self.assert_error(self.chat(agent), 504, "upstream_timeout")
        self.assertLess(time.monotonic() - t0, 10)
        # The agent probed the child, found it dead to the world, sent SIGTERM
        # (which a stopped process cannot act on) and escalates to SIGKILL.
        wait_until(lambda: not pid_alive(pid), 10, what="the stopped child killed")
        self.assert_chat_ok(agent)
        after = self.device(agent)
        self.assertEqual(after["state"], "ready")
        self.assertNotEqual(after["pid"], pid)
        self.assertGreater(after["restarts"], before["restarts"])
        log = agent.log_text()
        self.assertIn("failed a health probe", log)
        self.assertIn("sending SIGKILL", log)
        self.stop_and_assert_no_orphans(agent)

    def test_sigstopped_child_stream_that_never_begins_times_out(self) -> None:
        agent = self.start_agent(self.real_config(request_timeout_s=3, llama_server_stop_timeout_s=1))
        self.assert_chat_ok(agent)
        before = self.device(agent)
        pid, started = before["pid"], _start_time(before["pid"])

        def resume() -> None:
            if self._same_process_alive(pid, started):
                os.kill(pid, signal.SIGCONT)

        self.addCleanup(resume)
        os.kill(pid, signal.SIGSTOP)
        self.assert_error(self.chat(agent, stream=True), 504, "upstream_timeout")
        wait_until(lambda: not pid_alive(pid), 10, what="the stopped child killed")
        self.assert_chat_ok(agent)
        self.stop_and_assert_no_orphans(agent)


class PortCollisionTests(FaultTestCase):
    def test_port_taken_between_pick_and_bind_is_retried(self) -> None:
        agent = self.start_agent(self.fake_config(), env={"FAKE_LLAMA": f"once_file={self.marker()},bind_fail"})
        self.assert_chat_ok(agent)
        log = agent.log_text()
        self.assertIn("couldn't bind HTTP server socket", log)
        self.assertIn("retrying on another port", log)
        self.assertFalse(os.path.exists(os.path.join(self.dir, "fault-once")))
        self.assertEqual(self.device(agent)["state"], "ready")
        self.stop_and_assert_no_orphans(agent)

    def test_real_llama_server_finding_its_port_taken_is_retried(self) -> None:
        """A squatter really holds the picked port when the real llama-server binds it."""
        binary = require_llama_server()
        marker = self.marker()
        squatter = os.path.join(self.dir, "squatting-llama-server")
        with open(squatter, "w", encoding="utf-8") as f:
            f.write(SQUATTER.format(python=sys.executable, marker=marker, binary=binary))
        os.chmod(squatter, 0o755)
        agent = self.start_agent(self.real_config(llama_server_bin=squatter))
        self.assert_chat_ok(agent)
        log = agent.log_text()
        self.assertIn("couldn't bind HTTP server socket", log)
        self.assertIn("retrying on another port", log)
        self.assertFalse(os.path.exists(marker))
        self.stop_and_assert_no_orphans(agent)


#: A llama-server wrapper that, while ``marker`` exists, consumes it, binds the
#: ``--port`` it was given (as another process could have in the meantime) and
#: execs the real binary with that socket still held.
SQUATTER = """#!{python}
import os, socket, sys
args = sys.argv[1:]
try:
    os.unlink({marker!r})
except OSError:
    pass
else:
    held = socket.socket()
    held.bind(("127.0.0.1", int(args[args.index("--port") + 1])))
    held.listen(1)
    os.set_inheritable(held.fileno(), True)
os.execv({binary!r}, [{binary!r}] + args)
"""


class EnvironmentFaultTests(FaultTestCase):
    def test_hung_dispatcher_neither_slows_requests_nor_blocks_the_stop(self) -> None:
        require_llama_server()
        dispatcher = FakeDispatcherProcess(log_path=os.path.join(self.dir, "dispatcher.log"))
        self.addCleanup(dispatcher.stop)
        dispatcher.mode(hang=True)
        agent = self.start_agent(self.real_config(dispatcher_base_url=dispatcher.url, heartbeat_interval_s=0.5,
                                                  full_heartbeat_interval_s=0.5,
                                                  shutdown_grace_s=5))
        wait_until(lambda: dispatcher.received("register"), 10, interval=0.05, what="a (hung) registration")
        self.assert_chat_ok(agent)  # cold start
        latencies = []
        for _ in range(8):
            t0 = time.monotonic()
            self.assert_chat_ok(agent)
            latencies.append(time.monotonic() - t0)
        # The registration times out (5 s) and is retried in the background; serving goes on meanwhile.
        wait_until(lambda: "dispatcher unreachable" in agent.log_text(), 15, interval=0.1,
                   what="the unreachable warning")
        for _ in range(4):
            t0 = time.monotonic()
            self.assert_chat_ok(agent)
            latencies.append(time.monotonic() - t0)
        latencies.sort()
        self.assertLess(latencies[len(latencies) // 2], 1.0, latencies)
        self.assertLess(latencies[-1], 5.0, latencies)
        self.assertEqual(agent.log_text().count("dispatcher unreachable"), 1)
        took = self.stop_and_assert_no_orphans(agent, bound=15)
        self.assertLess(took, 10, "deregistration from a hung dispatcher held up the stop")

    def test_unwritable_state_dir_is_warned_about_once_and_tolerated(self) -> None:
        # chmod does not stop root: put the state dir below a regular file (ENOTDIR for everyone).
        blocker = os.path.join(self.dir, "not-a-directory")
        open(blocker, "w").close()
        require_llama_server()
        a = tiny_model(self.dir, "a", 1)
        b = tiny_model(self.dir, "b", 2)
        agent = self.start_agent({"state_dir": os.path.join(blocker, "state"), "models": [
            {"model_id": "a", "path": a}, {"model_id": "b", "path": b}]})
        # Three spawns and two reaps, each a pid-file write or removal that fails.
        for model in ("a", "b", "a"):
            self.assert_chat_ok(agent, model)
            self.assertEqual(self.device(agent)["model"], model)
        self.stop_and_assert_no_orphans(agent)
        log = agent.log_text()
        self.assertEqual(log.count("is not writable"), 1, log[-3000:])
        self.assertNotIn("Traceback", log)
        self.assertGreaterEqual(len(self.seen), 3)


class OnceFileFlagTests(SynchronousTestCase):
    """The fake's ``once_file`` flag: only the start that consumes the marker misbehaves."""

    def test_only_the_start_that_consumes_the_marker_gets_the_flags(self) -> None:
        marker = os.path.abspath(self.mktemp())
        open(marker, "w").close()
        first = start_fake_llama_server(f"once_file={marker},bind_fail", wait=False)
        self.addCleanup(first.stop)
        self.assertEqual(first.process.wait(10), 1)
        self.assertIn("couldn't bind", first.log_text())
        self.assertFalse(os.path.exists(marker))
        second = start_fake_llama_server(f"once_file={marker},bind_fail")  # waits for /health 200
        self.addCleanup(second.stop)
        status, _, body = http_request("GET", second.url + "/fake/info")
        self.assertEqual((status, json.loads(body)["flags"]), (200, {}))


class ReloadCutOverTests(FaultTestCase):
    """A reload that fixes a model is not held back by the failures of the command it replaced (issue 39)."""

    def reload_with(self, agent: AgentProcess, path: str) -> None:
        import yaml

        with open(agent.config_path, encoding="utf-8") as f:
            config = yaml.safe_load(f)
        config["models"][0]["path"] = path
        with open(agent.config_path, "w", encoding="utf-8") as f:
            yaml.safe_dump(config, f)
        status, _, body = agent.request("POST", "/v1/node/reload", timeout=30)
        self.assertEqual(status, 200, body)
        self.assertEqual(json.loads(body)["models"]["restart_on_next_use"], ["m"])

    def child_argv(self, agent: AgentProcess) -> str:
        with open(f"/proc/{self.device(agent)['pid']}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode()

    def test_a_fixing_reload_clears_the_back_off(self) -> None:
        """Item 1: a model on a broken file backs off; pointed at a good one, it answers at once."""
        require_llama_server()
        broken = os.path.join(self.dir, "broken.gguf")
        with open(broken, "wb") as f:
            f.write(b"this is not a GGUF file" * 100)
        agent = self.start_agent({"models": [{"model_id": "m", "path": broken}]})
        self.assert_error(self.chat(agent), 503, "model_load_failed")
        answer = self.chat(agent)
        self.assert_error(answer, 503, "model_load_failed")
        self.assertEqual(answer[1].get("retry-after"), "15")  # backing off
        self.reload_with(agent, tiny_model(self.dir, "good", 3))
        started = time.monotonic()
        self.assert_chat_ok(agent)
        print(f"\n    the fixed model answered 200 {time.monotonic() - started:.2f}s after the reload "
              "(one load of the tiny model; it was backing off 15 s)")
        self.assertIn("good.gguf", self.child_argv(agent))
        self.stop_and_assert_no_orphans(agent)

    def test_a_load_in_flight_for_the_replaced_file_fails_nobody_who_asked_for_the_new_one(self) -> None:
        """Item 2: the old file's load never becomes ready; the request after the reload gets the new file."""
        marker = self.marker()
        config = self.fake_config(llama_server_startup_timeout_s=4)
        good = os.path.join(self.dir, "good.gguf")
        open(good, "wb").close()
        agent = self.start_agent(config, env={"FAKE_LLAMA": f"once_file={marker},slow_start=100"})
        old_thread, old_result = self.in_thread(lambda: self.chat(agent))
        wait_until(lambda: self.device(agent)["state"] == "starting" and not os.path.exists(marker), 10,
                   interval=0.02, what="the old file's load under way")
        self.reload_with(agent, good)
        new_thread, new_result = self.in_thread(lambda: self.chat(agent))
        self.assertEqual(self.joined(new_thread, new_result)[0], 200)
        self.assertIn("good.gguf", self.child_argv(agent))
        old = self.joined(old_thread, old_result)
        self.assertIn(old[0], (200, 503), old)  # admitted under the old record: its own load's outcome
        self.assertEqual(self.chat(agent)[0], 200)  # and nothing backs the model off afterwards
        self.assertEqual(self.device(agent)["backoff"], [])
        self.stop_and_assert_no_orphans(agent)

    def test_streams_admitted_before_a_changed_ctx_size_finish_then_one_restart(self) -> None:
        """Item 3: parallel 2, two streams running and one queued; a reload makes ctx_size 512 -> 1024
        and a new request comes. Every stream ends with [DONE], the child afterwards has --ctx-size
        1024, and the device restarted once."""
        config = self.fake_config(max_pending_requests_per_device=8)
        config["models"][0].update({"ctx_size": 512, "server_args": {"parallel": 2}})
        agent = self.start_agent(config, env={"FAKE_LLAMA": "slow_tokens=0.1"})
        self.assert_chat_ok(agent)
        before = self.device(agent)

        def loads() -> int:
            return agent.log_text().count("llama-server for m ready on cpu:0")

        loaded = loads()

        def stream() -> List[str]:
            conn = http.client.HTTPConnection("127.0.0.1", agent.port, timeout=REQUEST_TIMEOUT)
            try:
                conn.request("POST", "/v1/chat/completions", json.dumps({**CHAT, "stream": True, "max_tokens": 15}),
                             {"Content-Type": "application/json"})
                response = conn.getresponse()
                return [str(response.status), *read_sse(response.read())]
            finally:
                conn.close()

        old = [self.in_thread(stream) for _ in range(3)]
        wait_until(lambda: (self.device(agent)["in_flight"], self.device(agent)["queued"]) == (2, 1), 10,
                   interval=0.02, what="two streams running and one queued")
        with open(agent.config_path, encoding="utf-8") as f:
            text = f.read()
        with open(agent.config_path, "w", encoding="utf-8") as f:
            f.write(text.replace("ctx_size: 512", "ctx_size: 1024"))
        status, _, body = agent.request("POST", "/v1/node/reload", timeout=30)
        self.assertEqual(json.loads(body)["models"]["restart_on_next_use"], ["m"], body)
        self.assertTrue(self.device(agent)["stale"])
        self.assert_chat_ok(agent)  # the new request: waits for the three, then one restart
        for thread, result in old:
            events = self.joined(thread, result)
            self.assertEqual((events[0], events[-1]), ("200", "[DONE]"), events[-3:])
            self.assertFalse(any('"error"' in e for e in events), events)
        after = self.device(agent)
        self.assertEqual((loads() - loaded, after["pid"] != before["pid"]), (1, True), "one restart")
        self.assertFalse(after["stale"])
        self.assertIn("--ctx-size 1024", self.child_argv(agent))
        self.stop_and_assert_no_orphans(agent)
