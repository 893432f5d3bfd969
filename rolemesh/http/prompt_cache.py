"""Prompt tokens served from llama-server's cache vs processed, per device and model.

llama-server ends every answer with a ``timings`` object: ``cache_n``, the
prompt tokens it reused from the slot's KV cache, and ``prompt_n``, the
prompt tokens it had to process (``cache_n + prompt_n`` is the prompt).  A
non-streamed answer carries it as its last key; a stream, in its last event
before ``data: [DONE]`` (with ``timings_per_token``, in every event: the last
one counts; with ``n`` > 1, one per choice: the last one counts, as a
non-streamed answer reports one).  Pure, no I/O:

* :func:`prompt_timings` finds the last ``timings`` object in the tail of an
  answer with a byte search and two small matches, never a JSON parse of
  the body (the relay does not parse what it relays).  The pattern cannot
  occur inside a JSON string: there every ``"`` is escaped.
* :class:`PromptCacheTally` adds them up per ``(device, model)`` since the
  agent started: the ``rolemesh_prompt_tokens_cached_total`` and
  ``rolemesh_prompt_tokens_processed_total`` counters, the inventory's
  per-device ``prompt_tokens``, and the heartbeat's per-model
  ``prompt_cache_hit_rate`` (cached / (cached + processed)): where
  conversations stick, in tokens.
"""

from __future__ import annotations

import re
from typing import Any, Dict, Iterable, List, Optional, Tuple

#: What begins llama-server's ``timings`` object (compact JSON, as it writes it).
_TIMINGS = b'"timings":'
_CACHE_N = b'"cache_n":'
_PROMPT_N = b'"prompt_n":'
#: A count after its key: digits, then what ends a JSON number.
_COUNT = re.compile(rb"[ \t\r\n]*([0-9]+)[,}\s]")


def prompt_timings(tail: bytes) -> Optional[Tuple[int, int]]:
    """``(cache_n, prompt_n)`` of the last whole ``timings`` object in
    ``tail``; None when there is none, or it has no ``prompt_n`` of 0 or
    more (llama-server writes ``-1`` for "not measured").  A build without
    ``cache_n`` counts 0 cached.  Byte searches only (a regular expression
    over the whole object cost ten times as much)."""
    at = tail.rfind(_TIMINGS)
    while at >= 0:
        start = at + len(_TIMINGS)
        end = tail.find(b"}", start)  # the object is flat: its first } ends it
        opened = tail.find(b"{", start, end) if end >= 0 else -1
        if opened >= 0 and not tail[start:opened].strip() and tail.find(b"{", opened + 1, end) < 0:
            processed = _count(tail, _PROMPT_N, opened, end)
            if processed is None:
                return None
            cached = _count(tail, _CACHE_N, opened, end)
            return (cached if cached is not None else 0, processed)
        at = tail.rfind(_TIMINGS, 0, at)  # cut off at the end of the tail (or not an object): the one before
    return None


#: Anthropic's Messages answers carry no ``timings``: their ``usage`` says it
#: (``cache_read_input_tokens``: from the cache; ``input_tokens``: processed),
#: in a stream's first event (``message_start``), else in the answer.
_USAGE = b'"usage":'
_CACHE_READ = b'"cache_read_input_tokens":'
_INPUT = b'"input_tokens":'


def anthropic_usage(data: bytes) -> Optional[Tuple[int, int]]:
    """``(cached, processed)`` prompt tokens of the first ``usage`` object
    in ``data`` (a Messages answer, or its stream's first read); None
    without one.  Byte searches, like :func:`prompt_timings`."""
    at = data.find(_USAGE)
    if at < 0:
        return None
    opened = data.find(b"{", at + len(_USAGE))
    end = data.find(b"}", opened) if opened >= 0 else -1
    if end < 0 or data[at + len(_USAGE):opened].strip():
        return None
    processed = _count(data, _INPUT, opened, end)
    if processed is None:
        return None
    cached = _count(data, _CACHE_READ, opened, end)
    return (cached if cached is not None else 0, processed)


def _count(tail: bytes, key: bytes, opened: int, end: int) -> Optional[int]:
    """The whole number after ``key`` within ``tail[opened:end + 1]``, if any."""
    at = tail.find(key, opened, end)
    if at < 0:
        return None
    found = _COUNT.match(tail, at + len(key), end + 1)
    return int(found.group(1)) if found is not None else None


class PromptCacheTally:
    """Prompt tokens cached and processed, per ``(device, model)``, since start.

    Counters only grow (they are Prometheus counters); a model or device a
    reload removes keeps its figures."""

    def __init__(self) -> None:
        #: (device, model) -> [cached, processed].
        self.counts: Dict[Tuple[str, str], List[int]] = {}

    def add(self, device: Optional[str], model: Optional[str], cached: int, processed: int) -> None:
        """One answer's figures (ignored without a device and a model)."""
        if device is None or model is None:
            return
        counts = self.counts.get((device, model))
        if counts is None:
            self.counts[(device, model)] = [cached, processed]
        else:
            counts[0] += cached
            counts[1] += processed

    def get(self, device: str, model: str) -> Tuple[int, int]:
        """``(cached, processed)`` of one pair (0, 0 before any)."""
        counts = self.counts.get((device, model))
        return (counts[0], counts[1]) if counts is not None else (0, 0)

    def per_model(self, models: Iterable[str]) -> Dict[str, Dict[str, Any]]:
        """Per model (each of ``models``, and any counted): its tokens over
        all devices and the share served from cache (None before any)."""
        totals: Dict[str, List[int]] = {model: [0, 0] for model in models}
        for (_, model), (cached, processed) in self.counts.items():
            total = totals.setdefault(model, [0, 0])
            total[0] += cached
            total[1] += processed
        return {model: _json(cached, processed) for model, (cached, processed) in totals.items()}

    def hit_rates(self, models: Iterable[str]) -> Dict[str, Optional[float]]:
        """Per model: cached / (cached + processed) prompt tokens over all
        devices since start; None before any answer reported them (the
        heartbeat's ``prompt_cache_hit_rate``)."""
        return {model: entry["hit_rate"] for model, entry in self.per_model(models).items()}

    def device_json(self, device: str) -> Dict[str, Dict[str, Any]]:
        """The models served on ``device`` so far: their tokens and hit rate
        (the inventory's per-device ``prompt_tokens``)."""
        return {model: _json(counts[0], counts[1])
                for (name, model), counts in sorted(self.counts.items()) if name == device}


def _json(cached: int, processed: int) -> Dict[str, Any]:
    total = cached + processed
    return {"cached": cached, "processed": processed, "hit_rate": cached / total if total else None}
