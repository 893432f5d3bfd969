"""What the dispatcher protocol's messages and answers mean: pure.

The paths the node posts to, the kinds of request, what a status code means
for each (:func:`classify`), the heartbeat interval a dispatcher may ask for
(:func:`asked_interval`), and the client's states.  No I/O and no clock, so
:class:`rolemesh.fleet.dispatcher.DispatcherClient` and its parts decide from
these and the tests check them alone.  See docs/dispatcher-protocol.md.
"""

from __future__ import annotations

import json
from typing import Any, Dict, Optional

from rolemesh.base.enums import StrEnum
from rolemesh.config.file import is_loopback

__all__ = [
    "AUTH", "COALESCE_S", "DEREGISTER_PATH", "EVENTS_PATH", "FORGOTTEN", "HEARTBEAT_PATH", "MAX_ASKED_INTERVAL_S",
    "MIN_ASKED_INTERVAL_S", "OK", "REGISTERED", "REGISTER_PATH", "REJECTED", "TRANSIENT", "UNREACHABLE",
    "UNREGISTERED", "DispatcherState", "Outcome", "RequestKind", "asked_interval", "classify", "json_object",
    "plaintext_off_loopback", "without_userinfo",
]

REGISTER_PATH = "/v1/nodes/register"
HEARTBEAT_PATH = "/v1/nodes/heartbeat"
DEREGISTER_PATH = "/v1/nodes/deregister"
EVENTS_PATH = "/v1/nodes/events"

#: Changes are held this long before they go, so a burst is one message.
COALESCE_S = 0.2
#: The bounds of a heartbeat interval a dispatcher may ask for in its answer
#: (``{"heartbeat_interval_s": N}``): back-pressure, never silence.
MIN_ASKED_INTERVAL_S = 1.0
MAX_ASKED_INTERVAL_S = 300.0


class RequestKind(StrEnum):
    """The three requests the client sends."""

    REGISTER = "register"
    HEARTBEAT = "heartbeat"
    DEREGISTER = "deregister"
    EVENTS = "events"


class Outcome(StrEnum):
    """What one answer (or the lack of one) means; see :func:`classify`."""

    OK = "ok"
    FORGOTTEN = "forgotten"
    AUTH = "auth"
    REJECTED = "rejected"
    TRANSIENT = "transient"


class DispatcherState(StrEnum):
    """Values of :attr:`DispatcherClient.state` (shown by ``/ready``, the
    systemd status line and the ``rolemesh_dispatcher_state`` metric)."""

    UNREGISTERED = "unregistered"
    REGISTERED = "registered"
    UNREACHABLE = "unreachable"


OK = Outcome.OK
FORGOTTEN = Outcome.FORGOTTEN
AUTH = Outcome.AUTH
REJECTED = Outcome.REJECTED
TRANSIENT = Outcome.TRANSIENT

UNREGISTERED = DispatcherState.UNREGISTERED
REGISTERED = DispatcherState.REGISTERED
UNREACHABLE = DispatcherState.UNREACHABLE

_TRANSIENT_CODES = frozenset({408, 425, 429})


def classify(kind: str, code: Optional[int]) -> Outcome:
    """What the dispatcher's answer to a ``kind`` request means.

    ``code`` is the HTTP status, or ``None`` when no answer came (connection
    refused, reset, timeout).  ``kind`` is a :class:`RequestKind`.  Returns
    one of ``OK``, ``FORGOTTEN`` (the dispatcher no longer knows the node:
    register again), ``AUTH`` (our token was refused:
    a configuration error), ``REJECTED`` (any other refusal, e.g. a wrong base
    URL or a payload it does not accept) or ``TRANSIENT`` (down, overloaded
    or slow: retry with backoff).
    """
    if code is None:
        return TRANSIENT
    if 200 <= code < 300:
        return OK
    if code in (404, 410) and kind in (RequestKind.HEARTBEAT, RequestKind.DEREGISTER):
        return FORGOTTEN
    if code == 410 and kind == RequestKind.EVENTS:  # 404 there: a dispatcher without the route (see dispatcher_deltas)
        return FORGOTTEN
    if code in (401, 403):
        return AUTH
    if code in _TRANSIENT_CODES or code >= 500:
        return TRANSIENT
    return REJECTED


def plaintext_off_loopback(url: str) -> bool:
    """True for an ``http://`` URL whose host is not loopback: the token and
    every payload would cross the network in the clear."""
    scheme, sep, rest = url.partition("://")
    if scheme.lower() != "http" or not sep:
        return False
    host = rest.partition("/")[0].rpartition("@")[2]
    if host.startswith("["):
        host = host[: host.find("]") + 1]
    else:
        host = host.partition(":")[0]
    return not is_loopback(host)


def asked_interval(body: str) -> Optional[float]:
    """The ``heartbeat_interval_s`` a dispatcher's JSON answer asks for,
    clamped to [MIN_ASKED_INTERVAL_S, MAX_ASKED_INTERVAL_S]; None if it asks none."""
    answer = json_object(body)
    value = answer.get("heartbeat_interval_s")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
        return None
    return min(MAX_ASKED_INTERVAL_S, max(MIN_ASKED_INTERVAL_S, float(value)))


def json_object(body: str) -> Dict[str, Any]:
    try:
        answer = json.loads(body) if body else {}
    except ValueError:
        return {}
    return answer if isinstance(answer, dict) else {}


def without_userinfo(url: str) -> str:
    """``url`` with any ``user:password@`` removed, for logs."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url
    host, slash, path = rest.partition("/")
    return f"{scheme}://{host.rpartition('@')[2]}{slash}{path}"
