"""Probing a ready child on demand, and judging what the probe says.

Two checks of a child that answers ``/health``: after a request to it failed
(:meth:`ChildHealth.after_failure`: one readiness probe; a child that fails
it is replaced) and the opt-in inference probe
(:meth:`ChildHealth.inference`: a 1-token answer; INFERENCE_PROBE_FAILURES
failures in a row replace it).  A verdict only counts for the child that was
probed: ``still_serving(generation)`` says whether it is still the ready
one, and ``replace(code, message, why)`` (the supervisor's transition)
replaces it.  Log lines keep the supervisor's namespace.
"""

from __future__ import annotations

from typing import Callable

from twisted.internet.defer import Deferred
from twisted.logger import Logger

from rolemesh.children import failures as child_failures
from rolemesh.children.probes import ChildProbes
from rolemesh.children.restart_policy import INFERENCE_PROBE_FAILURES, RestartPolicy
from rolemesh.children.views import ChildEndpoint
from rolemesh.config.file import ModelConfig

__all__ = ["ChildHealth"]

log = Logger(namespace="rolemesh.supervisor")


class ChildHealth:
    """The on-demand probes of one device's ready child, and their verdicts."""

    def __init__(self, name: str, probes: ChildProbes, policy: RestartPolicy,
                 still_serving: Callable[[int], bool], replace: Callable[[str, str, str], bool]) -> None:
        self.name = name
        self._probes = probes
        self._policy = policy
        self._still_serving = still_serving
        self._replace = replace

    def after_failure(self, endpoint: ChildEndpoint, model: ModelConfig, generation: int,
                      after: str) -> "Deferred[bool]":
        """Probe the child once; replace it if it fails.  Fires True if it was replaced."""
        model_id = model.model_id
        d = self._probes.readiness(endpoint.base_url, model.served_name)
        return d.addErrback(lambda _: False).addCallback(
            lambda ok: self._health_judged(ok is True, generation, model_id, after))

    def _health_judged(self, ok: bool, generation: int, model_id: str, after: str) -> bool:
        if ok or not self._still_serving(generation):
            return False
        log.warn("llama-server on {device} failed a health probe after {after}; restarting",
                 device=self.name, after=after)
        return self._replace("unhealthy", child_failures.unhealthy(model_id, after, self.name),
                             f"unhealthy after {after}")

    def inference(self, endpoint: ChildEndpoint, model: ModelConfig, generation: int) -> "Deferred[bool]":
        """Ask the child for a 1-token answer; fires True if it answered."""
        d = self._probes.inference(endpoint.base_url, model)
        return d.addErrback(lambda _: False).addCallback(
            lambda ok: self._inference_judged(ok is True, generation, model))

    def _inference_judged(self, ok: bool, generation: int, model: ModelConfig) -> bool:
        if not self._still_serving(generation):
            return False
        if ok:
            self._policy.inference_failures = 0
            return True
        replace = self._policy.inference_failed()
        log.warn("llama-server for {model} on {device} failed an inference probe ({count} of {limit} in a row)",
                 model=model.model_id, device=self.name, count=self._policy.inference_failures,
                 limit=INFERENCE_PROBE_FAILURES)
        if replace:
            self._replace("inference_probe_failed", child_failures.inference_probe_failed(model.model_id, self.name),
                          "failed its inference probes")
        return False
