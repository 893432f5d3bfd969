"""Fair shares, priority bands and prefix affinity in the scheduler: the pure
tag order, examples, and a hypothesis state machine that checks the new rules
against a model of them while the old ones (no switch under requests in
flight, bounded overtaking) still hold."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test
from twisted.trial.unittest import SynchronousTestCase

from rolemesh.scheduling.books import DONE, QUEUED, RUNNING, QueueFull
from rolemesh.scheduling.fairqueue import BATCH, INTERACTIVE, FairOrder, Share
from rolemesh.scheduling.scheduler import Scheduler
from tests.scheduling.test_scheduler import TicketRules


def loaded(limit=64, bound=4, devices=("d0",), slots=1):
    started = []
    s = Scheduler(list(devices), limit, started.append, bound)
    for d in devices:
        s.model_loaded(d, "a", slots)
    return s, started


def drain(s, started, device="d0"):
    """Finish running tickets one at a time until the lane is idle; the start order."""
    order = []
    book = s.devices[device]
    while book.running:
        ticket = book.running[0]
        s.finish(ticket)
        order.extend(t for t in started if t not in order and t.device == device and t.state == RUNNING)
    return order


class FairOrderTests(SynchronousTestCase):
    def test_a_newcomer_goes_before_a_flood(self):
        order = FairOrder()
        flood = [order.tag(Share("A")) for _ in range(8)]
        late = order.tag(Share("B"))
        self.assertEqual(late, flood[0], "tagged 'now', level with the flood's first")
        self.assertLess(late, flood[1])

    def test_bands_come_first(self):
        order = FairOrder()
        batch = order.tag(Share("A", BATCH))
        interactive = order.tag(Share("A", INTERACTIVE, weight=0.01))
        self.assertLess(interactive, batch)

    def test_weights_space_the_tags(self):
        order = FairOrder()
        heavy = [order.tag(Share("H", weight=4))[1] for _ in range(4)]
        light = [order.tag(Share("L"))[1] for _ in range(2)]
        self.assertEqual(heavy, [0.0, 0.25, 0.5, 0.75])
        self.assertEqual(light, [0.0, 1.0])

    def test_an_idle_tenant_does_not_bank_credit(self):
        order = FairOrder()
        for _ in range(5):
            key = order.tag(Share("A"))
            order.started(key, "A")
        self.assertEqual(order.tag(Share("B")), key, "B starts from now, not from 0")

    def test_old_tenants_are_pruned(self):
        order = FairOrder()
        for i in range(FairOrder.PRUNE_AT * 2):
            order.started(order.tag(Share(f"t{i}")), f"t{i}")
        self.assertLessEqual(len(order), FairOrder.PRUNE_AT)

    def test_a_tenant_with_tickets_queued_is_never_pruned(self):
        order = FairOrder()
        flood = [order.tag(Share("A"), seq) for seq in range(1, 9)]
        order.started(flood[0], "A")
        for i in range(FairOrder.PRUNE_AT * 2):  # a flood of distinct tenant names
            order.started(order.tag(Share(f"t{i}"), 100 + i), f"t{i}")
        self.assertEqual(order.tag(Share("A"), 999)[1], flood[-1][1] + 1, "A's place is kept")

    def test_a_withdrawn_ticket_gives_its_charge_back(self):
        order = FairOrder()
        tickets = [order.tag(Share("A", weight=2)) for _ in range(3)]
        self.assertEqual(order.withdrawn(tickets[2], Share("A", weight=2)), 0.5)
        self.assertEqual(order.tag(Share("A", weight=2))[1], tickets[2][1], "the next takes the place it left")

    def test_forget_starts_everyone_at_now(self):
        order = FairOrder()
        for _ in range(5):
            order.started(order.tag(Share("B")), "B")
        now = order.tag(Share("C"))[1]
        order.forget()
        self.assertEqual(order.tag(Share("B"))[1], now)


class FairQueueTests(SynchronousTestCase):
    def test_a_second_tenant_is_not_stuck_behind_a_flood(self):
        s, started = loaded()
        flood = [s.submit("a", share=Share("A")) for _ in range(10)]
        late = s.submit("a", share=Share("B"))
        order = drain(s, started)
        self.assertEqual(order[:2], [late, flood[1]], "B's one request runs next, not after the 9 queued")

    def test_a_tenant_that_used_the_idle_device_is_next_after_a_flood(self):
        """Issue 38's case: B alone on the device (through admit and submit),
        then A queues eight, then B sends one: B is served second, not fourth."""
        s, started = loaded()
        s.finish(s.admit("a", share=Share("B")))
        s.finish(s.submit("a", share=Share("B")))
        flood = [s.submit("a", share=Share("A")) for _ in range(8)]
        back = s.submit("a", share=Share("B"))
        self.assertEqual(drain(s, started)[:2], [back, flood[1]])

    def test_a_tenant_never_seen_is_next_after_a_flood_begun_on_an_idle_device(self):
        s, started = loaded()
        first = s.admit("a", share=Share("A"))  # straight to the idle device: tagged, and time moves
        flood = [s.submit("a", share=Share("A")) for _ in range(7)]
        new = s.submit("a", share=Share("C"))
        s.finish(first)
        self.assertEqual([t for t in started if t.state == RUNNING], [new], "C runs next")
        self.assertEqual(drain(s, started), flood, "then A's, in order")

    def test_a_tenant_whose_request_runs_as_a_flood_begins_waits_for_one_of_it(self):
        s, started = loaded()
        running = s.submit("a", share=Share("B"))
        flood = [s.submit("a", share=Share("A")) for _ in range(8)]
        back = s.submit("a", share=Share("B"))
        s.finish(running)
        self.assertEqual([t for t in started if t.state == RUNNING], [flood[0]])
        self.assertEqual(drain(s, started)[:2], [back, flood[1]], "B after one of A's")

    def test_cancelled_requests_are_not_charged(self):
        """20 of A's requests abandoned in the queue (499s, queue timeouts)
        leave A's next one where it would have been without them."""
        s, started = loaded()
        s.submit("a", share=Share("B"))  # running
        b = [s.submit("a", share=Share("B")) for _ in range(10)]
        for ticket in [s.submit("a", share=Share("A")) for _ in range(20)]:
            s.cancel(ticket)
        a = s.submit("a", share=Share("A"))
        self.assertEqual(drain(s, started)[:2], [a, b[0]], "first, as without them")

    def test_a_cancelled_ticket_moves_its_tenants_later_ones_up(self):
        s, started = loaded()
        s.submit("a", share=Share("A"))  # running
        a = [s.submit("a", share=Share("A")) for _ in range(4)]
        b = [s.submit("a", share=Share("B")) for _ in range(4)]
        s.cancel(a[1])
        self.assertEqual(drain(s, started), [b[0], a[0], b[1], a[2], b[2], a[3], b[3]])

    def test_many_tenant_names_undo_no_ones_place(self):
        s, started = loaded(limit=1000)
        s.submit("a", share=Share("A"))  # running
        flood = [s.submit("a", share=Share("A")) for _ in range(8)]
        for i in range(300):  # distinct names, two waiting each: 300 tenants ahead of the virtual time
            s.submit("a", share=Share(f"t{i}"))
            s.submit("a", share=Share(f"t{i}"))
        later = s.submit("a", share=Share("A"))
        order = drain(s, started)
        self.assertEqual([t for t in order if t.share.tenant == "A"], flood + [later])
        self.assertEqual(order[-1], later, "A's next one still after A's flood and everyone's turns")

    def test_without_tenants_it_is_first_come_first_served(self):
        s, started = loaded()
        tickets = [s.submit("a") for _ in range(6)]
        self.assertEqual(drain(s, started), tickets[1:])

    def test_interactive_before_batch(self):
        s, started = loaded()
        s.submit("a", share=Share("A", BATCH))  # runs
        batch = [s.submit("a", share=Share("A", BATCH)) for _ in range(3)]
        interactive = [s.submit("a", share=Share("B")) for _ in range(2)]
        self.assertEqual(drain(s, started), interactive + batch)

    def test_a_request_overtaken_enough_is_not_pushed_back_any_more(self):
        """A batch request waiting for a switch, overtaken the bound's times,
        is not pushed back by interactive requests either (strict bands would
        starve it)."""
        s, started = loaded(bound=2)
        running = s.submit("a", share=Share("A", BATCH))
        switch = s.submit("b", share=Share("A", BATCH), device="d0")
        ahead = [s.submit("a", share=Share("A", BATCH)) for _ in range(2)]  # overtake the switch twice
        s.finish(running)
        s.finish(ahead[0])
        self.assertEqual(switch.overtaken, 2)
        newcomers = [s.submit("a", share=Share("B")) for _ in range(2)]  # interactive: before batch, but not this
        self.assertEqual(list(s.devices["d0"].queue), [switch] + newcomers)
        s.finish(ahead[1])
        self.assertEqual(switch.state, RUNNING, "the switch runs next, as the bound promises")

    @given(st.integers(1, 4), st.integers(1, 4), st.integers(1, 12), st.integers(1, 12))
    def test_backlogged_tenants_share_by_weight(self, wx, wy, nx, ny):
        """Start-time fair queueing's bound: while both have requests queued,
        the starts of X and Y, each divided by its weight, differ by at most
        one request of each."""
        s, started = loaded()
        s.submit("a")  # occupies the slot
        x = {s.submit("a", share=Share("X", weight=wx)).id for _ in range(nx)}
        y = {s.submit("a", share=Share("Y", weight=wy)).id for _ in range(ny)}
        order = drain(s, started)
        sx = sy = 0
        for ticket in order:
            if sx == nx or sy == ny:
                break
            sx += ticket.id in x
            sy += ticket.id in y
            self.assertLessEqual(abs(sx / wx - sy / wy), 1 / wx + 1 / wy, (sx, sy))

    def test_tenant_counts(self):
        s, _ = loaded(limit=5)
        a = [s.submit("a", share=Share("A")) for _ in range(3)]
        self.assertEqual(s.tenant_pending, {"A": 3})
        s.cancel(a[2])
        s.finish(a[0])
        self.assertEqual(s.tenant_pending, {"A": 1})
        s.finish(a[1])
        self.assertEqual(s.tenant_pending, {})
        admitted = s.admit("a", share=Share("B"))
        self.assertEqual(s.tenant_pending, {"B": 1})
        s.finish(admitted)
        s.finish(admitted)  # twice: counted once
        self.assertEqual(s.tenant_pending, {})


