"""The agent's own footprint: resident memory and start-up time (issue 30, item 6).

Starts ``python -m rolemesh.cli`` (what ``rolemesh-node-agent`` runs) on a
small config -- two tiny generated models (their GGUF headers are read at
start-up for the memory estimate), the fake llama-server of
``tests/fixtures`` as the binary, nothing preloaded -- and measures, per
round:

- start-up: from spawning the process to the first ``GET /ready`` 200
  (polled every 5 ms);
- ``VmRSS`` from ``/proc/PID/status`` at that moment (and ``VmHWM``, the
  peak);
- whether numpy (which the ``gguf`` package imports) is loaded: its
  extension modules in ``/proc/PID/maps``.

Prints the medians (and each round with ``-v``).  No real llama-server is
needed: no child is started.

    python bench/agent_footprint.py [--rounds 7] [--tree DIR] [-v]

``--tree`` runs the agent from another checkout (say ``git worktree add``
of an older commit) to compare two versions on the same machine.
"""

from __future__ import annotations

import argparse
import http.client
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from tests.fixtures.llama import free_port, write_fake_llama_server_bin  # noqa: E402
from tests.fixtures.tiny_gguf import write_tiny_gguf  # noqa: E402


def _ready(port: int) -> bool:
    try:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=1)
        conn.request("GET", "/ready")
        status = conn.getresponse().status
        conn.close()
        return status == 200
    except OSError:
        return False


def _status(pid: int) -> Dict[str, int]:
    out = {}
    with open(f"/proc/{pid}/status", encoding="ascii") as f:
        for line in f:
            name, _, value = line.partition(":")
            if name in ("VmRSS", "VmHWM"):
                out[name] = int(value.split()[0]) * 1024
    return out


def _mapped(pid: int) -> List[str]:
    with open(f"/proc/{pid}/maps", encoding="ascii", errors="replace") as f:
        maps = f.read()
    return [name for name in ("numpy",) if f"/{name}/" in maps]


def one_round(work: str, config_path: str, port: int, tree: str) -> Tuple[float, Dict[str, int], List[str]]:
    env = {**os.environ, "PYTHONPATH": tree}
    with open(os.path.join(work, "agent.log"), "ab") as log:
        start = time.monotonic()
        process = subprocess.Popen([sys.executable, "-m", "rolemesh.cli", "--config", config_path],
                                   stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                   cwd=tree)  # ``-m`` puts the working directory first on the path
        try:
            while not _ready(port):
                if process.poll() is not None:
                    raise SystemExit(f"the agent exited with {process.returncode}; see {work}/agent.log")
                if time.monotonic() - start > 60:
                    raise SystemExit("the agent was not ready within 60 s")
                time.sleep(0.005)
            took = time.monotonic() - start
            return took, _status(process.pid), _mapped(process.pid)
        finally:
            process.terminate()
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(10)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--tree", default=ROOT, help="the checkout whose rolemesh/ runs (default: this one)")
    parser.add_argument("-v", "--verbose", action="store_true")
    args = parser.parse_args()
    work = tempfile.mkdtemp(prefix="rolemesh-footprint-")
    try:
        binary = write_fake_llama_server_bin(work)
        models = []
        for i, name in enumerate(("tiny-a", "tiny-b")):
            path = os.path.join(work, f"{name}.gguf")
            write_tiny_gguf(path, seed=i + 1, name=name)
            models.append({"model_id": name, "path": path})
        port = free_port()
        config_path = os.path.join(work, "agent.yaml")
        import yaml

        with open(config_path, "w", encoding="utf-8") as f:
            yaml.safe_dump({"node_id": "footprint", "listen_port": port, "backend": "cpu",
                            "llama_server_bin": binary, "state_dir": os.path.join(work, "state"),
                            "models": models}, f)
        times, rss, hwm = [], [], []
        imported: List[str] = []
        for n in range(args.rounds):
            took, status, mapped = one_round(work, config_path, port, os.path.abspath(args.tree))
            times.append(took)
            rss.append(status["VmRSS"])
            hwm.append(status["VmHWM"])
            imported = mapped
            if args.verbose:
                print(f"round {n + 1}: ready after {took * 1000:.0f} ms, VmRSS {status['VmRSS'] / 2**20:.1f} MiB, "
                      f"VmHWM {status['VmHWM'] / 2**20:.1f} MiB, numpy loaded: {'yes' if mapped else 'no'}")
        print(f"{args.rounds} rounds, medians: start-up to /ready {statistics.median(times) * 1000:.0f} ms, "
              f"VmRSS {statistics.median(rss) / 2**20:.1f} MiB, VmHWM {statistics.median(hwm) / 2**20:.1f} MiB; "
              f"numpy loaded: {'yes' if imported else 'no'}")
        return 0
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
