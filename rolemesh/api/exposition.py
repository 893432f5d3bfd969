"""Prometheus text for ``GET /metrics``, made without prometheus_client's
``generate_latest`` on the scrape path, and the counters and histograms of
the agent's events, which keep their own rendered text.

* :func:`format_families`: a list of :class:`~prometheus_client.Metric` in
  the text exposition format, byte for byte what ``generate_latest`` writes
  for them (the same name and label escaping, ``floatToGoString`` values,
  ``_created`` samples moved to a gauge of their own after the family), only
  cheaper: name escaping is worked out once per name.
  ``tests.api.test_exposition`` holds the two side by side.
* :class:`PlainCounter` and :class:`PlainHistogram`: labelled families kept
  as plain numbers (no lock, no label checks per event).  Each is a
  :class:`~prometheus_client.registry.Collector` (``collect()``, for
  ``generate_latest`` and the uncached render) and renders its own text
  (:meth:`~PlainCounter.text`): a series keeps its lines until it changes,
  a family its text until one of its series changes or is added.  Only
  their own methods change them (``inc``, ``observe``, ``labels``), and each
  drops what it changed, so their text is never stale.
"""

from __future__ import annotations

import bisect
import functools
import time
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

from prometheus_client import metrics as prometheus_metrics
from prometheus_client.core import Metric
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample
from prometheus_client.utils import INF, floatToGoString

try:  # prometheus_client 0.22 and later escape names that are not legacy ones
    from prometheus_client.openmetrics.exposition import UNDERSCORES, escape_label_name, escape_metric_name
except ImportError:  # older releases write every name as it is (and allow legacy names only)
    UNDERSCORES = "underscores"

    def escape_metric_name(s: str, escaping: str = UNDERSCORES) -> str:
        return s

    def escape_label_name(s: str, escaping: str = UNDERSCORES) -> str:
        return s

#: Exposition types as the text format names them (prometheus_client's munging).
_TEXT_TYPES = {"info": "gauge", "stateset": "gauge", "gaugehistogram": "histogram", "unknown": "untyped"}
#: Samples the text format moves into a gauge of their own, after the family.
_OPENMETRICS_SUFFIXES = ("_created", "_gsum", "_gcount")


def created_series() -> bool:
    """Whether ``_created`` samples are rendered (prometheus_client's switch:
    ``PROMETHEUS_DISABLE_CREATED_SERIES``, ``disable_created_metrics()``)."""
    return bool(getattr(prometheus_metrics, "_use_created", True))


@functools.lru_cache(maxsize=4096)
def metric_name(name: str) -> str:
    """A metric name as the text format writes it (legacy names as they are)."""
    return escape_metric_name(name, UNDERSCORES)


@functools.lru_cache(maxsize=4096)
def _label_name(name: str) -> str:
    return escape_label_name(name, UNDERSCORES)


def _label_value(value: str) -> str:
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


def _help(documentation: str) -> str:
    return documentation.replace("\\", r"\\").replace("\n", r"\n")


def label_text(pairs: Iterable[Tuple[str, str]]) -> str:
    """``{name="value",...}`` sorted by name, escaped; ``""`` without labels."""
    inner = ",".join(f'{_label_name(k)}="{_label_value(v)}"' for k, v in sorted(pairs))
    return "{" + inner + "}" if inner else ""


@functools.lru_cache(maxsize=4096)
def head(name: str, documentation: str, kind: str) -> str:
    """The ``# HELP`` and ``# TYPE`` lines of a family named ``name`` as written."""
    written = metric_name(name)
    return f"# HELP {written} {_help(documentation)}\n# TYPE {written} {kind}\n"


def sample_line(sample: Sample) -> str:
    labels = label_text(sample.labels.items()) if sample.labels else ""
    stamp = "" if sample.timestamp is None else f" {int(float(sample.timestamp) * 1000):d}"
    return f"{metric_name(sample.name)}{labels} {floatToGoString(sample.value)}{stamp}\n"


