"""Prometheus metrics for ``GET /metrics``.

:class:`NodeMetrics` keeps its own :class:`~prometheus_client.CollectorRegistry`
(never the global one) and renders it in the route with
``generate_latest`` -- no thread pool.  It learns about the agent three ways:

* ``observe(event, **fields)``, an observer (:mod:`rolemesh.base.events`) of the
  API (``"request"`` after every proxied request), of the node
  (``"queue_full"``, ``"queue_timeout"``, ``"queue_wait"``, ``"idle_unload"``)
  and of every :class:`~rolemesh.children.supervisor.DeviceSupervisor`: the events
  the supervisor counts at their source (loads, load failures and timeouts,
  crashes, restarts, safe-mode retries: ``COUNTED_EVENTS``) become per
  ``(device, model)`` counts, and a load's ``seconds`` go into a histogram.
* a custom collector that reads live state at scrape time: scheduler books
  (in flight, queued), child states, device samples, the dispatcher client,
  and the children's own telemetry (:mod:`rolemesh.children.telemetry`): slots,
  tokens/s, staleness, and llama-server's series re-exported as
  ``rolemesh_llamacpp_*`` with ``device`` and ``model`` labels.

Labels are bounded: ``model`` is a configured ``model_id`` (anything else,
including a request for an unknown model, is ``"unknown"``), ``device`` is a
device name from discovery/config, ``endpoint`` is one of
:data:`ENDPOINTS` and ``status`` an HTTP status code.  Nothing a client sends
becomes a label value.  Every callback catches and logs what it raises: a
metrics bug never breaks a request or a scrape.
"""

from __future__ import annotations

import bisect
import functools
import time
from typing import TYPE_CHECKING, Any, Callable, Dict, Iterable, Iterator, List, Optional, Protocol, Sequence, Tuple

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client import metrics as prometheus_metrics
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import INF, floatToGoString
from twisted.logger import Logger

from rolemesh import __version__
from rolemesh.api.app import PROXIED_ROUTES
from rolemesh.children.state import FAILED, READY, STARTING, STOPPED, STOPPING
from rolemesh.children.telemetry import finite_number
from rolemesh.config.file import NodeConfig
from rolemesh.fleet.dispatcher import DispatcherState

if TYPE_CHECKING:
    from rolemesh.fleet.dispatcher import DispatcherClient
    from rolemesh.node.node import Node

log = Logger(namespace="rolemesh.metrics")


class MetricsRoot(Protocol):
    """What the metrics read of the root service
    (:class:`rolemesh.service.NodeAgentService`, whose module imports this
    one): its dispatcher client, if it has one."""

    @property
    def dispatcher(self) -> Optional[DispatcherClient]: ...

#: The proxied endpoints, as the API names them in ``request`` events (the
#: route table's ``relayed`` names, each once, in table order).
ENDPOINTS = tuple(dict.fromkeys(endpoint for endpoint, _ in PROXIED_ROUTES))
_ENDPOINT_NAMES = frozenset(ENDPOINTS)
#: Label value for a model (or endpoint, or status) that is not one we know.
UNKNOWN = "unknown"
#: Every child state, so ``rolemesh_child_state`` has a stable set of series.
CHILD_STATES = (STOPPED, STARTING, READY, STOPPING, FAILED)
#: Dispatcher client states (``rolemesh.fleet.dispatcher``), for the same reason.
DISPATCHER_STATES = tuple(state.value for state in DispatcherState)

#: Whole-request latency: LLM answers range from milliseconds (embeddings) to minutes.
REQUEST_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0)
#: Time to first byte: includes queueing and any model load.
TTFB_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
#: Model load (spawn to ready).
LOAD_BUCKETS = (0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0)
#: Time a request waits in a device queue before it may run (0 when it runs at once).
QUEUE_WAIT_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)

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


#: ``status`` label values of every HTTP status code, made once.
_STATUS_LABELS = {code: str(code) for code in range(100, 600)}


def _created_series() -> bool:
    """Whether ``_created`` samples are rendered (prometheus_client's switch:
    ``PROMETHEUS_DISABLE_CREATED_SERIES``, ``disable_created_metrics()``)."""
    return bool(getattr(prometheus_metrics, "_use_created", True))


