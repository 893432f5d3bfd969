"""Where the dispatcher client stands with its dispatcher, and how long it
waits before it tries again.

:class:`DispatcherLink` is the connection's state machine: unregistered,
registered, or unreachable (any failure); the time of the last answered-OK
request; and, across failures, a jittered back-off after transient ones
(down, slow, overloaded) and the slow retry after refusals (a bad token, a
wrong URL).  The log speaks once per change of the dispatcher's health, not
once per attempt: the first failure of a kind, and the recovery, with how
long it was down and how many attempts failed.  It also tells the node's
feed when the dispatcher comes up or goes down (``dispatcher_up`` /
``dispatcher_down``).  No I/O but the log and the clock it is given.
"""

from __future__ import annotations

from typing import Optional

from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger

from rolemesh.base.backoff import Backoff
from rolemesh.fleet.protocol import (
    AUTH,
    REGISTERED,
    TRANSIENT,
    UNREACHABLE,
    UNREGISTERED,
    DispatcherState,
    Outcome,
    RequestKind,
)
from rolemesh.node.feed import DISPATCHER_DOWN, DISPATCHER_UP, NodeFeed

__all__ = ["DispatcherLink"]


class DispatcherLink:
    """The client's standing with one dispatcher (shown as ``display_url``)."""

    def __init__(self, display_url: str, clock: IReactorTime, backoff: Backoff, slow_retry: float,
                 log: Optional[Logger] = None) -> None:
        self.display_url = display_url
        self._clock = clock
        self.backoff = backoff
        #: Delay between attempts once the dispatcher refused us (401/403/4xx).
        self.slow_retry = slow_retry
        self.log = log if log is not None else Logger(namespace="rolemesh.fleet.dispatcher.DispatcherClient")
        self.state: DispatcherState = UNREGISTERED
        #: ``clock.seconds()`` of the last answered-OK request, or None.
        self.last_success: Optional[float] = None
        #: The dispatcher knows the node (its registration was answered OK).
        self.registered = False
        #: A registration was sent: the dispatcher may know the node (deregister on stop).
        self.maybe_known = False
        #: The node id of the last registration sent.
        self.node_id: Optional[str] = None
        self._problem: Optional[Outcome] = None
        self._problem_since: Optional[float] = None
        self._failed_attempts = 0
        self._told_state: Optional[DispatcherState] = None

    def succeeded(self) -> None:
        """A request was answered OK."""
        self.state = REGISTERED if self.registered else UNREGISTERED
        self.last_success = self._clock.seconds()
        self.backoff.reset()
        self._recovered()

    def forgotten(self) -> None:
        """The dispatcher is up (it answered) but does not know the node,
        e.g. it restarted: register again, at once."""
        self.registered = False
        self.state = UNREGISTERED
        self.last_success = self._clock.seconds()
        self.backoff.reset()
        self._recovered()

    def deregistered(self) -> None:
        """The node said goodbye (whatever the answer)."""
        self.registered = False
        self.maybe_known = False
        self.state = UNREGISTERED

    def _recovered(self) -> None:
        problem = self._problem
        if problem is None:
            return
        now = self._clock.seconds()
        since = self._problem_since if self._problem_since is not None else now
        fields = {
            "dispatcher": self.display_url,
            "down_s": round(now - since, 3),
            "failed_attempts": self._failed_attempts,
        }
        if problem == TRANSIENT:
            self.log.info(
                "dispatcher reachable again after {down_s}s and {failed_attempts} failed attempts", **fields
            )
        else:
            self.log.info("dispatcher accepts this node again after {down_s}s", **fields)
        self._problem = None
        self._problem_since = None
        self._failed_attempts = 0

    def failed(self, kind: RequestKind, outcome: Outcome, code: Optional[int], detail: str) -> float:
        """Record a failed request; log only if the kind of failure changed.
        Returns the delay before the next attempt."""
        self.state = UNREACHABLE
        self._failed_attempts += 1
        if outcome == TRANSIENT:
            delay = self.backoff.next_delay()
        else:
            delay = self.slow_retry
        if outcome != self._problem:
            if self._problem is None:
                self._problem_since = self._clock.seconds()
            self._problem = outcome
            reason = detail if code is None else (f"HTTP {code}: {detail}" if detail else f"HTTP {code}")
            fields = {"dispatcher": self.display_url, "request": kind, "code": code, "reason": reason}
            if outcome == TRANSIENT:
                self.log.warn(  # noqa: G010 - twisted.logger.Logger has warn(), not warning()
                    "dispatcher unreachable ({reason}); retrying in the background "
                    "with backoff up to {cap}s, local serving continues",
                    cap=self.backoff.cap,
                    **fields,
                )
            elif outcome == AUTH:
                self.log.error(
                    "configuration error: dispatcher rejected our token (HTTP {code} on {request}); "
                    "check dispatcher_token; retrying every {retry_s}s",
                    retry_s=self.slow_retry,
                    **fields,
                )
            else:
                self.log.error(
                    "dispatcher rejected the {request} request ({reason}); "
                    "check dispatcher_base_url; retrying every {retry_s}s",
                    retry_s=self.slow_retry,
                    **fields,
                )
        return delay

    def tell(self, feed: Optional[NodeFeed]) -> None:
        """``dispatcher_up``/``dispatcher_down`` on the node's feed, on change."""
        state = self.state
        if feed is None or state == self._told_state or state == UNREGISTERED:
            return
        self._told_state = state
        feed.publish(DISPATCHER_UP if state == REGISTERED else DISPATCHER_DOWN, None, None,
                     dispatcher=self.display_url, state=str(state))
