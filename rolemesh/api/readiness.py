"""``GET /ready``: can this agent take work right now?  A pure decision.

Liveness (``GET /health``) only says the process answers.  Readiness is what
a load balancer, a Kubernetes ``readinessProbe`` or a dispatcher asks before
sending traffic, so it is 200 only when every condition holds, and 503
naming the first that does not:

1. ``listening``: the API port is bound;
2. ``devices``: the backend discovered at least one device;
3. ``preload``: models to preload at start-up have finished loading (or
   failed: a failed preload is logged and retried on demand, it does not
   keep the node out of service forever);
4. ``draining``: the agent is not draining for shutdown;
5. ``dispatcher``: registered with the dispatcher, when one is configured.
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

import attr

from rolemesh.fleet.dispatcher import REGISTERED, DispatcherState


@attr.s(auto_attribs=True, frozen=True)
class Check:
    """One readiness condition and what was seen."""

    name: str
    ok: bool
    detail: str


@attr.s(auto_attribs=True, frozen=True)
class Readiness:
    """Every condition, in the order they are judged."""

    checks: Tuple[Check, ...]

    @property
    def ready(self) -> bool:
        return all(c.ok for c in self.checks)

    @property
    def failing(self) -> Optional[Check]:
        for check in self.checks:
            if not check.ok:
                return check
        return None

    def to_json(self) -> Dict[str, Any]:
        failing = self.failing
        return {
            "ready": failing is None,
            "failing": None if failing is None else f"{failing.name}: {failing.detail}",
            "checks": {c.name: {"ok": c.ok, "detail": c.detail} for c in self.checks},
        }


def decide(
    *,
    listening: bool,
    devices: int,
    preloading: int,
    draining: bool,
    dispatcher_state: Optional[DispatcherState] = None,
) -> Readiness:
    """Judge readiness from plain facts (``dispatcher_state`` None: standalone)."""
    checks = [
        Check("listening", listening, "the API port is bound" if listening else "the API port is not bound yet"),
        Check("devices", devices > 0,
              f"{devices} device{'s' if devices != 1 else ''} discovered" if devices else "no device discovered"),
        Check("preload", preloading == 0,
              "nothing left to preload" if preloading == 0 else f"still preloading {preloading} model(s)"),
        Check("draining", not draining, "draining for shutdown" if draining else "not draining"),
    ]
    if dispatcher_state is None:
        checks.append(Check("dispatcher", True, "standalone (no dispatcher_base_url)"))
    elif dispatcher_state == REGISTERED:
        checks.append(Check("dispatcher", True, "registered"))
    else:
        checks.append(Check("dispatcher", False, f"not registered with the dispatcher ({dispatcher_state})"))
    return Readiness(tuple(checks))
