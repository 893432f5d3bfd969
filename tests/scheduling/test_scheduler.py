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

from rolemesh.scheduling.books import CANCELLED, DONE, QUEUED, RUNNING, QueueFull
from rolemesh.scheduling.scheduler import Scheduler


class Recorder:
    def __init__(self):
        self.started = []

    def __call__(self, ticket):
        self.started.append(ticket)


def make(devices=("d0",), limit=2, bound=4, groups=None):
    recorder = Recorder()
    return Scheduler(list(devices), limit, recorder, bound, groups=groups), recorder


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


class MemoryTests(SynchronousTestCase):
    def test_prefers_a_device_whose_free_memory_holds_the_need(self):
        s, _ = make(devices=("d0", "d1"), limit=3)
        s.set_free_memory("d0", 8 << 30)
        s.set_free_memory("d1", 4 << 30)
        t = s.submit("a", need={"d0": 10 << 30, "d1": 3 << 30})
        self.assertEqual(t.device, "d1", "d0 has more free memory but not enough; d1 fits")

    def test_memory_the_replaced_model_holds_counts_as_free(self):
        s, _ = make(devices=("d0", "d1"), limit=3)
        t = s.submit("x", need={"d0": 6 << 30, "d1": 6 << 30})
        self.assertEqual(t.device, "d0")
        s.finish(t)
        s.set_free_memory("d0", 1 << 30)  # x holds the rest
        s.set_free_memory("d1", 4 << 30)
        s.model_loaded("d1", "y")
        t2 = s.submit("a", need={"d0": 5 << 30, "d1": 5 << 30})
        self.assertEqual(t2.device, "d0", "1 GiB free + 6 GiB x holds covers 5 GiB; d1 cannot")

    def test_when_nothing_fits_now_the_normal_rules_apply(self):
        s, _ = make(devices=("d0", "d1"), limit=3)
        s.set_free_memory("d0", 1 << 30)
        s.set_free_memory("d1", 2 << 30)
        self.assertEqual(s.submit("a", need={"d0": 5 << 30, "d1": 5 << 30}).device, "d1")


class GroupTests(SynchronousTestCase):
    """A model on the group g = d0+d1: one lane that occupies both devices."""

    def make(self, limit=3, bound=4):
        return make(devices=("d0", "d1", "d2"), limit=limit, bound=bound, groups={"g": ("d0", "d1")})

    def test_unknown_member_is_refused(self):
        self.assertRaises(ValueError, make, devices=("d0",), groups={"g": ("d0", "d9")})

    def test_group_models_only_go_to_the_group_and_others_never_do(self):
        s, _ = self.make()
        t = s.submit("G", lanes=["g"])
        self.assertEqual((t.device, t.state, t.evict), ("g", RUNNING, []))
        self.assertNotEqual(s.submit("a").device, "g")

    def test_group_waits_for_a_busy_member_then_evicts_it(self):
        s, r = self.make()
        ta = s.submit("a", device="d1")
        tg = s.submit("G", lanes=["g"])
        self.assertEqual(tg.state, QUEUED, "a member is busy with another model")
        s.finish(ta)
        self.assertEqual(tg.state, RUNNING)
        self.assertTrue(tg.switched)
        self.assertEqual(tg.evict, ["d1"], "d1's child must stop before the group's starts")
        self.assertIsNone(s.devices["d1"].model)

    def test_member_request_waits_for_the_groups_in_flight_request_then_switches(self):
        s, _ = self.make()
        tg = s.submit("G", lanes=["g"])
        tb = s.submit("b", device="d1")
        self.assertEqual(tb.state, QUEUED)
        s.finish(tg)
        self.assertEqual(tb.state, RUNNING)
        self.assertEqual(tb.evict, ["g"])
        self.assertIsNone(s.devices["g"].model)
        # The other member is free again too.
        self.assertEqual(s.submit("c", device="d0").state, RUNNING)

    def test_an_unrelated_device_is_not_held_up(self):
        s, _ = self.make()
        s.submit("G", lanes=["g"])
        self.assertEqual(s.submit("c", device="d2").state, RUNNING)

    def test_a_busy_group_is_not_starved_out_by_its_members_nor_they_by_it(self):
        s, _ = self.make(limit=10, bound=2)
        tg = s.submit("G", lanes=["g"])
        tb = s.submit("b", device="d1")
        more = [s.submit("G", lanes=["g"]) for _ in range(3)]
        s.finish(tg)
        self.assertEqual(more[0].state, RUNNING, "the group's own requests may go first, a bounded number of times")
        self.assertEqual(tb.overtaken, 1)
        s.finish(more[0])
        self.assertEqual(more[1].state, RUNNING)
        self.assertEqual(tb.overtaken, 2)
        s.finish(more[1])
        self.assertEqual((tb.state, more[2].state), (RUNNING, QUEUED), "b's claim: the group waits for it")
        s.finish(tb)
        self.assertEqual(more[2].state, RUNNING)
        self.assertEqual(more[2].evict, ["d1"])

    def test_a_member_model_loaded_under_the_group_is_ignored(self):
        s, _ = self.make()
        s.submit("G", lanes=["g"])
        s.model_loaded("d0", "a")
        self.assertIsNone(s.devices["d0"].model)

    def test_unload_of_a_member_evicts_the_group(self):
        s, _ = self.make()
        tg = s.submit("G", lanes=["g"])
        s.finish(tg)
        tu = s.submit("", device="d0")
        self.assertEqual((tu.state, tu.evict), (RUNNING, ["g"]))


