"""The families of ``GET /metrics`` read from the agent's live state: the
scheduler's books, the children's states and back-offs, the supervisors'
counts, the prompt-token tally, the device samples, the children's own
telemetry and the dispatcher client.

Each part of the scrape is a :class:`Part`: a ``key`` that reads what the
part shows into a plain snapshot (tuples of numbers, strings and frozen
records), and ``families``, which builds the part's families from that
snapshot alone.  :meth:`LiveCollector.texts` keeps each part's rendered text
with the snapshot it came from and renders a part again only when its
snapshot differs: a scrape costs the snapshots and a join.  As ``families``
reads nothing but its key, a part cannot show something its key does not
hold, and a change of anything it shows is a change of its key: no
invalidation to remember anywhere else.  Frozen records (a device sample, a
child's telemetry: replaced, never changed) are held by identity, mutable
figures copied.

The few series that move with time alone (how old a sample is, how long since
the dispatcher answered) are parts of their own whose key holds the clock,
so they are rendered again when the clock has moved, and only they.
:meth:`LiveCollector.collect` builds every part from a fresh snapshot, as the
uncached render (``NodeMetrics.render_uncached``) does.
"""

from __future__ import annotations

from typing import (
    TYPE_CHECKING,
    Any,
    Callable,
    Dict,
    FrozenSet,
    Hashable,
    Iterable,
    Iterator,
    List,
    Mapping,
    NamedTuple,
    Optional,
    Tuple,
)

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from twisted.logger import Logger

from rolemesh import __version__
from rolemesh.api.exposition import format_families
from rolemesh.children.state import FAILED, READY, STARTING, STOPPED, STOPPING
from rolemesh.children.telemetry import export_name, finite_number
from rolemesh.fleet.dispatcher import DispatcherState

if TYPE_CHECKING:
    from rolemesh.node.node import Node

log = Logger(namespace="rolemesh.metrics")

#: Label value for a model (or endpoint, or status) that is not one we know.
UNKNOWN = "unknown"
#: The label of a tenant the config does not name.
OTHER_TENANT = "other"
#: Every child state, so ``rolemesh_child_state`` has a stable set of series.
CHILD_STATES = (STOPPED, STARTING, READY, STOPPING, FAILED)
#: Dispatcher client states (``rolemesh.fleet.dispatcher``), for the same reason.
DISPATCHER_STATES = tuple(state.value for state in DispatcherState)

#: Supervisor events (``COUNTED_EVENTS``) counted per ``(device, model)``:
#: event -> (metric name without ``_total``, help).
SUPERVISOR_COUNTERS: Dict[str, Tuple[str, str]] = {
    "load": ("rolemesh_model_loads", "Model loads that reached ready, by device and model."),
    "load_failure": (
        "rolemesh_model_load_failures",
        "Model loads that failed (llama-server exited while loading), by device and model.",
    ),
    "load_timeout": (
        "rolemesh_model_load_timeouts",
        "Model loads that did not become ready within llama_server_startup_timeout_s.",
    ),
    "crash": ("rolemesh_child_crashes", "Ready llama-server children that exited unexpectedly."),
    "restart": (
        "rolemesh_child_restarts",
        "llama-server children restarted after a crash or a failed health probe.",
    ),
    "safe_mode_retry": (
        "rolemesh_model_safe_mode_retries",
        "Loads retried with --no-repack after llama-server died of SIGILL (a non-portable build).",
    ),
}


def model_label(model: object, models: FrozenSet[str]) -> str:
    """A model's label: a configured model id, else ``unknown`` (a bounded set)."""
    return model if isinstance(model, str) and model in models else UNKNOWN


def tenant_label(tenant: object, names: FrozenSet[str]) -> str:
    """A tenant's label: its name if the config names it, else ``other`` (a bounded set)."""
    return tenant if isinstance(tenant, str) and tenant in names else OTHER_TENANT


class Part(NamedTuple):
    """One part of the live families: its snapshot, and its families from it."""

    name: str
    key: Callable[["LiveCollector"], Hashable]
    families: Callable[[Any], Iterable[Metric]]


