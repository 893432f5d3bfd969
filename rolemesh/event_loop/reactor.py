"""The injected reactor, with a lazy fall-back to the global one.

Library code never imports the global reactor at module level: tests inject
a Clock or MemoryReactor, and the real reactor is looked up only on first use.
This module is the one place that lookup happens.
"""

from __future__ import annotations

from typing import Generic, Optional, TypeVar, cast

#: The interface (or set of them, see :mod:`rolemesh.base.interfaces`) a part
#: needs from its reactor.
ReactorT = TypeVar("ReactorT")


def resolve_reactor(reactor: Optional[ReactorT]) -> ReactorT:
    """``reactor`` itself, or the global reactor imported now (never at module import)."""
    if reactor is None:
        from twisted.internet import reactor as global_reactor

        return cast(ReactorT, global_reactor)  # the real reactor provides every interface a part asks for
    return reactor


class UsesReactor(Generic[ReactorT]):
    """Mixin: ``self.reactor`` is the one given as ``self._reactor``, else the
    global reactor, looked up when first needed.  ``UsesReactor[IReactorTime]``
    says what the class uses it for."""

    _reactor: Optional[ReactorT] = None

    @property
    def reactor(self) -> ReactorT:
        if self._reactor is None:
            self._reactor = resolve_reactor(self._reactor)
        return self._reactor
