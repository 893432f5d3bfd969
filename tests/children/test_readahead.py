"""Warm switches (issue 28, item 6): what is read ahead (pure
:func:`rolemesh.children.readahead.plan`, bounded by MemAvailable), once per window,
and that the node asks for it when a request waits for a switch -- and only
then."""

from __future__ import annotations

import os
from typing import List, Optional, Tuple

from hypothesis import given
from hypothesis import strategies as st
from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from rolemesh.children import readahead
from rolemesh.children.readahead import ReadAhead, files_of, plan
from rolemesh.config.file import ModelConfig
from tests.node.test_node import NodeHarness


class PlanTests(SynchronousTestCase):
    @given(st.lists(st.integers(0, 1 << 40), max_size=6), st.none() | st.integers(-1, 1 << 41))
    def test_bounded_by_half_the_available_memory_front_first(self, sizes: List[int],
                                                              available: Optional[int]) -> None:
        lengths = plan(sizes, available)
        budget = max(0, available or 0) // 2
        self.assertEqual(len(lengths), len(sizes))
        self.assertLessEqual(sum(lengths), budget)
        for i, (size, n) in enumerate(zip(sizes, lengths)):
            self.assertTrue(0 <= n <= size)
            if n < size:  # a file cut short: the budget is used up, nothing after it
                self.assertEqual(sum(lengths[i + 1:]), 0)
        if sum(sizes) <= budget:
            self.assertEqual(lengths, sizes)

    def test_files_of_a_split_model_and_its_projector(self) -> None:
        model = ModelConfig("m", "/w/big-00001-of-00003.gguf", mmproj="/w/mmproj-big.gguf")
        self.assertEqual(files_of(model), ["/w/big-00001-of-00003.gguf", "/w/big-00002-of-00003.gguf",
                                           "/w/big-00003-of-00003.gguf", "/w/mmproj-big.gguf"])
        self.assertEqual(files_of(ModelConfig("m", "/w/m.gguf")), ["/w/m.gguf"])


class ReadAheadTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.clock = Clock()
        self.asked: List[Tuple[str, int]] = []
        self.available: Optional[int] = 10 << 30
        self.reader = ReadAhead(lambda: self.clock, advise=lambda p, n: self.asked.append((p, n)),
                                available=lambda: self.available, size_of=lambda p: 3 << 30)

    def test_once_per_window(self) -> None:
        model = ModelConfig("m", "/w/m.gguf")
        self.assertEqual(self.reader.warm(model), (("/w/m.gguf", 3 << 30),))
        self.assertIsNone(self.reader.warm(model))
        self.clock.advance(readahead.WINDOW_S)
        self.reader.warm(model)
        self.assertEqual(self.asked, [("/w/m.gguf", 3 << 30)] * 2)

    def test_cut_to_half_the_free_memory_or_skipped(self) -> None:
        self.available = 4 << 30
        self.assertEqual(self.reader.warm(ModelConfig("a", "/w/a.gguf")), (("/w/a.gguf", 2 << 30),))
        self.available = None
        self.assertIsNone(self.reader.warm(ModelConfig("b", "/w/b.gguf")))
        self.assertEqual(self.asked, [("/w/a.gguf", 2 << 30)])

    def test_advice_goes_a_read_ahead_window_at_a_time(self) -> None:
        """Linux reads at most one window per WILLNEED call: one call for the
        whole file would warm only its first window."""
        path = os.path.abspath(self.mktemp())
        with open(path, "wb") as f:
            f.write(b"\0" * 10)
        calls = []
        self.patch(readahead, "read_ahead_window", lambda p: 4 << 20)
        self.patch(os, "posix_fadvise", lambda fd, offset, length, advice: calls.append((offset, length, advice)))
        readahead.advise_willneed(path, 10 << 20)
        self.assertEqual(calls, [(0, 4 << 20, os.POSIX_FADV_WILLNEED), (4 << 20, 4 << 20, os.POSIX_FADV_WILLNEED),
                                 (8 << 20, 2 << 20, os.POSIX_FADV_WILLNEED)])

    def test_real_advice_on_a_real_file(self) -> None:
        path = os.path.abspath(self.mktemp())
        with open(path, "wb") as f:
            f.write(b"GGUF" + b"\0" * 8192)
        readahead.advise_willneed(path, 8196)  # no error: the kernel takes the advice
        readahead.evict(path)
        self.assertIsNotNone(readahead.mem_available())


class NodeHookTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.h = NodeHarness()
        self.warmed: List[str] = []
        self.h.node.read_ahead.warm = lambda model: self.warmed.append(model.model_id)  # type: ignore[method-assign]

    def test_a_request_waiting_for_a_switch_reads_the_model_ahead(self) -> None:
        h = self.h
        first = h.node.acquire(h.model("a"))
        h.answer("alpha")
        lease = self.successResultOf(first)
        self.assertEqual(self.warmed, [], "a load on an idle device starts at once: nothing to warm")
        other = h.node.acquire(h.model("b"))  # queued behind a's request: the switch comes after it
        self.assertNoResult(other)
        self.assertEqual(self.warmed, ["b"])
        lease.release()
        h.reap()
        h.answer("b")
        self.successResultOf(other).release()

    def test_a_request_queued_behind_its_own_model_reads_nothing(self) -> None:
        h = self.h
        first = h.node.acquire(h.model("a"))
        h.answer("alpha")
        lease = self.successResultOf(first)
        second = h.node.acquire(h.model("a"))  # one slot: waits, but for the same child
        self.assertNoResult(second)
        self.assertEqual(self.warmed, [])
        lease.release()
        self.successResultOf(second).release()
