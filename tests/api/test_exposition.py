"""Unit tests of ``rolemesh.api.exposition``: its text is ``generate_latest``'s,
byte for byte, and its plain families render what their ``collect()`` does."""

from __future__ import annotations

from typing import Any, Iterable, List, Tuple

from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import Metric
from prometheus_client.registry import Collector
from twisted.trial.unittest import SynchronousTestCase

from rolemesh.api.exposition import PlainCounter, PlainHistogram, format_families


class Fixed(Collector):
    """A collector of the given families (for ``generate_latest``)."""

    def __init__(self, metrics: Iterable[Any]) -> None:
        self.metrics = list(metrics)

    def collect(self) -> Iterable[Any]:
        return self.metrics


def prometheus_text(*collectors: Collector) -> bytes:
    registry = CollectorRegistry(auto_describe=False)
    for collector in collectors:
        registry.register(collector)
    return generate_latest(registry)


def _any_name_allowed() -> bool:
    """Whether this prometheus_client takes names that are not legacy ones
    (0.22 and later, which escape them; older ones refuse them)."""
    try:
        Metric("a.b", "", "gauge")
    except ValueError:
        return False
    return True


#: Names legacy and not (dots, UTF-8, a leading digit, a reserved ``__`` label).
NAMES = st.sampled_from(["rolemesh_x", "llamacpp:tokens", "x"]
                        + (["a.b", "ünï", "9lives"] if _any_name_allowed() else []))
LABEL_NAMES = st.sampled_from(["device", "model", "le", "a.b", "ünï", "__reserved", "9x", "quantile"])
VALUES = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(-10**20, 10**20),
                   st.sampled_from([0.0, -0.0, 1e6, 1234567.0, 1e-7, 1.5e9]))
SUFFIXES = st.sampled_from(["", "_total", "_created", "_bucket", "_sum", "_count", "_gsum", "_gcount", "_info",
                            "_other"])
SAMPLES = st.tuples(SUFFIXES, st.dictionaries(LABEL_NAMES, st.text(max_size=8), max_size=3), VALUES,
                    st.one_of(st.none(), st.floats(0, 2e9)))
FAMILIES = st.tuples(NAMES, st.text(max_size=20),
                     st.sampled_from(["counter", "gauge", "summary", "histogram", "gaugehistogram", "unknown",
                                      "info", "stateset"]),
                     st.lists(SAMPLES, max_size=6))


def build(spec: Tuple[str, str, str, List[Any]]) -> Metric:
    name, documentation, kind, samples = spec
    metric = Metric(name, documentation, kind)
    for suffix, labels, value, stamp in samples:
        metric.add_sample(name + suffix, labels, value, timestamp=stamp)
    return metric


class FormatTests(SynchronousTestCase):
    @settings(max_examples=200)
    @given(st.lists(FAMILIES, max_size=4))
    def test_the_same_bytes_as_generate_latest(self, specs: List[Any]) -> None:
        """Whatever the names, label values (quotes, backslashes, newlines),
        help text, types, values (NaN, infinities, -0.0, big and small) and
        timestamps."""
        metrics = [build(spec) for spec in specs]
        self.assertEqual(format_families(metrics), prometheus_text(Fixed(metrics)))

    def test_an_empty_family_is_its_help_and_type(self) -> None:
        metric = Metric("rolemesh_none", "Nothing \\ yet\nat all.", "counter")
        self.assertEqual(format_families([metric]),
                         b"# HELP rolemesh_none_total Nothing \\\\ yet\\nat all.\n# TYPE rolemesh_none_total counter\n")


class PlainFamilyTests(SynchronousTestCase):
    def families(self) -> Tuple[PlainCounter, PlainHistogram]:
        counter = PlainCounter("rolemesh_c", "A counter.", ["model", "endpoint"])
        histogram = PlainHistogram("rolemesh_h_seconds", "A histogram.", ["tenant", "device"], [0.1, 1.0, 10.0])
        return counter, histogram

    @given(st.lists(st.tuples(st.sampled_from(["inc", "observe", "labels"]),
                              st.sampled_from(["a", 'qu"ote', "back\\slash", "new\nline", "ünï"]),
                              st.floats(0, 100)), max_size=30))
    def test_text_is_what_collect_renders_after_every_change(self, steps: List[Tuple[str, str, float]]) -> None:
        counter, histogram = self.families()
        for op, label, amount in steps:
            if op == "inc":
                counter.inc((label, "chat"))
            elif op == "observe":
                histogram.observe((label, "gpu:0"), amount)
            else:
                counter.labels(("x", label))
                histogram.labels(("x", label))
            self.assertEqual(counter.text(), prometheus_text(counter))
            self.assertEqual(histogram.text(), prometheus_text(histogram))
            self.assertEqual(counter.text() + histogram.text(), format_families([*counter.collect(),
                                                                                 *histogram.collect()]))

    def test_text_is_made_once_per_change(self) -> None:
        counter, histogram = self.families()
        counter.inc(("a", "chat"))
        histogram.observe(("t", "gpu:0"), 0.5)
        first = (counter.text(), histogram.text())
        self.assertEqual((counter.renders, histogram.renders), (1, 1))
        self.assertIs(counter.text(), first[0])
        self.assertIs(histogram.text(), first[1])
        self.assertEqual((counter.renders, histogram.renders), (1, 1))
        counter.labels(("a", "chat"))  # there already: nothing changes
        self.assertIs(counter.text(), first[0])
        counter.inc(("a", "chat"))
        histogram.labels(("t", "gpu:1"))
        self.assertNotEqual((counter.text(), histogram.text()), first)
        self.assertEqual((counter.renders, histogram.renders), (2, 2))

    def test_the_created_switch_is_followed(self) -> None:
        from prometheus_client import metrics as prometheus_metrics

        counter, histogram = self.families()
        counter.inc(("a", "chat"))
        histogram.observe(("t", "gpu:0"), 0.5)
        self.assertIn(b"rolemesh_c_created{", counter.text())
        self.patch(prometheus_metrics, "_use_created", False)
        self.assertNotIn(b"_created", counter.text() + histogram.text())
        self.assertEqual(counter.text() + histogram.text(), prometheus_text(counter, histogram))
