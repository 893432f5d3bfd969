"""Fair shares and priority bands in a device's queue.  Pure: no I/O.

A request carries a :class:`Share`: its tenant, its band (``interactive``
before ``batch``), the tenant's weight and concurrency cap.  A device's
queue is kept in the order :class:`FairOrder` gives: band first, then
start-time fair queueing within the band (a weighted round robin that needs
no rounds: each tenant's next request is tagged ``max(now, its last tag) +
1/weight``, and the queue serves the lowest tag).  A tenant that sends 32
requests at once gets tags 1/w apart; another tenant's one request is
tagged ``now`` and goes before all but the first of them.  O(1) per request
to tag; the queue (bounded by ``max_pending_requests_per_device``) is
inserted into by a short scan from its end.
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


class FairOrder:
    """Start tags per band and tenant for one queue (see the module doc)."""

    #: Tenants remembered at most before those whose tag has passed are dropped.
    PRUNE_AT = 256

    def __init__(self) -> None:
        #: band rank -> virtual time: the tag of the last ticket started in it.
        self._now: Dict[int, float] = {}
        #: (band rank, tenant) -> the finish tag of its last queued ticket.
        self._last: Dict[Tuple[int, str], float] = {}

    def tag(self, share: Share) -> Tuple[int, float]:
        """The sort key of a new request of ``share`` (band rank, start tag)."""
        rank = share.rank
        now = self._now.get(rank, 0.0)
        key = (rank, share.tenant)
        start = max(now, self._last.get(key, 0.0))
        if len(self._last) >= self.PRUNE_AT:
            # Drop the tenants at most one request ahead of now (forgetting
            # them gives back at most that); many tenants far ahead at once
            # (a flood of distinct names): forget them all -- bounded memory first.
            now_of = self._now
            kept = {k: v for k, v in self._last.items() if v > now_of.get(k[0], 0.0) + 1.0}
            self._last = kept if len(kept) < self.PRUNE_AT // 2 else {}
        self._last[key] = start + 1.0 / share.weight
        return rank, start

    def started(self, key: Tuple[int, float]) -> None:
        """A ticket with ``key`` started: the band's virtual time moves on."""
        rank, start = key
        if start > self._now.get(rank, 0.0):
            self._now[rank] = start
