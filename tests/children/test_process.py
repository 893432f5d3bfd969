"""Unit tests of rolemesh.children.process: the output ring, line splitting, and
reading a serving child's pipes in batches (a Clock and a fake process
transport with flow control; no real process)."""

from __future__ import annotations

from typing import Any, List, Tuple

from hypothesis import given
from hypothesis import strategies as st
from twisted.internet import process
from twisted.internet.interfaces import IProcessProtocol, IProcessTransport, IReactorProcess
from twisted.internet.task import Clock
from twisted.python.failure import Failure
from twisted.trial.unittest import SynchronousTestCase
from zope.interface.verify import verifyObject

from rolemesh.children.process import (
    BATCH_BYTES,
    LARGE_READ,
    MIN_HOLD_S,
    OUTPUT_HOLD_S,
    ChildProcess,
    OutputRing,
    next_hold,
    to_log,
    worth_logging,
)
from rolemesh.children.state import READY, STOPPED
from tests.children.test_supervisor import Harness
from tests.fixtures.fakes import FakeProcess, ProcessReactor


class PausableProcess(FakeProcess):
    """A FakeProcess with the flow control of Twisted's posix Process."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.paused = False
        self.pauses = 0
        self.resumes = 0
        super().__init__(*args, **kwargs)

    def pauseProducing(self) -> None:
        assert not self.paused, "paused twice"
        self.paused = True
        self.pauses += 1

    def resumeProducing(self) -> None:
        self.paused = False
        self.resumes += 1


class PausableReactor(ProcessReactor):
    def spawnProcess(self, processProtocol, executable, args=(), env=None, path=None, uid=None, gid=None,
                     usePTY=0, childFDs=None):
        self._next_pid += 1
        child = PausableProcess(self, processProtocol, list(args), dict(env or {}), self._next_pid)
        self.processes.append(child)
        return child


class Sink:
    def __init__(self) -> None:
        self.lines: List[Tuple[int, bytes]] = []
        self.progress = 0
        self.ended: List[Failure] = []

    def child_progressed(self, child: ChildProcess) -> None:
        self.progress += 1

    def child_output(self, child: ChildProcess, fd: int, chunk: bytes) -> None:
        self.lines.extend((fd, line) for line in chunk.split(b"\n"))

    def child_ended(self, child: ChildProcess, reason: Failure) -> None:
        self.ended.append(reason)


class OutputRingTests(SynchronousTestCase):
    def test_the_attempt_is_the_lines_since_its_mark_bounded(self) -> None:
        ring = OutputRing(size=10, attempt_size=3)
        ring.append("old")
        ring.new_attempt()
        self.assertEqual(ring.attempt(), [])
        for i in range(5):
            ring.append(f"l{i}")
        self.assertEqual(ring.attempt(), ["l2", "l3", "l4"])
        self.assertEqual(ring.tail(2), ["l3", "l4"])
        self.assertEqual(ring.tail(0), [])
        self.assertEqual(ring.tail(100), ["old", "l0", "l1", "l2", "l3", "l4"])

    def test_an_attempt_longer_than_the_ring_is_what_the_ring_holds(self) -> None:
        ring = OutputRing(size=4, attempt_size=200)
        ring.new_attempt()
        for i in range(10):
            ring.append(f"l{i}")
        self.assertEqual(ring.attempt(), ["l6", "l7", "l8", "l9"])


class OutputRingChunkTests(SynchronousTestCase):
    """Reads kept as chunks read back as the lines they hold."""

    def test_chunks_and_lines_read_back_in_order(self) -> None:
        ring = OutputRing(size=5, attempt_size=3)
        ring.append("note")
        ring.new_attempt()
        ring.add_chunk(b"a\nb\n\nc")  # an empty line is a line
        ring.add_chunk("\u00e9t\u00e9".encode() + b"\n\xff")
        self.assertEqual(ring.lines, ["b", "", "c", "\u00e9t\u00e9", "\ufffd"])
        self.assertEqual(ring.tail(2), ["\u00e9t\u00e9", "\ufffd"])
        self.assertEqual(ring.attempt(), ["c", "\u00e9t\u00e9", "\ufffd"])

    @given(st.lists(st.one_of(st.lists(st.text(alphabet="ab\u00e9", max_size=3), min_size=1, max_size=6),
                              st.text(alphabet="xy", max_size=3)), max_size=30),
           st.integers(1, 12), st.integers(0, 15))
    def test_same_as_keeping_every_line(self, entries: List[Any], size: int, count: int) -> None:
        ring = OutputRing(size=size, attempt_size=size)
        every: List[str] = []
        for entry in entries:
            if isinstance(entry, list):
                ring.add_chunk("\n".join(entry).encode())
                every.extend(entry)
            else:
                ring.append(entry)
                every.append(entry)
        self.assertEqual(ring.lines, every[-size:])
        self.assertEqual(ring.tail(count), every[-min(count, size):] if count else [])
        self.assertLessEqual(sum(n for _, n in ring._entries) - max([n for _, n in ring._entries] or [0]), size,
                             "holds no entry it no longer needs")


class InterfaceTests(SynchronousTestCase):
    def test_the_child_protocol_and_the_fake_transport_provide_their_interfaces(self) -> None:
        child = ChildProcess(Sink(), Clock(), "gpu:0")
        verifyObject(IProcessProtocol, child)
        transport = PausableReactor().spawnProcess(child, "llama-server")
        verifyObject(IProcessTransport, transport)
        verifyObject(IReactorProcess, PausableReactor())


class NextHoldTests(SynchronousTestCase):
    @given(st.floats(MIN_HOLD_S, OUTPUT_HOLD_S), st.integers(0, 1 << 30), st.integers(0, 1 << 30))
    def test_bounded_and_shorter_for_bigger_batches(self, hold: float, batch: int, more: int) -> None:
        short, shorter = next_hold(hold, batch), next_hold(hold, batch + more)
        self.assertTrue(MIN_HOLD_S <= shorter <= short <= OUTPUT_HOLD_S, (short, shorter))

    def test_a_batch_of_the_target_size_keeps_the_hold(self) -> None:
        self.assertAlmostEqual(next_hold(0.02, BATCH_BYTES), 0.02)
        self.assertEqual(next_hold(0.1, 500), OUTPUT_HOLD_S)
        self.assertAlmostEqual(next_hold(0.1, 4 * BATCH_BYTES), 0.025)


class HoldTests(SynchronousTestCase):
    """While serving, a small read is followed by a rest of OUTPUT_HOLD_S."""

    def setUp(self) -> None:
        self.clock = Clock()
        self.sink = Sink()
        self.child = ChildProcess(self.sink, self.clock, "gpu:0", signal_group=lambda pid, sig: None)
        self.reactor = PausableReactor()
        self.transport = self.reactor.spawnProcess(self.child, "llama-server")
        self.child.pid = self.transport.pid

    def test_the_real_process_transport_has_flow_control(self) -> None:
        self.assertTrue(callable(getattr(process.Process, "pauseProducing", None)))
        self.assertTrue(callable(getattr(process.Process, "resumeProducing", None)))

    def test_no_hold_while_loading(self) -> None:
        self.transport.output("loading\n")
        self.assertFalse(self.transport.paused)
        self.assertEqual(self.clock.getDelayedCalls(), [])
        self.assertEqual(self.sink.lines, [(2, b"loading")])

    def test_a_small_read_while_serving_rests_the_pipes_then_reads_again(self) -> None:
        self.child.serving = True
        self.transport.output("slot launch\nslot done\n")
        self.assertEqual(self.sink.lines, [(2, b"slot launch"), (2, b"slot done")], "lines are not delayed")
        self.assertTrue(self.transport.paused)
        self.clock.advance(OUTPUT_HOLD_S - 0.001)
        self.assertTrue(self.transport.paused)
        self.clock.advance(0.001)
        self.assertFalse(self.transport.paused)
        self.assertEqual((self.transport.pauses, self.transport.resumes), (1, 1))
        self.transport.output("next\n")
        self.assertTrue(self.transport.paused)
        self.assertEqual(self.transport.pauses, 2)

    def test_data_from_the_other_pipe_in_the_same_wake_up_does_not_pause_twice(self) -> None:
        self.child.serving = True
        self.transport.output("a\n", fd=1)
        self.transport.output("b\n", fd=2)
        self.assertEqual((self.transport.pauses, len(self.clock.getDelayedCalls())), (1, 1))

    def test_a_child_printing_fast_gets_shorter_holds_and_slow_again_longer(self) -> None:
        self.child.serving = True
        self.transport.output("first\n")
        self.clock.advance(OUTPUT_HOLD_S)  # 64 KiB piled up meanwhile: eight full reads, then a short one
        for _ in range(8):
            self.transport.output("y" * (LARGE_READ - 1) + "\n")
            self.assertFalse(self.transport.paused, "a full read: read on")
        self.transport.output("tail\n")
        self.assertTrue(self.transport.paused)
        [resume] = self.clock.getDelayedCalls()
        expected = OUTPUT_HOLD_S * BATCH_BYTES / (8 * LARGE_READ + 5)  # about a quarter of the first
        self.assertAlmostEqual(resume.getTime() - self.clock.seconds(), expected)
        self.clock.advance(OUTPUT_HOLD_S)
        self.transport.output("quiet again\n")  # a small batch: back to the longest hold
        [resume] = self.clock.getDelayedCalls()
        self.assertAlmostEqual(resume.getTime() - self.clock.seconds(), OUTPUT_HOLD_S)

    def test_a_large_read_is_followed_by_the_next_at_once(self) -> None:
        self.child.serving = True
        self.transport.output("x" * (LARGE_READ - 1) + "\n")
        self.assertFalse(self.transport.paused)
        self.assertEqual(self.clock.getDelayedCalls(), [])

    def test_the_end_while_held_cancels_the_resume_and_is_reported(self) -> None:
        self.child.serving = True
        self.transport.output("last words")
        self.assertTrue(self.transport.paused)
        self.transport.exit(1)
        self.assertEqual(self.clock.getDelayedCalls(), [], "no orphaned DelayedCall")
        self.assertEqual(len(self.sink.ended), 1)
        self.assertEqual(self.sink.lines, [(2, b"last words")])
        self.assertEqual(self.transport.resumes, 0, "nothing resumes an ended child")

    def test_stop_holding_reads_again_at_once_and_for_good(self) -> None:
        self.child.serving = True
        self.transport.output("a\n")
        self.child.stop_holding()
        self.assertFalse(self.transport.paused)
        self.assertEqual(self.clock.getDelayedCalls(), [])
        self.transport.output("stopping\n")
        self.assertFalse(self.transport.paused)

    def test_a_transport_without_flow_control_is_read_as_output_comes(self) -> None:
        child = ChildProcess(self.sink, self.clock, "gpu:0")
        plain = ProcessReactor().spawnProcess(child, "llama-server")
        child.serving = True
        plain.output("line\n")
        self.assertEqual(self.clock.getDelayedCalls(), [])


class SupervisorHoldTests(SynchronousTestCase):
    """The supervisor holds reads only while its child serves."""

    def setUp(self) -> None:
        self.h = Harness(reactor=PausableReactor())

    def test_held_only_once_ready_and_released_when_stopped(self) -> None:
        h = self.h
        d = h.sup.ensure(h.a)
        child = h.reactor.last
        child.output("llama_model_load: loading\n")
        self.assertFalse(child.paused, "loading output is read at once (readiness, stall)")
        h.make_ready("a")
        self.successResultOf(d)
        self.assertEqual(h.sup.state, READY)
        child.output("0.01.000 I slot launch_slot_: id 0 | task 1\n")
        self.assertTrue(child.paused)
        self.assertIn("0.01.000 I slot launch_slot_: id 0 | task 1", h.sup.logs)
        stopped = h.sup.stop()
        self.assertFalse(child.paused, "a stopping child is read at once")
        child.exit(0)
        self.successResultOf(stopped)
        self.assertEqual(h.sup.state, STOPPED)
        self.assertEqual(h.reactor.getDelayedCalls(), [])

    def test_a_crash_while_held_is_seen_and_leaves_no_timer(self) -> None:
        h = self.h
        h.sup.ensure(h.a)
        h.make_ready("a")
        child = h.reactor.last
        child.output("0.02.000 I slot release: id 0\n")
        self.assertTrue(child.paused)
        child.exit(signal=11)
        self.assertEqual(h.sup.crashes, 1)
        self.assertEqual(h.reactor.getDelayedCalls(), [])


class ToLogTests(SynchronousTestCase):
    """One search over a read picks the same lines as checking each line."""

    @given(st.lists(st.one_of(st.binary(max_size=40), st.sampled_from(
        [b"0.00.005.256 E srv  error", b"  1.2 E x", b"slot launch", b"ERROR here", b"abort", b"\t", b"", b"a\rb",
         b"0.1 W warning", b"3 e lower", b"GGML_ASSERT(x) failed", b"Aborted (core dumped)", b"1.0 E"])),
        max_size=12), st.booleans())
    def test_same_lines_as_one_by_one(self, lines: List[bytes], serving: bool) -> None:
        lines = [line.replace(b"\n", b" ") for line in lines] or [b""]  # a read's lines hold no newline
        self.assertEqual(to_log(b"\n".join(lines), serving),
                         [line.decode("utf-8", "replace") for line in lines if worth_logging(line, serving)])

    def test_a_serving_childs_request_lines_are_not_logged(self) -> None:
        read = b"srv  log_server_r: request: POST /v1/chat/completions 127.0.0.1 200\nslot release: id 0"
        self.assertEqual(to_log(read, serving=True), [])
        self.assertEqual(to_log(read + b"\n0.00.1 E boom", serving=True), ["0.00.1 E boom"])
        self.assertEqual(to_log(read, serving=False), read.decode().split("\n"))