class ReturningTenantTests(SynchronousTestCase):
    @given(st.lists(st.tuples(st.sampled_from(["submit", "submit", "finish", "cancel"]),
                              st.sampled_from(["A", "B", "C"]), st.integers(0, 63)), max_size=40),
           st.integers(2, 10), st.booleans())
    def test_a_tenant_that_comes_back_waits_one_turn_of_the_round(self, history, flood, third):
        """Any history (requests, completions, cancels), then A floods, then
        B -- with nothing queued or running -- sends one.  Of A and B alone:
        before B's starts, at most one more of A's does.  With a third tenant
        C: at most the rest of the round under way and one turn of the next,
        two of each."""
        if not third:
            history = [step for step in history if step[1] != "C"]
        s, started = loaded(limit=1000)
        live = []
        for op, tenant, pick in history:
            if op == "submit":
                live.append(s.submit("a", share=Share(tenant)))
            elif live:
                ticket = live[pick % len(live)]
                (s.finish if op == "finish" else s.cancel)(ticket)
            live = [t for t in live if t.state in (QUEUED, RUNNING)]
        for ticket in live:
            if ticket.share.tenant == "B":
                s.cancel(ticket)
        for _ in range(flood):
            s.submit("a", share=Share("A"))
        back = s.submit("a", share=Share("B"))
        order = drain(s, started)
        if back not in order:
            self.assertEqual(back.state, DONE, "it started at once")
            return
        ahead = order[:order.index(back)]
        for tenant in ("A", "C"):
            self.assertLessEqual(sum(t.share.tenant == tenant for t in ahead), 2 if third else 1, (tenant, ahead))


