"""Load test: many concurrent streaming clients against the agent and the real tiny model.

Starts the agent (``python -m rolemesh.cli``) on loopback with one cpu device,
the real llama-server (``tests.fixtures.llama.llama_server_binary``) and a
generated tiny GGUF (``tests.fixtures.tiny_gguf.write_tiny_gguf``), with
``max_pending_requests_per_device`` well below the number of clients.  Then
``--clients`` threads (default 16) each loop for ``--duration`` seconds
(default 20): stream a chat completion (``--max-tokens``, default 64,
``ignore_eos`` so every answer has that length), read it to the end and
record the outcome:

``ok``         200, every event relayed, ended by ``data: [DONE]``, no error event
``429``        ``queue_full`` with a ``Retry-After``; the client then waits
               ``min(Retry-After, --retry-cap)`` (plus a little jitter) before its next try
``hang``       no byte for ``--hang-timeout`` seconds (default 30)
anything else  named by what happened (``http_503``, ``stream_error``, ``no_done``, ``error:...``)

A warm-up (``--warmup`` seconds of the same load, default 3, counted
separately) comes first so the agent's allocator has seen the concurrency
before the baseline is taken.  The agent's RSS (``VmRSS`` in
``/proc/<pid>/status``) is reported at the baseline (after the warm-up), at
the peak during the load, and ``--settle`` seconds (default 5) after the load
stopped; its open file descriptors too.

PASS when: every request ended ``ok`` or ``429`` (and at least one was ok),
none hung, none was lost (requests started == requests finished, every client
thread ended), the agent reports nothing in flight or queued afterwards, its
log holds no traceback, RSS after the load is within 10% (or 5 MB, whichever
is larger) of the baseline, open fds within 16 of the baseline, and the agent
then stops with status 0 leaving no child running.  Exit status 0 on PASS, 1
on FAIL; with no llama-server it prints ``SKIP: ...`` and exits 0, like the
other scripts here.

Everything binds 127.0.0.1; every wait is bounded, and the run stops by itself
(at most ``warmup + duration + hang-timeout + settle`` plus start-up and stop).

    /work/venv/bin/python bench/load_test.py [--clients 16] [--duration 20] [--pending 2]
"""

from __future__ import annotations

import argparse
import collections
import http.client
import json
import os
import random
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
from typing import Any, Dict, List, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from tests.fixtures.llama import NO_LLAMA_SERVER_REASON, llama_server_binary  # noqa: E402
from tests.fixtures.tiny_gguf import write_tiny_gguf  # noqa: E402
from tests.integration.harness import AgentProcess, children_of, pid_alive, wait_until  # noqa: E402

OK = "ok"
QUEUE_FULL = "429"
HANG = "hang"
ACCEPTED = (OK, QUEUE_FULL)


def read_status_kb(pid: int, field: str) -> Optional[int]:
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def rss_kb(pid: int) -> Optional[int]:
    return read_status_kb(pid, "VmRSS")


def open_fds(pid: int) -> Optional[int]:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None


