"""How a device supervisor tells a child's failures: messages, codes and
the back-off's log line.

Pure functions of what happened (the model, the exit, the last lines of the
child's output, the back-off the policy set), so the wording and the codes
a dispatcher acts on are checked without a process or a clock.  Their log
lines keep the supervisor's namespace (``rolemesh.supervisor``), as before
they moved here.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

from twisted.logger import Logger

from rolemesh import diagnosis, errors
from rolemesh.config import ModelConfig
from rolemesh.restart_policy import INFERENCE_PROBE_FAILURES, BackOff, retry_after_seconds

__all__ = [
    "ERROR_TAIL_LINES", "crash", "inference_probe_failed", "log_backoff", "refusal", "superseded",
    "timed_out", "unhealthy",
]

log = Logger(namespace="rolemesh.supervisor")

#: Lines of log tail put into a crash message.
ERROR_TAIL_LINES = 12


def refusal(model_id: str, device: str, backoff: Optional[BackOff], now: float) -> Optional[errors.ApiError]:
    """The 503 for ``model_id`` while it backs off on ``device`` (its
    Retry-After: when it will be tried again), else None."""
    if backoff is None:
        return None
    wait = retry_after_seconds(backoff.remaining(now))
    return errors.model_load_failed(
        diagnosis.shorten(
            f"model {model_id!r} failed {backoff.failures} times in a row on {device}; "
            f"next attempt in {wait}s. Last error: {backoff.message or 'unknown'}"
        ),
        retry_after=wait,
    )


def timed_out(model: ModelConfig, what: str, device: str, attempt: List[str]) -> str:
    """The message of a load that ``what`` (never became ready, stalled),
    with the decisive line of the attempt's output if there is one."""
    line = diagnosis.decisive_line(attempt, model.path, model.model_id)
    return diagnosis.shorten(f"model {model.model_id!r} {what} on {device}" + (f"; last error: {line}" if line else ""))


def crash(model: ModelConfig, exit: diagnosis.Exit, tail: List[str]) -> Tuple[str, str]:
    """The code and message of a ready child that ended on its own; ``tail``:
    the last lines of its output (ERROR_TAIL_LINES)."""
    meaning = f" ({exit.meaning})" if exit.meaning else ""
    line = diagnosis.decisive_line(tail, model.path, model.model_id)
    message = diagnosis.shorten(f"llama-server for {model.model_id!r} {exit.how} unexpectedly{meaning}"
                                + (f": {line}" if line else ""))
    return exit.error_code("child_crashed"), message


def superseded(model_id: str, device: str) -> errors.ApiError:
    """What a waiter for ``model_id`` gets when another model became ready."""
    return errors.model_load_failed(f"model {model_id!r} was superseded on {device}")


def unhealthy(model_id: str, after: str, device: str) -> str:
    return f"llama-server for {model_id!r} failed a health probe after {after} on {device}; restarted"


def inference_probe_failed(model_id: str, device: str) -> str:
    return (f"llama-server for {model_id!r} answered /health but failed "
            f"{INFERENCE_PROBE_FAILURES} inference probes in a row on {device}; restarted")


def log_backoff(backoff: BackOff, device: str) -> None:
    """Log the back-off a failure set on ``device``, and why."""
    if backoff.delay > 0:
        log.warn("{model} backs off on {device} for {delay:g}s, loads refused until then: {why}",
                 model=backoff.model, device=device, delay=backoff.delay, why=backoff.why(),
                 failures=backoff.failures, step=backoff.step, schedule=str(backoff.schedule))
    else:
        log.info("{model} will be loaded again on {device} at the next request: {why}",
                 model=backoff.model, device=device, why=backoff.why(),
                 failures=backoff.failures, step=backoff.step, schedule=str(backoff.schedule))