class AffinityTests(SynchronousTestCase):
    def test_the_preferred_lane_unless_clearly_busier(self):
        s, _ = loaded(devices=("d0", "d1"))
        s.submit("a")
        self.assertEqual(s.submit("a", prefer="d0", max_imbalance=1).device, "d0", "busier by one: allowed")
        self.assertEqual(s.submit("a", prefer="d0", max_imbalance=1).device, "d1", "busier by two: not")
        self.assertEqual(s.submit("a").device, "d1", "no preference: the least busy")

    def test_only_among_lanes_holding_the_model(self):
        s, _ = loaded(devices=("d0", "d1"))
        s.model_unloaded("d1", "a")
        self.assertEqual(s.admit("a", prefer="d1", max_imbalance=5).device, "d0")
        self.assertEqual(s.submit("a", prefer="d1", max_imbalance=5).device, "d0")

    def test_admit_follows_the_preference(self):
        s, _ = loaded(devices=("d0", "d1"), slots=3)
        self.assertEqual(s.admit("a", 3, prefer="d1").device, "d1")
        self.assertEqual(s.admit("a", 3, prefer="d1", max_imbalance=1).device, "d1")
        self.assertEqual(s.admit("a", 3, prefer="d1", max_imbalance=1).device, "d0", "two more than d0: not")


