"""Which device serves a request, and when: pure logic, no I/O.

The scheduler only keeps books -- per device: the model it holds (loaded,
loading or assigned), the requests running on it, and its queue -- and calls
``on_start(ticket)`` when a ticket may run.  The node (see
:mod:`rolemesh.node.node`) turns that into ``supervisor.ensure()`` and a proxied
request, and reports back with ``finish``/``cancel``/``model_loaded``/
``model_unloaded``.

Rules (SPEC.md, "Serving and scheduling"):

1. Prefer a device that already has the model (loaded or loading) and has
   room (in-flight + queued below ``pending_limit``).
2. Otherwise the device with the least queue pressure, then one holding no
   model, then the most free memory.
3. No room anywhere: :class:`QueueFull` (429).

On a device, requests run one at a time, or up to the model's ``parallel``
slots.  A request for another model waits until the running ones finish
(never switch under in-flight requests); queued requests for the current
model may overtake it -- a switch costs a reload -- but at most
``starvation_bound`` times, so nothing starves.

Device groups: a model that spans several devices gets one *lane* (a book
like a device's) whose ``members`` are those devices.  Lanes that share a
member exclude each other: at most one of them holds a model or runs
requests at any time.  A switch on a lane therefore also waits for the
requests of every overlapping lane, and *evicts* their (idle) models --
``ticket.evict`` names the lanes whose children must stop before the new one
starts.  Fairness across lanes uses the same bound: each start on a lane
counts as an overtake of every overlapping lane's waiting head; a head that
has been overtaken ``starvation_bound`` times claims its devices, and no
overlapping lane starts anything until it has run (the oldest claim wins).

Fair shares (see :mod:`rolemesh.scheduling.fairqueue`): a ticket carries a
:class:`~rolemesh.scheduling.fairqueue.Share` (tenant, band, weight); a lane's queue is
kept in band order, then fair order across tenants within a band -- never
ahead of a ticket that has been overtaken ``starvation_bound`` times, so the
bound above holds -- and the switch rules apply to that order.  The
scheduler counts each tenant's queued and running tickets (``tenant_pending``,
O(1) per request) for the caller's concurrency caps.

Prefix affinity (see :mod:`rolemesh.scheduling.prefix`): a request may name a lane it prefers
(``prefer``) among those holding its model; it gets it unless that lane has
more than ``max_imbalance`` pending requests more than the least busy one.

Pins: a use of a lane's child that takes no generation slot (tokenize, count
tokens, apply a template: ms of work, never worth a queue) *pins* a lane that
holds its model (:meth:`Scheduler.pin`).  A pin counts in no slot, queue or
tenant count, and holds off a switch (and an unload) like a running request,
so no child is replaced under it; :meth:`Scheduler.unpin` lets a waiting
switch go.

Memory: a request may say how many bytes it needs per lane; among lanes
without the model, those whose free memory (plus what the models they would
evict hold) covers the need come first.

Replicas: a request may carry ``replicas``, the most lanes its model may
hold at once.  Then the model *scales out* on purpose: a request that would
wait on every lane holding the model (no free slot) starts a copy on an idle
lane that holds nothing (no model, no requests, no overlapping lane busy)
while fewer than ``replicas`` lanes hold or wait for the model; and it never
goes to a new lane once ``replicas`` lanes do (full queues there: 429).
Without ``replicas`` a model spreads only when its lanes' queues are full.
"""

from __future__ import annotations

import itertools
from typing import Callable, Dict, Iterable, List, Mapping, Optional, Sequence

from rolemesh.scheduling.books import CANCELLED, DONE, QUEUED, RUNNING, DeviceBook, QueueFull, Ticket
from rolemesh.scheduling.fairqueue import DEFAULT_SHARE, Order, Share
from rolemesh.scheduling.lanes import Lanes

__all__ = ["UNLOAD", "Scheduler", "superseded"]


#: The model id of an unload ticket: starting it is a switch to "no model", so
#: an unload waits for in-flight requests exactly like a switch does.  Config
#: never allows an empty model id.
UNLOAD = ""


def superseded(model_id: str) -> str:
    """The key the requests and the child of a record a reload replaced are
    booked under (:meth:`Scheduler.supersede`): no request names it."""
    return model_id + "\x00superseded"


