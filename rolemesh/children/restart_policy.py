"""What a device supervisor does after a child fails: the policy, apart
from the mechanism (as ``twisted.runner.procmon`` keeps them apart).

Pure functions decide (how long to back off, whether a failure was a port
collision, whether a load may be retried in safe mode); :class:`RestartPolicy`
holds their memory as plain attributes, per model: two runs of failures (failed
loads, ended by a load that becomes ready; crashes of a ready child, ended by a
child the agent stopped while it served) and each model's :class:`BackOff`.  No reactor: the caller
passes the time.  The delays themselves are :mod:`rolemesh.base.backoff`'s.
"""

from __future__ import annotations

import functools
import re
import signal
from typing import Any, Dict, Iterable, List, Optional, Tuple

import attr

from rolemesh.base.backoff import load_retry_delay, restart_delay
from rolemesh.base.enums import StrEnum
from rolemesh.children import diagnosis
from rolemesh.children.llama_args import build_argv
from rolemesh.config.file import ModelConfig

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


def same_command(old: ModelConfig, new: ModelConfig) -> bool:
    """Whether two records of a model start the same child: one llama-server
    command line on the same devices (what a reload keeps running)."""
    return (getattr(old, "devices", ()) == getattr(new, "devices", ())
            and build_argv("llama-server", old, 0) == build_argv("llama-server", new, 0))


def safe_mode_warning(model_id: str, device: str) -> str:
    """What an operator is told about a model that now runs in safe mode."""
    return (
        f"model {model_id!r} died of SIGILL (illegal instruction) while loading on {device} and "
        f"now runs with --{diagnosis.SAFE_FLAG}: this llama-server build uses CPU instructions this machine "
        "cannot run; install the portable build (scripts/install-llama-server.sh)"
    )


class Schedule(StrEnum):
    """Which back-off schedule a failure follows (:mod:`rolemesh.base.backoff`)."""

    #: A load that ended on its own (bad file, crash at load, timeout): it
    #: repeats until a person acts, so no free retry (:func:`load_retry_delay`).
    LOAD = "load"
    #: A child killed from outside while loading, one that could not be
    #: spawned, or a ready child that crashed: the first retry is free
    #: (:func:`restart_delay`).
    RESTART = "restart"


class History(StrEnum):
    """Which run of failures a failure adds to (each ends differently)."""

    #: Loads that did not become ready; a load that does ends the run.
    LOAD = "load"
    #: Ready children that ended on their own; a child of the model that the
    #: agent stopped while it served, or one up STABLE_AFTER_S, ends the run.
    CRASH = "crash"


def schedule_delay(schedule: Schedule, failures: int) -> float:
    """Seconds of back-off after ``failures`` in a row on ``schedule``."""
    return load_retry_delay(failures) if schedule == Schedule.LOAD else restart_delay(failures)


@functools.cache
def schedule_steps(schedule: Schedule) -> Tuple[float, ...]:
    """The schedule's delays, failure 1 first, up to its cap (then it stays there)."""
    steps: List[float] = []
    n = 1
    while True:
        delay = schedule_delay(schedule, n)
        if steps and delay == steps[-1] and n > 2:
            return tuple(steps)
        steps.append(delay)
        n += 1


def schedule_text(schedule: Schedule) -> str:
    """``0 s, 1 s, 2 s, ... 60 s`` -- what the docs and the log show."""
    return ", ".join(f"{delay:g} s" for delay in schedule_steps(schedule)) + " (then the last, each time)"


@attr.s(auto_attribs=True, frozen=True)
class BackOff:
    """A model's back-off on one device: the failure that set it, and until when."""

    model: str
    #: Failures in a row of ``history`` (this one included).
    failures: int
    history: History
    schedule: Schedule
    #: Seconds refused from ``at``; 0: retried at once.
    delay: float
    #: When the failure was seen, and the end of the refusal (reactor seconds).
    at: float
    until: float
    #: The failure's stable code and one-line message (the refusals repeat it).
    code: Optional[str] = None
    message: Optional[str] = None

    @property
    def step(self) -> int:
        """The position on the schedule, 1-based (the last step repeats)."""
        return min(self.failures, len(schedule_steps(self.schedule)))

    def remaining(self, now: float) -> float:
        return self.until - now

    def why(self) -> str:
        """The reason in words, for the log line."""
        kind = "failed load" if self.history == History.LOAD else "crash"
        ordinal = {1: "1st", 2: "2nd", 3: "3rd"}.get(self.failures, f"{self.failures}th")
        return (f"{ordinal} {kind} in a row; step {self.step} of the {self.schedule} schedule "
                f"({schedule_text(self.schedule)})")

    def to_json(self, now: float) -> Dict[str, Any]:
        return {
            "model": self.model,
            "until": self.until,
            "retry_after_s": retry_after_seconds(self.remaining(now)),
            "failures": self.failures,
            "history": self.history.value,
            "schedule": self.schedule.value,
            "step": self.step,
            "code": self.code,
            "message": self.message,
        }