class LiveCollector(Collector):
    """The live parts, each rendered again only when its snapshot changes."""

    def __init__(
        self,
        node: Node,
        models: Callable[[], FrozenSet[str]],
        tenant_names: Callable[[], FrozenSet[str]],
        supervisor_counts: Mapping[Tuple[str, str, str], float],
        dispatcher: Callable[[], Any],
        started: float,
    ) -> None:
        self.node = node
        #: The running config's model ids, and its tenant names.
        self.models, self.tenant_names = models, tenant_names
        #: (device, model, event of SUPERVISOR_COUNTERS) -> count since start.
        self.supervisor_counts = supervisor_counts
        #: The dispatcher client (None without one; set after the metrics are built).
        self.dispatcher = dispatcher
        self.started = started
        #: Part name -> (the snapshot, the part's text rendered from it).
        self._cache: Dict[str, Tuple[Hashable, bytes]] = {}
        #: Parts rendered (tests: a scrape of nothing new renders none).
        self.renders = 0

    def now(self) -> float:
        return float(self.node.reactor.seconds())

    def describe(self) -> Iterable[Metric]:
        return []

    def collect(self) -> Iterable[Metric]:
        """Every part from a fresh snapshot (the uncached render)."""
        out: List[Metric] = []
        for part in PARTS:
            try:
                out.extend(part.families(part.key(self)))
            except Exception:
                log.failure("metrics: collecting {part} failed", part=part.name)
        return out

    def texts(self) -> Iterator[bytes]:
        """Each part's text: the one rendered last unless its snapshot changed."""
        cache = self._cache
        for part in PARTS:
            try:
                key = part.key(self)
                cached = cache.get(part.name)
                if cached is None or cached[0] != key:
                    cache.pop(part.name, None)
                    cached = (key, format_families(part.families(key)))
                    cache[part.name] = cached
                    self.renders += 1
            except Exception:
                log.failure("metrics: collecting {part} failed", part=part.name)
                continue
            yield cached[1]


# ---------------------------------------------------------------------------
# The node and the scheduler


def _node_key(src: LiveCollector) -> Hashable:
    node = src.node
    return str(node.config.node_id), str(getattr(node.backend, "name", UNKNOWN)), bool(node.draining)


def _node_families(key: Any) -> Iterable[Metric]:
    node_id, backend, draining = key
    info = GaugeMetricFamily(
        "rolemesh_node_info", "Constant 1; labels describe the agent.", labels=["node_id", "backend", "version"]
    )
    info.add_metric([node_id, backend, __version__], 1)
    yield info
    yield GaugeMetricFamily(
        "rolemesh_node_draining", "1 while the agent drains for shutdown.", value=1 if draining else 0
    )


def _scheduler_key(src: LiveCollector) -> Hashable:
    """Per device the tenants of its running and queued tickets (a ticket's
    share never changes), the limit, the config's tenants, the prefix memory."""
    scheduler, prefixes = src.node.scheduler, src.node.prefixes
    books = tuple(
        (name, tuple([t.share.tenant for t in book.running]), tuple([t.share.tenant for t in book.queue]))
        for name, book in scheduler.devices.items()
    )
    return scheduler.pending_limit, src.tenant_names(), books, len(prefixes), prefixes.lookups, prefixes.hits


