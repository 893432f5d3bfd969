"""Who waits on a device supervisor, and how they are told.

The callers of ``ensure(model)`` each wait for a model (those for the model
being loaded share the one load); the callers of ``stop()`` wait for the
child to be reaped.  :class:`Waiters` holds both and fires them through the
supervisor's :class:`~rolemesh.base.events.Outbox`: a waiter's result is
delivered once the transition that decided it is complete, in order with the
events it caused.  A waiter cancelled meanwhile (its request went away) is
dropped and never fired.
"""

from __future__ import annotations

from typing import Callable, List, Optional, Tuple, Union

from twisted.internet.defer import Deferred

from rolemesh.base import errors
from rolemesh.base.events import Outbox

__all__ = ["Waiters"]


class Waiters:
    """The pending ``ensure`` and ``stop`` Deferreds of one device."""

    def __init__(self, outbox: Outbox) -> None:
        self._outbox = outbox
        self._loads: List[Tuple[str, Deferred]] = []
        self._stops: List[Deferred] = []

    @property
    def models(self) -> List[str]:
        """The model id each load waiter waits for, oldest first (read only)."""
        return [model_id for model_id, _ in self._loads]

    @property
    def stopping(self) -> int:
        """How many wait for the child to be reaped."""
        return len(self._stops)

    def for_load(self, model_id: str) -> Deferred:
        """A new waiter for ``model_id``; cancelling it only removes it."""
        d: Deferred = Deferred(self._cancelled)
        self._loads.append((model_id, d))
        return d

    def for_stop(self) -> Deferred:
        """A new waiter for the end of the child; it fires with None."""
        d: Deferred = Deferred()
        self._stops.append(d)
        return d

    def ready(self, model_id: str, endpoint: object, superseded: Callable[[str], errors.ApiError]) -> None:
        """The child of ``model_id`` is ready at ``endpoint``: its waiters get
        that, any other's ``superseded(its model id)``."""
        waiters, self._loads = self._loads, []
        for waited, d in waiters:
            self._fire_after_transition(d, endpoint if waited == model_id else superseded(waited))

    def fail(self, error: errors.ApiError, keep: Optional[str] = None) -> None:
        """Fail every load waiter with ``error``, except those for model ``keep``."""
        waiters = self._loads
        self._loads = [(m, d) for (m, d) in waiters if m == keep]
        for model_id, d in waiters:
            if model_id != keep:
                self._fire_after_transition(d, error)

    def stopped(self) -> None:
        """The child was reaped: every stop waiter fires."""
        stops, self._stops = self._stops, []
        for d in stops:
            self._fire_after_transition(d, None)

    def _fire_after_transition(self, d: Deferred, result: Union[object, errors.ApiError]) -> None:
        """Fire ``d`` with ``result`` (errback for an ApiError) once the
        transition is complete, unless it was cancelled meanwhile."""

        def fire() -> None:
            if d.called:
                return
            if isinstance(result, errors.ApiError):
                d.errback(result)
            else:
                d.callback(result)

        self._outbox.later(fire)

    def _cancelled(self, d: Deferred) -> None:
        # Deferred.cancel() errbacks with CancelledError once we return.
        self._loads = [(m, w) for (m, w) in self._loads if w is not d]