@attr.s(auto_attribs=True)
class RestartPolicy:
    """One device's failure memory, per model: its runs of failures, its
    back-off, whether it runs in safe mode; and retries of the current child.

    The back-off belongs to the (model, device) that failed: another model
    on the device is never held back by it."""

    #: History -> model id -> failures in a row.
    runs: Dict[History, Dict[str, int]] = attr.Factory(lambda: {History.LOAD: {}, History.CRASH: {}})
    #: model id -> the latest failure's back-off (refused while it runs).
    backoffs: Dict[str, BackOff] = attr.Factory(dict)
    #: model id -> the warning: models that died of SIGILL at load run with --no-repack.
    safe_mode: Dict[str, str] = attr.Factory(dict)
    #: Port collisions retried for the current model.
    bind_retries: int = 0
    #: Inference probes the current child failed in a row.
    inference_failures: int = 0
    #: model id -> the record (its command) the memory above is about: see :meth:`about`.
    records: Dict[str, ModelConfig] = attr.Factory(dict)

    def about(self, model: ModelConfig) -> None:
        """Make the model's memory about this record.  Failures belong to the
        command that failed: a reload that gives the model another one (the
        fixed file, another ctx_size) starts it clean -- no back-off, run or
        safe mode carried over from a command the config no longer has."""
        known = self.records.get(model.model_id)
        if known is model:
            return
        if known is not None and known != model and not same_command(known, model):
            self.replaced(model)
        self.records[model.model_id] = model

    def replaced(self, model: ModelConfig) -> None:
        """A reload gave the model another command (``model``): forget every
        failure of the one before, even where the command comes back (a reload
        undone) -- what failed was a record the config no longer has."""
        for run in self.runs.values():
            run.pop(model.model_id, None)
        self.backoffs.pop(model.model_id, None)
        self.safe_mode.pop(model.model_id, None)
        self.records[model.model_id] = model

    def record_failure(self, model_id: str, now: float, history: History, schedule: Schedule,
                       ready_at: Optional[float] = None, code: Optional[str] = None,
                       message: Optional[str] = None) -> BackOff:
        """Count a failure in a row of ``history``; returns the back-off it
        sets (a delay of 0: retried at once)."""
        run = self.runs[history]
        if history == History.CRASH and was_stable(now, ready_at):
            run.pop(model_id, None)
        failures = run.get(model_id, 0) + 1
        run[model_id] = failures
        delay = schedule_delay(schedule, failures)
        backoff = self.backoffs[model_id] = BackOff(model_id, failures, history, schedule, delay, now, now + delay,
                                                    code, message)
        return backoff

    def failures(self, model_id: str) -> int:
        """Failures in a row behind the model's latest back-off (0: none)."""
        backoff = self.backoffs.get(model_id)
        return backoff.failures if backoff is not None else 0

    def loaded(self, model_id: str) -> None:
        """A load of the model became ready: its run of failed loads is over."""
        self.runs[History.LOAD].pop(model_id, None)
        self.backoffs.pop(model_id, None)

    def stopped(self, model_id: str, now: float, ready_at: Optional[float], healthy: bool = True) -> None:
        """A stop we asked for (its exit status says nothing): a child that
        served until then (``healthy``: not replaced for failing a probe), or
        had been stable, ends the model's run of crashes."""
        if (healthy and ready_at is not None) or was_stable(now, ready_at):
            self.runs[History.CRASH].pop(model_id, None)

    def backoff(self, model_id: str, now: float) -> Optional[BackOff]:
        """The model's back-off while it runs, else None."""
        backoff = self.backoffs.get(model_id)
        return backoff if backoff is not None and backoff.until > now else None

    def backing_off(self, model_id: str, now: float) -> float:
        """Seconds until ``model_id`` may load again (<= 0: it may now)."""
        backoff = self.backoffs.get(model_id)
        return backoff.until - now if backoff is not None else 0.0

    def active(self, now: float) -> List[BackOff]:
        """The back-offs running now, by model id."""
        return [b for _, b in sorted(self.backoffs.items()) if b.until > now]

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
        self.about(model)
        if model.model_id in self.safe_mode or runs_safe(model):
            return None
        warning = self.safe_mode[model.model_id] = safe_mode_warning(model.model_id, device)
        return warning

    def inference_failed(self) -> bool:
        """Count a failed inference probe; True once the child should go."""
        self.inference_failures += 1
        return self.inference_failures >= INFERENCE_PROBE_FAILURES
