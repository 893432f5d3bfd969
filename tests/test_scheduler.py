"""The scheduler's rules, by example and as a hypothesis state machine."""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)
from twisted.trial.unittest import SynchronousTestCase

from rolemesh.scheduler import CANCELLED, DONE, QUEUED, RUNNING, QueueFull, Scheduler


class Recorder:
    def __init__(self):
        self.started = []

    def __call__(self, ticket):
        self.started.append(ticket)


def make(devices=("d0",), limit=2, bound=4):
    recorder = Recorder()
    return Scheduler(list(devices), limit, recorder, bound), recorder


class ExampleTests(SynchronousTestCase):
    def test_serialized_per_device(self):
        s, r = make(limit=3)
        t1 = s.submit("a")
        t2 = s.submit("a")
        self.assertEqual((t1.state, t2.state), (RUNNING, QUEUED))
        s.finish(t1)
        self.assertEqual(t2.state, RUNNING)
        self.assertEqual(r.started, [t1, t2])

    def test_parallel_slots(self):
        s, r = make(limit=4)
        ts = [s.submit("a", parallel=2) for _ in range(3)]
        self.assertEqual([t.state for t in ts], [RUNNING, RUNNING, QUEUED])

    def test_queue_full(self):
        s, _ = make(limit=2)
        s.submit("a")
        s.submit("a")
        self.assertRaises(QueueFull, s.submit, "a")

    def test_prefers_device_holding_the_model_even_if_busy(self):
        s, _ = make(devices=("d0", "d1"), limit=3)
        ta = s.submit("a")
        tb = s.submit("b")
        self.assertEqual((ta.device, tb.device), ("d0", "d1"))
        again = s.submit("a")
        self.assertEqual(again.device, "d0", "waits where a is loaded instead of evicting b")
        self.assertEqual(again.state, QUEUED)

    def test_otherwise_least_pressure_then_empty_then_free_memory(self):
        s, _ = make(devices=("d0", "d1", "d2"), limit=3)
        s.model_loaded("d0", "x")
        s.set_free_memory("d1", 1 << 30)
        s.set_free_memory("d2", 4 << 30)
        t = s.submit("a")
        self.assertEqual(t.device, "d2")

    def test_no_switch_while_in_flight(self):
        s, r = make(limit=3)
        ta = s.submit("a")
        tb = s.submit("b")
        self.assertEqual(tb.state, QUEUED)
        s.finish(ta)
        self.assertEqual(tb.state, RUNNING)
        self.assertTrue(tb.switched)

    def test_unloaded_model_does_not_hold_back_a_switch(self):
        s, r = make(limit=3)
        ta = s.submit("a")
        tb = s.submit("b")
        ta2 = s.submit("a")
        s.model_unloaded("d0", "a")  # crashed: nothing to save by waiting
        s.finish(ta)
        self.assertEqual((tb.state, ta2.state), (RUNNING, QUEUED))

    def test_current_model_may_overtake_a_bounded_number_of_times(self):
        s, r = make(limit=10, bound=2)
        running = s.submit("a")
        waiting_b = s.submit("b")
        overtakers = [s.submit("a") for _ in range(4)]
        s.finish(running)
        self.assertEqual(overtakers[0].state, RUNNING)
        s.finish(overtakers[0])
        self.assertEqual(overtakers[1].state, RUNNING)
        s.finish(overtakers[1])
        self.assertEqual(waiting_b.state, RUNNING, "the bound is reached: b goes next")
        self.assertEqual(waiting_b.overtaken, 2)

    def test_cancel_queued_leaves_at_once(self):
        s, _ = make(limit=2)
        t1 = s.submit("a")
        t2 = s.submit("a")
        s.cancel(t2)
        self.assertEqual(t2.state, CANCELLED)
        self.assertEqual(s.devices["d0"].pending, 1)
        s.finish(t1)
        self.assertEqual(t2.state, CANCELLED)

    def test_cancel_running_frees_slot(self):
        s, _ = make(limit=2)
        t1 = s.submit("a")
        t2 = s.submit("a")
        s.cancel(t1)
        self.assertEqual((t1.state, t2.state), (DONE, RUNNING))

    def test_unloaded_model_is_no_longer_preferred(self):
        s, _ = make(devices=("d0", "d1"), limit=2)
        t = s.submit("a")
        s.finish(t)
        s.model_unloaded("d0", "a")
        s.model_loaded("d1", "a")
        self.assertEqual(s.submit("a").device, "d1")

    def test_unload_of_another_model_is_ignored(self):
        s, _ = make()
        s.submit("b")
        s.model_unloaded("d0", "a")  # the old child of a switch was reaped
        self.assertEqual(s.devices["d0"].model, "b")

    def test_pinned_device(self):
        s, _ = make(devices=("d0", "d1"), limit=2)
        self.assertEqual(s.submit("a", device="d1").device, "d1")
        s.submit("a", device="d1")
        self.assertRaises(QueueFull, s.submit, "a", device="d1")