class TicketRules:
    """Rules both machines share: a running request completes, a live one is
    cancelled (the machine holds ``scheduler`` and ``tickets``)."""

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


class SchedulerMachine(TicketRules, RuleBasedStateMachine):
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

    #: Each model's replica cap (None: spreads only when its queues are full).
    replicas = {"a": None, "b": 1, "c": 2}

    @rule(model=st.sampled_from(["a", "b", "c"]), parallel=st.sampled_from([1, 1, 2]),
          need=st.sampled_from([None, 1 << 30, 3 << 30, 6 << 30]))
    def arrive(self, model, parallel, need):
        books = list(self.scheduler.devices.values())
        cap = self.replicas[model]
        holding = [b for b in books if b.model == model and b.pending < self.limit]
        needs = None if need is None else {b.name: need for b in books}
        fitting = [b.name for b in books if b.pending < self.limit and self.scheduler.lanes.fits(b, need)]
        claimed = [b for b in books if b.model == model or any(t.model_id == model for t in b.queue)]
        spare = [b.name for b in books if b.model is None and not b.running and not b.queue
                 and self.scheduler.lanes.fits(b, need)]
        # Whether the holder it would take has no free slot (seen before the submit).
        best = min(holding, key=lambda b: (b.pending, b.order)) if holding else None
        waits = best is not None and best.pending >= best.slots
        try:
            ticket = self.scheduler.submit(model, parallel, need=needs, replicas=cap)
        except QueueFull:
            full = all(b.pending >= self.limit for b in books)
            capped = cap is not None and not holding and len(claimed) >= cap and all(
                b.pending >= self.limit for b in claimed)
            assert full or capped, "429 only when every lane the model may use is full"
            self.rejected += 1
            return
        if holding:
            if cap is not None and waits and len(claimed) < cap and spare:
                assert ticket.device in spare, "a model under its replica cap scales out rather than wait"
            else:
                assert ticket.device in [b.name for b in holding], \
                    "a device holding the model with room must be preferred"
        elif cap is not None and len(claimed) >= cap:
            assert ticket.device in [b.name for b in claimed], "a model at its replica cap takes no new device"
        elif fitting:
            assert ticket.device in fitting, "a device whose free memory holds the model must be preferred"
        self.tickets.append(ticket)

    @rule(device=st.sampled_from(["d0", "d1"]), free=st.sampled_from([None, 0, 2 << 30, 8 << 30]))
    def memory_sampled(self, device, free):
        self.scheduler.set_free_memory(device, free)

    @rule(device=st.sampled_from(["d0", "d1"]), model=st.sampled_from(["a", "b", "c"]),
          slots=st.sampled_from([1, 2, 3]))
    def load_finished(self, device, model, slots):
        """A child reports a model loaded -- possibly not the one the book
        holds (a reload under requests after a crash), with its slot count:
        the book changes and queued work may start."""
        book = self.scheduler.devices[device]
        before = (book.model, book.slots)
        running = [t.model_id for t in book.running]
        self.scheduler.model_loaded(device, model, slots)
        if before[0] != model and running and all(m == model for m in running):
            # Requests of that model run here: nothing may switch it away now.
            # (Its slot count may be reset by a ticket that starts with its own.)
            assert book.model == model, "the load changed what the device holds"

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


