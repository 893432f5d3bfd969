"""What each llama-server child says about its own load: slots, queue,
tokens, tokens/s -- and how far a loading child has got.

A dispatcher choosing between nodes needs free slots and throughput, not only
"model loaded"; llama-server knows both (``/metrics`` with ``--metrics``,
``/slots`` unless ``--no-slots``).  This module reads them:

* pure parsers: :func:`parse_prometheus` (the child's exposition text into
  :class:`ChildFamily` records) and :func:`parse_slots` (``/slots`` JSON into
  :class:`SlotState` records), and :func:`summarize`, which turns one sample
  plus the previous one into a frozen :class:`ChildTelemetry` with tokens/s;
* :class:`TelemetrySampler`: on the node's metrics interval it asks every
  *ready* child, on its own short-lived connections and with a short timeout,
  never on the request path.  A child that does not answer is marked stale
  (the last good figures kept, ``stale`` and ``error`` set); it is never
  restarted for that -- serving decides a child's health, not telemetry;
* :func:`load_progress`: how far a loading child has got, read from its
  output lines (the supervisor's ring buffer), as a :class:`LoadProgress`;
* :func:`device_issues`: the typed issue list (stable codes with the model and
  the time) that the heartbeat and inventory carry, so a dispatcher can act
  without reading logs.
"""

from __future__ import annotations

import json
import re
from typing import TYPE_CHECKING, Any, Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

import attr
from prometheus_client.parser import text_string_to_metric_families
from twisted.internet import defer
from twisted.internet.defer import Deferred
from twisted.logger import Logger
from twisted.python.failure import Failure

from rolemesh.base.devices import DeviceMetrics
from rolemesh.base.interfaces import IHTTPClientReactor
from rolemesh.event_loop.reactor import UsesReactor

if TYPE_CHECKING:  # the supervisor reports through this module: no import at run time
    from rolemesh.children.supervisor import DeviceSupervisor

log = Logger(namespace="rolemesh.telemetry")

#: Longest a telemetry request to a child may take (both endpoints together).
TELEMETRY_TIMEOUT_S = 2.0
#: Largest body read from a child's /metrics or /slots.
MAX_BODY_BYTES = 1 << 20
#: The child's series prefix, and what relabelled series are called instead.
CHILD_PREFIX = "llamacpp:"
EXPORT_PREFIX = "rolemesh_llamacpp_"

#: Issue codes: the supervisor's failure kinds, plus telemetry's own.
BACKEND_METRICS_STALE = "backend_metrics_stale"
DEVICE_METRICS_STALE = "device_metrics_stale"
ISSUE_CODES = (
    "model_load_failed",
    "model_load_timeout",
    "child_crashed",
    "illegal_instruction",
    "unhealthy",
    BACKEND_METRICS_STALE,
    DEVICE_METRICS_STALE,
)


# ---------------------------------------------------------------------------
# Records


@attr.s(auto_attribs=True, frozen=True)
class ChildSample:
    """One sample line of a child's family: name, sorted labels, value."""

    name: str
    labels: Tuple[Tuple[str, str], ...]
    value: float


@attr.s(auto_attribs=True, frozen=True)
class ChildFamily:
    """One metric family as the child exposes it (name without its prefix)."""

    name: str
    type: str
    documentation: str
    samples: Tuple[ChildSample, ...]


@attr.s(auto_attribs=True, frozen=True)
class SlotState:
    """One llama-server slot from ``/slots``."""

    id: int
    n_ctx: Optional[int]
    is_processing: bool
    id_task: Optional[int] = None
    n_decoded: int = 0
    n_prompt_tokens: int = 0