class Scheduler:
    """Per-device queues with a bounded pending count and switch rules."""

    def __init__(
        self,
        devices: Iterable[str],
        pending_limit: int,
        on_start: Callable[[Ticket], None],
        starvation_bound: int = 4,
        groups: Optional[Mapping[str, Sequence[str]]] = None,
    ) -> None:
        #: The lanes' books, which overlap, and the choice of one (rolemesh.scheduling.lanes).
        self.lanes = Lanes(devices, groups)
        self.devices: Dict[str, DeviceBook] = self.lanes.devices
        #: For each lane, the other lanes that share a device with it.
        self.overlaps: Dict[str, List[DeviceBook]] = self.lanes.overlaps
        self.pending_limit = pending_limit
        self.starvation_bound = starvation_bound
        self._on_start = on_start
        self._ids = itertools.count(1)
        #: Queued plus running tickets per tenant (absent: none).
        self.tenant_pending: Dict[str, int] = {}

    # -- choosing (rolemesh.scheduling.lanes) -----------------------------------

    def choose(
        self,
        model_id: str,
        only: Optional[str] = None,
        lanes: Optional[Sequence[str]] = None,
        need: Optional[Mapping[str, int]] = None,
        prefer: Optional[str] = None,
        max_imbalance: int = 0,
        replicas: Optional[int] = None,
    ) -> DeviceBook:
        """The lane a new request for ``model_id`` should queue on (see :meth:`Lanes.choose`)."""
        return self.lanes.choose(model_id, self.pending_limit, only, lanes, need, prefer, max_imbalance, replicas)

    def submit(
        self,
        model_id: str,
        parallel: int = 1,
        device: Optional[str] = None,
        context: object = None,
        lanes: Optional[Sequence[str]] = None,
        need: Optional[Mapping[str, int]] = None,
        share: Share = DEFAULT_SHARE,
        prefer: Optional[str] = None,
        max_imbalance: int = 0,
        replicas: Optional[int] = None,
    ) -> Ticket:
        """Queue a request; raises QueueFull.  ``device`` pins it to one lane
        (operator load requests, preload).  ``on_start`` may run before this
        returns, so ``context`` carries what it needs."""
        book = self.choose(model_id, only=device, lanes=lanes, need=need, prefer=prefer, max_imbalance=max_imbalance,
                           replicas=replicas)
        seq = next(self._ids)
        ticket = Ticket(seq, model_id, max(1, parallel), book.name, context=context, need=need,
                        share=share, order=self._tag(book, share, seq))
        self._count(share.tenant, 1)
        self._enqueue(book, ticket)
        self._settle(book)
        return ticket

    @staticmethod
    def _tag(book: DeviceBook, share: Share, seq: int) -> Order:
        """A new ticket's fair order; a lane with nothing queued or running
        forgets its tenants first (idle use is held against no one)."""
        if not book.running and not book.queue:
            book.fair.forget()
        return book.fair.tag(share, seq)

    def _count(self, tenant: str, delta: int) -> None:
        pending = self.tenant_pending
        left = pending.get(tenant, 0) + delta
        if left > 0:
            pending[tenant] = left
        else:
            pending.pop(tenant, None)

    def _enqueue(self, book: DeviceBook, ticket: Ticket) -> None:
        """Into ``book``'s queue at its fair place: after every ticket of a
        lower or equal (band, tag), and never ahead of one that has been
        overtaken ``starvation_bound`` times (it has waited long enough)."""
        queue = book.queue
        key = ticket.order
        position = len(queue)
        bound = self.starvation_bound
        while position > 0:
            ahead = queue[position - 1]
            if ahead.order <= key or ahead.overtaken >= bound:
                break
            position -= 1
        if position == len(queue):
            queue.append(ticket)
        else:
            queue.insert(position, ticket)

    def admit(
        self,
        model_id: str,
        parallel: int = 1,
        lanes: Optional[Sequence[str]] = None,
        need: Optional[Mapping[str, int]] = None,
        ready: Callable[[str], bool] = lambda lane: True,
        share: Share = DEFAULT_SHARE,
        prefer: Optional[str] = None,
        max_imbalance: int = 0,
        replicas: Optional[int] = None,
    ) -> Optional[Ticket]:
        """A running ticket at once, when :meth:`submit` would start one then
        and there without a switch: the lane it would choose holds the model,
        has a free slot and an empty queue, shares no device with another
        lane, and is ``ready`` (the caller's say: its child answers now) --
        nearly every request on a busy node.  Else None, and nothing changed:
        :meth:`submit` it.  ``on_start`` is not called: the caller starts it."""
        try:
            book = self.choose(model_id, lanes=lanes, need=need, prefer=prefer, max_imbalance=max_imbalance,
                               replicas=replicas)
        except QueueFull:
            return None
        if (book.model != model_id or book.queue or len(book.running) >= book.slots or self.overlaps[book.name]
                or not ready(book.name)):
            return None
        seq = next(self._ids)
        ticket = Ticket(seq, model_id, max(1, parallel), book.name, RUNNING, need=need, share=share,
                        order=self._tag(book, share, seq))
        book.fair.started(ticket.order, share.tenant)  # as _start does: virtual time moves with what is served
        self._count(share.tenant, 1)
        book.slots = ticket.parallel  # as _start does
        book.running.append(ticket)
        return ticket

    def pin(self, model_id: str, lanes: Sequence[str], ready: Callable[[str], bool] = bool) -> Optional[str]:
        """Pin the least busy lane that holds ``model_id`` and is ``ready`` (module docstring); None if none does."""
        holding = [b for b in (self.devices[n] for n in lanes) if b.model == model_id and ready(b.name)]
        if not holding:
            return None
        book = min(holding, key=lambda b: (b.pending, b.order))
        book.pinned += 1
        return book.name

    def unpin(self, lane: str) -> None:
        book = self.devices[lane]
        book.pinned = max(0, book.pinned - 1)
        if not book.pinned:
            self._settle(book)  # a switch waiting for the pin may go

    # -- events ---------------------------------------------------------------

    def finish(self, ticket: Ticket) -> None:
        """A running ticket is done (answered, failed, or client gone)."""
        if ticket.state != RUNNING:
            return
        book = self.devices[ticket.device]  # type: ignore[index]
        book.running.remove(ticket)
        ticket.state = DONE
        self._count(ticket.share.tenant, -1)
        self._settle(book)

    def cancel(self, ticket: Ticket) -> None:
        """The client went away: leave the queue at once (or free the slot)."""
        if ticket.state == RUNNING:
            self.finish(ticket)
        elif ticket.state == QUEUED:
            book = self.devices[ticket.device]  # type: ignore[index]
            book.queue.remove(ticket)
            ticket.state = CANCELLED
            self._count(ticket.share.tenant, -1)
            self._give_back(book, ticket)
            self._settle(book)

    def _give_back(self, book: DeviceBook, gone: Ticket) -> None:
        """``gone`` left the queue before it started: its charge is given
        back, so its tenant's later tickets move up by it (to their new place)."""
        give = book.fair.withdrawn(gone.order, gone.share, gone.id)
        rank, tenant = gone.order[0], gone.share.tenant
        later = sorted((t for t in book.queue if t.order[0] == rank and t.share.tenant == tenant
                        and t.order > gone.order), key=lambda t: t.order)
        if not give or not later:
            return
        prev = gone.order[2]  # the next one follows what came before the one that left
        for ticket in later:
            book.queue.remove(ticket)
            ticket.order, prev = (rank, ticket.order[1] - give, prev), ticket.id
        for ticket in later:
            self._enqueue(book, ticket)

    def model_loaded(self, device: str, model_id: str, slots: int = 1) -> None:
        """The device's child has (or is loading) ``model_id``."""
        book = self.devices[device]
        # Requests in flight for another model keep the book's model; ones for
        # this model do not (a reload under them after an unload or a crash).
        # A lane whose devices another lane occupies cannot hold a model.
        if any(o.occupied for o in self.overlaps[device]):
            return
        if book.model != model_id and all(t.model_id == model_id for t in book.running):
            book.model, book.slots = model_id, max(1, slots)
            self._settle(book)

    def supersede(self, device: str, model_id: str) -> None:
        """A reload changed ``model_id``'s command while ``device`` holds it:
        the child and the requests it admitted here (running and queued)
        keep the old record, booked as :func:`superseded`; requests for the
        new record are another model -- they wait for those, then switch the
        device once."""
        self._rebook(device, model_id, superseded(model_id))

    def restore(self, device: str, model_id: str) -> None:
        """A reload brought back the command ``device``'s superseded child
        runs (a reload undone): it is ``model_id``'s current one again."""
        self._rebook(device, superseded(model_id), model_id)

    def _rebook(self, device: str, was: str, key: str) -> None:
        book = self.devices[device]
        for ticket in (*book.running, *book.queue):
            if ticket.model_id == was:
                ticket.model_id = key
        if book.model == was:
            book.model = key
        self._settle(book)

    def model_unloaded(self, device: str, model_id: str) -> None:
        """The device's child for ``model_id`` is gone (crash, unload)."""
        book = self.devices[device]
        if book.model == model_id:
            book.model, book.held = None, 0
            self._settle(book)

    def set_free_memory(self, device: str, free_bytes: Optional[int]) -> None:
        self.devices[device].free_memory = free_bytes

    def is_idle(self, device: str) -> bool:
        return not self.devices[device].running and not self.devices[device].queue

    # -- the per-lane loop -----------------------------------------------------

    def _claims_over(self, book: DeviceBook) -> bool:
        """Whether an overlapping lane's head has waited long enough that
        ``book`` must start nothing until it has run (the oldest claim wins)."""
        mine = book.queue[0] if book.queue and book.queue[0].overtaken >= self.starvation_bound else None
        for other in self.overlaps[book.name]:
            if other.queue and other.queue[0].overtaken >= self.starvation_bound:
                if mine is None or other.queue[0].id < mine.id:
                    return True
        return False

    def _start(self, book: DeviceBook, ticket: Ticket) -> None:
        ticket.switched = book.model != ticket.model_id
        if ticket.switched:
            for other in self.overlaps[book.name]:
                if other.model is not None:
                    ticket.evict.append(other.name)
                    other.model, other.held = None, 0
            book.held = (ticket.need or {}).get(book.name) or 0
        for other in self.overlaps[book.name]:
            if other.queue and other.queue[0].overtaken < self.starvation_bound:
                other.queue[0].overtaken += 1
        book.model, book.slots = ticket.model_id, ticket.parallel
        book.running.append(ticket)
        book.fair.started(ticket.order, ticket.share.tenant)
        ticket.state = RUNNING
        self._on_start(ticket)

    def _settle(self, first: DeviceBook) -> None:
        """Pump ``first``, then every lane, until nothing more can start: an
        event on one lane can unblock the lanes that share its devices."""
        progress = self._pump(first)
        if not self.overlaps[first.name]:
            return  # no lane shares its devices: nothing else is unblocked by it
        while True:
            for book in list(self.devices.values()):
                progress = self._pump(book) or progress
            if not progress:
                return
            progress = False

    def _pump(self, book: DeviceBook) -> bool:
        """Start what may start on ``book``; True if anything did."""
        started = False
        overlapped = bool(self.overlaps[book.name])  # else no other lane's claim can stop it
        while book.queue:
            if overlapped and self._claims_over(book):
                return started
            head = book.queue[0]
            if head.model_id == book.model:
                if len(book.running) >= book.slots:
                    return started
                book.queue.popleft()
                self._start(book, head)
                started = True
                continue
            # The head needs a switch.  Queued requests for the current model
            # go first (a switch costs a reload), a bounded number of times.
            if head.overtaken < self.starvation_bound and len(book.running) < book.slots:
                position = self._first_for_current_model(book)
                if position is not None and position > 1 and any(
                        ahead.overtaken >= self.starvation_bound for ahead in itertools.islice(book.queue, position)):
                    position = None  # one ahead has waited long enough (fair order put it behind the head)
                if position is not None:
                    for ahead in itertools.islice(book.queue, position):
                        ahead.overtaken += 1
                    ticket = book.queue[position]
                    del book.queue[position]
                    self._start(book, ticket)
                    started = True
                    continue
            if book.running or book.pinned:
                return started  # never switch under requests in flight (or a pin)
            if any(o.running or o.pinned for o in self.overlaps[book.name]):
                return started  # nor while another lane uses one of its devices
            book.queue.popleft()
            self._start(book, head)  # the switch
            started = True
        return started

    @staticmethod
    def _first_for_current_model(book: DeviceBook) -> Optional[int]:
        if book.model is None:
            return None
        for position, ticket in enumerate(book.queue):
            if ticket.model_id == book.model:
                return position
        return None
