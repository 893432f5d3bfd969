"""The injected reactor, with a lazy fall-back to the global one.

Library code never imports the global reactor at module level: tests inject
a Clock or MemoryReactor, and the real reactor is looked up only on first use.
This module is the one place that lookup happens.
"""

from __future__ import annotations

from typing import Any


def resolve_reactor(reactor: Any) -> Any:
    """``reactor`` itself, or the global reactor imported now (never at module import)."""
    if reactor is None:
        from twisted.internet import reactor as global_reactor

        return global_reactor
    return reactor


class UsesReactor:
    """Mixin: ``self.reactor`` is the one given as ``self._reactor``, else the
    global reactor, looked up when first needed."""

    _reactor: Any = None

    @property
    def reactor(self) -> Any:
        if self._reactor is None:
            self._reactor = resolve_reactor(None)
        return self._reactor