LANE_MODELS = {"G": ["g"], "H": ["h"]}


class GroupSchedulerMachine(TicketRules, RuleBasedStateMachine):
    """Devices d0, d1, d2; group g = d0+d1 serves G, group h = d1+d2 serves H;
    a, b, c go anywhere single or pinned.  Random arrivals, completions,
    cancels, loads and crashes; then everything drains."""

    DEVICES = ("d0", "d1", "d2")

    def __init__(self):
        super().__init__()
        self.limit = 3
        self.bound = 2
        self.scheduler = Scheduler(list(self.DEVICES), self.limit, self.on_start, self.bound,
                                   groups={"g": ("d0", "d1"), "h": ("d1", "d2")})
        self.tickets = []

    def lanes_covering(self, device):
        return [b for b in self.scheduler.devices.values() if device in b.members]

    def on_start(self, ticket):
        book = self.scheduler.devices[ticket.device]
        for other in self.scheduler.overlaps[book.name]:
            assert not other.running, f"{book.name} started while {other.name} runs requests on a shared device"
            assert other.model is None, f"{book.name} started while {other.name} still holds {other.model}"
        others = [t for t in book.running if t is not ticket]
        if ticket.switched:
            assert not others, "switched a lane with requests in flight"
        assert all(t.model_id == ticket.model_id for t in others), "two models running on one lane"

    @rule(model=st.sampled_from(["a", "b", "c", "G", "H"]), pin=st.sampled_from([None, None, "d0", "d1", "d2"]),
          parallel=st.sampled_from([1, 1, 2]))
    def arrive(self, model, pin, parallel):
        lanes = LANE_MODELS.get(model)
        if lanes is not None:
            pin = None
        try:
            ticket = self.scheduler.submit(model, parallel, device=pin, lanes=lanes)
        except QueueFull:
            return
        if lanes is not None:
            assert ticket.device in lanes
        else:
            assert not self.scheduler.devices[ticket.device].is_group
        self.tickets.append(ticket)

    @rule(lane=st.sampled_from(["d0", "d1", "d2", "g", "h"]), model=st.sampled_from([None, "a", "G"]))
    def load_reported(self, lane, model):
        book = self.scheduler.devices[lane]
        self.scheduler.model_loaded(lane, model or book.model or "a")

    @rule(lane=st.sampled_from(["d0", "d1", "d2", "g", "h"]))
    def crash(self, lane):
        book = self.scheduler.devices[lane]
        if book.model is not None:
            self.scheduler.model_unloaded(lane, book.model)

    @invariant()
    def no_device_serves_two_children(self):
        for device in self.DEVICES:
            holders = [b.name for b in self.lanes_covering(device) if b.occupied]
            assert len(holders) <= 1, f"{device} is held by {holders}"

    @invariant()
    def bounded(self):
        for book in self.scheduler.devices.values():
            assert book.pending <= self.limit
        for t in self.tickets:
            assert t.overtaken <= self.bound

    @invariant()
    def a_waiting_lane_waits_for_running_requests(self):
        books = self.scheduler.devices
        for book in books.values():
            if not book.queue or book.running:
                continue
            # Something it shares devices with (directly or through a chain) is running.
            seen, todo = {book.name}, [book.name]
            while todo:
                for other in self.scheduler.overlaps[todo.pop()]:
                    if other.name not in seen:
                        seen.add(other.name)
                        todo.append(other.name)
            assert any(books[n].running for n in seen), f"{book.name} has a queue but nothing will wake it"

    def teardown(self):
        # Nothing starves: finishing whatever runs, oldest first, serves every
        # queued ticket in a bounded number of steps.
        for _ in range(10 * len(self.tickets) + 10):
            running = [t for t in self.tickets if t.state == RUNNING]
            if not running:
                break
            self.scheduler.finish(min(running, key=lambda t: t.id))
        stuck = [(t.id, t.model_id, t.device) for t in self.tickets if t.state in (QUEUED, RUNNING)]
        assert not stuck, f"starved: {stuck}"


class GroupSchedulerMachineTest(SynchronousTestCase):
    def test_groups_and_devices_under_random_event_sequences(self):
        run_state_machine_as_test(GroupSchedulerMachine,
                                  settings=settings(max_examples=300, stateful_step_count=40))