class Tally:
    """Outcomes and durations, shared by the client threads."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.started = 0
        self.finished = 0
        self.outcomes: collections.Counter = collections.Counter()
        self.ok_seconds: List[float] = []
        self.ttfb_seconds: List[float] = []
        self.examples: Dict[str, str] = {}

    def start(self) -> None:
        with self.lock:
            self.started += 1

    def finish(self, outcome: str, seconds: float, ttfb: Optional[float], detail: str = "") -> None:
        with self.lock:
            self.finished += 1
            self.outcomes[outcome] += 1
            if outcome == OK:
                self.ok_seconds.append(seconds)
            if ttfb is not None and outcome == OK:
                self.ttfb_seconds.append(ttfb)
            if outcome not in ACCEPTED and outcome not in self.examples:
                self.examples[outcome] = detail[:300]


def one_request(port: int, body: bytes, hang_timeout: float, tally: Tally) -> float:
    """One streaming chat completion; record its outcome; return seconds to wait before the next."""
    tally.start()
    started = time.monotonic()
    ttfb: Optional[float] = None
    outcome, detail, wait = "error:unknown", "", 0.0
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=hang_timeout)
    try:
        conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
        response = conn.getresponse()
        if response.status == 429:
            payload = response.read()
            retry_after = response.getheader("Retry-After")
            code = json.loads(payload).get("error", {}).get("code")
            if code == "queue_full" and retry_after is not None:
                outcome, wait = QUEUE_FULL, float(retry_after)
            else:
                outcome, detail = "429_malformed", f"Retry-After={retry_after!r} body={payload[:200]!r}"
        elif response.status != 200:
            outcome, detail = f"http_{response.status}", response.read()[:300].decode("utf-8", "replace")
        else:
            done = error = False
            events = 0
            while True:
                line = response.readline()  # socket timeout = no byte for hang_timeout
                if not line:
                    break
                if ttfb is None:
                    ttfb = time.monotonic() - started
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    done = True
                    continue
                events += 1
                if b'"error"' in data:
                    error = True
                    detail = data[:300].decode("utf-8", "replace")
            if error:
                outcome = "stream_error"
            elif not done:
                outcome, detail = "no_done", f"{events} events, then the stream ended without [DONE]"
            else:
                outcome = OK
    except socket.timeout:
        outcome, detail = HANG, f"no byte for {hang_timeout:g}s"
    except (OSError, http.client.HTTPException, ValueError) as e:
        outcome, detail = f"error:{type(e).__name__}", str(e)
    finally:
        conn.close()
        tally.finish(outcome, time.monotonic() - started, ttfb, detail)
    return wait


def client_loop(port: int, body: bytes, until: float, hang_timeout: float, retry_cap: float, tally: Tally,
                stop: threading.Event, seed: int) -> None:
    rng = random.Random(seed)
    while not stop.is_set() and time.monotonic() < until:
        wait = one_request(port, body, hang_timeout, tally)
        if wait:
            # Honour Retry-After, briefly: capped, with jitter so clients do not retry in lockstep.
            stop.wait(min(wait, retry_cap) + rng.uniform(0, 0.2))


def run_phase(name: str, port: int, body: bytes, clients: int, seconds: float, hang_timeout: float,
              retry_cap: float, sample: Any = None) -> Dict[str, Any]:
    """``clients`` threads for ``seconds``; returns the tally and whether every thread ended."""
    tally = Tally()
    stop = threading.Event()
    began = time.monotonic()
    until = began + seconds
    threads = [
        threading.Thread(target=client_loop, name=f"{name}-{i}", daemon=True,
                         args=(port, body, until, hang_timeout, retry_cap, tally, stop, i))
        for i in range(clients)
    ]
    for thread in threads:
        thread.start()
    while time.monotonic() < until:
        if sample is not None:
            sample()
        time.sleep(0.25)
    # A request in progress at the deadline may take up to hang_timeout more (a hang) before it ends.
    join_by = time.monotonic() + hang_timeout + 10
    for thread in threads:
        thread.join(max(0.0, join_by - time.monotonic()))
        if sample is not None:
            sample()
    stop.set()
    elapsed = time.monotonic() - began
    stuck = [t.name for t in threads if t.is_alive()]
    return {"tally": tally, "elapsed": elapsed, "load_s": seconds, "stuck": stuck}


def pct(values: List[float], q: float) -> float:
    if not values:
        return float("nan")
    data = sorted(values)
    return data[max(0, min(len(data) - 1, int(round(q * (len(data) - 1)))))]


def report_phase(title: str, phase: Dict[str, Any]) -> None:
    tally: Tally = phase["tally"]
    print(f"{title}: {phase['load_s']:g} s of load ({phase['elapsed']:.1f} s until every client ended)")
    for outcome, count in sorted(tally.outcomes.items(), key=lambda kv: (-kv[1], kv[0])):
        print(f"  {outcome:<22} {count:>7}")
    print(f"  {'started':<22} {tally.started:>7}")
    print(f"  {'finished':<22} {tally.finished:>7}")
    rate = tally.finished / phase["load_s"] if phase["load_s"] else 0.0
    ok_rate = tally.outcomes[OK] / phase["load_s"] if phase["load_s"] else 0.0
    print(f"  requests/s {rate:.1f} (completed streams/s {ok_rate:.2f})")
    if tally.ok_seconds:
        print(f"  ok stream seconds: p50 {pct(tally.ok_seconds, 0.5):.3f}  p95 {pct(tally.ok_seconds, 0.95):.3f}"
              f"  max {max(tally.ok_seconds):.3f};  first byte p50 {pct(tally.ttfb_seconds, 0.5):.3f}"
              f"  p95 {pct(tally.ttfb_seconds, 0.95):.3f}")
    for outcome, example in sorted(tally.examples.items()):
        print(f"  e.g. {outcome}: {example}")
    if phase["stuck"]:
        print(f"  client threads that never ended: {phase['stuck']}")


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=16, help="concurrent streaming clients (16)")
    parser.add_argument("--duration", type=float, default=20.0, help="seconds of load (20)")
    parser.add_argument("--warmup", type=float, default=3.0, help="seconds of warm-up load before the baseline (3)")
    parser.add_argument("--pending", type=int, default=2, help="max_pending_requests_per_device (2)")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens per answer (64)")
    parser.add_argument("--hang-timeout", type=float, default=30.0, help="no byte for this long = hang (30)")
    parser.add_argument("--retry-cap", type=float, default=1.0, help="longest Retry-After honoured, seconds (1)")
    parser.add_argument("--settle", type=float, default=5.0, help="seconds after the load before RSS (5)")
    parser.add_argument("--keep", action="store_true", help="keep the work directory (agent log) afterwards")
    parser.add_argument("--llama-server", metavar="BIN", help="llama-server binary (default: tests' discovery)")
    args = parser.parse_args(argv)
    if args.clients < 1 or args.duration <= 0 or args.pending < 1:
        parser.error("--clients, --duration and --pending must be positive")

    binary = args.llama_server or llama_server_binary()
    if binary is None or not os.access(binary, os.X_OK):
        print(f"SKIP: {NO_LLAMA_SERVER_REASON}")
        return 0

    workdir = tempfile.mkdtemp(prefix="rolemesh-load-")
    model = write_tiny_gguf(os.path.join(workdir, "tiny.gguf"), seed=1, name="tiny")
    config = {
        "llama_server_bin": binary,
        "max_pending_requests_per_device": args.pending,
        "shutdown_grace_s": 10,
        "models": [{"model_id": "tiny", "path": model, "ctx_size": 256, "preload": True}],
    }
    body = json.dumps({
        "model": "tiny",
        "stream": True,
        "max_tokens": args.max_tokens,
        "ignore_eos": True,
        "messages": [{"role": "user", "content": "Tell me a story."}],
    }).encode()

    print(f"agent: 1 cpu device, real llama-server {binary}, tiny model, max_pending_requests_per_device "
          f"{args.pending}; {args.clients} streaming clients, max_tokens {args.max_tokens}")
    agent = AgentProcess(workdir, config)
    failures: List[str] = []
    children: set = set()
    try:
        pid = agent.process.pid

        def inventory_device() -> Dict[str, Any]:
            return agent.inventory()["devices"][0]

        wait_until(lambda: inventory_device()["state"] == "ready", 60, interval=0.1, what="the preloaded model")
        children.update(children_of(pid))

        warm = run_phase("warm", agent.port, body, args.clients, args.warmup, args.hang_timeout, args.retry_cap)
        report_phase("warm-up", warm)
        baseline = rss_kb(pid) or 0
        baseline_fds = open_fds(pid) or 0
        child_baseline = {c: rss_kb(c) for c in children_of(pid)}
        peak = [baseline]

        def sample() -> None:
            value = rss_kb(pid)
            if value:
                peak[0] = max(peak[0], value)
            children.update(children_of(pid))

        load = run_phase("load", agent.port, body, args.clients, args.duration, args.hang_timeout,
                         args.retry_cap, sample)
        stopped_at = time.monotonic()
        report_phase("load", load)
        wait_until(lambda: time.monotonic() - stopped_at >= args.settle, args.settle + 1, interval=0.1,
                   what="the settle time")
        after = rss_kb(pid) or 0
        after_fds = open_fds(pid) or 0
        device = inventory_device()
        child_after = {c: rss_kb(c) for c in children_of(pid)}

        tally: Tally = load["tally"]
        allowed = max(0.10 * baseline, 5 * 1024)
        print(f"agent RSS: baseline {baseline / 1024:.1f} MB, peak {peak[0] / 1024:.1f} MB, "
              f"{args.settle:g} s after {after / 1024:.1f} MB ({(after - baseline) / 1024:+.1f} MB; "
              f"allowed +{allowed / 1024:.1f} MB)")
        print(f"agent open fds: baseline {baseline_fds}, after {after_fds}")
        print(f"llama-server RSS: baseline {', '.join(f'{(v or 0) / 1024:.1f} MB' for v in child_baseline.values())}"
              f"; after {', '.join(f'{(v or 0) / 1024:.1f} MB' for v in child_after.values())}")
        print(f"device after the load: state {device['state']}, in_flight {device['in_flight']}, "
              f"queued {device['queued']}, restarts {device['restarts']}")

        for phase_name, phase in (("warm-up", warm), ("load", load)):
            t: Tally = phase["tally"]
            bad = {k: v for k, v in t.outcomes.items() if k not in ACCEPTED}
            if bad:
                failures.append(f"{phase_name}: requests that were neither ok nor 429: {bad}")
            if t.started != t.finished or phase["stuck"]:
                failures.append(f"{phase_name}: lost requests: started {t.started}, finished {t.finished}, "
                                f"stuck clients {phase['stuck']}")
        if tally.outcomes[OK] == 0:
            failures.append("no request succeeded")
        if tally.outcomes[QUEUE_FULL] == 0 and args.clients > args.pending:
            failures.append("no 429 although the clients outnumber the pending limit")
        if after - baseline > allowed:
            failures.append(f"RSS did not return to baseline: {baseline} kB -> {after} kB")
        if after_fds > baseline_fds + 16:
            failures.append(f"open fds grew: {baseline_fds} -> {after_fds}")
        if device["in_flight"] or device["queued"]:
            failures.append(f"device not idle after the load: {device}")
        if device["restarts"]:
            failures.append(f"the child restarted {device['restarts']} times under load")
    finally:
        code = agent.stop(timeout=30)
    log = agent.log_text()
    if code != 0:
        failures.append(f"agent exited with {code}")
    if "Traceback" in log or "Unhandled" in log:
        failures.append("the agent log holds a traceback / unhandled error")
    try:
        wait_until(lambda: not any(pid_alive(c) for c in children), 10, what="children gone")
    except AssertionError:
        failures.append(f"children left running: {[c for c in children if pid_alive(c)]}")

    if failures:
        print("FAIL")
        for failure in failures:
            print(f"  - {failure}")
        print(f"  agent log: {agent.log_path}")
        return 1
    print("PASS: every request ok or 429, none hung, none lost, RSS back to baseline")
    if args.keep:
        print(f"work directory kept: {workdir}")
    else:
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    sys.exit(main())