@attr.s(auto_attribs=True, frozen=True)
class ChildTelemetry:
    """The latest telemetry of one device's child.

    ``None`` means the child did not report it (e.g. no KV figure in this
    build).  ``stale`` with ``error``: the last request failed and the
    figures are the last good ones.  ``generation`` is the supervisor's child
    generation it was taken from: a new child starts its counters afresh.
    """

    device: str
    model: str
    generation: int
    sampled_at: float
    slots_total: Optional[int] = None
    slots_busy: Optional[int] = None
    requests_processing: Optional[float] = None
    requests_deferred: Optional[float] = None
    prompt_tokens_total: Optional[float] = None
    generated_tokens_total: Optional[float] = None
    tokens_per_s: Optional[float] = None
    kv_cache_usage_ratio: Optional[float] = None
    kv_cache_tokens: Optional[float] = None
    families: Tuple[ChildFamily, ...] = ()
    slots: Tuple[SlotState, ...] = ()
    stale: bool = False
    error: Optional[str] = None
    #: When the figures were last good, and since when they are stale.
    good_at: Optional[float] = None
    stale_since: Optional[float] = None

    @property
    def slots_free(self) -> Optional[int]:
        if self.slots_total is None or self.slots_busy is None:
            return None
        return max(0, self.slots_total - self.slots_busy)

    def marked_stale(self, error: str, now: float) -> "ChildTelemetry":
        since = self.stale_since if self.stale and self.stale_since is not None else now
        return attr.evolve(self, stale=True, error=error, stale_since=since)

    def slots_json(self) -> Dict[str, Any]:
        """The inventory's ``slots`` block."""
        return {
            "total": self.slots_total,
            "busy": self.slots_busy,
            "free": self.slots_free,
            "requests_processing": _int(self.requests_processing),
            "requests_deferred": _int(self.requests_deferred),
            "kv_cache_usage_ratio": self.kv_cache_usage_ratio,
            "kv_cache_tokens": _int(self.kv_cache_tokens),
            "sampled_at": self.sampled_at,
            "stale": self.stale,
            "error": self.error,
        }

    def throughput_json(self) -> Dict[str, Any]:
        """The inventory's ``throughput`` block."""
        return {
            "tokens_per_s": self.tokens_per_s,
            "prompt_tokens_total": _int(self.prompt_tokens_total),
            "generated_tokens_total": _int(self.generated_tokens_total),
        }


@attr.s(auto_attribs=True, frozen=True)
class LoadProgress:
    """How far a loading child has got, from its own output."""

    model: str
    since: float
    step: str
    steps_done: int
    steps_total: int
    file_bytes: Optional[int] = None
    layers_offloaded: Optional[int] = None
    layers_total: Optional[int] = None

    def to_json(self, now: Optional[float] = None) -> Dict[str, Any]:
        data = attr.asdict(self)
        if now is not None:
            data["elapsed_s"] = round(max(0.0, now - self.since), 3)
        return data


def _int(value: Optional[float]) -> Optional[int]:
    return None if value is None else int(value)


