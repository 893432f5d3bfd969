"""A reload as a cut-over, as a hypothesis state machine (issue 39): reloads
that flip a model's command, requests, finishes, loads that succeed or fail
and children that die, in any order, over a real Node with fake children and
a Clock.  Invariants:

- no request is served by a child of a command the config had stopped
  naming before the request came (its own, or one a reload made current
  while it waited);
- a child runs a command the config no longer has only while the device
  says so (``stale``), and once nothing is running or queued, a request is
  served by a child of the current command;
- no request for the current command is refused for a failure of a command
  the config no longer has.
"""

from __future__ import annotations

import signal
from typing import Any, Dict, List, Optional, Set, Tuple

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test
from twisted.trial.unittest import SynchronousTestCase

from rolemesh.children.state import READY, STARTING
from rolemesh.node.leases import Lease
from tests.fixtures.fakes import FakeProcess, make_config
from tests.node.test_node import NodeHarness

TOP = {"max_pending_requests_per_device": 64, "llama_server_startup_timeout_s": 10.0,
       "llama_server_probe_interval_s": 0.5, "llama_server_stop_timeout_s": 5.0}


def entry(ctx: int) -> dict:
    return {"model_id": "p", "ctx_size": ctx, "server_args": {"parallel": 2}}


def ctx_of(process: FakeProcess) -> int:
    argv = process.argv
    return int(argv[argv.index("--ctx-size") + 1])


class ReloadMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.ctx = 512
        self.h = NodeHarness(models=[entry(512)], **TOP)
        #: (the reload it came after, the commands current since, results) of requests not yet answered.
        self.waiting: List[Tuple[int, Set[int], List[Any]]] = []
        self.generation = 0
        #: pid -> the --ctx-size of the child that had it.
        self.ctx_by_pid: Dict[int, int] = {}
        #: (the command of its child, lease) of requests being served.
        self.leases: List[Tuple[int, Lease]] = []
        #: Children of the current command that had ended when it became current.
        self.ended_when_current = 0

    # -- what reaches the node -----------------------------------------------------

    @rule()
    def reload(self) -> None:
        self.ctx = 1024 if self.ctx == 512 else 512
        config = make_config([entry(self.ctx)], **TOP)
        self.h.node.reconfigure(config)
        self.generation += 1
        self.ended_when_current = self._ended(self.ctx)
        for _, seen, _ in self.waiting:
            seen.add(self.ctx)
        # The new command's first request is never refused for the old one's failures.
        assert self.h.sup("gpu:0").refusal(config.model("p")) is None
        self._collect()

    @rule()
    def request(self) -> None:
        results: List[Any] = []
        self.h.node.acquire(self.h.node.config.model("p")).addBoth(results.append)
        self.waiting.append((self.generation, {self.ctx}, results))
        self._collect()

    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        if self.leases:
            _, lease = self.leases.pop(data.draw(st.integers(0, len(self.leases) - 1)))
            lease.release()
        self._collect()

    # -- what the children do --------------------------------------------------------

    def _live(self) -> Optional[FakeProcess]:
        live = [p for p in self.h.reactor.processes if not p.ended]
        return live[-1] if live else None

    @rule()
    def load_succeeds(self) -> None:
        self.h.answer("p")
        self._collect()

    @rule()
    def load_fails(self) -> None:
        child = self._live()
        if child is not None and self.h.sup("gpu:0").state == STARTING:
            child.exit(1)
        self._collect()

    @rule()
    def child_dies(self) -> None:
        child = self._live()
        if child is not None:
            child.exit(signal=signal.SIGKILL)
        self._collect()

    @rule(seconds=st.sampled_from([1, 5, 16]))
    def time_passes(self, seconds: int) -> None:
        self.h.reactor.advance(seconds)
        self._collect()

    # -- checks --------------------------------------------------------------------------

    def _ended(self, ctx: int) -> int:
        return sum(1 for p in self.h.reactor.processes if p.ended and ctx_of(p) == ctx)

    def _collect(self) -> None:
        for process in self.h.reactor.processes:  # a child the agent signalled ends, as a real one does
            if process.pid is not None:
                self.ctx_by_pid[process.pid] = ctx_of(process)  # gone once it ends
            if not process.ended and process.signals:
                process.exit(signal=process.signals[-1])
        still = []
        for came_after, seen, results in self.waiting:
            if not results:
                still.append((came_after, seen, results))
            elif isinstance(results[0], Lease):
                lease = results[0]
                served = self.ctx_by_pid[lease.endpoint.pid]
                assert served in seen, (served, seen, self.ctx)
                self.leases.append((served, lease))
            else:
                error = getattr(results[0], "value", None)
                code = getattr(error, "code", None)
                if came_after == self.generation and code == "model_load_failed":
                    # A refusal of the current command follows a child of it that ended (a failed
                    # load, a crash, a timeout) since it became current, never an old command's.
                    assert self._ended(self.ctx) > self.ended_when_current, (
                        "refused for another command's failure", error)
        self.waiting = still

    @invariant()
    def stale_says_which_command_runs(self) -> None:
        supervisor = self.h.sup("gpu:0")
        (device,) = self.h.node.inventory()["devices"]
        runs_old = (supervisor.state in (STARTING, READY) and supervisor.model is not None
                    and supervisor.model.ctx_size != self.ctx)
        assert device["stale"] == runs_old, (device["stale"], supervisor.state, supervisor.model, self.ctx)

    def teardown(self) -> None:
        """Drain: release everything and let loads finish; a request then gets the current command."""
        for _, lease in self.leases:
            lease.release()
        self.leases = []
        self.h.answer("p")  # the loads under way finish
        self._collect()
        self.h.reactor.advance(700)  # past any back-off
        self._collect()
        results: List[Any] = []
        self.h.node.acquire(self.h.node.config.model("p")).addBoth(results.append)
        for _ in range(3):
            self.h.answer("p")
            self._collect()
        if results and isinstance(results[0], Lease):
            assert self.ctx_by_pid[results[0].endpoint.pid] == self.ctx, (results[0].endpoint.pid, self.ctx)
            results[0].release()


class ReloadMachineTest(SynchronousTestCase):
    def test_a_reload_is_a_clean_cut_over(self) -> None:
        run_state_machine_as_test(ReloadMachine, settings=settings(max_examples=150, stateful_step_count=30))
