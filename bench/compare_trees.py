"""CPU per request of two agent source trees, A/B, in alternating blocks.

``bench/capacity.py`` measures the agent against the bare relay; between two
versions of the agent its figures move by +-5% run to run, more than most
single changes are worth.  This runs two agents side by side (each with its
own llama-server child on the same tiny model, the configuration of
``bench/capacity.py``), sends blocks of sequential 1-token chat completions
to each in turn (the order alternating), and reads each agent's CPU time
around every block from ``/proc/<pid>/task/*/schedstat``.  It prints each
tree's median CPU per request and the median of the per-block ratios B / A
with its quartiles: drift of the machine (other processes, frequency)
affects both sides of a pair alike.

    python bench/compare_trees.py /tmp/before /tmp/after [--blocks 24] [--requests 400]
    python bench/compare_trees.py . . --b-server-args '{"log-verbosity": 2}'   # a what-if on B's child

A tree is a directory holding ``rolemesh/`` (``git archive <commit> | tar -x -C DIR``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from typing import Any, Dict, List, Optional, Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from bench.capacity import MODEL_ID, cpu_seconds  # noqa: E402 - after the path set-up
from bench.proxy_overhead import (  # noqa: E402
    Client,
    Processes,
    chat_body,
    free_port,
    run_in_workdir,
    wait_http,
)


def start(procs: Processes, workdir: str, name: str, tree: str, binary: str, model: str,
          server_args: Dict[str, Any]) -> Any:
    port = free_port()
    config = {
        "node_id": f"compare-{name}", "listen_host": "127.0.0.1", "listen_port": port, "backend": "cpu",
        "llama_server_bin": binary, "state_dir": os.path.join(workdir, f"state-{name}"),
        "max_pending_requests_per_device": 256, "llama_server_probe_interval_s": 0.05, "shutdown_grace_s": 1,
        "stream_coalesce_ms": 8,
        "models": [{"model_id": MODEL_ID, "path": model, "preload": True,
                    "server_args": {"parallel": 8, **server_args}}],
    }
    path = os.path.join(workdir, f"agent-{name}.yaml")
    with open(path, "w", encoding="utf-8") as f:
        json.dump(config, f, indent=1)
    log = os.path.join(workdir, f"agent-{name}.log")
    run = (f"import sys; sys.path.insert(0, {os.path.abspath(tree)!r}); import rolemesh.cli; "
           "sys.exit(rolemesh.cli.main(sys.argv[1:]))")
    proc = procs.start([sys.executable, "-c", run, "--config", path], log)
    wait_http(port, "/health", proc, log)
    return proc, Client(port)  # a fresh connection: only POSTs on it, so the agent's fast path serves it


def block(proc: Any, client: Client, n: int, body: bytes) -> float:
    """CPU milliseconds per request of ``n`` sequential requests."""
    before = cpu_seconds(proc.pid)
    for _ in range(n):
        status, _, _, data = client.post("/v1/chat/completions", body)
        if status != 200:
            raise RuntimeError(f"HTTP {status}: {data[:300]!r}")
    return (cpu_seconds(proc.pid) - before) / n * 1e3


def quartiles(values: Sequence[float]) -> str:
    ordered = sorted(values)
    return f"{ordered[len(ordered) // 4]:.3f} .. {ordered[(3 * len(ordered)) // 4]:.3f}"


def run(args: argparse.Namespace, procs: Processes, workdir: str) -> int:
    from tests.fixtures.llama import llama_server_binary
    from tests.fixtures.tiny_gguf import write_tiny_gguf

    binary = args.llama_server or llama_server_binary()
    if binary is None:
        print("SKIP: no llama-server binary found (install one with scripts/install-llama-server.sh, "
              "or pass --llama-server)")
        return 0
    model = write_tiny_gguf(os.path.join(workdir, "tiny.gguf"), seed=1, name=MODEL_ID, n_ctx=2048)
    sides = [start(procs, workdir, "a", args.tree_a, binary, model, {}),
             start(procs, workdir, "b", args.tree_b, binary, model, json.loads(args.b_server_args))]
    body = chat_body(1, False)
    for proc, client in sides:
        block(proc, client, args.requests, body)  # warm-up
    results: List[List[float]] = [[], []]
    for b in range(args.blocks):
        for i in ((0, 1) if b % 2 == 0 else (1, 0)):
            results[i].append(block(*sides[i], args.requests, body))
    ratios = [b / a for a, b in zip(*results)]
    for name, tree, values in (("A", args.tree_a, results[0]), ("B", args.tree_b, results[1])):
        print(f"{name} {tree}: median {statistics.median(values):.4f} ms per request (quartiles {quartiles(values)})")
    print(f"B / A: median of {len(ratios)} block ratios {statistics.median(ratios):.3f} "
          f"(quartiles {quartiles(ratios)})")
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("tree_a", help="source tree A (a directory holding rolemesh/)")
    parser.add_argument("tree_b", help="source tree B")
    parser.add_argument("--blocks", type=int, default=24, help="blocks per tree (default 24)")
    parser.add_argument("--requests", type=int, default=400, help="requests per block (default 400)")
    parser.add_argument("--b-server-args", default="{}", help="extra server_args (JSON) for B's llama-server")
    parser.add_argument("--llama-server", help="llama-server binary (default: the llama extra's)")
    parser.add_argument("--keep", action="store_true", help="keep the work directory")
    args = parser.parse_args(argv)
    return run_in_workdir(run, args, "rolemesh-compare-")


if __name__ == "__main__":
    sys.exit(main())