class _PlainCounter(Collector):
    """A labelled counter kept as plain floats and read at scrape time: the
    samples prometheus_client's ``Counter`` renders, one for one, without
    its label validation and lock on every increment (it is counted once
    per proxied request; the agent counts and scrapes on the reactor
    thread only)."""

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str]) -> None:
        self.name, self.documentation, self.labelnames = name, documentation, tuple(labelnames)
        #: label values -> [count, created (unix time, as the child's ``_created``)].
        self.series: Dict[Tuple[str, ...], List[float]] = {}

    def inc(self, labels: Tuple[str, ...]) -> None:
        series = self.series.get(labels)
        if series is None:
            self.series[labels] = [1.0, time.time()]
        else:
            series[0] += 1.0

    def describe(self) -> Iterable[Metric]:
        return [Metric(self.name, self.documentation, "counter")]

    def collect(self) -> Iterable[Metric]:
        metric = Metric(self.name, self.documentation, "counter")
        created = _created_series()
        for labels, (count, when) in list(self.series.items()):
            metric.add_sample(self.name + "_total", dict(zip(self.labelnames, labels)), count)
            if created:
                metric.add_sample(self.name + "_created", dict(zip(self.labelnames, labels)), when)
        return [metric]


class _HistogramSeries:
    """One label set of a :class:`_PlainHistogram`."""

    __slots__ = ("counts", "sum", "created")

    def __init__(self, buckets: int) -> None:
        self.counts = [0] * buckets
        self.sum = 0.0
        self.created = time.time()


class _PlainHistogram(Collector):
    """A labelled histogram kept as plain numbers and read at scrape time:
    the samples prometheus_client's ``Histogram`` renders (cumulative
    buckets, count, sum, created), one for one, without its two locked
    increments and label checks per observation."""

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str], buckets: Sequence[float]) -> None:
        self.name, self.documentation, self.labelnames = name, documentation, tuple(labelnames)
        self.bounds = tuple(float(b) for b in buckets) + (INF,)
        self._le = tuple(floatToGoString(b) for b in self.bounds)
        #: label values -> its buckets (not cumulative), sum and creation time.
        self.series: Dict[Tuple[str, ...], _HistogramSeries] = {}

    def labels(self, labels: Tuple[str, ...]) -> _HistogramSeries:
        """The series of ``labels``, made (all zero) if it is not there yet."""
        series = self.series.get(labels)
        if series is None:
            series = self.series[labels] = _HistogramSeries(len(self.bounds))
        return series

    def observe(self, labels: Tuple[str, ...], amount: float) -> None:
        """``amount``: a finite number (the callers check), counted in the
        first bucket whose bound is at least ``amount``, as prometheus_client does."""
        series = self.series.get(labels) or self.labels(labels)
        series.sum += amount
        series.counts[bisect.bisect_left(self.bounds, amount)] += 1

    def describe(self) -> Iterable[Metric]:
        return [Metric(self.name, self.documentation, "histogram")]

    def collect(self) -> Iterable[Metric]:
        metric = Metric(self.name, self.documentation, "histogram")
        created = _created_series()
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


