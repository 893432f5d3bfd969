"""The lanes a scheduler books, and which one a new request goes to.

One lane per device and per device group; lanes that share a device
*overlap*.  Choosing a lane (the module docstring of
:mod:`rolemesh.scheduling.scheduler`: holding the model first, then the
least queue pressure, the memory that fits, replicas) only reads the books;
what is queued and started on them is the scheduler's.  Pure: no I/O.
"""

from __future__ import annotations

from typing import Dict, Iterable, List, Mapping, Optional, Sequence

from rolemesh.scheduling.books import DeviceBook, QueueFull
from rolemesh.scheduling.prefix import affine_choice

__all__ = ["Lanes"]


class Lanes:
    """The books of every lane, which lanes overlap, and the lane choice."""

    def __init__(self, devices: Iterable[str], groups: Optional[Mapping[str, Sequence[str]]] = None) -> None:
        self.devices: Dict[str, DeviceBook] = {
            name: DeviceBook(name, i, members=(name,)) for i, name in enumerate(devices)
        }
        for name, members in (groups or {}).items():
            unknown = [m for m in members if m not in self.devices or self.devices[m].is_group]
            if unknown or not members:
                raise ValueError(f"group {name!r} names unknown devices {unknown}")
            self.devices[name] = DeviceBook(name, len(self.devices), members=tuple(members))
        #: For each lane, the other lanes that share a device with it.
        self.overlaps: Dict[str, List[DeviceBook]] = {
            name: [o for o in self.devices.values() if o is not b and set(o.members) & set(b.members)]
            for name, b in self.devices.items()
        }

    def choose(
        self,
        model_id: str,
        pending_limit: int,
        only: Optional[str] = None,
        lanes: Optional[Sequence[str]] = None,
        need: Optional[Mapping[str, int]] = None,
        prefer: Optional[str] = None,
        max_imbalance: int = 0,
        replicas: Optional[int] = None,
    ) -> DeviceBook:
        """The lane a new request for ``model_id`` should queue on (QueueFull: none below ``pending_limit``).

        ``lanes`` are the ones the model may use (default: every single
        device); ``only`` narrows them to one (operator load, preload);
        ``prefer`` is the lane prefix affinity asks for, taken among those
        holding the model unless it is busier than the least busy by more
        than ``max_imbalance``; ``replicas`` caps the lanes the model holds
        and lets it scale out before its queues are full (rolemesh.scheduling.scheduler)."""
        names = lanes if lanes is not None else [n for n, b in self.devices.items() if not b.is_group]
        if len(names) == 1 and (only is None or names[0] == only):
            # One lane (one device, or a model pinned to one): it, if it has room.
            book = self.devices[names[0]]
            if len(book.running) + len(book.queue) >= pending_limit:
                raise QueueFull(model_id)
            return book
        books = [self.devices[n] for n in names if only is None or n == only]
        room = [b for b in books if b.pending < pending_limit]
        if not room:
            raise QueueFull(model_id)
        holding = [b for b in room if b.model == model_id]
        cap = replicas if only is None else None  # an operator's pin is not a replica decision
        if holding:
            chosen = None
            if prefer is not None and len(holding) > 1:
                chosen = affine_choice({b.name: b.pending for b in holding}, prefer, max_imbalance)
            book = self.devices[chosen] if chosen is not None else min(holding, key=lambda b: (b.pending, b.order))
            if cap is not None and book.pending >= book.slots and len(self._claimed(model_id, books)) < cap:
                spare = self._spare(room, need)
                if spare is not None:
                    return spare  # scale out: a copy on an idle lane rather than a wait
            return book
        claimed = self._claimed(model_id, books) if cap is not None else []
        if cap is not None and len(claimed) >= cap:
            # As many lanes as it may hold have it (or a switch to it queued):
            # one of those with room, else 429.
            waiting = [b for b in claimed if b.pending < pending_limit]
            if not waiting:
                raise QueueFull(model_id)
            return min(waiting, key=lambda b: (b.pending, b.order))
        fitting = [b for b in room if self.fits(b, (need or {}).get(b.name))] or room
        return min(
            fitting,
            key=lambda b: (
                b.pending + sum(o.pending for o in self.overlaps[b.name]),
                b.model is not None or any(o.occupied for o in self.overlaps[b.name]),
                -(b.free_memory or 0),
                b.order,
            ),
        )

    @staticmethod
    def _claimed(model_id: str, books: Sequence[DeviceBook]) -> List[DeviceBook]:
        """Lanes that hold ``model_id`` or have a request for it waiting (a
        switch to it is coming): the replicas it has, or is about to."""
        return [b for b in books if b.model == model_id or any(t.model_id == model_id for t in b.queue)]

    def _spare(self, room: Sequence[DeviceBook], need: Optional[Mapping[str, int]]) -> Optional[DeviceBook]:
        """An idle lane that holds nothing -- no model, no request, no
        overlapping lane in use -- where the model fits: a new replica costs
        no other model its place.  The most free memory first."""
        spare = [b for b in room if not b.occupied and not b.queue
                 and not any(o.occupied or o.queue for o in self.overlaps[b.name])
                 and self.fits(b, (need or {}).get(b.name))]
        return min(spare, key=lambda b: (-(b.free_memory or 0), b.order)) if spare else None

    def fits(self, book: DeviceBook, need: Optional[int]) -> bool:
        """Free memory, plus what the models it would replace hold, covers ``need``."""
        if need is None or book.free_memory is None:
            return True
        freed = book.held + sum(o.held for o in self.overlaps[book.name])
        return book.free_memory + freed >= need
