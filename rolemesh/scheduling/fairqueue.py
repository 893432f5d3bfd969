"""Fair shares and priority bands in a device's queue.  Pure: no I/O.

A request carries a :class:`Share`: its tenant, its band (``interactive``
before ``batch``), the tenant's weight and concurrency cap.  A device's
queue is kept in the order :class:`FairOrder` gives: band first, then
start-time fair queueing within the band (a weighted round robin that needs
no rounds: each tenant's next request is tagged ``max(now, its last tag) +
1/weight``, and the queue serves the lowest tag).  A tenant that sends 32
requests at once gets tags 1/w apart; another tenant's one request is
tagged ``now`` and goes before all but the first of them.  Use while nobody
else waited is never charged: an idle queue forgets its tenants, and a
ticket withdrawn before it starts gives its charge back (:class:`FairOrder`).
O(1) per request to tag; the queue (bounded by
``max_pending_requests_per_device``) is inserted into by a short scan from
its end.
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple

import attr

#: The priority bands, served in this order.
BANDS: Tuple[str, ...] = ("interactive", "batch")
INTERACTIVE, BATCH = BANDS
#: The tenant label of requests from tenants not in the config (metrics).
OTHER = "other"


@attr.s(auto_attribs=True, frozen=True, slots=True)
class Share:
    """Who a request belongs to, and how it is served."""

    tenant: str = "default"
    band: str = INTERACTIVE
    weight: float = 1.0
    #: Requests of this tenant queued or running at once (None: no cap).
    max_concurrent: Optional[int] = None

    @property
    def rank(self) -> int:
        return BANDS.index(self.band)


#: The share of a request that says nothing (preloads, operator loads, unloads).
DEFAULT_SHARE = Share()


@attr.s(auto_attribs=True, slots=True)
class _Flow:
    """One tenant's place in one band of a queue."""

    #: The finish tag of its last ticket (``start + 1/weight``).
    finish: float = 0.0
    #: Its tickets tagged and not yet started or withdrawn.
    queued: int = 0
    #: The sequence number of its last ticket (the tie-break: least recently active first).
    last_seq: int = 0


#: A ticket's place in the fair order: (band rank, start tag, its tenant's previous ticket's sequence number).
Order = Tuple[int, float, int]


class FairOrder:
    """Start tags per band and tenant for one queue (see the module doc).

    What a tenant did while nobody else waited is never held against it:
    when the queue falls idle (:meth:`forget`) every tenant starts again at
    the virtual time, and a ticket withdrawn before it started (client gone,
    queue timeout) gives its charge back (:meth:`withdrawn`).  Equal start
    tags go to the tenant whose previous ticket came first, so a tenant whose
    own request was running when a flood began goes after one of the flood's,
    not two."""

    #: Tenants remembered before those with nothing queued are dropped.
    PRUNE_AT = 256

    def __init__(self) -> None:
        #: band rank -> virtual time: the tag of the last ticket started in it.
        self._now: Dict[int, float] = {}
        #: (band rank, tenant) -> its flow.
        self._flows: Dict[Tuple[int, str], _Flow] = {}

    def tag(self, share: Share, seq: int = 0) -> Order:
        """The sort key of a new ticket of ``share`` (``seq``: its sequence number)."""
        rank = share.rank
        key = (rank, share.tenant)
        flow = self._flows.get(key)
        if flow is None:
            if len(self._flows) >= self.PRUNE_AT:
                # Forgetting a tenant with nothing queued gives back at most the
                # charge of its last ticket; one with tickets queued keeps its
                # place (they are bounded by the queue's length).
                self._flows = {k: f for k, f in self._flows.items() if f.queued}
            flow = self._flows[key] = _Flow()
        start = max(self._now.get(rank, 0.0), flow.finish)
        order = (rank, start, flow.last_seq)
        flow.finish = start + 1.0 / share.weight
        flow.queued += 1
        flow.last_seq = seq
        return order

    def started(self, order: Order, tenant: str) -> None:
        """A ticket with ``order`` (of ``tenant``) started: the band's virtual time moves on."""
        rank, start = order[0], order[1]
        if start > self._now.get(rank, 0.0):
            self._now[rank] = start
        flow = self._flows.get((rank, tenant))
        if flow is not None and flow.queued:
            flow.queued -= 1

    def withdrawn(self, order: Order, share: Share, seq: int = 0) -> float:
        """A queued ticket (number ``seq``) left without starting: its charge
        is given back, and its place in the tie-break.  The tenant's later
        queued tickets move ahead by what this returns."""
        flow = self._flows.get((order[0], share.tenant))
        if flow is None:
            return 0.0
        flow.queued = max(0, flow.queued - 1)
        if flow.last_seq == seq:
            flow.last_seq = order[2]
        give = 1.0 / share.weight
        flow.finish -= give
        return give

    def forget(self) -> None:
        """The queue is idle (nothing queued, nothing running): every tenant
        starts again at the virtual time."""
        self._flows.clear()

    def __len__(self) -> int:
        return len(self._flows)
