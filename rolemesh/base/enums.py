"""The base of the agent's named states and outcomes.

A state is an :class:`enum.Enum` member (so a typo is an error and mypy
knows the set), and also the ``str`` of its value, so JSON bodies, log
lines, Prometheus labels and comparisons with plain strings read exactly as
the bare strings did.  Python 3.11's ``enum.StrEnum`` does the same; the
agent supports 3.9.
"""

from __future__ import annotations

import enum


class StrEnum(str, enum.Enum):
    """An enum whose members are their ``str`` value wherever shown or sent."""

    def __str__(self) -> str:
        return str(self.value)

    def __format__(self, spec: str) -> str:
        return str(self.value).__format__(spec)