def format_family(metric: Metric) -> str:
    """One family as ``generate_latest`` writes it."""
    name, kind = metric.name, metric.type
    if kind == "counter":
        name += "_total"
    elif kind == "info":
        name += "_info"
    out = [head(name, metric.documentation, _TEXT_TYPES.get(kind, kind))]
    moved: Dict[str, List[str]] = {}
    for sample in metric.samples:
        for suffix in _OPENMETRICS_SUFFIXES:
            if sample.name == metric.name + suffix:
                moved.setdefault(suffix, []).append(sample_line(sample))
                break
        else:
            out.append(sample_line(sample))
    for suffix, lines in sorted(moved.items()):
        out.append(head(metric.name + suffix, metric.documentation, "gauge"))
        out.extend(lines)
    return "".join(out)


def format_families(metrics: Iterable[Metric]) -> bytes:
    """Families in the text exposition format (``generate_latest``'s bytes)."""
    return "".join(format_family(metric) for metric in metrics).encode("utf-8")


# ---------------------------------------------------------------------------
# Families that render themselves


class _CounterSeries:
    """One label set of a :class:`PlainCounter`: its count, when it began,
    and its ``_total`` line while the count stays."""

    __slots__ = ("count", "created", "line")

    def __init__(self, count: float) -> None:
        self.count = count
        self.created = time.time()
        self.line: Optional[str] = None


class _PlainFamily(Collector):
    """What the plain families share: their name, help and label names, and
    their text, kept until a change drops it (``_text = None``)."""

    #: The family's type, as :class:`~prometheus_client.core.Metric` names it.
    kind = ""

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str]) -> None:
        self.name, self.documentation, self.labelnames = name, documentation, tuple(labelnames)
        #: (whether ``_created`` lines were in it, the text), or None after a change.
        self._text: Optional[Tuple[bool, bytes]] = None
        #: Times the family's text was made (tests: a scrape of nothing new makes none).
        self.renders = 0

    def describe(self) -> Iterable[Metric]:
        return [Metric(self.name, self.documentation, self.kind)]

    def text(self) -> bytes:
        """What :meth:`collect` renders to, made again only after a change."""
        created = created_series()
        if self._text is None or self._text[0] != created:
            self._text = (created, self._render(created).encode("utf-8"))
            self.renders += 1
        return self._text[1]

    def _render(self, created: bool) -> str:
        raise NotImplementedError


class PlainCounter(_PlainFamily):
    """A labelled counter kept as plain floats: the samples prometheus_client's
    ``Counter`` renders, one for one, without its label validation and lock
    on every increment (the agent counts and scrapes on the reactor thread
    only)."""

    kind = "counter"

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str]) -> None:
        super().__init__(name, documentation, labelnames)
        #: label values -> the series (in the order they were first seen).
        self.series: Dict[Tuple[str, ...], _CounterSeries] = {}
        #: label values -> ``{...}`` as written, and the ``_created`` line (both fixed).
        self._labels: Dict[Tuple[str, ...], Tuple[str, str]] = {}

    def labels(self, labels: Tuple[str, ...]) -> None:
        """Make the series of ``labels`` (at 0) if it is not there yet."""
        if labels not in self.series:
            self.series[labels] = _CounterSeries(0.0)
            self._text = None

    def inc(self, labels: Tuple[str, ...]) -> None:
        series = self.series.get(labels)
        if series is None:
            self.series[labels] = _CounterSeries(1.0)
        else:
            series.count += 1.0
            series.line = None
        self._text = None

    def collect(self) -> Iterable[Metric]:
        metric = Metric(self.name, self.documentation, "counter")
        created = created_series()
        for labels, series in list(self.series.items()):
            metric.add_sample(self.name + "_total", dict(zip(self.labelnames, labels)), series.count)
            if created:
                metric.add_sample(self.name + "_created", dict(zip(self.labelnames, labels)), series.created)
        return [metric]

    def _render(self, created: bool) -> str:
        total = metric_name(self.name + "_total")
        out = [head(self.name + "_total", self.documentation, "counter")]
        stamps = []
        for labels, series in self.series.items():
            fixed = self._labels.get(labels)
            if fixed is None:
                written = label_text(zip(self.labelnames, labels))
                stamp = f"{metric_name(self.name + '_created')}{written} {floatToGoString(series.created)}\n"
                fixed = self._labels[labels] = (written, stamp)
            if series.line is None:
                series.line = f"{total}{fixed[0]} {floatToGoString(series.count)}\n"
            out.append(series.line)
            stamps.append(fixed[1])
        if created and stamps:
            out.append(head(self.name + "_created", self.documentation, "gauge"))
            out.extend(stamps)
        return "".join(out)