class AdmitTests(SynchronousTestCase):
    def test_a_ready_lane_with_a_free_slot_admits_at_once(self):
        s, started = make(limit=3)
        s.model_loaded("d0", "a", slots=2)
        first = s.admit("a", 2)
        second = s.admit("a", 2)
        self.assertEqual([first.state, second.state], [RUNNING, RUNNING])
        self.assertEqual(s.devices["d0"].running, [first, second])
        self.assertEqual(started.started, [], "on_start is the caller's to do")
        self.assertIsNone(s.admit("a", 2), "no free slot: it would queue")
        s.finish(first)
        self.assertEqual(s.devices["d0"].running, [second])

    def test_what_would_wait_or_switch_is_left_to_submit(self):
        s, _ = make(limit=3)
        self.assertIsNone(s.admit("a"), "no model loaded: a load")
        s.model_loaded("d0", "a")
        self.assertIsNone(s.admit("b"), "another model: a switch")
        self.assertIsNone(s.admit("a", ready=lambda lane: False), "the child does not answer yet")
        held = s.submit("a")
        queued = s.submit("a")
        self.assertEqual(queued.state, QUEUED)
        s.finish(held)  # the queued one starts
        self.assertIsNone(s.admit("a"), "its slot is taken")
        self.assertEqual([t.id for t in s.devices["d0"].running], [queued.id])

    def test_a_full_device_admits_nothing(self):
        s, _ = make(limit=1)
        s.model_loaded("d0", "a", slots=4)
        self.assertIsNotNone(s.admit("a", 4))
        self.assertIsNone(s.admit("a", 4))

    def test_lanes_that_share_devices_always_go_through_submit(self):
        s, _ = make(devices=("d0", "d1"), limit=3, groups={"g": ("d0", "d1")})
        s.model_loaded("d0", "a")
        self.assertIsNone(s.admit("a", lanes=["d0"]))
        self.assertEqual(s.devices["d0"].pending, 0)


class AdmitMachine(RuleBasedStateMachine):
    """``admit`` is ``submit`` without the queue: a scheduler that tries
    ``admit`` first and one that only submits, given the same events, keep
    the same books, start the same tickets on the same lanes and refuse the
    same ones (lanes that share a device included: admit leaves them to
    submit)."""

    def __init__(self):
        super().__init__()
        groups = {"g": ("d0", "d1")}
        self.scheduler = Scheduler(["d0", "d1", "d2"], 3, lambda t: None, 2, groups=groups)
        self.plain = Scheduler(["d0", "d1", "d2"], 3, lambda t: None, 2, groups=groups)
        self.tickets = []  # the admitting scheduler's (TicketRules finishes and cancels these)
        self.twins = {}  # ticket id -> the plain scheduler's ticket

    #: Tickets admitted, over all examples (the test checks admit was exercised).
    admitted = 0

    def _twin(self, ticket):
        return self.twins[ticket.id]

    @rule(model=st.sampled_from(["a", "b", "G"]), parallel=st.sampled_from([1, 2, 2]),
          ready=st.sampled_from([True, True, False]))
    def arrive(self, model, parallel, ready):
        lanes = ["g"] if model == "G" else None
        ticket = self.scheduler.admit(model, parallel, lanes, ready=lambda lane: ready)
        if ticket is not None:
            AdmitMachine.admitted += 1
        else:
            try:
                ticket = self.scheduler.submit(model, parallel, lanes=lanes)
            except QueueFull:
                ticket = None
        try:
            twin = self.plain.submit(model, parallel, lanes=lanes)
        except QueueFull:
            twin = None
        assert (ticket is None) == (twin is None), "one refused what the other took"
        if ticket is not None:
            assert (ticket.id, ticket.device, ticket.state) == (twin.id, twin.device, twin.state)
            self.tickets.append(ticket)
            self.twins[ticket.id] = twin

    @rule(lane=st.sampled_from(["d0", "d1", "d2", "g"]), model=st.sampled_from(["a", "b", "G"]),
          slots=st.sampled_from([1, 2]))
    def loaded(self, lane, model, slots):
        for s in (self.scheduler, self.plain):
            s.model_loaded(lane, model, slots)

    @rule(lane=st.sampled_from(["d0", "d1", "d2", "g"]))
    def crash(self, lane):
        model = self.scheduler.devices[lane].model
        if model is not None:
            for s in (self.scheduler, self.plain):
                s.model_unloaded(lane, model)

    @precondition(lambda self: any(t.state == RUNNING for t in self.tickets))
    @rule(data=st.data())
    def complete(self, data):  # both schedulers, the same ticket
        ticket = data.draw(st.sampled_from([t for t in self.tickets if t.state == RUNNING]))
        self.scheduler.finish(ticket)
        self.plain.finish(self._twin(ticket))

    @precondition(lambda self: any(t.state in (QUEUED, RUNNING) for t in self.tickets))
    @rule(data=st.data())
    def cancel(self, data):
        ticket = data.draw(st.sampled_from([t for t in self.tickets if t.state in (QUEUED, RUNNING)]))
        self.scheduler.cancel(ticket)
        self.plain.cancel(self._twin(ticket))

    @invariant()
    def same_books(self):
        def books(s):
            return {name: (b.model, b.slots, b.held, [t.id for t in b.running], [t.id for t in b.queue])
                    for name, b in s.devices.items()}
        assert books(self.scheduler) == books(self.plain)
        for ticket in self.tickets:
            assert ticket.state == self._twin(ticket).state