class NodeMetrics:
    """The agent's metrics: observers in, Prometheus text out."""

    _models_of: Optional[NodeConfig]
    _model_ids: frozenset

    @property
    def _models(self) -> frozenset:
        """The models of the running config (a reload may add some); worked
        out once per config, not per request."""
        config = self.node.config
        if self._models_of is not config:
            self._models_of, self._model_ids = config, frozenset(m.model_id for m in config.models)
            self._precreate()
        return self._model_ids

    def _precreate(self) -> None:
        """Every per-model and per-(device, model) counter exists at 0 for
        each configured model (and device) from the start, and for a model a
        reload adds from then on: ``rate()`` and ``increase()`` work from the
        first scrape.  (The supervisors' counters are built at scrape time
        over the same pairs.)"""
        for model_id in sorted(self._model_ids):
            self.queue_full.labels(model=model_id)
            self.queue_timeouts.labels(model=model_id)
            for device_name in self.node.supervisors:
                self.idle_unloads.labels(device=device_name, model=model_id)

    def __init__(self, node: Node, root: Optional[MetricsRoot] = None) -> None:
        self.node = node
        self.root = root
        self.registry = CollectorRegistry(auto_describe=False)
        self._started = self._now()
        self._models_of = None
        self._model_ids = frozenset()
        self._request_families()
        self._node_families()
        #: (device, model, event of SUPERVISOR_COUNTERS) -> count since start.
        self._supervisor_counts: Dict[Tuple[str, str, str], float] = {}
        self._handlers: Dict[str, Callable[..., None]] = {
            "request": self._on_request,
            "queue_full": self._on_queue_full,
            "queue_timeout": self._on_queue_timeout,
            "idle_unload": self._on_idle_unload,
            "queue_wait": self._on_queue_wait,
            "tenant_limit": self._on_tenant_limit,
            "load": self._on_load,
        }
        for event in SUPERVISOR_COUNTERS:
            self._handlers.setdefault(event, functools.partial(self._count_supervisor_event, event))
        self.registry.register(_LiveCollector(self))
        for supervisor in node.supervisors.values():
            supervisor.events.subscribe(self.observe)
        node.events.subscribe(self.observe)

    def _request_families(self) -> None:
        """The families fed by the API's ``request`` events: plain numbers
        read at scrape time (see _PlainCounter), as they change with every
        request."""
        self.requests = _PlainCounter(
            "rolemesh_requests",
            "Proxied requests by model, endpoint and HTTP status (499: client went away).",
            ["model", "endpoint", "status"],
        )
        self.request_duration = _PlainHistogram(
            "rolemesh_request_duration_seconds",
            "Proxied request latency, arrival to last byte.",
            ["model", "endpoint"],
            REQUEST_BUCKETS,
        )
        self.request_ttfb = _PlainHistogram(
            "rolemesh_request_ttfb_seconds",
            "Proxied request time to first byte from llama-server (queueing and model load included).",
            ["model", "endpoint"],
            TTFB_BUCKETS,
        )
        for family in (self.requests, self.request_duration, self.request_ttfb):
            self.registry.register(family)

    def _node_families(self) -> None:
        """The families fed by the node's and the supervisors' events."""
        self.queue_full = Counter(
            "rolemesh_queue_full",
            "Requests refused with 429 queue_full (max_pending_requests_per_device).",
            ["model"],
            registry=self.registry,
        )
        self.queue_timeouts = Counter(
            "rolemesh_queue_timeouts",
            "Requests answered 503 queue_timeout after waiting queue_timeout_s in a device queue.",
            ["model"],
            registry=self.registry,
        )
        self.idle_unloads = Counter(
            "rolemesh_idle_unloads",
            "Children stopped after idle_unload_s without requests.",
            ["device", "model"],
            registry=self.registry,
        )
        self.load_duration = Histogram(
            "rolemesh_model_load_duration_seconds",
            "Seconds from spawning llama-server to ready, per load.",
            ["device", "model"],
            buckets=LOAD_BUCKETS,
            registry=self.registry,
        )
        self.queue_wait = _PlainHistogram(  # observed for every request, as the request families
            "rolemesh_queue_wait_seconds",
            "Seconds a request waited in its device's queue before it could run (model load not included).",
            ["device"],
            QUEUE_WAIT_BUCKETS,
        )
        self.registry.register(self.queue_wait)
        self.tenant_wait = _PlainHistogram(
            "rolemesh_tenant_queue_wait_seconds",
            "Seconds a tenant's request waited in a device queue (tenants of the config, others as `other`).",
            ["tenant"],
            QUEUE_WAIT_BUCKETS,
        )
        self.registry.register(self.tenant_wait)
        self.tenant_limited = Counter(
            "rolemesh_tenant_limited",
            "Requests refused with 429 tenant_limit (the tenant's max_concurrent).",
            ["tenant"],
            registry=self.registry,
        )
        self._models  # noqa: B018 - worked out here once: pre-creates the per-model counters
        for device_name in self.node.supervisors:
            self.queue_wait.labels((device_name,))

    # -- output ------------------------------------------------------------------

    def render(self) -> bytes:
        """The registry in Prometheus text exposition format."""
        self._models  # noqa: B018 - a reload's new models get their counters before the scrape
        return generate_latest(self.registry)

    # -- input -------------------------------------------------------------------

    def observe(self, event: str, **fields: Any) -> None:
        """An API or node event; unknown events are ignored, errors logged."""
        try:
            handler = self._handlers.get(event)
            if handler is not None:
                handler(**fields)
        except Exception:
            log.failure("metrics: observing {event} failed", event=event)

    def _model(self, model: object) -> str:
        return model if isinstance(model, str) and model in self._models else UNKNOWN

    def _device(self, device: object) -> Optional[str]:
        return device if isinstance(device, str) and device in self.node.supervisors else None

    @staticmethod
    def _endpoint(endpoint: object) -> str:
        if isinstance(endpoint, str):
            name = endpoint.strip("/")
            if name.startswith("v1/"):
                name = name[3:]
            if name in ENDPOINTS:
                return name
        return UNKNOWN

    @staticmethod
    def _status(status: object) -> str:
        if isinstance(status, int) and not isinstance(status, bool) and 100 <= status <= 599:
            return str(status)
        return UNKNOWN

    def _on_request(
        self,
        endpoint: object = None,
        model: object = None,
        status: object = None,
        duration: object = None,
        ttfb: object = None,
        **_: object,
    ) -> None:
        model_label = self._model(model)
        endpoint_label = endpoint if type(endpoint) is str and endpoint in _ENDPOINT_NAMES else self._endpoint(endpoint)
        status_label = _STATUS_LABELS.get(status, UNKNOWN) if type(status) is int else self._status(status)
        self.requests.inc((model_label, endpoint_label, status_label))
        labels = (model_label, endpoint_label)
        seconds = finite_number(duration)
        if seconds is not None and seconds >= 0:
            self.request_duration.observe(labels, seconds)
        first = finite_number(ttfb)
        if first is not None and first >= 0:
            self.request_ttfb.observe(labels, first)

    def _on_queue_full(self, model: object = None, **_: object) -> None:
        self.queue_full.labels(model=self._model(model)).inc()

    def _on_queue_timeout(self, model: object = None, **_: object) -> None:
        self.queue_timeouts.labels(model=self._model(model)).inc()

    def _on_idle_unload(self, device: object = None, model: object = None, **_: object) -> None:
        name = self._device(device)
        if name is not None:
            self.idle_unloads.labels(device=name, model=self._model(model)).inc()

    def _on_queue_wait(self, device: object = None, seconds: object = None, tenant: object = None,
                       **_: object) -> None:
        name = self._device(device)
        wait = finite_number(seconds)
        if name is not None and wait is not None:
            self.queue_wait.observe((name,), max(0.0, wait))
            if tenant is not None:
                self.tenant_wait.observe((self.tenant_label(tenant),), max(0.0, wait))

    def _on_tenant_limit(self, tenant: object = None, **_: object) -> None:
        self.tenant_limited.labels(tenant=self.tenant_label(tenant)).inc()

    _tenants_of: Optional[NodeConfig] = None
    _tenant_names: frozenset = frozenset()

    def tenant_label(self, tenant: object) -> str:
        """A tenant's label: its name if the config names it, else ``other`` (a bounded set)."""
        config = self.node.config
        if self._tenants_of is not config:
            from rolemesh.scheduling.tenants import Tenants

            self._tenants_of, self._tenant_names = config, Tenants(config).names
        return tenant if isinstance(tenant, str) and tenant in self._tenant_names else "other"

    # -- supervisors ---------------------------------------------------------------

    def _count_supervisor_event(self, event: str, device: object = None, model: object = None, **_: object) -> None:
        """One of a supervisor's counted events, credited to its model."""
        name = self._device(device)
        if name is not None:
            key = (name, self._model(model), event)
            self._supervisor_counts[key] = self._supervisor_counts.get(key, 0) + 1

    def _on_load(self, device: object = None, model: object = None, seconds: object = None, **_: object) -> None:
        """A child became ready: a load, and how long it took."""
        self._count_supervisor_event("load", device, model)
        name, took = self._device(device), finite_number(seconds)
        if name is not None and took is not None and took >= 0:
            self.load_duration.labels(device=name, model=self._model(model)).observe(took)

    def _now(self) -> float:
        return float(self.node.reactor.seconds())