class SchedulerMachine(RuleBasedStateMachine):
    """Random arrive / complete / cancel / load-finished / crash sequences."""

    def __init__(self):
        super().__init__()
        self.limit = 3
        self.bound = 2
        self.scheduler = Scheduler(["d0", "d1"], self.limit, self.on_start, self.bound)
        self.tickets = []
        self.rejected = 0
        self.outcomes = {}

    def on_start(self, ticket):
        book = self.scheduler.devices[ticket.device]
        others = [t for t in book.running if t is not ticket]
        if ticket.switched:
            assert not others, "switched a device with requests in flight"
        assert all(t.model_id == ticket.model_id for t in others), "two models running on one device"
        assert ticket.id not in self.outcomes
        self.outcomes[ticket.id] = "started"

    @rule(model=st.sampled_from(["a", "b", "c"]), parallel=st.sampled_from([1, 1, 2]))
    def arrive(self, model, parallel):
        holding = [b.name for b in self.scheduler.devices.values()
                   if b.model == model and b.pending < self.limit]
        try:
            ticket = self.scheduler.submit(model, parallel)
        except QueueFull:
            assert all(b.pending >= self.limit for b in self.scheduler.devices.values())
            self.rejected += 1
            return
        if holding:
            assert ticket.device in holding, "a device holding the model with room must be preferred"
        self.tickets.append(ticket)

    @precondition(lambda self: any(t.state == RUNNING for t in self.tickets))
    @rule(data=st.data())
    def complete(self, data):
        running = [t for t in self.tickets if t.state == RUNNING]
        self.scheduler.finish(data.draw(st.sampled_from(running)))

    @precondition(lambda self: any(t.state in (QUEUED, RUNNING) for t in self.tickets))
    @rule(data=st.data())
    def cancel(self, data):
        live = [t for t in self.tickets if t.state in (QUEUED, RUNNING)]
        self.scheduler.cancel(data.draw(st.sampled_from(live)))

    @rule(device=st.sampled_from(["d0", "d1"]))
    def load_finished(self, device):
        book = self.scheduler.devices[device]
        if book.model is not None:
            self.scheduler.model_loaded(device, book.model)

    @rule(device=st.sampled_from(["d0", "d1"]))
    def crash(self, device):
        book = self.scheduler.devices[device]
        if book.model is not None:
            self.scheduler.model_unloaded(device, book.model)

    @invariant()
    def pending_bounded(self):
        for book in self.scheduler.devices.values():
            assert book.pending <= self.limit

    @invariant()
    def starvation_bounded(self):
        for t in self.tickets:
            assert t.overtaken <= self.bound

    @invariant()
    def each_ticket_in_exactly_one_place(self):
        for t in self.tickets:
            book = self.scheduler.devices[t.device]
            places = (t in book.running) + (t in book.queue)
            assert places == (1 if t.state in (QUEUED, RUNNING) else 0)
            if t.state in (RUNNING, DONE):
                assert self.outcomes.get(t.id) == "started"

    @invariant()
    def no_idle_device_with_a_queue(self):
        for book in self.scheduler.devices.values():
            if book.queue:
                assert book.running, "a queued request on an idle device would wait forever"


class SchedulerMachineTest(SynchronousTestCase):
    def test_rules_hold_under_random_event_sequences(self):
        run_state_machine_as_test(SchedulerMachine, settings=settings(max_examples=300, stateful_step_count=40))