class AdmitMachineTest(SynchronousTestCase):
    def test_admit_keeps_the_books_submit_keeps(self):
        AdmitMachine.admitted = 0
        run_state_machine_as_test(AdmitMachine, settings=settings(max_examples=200, stateful_step_count=40))
        self.assertGreater(AdmitMachine.admitted, 50)


class ReplicaTests(SynchronousTestCase):
    """``replicas``: a model scales out on purpose, and no further than its cap."""

    def make(self, devices=("d0", "d1", "d2"), limit=4):
        started = []
        return Scheduler(list(devices), limit, started.append), started

    def test_without_a_cap_a_model_waits_on_its_device_until_the_queue_is_full(self):
        s, _ = self.make()
        first = s.submit("a")
        second = s.submit("a")
        self.assertEqual((first.device, second.device, second.state), ("d0", "d0", QUEUED))

    def test_under_its_cap_a_request_that_would_wait_starts_a_copy_on_an_idle_device(self):
        s, _ = self.make()
        first = s.submit("a", replicas=2)
        second = s.submit("a", replicas=2)
        self.assertEqual((first.device, second.device), ("d0", "d1"))
        self.assertEqual((second.state, second.switched), (RUNNING, True))
        third = s.submit("a", replicas=2)
        self.assertIn(third.device, ("d0", "d1"), "at its cap: it queues on a copy")
        self.assertEqual(third.state, QUEUED)
        self.assertIsNone(s.devices["d2"].model)

    def test_a_copy_goes_only_where_nothing_is_held(self):
        s, _ = self.make(devices=("d0", "d1"))
        s.submit("a", replicas=2)
        s.finish(s.submit("b", device="d1"))  # d1 holds b, idle
        second = s.submit("a", replicas=2)
        self.assertEqual((second.device, second.state), ("d0", QUEUED), "b keeps its device")

    def test_a_free_slot_is_used_before_a_copy(self):
        s, _ = self.make()
        s.submit("a", parallel=2, replicas=3)
        second = s.submit("a", parallel=2, replicas=3)
        self.assertEqual((second.device, second.state), ("d0", RUNNING))

    def test_at_its_cap_with_full_queues_the_request_is_refused(self):
        s, _ = self.make(limit=2)
        s.submit("a", replicas=1)
        s.submit("a", replicas=1)
        with self.assertRaises(QueueFull):
            s.submit("a", replicas=1)
        self.assertEqual([b.pending for b in s.devices.values()], [2, 0, 0])

    def test_a_queued_switch_counts_as_a_replica(self):
        s, _ = self.make(devices=("d0", "d1"))
        s.submit("b", device="d0")
        s.submit("c", device="d1")
        waiting = s.submit("a", replicas=1)  # queued for a switch
        again = s.submit("a", replicas=1)
        self.assertEqual(again.device, waiting.device, "the lane it waits on is its one replica")

    def test_an_operator_pin_is_not_capped(self):
        s, _ = self.make()
        s.submit("a", replicas=1)
        pinned = s.submit("a", device="d2", replicas=1)
        self.assertEqual((pinned.device, pinned.state), ("d2", RUNNING))