TENANTS = {"X": 1.0, "Y": 2.0, "Z": 1.0}


class FairSchedulerMachine(TicketRules, RuleBasedStateMachine):
    """Random arrivals of tenants X, Y (weight 2), Z in both bands, with
    affinity preferences, switches, completions, cancels and crashes.  A model
    of the rules -- each lane's tags, the affinity choice, the insertion place
    -- is kept here and compared; the scheduler's old rules are checked as in
    SchedulerMachine."""

    def __init__(self):
        super().__init__()
        self.limit, self.bound, self.imbalance = 4, 1, 1
        self.scheduler = Scheduler(["d0", "d1"], self.limit, self.on_start, self.bound)
        self.tickets = []
        #: The model of each lane's tags: band -> virtual time, (band, tenant) -> last finish tag.
        self.now = {"d0": {}, "d1": {}}
        self.last = {"d0": {}, "d1": {}}
        self.starts = 0
        #: ticket id -> the ids queued ahead of it when it had been overtaken the bound's times.
        self.claimed_ahead = {}

    def on_start(self, ticket):
        self.starts += 1
        book = self.scheduler.devices[ticket.device]
        others = [t for t in book.running if t is not ticket]
        if ticket.switched:
            assert not others, "switched a device with requests in flight"
        assert all(t.model_id == ticket.model_id for t in others), "two models running on one device"
        for waiting in book.queue:
            known = self.claimed_ahead.get(waiting.id)
            if known is not None:
                assert ticket.id in known, f"{ticket.id} started before {waiting.id}, which had waited enough"
        rank, tag = ticket.order[:2]
        now = self.now[ticket.device]
        now[rank] = max(now.get(rank, 0.0), tag)
        if not ticket.switched:
            # A better-placed ticket of the same model still waiting must sit
            # behind one that has waited long enough (the bound's exception).
            queue = list(book.queue)
            for i, q in enumerate(queue):
                if q.model_id == ticket.model_id and q.order < ticket.order:
                    assert any(p.overtaken >= self.bound for p in queue[:i]), \
                        f"{q.id} {q.order} waits while {ticket.id} {ticket.order} starts"

    @rule(model=st.sampled_from(["a", "a", "b"]), tenant=st.sampled_from(sorted(TENANTS)),
          band=st.sampled_from([INTERACTIVE, INTERACTIVE, BATCH]), prefer=st.sampled_from([None, "d0", "d1"]),
          pin=st.sampled_from([None, None, "d0"]))
    def arrive(self, model, tenant, band, prefer, pin):
        """A request; ``pin``: an operator load on d0 (so switches wait there)."""
        share = Share(tenant, band, TENANTS[tenant])
        books = self.scheduler.devices
        room = {n: b.pending for n, b in books.items() if b.pending < self.limit and pin in (None, n)}
        holding = {n: p for n, p in room.items() if books[n].model == model}
        starts = self.starts
        idle = {n: not b.running and not b.queue for n, b in books.items()}
        try:
            ticket = self.scheduler.submit(model, device=pin, share=share, prefer=prefer,
                                           max_imbalance=self.imbalance)
        except QueueFull:
            assert not room
            return
        if holding and pin is None:
            if prefer in holding and len(holding) > 1 and holding[prefer] - min(holding.values()) <= self.imbalance:
                assert ticket.device == prefer, "the preferred lane, within the imbalance bound"
            elif prefer not in holding or len(holding) == 1:
                assert holding[ticket.device] == min(holding.values()), "else the least busy holding it"
            else:
                assert ticket.device != prefer or holding[prefer] == min(holding.values())
        # The tag is start-time fair queueing's, in the lane's own books.
        rank = (INTERACTIVE, BATCH).index(band)
        lane = ticket.device
        if idle[lane]:
            self.last[lane] = {}  # an idle lane forgets its tenants
        start = max(self.now[lane].get(rank, 0.0), self.last[lane].get((rank, tenant), 0.0))
        self.last[lane][(rank, tenant)] = start + 1 / share.weight
        assert ticket.order[:2] == (rank, start), (ticket.order, (rank, start))
        if ticket.state == QUEUED and self.starts == starts:
            queue = list(books[lane].queue)
            i = queue.index(ticket)
            assert all(q.order > ticket.order for q in queue[i + 1:]), "behind only what comes before it"
            if i:
                ahead = queue[i - 1]
                assert ahead.order <= ticket.order or ahead.overtaken >= self.bound
        self.tickets.append(ticket)

    @precondition(lambda self: any(t.state in (QUEUED, RUNNING) for t in self.tickets))
    @rule(data=st.data())
    def cancel(self, data):
        """As TicketRules's, with the model's give-back: a queued ticket's
        charge returns to its tenant, and its later tickets move up by it."""
        live = [t for t in self.tickets if t.state in (QUEUED, RUNNING)]
        ticket = data.draw(st.sampled_from(live))
        queued = ticket.state == QUEUED
        later = {t.id: t.order[1] for t in self.scheduler.devices[ticket.device].queue
                 if t.share.tenant == ticket.share.tenant and t.order[0] == ticket.order[0]
                 and t.order > ticket.order}
        self.scheduler.cancel(ticket)
        if queued:
            give = 1 / ticket.share.weight
            self.last[ticket.device][(ticket.order[0], ticket.share.tenant)] -= give
            for t in self.scheduler.devices[ticket.device].queue:
                if t.id in later:
                    assert t.order[1] == later[t.id] - give, "the tenant's later tickets move up"

    @rule(device=st.sampled_from(["d0", "d1"]), model=st.sampled_from(["a", "b"]))
    def load_finished(self, device, model):
        self.scheduler.model_loaded(device, model, 2)

    @rule(device=st.sampled_from(["d0", "d1"]))
    def crash(self, device):
        book = self.scheduler.devices[device]
        if book.model is not None:
            self.scheduler.model_unloaded(device, book.model)

    @invariant()
    def old_rules(self):
        for book in self.scheduler.devices.values():
            assert book.pending <= self.limit
            if book.queue:
                assert book.running, "a queued request on an idle device would wait forever"
        for t in self.tickets:
            assert t.overtaken <= self.bound

    @invariant()
    def nothing_new_goes_ahead_of_a_request_that_waited_enough(self):
        for book in self.scheduler.devices.values():
            queue = list(book.queue)
            for i, t in enumerate(queue):
                if t.overtaken >= self.bound:
                    ahead = {q.id for q in queue[:i]}
                    known = self.claimed_ahead.setdefault(t.id, ahead)
                    assert ahead <= known, f"{ahead - known} went ahead of {t.id}, which had waited enough"

    @invariant()
    def tenant_counts(self):
        live = {}
        for book in self.scheduler.devices.values():
            for t in list(book.running) + list(book.queue):
                live[t.share.tenant] = live.get(t.share.tenant, 0) + 1
        assert self.scheduler.tenant_pending == live


class FairSchedulerMachineTest(SynchronousTestCase):
    def test_fair_rules_hold_under_random_event_sequences(self):
        run_state_machine_as_test(FairSchedulerMachine, settings=settings(max_examples=300, stateful_step_count=40))
