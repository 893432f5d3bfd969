"""A fleet's reporting on one machine: bytes, messages and staleness into one dispatcher.

N simulated hosts of D devices each run the agent's real reporting code --
one :class:`rolemesh.fleet.dispatcher.DispatcherClient` per host, the real payload
builders (:mod:`rolemesh.node.payloads`: ``device_state``, ``heartbeat_payload``,
``events_payload``) and, for the new protocol, a real
:class:`rolemesh.node.feed.NodeFeed` per host -- against a stub dispatcher
in the same process that counts bytes and messages and keeps its own view of
every device.  Two protocols, side by side:

old   today's agent: no feed; a full heartbeat every ``heartbeat_interval_s``
      (5 s); a dispatcher learns a change at the next heartbeat.
new   deltas: each change is published on the host's feed, coalesced for
      200 ms and POSTed to ``/v1/nodes/events``; the full heartbeat (with
      ``last_seq``) every ``full_heartbeat_interval_s`` (30 s).

Simulated devices change at realistic rates (``--cycle``: a model is served
for an exponentially distributed time, mean 10 min, then unloaded, switched
to another model, or it fails and is restarted; a load goes load_started,
two load_progress steps and ready over 3-20 s; queue pressure crosses its
threshold about 6 times an hour while a device serves, and a typed issue is
raised and cleared about once an hour), so with 8 devices a host has a change
about every 11 s.  Hosts start at random offsets (a real fleet is not in step).

Time is virtual: one heap-ordered clock (:class:`HeapClock`, an
``IReactorTime`` with O(log n) ``callLater``; ``twisted.internet.task.Clock``
re-sorts its list on every call, too slow for 20,000 timers) drives every
client, and the stub's answers fire at once (zero network latency: the
staleness measured is what the protocol adds).  A run simulates
``--warmup`` seconds (not measured) then ``--seconds`` measured, so 10,000
hosts take a couple of minutes of CPU, not hours.

Bytes are each request's JSON body (as treq sends it: compact separators)
plus its request line and headers as the agent sends them (Host,
Content-Type, Content-Length, Accept, User-Agent, a bearer token).
Staleness: for each change, the time from the change until a message that
carries it (a delta naming the device, or a heartbeat) reaches the
dispatcher; p50 and p99 over every change in the measured span.

    /work/main/.venv/bin/python bench/fleet.py [--hosts 1000,10000] [--devices 8] [--seconds 60]
        [--full-interval 30] [--cycle 600]

The measured span should be a whole number of full heartbeat intervals (60 s
for 30 s or 15 s; 120 s for 60 s), and the warm-up longer than one, so that
every host's heartbeats are counted as in a steady state.
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import json
import os
import random
import sys
import time
from typing import Any, Callable, Dict, List, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from twisted.internet.defer import succeed  # noqa: E402
from twisted.logger import globalLogBeginner  # noqa: E402

from rolemesh.base.devices import DeviceMetrics  # noqa: E402
from rolemesh.fleet.dispatcher import EVENTS_PATH, HEARTBEAT_PATH, DispatcherClient  # noqa: E402
from rolemesh.node import feed as ne  # noqa: E402
from rolemesh.node.payloads import device_state, heartbeat_payload  # noqa: E402

HEARTBEAT_INTERVAL_S = 5.0
FULL_HEARTBEAT_INTERVAL_S = 30.0
TOKEN = "fleet-bench-token-0123456789abcdef"
MODELS = ("qwen2.5-7b-instruct", "llama-3.1-8b-instruct", "mistral-nemo-12b", "nomic-embed-text-v1.5")


# ---------------------------------------------------------------------------
# Virtual time


class _Call:
    __slots__ = ("time", "seq", "f", "args", "kw", "cancelled", "called", "clock")

    def __init__(self, clock: "HeapClock", when: float, seq: int, f: Callable[..., Any], args: Any, kw: Any):
        self.clock, self.time, self.seq, self.f, self.args, self.kw = clock, when, seq, f, args, kw
        self.cancelled = self.called = False

    def __lt__(self, other: "_Call") -> bool:
        return (self.time, self.seq) < (other.time, other.seq)

    def getTime(self) -> float:
        return self.time

    def active(self) -> bool:
        return not (self.cancelled or self.called)

    def cancel(self) -> None:
        self.cancelled = True

    def delay(self, seconds: float) -> None:  # pragma: no cover - not used by the client
        raise NotImplementedError

    def reset(self, seconds: float) -> None:  # pragma: no cover
        raise NotImplementedError


class HeapClock:
    """``seconds()`` and ``callLater()`` on a heap: a virtual reactor for many timers."""

    def __init__(self) -> None:
        self.now = 0.0
        self._heap: List[_Call] = []
        self._seq = itertools.count()

    def seconds(self) -> float:
        return self.now

    def callLater(self, delay: float, f: Callable[..., Any], *args: Any, **kw: Any) -> _Call:
        call = _Call(self, self.now + max(0.0, delay), next(self._seq), f, args, kw)
        heapq.heappush(self._heap, call)
        return call

    def getDelayedCalls(self) -> List[_Call]:
        return [c for c in self._heap if c.active()]

    def run_until(self, when: float) -> None:
        heap = self._heap
        while heap and heap[0].time <= when:
            call = heapq.heappop(heap)
            if call.cancelled:
                continue
            self.now = call.time
            call.called = True
            call.f(*call.args, **call.kw)
        self.now = when


# ---------------------------------------------------------------------------
# The stub dispatcher


class _Response:
    __slots__ = ("code", "_body")

    def __init__(self, code: int, body: bytes) -> None:
        self.code, self._body = code, body

    def content(self) -> Any:
        return succeed(self._body)


_OK = b'{"ok":true}'


class StubDispatcher:
    """Answers at once; counts bytes and messages; measures staleness."""

    def __init__(self, clock: HeapClock, fleet: "Fleet", events: bool) -> None:
        self.clock, self.fleet, self.events = clock, fleet, events
        self.measuring = False
        self.bytes = self.messages = 0
        self.by_kind: Dict[str, List[int]] = {}
        self.staleness: List[float] = []

    def client_for(self, host: "Host") -> "StubHTTP":
        return StubHTTP(self, host)

    def receive(self, host: "Host", url: str, body: Dict[str, Any], headers: Dict[str, str]) -> _Response:
        raw = json.dumps(body, separators=(",", ":")).encode()
        path = url[url.index("/v1/"):]
        head = (f"POST {path} HTTP/1.1\r\nHost: dispatcher.example:9000\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(raw)}\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers.items()) + "\r\n")
        if path == EVENTS_PATH and not self.events:
            return _Response(404, b'{"error":"no route"}')
        if self.measuring:
            size = len(head) + len(raw)
            self.bytes += size
            self.messages += 1
            counts = self.by_kind.setdefault(path, [0, 0])
            counts[0] += 1
            counts[1] += size
        now = self.clock.now
        if path == HEARTBEAT_PATH:
            for device in host.devices:
                self._seen(device, now)
        elif path == EVENTS_PATH:
            for event in body["events"]:
                named = host.by_name.get(event["device"])
                if named is not None:
                    self._seen(named, now)
        return _Response(200, _OK)

    def _seen(self, device: "SimDevice", now: float) -> None:
        if device.unseen:
            if self.measuring:
                self.staleness.extend(now - t for t in device.unseen)
            device.unseen.clear()


class StubHTTP:
    """The treq-like ``post`` a DispatcherClient is given."""

    def __init__(self, dispatcher: StubDispatcher, host: "Host") -> None:
        self.dispatcher, self.host = dispatcher, host

    def post(self, url: str, *, json: Any = None, headers: Any = None, allow_redirects: bool = False,
             reactor: Any = None) -> Any:
        return succeed(self.dispatcher.receive(self.host, url, json, headers or {}))


# ---------------------------------------------------------------------------
# Simulated nodes


class SimDevice:
    __slots__ = ("name", "state", "model", "port", "pid", "restarts", "queued", "issues", "unseen", "metrics")

    def __init__(self, name: str, index: int) -> None:
        self.name = name
        self.state = "stopped"
        self.model: Optional[str] = None
        self.port: Optional[int] = None
        self.pid: Optional[int] = None
        self.restarts = 0
        self.queued = 0
        self.issues: List[Dict[str, Any]] = []
        #: Times of changes the dispatcher has not been told yet.
        self.unseen: List[float] = []
        self.metrics = DeviceMetrics(device=name, sampled_at=0.0, memory_total_bytes=85_899_345_920,
                                     memory_used_bytes=41_875_931_136, memory_free_bytes=44_023_414_784,
                                     utilization_pct=37.0, temperature_c=61.0, power_w=312.5)


class Host:
    """One simulated agent: its devices, its feed and its DispatcherClient."""

    def __init__(self, index: int, devices: int, clock: HeapClock, dispatcher: StubDispatcher, events: bool,
                 rng: random.Random, cycle: float, full_interval: float = FULL_HEARTBEAT_INTERVAL_S) -> None:
        self.node_id = f"node-{index:05d}"
        self.clock, self.rng, self.cycle = clock, rng, cycle
        self.devices = [SimDevice(f"cuda:{i}", i) for i in range(devices)]
        self.by_name = {d.name: d for d in self.devices}
        self.feed: Optional[ne.NodeFeed] = ne.NodeFeed(clock) if events else None  # type: ignore[arg-type]
        self.seq = itertools.count(1)
        self.client = DispatcherClient(
            "http://dispatcher.example:9000", TOKEN, self.registration, self.heartbeat, HEARTBEAT_INTERVAL_S,
            reactor=clock,  # type: ignore[arg-type]
            http=dispatcher.client_for(self), random=rng.random, feed=self.feed,
            full_interval=full_interval if events else None,
        )

    def registration(self) -> Dict[str, Any]:
        return {"node_id": self.node_id, "advertise_url": f"http://{self.node_id}:8090", "agent_version": "bench",
                "backend": "cuda", "devices": [], "served_models": [], "capabilities": [],
                "max_pending_requests_per_device": 32}

    def heartbeat(self) -> Dict[str, Any]:
        now = self.clock.now
        entries = []
        for d in self.devices:
            d.metrics = DeviceMetrics(d.metrics.device, now - 1.5, d.metrics.memory_total_bytes,
                                      d.metrics.memory_used_bytes, d.metrics.memory_free_bytes,
                                      d.metrics.utilization_pct, d.metrics.temperature_c, d.metrics.power_w)
            entry = device_state(d.name, d.state, now=now, model=d.model, port=d.port, pid=d.pid,
                                 in_flight=min(4, d.queued + 1) if d.state == "ready" else 0, queued=d.queued,
                                 pending_limit=32, restarts=d.restarts, metrics=d.metrics)
            ready = d.state == "ready"
            entry.update({"slots_total": 4 if ready else None, "slots_busy": 2 if ready else None,
                          "slots_free": 2 if ready else None, "queue_depth": d.queued,
                          "tokens_per_s": 412.7 if ready else None, "issues": list(d.issues),
                          "load": None, "group": None})
            entries.append(entry)
        return heartbeat_payload(self.node_id, next(self.seq), now, entries)

    # -- the simulated life of a device --------------------------------------

    def start(self, offset: float) -> None:
        self.clock.callLater(offset, self.client.startService)
        for d in self.devices:
            # A fleet already running: most devices serve a model from the start.
            d.state, d.model, d.port, d.pid = "ready", self.rng.choice(MODELS), 40000, 1000
            self.clock.callLater(offset + self.rng.expovariate(1 / self.cycle), self._end_serving, d)
            self.clock.callLater(offset + self.rng.expovariate(6 / 3600), self._queue_cross, d)
            self.clock.callLater(offset + self.rng.expovariate(1 / 3600), self._issue, d)

    def _change(self, d: SimDevice, type: str, **fields: Any) -> None:
        d.unseen.append(self.clock.now)
        if self.feed is not None:
            self.feed.publish(type, d.name, d.model, **fields)

    def _load(self, d: SimDevice, model: str) -> None:
        previous = d.model
        d.state, d.model, d.pid, d.port = "starting", model, None, None
        if previous is not None and previous != model:
            self._change(d, ne.SWITCHED, state="starting", previous_model=previous)
        self._change(d, ne.LOAD_STARTED, state="starting")
        took = self.rng.uniform(3.0, 20.0)
        self.clock.callLater(took * 0.2, self._progress, d, "loading_tensors")
        self.clock.callLater(took * 0.7, self._progress, d, "warming_up")
        self.clock.callLater(took, self._ready, d)

    def _progress(self, d: SimDevice, step: str) -> None:
        if d.state == "starting":
            self._change(d, ne.LOAD_PROGRESS, state="starting", step=step)

    def _ready(self, d: SimDevice) -> None:
        if d.state != "starting":
            return
        d.state, d.pid, d.port = "ready", 1000 + self.rng.randrange(30000), 40000 + self.rng.randrange(1000)
        self._change(d, ne.READY, state="ready")
        self.clock.callLater(self.rng.expovariate(1 / self.cycle), self._end_serving, d)

    def _end_serving(self, d: SimDevice) -> None:
        if d.state != "ready":
            return
        roll = self.rng.random()
        if roll < 0.45:  # switched to another model
            self._load(d, self.rng.choice([m for m in MODELS if m != d.model]))
        elif roll < 0.9:  # idle: unloaded, loaded again later
            d.state, d.pid, d.port = "stopped", None, None
            self._change(d, ne.UNLOADED, state="stopped")
            self.clock.callLater(self.rng.expovariate(1 / 120), self._load, d, self.rng.choice(MODELS))
        else:  # the child died: failed, restarted after a back-off
            d.state, d.pid, d.port, d.restarts = "failed", None, None, d.restarts + 1
            self._change(d, ne.FAILED, state="failed", code="child_crashed", message="llama-server exited: signal 9")
            self.clock.callLater(10.0, self._load, d, d.model or MODELS[0])

    def _queue_cross(self, d: SimDevice) -> None:
        if d.state == "ready":
            high = d.queued < 20
            d.queued = 26 if high else 3
            self._change(d, ne.QUEUE_PRESSURE, level="high" if high else "normal", queued=d.queued, limit=32)
        self.clock.callLater(self.rng.expovariate(6 / 3600), self._queue_cross, d)

    def _issue(self, d: SimDevice) -> None:
        d.issues = [{"code": "backend_metrics_stale", "message": "llama-server telemetry: timed out",
                     "model": d.model, "at": self.clock.now}]
        self._change(d, ne.ISSUE_RAISED, code="backend_metrics_stale", message="llama-server telemetry: timed out")
        self.clock.callLater(60.0, self._clear, d)

    def _clear(self, d: SimDevice) -> None:
        d.issues = []
        self._change(d, ne.ISSUE_CLEARED, code="backend_metrics_stale", message="llama-server telemetry: timed out")
        self.clock.callLater(self.rng.expovariate(1 / 3600), self._issue, d)


class Fleet:
    def __init__(self, hosts: int, devices: int, events: bool, seed: int, cycle: float,
                 full_interval: float = FULL_HEARTBEAT_INTERVAL_S) -> None:
        self.clock = HeapClock()
        self.dispatcher = StubDispatcher(self.clock, self, events)
        rng = random.Random(seed)
        self.hosts = [Host(i, devices, self.clock, self.dispatcher, events, random.Random(rng.random()), cycle,
                           full_interval) for i in range(hosts)]
        for host in self.hosts:
            host.start(rng.uniform(0, HEARTBEAT_INTERVAL_S))

    def run(self, warmup: float, seconds: float) -> Dict[str, Any]:
        started = time.process_time()
        self.clock.run_until(warmup)
        for host in self.hosts:  # changes before the measured span are not counted
            for d in host.devices:
                d.unseen.clear()
        self.dispatcher.measuring = True
        self.clock.run_until(warmup + seconds)
        self.dispatcher.measuring = False
        stale = sorted(self.dispatcher.staleness)
        changes = len(stale)
        return {
            "bytes_per_s": self.dispatcher.bytes / seconds,
            "messages_per_s": self.dispatcher.messages / seconds,
            "changes_per_s": changes / seconds,
            "p50_s": _quantile(stale, 0.50),
            "p99_s": _quantile(stale, 0.99),
            "max_s": stale[-1] if stale else None,
            "by_kind": {k: (v[0] / seconds, v[1] / max(1, v[0])) for k, v in self.dispatcher.by_kind.items()},
            "cpu_s": time.process_time() - started,
        }


def _quantile(values: List[float], q: float) -> Optional[float]:
    if not values:
        return None
    return values[min(len(values) - 1, int(q * len(values)))]


def simulate(hosts: int, devices: int, events: bool, warmup: float, seconds: float, seed: int,
             cycle: float, full_interval: float = FULL_HEARTBEAT_INTERVAL_S) -> Dict[str, Any]:
    return Fleet(hosts, devices, events, seed, cycle, full_interval).run(warmup, seconds)


def _row(label: str, r: Dict[str, Any]) -> str:
    return (f"  {label:<4} {r['bytes_per_s'] / 1e6:9.3f} MB/s {r['messages_per_s']:9.1f} msg/s "
            f"{r['changes_per_s']:8.1f} changes/s   staleness p50 {r['p50_s']:.3f} s  p99 {r['p99_s']:.3f} s "
            f"max {r['max_s']:.3f} s   ({r['cpu_s']:.0f} s CPU)")


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hosts", default="1000,10000", help="comma-separated host counts (default 1000,10000)")
    parser.add_argument("--devices", type=int, default=8, help="devices per host (default 8)")
    parser.add_argument("--seconds", type=float, default=60.0, help="measured virtual seconds (default 60)")
    parser.add_argument("--warmup", type=float, default=35.0, help="virtual seconds before measuring (default 35)")
    parser.add_argument("--cycle", type=float, default=600.0,
                        help="mean seconds a device serves a model before it changes (default 600)")
    parser.add_argument("--full-interval", type=float, default=FULL_HEARTBEAT_INTERVAL_S,
                        help="the new protocol's full heartbeat interval (default 30: full_heartbeat_interval_s)")
    parser.add_argument("--seed", type=int, default=29)
    args = parser.parse_args(argv)
    globalLogBeginner.beginLoggingTo([lambda event: None], redirectStandardIO=False,  # type: ignore[list-item]
                                     discardBuffer=True)
    for hosts in [int(h) for h in args.hosts.split(",")]:
        print(f"{hosts} hosts x {args.devices} devices, {args.seconds:g} s measured after {args.warmup:g} s "
              f"(virtual time):", flush=True)
        old = simulate(hosts, args.devices, False, args.warmup, args.seconds, args.seed, args.cycle)
        print(_row("old", old), flush=True)
        new = simulate(hosts, args.devices, True, args.warmup, args.seconds, args.seed, args.cycle,
                       args.full_interval)
        print(_row("new", new), flush=True)
        for kind, (rate, size) in sorted(new["by_kind"].items()):
            print(f"         new {kind}: {rate:.1f}/s, {size:.0f} B each")
        for kind, (rate, size) in sorted(old["by_kind"].items()):
            print(f"         old {kind}: {rate:.1f}/s, {size:.0f} B each")
        print(f"  new/old bytes: {new['bytes_per_s'] / old['bytes_per_s']:.3f}  "
              f"(target <= 0.25);  new p99 staleness {new['p99_s']:.3f} s (target <= 1 s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
