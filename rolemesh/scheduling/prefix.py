"""Prefix affinity: send a prompt to the device whose llama-server cache
already holds its beginning.  Pure: no I/O, no tokenizer.

llama-server keeps each slot's KV cache and reuses the longest common
prefix of the next prompt.  When a model runs on several devices, a
conversation's turns spread over them unless the agent remembers where each
prefix went.  :func:`prefix_hashes` cuts a request's prompt into a few
cumulative hashes (one per chat message, or per block of characters for a
plain prompt); :class:`PrefixMemory` remembers, for each hash, the device
that last served it (bounded, least recently used first out, and a device's
entries forgotten when its child restarts or switches); :func:`affine_choice`
prefers that device unless it is clearly busier than another.  The slot
is llama-server's own choice (prompt similarity, and its host-memory prompt
cache): measured, that keeps 96-97% of a conversation's later prompt tokens
cached on the device, so no ``id_slot`` is set (docs/operations/tenants.md, "Which slot").
"""

from __future__ import annotations

import collections
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

#: Characters per block of a plain (completions) prompt.
BLOCK_CHARS = 512
#: Hashes per request at most: chat messages or prompt blocks past this many
#: are folded into the last one (the cache reuses a *prefix*: the first ones matter).
MAX_HASHES = 32


def prefix_hashes(payload: Mapping[str, Any]) -> List[int]:
    """Cumulative hashes of the prompt's prefixes, shortest first.

    Chat (OpenAI's ``messages``, Anthropic's, the Responses API's
    ``input``): one hash after each message (role and content), so a later
    turn, which repeats the earlier messages, shares the earlier turn's
    hashes; before them one of the system prompt (``system``,
    ``instructions``) and the tools, where the request has them.
    Completions: one after each :data:`BLOCK_CHARS` characters of the prompt
    (and its end).  Python's ``hash`` of a tuple: C speed, computed once per
    string; stable within the process, which is all the memory needs.
    Total: any JSON body gives a list (it runs before the body is checked
    by llama-server)."""
    out: List[int] = []
    h = 0
    # What comes before the turns, as each API shapes it: Anthropic's
    # ``system``, the Responses API's ``instructions``, and the tools: one
    # hash, the first.
    head = payload.get("system") or payload.get("instructions")
    tools = payload.get("tools")
    if head or tools:
        h = hash(("head", head if isinstance(head, str) else repr(head), repr(tools) if tools else None))
        out.append(h)
    messages = payload.get("messages")
    if messages is None:  # the Responses API's turns: a list of items, or one text
        given = payload.get("input")
        messages = [{"role": "user", "content": given}] if isinstance(given, str) else given
    if isinstance(messages, list):
        for message in messages[:MAX_HASHES]:
            if isinstance(message, dict):
                role, content = message.get("role"), message.get("content")
                # Anything but a string (a list of parts, or a client's
                # mistake that llama-server will refuse) by its repr: a hash
                # of a dict or a list would raise.
                if not isinstance(content, str):
                    content = repr(content)
                if not isinstance(role, str):
                    role = repr(role)
                h = hash((h, role, content))
            else:
                h = hash((h, repr(message)))
            out.append(h)
        return out
    prompt = payload.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str) or not prompt:
        return out
    end = min(len(prompt), BLOCK_CHARS * MAX_HASHES)
    for start in range(0, end, BLOCK_CHARS):
        h = hash((h, prompt[start:start + BLOCK_CHARS]))
        out.append(h)
    return out


class PrefixMemory:
    """Which device last served each prefix hash: an LRU of ``entries``.

    Entries carry the device's *generation*; :meth:`forget` bumps it (the
    child restarted, switched or stopped: its cache is gone), so a device's
    old entries stop matching at once without a scan."""

    def __init__(self, entries: int) -> None:
        self.entries = max(0, entries)
        self._map: "collections.OrderedDict[int, Tuple[str, int]]" = collections.OrderedDict()
        self._generation: Dict[str, int] = {}
        self.lookups = 0
        self.hits = 0

    def __len__(self) -> int:
        return len(self._map)

    def lookup(self, hashes: Sequence[int]) -> Optional[str]:
        """The device that served the longest remembered prefix, or None."""
        if not hashes or not self.entries:
            return None
        self.lookups += 1
        found = self._map
        generation = self._generation
        for h in reversed(hashes):
            where = found.get(h)
            if where is not None and generation.get(where[0], 0) == where[1]:
                self.hits += 1
                return where[0]
        return None

    def remember(self, hashes: Iterable[int], device: str) -> None:
        """``device`` now holds these prefixes in its cache."""
        if not self.entries:
            return
        entry = (device, self._generation.get(device, 0))
        found = self._map
        for h in hashes:
            found[h] = entry
            found.move_to_end(h)
        while len(found) > self.entries:
            found.popitem(last=False)

    def forget(self, device: str) -> None:
        """``device``'s cache is gone (its child restarted, switched or stopped)."""
        self._generation[device] = self._generation.get(device, 0) + 1

    def resize(self, entries: int) -> None:
        self.entries = max(0, entries)
        while len(self._map) > self.entries:
            self._map.popitem(last=False)

    @property
    def hit_rate(self) -> Optional[float]:
        return self.hits / self.lookups if self.lookups else None

    def to_json(self) -> Dict[str, Any]:
        return {"entries": len(self._map), "capacity": self.entries, "lookups": self.lookups,
                "hits": self.hits, "hit_rate": self.hit_rate}


def affine_choice(pending: Mapping[str, int], preferred: Optional[str], max_imbalance: int) -> Optional[str]:
    """``preferred`` when it is a candidate and holds at most ``max_imbalance``
    more pending requests than the least busy candidate; else None (the
    caller's usual choice: the least busy)."""
    if preferred is None or preferred not in pending:
        return None
    least = min(pending.values())
    return preferred if pending[preferred] - least <= max_imbalance else None