def _scheduler_families(key: Any) -> Iterable[Metric]:
    pending_limit, names, books, entries, lookups, hits = key
    in_flight = GaugeMetricFamily("rolemesh_device_in_flight", "Requests running on the device now.", labels=["device"])
    queued = GaugeMetricFamily("rolemesh_device_queue_depth", "Requests waiting for the device now.", labels=["device"])
    limit = GaugeMetricFamily(
        "rolemesh_device_pending_limit",
        "max_pending_requests_per_device: in flight plus queued admitted per device.",
        labels=["device"],
    )
    by_tenant: Dict[str, List[int]] = {}
    for name, running, waiting in books:
        in_flight.add_metric([name], len(running))
        queued.add_metric([name], len(waiting))
        limit.add_metric([name], pending_limit)
        for i, tenants in enumerate((running, waiting)):
            for tenant in tenants:
                by_tenant.setdefault(tenant_label(tenant, names), [0, 0])[i] += 1
    yield from (in_flight, queued, limit)
    tenant_running = GaugeMetricFamily(
        "rolemesh_tenant_running", "A tenant's requests running now (others as `other`).", labels=["tenant"])
    tenant_queued = GaugeMetricFamily(
        "rolemesh_tenant_queued", "A tenant's requests waiting in device queues now.", labels=["tenant"])
    for tenant in sorted(set(by_tenant) | names):
        running_now, waiting_now = by_tenant.get(tenant, (0, 0))
        tenant_running.add_metric([tenant], running_now)
        tenant_queued.add_metric([tenant], waiting_now)
    yield tenant_running
    yield tenant_queued
    yield GaugeMetricFamily("rolemesh_prefix_memory_entries",
                            "Prompt prefixes remembered for prefix affinity now.", value=entries)
    yield CounterMetricFamily("rolemesh_prefix_lookups", "Requests that looked their prompt prefix up "
                              "(a model on several devices).", value=lookups)
    yield CounterMetricFamily("rolemesh_prefix_hits", "Lookups that found the device that served the prefix.",
                              value=hits)


# ---------------------------------------------------------------------------
# The children and their supervisors


def _children_key(src: LiveCollector) -> Hashable:
    node = src.node
    return src.models(), tuple(
        (name, supervisor.state, supervisor.loading_or_loaded, bool(node.child_stale(name)))
        for name, supervisor in node.supervisors.items()
    )


def _children_families(key: Any) -> Iterable[Metric]:
    models, devices = key
    state = GaugeMetricFamily(
        "rolemesh_child_state", "1 for the llama-server child's current state.", labels=["device", "state"]
    )
    model = GaugeMetricFamily(
        "rolemesh_child_model", "1 for the model the device's child serves or is loading.", labels=["device", "model"]
    )
    stale = GaugeMetricFamily(
        "rolemesh_child_stale",
        "1 while the device's child runs a command a reload replaced (it finishes its requests, then restarts).",
        labels=["device"],
    )
    for name, current_state, current, child_stale in devices:
        for s in CHILD_STATES:
            state.add_metric([name, s], 1 if current_state == s else 0)
        # A model a reload removed still shows where its child serves (until it leaves).
        for model_id in sorted(models | ({current} if current is not None else set())):
            model.add_metric([name, model_id], 1 if current == model_id else 0)
        stale.add_metric([name], 1 if child_stale else 0)
    yield from (state, model, stale)


def _backoffs_key(src: LiveCollector) -> Hashable:
    """The back-offs running now (one that ran out is gone: the key holds the clock's verdict)."""
    return src.models(), tuple(
        (name, tuple((b.model, b.until, b.failures) for b in supervisor.backoffs()))
        for name, supervisor in src.node.supervisors.items()
    )


def _backoffs_families(key: Any) -> Iterable[Metric]:
    """Which model backs off on which device, until when and after how
    many failures in a row (0 for every other model)."""
    models, devices = key
    until = GaugeMetricFamily(
        "rolemesh_model_backoff_until_seconds",
        "While loads of the model on the device are refused after failures in a row: when it will be "
        "tried again (POSIX seconds); 0 when it is not backing off.",
        labels=["device", "model"],
    )
    failures = GaugeMetricFamily(
        "rolemesh_model_backoff_failures",
        "Failures in a row behind the model's back-off on the device; 0 when it is not backing off.",
        labels=["device", "model"],
    )
    for name, backoffs in devices:
        active = {model_id: (at, count) for model_id, at, count in backoffs}
        for model_id in sorted(models | set(active)):
            at, count = active.get(model_id, (0, 0))
            until.add_metric([name, model_id], at)
            failures.add_metric([name, model_id], count)
    yield until
    yield failures


def _supervisor_counters_key(src: LiveCollector) -> Hashable:
    return src.models(), tuple(src.node.supervisors), tuple(src.supervisor_counts.items())


def _supervisor_counters_families(key: Any) -> Iterable[Metric]:
    models, devices, items = key
    counts = dict(items)
    for event, (name, help_text) in SUPERVISOR_COUNTERS.items():
        family = CounterMetricFamily(name, help_text, labels=["device", "model"])
        extra = sorted({m for (_, m, e) in counts if e == event} - models)
        for device in devices:
            for model_id in sorted(models) + extra:
                family.add_metric([device, model_id], counts.get((device, model_id, event), 0))
        yield family


