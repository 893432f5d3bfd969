"""How a device supervisor tells a child's failures: messages, codes and
the back-off's log line.

Pure functions of what happened (the model, the exit, the last lines of the
child's output, the back-off the policy set), so the wording and the codes
a dispatcher acts on are checked without a process or a clock.  A failure
that counts against a model is an :class:`Account`: its code and message,
the run of failures it extends and the back-off schedule it follows, and the
events it is counted as.  The log lines keep the supervisor's namespace
(``rolemesh.children.supervisor``), as before they moved here.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import attr
from twisted.logger import Logger

from rolemesh.base import errors
from rolemesh.children import diagnosis
from rolemesh.children.restart_policy import (
    INFERENCE_PROBE_FAILURES,
    BackOff,
    History,
    Schedule,
    killed_from_outside,
    retry_after_seconds,
)
from rolemesh.config.file import ModelConfig

__all__ = [
    "ERROR_TAIL_LINES", "Account", "crash", "inference_probe_failed", "load_ended", "log_backoff", "refusal",
    "spawn_failed", "superseded", "timed_out", "unhealthy",
]

log = Logger(namespace="rolemesh.supervisor")

#: Lines of log tail put into a crash message.
ERROR_TAIL_LINES = 12


@attr.s(auto_attribs=True, frozen=True)
class Account:
    """A failure of a model on a device, as the supervisor records it."""

    code: str
    message: str
    #: The run of failures in a row it extends, and the back-off it follows.
    history: History
    schedule: Schedule
    #: The counted events it is (COUNTED_EVENTS of rolemesh.children.supervisor).
    events: Tuple[str, ...]


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


def spawn_failed(device: str, error: Exception) -> Account:
    """A child that could not even be spawned (e.g. the interpreter vanished)."""
    return Account("model_load_failed", f"cannot start llama-server on {device}: {error}", History.LOAD,
                   Schedule.RESTART, ("load_failure",))


def load_ended(model: ModelConfig, device: str, exit: diagnosis.Exit, attempt: List[str]) -> Account:
    """A load whose child ended on its own before it was ready; ``attempt``:
    the attempt's output."""
    message = diagnosis.load_failure(model.model_id, device, exit, attempt, model.path)
    # Killed from outside (a person, the OOM killer): the first retry is
    # free; a load that ended on its own repeats until someone acts.
    schedule = Schedule.RESTART if killed_from_outside(exit) else Schedule.LOAD
    return Account(exit.error_code("model_load_failed"), message, History.LOAD, schedule, ("load_failure",))


def timed_out(model: ModelConfig, what: str, device: str, attempt: List[str]) -> Account:
    """A load that ``what`` (never became ready, stalled), its message with
    the decisive line of the attempt's output if there is one."""
    line = diagnosis.decisive_line(attempt, model.path, model.model_id)
    message = diagnosis.shorten(f"model {model.model_id!r} {what} on {device}"
                                + (f"; last error: {line}" if line else ""))
    return Account("model_load_timeout", message, History.LOAD, Schedule.LOAD, ("load_timeout",))


def crash(model: ModelConfig, exit: diagnosis.Exit, tail: List[str]) -> Account:
    """A ready child that ended on its own; ``tail``: the last lines of its
    output (ERROR_TAIL_LINES).  It counts as a crash and a restart."""
    meaning = f" ({exit.meaning})" if exit.meaning else ""
    line = diagnosis.decisive_line(tail, model.path, model.model_id)
    message = diagnosis.shorten(f"llama-server for {model.model_id!r} {exit.how} unexpectedly{meaning}"
                                + (f": {line}" if line else ""))
    return Account(exit.error_code("child_crashed"), message, History.CRASH, Schedule.RESTART, ("crash", "restart"))


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
