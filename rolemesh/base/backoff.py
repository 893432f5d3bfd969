"""Back-off: how long to wait before trying again, in one place.

Every retry in the agent doubles a wait up to a cap (:func:`doubling`); what
differs is the policy around it:

- :func:`restart_delay`: a crashed child (the first retry is free);
- :func:`load_retry_delay`: a model whose load keeps failing (no free retry,
  and soon longer than any client waits);
- :class:`Backoff`: the dispatcher connection, with full jitter so a fleet
  does not come back in lock-step.

All pure: no clock, no reactor; randomness is injected.
"""

from __future__ import annotations

import math
import random as _random
from typing import Callable


def doubling(n: int, base: float, cap: float) -> float:
    """``base * 2**n`` capped at ``cap``, for any ``n >= 0`` (no overflow)."""
    if n >= 1024:  # 2.0 ** 1024 overflows; any positive base has long reached the cap
        return cap
    return min(cap, base * 2.0 ** max(n, 0))


def restart_delay(failures: int, base: float = 1.0, cap: float = 60.0) -> float:
    """Seconds to wait before the next start after ``failures`` in a row.

    The first failure is retried at once (a one-off crash costs nothing);
    after that the delay doubles from ``base`` up to ``cap``.
    """
    if failures <= 1:
        return 0.0
    return doubling(failures - 2, base, cap)


def load_retry_delay(failures: int, first: float = 15.0, repeat: float = 300.0, cap: float = 600.0) -> float:
    """Seconds to wait before loading a model again after ``failures`` loads
    in a row ended on their own (bad file, crash at load, timeout).

    Such a failure repeats until a person acts, so there is no free retry:
    15 s after the first, then 5 minutes, then 10.  From the second failure
    on, the wait is longer than any client honours as Retry-After (OpenAI's
    SDK waits up to 2 minutes and gives up beyond that), so clients'
    automatic retries never each start a failing child.
    """
    if failures <= 0:
        return 0.0
    if failures == 1:
        return first
    return doubling(failures - 2, repeat, cap)


class Backoff:
    """Capped exponential backoff with full jitter.

    The n-th consecutive delay is drawn uniformly from ``[0, min(cap, base *
    2**n)]`` ("full jitter"), so a fleet of nodes that lost the same
    dispatcher does not come back in lock-step.  ``random`` is injected (a
    callable returning a float in ``[0, 1)``) so tests can pin it.
    """

    def __init__(self, base: float, cap: float, random: Callable[[], float] = _random.random) -> None:
        if not (math.isfinite(base) and math.isfinite(cap)) or base <= 0 or cap < base:
            raise ValueError(f"backoff needs 0 < base <= cap, both finite; got base={base!r}, cap={cap!r}")
        self.base = base
        self.cap = cap
        self._random = random
        #: Delays handed out since the last :meth:`reset`.
        self.attempts = 0

    @property
    def ceiling(self) -> float:
        """The upper bound of the next delay."""
        return doubling(self.attempts, self.base, self.cap)

    def next_delay(self) -> float:
        """Return the next delay in seconds; the ceiling grows (up to the cap)."""
        ceiling = self.ceiling
        self.attempts += 1
        return min(ceiling, max(0.0, self._random() * ceiling))

    def reset(self) -> None:
        """Start over from ``base``: called after any success."""
        self.attempts = 0
