"""Log observers: readable text by default, one JSON object per line with
``log_format: json`` (structured fields -- device, model, request id, status,
duration -- become JSON keys)."""

from __future__ import annotations

import contextlib
import json
import string
import sys
import time
from typing import IO, Any, Callable, Dict, Iterator, List, Optional, Tuple

from twisted.logger import (
    FileLogObserver,
    ILogObserver,
    LogEvent,
    Logger,
    LogLevel,
    formatEvent,
    formatEventAsClassicLogText,
    formatTime,
    timeFormatRFC3339,
)
from zope.interface import implementer

_FORMATTER = string.Formatter()

_SKIP = frozenset({"log_format", "log_logger", "log_source", "log_io", "log_time", "log_level",
                   "log_namespace", "log_failure", "log_text", "log_flattened", "log_trace",
                   "message", "format", "isError", "system", "time", "failure", "why"})


_UNPARSED: Any = object()
#: format string -> (the same as a positional ``str.format`` template, the
#: field names in order), or None where a field is more than a plain name
#: (``{a.b}``, ``{f()}``, ``{0}``, nested specs): those go to Twisted.
_PARSED: Dict[str, Optional[Tuple[str, Tuple[str, ...]]]] = {}


def _parse(text: str) -> Optional[Tuple[str, Tuple[str, ...]]]:
    try:
        parts = list(_FORMATTER.parse(text))
    except ValueError:
        return None
    template: List[str] = []
    names: List[str] = []
    for literal, name, spec, conversion in parts:
        template.append(literal.replace("{", "{{").replace("}", "}}"))
        if name is None:
            continue
        if not name.isidentifier() or "{" in (spec or ""):
            return None
        template += ("{", str(len(names)), "!" + conversion if conversion else "", ":" + spec if spec else "", "}")
        names.append(name)
    return "".join(template), tuple(names)


def format_event(event: LogEvent) -> str:
    """What ``twisted.logger.formatEvent`` returns, with each format string
    parsed once instead of at every event (the request log line is written
    for every request; Twisted's parse was most of its cost) and formatted
    by one ``str.format`` call."""
    text = event.get("log_format")
    if not isinstance(text, str) or "log_flattened" in event:
        return formatEvent(event)
    parsed = _PARSED.get(text, _UNPARSED)
    if parsed is _UNPARSED:
        parsed = _parse(text)
        if len(_PARSED) < 4096:
            _PARSED[text] = parsed
    if parsed is None:
        return formatEvent(event)
    template, names = parsed
    try:
        return template.format(*[event[name] for name in names])
    except Exception:
        return formatEvent(event)  # says what could not be formatted


class _Timestamps:
    """``formatTime(when, timeFormatRFC3339)``, computed once per second."""

    def __init__(self) -> None:
        self._second: Optional[int] = None
        self._text = "-"

    def __call__(self, when: Optional[float]) -> str:
        if when is None:
            return "-"
        second = int(when)
        if second != self._second:
            self._text = formatTime(second, timeFormatRFC3339)
            self._second = second
        return self._text


def classic_text(timestamps: Callable[[Optional[float]], str]) -> Callable[[LogEvent], Optional[str]]:
    """``formatEventAsClassicLogText`` (what ``textFileLogObserver`` writes),
    byte for byte, with :func:`format_event` and a cached timestamp; events
    that carry a failure go to Twisted's own."""

    def classic(event: LogEvent) -> Optional[str]:
        if "log_failure" in event:
            return formatEventAsClassicLogText(event, formatTime=lambda when: formatTime(when, timeFormatRFC3339))
        text = format_event(event)
        if not text:
            return None
        system = event.get("log_system")
        if system is None:
            level = event.get("log_level")
            system = f"{event.get('log_namespace', '-')}#{level.name if level is not None else '-'}"
        else:
            try:
                system = str(system)
            except Exception:
                system = "UNFORMATTABLE"
        return f"{timestamps(event.get('log_time'))} [{system}] {text}".replace("\n", "\n\t") + "\n"

    return classic