def _prompt_tokens_key(src: LiveCollector) -> Hashable:
    counts = src.node.prompt_cache.counts  # its lists grow in place: copied
    return src.models(), tuple(src.node.supervisors), tuple((pair, c[0], c[1]) for pair, c in counts.items())


def _prompt_tokens_families(key: Any) -> Iterable[Metric]:
    """Prompt tokens llama-server served from its cache and processed
    (the answers' ``timings``), per device (or group) and model: 0 for
    every configured pair from the start."""
    models, devices, items = key
    tally = {pair: (hit, miss) for pair, hit, miss in items}
    cached = CounterMetricFamily("rolemesh_prompt_tokens_cached", "Prompt tokens llama-server reused from its "
                                 "KV cache (timings.cache_n of its answers).", labels=["device", "model"])
    processed = CounterMetricFamily("rolemesh_prompt_tokens_processed", "Prompt tokens llama-server processed "
                                    "(timings.prompt_n of its answers).", labels=["device", "model"])
    pairs = {(device, model_id) for device in devices for model_id in models}
    for device, model_id in sorted(pairs | set(tally)):
        hit, miss = tally.get((device, model_id), (0, 0))
        cached.add_metric([device, model_id], hit)
        processed.add_metric([device, model_id], miss)
    yield cached
    yield processed


# ---------------------------------------------------------------------------
# The devices


def _devices_key(src: LiveCollector) -> Hashable:
    """Per device: its total from discovery and its latest sample (a frozen
    record, replaced by every sample: held by identity)."""
    node = src.node
    samples = tuple((ref.name, ref.memory_total_bytes, node.metrics.get(ref.name)) for ref in node.devices)
    return tuple(id(sample) for _, _, sample in samples), samples


def _devices_families(key: Any) -> Iterable[Metric]:
    _, samples = key
    g = {
        "total": GaugeMetricFamily("rolemesh_device_memory_total_bytes", "Device memory size.", labels=["device"]),
        "used": GaugeMetricFamily("rolemesh_device_memory_used_bytes", "Device memory in use.", labels=["device"]),
        "free": GaugeMetricFamily("rolemesh_device_memory_free_bytes", "Device memory free.", labels=["device"]),
        "util": GaugeMetricFamily("rolemesh_device_utilization_ratio", "Device utilization, 0 to 1.",
                                  labels=["device"]),
        "temp": GaugeMetricFamily("rolemesh_device_temperature_celsius", "Device temperature.", labels=["device"]),
        "power": GaugeMetricFamily("rolemesh_device_power_watts", "Device power draw.", labels=["device"]),
    }
    for name, discovered, sample in samples:
        total = finite_number(sample.memory_total_bytes) if sample is not None else None
        if total is None:
            total = finite_number(discovered)
        if total is not None:
            g["total"].add_metric([name], total)
        if sample is None:
            continue
        for k, value in (("used", sample.memory_used_bytes), ("free", sample.memory_free_bytes),
                         ("temp", sample.temperature_c), ("power", sample.power_w)):
            number = finite_number(value)
            if number is not None:
                g[k].add_metric([name], number)
        util = finite_number(sample.utilization_pct)
        if util is not None:
            g["util"].add_metric([name], util / 100.0)
    yield from g.values()


def _device_age_key(src: LiveCollector) -> Hashable:
    node = src.node
    samples = ((ref.name, node.metrics.get(ref.name)) for ref in node.devices)
    return src.now(), tuple((name, sample.sampled_at) for name, sample in samples if sample is not None)


def _device_age_families(key: Any) -> Iterable[Metric]:
    now, stamps = key
    age = GaugeMetricFamily("rolemesh_device_metrics_sample_age_seconds",
                            "Seconds since the device's metrics were last measured.", labels=["device"])
    for name, stamp in stamps:
        sampled_at = finite_number(stamp)
        if sampled_at is not None:
            age.add_metric([name], max(0.0, now - sampled_at))
    yield age