def finite_number(value: object) -> Optional[float]:
    """``value`` as a float if it is a finite real number (not a bool, NaN
    or an infinity: a sample, a duration or a count from outside), else None."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    value = float(value)
    return value if value == value and value not in (float("inf"), float("-inf")) else None


# ---------------------------------------------------------------------------
# Parsers (pure)


def parse_prometheus(text: str) -> Tuple[ChildFamily, ...]:
    """The child's ``/metrics`` text as records; ``llamacpp:`` families only.

    Raises ValueError when the text is not Prometheus exposition format.
    """
    out: List[ChildFamily] = []
    try:
        families = list(text_string_to_metric_families(text))
    except Exception as e:  # the parser raises ValueError, IndexError, ... on garbage
        raise ValueError(f"not Prometheus text: {e}") from None
    for family in families:
        if not family.name.startswith(CHILD_PREFIX):
            continue
        short = family.name[len(CHILD_PREFIX):]
        samples = []
        for s in family.samples:
            value = finite_number(s.value)
            if value is None or not s.name.startswith(CHILD_PREFIX):
                continue
            samples.append(ChildSample(s.name[len(CHILD_PREFIX):], tuple(sorted(s.labels.items())), value))
        out.append(ChildFamily(short, family.type, family.documentation, tuple(samples)))
    return tuple(out)


def parse_slots(body: Any) -> Tuple[SlotState, ...]:
    """``/slots`` JSON (already decoded) as records; ValueError if it is not a slot list."""
    if not isinstance(body, list):
        raise ValueError("/slots did not answer a JSON list")
    out = []
    for entry in body:
        if not isinstance(entry, dict) or not isinstance(entry.get("id"), int):
            raise ValueError("/slots entry without an integer id")
        n_decoded = 0
        steps = entry.get("next_token")
        if isinstance(steps, list) and steps and isinstance(steps[0], dict):
            n_decoded = int(finite_number(steps[0].get("n_decoded")) or 0)
        n_ctx = entry.get("n_ctx")
        id_task = entry.get("id_task")
        out.append(
            SlotState(
                id=entry["id"],
                n_ctx=n_ctx if isinstance(n_ctx, int) and not isinstance(n_ctx, bool) else None,
                is_processing=entry.get("is_processing") is True,
                id_task=id_task if isinstance(id_task, int) and not isinstance(id_task, bool) else None,
                n_decoded=max(0, n_decoded),
                n_prompt_tokens=max(0, int(finite_number(entry.get("n_prompt_tokens")) or 0)),
            )
        )
    return tuple(out)


def family_value(families: Iterable[ChildFamily], name: str) -> Optional[float]:
    """The unlabelled value of family ``name`` (without the prefix), if present."""
    for family in families:
        for sample in family.samples:
            if sample.name == name and not sample.labels:
                return sample.value
    return None


def generated_since(previous: Sequence[SlotState], current: Sequence[SlotState]) -> int:
    """Tokens the slots generated between two ``/slots`` samples.

    A slot still on the same task adds what it decoded since; a slot on a new
    task (running, or just finished and showing it as its last) adds all of it.
    """
    before = {s.id: s for s in previous}
    total = 0
    for slot in current:
        if slot.id_task is None:
            continue
        old = before.get(slot.id)
        if old is not None and old.id_task == slot.id_task:
            total += max(0, slot.n_decoded - old.n_decoded)
        else:
            total += slot.n_decoded
    return total


def summarize(
    device: str,
    model: str,
    generation: int,
    now: float,
    families: Tuple[ChildFamily, ...],
    slots: Optional[Tuple[SlotState, ...]],
    previous: Optional[ChildTelemetry] = None,
) -> ChildTelemetry:
    """One good sample as a record; tokens/s from the ``previous`` one.

    llama-server adds a request's tokens to its counters only when the request
    ends, so tokens/s takes the larger of the counter's growth and what the
    slots decoded meanwhile (live while streams run).  ``slots`` None: the
    child has ``/slots`` off; slot figures then come from ``/metrics`` alone.
    """
    processing = family_value(families, "requests_processing")
    generated = family_value(families, "tokens_predicted_total")
    busy: Optional[int]
    total: Optional[int]
    if slots is not None:
        total = len(slots)
        busy = sum(1 for s in slots if s.is_processing)
    else:
        total = None
        busy = None if processing is None else int(processing)
    rate: Optional[float] = None
    if previous is not None and previous.generation == generation and not previous.stale:
        elapsed = now - previous.sampled_at
        if elapsed > 0:
            counted = 0.0
            if generated is not None and previous.generated_tokens_total is not None:
                counted = max(0.0, generated - previous.generated_tokens_total)
            decoded = float(generated_since(previous.slots, slots)) if slots is not None else 0.0
            rate = round(max(counted, decoded) / elapsed, 3)
    kv_ratio = family_value(families, "kv_cache_usage_ratio")
    return ChildTelemetry(
        device=device,
        model=model,
        generation=generation,
        sampled_at=now,
        slots_total=total,
        slots_busy=busy,
        requests_processing=processing,
        requests_deferred=family_value(families, "requests_deferred"),
        prompt_tokens_total=family_value(families, "prompt_tokens_total"),
        generated_tokens_total=generated,
        tokens_per_s=rate,
        kv_cache_usage_ratio=None if kv_ratio is None else max(0.0, min(1.0, kv_ratio)),
        kv_cache_tokens=family_value(families, "kv_cache_tokens"),
        families=families,
        slots=slots or (),
        good_at=now,
    )


def export_name(child_name: str) -> str:
    """The agent's name for a child series (``llamacpp:x`` -> ``rolemesh_llamacpp_x``)."""
    return EXPORT_PREFIX + re.sub(r"[^a-zA-Z0-9_]", "_", child_name)


# ---------------------------------------------------------------------------
# Load progress (pure: lines in, record out)

#: Loading steps in the order llama-server prints them: (step, pattern).
#: Builds differ in how much they print (11434 prints ~10 lines at its
#: default verbosity; older ones print every loader line), so a step that
#: a build does not print is skipped over, and ``steps_done`` only grows.
LOAD_STEPS: Tuple[Tuple[str, "re.Pattern[str]"], ...] = (
    ("loading_model", re.compile(r"load_model: loading model|llama_model_loader: loaded meta data")),
    ("loading_tensors", re.compile(r"load_tensors:")),
    ("creating_context", re.compile(r"llama_context|llama_init_from_model")),
    ("warming_up", re.compile(r"warming up the model|threadpool init")),
    ("initializing_slots", re.compile(r"initializing, n_slots|initializing slots")),
    ("loaded", re.compile(r"model loaded|listening on http|all slots are idle")),
)
_START_MARK = "[rolemesh] starting "
_FILE_SIZE = re.compile(r"file size\s*=\s*([\d.]+)\s*(B|KiB|MiB|GiB|TiB)\b")
_OFFLOADED = re.compile(r"offloaded (\d+)/(\d+) layers")
_UNITS = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40}


