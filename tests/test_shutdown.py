"""The shutdown's hard deadline: a child that never reports its end (stuck
in the kernel, D-state) cannot keep the agent from exiting."""

from __future__ import annotations

import gc
import os
from typing import Any, List

from twisted.logger import capturedLogs, formatEvent
from twisted.trial.unittest import SynchronousTestCase

import rolemesh.service
from rolemesh.config.file import validate
from rolemesh.service import SHUTDOWN_MARGIN_S, SHUTDOWN_OVERDUE_EXIT, kernel_state, shutdown_deadline
from tests.fixtures.service_harness import ServiceHarness


class DeadlineTests(SynchronousTestCase):
    def test_deadline_is_grace_plus_stop_timeout_plus_margin(self) -> None:
        config = validate({"node_id": "n", "shutdown_grace_s": 7, "llama_server_stop_timeout_s": 3, "models": []})
        self.assertEqual(shutdown_deadline(config), 7 + 3 + SHUTDOWN_MARGIN_S)

    def test_kernel_state_of_this_process_and_of_none(self) -> None:
        self.assertTrue(kernel_state(os.getpid()).startswith(("R", "S")), kernel_state(os.getpid()))
        self.assertEqual(kernel_state(None), "unknown")
        self.assertEqual(kernel_state(2 ** 22 + 12345), "unknown")


class StuckChildTests(SynchronousTestCase):
    """The whole service tree on fakes; the child ignores SIGTERM and SIGKILL."""

    def setUp(self) -> None:
        self.h = ServiceHarness({"models": [{"model_id": "tiny", "preload": True}],
                                 "shutdown_grace_s": 2, "llama_server_stop_timeout_s": 1})
        self.addCleanup(self.h.cleanup)
        self.exits: List[int] = []
        self.h.root.hard_exit = self.exits.append
        self.h.start()
        self.h.answer("tiny")
        [self.child] = self.h.live_children()

    def test_a_child_that_never_ends_does_not_keep_the_agent(self) -> None:
        done: List[Any] = []
        deadline = shutdown_deadline(self.h.root.config)
        with capturedLogs() as events:
            self.h.stop().addBoth(done.append)
            self.h.reactor.advance(deadline - 0.5)
            self.assertEqual(self.exits, [], "not before the deadline")
            self.assertIn(9, self.child.signals, "SIGKILL was sent")
            self.h.reactor.advance(1)
        self.assertEqual(self.exits, [SHUTDOWN_OVERDUE_EXIT])
        self.assertNotEqual(SHUTDOWN_OVERDUE_EXIT, 0)
        self.assertEqual(done, [], "the stop itself never finished")
        text = "\n".join(formatEvent(e) for e in events)
        self.assertIn(f"shutdown did not finish within {deadline:g} s", text)
        self.assertIn("stuck stopping the llama-server children", text)
        self.assertIn(f"still running: llama-server on gpu:0, pid {self.child.pid}, state stopping", text)
        self.child.exit(0, signal=9)  # let the fakes end cleanly

    def test_a_shutdown_in_time_cancels_the_deadline(self) -> None:
        done: List[Any] = []
        self.h.stop().addBoth(done.append)
        self.child.exit(0)
        self.h.reactor.advance(0)
        self.assertEqual(done, [None])
        self.h.reactor.advance(shutdown_deadline(self.h.root.config) + 60)
        self.assertEqual(self.exits, [])
        self.assertEqual(self.h.reactor.getDelayedCalls(), [])


class StopOrderTests(SynchronousTestCase):
    def test_idle_connections_to_the_children_close_before_the_children_stop(self) -> None:
        """llama-server does not exit on SIGTERM while a client connection is
        open: the proxy's idle keep-alive connections must go first."""
        h = ServiceHarness({"models": [{"model_id": "tiny", "preload": True}]})
        self.addCleanup(h.cleanup)
        h.start()
        h.answer("tiny")
        order: List[str] = []
        real_close = h.root.proxy.close
        h.root.proxy.close = lambda: (order.append("proxy closed"), real_close())[1]  # type: ignore[method-assign]
        h.root.node.supervisors["gpu:0"].subscribe(
            lambda s: order.append(f"child {s.state}") if s.state == "stopping" else None)
        h.stop()
        self.assertEqual(order[:2], ["proxy closed", "child stopping"])
        [child] = h.live_children()
        child.exit(0)
        h.reactor.advance(0)


class OperationsDocTests(SynchronousTestCase):
    """docs/operations/systemd.md quotes the lines an operator sees, with the defaults."""

    def test_the_doc_quotes_the_log_lines(self) -> None:
        import re

        h = ServiceHarness({"models": [{"model_id": "tiny", "preload": True}]})
        self.addCleanup(h.cleanup)
        h.root.hard_exit = lambda status: None
        h.start()
        h.answer("tiny")
        [child] = h.live_children()
        with capturedLogs() as events:
            h.stop()
            h.reactor.advance(shutdown_deadline(h.root.config))
        child.exit(0, signal=9)
        lines = [formatEvent(e) for e in events if e.get("log_level").name == "critical"]
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        doc_path = os.path.join(root, "docs", "operations", "systemd.md")
        with open(doc_path, encoding="utf-8") as f:
            doc = f.read()
        self.assertIn(f"`{lines[0]}`", doc)
        shape = re.sub(r"gpu:0|\d+|stopping|unknown|[RSDZT] \([a-z ]+\)", ".", lines[1])
        quoted = re.search(r"`(still running: [^`]+)`", doc)
        assert quoted is not None
        self.assertEqual(re.sub(r"cuda:0|\d+|stopping|unknown|[RSDZT] \([a-z ]+\)", ".", quoted.group(1)), shape)


class FreezeHeapTests(SynchronousTestCase):
    """The entry points' service freezes its start-up heap once running; tests' services do not."""

    def started(self, freeze: bool) -> List[str]:
        frozen: List[str] = []
        self.patch(rolemesh.service, "freeze_heap", lambda: frozen.append("frozen"))
        h = ServiceHarness({"models": [{"model_id": "tiny"}]})
        self.addCleanup(h.cleanup)
        h.root.freeze_heap = freeze
        h.start()
        self.addCleanup(h.stop)
        for f, args, kwargs in getattr(h.reactor, "whenRunningHooks", []):  # the reactor starts running
            f(*args, **kwargs)
        return frozen

    def test_frozen_when_asked(self) -> None:
        self.assertEqual(self.started(True), ["frozen"])

    def test_not_by_default(self) -> None:
        self.assertEqual(self.started(False), [])

    def test_freeze_heap_moves_objects_out_of_the_collectors_sight(self) -> None:
        before = gc.get_freeze_count()
        self.addCleanup(gc.unfreeze)
        rolemesh.service.freeze_heap()
        self.assertGreater(gc.get_freeze_count(), before)