def _device_stale_key(src: LiveCollector) -> Hashable:
    node = src.node
    samples = ((ref.name, node.metrics.get(ref.name)) for ref in node.devices)
    return tuple((name, None if sample is None else bool(sample.stale)) for name, sample in samples)


def _device_stale_families(key: Any) -> Iterable[Metric]:
    stale = GaugeMetricFamily(
        "rolemesh_device_metrics_stale",
        "1 when the latest device sample failed (figures are the last good ones) or there is no sample yet.",
        labels=["device"],
    )
    for name, flag in key:
        stale.add_metric([name], 1 if flag is None or flag else 0)
    yield stale


# ---------------------------------------------------------------------------
# The children's telemetry


def _records(src: LiveCollector) -> Optional[Tuple[Tuple[str, Any], ...]]:
    """(device, its child's latest telemetry: a frozen record) for each ready
    child; None without a sampler."""
    sampler = getattr(src.node, "telemetry", None)
    if sampler is None:
        return None
    found = ((name, sampler.latest(name)) for name in src.node.supervisors)
    return tuple((name, record) for name, record in found if record is not None)


def _telemetry_key(src: LiveCollector) -> Hashable:
    records = _records(src)
    if records is None:
        return None
    return src.models(), tuple(id(record) for _, record in records), records


def _telemetry_families(key: Any) -> Iterable[Metric]:
    """Each ready child's own telemetry, labelled by device and model."""
    if key is None:
        return
    models, _, records = key
    slots = GaugeMetricFamily("rolemesh_device_slots", "llama-server slots of the device's child (--parallel).",
                              labels=["device", "model"])
    busy = GaugeMetricFamily("rolemesh_device_slots_busy", "Slots processing a request now.",
                             labels=["device", "model"])
    rate = GaugeMetricFamily("rolemesh_device_tokens_per_second",
                             "Tokens generated per second between the last two telemetry samples.",
                             labels=["device", "model"])
    kv = GaugeMetricFamily("rolemesh_device_kv_cache_usage_ratio",
                           "KV cache in use, 0 to 1, where the llama-server build reports it.",
                           labels=["device", "model"])
    stale = GaugeMetricFamily("rolemesh_device_telemetry_stale",
                              "1 when the child's last /metrics or /slots request failed (figures are the "
                              "last good ones); 0 when it answered; absent without a ready child.",
                              labels=["device", "model"])
    for name, record in records:
        labels = [name, model_label(record.model, models)]
        stale.add_metric(labels, 1 if record.stale else 0)
        for family, value in ((slots, record.slots_total), (busy, record.slots_busy),
                              (rate, record.tokens_per_s), (kv, record.kv_cache_usage_ratio)):
            number = finite_number(value)
            if number is not None:
                family.add_metric(labels, number)
    yield from (slots, busy, rate, kv, stale)


def _telemetry_age_key(src: LiveCollector) -> Hashable:
    records = _records(src)
    if records is None:
        return None
    return src.now(), src.models(), tuple((name, record.model, record.good_at) for name, record in records)


def _telemetry_age_families(key: Any) -> Iterable[Metric]:
    if key is None:
        return
    now, models, stamps = key
    age = GaugeMetricFamily("rolemesh_device_telemetry_age_seconds",
                            "Seconds since the child's telemetry last answered.", labels=["device", "model"])
    for name, model, stamp in stamps:
        good_at = finite_number(stamp)
        if good_at is not None:
            age.add_metric([name, model_label(model, models)], max(0.0, now - good_at))
    yield age


def _child_families(key: Any) -> Iterable[Metric]:
    """The children's own series, as ``rolemesh_llamacpp_*``."""
    if key is None:
        return
    models, _, records = key
    child: Dict[str, Any] = {}
    for name, record in records:
        _relabel(child, record.families, [name, model_label(record.model, models)])
    yield from child.values()


