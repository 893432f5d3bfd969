"""Which child holds the state a follow-up request needs.

llama-server keeps some state between requests in the child that served
them: a streamed completion armed with ``reasoning_control`` can be steered
by its id (``POST /v1/chat/completions/control``), and a stream sent with an
``X-Conversation-Id`` header can be replayed, looked up and stopped by that
id (``/v1/stream``, ``/v1/streams/lookup``).  A follow-up must reach the
child that holds it and no other: :class:`HeldState` remembers, per id, the
device and the very child (its pid and generation) that served it, so that
a follow-up finds it gone, rather than another child, after a restart.

Pure bookkeeping, bounded: the oldest ids are forgotten first.
"""

from __future__ import annotations

import re
from collections import OrderedDict
from typing import Dict, Optional

import attr

#: The two kinds of id a child holds state under.
COMPLETION = "completion"
CONVERSATION = "conversation"
#: Ids remembered per kind (the oldest go first): far more than a node has in flight.
MOST_HELD = 4096
#: A conversation id the node passes to a child: printable ASCII, bounded.
CONVERSATION_ID = re.compile(rb"^[\x21-\x7e]{1,256}$")
#: A chat completion's id, in the first read of its stream.
_COMPLETION_ID = re.compile(rb'"id"\s*:\s*"([^"\\]{1,200})"')


@attr.s(frozen=True, slots=True, auto_attribs=True)
class Holder:
    """The child that holds an id's state: its device and which child it was."""

    device: str
    model_id: str
    pid: int
    generation: int


def completion_id(first_read: bytes) -> Optional[str]:
    """The completion id in a stream's first read (its first chunk names it), or None."""
    found = _COMPLETION_ID.search(first_read)
    return found.group(1).decode("utf-8", "replace") if found is not None else None


class HeldState:
    """Per kind, id -> :class:`Holder`; at most ``most`` ids each."""

    def __init__(self, most: int = MOST_HELD) -> None:
        self._most = most
        self._held: Dict[str, "OrderedDict[str, Holder]"] = {COMPLETION: OrderedDict(), CONVERSATION: OrderedDict()}

    def remember(self, kind: str, key: str, holder: Holder) -> None:
        held = self._held[kind]
        held.pop(key, None)
        held[key] = holder
        while len(held) > self._most:
            held.popitem(last=False)

    def holder(self, kind: str, key: str) -> Optional[Holder]:
        return self._held[kind].get(key)

    def forget(self, kind: str, key: str) -> None:
        self._held[kind].pop(key, None)
