"""Log observers: readable text by default, one JSON object per line with
``log_format: json`` (structured fields -- device, model, request id, status,
duration -- become JSON keys)."""

from __future__ import annotations

import json
import sys
from typing import IO, Any, Dict

from twisted.logger import (
    FilteringLogObserver,
    ILogObserver,
    LogLevel,
    LogLevelFilterPredicate,
    formatEvent,
    textFileLogObserver,
)
from zope.interface import implementer

_SKIP = frozenset({"log_format", "log_logger", "log_source", "log_io", "log_time", "log_level",
                   "log_namespace", "log_failure", "log_text", "log_flattened", "log_trace",
                   "message", "format", "isError", "system", "time", "failure", "why"})


def event_as_json(event: Dict[str, Any]) -> str:
    """One log event as a JSON line: time, level, namespace, message, fields."""
    level = event.get("log_level")
    record: Dict[str, Any] = {
        "time": event.get("log_time"),
        "level": level.name if level is not None else "info",
        "namespace": event.get("log_namespace"),
        "message": formatEvent(event),
    }
    for key, value in event.items():
        if key in _SKIP or key.startswith("_") or key in record:
            continue
        if isinstance(value, (str, int, float, bool)) or value is None:
            record[key] = value
        elif isinstance(value, (list, tuple, dict)):
            try:
                json.dumps(value)
                record[key] = value
            except (TypeError, ValueError):
                record[key] = repr(value)
    failure = event.get("log_failure")
    if failure is not None:
        record["error"] = failure.getErrorMessage()
        record["traceback"] = failure.getTraceback()
    return json.dumps(record, default=repr)


@implementer(ILogObserver)
class JSONLinesObserver:
    """Writes each event as one JSON object on one line."""

    def __init__(self, stream: IO[str]) -> None:
        self._stream = stream

    def __call__(self, event: Dict[str, Any]) -> None:
        self._stream.write(event_as_json(event) + "\n")
        self._stream.flush()


def make_observer(log_format: str, stream: IO[str], level: LogLevel = LogLevel.info) -> ILogObserver:
    """The agent's observer for ``log_format`` (``text`` or ``json``)."""
    inner = JSONLinesObserver(stream) if log_format == "json" else textFileLogObserver(stream)
    return FilteringLogObserver(inner, [LogLevelFilterPredicate(defaultLogLevel=level)])


def json_logger() -> ILogObserver:
    """For ``twistd --logger rolemesh.logs.json_logger`` (set by the plugin
    when ``--log-format json`` is given)."""
    return make_observer("json", sys.stdout)


__all__ = ["json_logger", "make_observer", "event_as_json", "JSONLinesObserver"]
