"""Prometheus metrics for ``GET /metrics``.

:class:`NodeMetrics` learns about the agent two ways:

* ``observe(event, **fields)``, an observer (:mod:`rolemesh.base.events`) of the
  API (``"request"`` after every proxied request), of the node
  (``"queue_full"``, ``"queue_timeout"``, ``"queue_wait"``, ``"idle_unload"``)
  and of every :class:`~rolemesh.children.supervisor.DeviceSupervisor`: the events
  the supervisor counts at their source (loads, load failures and timeouts,
  crashes, restarts, safe-mode retries: ``COUNTED_EVENTS``) become per
  ``(device, model)`` counts, and a load's ``seconds`` go into a histogram.
  These families are plain numbers (:mod:`rolemesh.api.exposition`).
* live state read at scrape time (:mod:`rolemesh.api.live_metrics`): scheduler
  books (in flight, queued), child states, back-offs, device samples, the
  dispatcher client, and the children's own telemetry
  (:mod:`rolemesh.children.telemetry`): slots, tokens/s, staleness, and
  llama-server's series re-exported as ``rolemesh_llamacpp_*`` with
  ``device`` and ``model`` labels.

A scrape (:meth:`NodeMetrics.render`) does not format what has not changed:
each event family keeps its text until an event changes it, each live part
until the snapshot of what it shows changes (the few series that move with
time alone, the ages, are rendered again when the clock has moved), so a
scrape costs about the snapshots and a join.  What it returns is byte for
byte what ``generate_latest`` makes of the same families
(:meth:`NodeMetrics.render_uncached`, over the agent's own
:class:`~prometheus_client.CollectorRegistry`, never the global one); the
tests hold the two side by side after every kind of change.  No thread pool.

Labels are bounded: ``model`` is a configured ``model_id`` (anything else,
including a request for an unknown model, is ``"unknown"``), ``device`` is a
device name from discovery/config, ``endpoint`` is one of
:data:`ENDPOINTS` and ``status`` an HTTP status code.  Nothing a client sends
becomes a label value.  Every callback catches and logs what it raises: a
metrics bug never breaks a request or a scrape.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any, Callable, Dict, FrozenSet, Iterator, List, Optional, Protocol, Tuple, Union

from prometheus_client import CollectorRegistry, generate_latest
from twisted.logger import Logger

from rolemesh.api.app import PROXIED_ROUTES
from rolemesh.api.exposition import PlainCounter, PlainHistogram
from rolemesh.api.live_metrics import SUPERVISOR_COUNTERS, UNKNOWN, LiveCollector, model_label, tenant_label
from rolemesh.children.telemetry import finite_number
from rolemesh.config.file import NodeConfig

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
#: Whole-request latency: LLM answers range from milliseconds (embeddings) to minutes.
REQUEST_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0)
#: Time to first byte: includes queueing and any model load.
TTFB_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
#: Model load (spawn to ready).
LOAD_BUCKETS = (0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0)
#: Time a request waits in a device queue before it may run (0 when it runs at once).
QUEUE_WAIT_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)

#: ``status`` label values of every HTTP status code, made once.
_STATUS_LABELS = {code: str(code) for code in range(100, 600)}


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
            self.queue_full.labels((model_id,))
            self.queue_timeouts.labels((model_id,))
            for device_name in self.node.supervisors:
                self.idle_unloads.labels((device_name, model_id))

    def __init__(self, node: Node, root: Optional[MetricsRoot] = None) -> None:
        self.node = node
        self.root = root
        self.registry = CollectorRegistry(auto_describe=False)
        #: The event families, in the registry's order (each renders its own text).
        self._families: List[Union[PlainCounter, PlainHistogram]] = []
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
        self.live = LiveCollector(node, lambda: self._models, self.tenant_names, self._supervisor_counts,
                                  lambda: getattr(self.root, "dispatcher", None), self._started)
        self.registry.register(self.live)
        for supervisor in node.supervisors.values():
            supervisor.events.subscribe(self.observe)
        node.events.subscribe(self.observe)

    def _request_families(self) -> None:
        """The families fed by the API's ``request`` events: plain numbers
        (see rolemesh.api.exposition), as they change with every request."""
        self.requests = PlainCounter(
            "rolemesh_requests",
            "Proxied requests by model, endpoint and HTTP status (499: client went away).",
            ["model", "endpoint", "status"],
        )
        self.request_duration = PlainHistogram(
            "rolemesh_request_duration_seconds",
            "Proxied request latency, arrival to last byte.",
            ["model", "endpoint"],
            REQUEST_BUCKETS,
        )
        self.request_ttfb = PlainHistogram(
            "rolemesh_request_ttfb_seconds",
            "Proxied request time to first byte from llama-server (queueing and model load included).",
            ["model", "endpoint"],
            TTFB_BUCKETS,
        )
        for family in (self.requests, self.request_duration, self.request_ttfb):
            self._add(family)

    def _add(self, family: Union[PlainCounter, PlainHistogram]) -> None:
        self.registry.register(family)
        self._families.append(family)

    def _node_families(self) -> None:
        """The families fed by the node's and the supervisors' events."""
        self.queue_full = PlainCounter(
            "rolemesh_queue_full",
            "Requests refused with 429 queue_full (max_pending_requests_per_device).",
            ["model"],
        )
        self.queue_timeouts = PlainCounter(
            "rolemesh_queue_timeouts",
            "Requests answered 503 queue_timeout after waiting queue_timeout_s in a device queue.",
            ["model"],
        )
        self.idle_unloads = PlainCounter(
            "rolemesh_idle_unloads", "Children stopped after idle_unload_s without requests.", ["device", "model"]
        )
        self.load_duration = PlainHistogram(
            "rolemesh_model_load_duration_seconds",
            "Seconds from spawning llama-server to ready, per load.",
            ["device", "model"],
            LOAD_BUCKETS,
        )
        self.queue_wait = PlainHistogram(
            "rolemesh_queue_wait_seconds",
            "Seconds a request waited in its device's queue before it could run (model load not included).",
            ["device"],
            QUEUE_WAIT_BUCKETS,
        )
        self.tenant_wait = PlainHistogram(
            "rolemesh_tenant_queue_wait_seconds",
            "Seconds a tenant's request waited in a device queue (tenants of the config, others as `other`).",
            ["tenant"],
            QUEUE_WAIT_BUCKETS,
        )
        self.tenant_limited = PlainCounter(
            "rolemesh_tenant_limited",
            "Requests refused with 429 tenant_limit (the tenant's max_concurrent).",
            ["tenant"],
        )
        for family in (self.queue_full, self.queue_timeouts, self.idle_unloads, self.load_duration, self.queue_wait,
                       self.tenant_wait, self.tenant_limited):
            self._add(family)
        self._models  # noqa: B018 - worked out here once: pre-creates the per-model counters
        for device_name in self.node.supervisors:
            self.queue_wait.labels((device_name,))

    # -- output ------------------------------------------------------------------

    def render(self) -> bytes:
        """The metrics in Prometheus text exposition format: each family's
        and live part's text as last rendered, unless it changed since."""
        self._models  # noqa: B018 - a reload's new models get their counters before the scrape
        return b"".join(self._texts())

    def _texts(self) -> Iterator[bytes]:
        for family in self._families:
            try:
                text = family.text()
            except Exception:
                log.failure("metrics: rendering {family} failed", family=family.name)
                continue
            yield text
        yield from self.live.texts()

    def render_uncached(self) -> bytes:
        """The same text made afresh by ``generate_latest`` from the registry
        (what :meth:`render` must always equal; the tests compare them)."""
        self._models  # noqa: B018
        return generate_latest(self.registry)

    @property
    def renders(self) -> int:
        """Families and live parts rendered so far (not those served as they were)."""
        return sum(family.renders for family in self._families) + self.live.renders

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
        return model_label(model, self._models)

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
        self.queue_full.inc((self._model(model),))

    def _on_queue_timeout(self, model: object = None, **_: object) -> None:
        self.queue_timeouts.inc((self._model(model),))

    def _on_idle_unload(self, device: object = None, model: object = None, **_: object) -> None:
        name = self._device(device)
        if name is not None:
            self.idle_unloads.inc((name, self._model(model)))

    def _on_queue_wait(self, device: object = None, seconds: object = None, tenant: object = None,
                       **_: object) -> None:
        name = self._device(device)
        wait = finite_number(seconds)
        if name is not None and wait is not None:
            self.queue_wait.observe((name,), max(0.0, wait))
            if tenant is not None:
                self.tenant_wait.observe((self.tenant_label(tenant),), max(0.0, wait))

    def _on_tenant_limit(self, tenant: object = None, **_: object) -> None:
        self.tenant_limited.inc((self.tenant_label(tenant),))

    _tenants_of: Optional[NodeConfig] = None
    _tenant_names: FrozenSet[str] = frozenset()

    def tenant_names(self) -> FrozenSet[str]:
        """The running config's tenant names, worked out once per config."""
        config = self.node.config
        if self._tenants_of is not config:
            from rolemesh.scheduling.tenants import Tenants

            self._tenants_of, self._tenant_names = config, Tenants(config).names
        return self._tenant_names

    def tenant_label(self, tenant: object) -> str:
        """A tenant's label: its name if the config names it, else ``other`` (a bounded set)."""
        return tenant_label(tenant, self.tenant_names())

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
            self.load_duration.observe((name, self._model(model)), took)

    def _now(self) -> float:
        return float(self.node.reactor.seconds())
