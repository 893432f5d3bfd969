"""One agent per state folder, and pid files that know whose children they
list (rolemesh.children.pidfiles; issue 26).

The lock is a real ``flock`` on a file in a temporary folder (two opens of
one file conflict even within one process); the sweep's view of running
processes (command lines, start times) and its kill are fakes."""

from __future__ import annotations

import json
import os
import shutil
import signal
import tempfile
from typing import Dict, List, Optional, Tuple

from twisted.logger import capturedLogs, formatEvent
from twisted.trial.unittest import SynchronousTestCase

from rolemesh.base.errors import ConfigError
from rolemesh.children.pidfiles import LOCK_NAME, PidFiles, Process, StateDirLock, parse_start_time, start_time
from tests.fixtures.service_harness import ServiceHarness

ARGV = ["/opt/llama/llama-server", "--model", "/m.gguf", "--port", "41000"]


class World:
    """Processes by pid: (start time, command line); kills recorded."""

    def __init__(self) -> None:
        self.procs: Dict[int, Tuple[int, List[str]]] = {}
        self.killed: List[Tuple[int, int]] = []

    def run(self, pid: int, start: int, argv: Optional[List[str]] = None) -> None:
        self.procs[pid] = (start, list(argv or ["python3", "-m", "rolemesh.cli"]))

    def started(self, pid: int) -> Optional[int]:
        return self.procs[pid][0] if pid in self.procs else None

    def cmdline(self, pid: int) -> Optional[List[str]]:
        return self.procs[pid][1] if pid in self.procs else None

    def kill(self, pid: int, sig: int) -> None:
        self.killed.append((pid, sig))
        self.procs.pop(pid, None)


class TempDir(SynchronousTestCase):
    def setUp(self) -> None:
        self.dir = tempfile.mkdtemp(prefix="rm-pid-")
        self.addCleanup(shutil.rmtree, self.dir, True)
        self.state = os.path.join(self.dir, "state")


class ProcessTests(TempDir):
    def test_start_time_is_field_22_after_the_command_name(self) -> None:
        fields = " ".join(str(n) for n in range(3, 40))  # field 3 onwards; field 22 is "22"
        self.assertEqual(parse_start_time(f"123 (llama) server) x) {fields}"), 22)
        self.assertIsNone(parse_start_time("123 (short) R 1"))
        self.assertIsNone(parse_start_time(""))

    def test_this_process(self) -> None:
        me = Process.me()
        self.assertEqual(me.pid, os.getpid())
        self.assertIsNotNone(me.start)
        self.assertEqual(start_time(os.getpid()), me.start)
        self.assertTrue(me.alive())

    def test_a_reused_pid_is_not_the_recorded_process(self) -> None:
        world = World()
        world.run(500, start=1000)
        self.assertTrue(Process(500, 1000).alive(world.started))
        self.assertFalse(Process(500, 999).alive(world.started), "same pid, another process")
        self.assertFalse(Process(501, 1000).alive(world.started))
        self.assertTrue(Process(500, None).alive(world.started), "start unknown: the pid decides")

    def test_records(self) -> None:
        self.assertEqual(Process.from_json({"pid": 7, "start": 9}), Process(7, 9))
        self.assertEqual(Process.from_json({"pid": 7}), Process(7, None))
        for bad in (None, {}, {"pid": 0}, {"pid": "x"}, [], "7"):
            self.assertIsNone(Process.from_json(bad), bad)


class LockTests(TempDir):
    def test_a_second_agent_on_the_folder_is_refused_in_one_line(self) -> None:
        first = StateDirLock.acquire(self.state, me=Process(4242, 77))
        self.addCleanup(first.release)
        self.assertTrue(first.held)
        with open(os.path.join(self.state, LOCK_NAME), encoding="ascii") as f:
            self.assertEqual(json.load(f), {"pid": 4242, "start": 77})
        with self.assertRaises(ConfigError) as caught:
            StateDirLock.acquire(self.state, me=Process(5151, 88))
        message = str(caught.exception)
        self.assertEqual(message, f"state_dir: {self.state} is in use by another rolemesh-node-agent (pid 4242); "
                                  "give this agent a state_dir of its own")
        self.assertNotIn("\n", message)
        with open(os.path.join(self.state, LOCK_NAME), encoding="ascii") as f:
            self.assertEqual(json.load(f)["pid"], 4242, "the refused agent leaves the owner's record alone")

    def test_the_children_do_not_inherit_the_lock(self) -> None:
        """A child that outlived its agent must not keep the folder locked."""
        lock = StateDirLock.acquire(self.state)
        self.addCleanup(lock.release)
        assert lock._fd is not None
        self.assertFalse(os.get_inheritable(lock._fd))

    def test_the_owner_is_written_again_once_running(self) -> None:
        lock = StateDirLock.acquire(self.state, me=Process(1, 2))
        self.addCleanup(lock.release)
        lock.record()
        with open(os.path.join(self.state, LOCK_NAME), encoding="ascii") as f:
            self.assertEqual(json.load(f)["pid"], os.getpid())

    def test_released_the_folder_is_free_again(self) -> None:
        StateDirLock.acquire(self.state).release()
        again = StateDirLock.acquire(self.state, me=Process(6, 1))
        self.addCleanup(again.release)
        self.assertTrue(again.held)
        with open(os.path.join(self.state, LOCK_NAME), encoding="ascii") as f:
            self.assertEqual(json.load(f), {"pid": 6, "start": 1}, "a shorter record replaces a longer one")

    def test_owner_unknown_until_it_wrote_its_pid(self) -> None:
        def locked_elsewhere(fd: int, how: int) -> None:
            raise BlockingIOError(11, "Resource temporarily unavailable")

        with self.assertRaises(ConfigError) as caught:
            StateDirLock.acquire(self.state, flock=locked_elsewhere)
        self.assertIn("(pid unknown)", str(caught.exception))

    def test_a_folder_that_cannot_be_made_is_tolerated(self) -> None:
        blocker = os.path.join(self.dir, "file")
        open(blocker, "w").close()
        with capturedLogs() as events:
            lock = StateDirLock.acquire(os.path.join(blocker, "state"))
        self.assertFalse(lock.held)
        lock.release()
        self.assertIn("cannot hold the agent's lock", " ".join(formatEvent(e) for e in events))


