"""What a request of each API costs the agent: chat, Anthropic Messages, OpenAI Responses.

One agent process (``python -m rolemesh.cli``) in front of one real
llama-server (the tiny generated model), one sequential client on a
kept-alive connection.  Per API, blocks of ``--requests`` 1-token requests,
non-streamed and streamed, interleaved round by round in rotating order; the
agent's CPU for each block comes from ``/proc/<pid>/task/*/schedstat``
(nanoseconds, all threads), and so does llama-server's (the baseline: what
the child itself spends on the same requests, which differs by API).

It prints, per API and kind, the agent's CPU per request (median of
``--runs`` runs) and its ratio to chat's; the target (issue 36) is
Messages and Responses within 10 % of chat (ratio <= 1.10).

    .venv/bin/python bench/api_cost.py [--runs 3] [--requests 300]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from typing import Dict, List, Optional, Sequence, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from bench.capacity import cpu_seconds  # noqa: E402 - after the path set-up
from bench.proxy_overhead import (  # noqa: E402
    MODEL_ID,
    Client,
    Processes,
    agent_command,
    free_port,
    run_in_workdir,
    start_agent,
)

HI = [{"role": "user", "content": "hi"}]
#: ``(path, body)`` of a 1-token request of each API (``ignore_eos``: random
#: weights may stop at once; every request then generates its one token).
APIS: Dict[str, Tuple[str, Dict[str, object]]] = {
    "chat": ("/v1/chat/completions", {"messages": HI, "max_tokens": 1}),
    "messages": ("/v1/messages", {"messages": HI, "max_tokens": 1}),
    "responses": ("/v1/responses", {"input": "hi", "max_output_tokens": 1}),
}
TARGET = 1.10


def body(api: str, stream: bool) -> bytes:
    _, fields = APIS[api]
    return json.dumps({"model": MODEL_ID, "ignore_eos": True, **fields, **({"stream": True} if stream else {})}
                      ).encode()


def block(client: Client, api: str, stream: bool, n: int, pids: Dict[str, int]) -> Dict[str, float]:
    """``n`` requests; CPU seconds per request of each pid meanwhile."""
    path, payload = APIS[api][0], body(api, stream)
    before = {k: cpu_seconds(p) for k, p in pids.items()}
    for _ in range(n):
        status, _, _, data = client.post(path, payload, stream=stream)
        if status != 200:
            raise RuntimeError(f"{api}: HTTP {status}: {data[:300]!r}")
    return {k: (cpu_seconds(p) - before[k]) / n for k, p in pids.items()}


def run(args: argparse.Namespace, procs: Processes, workdir: str) -> int:
    from tests.fixtures.llama import llama_server_binary
    from tests.fixtures.tiny_gguf import write_tiny_gguf

    binary = args.llama_server or llama_server_binary()
    if binary is None:
        print("SKIP: no llama-server binary found (scripts/install-llama-server.sh, or --llama-server)")
        return 0
    model = write_tiny_gguf(os.path.join(workdir, "tiny.gguf"), seed=1, name=MODEL_ID)
    port = free_port()
    config_path = os.path.join(workdir, "agent.yaml")
    with open(config_path, "w", encoding="utf-8") as f:
        json.dump({"node_id": "api-cost", "listen_port": port, "backend": "cpu", "llama_server_bin": binary,
                   "state_dir": os.path.join(workdir, "state"), "llama_server_probe_interval_s": 0.05,
                   "shutdown_grace_s": 1, "models": [{"model_id": MODEL_ID, "path": model, "preload": True}]}, f)
    agent, client, device = start_agent(procs, agent_command(None, "rolemesh.cli", config_path), port,
                                        os.path.join(workdir, "agent.log"))
    pids = {"agent": agent.pid, "llama-server": device["pid"]}
    kinds = [(api, stream) for stream in (False, True) for api in APIS]
    for api, stream in kinds:  # warm every path
        block(client, api, stream, 10, pids)
    per: Dict[Tuple[str, bool], Dict[str, List[float]]] = {k: {"agent": [], "llama-server": []} for k in kinds}
    for r in range(args.runs):
        order = kinds[r % len(kinds):] + kinds[:r % len(kinds)]
        for _ in range(args.rounds):
            for kind in order:
                for name, seconds in block(client, *kind, args.requests // args.rounds, pids).items():
                    per[kind][name].append(seconds)
    print(f"{args.runs} runs x {args.requests} requests per API and kind, one client, kept-alive connection; "
          "CPU per request (median of the blocks)\n")
    print(f"{'API':<10} {'kind':<8} {'agent us':>9} {'vs chat':>8} {'llama-server us':>16}")
    ok = True
    for stream in (False, True):
        chat = statistics.median(per[("chat", stream)]["agent"])
        for api in APIS:
            agent_us = statistics.median(per[(api, stream)]["agent"])
            child_us = statistics.median(per[(api, stream)]["llama-server"])
            ratio = agent_us / chat
            ok = ok and (api == "chat" or ratio <= TARGET)
            print(f"{api:<10} {'stream' if stream else 'plain':<8} {agent_us * 1e6:9.1f} {ratio:7.2f}x "
                  f"{child_us * 1e6:16.1f}")
    print(f"\ntarget: Messages and Responses <= {TARGET:.2f}x chat's agent CPU per request: "
          + ("met" if ok else "NOT met"))
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3, help="runs (default 3)")
    parser.add_argument("--requests", type=int, default=300, help="requests per API and kind per run (default 300)")
    parser.add_argument("--rounds", type=int, default=10, help="interleaved blocks per run (default 10)")
    parser.add_argument("--llama-server", metavar="BIN", help="llama-server binary (default: the installed one)")
    parser.add_argument("--keep", action="store_true", help="keep the work directory (logs, config)")
    return run_in_workdir(run, parser.parse_args(argv), "rolemesh-api-cost-")


if __name__ == "__main__":
    sys.exit(main())