def load_progress(lines: Sequence[str], model: str, since: float) -> LoadProgress:
    """How far the load that the last ``[rolemesh] starting`` line began has got."""
    start = 0
    for i in range(len(lines) - 1, -1, -1):
        if lines[i].startswith(_START_MARK):
            start = i + 1
            break
    done = 0
    step = "spawned"
    file_bytes = layers_offloaded = layers_total = None
    for line in lines[start:]:
        for index in range(done, len(LOAD_STEPS)):
            name, pattern = LOAD_STEPS[index]
            if pattern.search(line):
                done, step = index + 1, name
                break
        size = _FILE_SIZE.search(line)
        if size:
            file_bytes = int(float(size.group(1)) * _UNITS[size.group(2)])
        offloaded = _OFFLOADED.search(line)
        if offloaded:
            layers_offloaded, layers_total = int(offloaded.group(1)), int(offloaded.group(2))
    return LoadProgress(model, since, step, done, len(LOAD_STEPS), file_bytes, layers_offloaded, layers_total)


# ---------------------------------------------------------------------------
# Typed issues (pure)


#: A model serves only with --no-repack after llama-server died of SIGILL.
SAFE_MODE = "safe_mode"


def issue(code: str, message: Optional[str], model: Optional[str], at: Optional[float]) -> Dict[str, Any]:
    return {"code": code, "message": (message or code)[:300], "model": model, "at": at}


def device_issues(supervisor: "DeviceSupervisor", telemetry: Optional[ChildTelemetry],
                  device_metrics: Optional[DeviceMetrics]) -> List[Dict[str, Any]]:
    """The device's current problems, each with a stable ``code``, the model
    it concerns (or None) and since when (reactor seconds: POSIX time on the
    real reactor, the clock the heartbeat's ``time`` uses too)."""
    out = []
    held = getattr(supervisor, "model", None)
    model_now = held.model_id if held is not None else None
    code = getattr(supervisor, "last_error_code", None)
    if code:
        out.append(issue(code, getattr(supervisor, "last_error", None), model_now,
                         getattr(supervisor, "last_error_at", None)))
    for warning in getattr(supervisor, "warnings", ()):
        # Serving, but only thanks to --no-repack after a SIGILL: a build to replace.
        out.append(issue(SAFE_MODE, warning, model_now, getattr(supervisor, "safe_mode_since", None)))
    if telemetry is not None and telemetry.stale:
        out.append(issue(BACKEND_METRICS_STALE, f"llama-server telemetry: {telemetry.error}", telemetry.model,
                         telemetry.stale_since))
    if device_metrics is not None and getattr(device_metrics, "stale", False):
        out.append(issue(DEVICE_METRICS_STALE, f"device metrics: {device_metrics.error or 'no sample'}", None,
                         device_metrics.sampled_at))
    return out


# ---------------------------------------------------------------------------
# The sampler (I/O)


def _treq_get(reactor: IHTTPClientReactor) -> Callable[..., Deferred]:
    from rolemesh.http.control_client import quiet_treq

    return quiet_treq(reactor, persistent=False, connect_timeout=TELEMETRY_TIMEOUT_S).get