def _relabel(out: Dict[str, Any], families: Iterable[Any], labels: List[str]) -> None:
    """Add a child's families to ``out`` as ``rolemesh_llamacpp_*`` series with
    ``device`` and ``model`` labels (never the child's port), keeping the
    child's counter/gauge types (anything else is left out)."""
    for family in families:
        if family.type not in ("counter", "gauge"):
            continue
        counter = family.type == "counter"
        sample_name = family.name + "_total" if counter else family.name
        extra = sorted({key for sample in family.samples for key, _ in sample.labels} - {"device", "model"})
        name = export_name(family.name)
        metric = out.get(name)
        if metric is None:
            documentation = f"llama-server: {family.documentation}" if family.documentation else "llama-server"
            cls = CounterMetricFamily if counter else GaugeMetricFamily
            metric = out[name] = cls(name, documentation, labels=["device", "model", *extra])
        known = list(getattr(metric, "_labelnames", ()))
        for sample in family.samples:
            if sample.name != sample_name:
                continue
            values = dict(sample.labels)
            row = labels + [values.get(key, "") for key in known[2:]]
            if len(row) == len(known):
                metric.add_metric(row, sample.value)


# ---------------------------------------------------------------------------
# The dispatcher client


def _dispatcher_counts_key(src: LiveCollector) -> Hashable:
    client = src.dispatcher()
    if client is None:
        return None
    return tuple(getattr(client, name, 0) or 0
                 for name in ("heartbeats_ok", "heartbeats_failed", "registrations_ok", "registrations_failed"))


def _dispatcher_counts_families(key: Any) -> Iterable[Metric]:
    if key is None:
        return
    beats_ok, beats_failed, regs_ok, regs_failed = key
    beats = CounterMetricFamily("rolemesh_dispatcher_heartbeats", "Heartbeats sent, by outcome.", labels=["outcome"])
    beats.add_metric(["success"], beats_ok)
    beats.add_metric(["failure"], beats_failed)
    yield beats
    regs = CounterMetricFamily(
        "rolemesh_dispatcher_registrations", "Registrations sent, by outcome.", labels=["outcome"]
    )
    regs.add_metric(["success"], regs_ok)
    regs.add_metric(["failure"], regs_failed)
    yield regs


def _dispatcher_since_key(src: LiveCollector) -> Hashable:
    client = src.dispatcher()
    if client is None:
        return None
    return src.now(), finite_number(getattr(client, "last_success", None)), src.started


def _dispatcher_since_families(key: Any) -> Iterable[Metric]:
    if key is None:
        return
    now, last, started = key
    yield GaugeMetricFamily(
        "rolemesh_dispatcher_seconds_since_last_success",
        "Seconds since the dispatcher last answered OK (since agent start if it never has).",
        value=max(0.0, now - (last if last is not None else started)),
    )


def _dispatcher_state_key(src: LiveCollector) -> Hashable:
    client = src.dispatcher()
    return None if client is None else (getattr(client, "state", None),)


def _dispatcher_state_families(key: Any) -> Iterable[Metric]:
    if key is None:
        return
    (current,) = key
    state = GaugeMetricFamily(
        "rolemesh_dispatcher_state", "1 for the dispatcher client's current state.", labels=["state"]
    )
    for s in DISPATCHER_STATES:
        state.add_metric([s], 1 if current == s else 0)
    yield state


#: The parts in the order of the scrape.
PARTS = (
    Part("node", _node_key, _node_families),
    Part("scheduler", _scheduler_key, _scheduler_families),
    Part("children", _children_key, _children_families),
    Part("backoffs", _backoffs_key, _backoffs_families),
    Part("supervisor_counters", _supervisor_counters_key, _supervisor_counters_families),
    Part("prompt_tokens", _prompt_tokens_key, _prompt_tokens_families),
    Part("devices", _devices_key, _devices_families),
    Part("device_age", _device_age_key, _device_age_families),
    Part("device_stale", _device_stale_key, _device_stale_families),
    Part("telemetry", _telemetry_key, _telemetry_families),
    Part("telemetry_age", _telemetry_age_key, _telemetry_age_families),
    Part("child_series", _telemetry_key, _child_families),
    Part("dispatcher_counts", _dispatcher_counts_key, _dispatcher_counts_families),
    Part("dispatcher_since", _dispatcher_since_key, _dispatcher_since_families),
    Part("dispatcher_state", _dispatcher_state_key, _dispatcher_state_families),
)