class _LiveCollector(Collector):
    """Families read from live state at scrape time."""

    def __init__(self, metrics: NodeMetrics) -> None:
        self._metrics = metrics

    def describe(self) -> Iterable[Metric]:
        return []

    def collect(self) -> Iterable[Metric]:
        out: List[Metric] = []
        for part in (
            self._node,
            self._scheduler,
            self._children,
            self._backoffs,
            self._supervisor_counters,
            self._prompt_tokens,
            self._devices,
            self._telemetry,
            self._dispatcher,
        ):
            try:
                out.extend(part())
            except Exception:
                log.failure("metrics: collecting {part} failed", part=part.__name__)
        return out

    def _node(self) -> Iterator[Metric]:
        node = self._metrics.node
        info = GaugeMetricFamily(
            "rolemesh_node_info", "Constant 1; labels describe the agent.", labels=["node_id", "backend", "version"]
        )
        info.add_metric([str(node.config.node_id), str(getattr(node.backend, "name", UNKNOWN)), __version__], 1)
        yield info
        yield GaugeMetricFamily(
            "rolemesh_node_draining", "1 while the agent drains for shutdown.", value=1 if node.draining else 0
        )

    def _scheduler(self) -> Iterator[Metric]:
        scheduler = self._metrics.node.scheduler
        in_flight = GaugeMetricFamily(
            "rolemesh_device_in_flight", "Requests running on the device now.", labels=["device"]
        )
        queued = GaugeMetricFamily(
            "rolemesh_device_queue_depth", "Requests waiting for the device now.", labels=["device"]
        )
        limit = GaugeMetricFamily(
            "rolemesh_device_pending_limit",
            "max_pending_requests_per_device: in flight plus queued admitted per device.",
            labels=["device"],
        )
        by_tenant: Dict[str, List[int]] = {}
        label = self._metrics.tenant_label
        label("")  # the running config's tenant names, worked out once per config
        for name, book in scheduler.devices.items():
            in_flight.add_metric([name], len(book.running))
            queued.add_metric([name], len(book.queue))
            limit.add_metric([name], scheduler.pending_limit)
            for i, tickets in enumerate((book.running, book.queue)):
                for ticket in tickets:
                    by_tenant.setdefault(label(ticket.share.tenant), [0, 0])[i] += 1
        yield in_flight
        yield queued
        yield limit
        tenant_running = GaugeMetricFamily(
            "rolemesh_tenant_running", "A tenant's requests running now (others as `other`).", labels=["tenant"])
        tenant_queued = GaugeMetricFamily(
            "rolemesh_tenant_queued", "A tenant's requests waiting in device queues now.", labels=["tenant"])
        for tenant in sorted(set(by_tenant) | self._metrics._tenant_names):
            running, waiting = by_tenant.get(tenant, (0, 0))
            tenant_running.add_metric([tenant], running)
            tenant_queued.add_metric([tenant], waiting)
        yield tenant_running
        yield tenant_queued
        prefixes = self._metrics.node.prefixes
        yield GaugeMetricFamily("rolemesh_prefix_memory_entries",
                                "Prompt prefixes remembered for prefix affinity now.", value=len(prefixes))
        yield CounterMetricFamily("rolemesh_prefix_lookups", "Requests that looked their prompt prefix up "
                                  "(a model on several devices).", value=prefixes.lookups)
        yield CounterMetricFamily("rolemesh_prefix_hits", "Lookups that found the device that served the prefix.",
                                  value=prefixes.hits)

    def _children(self) -> Iterator[Metric]:
        metrics = self._metrics
        state = GaugeMetricFamily(
            "rolemesh_child_state", "1 for the llama-server child's current state.", labels=["device", "state"]
        )
        model = GaugeMetricFamily(
            "rolemesh_child_model",
            "1 for the model the device's child serves or is loading.",
            labels=["device", "model"],
        )
        stale = GaugeMetricFamily(
            "rolemesh_child_stale",
            "1 while the device's child runs a command a reload replaced (it finishes its requests, then restarts).",
            labels=["device"],
        )
        for name, supervisor in metrics.node.supervisors.items():
            for s in CHILD_STATES:
                state.add_metric([name, s], 1 if supervisor.state == s else 0)
            current = supervisor.loading_or_loaded
            # A model a reload removed still shows where its child serves (until it leaves).
            for model_id in sorted(metrics._models | ({current} if current is not None else set())):
                model.add_metric([name, model_id], 1 if current == model_id else 0)
            stale.add_metric([name], 1 if metrics.node.child_stale(name) else 0)
        yield state
        yield model
        yield stale

    def _backoffs(self) -> Iterator[Metric]:
        """Which model backs off on which device, until when and after how
        many failures in a row (0 for every other model)."""
        metrics = self._metrics
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
        for name, supervisor in metrics.node.supervisors.items():
            active = {backoff.model: backoff for backoff in supervisor.backoffs()}
            for model_id in sorted(metrics._models | set(active)):
                backoff = active.get(model_id)
                until.add_metric([name, model_id], backoff.until if backoff is not None else 0)
                failures.add_metric([name, model_id], backoff.failures if backoff is not None else 0)
        yield until
        yield failures

    def _supervisor_counters(self) -> Iterator[Metric]:
        metrics = self._metrics
        for event, (name, help_text) in SUPERVISOR_COUNTERS.items():
            family = CounterMetricFamily(name, help_text, labels=["device", "model"])
            models = sorted(metrics._models)
            extra = sorted({m for (_, m, e) in metrics._supervisor_counts if e == event} - metrics._models)
            for device in metrics.node.supervisors:
                for model_id in models + extra:
                    family.add_metric(
                        [device, model_id], metrics._supervisor_counts.get((device, model_id, event), 0)
                    )
            yield family

    def _prompt_tokens(self) -> Iterator[Metric]:
        """Prompt tokens llama-server served from its cache and processed
        (the answers' ``timings``), per device (or group) and model: 0 for
        every configured pair from the start."""
        metrics = self._metrics
        tally = metrics.node.prompt_cache
        cached = CounterMetricFamily("rolemesh_prompt_tokens_cached", "Prompt tokens llama-server reused from its "
                                     "KV cache (timings.cache_n of its answers).", labels=["device", "model"])
        processed = CounterMetricFamily("rolemesh_prompt_tokens_processed", "Prompt tokens llama-server processed "
                                        "(timings.prompt_n of its answers).", labels=["device", "model"])
        pairs = {(device, model_id) for device in metrics.node.supervisors for model_id in metrics._models}
        for device, model_id in sorted(pairs | set(tally.counts)):
            hit, miss = tally.get(device, model_id)
            cached.add_metric([device, model_id], hit)
            processed.add_metric([device, model_id], miss)
        yield cached
        yield processed

    def _devices(self) -> Iterator[Metric]:
        node = self._metrics.node
        now = self._metrics._now()
        g = {
            "total": GaugeMetricFamily("rolemesh_device_memory_total_bytes", "Device memory size.", labels=["device"]),
            "used": GaugeMetricFamily("rolemesh_device_memory_used_bytes", "Device memory in use.", labels=["device"]),
            "free": GaugeMetricFamily("rolemesh_device_memory_free_bytes", "Device memory free.", labels=["device"]),
            "util": GaugeMetricFamily(
                "rolemesh_device_utilization_ratio", "Device utilization, 0 to 1.", labels=["device"]
            ),
            "temp": GaugeMetricFamily("rolemesh_device_temperature_celsius", "Device temperature.", labels=["device"]),
            "power": GaugeMetricFamily("rolemesh_device_power_watts", "Device power draw.", labels=["device"]),
            "age": GaugeMetricFamily(
                "rolemesh_device_metrics_sample_age_seconds",
                "Seconds since the device's metrics were last measured.",
                labels=["device"],
            ),
            "stale": GaugeMetricFamily(
                "rolemesh_device_metrics_stale",
                "1 when the latest device sample failed (figures are the last good ones) or there is no sample yet.",
                labels=["device"],
            ),
        }
        for ref in node.devices:
            name = ref.name
            sample = node.metrics.get(name)
            total = finite_number(sample.memory_total_bytes) if sample is not None else None
            if total is None:
                total = finite_number(ref.memory_total_bytes)
            if total is not None:
                g["total"].add_metric([name], total)
            if sample is None:
                g["stale"].add_metric([name], 1)
                continue
            for key, value in (
                ("used", sample.memory_used_bytes),
                ("free", sample.memory_free_bytes),
                ("temp", sample.temperature_c),
                ("power", sample.power_w),
            ):
                number = finite_number(value)
                if number is not None:
                    g[key].add_metric([name], number)
            util = finite_number(sample.utilization_pct)
            if util is not None:
                g["util"].add_metric([name], util / 100.0)
            sampled_at = finite_number(sample.sampled_at)
            if sampled_at is not None:
                g["age"].add_metric([name], max(0.0, now - sampled_at))
            g["stale"].add_metric([name], 1 if sample.stale else 0)
        yield from g.values()

    def _telemetry(self) -> Iterator[Metric]:
        """Each ready child's own telemetry, labelled by device and model."""
        metrics = self._metrics
        sampler = getattr(metrics.node, "telemetry", None)
        if sampler is None:
            return
        now = metrics._now()
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
        age = GaugeMetricFamily("rolemesh_device_telemetry_age_seconds",
                                "Seconds since the child's telemetry last answered.", labels=["device", "model"])
        child: Dict[str, Any] = {}
        for name in metrics.node.supervisors:
            record = sampler.latest(name)
            if record is None:
                continue
            labels = [name, metrics._model(record.model)]
            stale.add_metric(labels, 1 if record.stale else 0)
            good_at = finite_number(record.good_at)
            if good_at is not None:
                age.add_metric(labels, max(0.0, now - good_at))
            for family, value in ((slots, record.slots_total), (busy, record.slots_busy),
                                  (rate, record.tokens_per_s), (kv, record.kv_cache_usage_ratio)):
                number = finite_number(value)
                if number is not None:
                    family.add_metric(labels, number)
            _relabel(child, record.families, labels)
        yield from (slots, busy, rate, kv, stale, age)
        yield from child.values()

    def _dispatcher(self) -> Iterator[Metric]:
        client = getattr(self._metrics.root, "dispatcher", None)
        if client is None:
            return
        beats = CounterMetricFamily(
            "rolemesh_dispatcher_heartbeats", "Heartbeats sent, by outcome.", labels=["outcome"]
        )
        beats.add_metric(["success"], getattr(client, "heartbeats_ok", 0) or 0)
        beats.add_metric(["failure"], getattr(client, "heartbeats_failed", 0) or 0)
        yield beats
        regs = CounterMetricFamily(
            "rolemesh_dispatcher_registrations", "Registrations sent, by outcome.", labels=["outcome"]
        )
        regs.add_metric(["success"], getattr(client, "registrations_ok", 0) or 0)
        regs.add_metric(["failure"], getattr(client, "registrations_failed", 0) or 0)
        yield regs
        last = finite_number(getattr(client, "last_success", None))
        since = self._metrics._now() - (last if last is not None else self._metrics._started)
        yield GaugeMetricFamily(
            "rolemesh_dispatcher_seconds_since_last_success",
            "Seconds since the dispatcher last answered OK (since agent start if it never has).",
            value=max(0.0, since),
        )
        state = GaugeMetricFamily(
            "rolemesh_dispatcher_state", "1 for the dispatcher client's current state.", labels=["state"]
        )
        current = getattr(client, "state", None)
        for s in DISPATCHER_STATES:
            state.add_metric([s], 1 if current == s else 0)
        yield state


def _relabel(out: Dict[str, Any], families: Iterable[Any], labels: List[str]) -> None:
    """Add a child's families to ``out`` as ``rolemesh_llamacpp_*`` series with
    ``device`` and ``model`` labels (never the child's port), keeping the
    child's counter/gauge types (anything else is left out)."""
    from rolemesh.children.telemetry import export_name

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
