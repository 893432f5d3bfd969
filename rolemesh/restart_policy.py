"""What a device supervisor does after a child fails: the policy, apart
from the mechanism (as ``twisted.runner.procmon`` keeps them apart).

Pure functions decide (how long to back off, whether a failure was a port
collision, whether a load may be retried in safe mode); :class:`RestartPolicy`
holds their memory as plain attributes, per model.  No reactor: the caller
passes the time.  The delays themselves are :mod:`rolemesh.backoff`'s.
"""

from __future__ import annotations

import re
import signal
from typing import Dict, Iterable, Optional

import attr

from rolemesh import diagnosis
from rolemesh.backoff import load_retry_delay, restart_delay
from rolemesh.config import ModelConfig

#: A child up at least this long before it fails starts a fresh failure count.
STABLE_AFTER_S = 30.0
#: How often a port collision between pick and bind is retried.
BIND_RETRIES = 3
#: Inference probes failed in a row before the child is replaced.
INFERENCE_PROBE_FAILURES = 3

_BIND_FAILURE = re.compile(r"couldn't bind|address already in use", re.IGNORECASE)


def retry_after_seconds(delay: float) -> int:
    """Retry-After seconds for a delay: whole seconds, at least 1."""
    return max(1, int(delay + 0.999))


def killed_from_outside(exit: diagnosis.Exit) -> bool:
    """SIGKILL/SIGTERM/SIGINT while loading came from outside (a person, the
    OOM killer): worth one more try at once, like a crash of a ready child."""
    return exit.signal in (signal.SIGKILL, signal.SIGTERM, signal.SIGINT)


def was_stable(now: float, ready_at: Optional[float]) -> bool:
    """The child had been ready for :data:`STABLE_AFTER_S` or longer."""
    return ready_at is not None and now - ready_at >= STABLE_AFTER_S


def bind_failed(lines: Iterable[str]) -> bool:
    """The child's output says its port was taken."""
    return any(_BIND_FAILURE.search(line) for line in lines)


def runs_safe(model: ModelConfig) -> bool:
    """The model's own arguments already ask for ``--no-repack``."""
    return any(flag == diagnosis.SAFE_FLAG and value not in (None, False) for flag, value in model.server_args)


def safe_mode_warning(model_id: str, device: str) -> str:
    """What an operator is told about a model that now runs in safe mode."""
    return (
        f"model {model_id!r} died of SIGILL (illegal instruction) while loading on {device} and "
        f"now runs with --{diagnosis.SAFE_FLAG}: this llama-server build uses CPU instructions this machine "
        "cannot run; install the portable build (scripts/install-llama-server.sh)"
    )


@attr.s(auto_attribs=True)
class RestartPolicy:
    """One device's failure memory: failures in a row and the earliest next
    try per model, models that run in safe mode, retries of this child."""

    #: model id -> failures in a row.
    failures: Dict[str, int] = attr.Factory(dict)
    #: model id -> reactor time before which a load is refused (backing off).
    retry_at: Dict[str, float] = attr.Factory(dict)
    #: model id -> the warning: models that died of SIGILL at load run with --no-repack.
    safe_mode: Dict[str, str] = attr.Factory(dict)
    #: Port collisions retried for the current model.
    bind_retries: int = 0
    #: Inference probes the current child failed in a row.
    inference_failures: int = 0

    def record_failure(self, model_id: str, now: float, ready_at: Optional[float], load: bool) -> float:
        """Count a failure in a row; returns the back-off before the next try
        (a load failure's, or a crash's, whose first retry is free)."""
        if was_stable(now, ready_at):
            self.failures[model_id] = 0
        failures = self.failures.get(model_id, 0) + 1
        self.failures[model_id] = failures
        delay = load_retry_delay(failures) if load else restart_delay(failures)
        self.retry_at[model_id] = now + delay
        return delay

    def stopped(self, model_id: str, now: float, ready_at: Optional[float]) -> None:
        """A stop we asked for: a child that had been stable clears the count."""
        if was_stable(now, ready_at):
            self.failures[model_id] = 0

    def backing_off(self, model_id: str, now: float) -> float:
        """Seconds until ``model_id`` may load again (<= 0: it may now)."""
        return self.retry_at.get(model_id, 0.0) - now

    def retry_bind(self, lines: Iterable[str]) -> bool:
        """A port collision not yet retried too often: count it, say retry."""
        if self.bind_retries < BIND_RETRIES and bind_failed(lines):
            self.bind_retries += 1
            return True
        return False

    def enter_safe_mode(self, model: ModelConfig, device: str) -> Optional[str]:
        """After a SIGILL at load: the warning if the model should be retried
        once with ``--no-repack`` (llama.cpp's repacked kernels are where AMX /
        AVX-512 code runs); None if it already runs that way."""
        if model.model_id in self.safe_mode or runs_safe(model):
            return None
        warning = self.safe_mode[model.model_id] = safe_mode_warning(model.model_id, device)
        return warning

    def inference_failed(self) -> bool:
        """Count a failed inference probe; True once the child should go."""
        self.inference_failures += 1
        return self.inference_failures >= INFERENCE_PROBE_FAILURES
