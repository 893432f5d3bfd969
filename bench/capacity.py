"""How many requests and tokens one agent process can relay: CPU per request, per SSE event, and throughput.

In one run, against one real llama-server (the tiny generated model, started
by the agent with ``parallel: --parallel`` slots), for each proxy in front of
that same llama-server:

* the agent (``python -m rolemesh.cli``, a real process),
* the bare Twisted relay (``bench/bare_relay.py``: twisted.web + Agent, no
  routing, parsing, scheduling or logging),
* nginx (``proxy_buffering off``, keep-alive upstream, one worker process) if
  ``nginx`` is on the PATH,

it measures, from the proxy process's own CPU time (read before and after a
block of requests from ``/proc/<pid>/task/*/schedstat``: the same time as
``utime + stime`` in ``/proc/<pid>/stat``, in nanoseconds instead of ticks):

(1) CPU per request: a block of non-streaming 1-token chat completions from
    one sequential client;
(2) CPU per SSE event: streams of ``--tokens`` tokens minus streams of 1
    token, divided by the difference in ``data:`` events (so the per-request
    part cancels out);
(3) aggregate streamed tokens/s with 16 and 64 concurrent streams
    (``--concurrency``), through the agent vs. direct to llama-server.

The agent also reads its child's output lines for every request the child
answers (whichever proxy sent it); that cost is shown apart ("child output",
measured during the direct block) and is included in the agent's figure.

Every figure is the median of ``--runs`` runs (default 3); within a run the
proxies are measured block by block in rotating order. Targets (issue 16):
agent CPU per request <= 0.5 x the bare relay's; agent CPU per SSE event <=
0.2 x the agent's before the work (``BEFORE_EVENT_US``); agent tokens/s at 64
streams >= 0.9 x direct. Everything runs on loopback; every process started is
stopped on exit.

    .venv/bin/python bench/capacity.py [--runs 3] [--requests 300] [--streams 20] [--tokens 400]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from bench.proxy_overhead import (  # noqa: E402 - after the path set-up
    MODEL_ID,
    Client,
    Processes,
    agent_command,
    chat_body,
    free_port,
    run_in_workdir,
    start_agent,
    wait_http,
)

PATH = "/v1/chat/completions"
#: The agent's CPU per SSE event before the capacity work (commit 2f26412,
#: the ``before`` column of this bench, median of 3 runs on the 2-core
#: development machine; the issue's own estimate was ~75 us).  Used when
#: ``--before`` is not given.
BEFORE_EVENT_US = 39.0
TARGET_REQUEST_RATIO = 0.5  # agent / bare relay, CPU per request
TARGET_EVENT_RATIO = 0.2  # agent / BEFORE_EVENT_US, CPU per SSE event
TARGET_TOKENS_RATIO = 0.9  # agent / direct, tokens/s at 64 streams

NGINX_CONF = """
daemon off;
master_process off;
worker_processes 1;
error_log {dir}/nginx-error.log warn;
pid {dir}/nginx.pid;
events {{ worker_connections 1024; }}
http {{
    access_log off;
    client_body_temp_path {dir}/nginx-body;
    proxy_temp_path {dir}/nginx-proxy;
    fastcgi_temp_path {dir}/nginx-fastcgi;
    uwsgi_temp_path {dir}/nginx-uwsgi;
    scgi_temp_path {dir}/nginx-scgi;
    # llama-server closes after every stream, so a kept-alive connection can be
    # stale: retry a POST (the same server, listed twice) instead of a 502.
    upstream llama {{ server 127.0.0.1:{upstream} max_fails=0; server 127.0.0.1:{upstream} max_fails=0; keepalive 64; }}
    server {{
        listen 127.0.0.1:{port};
        location / {{
            proxy_pass http://llama;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
            proxy_next_upstream error timeout non_idempotent;
        }}
    }}
}}
"""


def cpu_seconds(pid: int) -> float:
    """CPU time of a process so far, all its threads: the nanosecond run times
    of ``/proc/<pid>/task/*/schedstat``.  ``utime + stime`` of
    ``/proc/<pid>/stat`` counts the same time in 10 ms ticks, too coarse for
    a few microseconds per event; the two agree to the tick."""
    total = 0
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/schedstat", encoding="ascii") as f:
                total += int(f.read().split()[0])
        except (OSError, ValueError, IndexError):
            pass  # a thread that ended meanwhile
    return total / 1e9


def count_events(data: bytes) -> int:
    """``data:`` lines of an SSE answer, ``[DONE]`` included."""
    return data.count(b"data: ")


def cpu_block(pids: Dict[str, int], work: Callable[..., Any], *args: Any) -> Tuple[Dict[str, float], Any]:
    """``work(*args)``, and the CPU each of ``pids`` spent meanwhile."""
    before = {k: cpu_seconds(p) for k, p in pids.items()}
    result = work(*args)
    return {k: cpu_seconds(p) - before[k] for k, p in pids.items()}, result


RETRIED_502: Dict[str, int] = {}


def sequential(client: Client, n: int, body: bytes, stream: bool, name: str = "") -> int:
    """``n`` requests one after the other; returns the SSE events seen.

    A 502 is retried (counted in ``RETRIED_502``): nginx answers one when a
    kept-alive upstream connection turns out to be closed by llama-server.
    """
    events = 0
    for _ in range(n):
        for _attempt in range(3):
            status, _, _, data = client.post(PATH, body, stream=stream)
            if status != 502:
                break
            RETRIED_502[name] = RETRIED_502.get(name, 0) + 1
        if status != 200:
            raise RuntimeError(f"{name}: HTTP {status}: {data[:300]!r}")
        events += count_events(data)
    return events


async def _stream_worker(port: int, request: bytes, deadline: float, counts: List[int], errors: List[str]) -> None:
    while time.monotonic() < deadline:
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
        except OSError as e:
            errors.append(repr(e))
            await asyncio.sleep(0.01)
            continue
        try:
            writer.write(request)
            head = await reader.readuntil(b"\r\n\r\n")
            if not head.startswith(b"HTTP/1.1 200"):
                errors.append(head.split(b"\r\n", 1)[0].decode("latin-1"))
                continue
            while True:
                chunk = await reader.read(65536)
                if not chunk:
                    break
                counts[0] += chunk.count(b"data: ")
        except (OSError, asyncio.IncompleteReadError) as e:
            errors.append(repr(e))
        finally:
            writer.close()


def tokens_per_second(port: int, streams: int, seconds: float, tokens: int) -> Tuple[float, List[str]]:
    """``streams`` concurrent clients, each streaming ``tokens``-token answers
    back to back for ``seconds``; SSE events relayed per second."""
    body = chat_body(tokens, True, long=True)
    request = (f"POST {PATH} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
               f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode() + body
    counts, errors = [0], []  # type: List[int], List[str]

    async def main() -> float:
        start = time.monotonic()
        deadline = start + seconds
        await asyncio.wait_for(
            asyncio.gather(*(_stream_worker(port, request, deadline, counts, errors) for _ in range(streams))),
            seconds + 60)
        return time.monotonic() - start

    elapsed = asyncio.run(main())
    return counts[0] / elapsed, errors


def start_nginx(procs: Processes, workdir: str, upstream: int) -> Optional[Tuple[int, int]]:
    binary = shutil.which("nginx") or ("/usr/sbin/nginx" if os.path.exists("/usr/sbin/nginx") else None)
    if binary is None:
        return None
    port = free_port()
    conf = os.path.join(workdir, "nginx.conf")
    with open(conf, "w", encoding="utf-8") as f:
        f.write(NGINX_CONF.format(dir=workdir, port=port, upstream=upstream))
    log = os.path.join(workdir, "nginx.log")
    proc = procs.start([binary, "-c", conf, "-p", workdir], log)
    wait_http(port, "/health", proc, log)
    return port, proc.pid


def start_before(args: argparse.Namespace, procs: Processes, workdir: str, config_path: str) -> Tuple[int, int]:
    """The agent of another source tree (``--before DIR``, e.g. ``git archive <commit> rolemesh | tar -x -C
    DIR``), same configuration on another port, with a llama-server child of its own."""
    port = free_port()
    with open(config_path, encoding="utf-8") as f:
        config = json.load(f)
    config.update(listen_port=port, node_id="capacity-before", state_dir=os.path.join(workdir, "state-before"))
    config.pop("stream_coalesce_ms", None)  # a key the tree before may not know
    path = os.path.join(workdir, "agent-before.yaml")
    with open(path, "w", encoding="utf-8") as f:
        json.dump(config, f, indent=1)
    log = os.path.join(workdir, "agent-before.log")
    # Not PYTHONPATH with -m: -m puts the working directory (this tree) first.
    run_before = (f"import sys; sys.path.insert(0, {os.path.abspath(args.before)!r}); import rolemesh.cli; "
                  "sys.exit(rolemesh.cli.main(sys.argv[1:]))")
    proc, client, _ = start_agent(procs, [sys.executable, "-c", run_before, "--config", path], port, log,
                                  "--before agent")
    client.close()
    return port, proc.pid


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


def run(args: argparse.Namespace, procs: Processes, workdir: str) -> int:
    from tests.fixtures.llama import llama_server_binary
    from tests.fixtures.tiny_gguf import write_tiny_gguf

    binary = args.llama_server or llama_server_binary()
    if binary is None:
        print("SKIP: no llama-server binary found (install one with scripts/install-llama-server.sh, "
              "or pass --llama-server)")
        return 0
    t0 = time.monotonic()
    # Each of the slots gets n_ctx / parallel tokens of context: room for the longest stream.
    n_ctx = max(2048, args.parallel * (args.tokens + 64))
    model = write_tiny_gguf(os.path.join(workdir, "tiny.gguf"), seed=1, name=MODEL_ID, n_ctx=n_ctx)
    agent_port = free_port()
    config_path = os.path.join(workdir, "agent.yaml")
    with open(config_path, "w", encoding="utf-8") as f:
        json.dump({
            "node_id": "capacity", "listen_host": "127.0.0.1", "listen_port": agent_port, "backend": "cpu",
            "llama_server_bin": binary, "state_dir": os.path.join(workdir, "state"),
            "max_pending_requests_per_device": max(256, 2 * max(args.concurrency)),
            "llama_server_probe_interval_s": 0.05, "shutdown_grace_s": 1,
            "models": [{"model_id": MODEL_ID, "path": model, "preload": True,
                        "server_args": {"parallel": args.parallel}}],
            **({"stream_coalesce_ms": args.coalesce_ms} if args.coalesce_ms else {}),
        }, f, indent=1)
    agent_log = os.path.join(workdir, "agent.log")
    agent, agent_client, device = start_agent(
        procs, agent_command(args.profile_agent, args.agent_module, config_path), agent_port, agent_log)
    llama_port, llama_pid = device["port"], device["pid"]

    relay_port = free_port()
    relay_log = os.path.join(workdir, "relay.log")
    relay = procs.start([sys.executable, os.path.join(ROOT, "bench", "bare_relay.py"), "--port", str(relay_port),
                         "--upstream", f"http://127.0.0.1:{llama_port}"], relay_log)
    wait_http(relay_port, "/health", relay, relay_log)

    ports = {"direct": llama_port, "agent": agent_port, "relay": relay_port}
    pids = {"agent": agent.pid, "relay": relay.pid}
    if args.before:
        ports["before"], pids["before"] = start_before(args, procs, workdir, config_path)
    nginx = None if args.no_nginx else start_nginx(procs, workdir, llama_port)
    if nginx is not None:
        ports["nginx"], pids["nginx"] = nginx
    clients = {name: (agent_client if name == "agent" else Client(port)) for name, port in ports.items()}
    proxies = [name for name in ports if name != "direct"]
    with open(f"/proc/{llama_pid}/cmdline", "rb") as f:
        print("llama-server: " + f.read().replace(b"\0", b" ").decode().strip())
    print(f"agent pid {agent.pid} :{agent_port}; bare relay pid {relay.pid} :{relay_port}; "
          + (f"nginx pid {nginx[1]} :{nginx[0]}; " if nginx else "nginx: not found (skipped); ")
          + f"llama-server pid {llama_pid} :{llama_port}; set-up {time.monotonic() - t0:.1f}s")
    print(f"per run: {args.requests} requests, {args.streams} x {args.tokens}-token and {args.streams} x 1-token "
          f"streams per proxy; {args.seconds:g}s of load at {', '.join(map(str, args.concurrency))} streams "
          f"(parallel {args.parallel}); {args.runs} runs\n")

    short, one_stream, long_stream = chat_body(1, False), chat_body(1, True), chat_body(args.tokens, True, long=True)
    for client in clients.values():  # warm every path
        sequential(client, 10, short, False)
        sequential(client, 3, long_stream, True)

    per_request: Dict[str, List[float]] = {n: [] for n in pids}
    per_event: Dict[str, List[float]] = {n: [] for n in pids}
    child_output: List[float] = []
    events_per_stream: List[float] = []
    tps: Dict[Tuple[str, int], List[float]] = {}
    load_errors: List[str] = []
    for r in range(args.runs):
        order = proxies[r % len(proxies):] + proxies[:r % len(proxies)]
        # The agent's CPU during direct requests: reading its child's output.
        cpu, _ = cpu_block({"agent": agent.pid}, sequential, clients["direct"], args.requests, short, False)
        child_output.append(cpu["agent"] / args.requests)
        for name in order:
            cpu, _ = cpu_block({name: pids[name]}, sequential, clients[name], args.requests, short, False, name)
            per_request[name].append(cpu[name] / args.requests)
        for name in order:
            cpu_long, ev_long = cpu_block(
                {name: pids[name]}, sequential, clients[name], args.streams, long_stream, True, name)
            cpu_short, ev_short = cpu_block(
                {name: pids[name]}, sequential, clients[name], args.streams, one_stream, True, name)
            extra_events = (ev_long - ev_short) / args.streams
            events_per_stream.append(ev_long / args.streams)
            per_event[name].append((cpu_long[name] - cpu_short[name]) / args.streams / max(1.0, extra_events))
        for streams in args.concurrency:
            for name in (("direct", "agent") if r % 2 == 0 else ("agent", "direct")):
                rate, errs = tokens_per_second(ports[name], streams, args.seconds, args.load_tokens)
                tps.setdefault((name, streams), []).append(rate)
                load_errors += [f"{name}@{streams}: {e}" for e in errs]
        print(f"run {r + 1}: " + "  ".join(
            f"{n} {per_request[n][-1] * 1e3:.3f} ms/req {per_event[n][-1] * 1e6:.1f} us/event" for n in pids)
            + "  " + "  ".join(f"{n}@{c} {tps[(n, c)][-1]:.0f} tok/s" for n in ("direct", "agent")
                               for c in args.concurrency), flush=True)

    # -- report --------------------------------------------------------------------------------
    req = {n: median(v) for n, v in per_request.items()}
    ev = {n: median(v) for n, v in per_event.items()}
    print(f"\nmedians of {args.runs} runs (CPU of the proxy process, from /proc/<pid>/task/*/schedstat; "
          f"{median(events_per_stream):.0f} events per {args.tokens}-token stream)")
    print("    proxy      CPU/request   x relay   CPU/SSE event   x relay")
    for name in pids:
        print(f"    {name:<8} {req[name] * 1e3:9.3f} ms  {req[name] / req['relay']:7.2f}   "
              f"{ev[name] * 1e6:9.1f} us  {ev[name] / ev['relay']:7.2f}")
    print(f"    (the agent's figure includes {median(child_output) * 1e3:.3f} ms per request reading its child's "
          f"output, measured during direct requests)")
    print(f"\naggregate tokens/s ({args.load_tokens}-token streams, {args.seconds:g}s each, parallel {args.parallel})")
    print("    streams     direct      agent   agent/direct")
    ratios = {}
    for c in args.concurrency:
        d, a = median(tps[("direct", c)]), median(tps[("agent", c)])
        ratios[c] = a / d if d else float("nan")
        print(f"    {c:>7} {d:10.0f} {a:10.0f}   {ratios[c]:10.3f}")
    if RETRIED_502:
        print(f"    502s retried: {RETRIED_502}")
    if load_errors:
        print(f"    load errors ({len(load_errors)}): {load_errors[:5]}")

    ok_req = req["agent"] <= TARGET_REQUEST_RATIO * req["relay"]
    before_event = ev["before"] if "before" in ev else BEFORE_EVENT_US * 1e-6
    ok_ev = ev["agent"] <= TARGET_EVENT_RATIO * before_event
    top = max(args.concurrency)
    ok_tps = ratios[top] >= TARGET_TOKENS_RATIO
    verdict = {True: "PASS", False: "MISS"}
    print("\ntargets:")
    print(f"    CPU per request: agent / relay = {req['agent'] / req['relay']:.2f} "
          f"(target <= {TARGET_REQUEST_RATIO})   {verdict[ok_req]}")
    print(f"    (stream_coalesce_ms: {args.coalesce_ms:g}; the tiny model streams thousands of tokens a second, so "
          "reads of the child carry several events; at a real model's pace see bench/stream_cost.py --paced)")
    print(f"    CPU per SSE event: agent {ev['agent'] * 1e6:.1f} us / before {before_event * 1e6:.1f} us"
          f"{'' if 'before' in ev else ' (BEFORE_EVENT_US)'} = {ev['agent'] / before_event:.2f} "
          f"(target <= {TARGET_EVENT_RATIO})   {verdict[ok_ev]}")
    if "before" in req:
        print(f"    (CPU per request: agent / before = {req['agent'] / req['before']:.2f})")
    print(f"    tokens/s at {top} streams: agent / direct = {ratios[top]:.3f} "
          f"(target >= {TARGET_TOKENS_RATIO})   {verdict[ok_tps]}")
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3, help="runs; medians are printed (default 3)")
    parser.add_argument("--requests", type=int, default=300, help="1-token requests per proxy per run (default 300)")
    parser.add_argument("--streams", type=int, default=20, help="streams of each length per proxy per run (default 20)")
    parser.add_argument("--tokens", type=int, default=400, help="tokens of the long stream (default 400)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[16, 64],
                        help="concurrent streams for the throughput part (default 16 64)")
    parser.add_argument("--seconds", type=float, default=4.0, help="seconds of each throughput block (default 4)")
    parser.add_argument("--load-tokens", type=int, default=64, help="tokens per stream under load (default 64)")
    parser.add_argument("--parallel", type=int, default=8, help="llama-server slots (default 8)")
    parser.add_argument("--coalesce-ms", type=float, default=0.0,
                        help="the agent's stream_coalesce_ms (default 0, the config default: what a client of an "
                             "agent as shipped gets; 8 gave the issue-16 figures, which only the tiny model's "
                             "thousands of tokens a second earn: bench/stream_cost.py)")
    parser.add_argument("--before", metavar="DIR",
                        help="also measure the agent of this source tree (a directory holding rolemesh/) as 'before'; "
                             "the per-event target is then against it")
    parser.add_argument("--no-nginx", action="store_true", help="skip nginx even if installed")
    parser.add_argument("--profile-agent", metavar="FILE", help="run the agent under cProfile, stats to FILE")
    parser.add_argument("--agent-module", default="rolemesh.cli", metavar="MODULE",
                        help="module run as the agent with -m (default rolemesh.cli)")
    parser.add_argument("--llama-server", metavar="BIN", help="llama-server binary (default: the llama extra's)")
    parser.add_argument("--keep", action="store_true", help="keep the work directory (logs, config)")
    args = parser.parse_args(argv)
    return run_in_workdir(run, args, "rolemesh-capacity-")


if __name__ == "__main__":
    sys.exit(main())