class TelemetrySampler(UsesReactor[IHTTPClientReactor]):
    """Samples every ready child's ``/metrics`` and ``/slots``.

    ``get`` is a treq-like ``get(url)`` (tests pass a
    ``StubTreq``'s); by default a quiet treq client on its own,
    non-persistent connections, so telemetry never borrows a connection a
    request could use.  One sample per device is in flight at a time.
    """

    def __init__(
        self,
        supervisors: Mapping[str, Any],
        reactor: Optional[IHTTPClientReactor] = None,
        get: Optional[Callable[..., Deferred]] = None,
        timeout: float = TELEMETRY_TIMEOUT_S,
    ) -> None:
        self._supervisors = supervisors
        self._reactor = reactor
        self._get = get
        self.timeout = timeout
        self._latest: Dict[str, ChildTelemetry] = {}
        self._in_flight: Dict[str, Deferred] = {}
        #: Samples that failed / succeeded since start (for tests and metrics).
        self.failures = 0
        self.successes = 0

    @property
    def get(self) -> Callable[..., Deferred]:
        if self._get is None:
            self._get = _treq_get(self.reactor)
        return self._get

    def latest(self, device: str) -> Optional[ChildTelemetry]:
        """The device's telemetry if it belongs to the child running now."""
        record = self._latest.get(device)
        supervisor = self._supervisors.get(device)
        if record is None or supervisor is None or supervisor.endpoint is None:
            return None
        if record.generation != supervisor.generation:
            return None
        return record

    def sample(self) -> "Deferred[None]":
        """Sample every ready child; fires when all have answered or timed out.

        Never fails: a periodic caller must not stop.
        """
        waits = []
        for name, supervisor in list(self._supervisors.items()):
            try:
                endpoint = supervisor.endpoint
                if endpoint is None:
                    self._latest.pop(name, None)
                    continue
                if name in self._in_flight:
                    continue
                d = self._sample_one(name, supervisor.model.model_id, endpoint.base_url, supervisor.generation)
                self._in_flight[name] = d
                d.addBoth(self._done, name)
                waits.append(d)
            except Exception:
                log.failure("telemetry: sampling {device} failed", device=name)
        return defer.gatherResults(waits, consumeErrors=True).addBoth(lambda _: None)

    def stop(self) -> None:
        """Cancel the requests in flight (the node is stopping)."""
        for d in list(self._in_flight.values()):
            d.cancel()

    def _done(self, _: Any, name: str) -> None:
        self._in_flight.pop(name, None)

    async def _fetch(self, url: str, optional: bool = False) -> Optional[bytes]:
        """The body, or None when ``optional`` and the child has the endpoint
        off (llama-server answers 501 "not supported"; 404 on other builds)."""
        # No treq ``timeout=`` (it would use the global reactor): the caller's
        # timer cancels the whole sample.
        response = await self.get(url)
        body: bytes = await response.content()
        if optional and response.code in (404, 501):
            return None
        if response.code != 200:
            raise ValueError(f"{url.rsplit('/', 1)[-1]} answered HTTP {response.code}")
        if len(body) > MAX_BODY_BYTES:
            raise ValueError(f"{url.rsplit('/', 1)[-1]} answered {len(body)} bytes")
        return body

    def _sample_one(self, device: str, model: str, base_url: str, generation: int) -> "Deferred[None]":
        work = defer.gatherResults(
            [Deferred.fromCoroutine(self._fetch(base_url + "/metrics")),
             Deferred.fromCoroutine(self._fetch(base_url + "/slots", optional=True))],
            consumeErrors=True,
        )
        timer = self.reactor.callLater(self.timeout, work.cancel)

        def got(bodies: List[Optional[bytes]]) -> None:
            families = parse_prometheus((bodies[0] or b"").decode("utf-8", "replace"))
            slots: Optional[Tuple[SlotState, ...]] = None
            if bodies[1] is not None:  # None: /slots is off (server_args no-slots); /metrics alone
                try:
                    decoded = json.loads(bodies[1].decode("utf-8", "replace"))
                except ValueError:
                    raise ValueError("/slots did not answer JSON") from None
                slots = parse_slots(decoded)
            previous = self._latest.get(device)
            if previous is not None and previous.generation != generation:
                previous = None
            if previous is not None and previous.stale:
                # Rate from the last good sample, not the failed ones.
                previous = attr.evolve(previous, stale=False, sampled_at=previous.good_at or previous.sampled_at)
            record = summarize(device, model, generation, self.reactor.seconds(), families, slots, previous)
            was = self._latest.get(device)
            if was is not None and was.stale and was.generation == generation:
                log.info("llama-server telemetry on {device} answers again", device=device)
            self._latest[device] = record
            self.successes += 1

        def failed(f: Failure) -> None:
            error = f.value
            if isinstance(error, defer.FirstError):
                error = error.subFailure.value
            why = (
                f"no answer within {self.timeout:g}s"
                if isinstance(error, defer.CancelledError)
                else (str(error) or type(error).__name__)
            )
            self.failures += 1
            now = self.reactor.seconds()
            previous = self._latest.get(device)
            if previous is None or previous.generation != generation:
                previous = ChildTelemetry(device, model, generation, now)
            if not previous.stale:  # log once per change, not per attempt
                log.warn("llama-server telemetry on {device} is stale: {why}", device=device, why=why)
            self._latest[device] = previous.marked_stale(why, now)

        def finish(result: Any) -> None:
            if timer.active():
                timer.cancel()
            if isinstance(result, Failure):  # a bug in failed() above: logged, not dropped
                log.failure("telemetry bookkeeping for {device} failed", result, device=device)

        work.addCallback(got).addErrback(failed).addBoth(finish)
        return work  # type: ignore[return-value]  # the callbacks above make it fire None
