"""Which device serves a request, and when: pure logic, no I/O.

The scheduler only keeps books -- per device: the model it holds (loaded,
loading or assigned), the requests running on it, and its queue -- and calls
``on_start(ticket)`` when a ticket may run.  The node (see
:mod:`rolemesh.node`) turns that into ``supervisor.ensure()`` and a proxied
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
"""

from __future__ import annotations

import collections
import itertools
from typing import Callable, Deque, Dict, Iterable, List, Optional

import attr

QUEUED = "queued"
RUNNING = "running"
DONE = "done"
CANCELLED = "cancelled"


#: The model id of an unload ticket: starting it is a switch to "no model", so
#: an unload waits for in-flight requests exactly like a switch does.  Config
#: never allows an empty model id.
UNLOAD = ""


class QueueFull(Exception):
    """Every eligible device already holds its limit of pending requests."""


@attr.s(eq=False, auto_attribs=True)
class Ticket:
    """One request's place in the scheduler."""

    id: int
    model_id: str
    parallel: int = 1
    device: Optional[str] = None
    state: str = QUEUED
    #: How many later tickets started before this one while it was queued.
    overtaken: int = 0
    #: Whether starting this ticket switched the device to its model.
    switched: bool = False
    #: Opaque to the scheduler: what the caller needs when the ticket starts.
    context: object = None


@attr.s(eq=False, auto_attribs=True)
class DeviceBook:
    """What the scheduler knows about one device."""

    name: str
    order: int
    model: Optional[str] = None
    slots: int = 1
    free_memory: Optional[int] = None
    running: List[Ticket] = attr.Factory(list)
    queue: Deque[Ticket] = attr.Factory(collections.deque)

    @property
    def pending(self) -> int:
        return len(self.running) + len(self.queue)


class Scheduler:
    """Per-device queues with a bounded pending count and switch rules."""

    def __init__(
        self,
        devices: Iterable[str],
        pending_limit: int,
        on_start: Callable[[Ticket], None],
        starvation_bound: int = 4,
    ) -> None:
        self.devices: Dict[str, DeviceBook] = {
            name: DeviceBook(name, i) for i, name in enumerate(devices)
        }
        self.pending_limit = pending_limit
        self.starvation_bound = starvation_bound
        self._on_start = on_start
        self._ids = itertools.count(1)

    # -- choosing -------------------------------------------------------------

    def choose(self, model_id: str, only: Optional[str] = None) -> DeviceBook:
        """The device a new request for ``model_id`` should queue on."""
        books = [b for b in self.devices.values() if only is None or b.name == only]
        room = [b for b in books if b.pending < self.pending_limit]
        if not room:
            raise QueueFull(model_id)
        holding = [b for b in room if b.model == model_id]
        if holding:
            return min(holding, key=lambda b: (b.pending, b.order))
        return min(
            room,
            key=lambda b: (b.pending, b.model is not None, -(b.free_memory or 0), b.order),
        )

    def submit(
        self, model_id: str, parallel: int = 1, device: Optional[str] = None, context: object = None
    ) -> Ticket:
        """Queue a request; raises QueueFull.  ``device`` pins it to one device
        (operator load requests, preload).  ``on_start`` may run before this
        returns, so ``context`` carries what it needs."""
        book = self.choose(model_id, only=device)
        ticket = Ticket(next(self._ids), model_id, max(1, parallel), book.name, context=context)
        book.queue.append(ticket)
        self._pump(book)
        return ticket

    # -- events ---------------------------------------------------------------

    def finish(self, ticket: Ticket) -> None:
        """A running ticket is done (answered, failed, or client gone)."""
        if ticket.state != RUNNING:
            return
        book = self.devices[ticket.device]  # type: ignore[index]
        book.running.remove(ticket)
        ticket.state = DONE
        self._pump(book)

    def cancel(self, ticket: Ticket) -> None:
        """The client went away: leave the queue at once (or free the slot)."""
        if ticket.state == RUNNING:
            self.finish(ticket)
        elif ticket.state == QUEUED:
            book = self.devices[ticket.device]  # type: ignore[index]
            book.queue.remove(ticket)
            ticket.state = CANCELLED
            self._pump(book)

    def model_loaded(self, device: str, model_id: str, slots: int = 1) -> None:
        """The device's child has (or is loading) ``model_id``."""
        book = self.devices[device]
        # Requests in flight for another model keep the book's model; ones for
        # this model do not (a reload under them after an unload or a crash).
        if book.model != model_id and all(t.model_id == model_id for t in book.running):
            book.model, book.slots = model_id, max(1, slots)
            self._pump(book)

    def model_unloaded(self, device: str, model_id: str) -> None:
        """The device's child for ``model_id`` is gone (crash, unload)."""
        book = self.devices[device]
        if book.model == model_id:
            book.model = None
            self._pump(book)

    def set_free_memory(self, device: str, free_bytes: Optional[int]) -> None:
        self.devices[device].free_memory = free_bytes

    def is_idle(self, device: str) -> bool:
        return self.devices[device].pending == 0

    # -- the per-device loop -----------------------------------------------------

    def _start(self, book: DeviceBook, ticket: Ticket) -> None:
        ticket.switched = book.model != ticket.model_id
        book.model, book.slots = ticket.model_id, ticket.parallel
        book.running.append(ticket)
        ticket.state = RUNNING
        self._on_start(ticket)

    def _pump(self, book: DeviceBook) -> None:
        while book.queue:
            head = book.queue[0]
            if head.model_id == book.model:
                if len(book.running) >= book.slots:
                    return
                book.queue.popleft()
                self._start(book, head)
                continue
            # The head needs a switch.  Queued requests for the current model
            # go first (a switch costs a reload), a bounded number of times.
            if head.overtaken < self.starvation_bound and len(book.running) < book.slots:
                position = self._first_for_current_model(book)
                if position is not None:
                    for ahead in itertools.islice(book.queue, position):
                        ahead.overtaken += 1
                    ticket = book.queue[position]
                    del book.queue[position]
                    self._start(book, ticket)
                    continue
            if book.running:
                return  # never switch under requests in flight
            book.queue.popleft()
            self._start(book, head)  # the switch

    @staticmethod
    def _first_for_current_model(book: DeviceBook) -> Optional[int]:
        if book.model is None:
            return None
        for position, ticket in enumerate(book.queue):
            if ticket.model_id == book.model:
                return position
        return None