def event_as_json(event: LogEvent) -> str:
    """One log event as a JSON line: time, level, namespace, message, fields."""
    level = event.get("log_level")
    record: Dict[str, Any] = {
        "time": event.get("log_time"),
        "level": level.name if level is not None else "info",
        "namespace": event.get("log_namespace"),
        "message": format_event(event),
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

    def __call__(self, event: LogEvent) -> None:
        self._stream.write(event_as_json(event) + "\n")
        self._stream.flush()


class BatchedStream:
    """A log stream whose lines, inside :func:`one_write`, reach the real
    stream together: one ``write`` system call for a batch of request log
    lines instead of one each (stderr is line-buffered)."""

    def __init__(self, stream: IO[str]) -> None:
        self.stream = stream
        self._held: Optional[List[str]] = None
        self._depth = 0

    def write(self, text: str) -> int:
        if self._held is not None:
            self._held.append(text)
            return len(text)
        return self.stream.write(text)

    def flush(self) -> None:
        if self._held is None:
            self.stream.flush()

    def hold(self) -> None:
        self._depth += 1
        if self._held is None:
            self._held = []

    def release(self) -> None:
        self._depth -= 1
        if self._depth > 0:
            return
        held, self._held = self._held, None
        if held:
            self.stream.write("".join(held))
            self.stream.flush()


#: The streams of the observers make_observer built (at most a few).
_BATCHED: List[BatchedStream] = []


@contextlib.contextmanager
def one_write() -> Iterator[None]:
    """Lines logged inside go out in one write per stream, at the end."""
    streams = list(_BATCHED)
    for stream in streams:
        stream.hold()
    try:
        yield
    finally:
        for stream in streams:
            stream.release()


@implementer(ILogObserver)
class LevelFilter:
    """Passes on the events of ``level`` and above that name a namespace:
    what ``FilteringLogObserver(observer, [LogLevelFilterPredicate(level)])``
    passes (with no per-namespace levels), decided by one set lookup instead
    of a predicate chain per event."""

    def __init__(self, observer: ILogObserver, level: LogLevel = LogLevel.info) -> None:
        self._observer = observer
        self._levels = frozenset(other for other in LogLevel.iterconstants() if not other < level)

    def __call__(self, event: LogEvent) -> None:
        try:
            wanted = event.get("log_level") in self._levels
        except TypeError:  # an unhashable level: not a LogLevel
            wanted = False
        if wanted and event.get("log_namespace"):
            if "log_trace" in event:
                event["log_trace"].append((self, self._observer))
            self._observer(event)


def emit(logger: Logger, level: LogLevel, format: str, event: Dict[str, Any]) -> None:
    """``logger.emit(level, format, **event)``, for a ``level`` the caller
    knows is a LogLevel: the same event, fields in the same order, to the
    same observer, without ``Logger.emit`` checking the level against every
    LogLevel (the request log line is emitted for every request)."""
    event.update(log_logger=logger, log_level=level, log_namespace=logger.namespace, log_source=logger.source,
                 log_format=format, log_time=time.time())
    if "log_trace" in event:
        event["log_trace"].append((logger, logger.observer))
    logger.observer(event)


def make_observer(log_format: str, stream: IO[str], level: LogLevel = LogLevel.info) -> ILogObserver:
    """The agent's observer for ``log_format`` (``text`` or ``json``)."""
    batched = BatchedStream(stream)
    _BATCHED.append(batched)
    del _BATCHED[:-4]  # the latest few: a process builds one or two
    out: Any = batched
    inner = JSONLinesObserver(out) if log_format == "json" else FileLogObserver(out, classic_text(_Timestamps()))
    return LevelFilter(inner, level)


def json_logger() -> ILogObserver:
    """For ``twistd --logger rolemesh.base.logs.json_logger`` (set by the plugin
    when ``--log-format json`` is given)."""
    return make_observer("json", sys.stdout)


__all__ = ["json_logger", "make_observer", "event_as_json", "format_event", "classic_text", "JSONLinesObserver",
           "LevelFilter", "emit"]
