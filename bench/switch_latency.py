"""Model switch latency through the agent's supervisor vs. llama-server's own cold start.

In one process, interleaved round by round (the order alternating), with two
tiny generated models A and B:

direct   spawn llama-server on model B exactly as the supervisor would (same
         argv, no exec wrapper) and poll ``GET /health`` + ``GET /v1/models``
         every ``--direct-poll`` seconds (default 2 ms) until B is listed:
         llama-server's own cold start.
agent    a :class:`rolemesh.supervisor.DeviceSupervisor` (real reactor,
         ``CpuBackend``, real readiness probe) with model A ready; the time
         ``ensure(B)`` takes to fire is the switch latency (stop A, reap it,
         start B through the exec wrapper, probe until ready).  The time
         ``ensure(A)`` took from a stopped device is reported too (the agent's
         cold start).

One supervisor per probe interval (``--probe-intervals``, default ``0.5,0.05``:
the SPEC default and a fine one).  The target (supervisor issue): switch latency
within 10% + one probe interval of the same llama-server's own cold start, i.e.
``switch_p50 <= 1.10 * direct_p50 + interval``.

    /work/venv/bin/python bench/switch_latency.py [--rounds 20] [--probe-intervals 0.5,0.05]
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional, Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


def pct(values: Sequence[float], q: float) -> float:
    data = sorted(values)
    if not data:
        return float("nan")
    return data[max(0, min(len(data) - 1, int(round(q * (len(data) - 1)))))]


def _get(port: int, path: str) -> tuple:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def direct_cold_start(argv: List[str], port: int, served_name: str, poll: float, timeout: float = 30.0) -> float:
    """Spawn ``argv``; seconds until /health is 200 and /v1/models lists ``served_name``."""
    started = time.perf_counter()
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"llama-server exited with {proc.returncode} while starting: {argv}")
            try:
                status, _ = _get(port, "/health")
                if status == 200:
                    status, body = _get(port, "/v1/models")
                    if status == 200 and any(
                        served_name == m.get("id") or served_name in (m.get("aliases") or ())
                        for m in json.loads(body).get("data", ())
                    ):
                        return time.perf_counter() - started
            except (OSError, http.client.HTTPException, ValueError):
                pass
            if time.perf_counter() - started > timeout:
                raise RuntimeError(f"llama-server not ready within {timeout}s")
            time.sleep(poll)
    finally:
        if proc.poll() is None:
            with contextlib.suppress(OSError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(OSError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(5)


def wrapper_startup(rounds: int = 5) -> float:
    """Median seconds the exec wrapper (``python -S -E child_exec.py``) adds before exec."""
    from rolemesh.supervisor import wrap_argv

    true = shutil.which("true") or "/bin/true"
    times = []
    for _ in range(rounds):
        argv = wrap_argv([true], os.getpid())
        t = time.perf_counter()
        subprocess.run(argv, check=True)
        t_wrapped = time.perf_counter() - t
        t = time.perf_counter()
        subprocess.run([true], check=True)
        times.append(t_wrapped - (time.perf_counter() - t))
    return pct(times, 0.5)


async def bench(reactor: Any, args: argparse.Namespace, workdir: str, cleanups: List[Any]) -> int:
    from twisted.internet import defer

    from rolemesh.backends.cpu import CpuBackend
    from rolemesh.config import validate
    from rolemesh.llama_args import build_argv
    from rolemesh.pidfiles import PidFiles
    from rolemesh.supervisor import STARTING, DeviceSupervisor
    from tests.fixtures.llama import free_port, llama_server_binary
    from tests.fixtures.tiny_gguf import write_tiny_gguf

    binary = args.llama_server or llama_server_binary()
    if binary is None:
        print("SKIP: no llama-server binary found (install one with scripts/install-llama-server.sh, "
              "or set ROLEMESH_TEST_LLAMA_SERVER "
              "or pass --llama-server)")
        return 0

    paths = {name: write_tiny_gguf(os.path.join(workdir, f"{name}.gguf"), seed=seed, name=name)
             for name, seed in (("a", 1), ("b", 2))}
    intervals = [float(x) for x in args.probe_intervals.split(",") if x.strip()]
    backend = CpuBackend(reactor=reactor)
    device = backend.discover()[0]
    sups: Dict[float, DeviceSupervisor] = {}
    config = None
    for interval in intervals:
        config = validate({
            "node_id": "bench",
            "state_dir": os.path.join(workdir, f"state-{interval:g}"),
            "llama_server_probe_interval_s": interval,
            "llama_server_startup_timeout_s": 30,
            "models": [{"model_id": "a", "path": paths["a"]}, {"model_id": "b", "path": paths["b"]}],
        }, check_files=False, environ={})
        sup = DeviceSupervisor(device, backend, config, binary, reactor=reactor,
                               pidfiles=PidFiles(os.path.join(workdir, f"state-{interval:g}")))
        sup.startService()
        cleanups.append(sup)
        sups[interval] = sup
    assert config is not None
    model_a, model_b = config.model("a"), config.model("b")

    def direct_argv() -> tuple:
        port = free_port()
        return build_argv(binary, model_b, port, device_defaults=backend.child_arguments(device)), port

    wrapper_s = wrapper_startup()
    print(f"llama-server: {' '.join(direct_argv()[0])}")
    print(f"rounds: {args.rounds}; probe intervals: {', '.join(f'{i:g}s' for i in intervals)}; "
          f"direct poll every {args.direct_poll * 1000:g} ms; exec wrapper start-up ~{wrapper_s * 1000:.1f} ms\n")

    direct: List[float] = []
    switch: Dict[float, List[float]] = {i: [] for i in intervals}
    cold: Dict[float, List[float]] = {i: [] for i in intervals}
    # the switch split at its state changes: stopping A (until B's spawn) and starting B (spawn -> ready)
    stop_part: Dict[float, List[float]] = {i: [] for i in intervals}
    start_part: Dict[float, List[float]] = {i: [] for i in intervals}
    transitions: Dict[float, List[tuple]] = {i: [] for i in intervals}
    for interval, sup in sups.items():
        sup.subscribe(lambda s, i=interval: transitions[i].append((s.state, time.perf_counter())))

    async def agent_round(interval: float) -> None:
        sup = sups[interval]
        t = time.perf_counter()
        await sup.ensure(model_a)
        cold[interval].append(time.perf_counter() - t)
        transitions[interval].clear()
        t = time.perf_counter()
        await sup.ensure(model_b)
        done = time.perf_counter()
        switch[interval].append(done - t)
        spawned = next((at for state, at in transitions[interval] if state == STARTING), t)
        stop_part[interval].append(spawned - t)
        start_part[interval].append(done - spawned)
        await sup.stop()

    # one untimed warm-up of everything (page cache, the binary's libraries)
    argv, port = direct_argv()
    direct_cold_start(argv, port, model_b.served_name, args.direct_poll)
    for interval in intervals:
        await defer.ensureDeferred(agent_round(interval))
        for series in (switch, cold, stop_part, start_part):
            series[interval].clear()

    for r in range(args.rounds):
        order: List[Optional[float]] = [None, *intervals]
        if r % 2:
            order.reverse()
        for what in order:
            if what is None:
                argv, port = direct_argv()
                direct.append(direct_cold_start(argv, port, model_b.served_name, args.direct_poll))
            else:
                await defer.ensureDeferred(agent_round(what))
        if args.verbose:
            print(f"round {r + 1}: direct {direct[-1] * 1000:.1f} ms; "
                  + "; ".join(f"switch@{i:g} {switch[i][-1] * 1000:.1f} ms" for i in intervals))

    def row(name: str, v: List[float]) -> str:
        return (f"    {name:<30} {pct(v, .5) * 1000:8.1f}  {pct(v, .9) * 1000:8.1f}  {min(v) * 1000:8.1f}  "
                f"{max(v) * 1000:8.1f}")

    d50, d90 = pct(direct, 0.5), pct(direct, 0.9)
    print("                                     p50 ms    p90 ms    min ms    max ms")
    print(row("direct cold start (model B)", direct))
    verdicts = []
    for interval in intervals:
        print(row(f"agent cold start A @{interval:g}s", cold[interval]))
        print(row(f"agent switch A->B @{interval:g}s", switch[interval]))
        print(row("  of which: stop A, reap", stop_part[interval]))
        print(row("  of which: start B -> ready", start_part[interval]))
    print()
    for interval in intervals:
        s50, s90 = pct(switch[interval], 0.5), pct(switch[interval], 0.9)
        bound50 = 1.10 * d50 + interval
        ok = s50 <= bound50
        verdicts.append(ok)
        print(f"probe interval {interval:g}s: switch/direct p50 = {s50 / d50:.2f} (p90 {s90 / d90:.2f}); "
              f"switch - direct = {(s50 - d50) * 1000:+.1f} ms; bound 1.10 x {d50 * 1000:.1f} + "
              f"{interval * 1000:g} = {bound50 * 1000:.1f} ms -> {'PASS' if ok else 'MISS'}"
              f" (p90 {'within' if s90 <= 1.10 * d90 + interval else 'beyond'} its bound)")
    print(f"\nsummary: {'PASS' if all(verdicts) else 'MISS'} "
          "(switch latency within 10% + one probe interval of llama-server's own cold start, at p50)")
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description="Switch latency through the supervisor vs. llama-server cold start.")
    parser.add_argument("--rounds", type=int, default=20, help="rounds (default 20)")
    parser.add_argument("--probe-intervals", default="0.5,0.05",
                        help="comma-separated llama_server_probe_interval_s values, one supervisor each "
                             "(default 0.5,0.05)")
    parser.add_argument("--direct-poll", type=float, default=0.002,
                        help="seconds between direct readiness polls (default 0.002)")
    parser.add_argument("--llama-server", metavar="BIN", help="llama-server binary (default: the llama extra's)")
    parser.add_argument("--agent-log", metavar="FILE",
                        help="where the supervisors' log goes, as the agent would write it (default: discarded "
                             "after formatting, into the work directory)")
    parser.add_argument("-v", "--verbose", action="store_true", help="print every round")
    args = parser.parse_args(argv)

    from twisted.internet import defer, reactor
    from twisted.logger import globalLogBeginner

    from rolemesh.logs import make_observer

    workdir = tempfile.mkdtemp(prefix="rolemesh-switch-bench-")
    # Log as the agent does (text, info level), so the cost of child-output logging is in the figures.
    log_file = open(args.agent_log or os.path.join(workdir, "agent.log"), "a", encoding="utf-8")
    globalLogBeginner.beginLoggingTo([make_observer("text", log_file)], redirectStandardIO=False)
    cleanups: List[Any] = []
    result: List[int] = []
    interrupted: List[bool] = []

    def stop_supervisors() -> Any:
        return defer.DeferredList([defer.maybeDeferred(s.stopService) for s in cleanups if s.running])

    def on_shutdown() -> Any:
        if not result:
            interrupted.append(True)
        return stop_supervisors()

    async def run() -> None:
        try:
            result.append(await bench(reactor, args, workdir, cleanups))
        except Exception as e:  # noqa: BLE001 - report, clean up, exit non-zero
            if interrupted:
                return
            import traceback

            traceback.print_exc()
            print(f"benchmark failed: {e}", file=sys.stderr)
            result.append(1)
        finally:
            await stop_supervisors()
            if reactor.running:
                reactor.stop()

    reactor.addSystemEventTrigger("before", "shutdown", on_shutdown)  # Ctrl-C: children go too
    reactor.callWhenRunning(lambda: defer.ensureDeferred(run()))
    started = time.monotonic()
    reactor.run()
    log_file.close()
    shutil.rmtree(workdir, ignore_errors=True)
    print(f"(total {time.monotonic() - started:.1f}s)", file=sys.stderr)
    if not result:
        print("interrupted", file=sys.stderr)
        return 130
    return result[0]


if __name__ == "__main__":
    sys.exit(main())