class SweepTests(TempDir):
    def setUp(self) -> None:
        super().setUp()
        self.world = World()
        self.world.run(100, start=10)  # the agent doing the sweep
        self.me = Process(100, 10)

    def pidfiles(self, owner: Process) -> PidFiles:
        return PidFiles(self.state, cmdline=self.world.cmdline, kill=self.world.kill, started=self.world.started,
                        owner=owner)

    def write_child(self, owner: Process, device: str, pid: int, start: int) -> str:
        self.world.run(pid, start, ARGV)
        self.pidfiles(owner).write(device, pid, ARGV)
        return os.path.join(self.state, "children", device.replace(":", "-") + ".json")

    def sweep(self) -> Tuple[List[int], str]:
        with capturedLogs() as events:
            killed = self.pidfiles(self.me).sweep()
        return killed, "\n".join(formatEvent(e) for e in events)

    def test_the_record_names_child_and_owner(self) -> None:
        path = self.write_child(Process(200, 20), "cpu:0", 201, 21)
        with open(path, encoding="utf-8") as f:
            self.assertEqual(json.load(f), {"pid": 201, "start": 21, "argv": ARGV,
                                            "owner": {"pid": 200, "start": 20}})

    def test_children_of_a_live_agent_are_left_alone(self) -> None:
        self.world.run(200, start=20)  # the other agent still runs
        path = self.write_child(Process(200, 20), "cpu:0", 201, 21)
        killed, logged = self.sweep()
        self.assertEqual((killed, self.world.killed), ([], []))
        self.assertTrue(os.path.exists(path), "its record stays: the child is not ours to forget")
        self.assertIn("left llama-server pid 201 alone: its agent, pid 200, still runs", logged)

    def test_children_of_a_dead_agent_are_killed_and_named_as_its(self) -> None:
        path = self.write_child(Process(200, 20), "cpu:0", 201, 21)  # agent 200 is gone
        killed, logged = self.sweep()
        self.assertEqual((killed, self.world.killed), ([201], [(201, signal.SIGKILL)]))
        self.assertFalse(os.path.exists(path))
        self.assertIn("killed stale llama-server pid 201 left by agent pid 200, which no longer runs", logged)

    def test_an_owner_pid_reused_by_another_process_counts_as_gone(self) -> None:
        self.world.run(200, start=99)  # pid 200 now runs something else
        self.write_child(Process(200, 20), "cpu:0", 201, 21)
        self.assertEqual(self.sweep()[0], [201])

    def test_a_child_pid_reused_by_another_process_is_not_hit(self) -> None:
        path = self.write_child(Process(200, 20), "cpu:0", 201, 21)
        self.world.run(201, start=55, argv=ARGV)  # same pid, same command line, another process
        self.assertEqual((self.sweep()[0], self.world.killed), ([], []))
        self.assertFalse(os.path.exists(path), "a stale record goes")

    def test_a_record_without_owner_is_an_earlier_run(self) -> None:
        os.makedirs(os.path.join(self.state, "children"))
        self.world.run(301, 31, ARGV)
        with open(os.path.join(self.state, "children", "cpu-0.json"), "w", encoding="utf-8") as f:
            json.dump({"pid": 301, "argv": ARGV}, f)  # as earlier versions wrote them
        killed, logged = self.sweep()
        self.assertEqual(killed, [301])
        self.assertIn("left by an earlier run (owner not recorded)", logged)


class ServiceLockTests(TempDir):
    """``make_service`` takes the lock before it sweeps, and lets it go
    once its children are stopped."""

    def harness(self) -> ServiceHarness:
        h = ServiceHarness({"state_dir": self.state, "models": [{"model_id": "m"}]})
        self.addCleanup(h.cleanup)
        return h

    def test_a_second_service_on_the_folder_stops_before_sweeping(self) -> None:
        first = self.harness()
        first.start()
        children = os.path.join(self.state, "children")
        os.makedirs(children, exist_ok=True)
        record = os.path.join(children, "gpu-0.json")
        with open(record, "w", encoding="utf-8") as f:  # a child of the first, as a sweep would see it
            json.dump({"pid": os.getpid(), "argv": ["x"]}, f)
        with self.assertRaises(ConfigError) as caught:
            self.harness()
        self.assertIn(f"state_dir: {self.state} is in use by another rolemesh-node-agent (pid {os.getpid()})",
                      str(caught.exception))
        self.assertTrue(os.path.exists(record), "the refused agent swept nothing")
        self.successResultOf(first.stop())
        self.assertFalse(first.root.state_lock is not None and first.root.state_lock.held)
        third = self.harness()
        self.assertTrue(third.root.state_lock is not None and third.root.state_lock.held)
        third.root.state_lock.release()