class _HistogramSeries:
    """One label set of a :class:`PlainHistogram`: its buckets (not
    cumulative), sum, creation time, and its lines while they stay."""

    __slots__ = ("counts", "sum", "created", "lines")

    def __init__(self, buckets: int) -> None:
        self.counts = [0] * buckets
        self.sum = 0.0
        self.created = time.time()
        self.lines: Optional[str] = None


class PlainHistogram(_PlainFamily):
    """A labelled histogram kept as plain numbers: the samples
    prometheus_client's ``Histogram`` renders (cumulative buckets, count,
    sum, created), one for one, without its two locked increments and label
    checks per observation."""

    kind = "histogram"

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str], buckets: Sequence[float]) -> None:
        super().__init__(name, documentation, labelnames)
        self.bounds = tuple(float(b) for b in buckets) + (INF,)
        self._le = tuple(floatToGoString(b) for b in self.bounds)
        #: label values -> its series (in the order they were first seen).
        self.series: Dict[Tuple[str, ...], _HistogramSeries] = {}
        #: label values -> each bucket's ``name{...}`` prefix, the count's,
        #: the sum's, and the ``_created`` line (all fixed).
        self._labels: Dict[Tuple[str, ...], Tuple[Tuple[str, ...], str, str, str]] = {}

    def labels(self, labels: Tuple[str, ...]) -> _HistogramSeries:
        """The series of ``labels``, made (all zero) if it is not there yet."""
        series = self.series.get(labels)
        if series is None:
            series = self.series[labels] = _HistogramSeries(len(self.bounds))
            self._text = None
        return series

    def observe(self, labels: Tuple[str, ...], amount: float) -> None:
        """``amount``: a finite number (the callers check), counted in the
        first bucket whose bound is at least ``amount``, as prometheus_client does."""
        series = self.series.get(labels) or self.labels(labels)
        series.sum += amount
        series.counts[bisect.bisect_left(self.bounds, amount)] += 1
        series.lines = None
        self._text = None

    def collect(self) -> Iterable[Metric]:
        metric = Metric(self.name, self.documentation, "histogram")
        created = created_series()
        for labels, series in list(self.series.items()):
            named = list(zip(self.labelnames, labels))
            acc = 0.0
            for le, count in zip(self._le, series.counts):
                acc += count
                metric.add_sample(self.name + "_bucket", dict(named + [("le", le)]), acc)
            metric.add_sample(self.name + "_count", dict(named), acc)
            metric.add_sample(self.name + "_sum", dict(named), series.sum)
            if created:
                metric.add_sample(self.name + "_created", dict(named), series.created)
        return [metric]

    def _fixed(self, labels: Tuple[str, ...], series: _HistogramSeries) -> Tuple[Tuple[str, ...], str, str, str]:
        named = list(zip(self.labelnames, labels))
        written = label_text(named)
        bucket = metric_name(self.name + "_bucket")
        buckets = tuple(bucket + label_text(named + [("le", le)]) for le in self._le)
        stamp = f"{metric_name(self.name + '_created')}{written} {floatToGoString(series.created)}\n"
        fixed = (buckets, metric_name(self.name + "_count") + written, metric_name(self.name + "_sum") + written, stamp)
        self._labels[labels] = fixed
        return fixed

    def _render(self, created: bool) -> str:
        out = [head(self.name, self.documentation, "histogram")]
        stamps = []
        for labels, series in self.series.items():
            fixed = self._labels.get(labels) or self._fixed(labels, series)
            if series.lines is None:
                lines, acc = [], 0.0
                for prefix, count in zip(fixed[0], series.counts):
                    acc += count
                    lines.append(f"{prefix} {floatToGoString(acc)}\n")
                lines.append(f"{fixed[1]} {floatToGoString(acc)}\n{fixed[2]} {floatToGoString(series.sum)}\n")
                series.lines = "".join(lines)
            out.append(series.lines)
            stamps.append(fixed[3])
        if created and stamps:
            out.append(head(self.name + "_created", self.documentation, "gauge"))
            out.extend(stamps)
        return "".join(out)
