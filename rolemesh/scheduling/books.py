"""What the scheduler books: tickets (one per request) and lanes' books.

Plain records, changed only by :class:`rolemesh.scheduling.scheduler.Scheduler`;
apart from it so that the lane choice (:mod:`rolemesh.scheduling.lanes`)
reads the same books without importing the scheduler.
"""

from __future__ import annotations

import collections
from typing import Deque, List, Mapping, Optional, Tuple

import attr

from rolemesh.base.enums import StrEnum
from rolemesh.scheduling.fairqueue import DEFAULT_SHARE, FairOrder, Order, Share

__all__ = ["CANCELLED", "DONE", "QUEUED", "RUNNING", "DeviceBook", "QueueFull", "Ticket", "TicketState"]


class TicketState(StrEnum):
    """Where a ticket is: waiting in a queue, running, or over."""

    QUEUED = "queued"
    RUNNING = "running"
    DONE = "done"
    CANCELLED = "cancelled"


QUEUED = TicketState.QUEUED
RUNNING = TicketState.RUNNING
DONE = TicketState.DONE
CANCELLED = TicketState.CANCELLED


class QueueFull(Exception):
    """Every eligible device already holds its limit of pending requests."""


@attr.s(eq=False, auto_attribs=True, slots=True)  # one per request
class Ticket:
    """One request's place in the scheduler."""

    id: int
    model_id: str
    parallel: int = 1
    device: Optional[str] = None
    state: TicketState = QUEUED
    #: How many later tickets started before this one while it was queued.
    overtaken: int = 0
    #: Whether starting this ticket switched the device to its model.
    switched: bool = False
    #: Opaque to the scheduler: what the caller needs when the ticket starts.
    context: object = None
    #: Lanes whose children must stop before this one starts (set at start).
    evict: List[str] = attr.Factory(list)
    #: Bytes the model needs on each eligible lane (None: unknown).
    need: Optional[Mapping[str, int]] = None
    #: Whose request it is, and its band (fair queueing).
    share: Share = DEFAULT_SHARE
    #: Its place in the lane's fair order (band rank, start tag, tie-break).
    order: Order = (0, 0.0, 0)


@attr.s(eq=False, auto_attribs=True)
class DeviceBook:
    """What the scheduler knows about one device."""

    name: str
    order: int
    model: Optional[str] = None
    slots: int = 1
    free_memory: Optional[int] = None
    #: The physical devices this lane occupies: itself, or a group's members.
    members: Tuple[str, ...] = ()
    #: Bytes the loaded model is estimated to hold (0: none or unknown).
    held: int = 0
    running: List[Ticket] = attr.Factory(list)
    queue: Deque[Ticket] = attr.Factory(collections.deque)
    fair: FairOrder = attr.Factory(FairOrder)
    #: Uses of its child that take no slot, under way (:meth:`Scheduler.pin`).
    pinned: int = 0

    @property
    def pending(self) -> int:
        return len(self.running) + len(self.queue)

    @property
    def is_group(self) -> bool:
        return self.members != (self.name,)

    @property
    def occupied(self) -> bool:
        return self.model is not None or bool(self.running)
