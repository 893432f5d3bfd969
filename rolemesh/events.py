"""The agent's one observer mechanism: ``Events``.

A source (a device supervisor, the node, the API) owns an :class:`Events`
and calls ``emit(event, **fields)``; anything that wants to know -- the
metrics, the node watching its supervisors, a test -- subscribes a callable
``observer(event, **fields)``.  An observer that raises is logged and the
others are still called: a metrics bug never breaks a request or a state
change.
"""

from __future__ import annotations

from typing import Any, Callable, List

from twisted.logger import Logger

log = Logger()

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
