"""Drain for shutdown: refuse new requests, answer the waiting ones 503
``shutting_down`` at once, and fire once the requests being answered are
done -- or once the grace is over, whichever is first.
"""

from __future__ import annotations

from typing import Any, Callable, List, Mapping, Optional, Protocol

from twisted.internet import defer
from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger

from rolemesh.event_loop.reactor import UsesReactor

log = Logger(namespace="rolemesh.drain")


class Pending(Protocol):
    """A lane's book as the drain sees it: how many requests run or wait there."""

    @property
    def pending(self) -> int: ...


class Drain(UsesReactor[IReactorTime]):
    """Whether the node drains, and the Deferreds waiting for it to be idle."""

    def __init__(
        self,
        books: Mapping[str, Pending],
        refuse_waiting: Callable[[], None],
        emit: Callable[..., None],
        reactor: Optional[IReactorTime] = None,
    ) -> None:
        #: The scheduler's books, per lane.
        self._books = books
        #: Answers every request that has not begun 503 ``shutting_down``.
        self._refuse_waiting = refuse_waiting
        self._emit = emit
        self._reactor = reactor
        #: New requests are refused (set by :meth:`drain`, and at stopService).
        self.draining = False
        self._drained: List[Deferred] = []

    def drain(self, grace: float) -> "Deferred[None]":
        """Refuse new requests; fire when in-flight ones are done or ``grace`` passed.

        Requests that have not begun -- queued, or waiting on a model load --
        are answered 503 ``shutting_down`` at once: only answers already
        being generated are waited for.
        """
        self.draining = True
        self._emit("draining")
        self._refuse_waiting()
        if self.all_idle():
            return defer.succeed(None)
        d: Deferred = Deferred()
        self._drained.append(d)
        timer = self.reactor.callLater(grace, self._timeout, d)

        def stop_timer(result: object) -> object:
            if timer.active():
                timer.cancel()
            return result

        d.addBoth(stop_timer)
        return d

    def in_flight(self) -> int:
        """Requests being answered or waiting to be, on every device."""
        return sum(book.pending for book in self._books.values())

    def all_idle(self) -> bool:
        return all(book.pending == 0 for book in self._books.values())

    def quiet(self) -> None:
        """A request ended somewhere: fire the drains waiting, if all is idle now."""
        if self._drained and self.all_idle():
            waiting, self._drained = self._drained, []
            for d in waiting:
                d.callback(None)

    def _timeout(self, d: "Deferred[Any]") -> None:
        if not d.called:
            busy = {n: b.pending for n, b in self._books.items() if b.pending}
            log.warn("drain grace over with requests still pending ({busy}); stopping anyway", busy=busy)
            self._drained.remove(d)
            d.callback(None)
