"""The agent's one observer mechanism: ``Events``.

A source (a device supervisor, the node, the API) owns an :class:`Events`
and calls ``emit(event, **fields)``; anything that wants to know -- the
metrics, the node watching its supervisors, a test -- subscribes a callable
``observer(event, **fields)``.  An observer that raises is logged and the
others are still called: a metrics bug never breaks a request or a state
change.

:class:`Outbox` is what makes a source's events arrive after the change
that caused them: a state machine queues them during a transition and they
are run, in order, once the outermost transition has returned.
"""

from __future__ import annotations

import collections
from typing import Any, Callable, Deque, List

from twisted.logger import Logger

log = Logger(namespace="rolemesh.events")

#: ``observer(event, **fields)``.
Observer = Callable[..., None]


class Events:
    """Observers of one source, called in the order they subscribed."""

    def __init__(self, *observers: Observer) -> None:
        self._observers: List[Observer] = list(observers)

    def subscribe(self, observer: Observer) -> Callable[[], None]:
        """Call ``observer(event, **fields)`` for every event from now on;
        returns a function that unsubscribes it (calling it twice is harmless)."""
        self._observers.append(observer)

        def unsubscribe() -> None:
            if observer in self._observers:
                self._observers.remove(observer)

        return unsubscribe

    def __contains__(self, observer: object) -> bool:
        return observer in self._observers

    def __len__(self) -> int:
        return len(self._observers)

    def emit(self, event: str, **fields: Any) -> None:
        """Tell every observer; one that raises is logged, the rest still run."""
        for observer in list(self._observers):
            try:
                observer(event, **fields)
            except Exception:
                log.failure("observer of {event} failed", event=event)


class Outbox:
    """Actions queued during transitions, run in order once the outermost
    transition has ended (synchronously, before it returns to its caller).
    An action that starts a transition of its own queues behind the rest."""

    def __init__(self) -> None:
        self._queue: Deque[Callable[[], None]] = collections.deque()
        self._depth = 0
        self._running = False

    def enter(self) -> None:
        self._depth += 1

    def leave(self) -> None:
        """End a transition; the outermost one runs what was queued."""
        self._depth -= 1
        if self._depth == 0:
            self._run()

    def later(self, action: Callable[[], None]) -> None:
        """Run ``action`` once the current transition has ended (now if none runs)."""
        self._queue.append(action)
        if self._depth == 0:
            self._run()

    def _run(self) -> None:
        if self._running or not self._queue:
            return
        self._running = True
        try:
            while self._queue:
                self._queue.popleft()()
        finally:
            self._running = False
