"""What the agent's request path costs, next to llama-server itself and a bare relay.

Starts, with a tiny generated model:

* the agent (``python -m rolemesh.cli --config <generated yaml>``, its own
  llama-server child, a generous pending limit),
* a bare twisted.web relay (``bench/bare_relay.py``: no routing, no JSON
  parsing, no scheduling, no logging) in front of the *same* llama-server the
  agent uses (its port comes from ``GET /v1/node/inventory`` after a warm-up
  request),

then measures, interleaved round by round with one client implementation
(``http.client`` on a kept-alive connection):

(a) latency of a non-streaming 1-token chat completion: direct / floor / agent
(b) time to the first SSE byte of a streamed chat completion: direct / floor / agent
(c) total time of a 400-token stream (temperature 0, ``ignore_eos``): direct / agent
    (and the floor, for reference); the tiny model is written with a 2048-token context so
    the answer is not cut at the default 256
(d) the agent's RSS (``VmRSS``) while 8 clients hammer it concurrently
(e) agent p50 (1-token completion) and first SSE byte with llama-server
    telemetry sampling on and off: two more agents, each with its own child,
    measured interleaved; "on" samples /metrics and /slots every
    ``--telemetry-interval`` s (default 0.25: 20x the real 5 s, so a cost would
    show), "off" never does (the bench patches the sampler out; the agent has
    no switch for it)

and prints the ratios with PASS/MISS against the targets of the request-path
issue. Every process it starts is stopped on exit, Ctrl-C included.

    /work/venv/bin/python bench/proxy_overhead.py [--rounds 300] [--profile-agent agent.prof]
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

MODEL_ID = "tiny"
PENDING_LIMIT = 64

# Targets (issue 4, "bench/").
TARGET_P50_RATIO = 1.10  # (a) agent p50 within 10% of the floor's
TARGET_TTFB_MS = 0.5  # (b) agent first byte within 0.5 ms of the floor's
TARGET_STREAM_RATIO = 0.97  # (c) direct/agent total stream time
TARGET_RSS_MB = 80.0  # (d)


# --------------------------------------------------------------------------
# statistics


def pct(values: Sequence[float], q: float) -> float:
    """The q-quantile (0..1), nearest-rank on sorted data."""
    data = sorted(values)
    if not data:
        return float("nan")
    k = max(0, min(len(data) - 1, int(round(q * (len(data) - 1)))))
    return data[k]


def ms(seconds: float) -> str:
    return f"{seconds * 1000:8.3f}"


# --------------------------------------------------------------------------
# the one client used for every target


class Client:
    """Keeps one HTTP/1.1 connection open; reconnects (outside the timed part)
    when the server closed it. llama-server closes its side after every
    streamed answer, so after a stream the connection is renewed for every
    target alike."""

    def __init__(self, port: int, host: str = "127.0.0.1", timeout: float = 60.0) -> None:
        self.host, self.port, self.timeout = host, port, timeout
        self.conn: Optional[http.client.HTTPConnection] = None
        self.retries = 0

    def _fresh(self) -> http.client.HTTPConnection:
        self.close()
        conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)
        conn.connect()
        conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.conn = conn
        return conn

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None

    def post(self, path: str, body: bytes, stream: bool = False) -> Tuple[int, float, float, bytes]:
        """POST; return (status, seconds to first body byte, seconds in all, body)."""
        for attempt in (0, 1):
            conn = self.conn or self._fresh()
            try:
                start = time.perf_counter()
                conn.request("POST", path, body, {"Content-Type": "application/json"})
                resp = conn.getresponse()
                if stream:
                    chunks = [resp.read1(65536)]
                    first = time.perf_counter() - start
                    while True:
                        chunk = resp.read1(65536)
                        if not chunk:
                            break
                        chunks.append(chunk)
                    data = b"".join(chunks)
                else:
                    data = resp.read()
                    first = time.perf_counter() - start
                total = time.perf_counter() - start
            except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError):
                self.close()
                if attempt:
                    raise
                self.retries += 1  # a stale kept-alive connection: retry once, on a fresh one
                continue
            if stream or resp.will_close:
                self.close()
            return resp.status, first, total, data
        raise AssertionError("unreachable")

    def get(self, path: str) -> Tuple[int, bytes]:
        conn = self.conn or self._fresh()
        conn.request("GET", path)
        resp = conn.getresponse()
        data = resp.read()
        if resp.will_close:
            self.close()
        return resp.status, data


def chat_body(max_tokens: int, stream: bool, long: bool = False) -> bytes:
    body: Dict[str, Any] = {
        "model": MODEL_ID,
        "messages": [{"role": "user", "content": "Say hello."}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": stream,
    }
    if long:
        body["ignore_eos"] = True
    return json.dumps(body).encode()


# --------------------------------------------------------------------------
# processes


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Processes:
    """Every process we start, stopped on exit (TERM to its group, then KILL)."""

    def __init__(self) -> None:
        self.procs: List[subprocess.Popen] = []
        self.extra_pids: List[int] = []

    def start(self, argv: List[str], log_path: str, env: Optional[Dict[str, str]] = None) -> subprocess.Popen:
        with open(log_path, "ab") as log:
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True, env=env, cwd=ROOT)
        self.procs.append(proc)
        return proc

    def stop_all(self) -> None:
        for proc in reversed(self.procs):
            if proc.poll() is None:
                with contextlib.suppress(OSError):
                    os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + 8
        for proc in reversed(self.procs):
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(OSError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(5)
        for pid in self.extra_pids:  # the agent's llama-server, should the agent not have stopped it
            for _ in range(50):
                if not pid_alive(pid):
                    break
                time.sleep(0.05)
            else:
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)


def pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("State:"):
                    return "Z" not in line.split()[1]
    except OSError:
        return False
    return False


def proc_status_kb(pid: int, field: str) -> Optional[int]:
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far."""
    with open(f"/proc/{pid}/stat", encoding="ascii") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def wait_http(port: int, path: str, proc: subprocess.Popen, log_path: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"process exited ({proc.returncode}) before answering; log:\n{tail(log_path)}")
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            conn.request("GET", path)
            if conn.getresponse().status == 200:
                conn.close()
                return
            conn.close()
        except OSError:
            pass
        time.sleep(0.05)
    raise RuntimeError(f"no answer on port {port} within {timeout}s; log:\n{tail(log_path)}")


def tail(path: str, n: int = 4000) -> str:
    try:
        with open(path, "rb") as f:
            return f.read()[-n:].decode("utf-8", "replace")
    except OSError:
        return ""


def agent_command(profile: Optional[str], module: str, config_path: str) -> List[str]:
    """The agent's command line: ``python -m MODULE --config PATH``, under
    ``cpu_profile.py`` (cProfile with a CPU-time clock) when ``profile`` names
    the stats file."""
    argv = [sys.executable]
    if profile:
        argv += [os.path.join(ROOT, "bench", "cpu_profile.py"), os.path.abspath(profile)]
    return argv + ["-m", module, "--config", config_path]


def start_agent(procs: "Processes", argv: List[str], port: int, log_path: str,
                what: str = "agent") -> Tuple[subprocess.Popen, "Client", Dict[str, Any]]:
    """Start an agent, wait for ``/health`` and warm it up with one request;
    its llama-server child is stopped with the rest.  Returns the process, a
    client, and the device entry of its inventory."""
    proc = procs.start(argv, log_path)
    wait_http(port, "/health", proc, log_path)
    client = Client(port)
    status, _, _, data = client.post("/v1/chat/completions", chat_body(1, False))
    if status != 200:
        raise RuntimeError(f"warm-up through the {what} failed: HTTP {status} {data[:300]!r}\n{tail(log_path)}")
    device = json.loads(client.get("/v1/node/inventory")[1])["devices"][0]
    procs.extra_pids.append(device["pid"])
    return proc, client, device


# --------------------------------------------------------------------------
# the measurements


def interleaved(targets: Dict[str, Client], rounds: int, path: str, body: bytes, stream: bool,
                use_first: bool) -> Dict[str, List[float]]:
    """One request per target per round, the order rotating each round."""
    names = list(targets)
    out: Dict[str, List[float]] = {n: [] for n in names}
    for i in range(rounds):
        for j in range(len(names)):
            name = names[(i + j) % len(names)]
            status, first, total, data = targets[name].post(path, body, stream=stream)
            if status != 200:
                raise RuntimeError(f"{name}: HTTP {status}: {data[:300]!r}")
            out[name].append(first if use_first else total)
    return out


def count_stream_tokens(data: bytes) -> int:
    n = 0
    for line in data.split(b"\n"):
        if line.startswith(b"data: ") and line != b"data: [DONE]":
            try:
                event = json.loads(line[6:])
            except ValueError:
                continue
            for choice in event.get("choices") or ():
                if (choice.get("delta") or {}).get("content"):
                    n += 1
    return n


def rss_under_load(agent_pid: int, port: int, clients: int, seconds: float) -> Dict[str, Any]:
    stop = threading.Event()
    statuses: Dict[int, int] = {}
    lock = threading.Lock()
    errors: List[str] = []
    short = chat_body(1, False)
    streamed = chat_body(8, True)

    def worker(k: int) -> None:
        client = Client(port)
        i = 0
        try:
            while not stop.is_set():
                status, _, _, _ = client.post("/v1/chat/completions", streamed if (i + k) % 4 == 0 else short,
                                              stream=(i + k) % 4 == 0)
                i += 1
                with lock:
                    statuses[status] = statuses.get(status, 0) + 1
        except Exception as e:  # noqa: BLE001 - reported, not raised from a thread
            errors.append(repr(e))
        finally:
            client.close()

    before = proc_status_kb(agent_pid, "VmRSS") or 0
    threads = [threading.Thread(target=worker, args=(k,), daemon=True) for k in range(clients)]
    for t in threads:
        t.start()
    samples = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        rss = proc_status_kb(agent_pid, "VmRSS")
        if rss is not None:
            samples.append(rss)
        time.sleep(0.02)
    stop.set()
    for t in threads:
        t.join(30)
    return {
        "before_kb": before,
        "peak_kb": max(samples) if samples else 0,
        "median_kb": statistics.median(samples) if samples else 0,
        "hwm_kb": proc_status_kb(agent_pid, "VmHWM") or 0,
        "statuses": statuses,
        "errors": errors,
    }


def verdict(ok: bool) -> str:
    return "PASS" if ok else "MISS"


#: Runs rolemesh.cli with the metrics interval set, and telemetry sampling off
#: if asked: ``python -c TELEMETRY_AGENT on|off INTERVAL --config ...``.
TELEMETRY_AGENT = """
import sys
from twisted.internet import defer
import rolemesh.node.node as node
import rolemesh.children.telemetry as telemetry
mode, interval = sys.argv[1], float(sys.argv[2])
init = node.Node.__init__
def patched(self, *a, **kw):
    kw["metrics_interval"] = interval
    init(self, *a, **kw)
node.Node.__init__ = patched
if mode == "off":
    telemetry.TelemetrySampler.sample = lambda self: defer.succeed(None)
from rolemesh.cli import main
sys.exit(main(sys.argv[3:]))
"""


def telemetry_on_off(args: argparse.Namespace, procs: Processes, workdir: str, binary: str, model: str,
                     path: str) -> bool:
    """(e): agent p50 and first byte with telemetry sampling on and off."""
    clients: Dict[str, Client] = {}
    sampled = {}
    for mode in ("on", "off"):
        port = free_port()
        config_path = os.path.join(workdir, f"agent-telemetry-{mode}.yaml")
        with open(config_path, "w", encoding="utf-8") as f:
            json.dump({
                "node_id": f"bench-{mode}", "listen_host": "127.0.0.1", "listen_port": port, "backend": "cpu",
                "llama_server_bin": binary, "state_dir": os.path.join(workdir, f"state-{mode}"),
                "max_pending_requests_per_device": PENDING_LIMIT, "llama_server_probe_interval_s": 0.05,
                "shutdown_grace_s": 1, "log_format": args.agent_log_format,
                "models": [{"model_id": MODEL_ID, "path": model, "preload": True,
                            **({"threads": args.llama_threads} if args.llama_threads else {})}],
            }, f, indent=1)
        log_path = os.path.join(workdir, f"agent-telemetry-{mode}.log")
        _, clients[mode], _ = start_agent(
            procs, [sys.executable, "-c", TELEMETRY_AGENT, mode, str(args.telemetry_interval), "--config", config_path],
            port, log_path, f"{mode} agent")
    interleaved(clients, 20, path, chat_body(1, False), False, False)
    lat = interleaved(clients, args.telemetry_rounds, path, chat_body(1, False), False, False)
    ttfb = interleaved(clients, args.telemetry_rounds, path, chat_body(4, True), True, True)
    for mode, client in clients.items():
        status, data = client.get("/v1/node/inventory")
        sampled[mode] = json.loads(data)["devices"][0].get("slots")
    print(f"(e) telemetry sampling on (every {args.telemetry_interval:g}s) vs off, "
          f"{args.telemetry_rounds} rounds interleaved")
    print("    agent         1-token p50 ms   p90 ms   first-byte p50 ms   p90 ms")
    for mode in ("on", "off"):
        print(f"    sampling {mode:<4} {ms(pct(lat[mode], .5))}  {ms(pct(lat[mode], .9))}   "
              f"{ms(pct(ttfb[mode], .5))}  {ms(pct(ttfb[mode], .9))}")
    d_lat = pct(lat["on"], .5) - pct(lat["off"], .5)
    d_fb = pct(ttfb["on"], .5) - pct(ttfb["off"], .5)
    # "Within noise": the p50 difference is inside the spread between p50 and p90 of the off agent.
    noise_lat = pct(lat["off"], .9) - pct(lat["off"], .5)
    noise_fb = pct(ttfb["off"], .9) - pct(ttfb["off"], .5)
    ok = d_lat <= noise_lat and d_fb <= noise_fb and sampled["on"] is not None and sampled["off"] is None
    print(f"    on - off (p50): 1-token {d_lat * 1000:+.3f} ms (noise p90-p50 {noise_lat * 1000:.3f} ms), "
          f"first byte {d_fb * 1000:+.3f} ms (noise {noise_fb * 1000:.3f} ms); "
          f"sampler ran: on {sampled['on'] is not None}, off {sampled['off'] is not None}   {verdict(ok)}\n")
    for client in clients.values():
        client.close()
    return ok


def run(args: argparse.Namespace, procs: Processes, workdir: str) -> int:
    from tests.fixtures.llama import llama_server_binary
    from tests.fixtures.tiny_gguf import write_tiny_gguf

    binary = args.llama_server or llama_server_binary()
    if binary is None:
        print("SKIP: no llama-server binary found (install one with scripts/install-llama-server.sh, "
              "or set ROLEMESH_TEST_LLAMA_SERVER "
              "or pass --llama-server)")
        return 0

    t_setup = time.monotonic()
    # n_ctx 2048: room for a 400-token answer (llama-server takes its context size from the model)
    model = write_tiny_gguf(os.path.join(workdir, "tiny.gguf"), seed=1, name=MODEL_ID, n_ctx=2048,
                            n_embd=args.n_embd, n_layer=args.n_layer, n_head=4, n_ff=2 * args.n_embd)
    agent_port, relay_port = free_port(), free_port()
    config_path = os.path.join(workdir, "agent.yaml")
    with open(config_path, "w", encoding="utf-8") as f:
        json.dump({  # JSON is YAML
            "node_id": "bench",
            "listen_host": "127.0.0.1",
            "listen_port": agent_port,
            "backend": "cpu",
            "llama_server_bin": binary,
            "state_dir": os.path.join(workdir, "state"),
            "max_pending_requests_per_device": PENDING_LIMIT,
            "llama_server_probe_interval_s": 0.05,
            "shutdown_grace_s": 1,
            "log_format": args.agent_log_format,
            "models": [{"model_id": MODEL_ID, "path": model, "preload": True,
                        **({"threads": args.llama_threads} if args.llama_threads else {})}],
        }, f, indent=1)

    agent_log = os.path.join(workdir, "agent.log")
    agent, agent_client, device = start_agent(
        procs, agent_command(args.profile_agent, args.agent_module, config_path), agent_port, agent_log)
    llama_port, llama_pid = device["port"], device["pid"]

    relay_log = os.path.join(workdir, "relay.log")
    relay = procs.start([sys.executable, os.path.join(ROOT, "bench", "bare_relay.py"), "--port", str(relay_port),
                         "--upstream", f"http://127.0.0.1:{llama_port}"], relay_log)
    wait_http(relay_port, "/health", relay, relay_log)
    targets = {"direct": Client(llama_port), "floor": Client(relay_port), "agent": agent_client}
    setup_s = time.monotonic() - t_setup

    with open(f"/proc/{llama_pid}/cmdline", "rb") as f:
        llama_cmd = f.read().replace(b"\0", b" ").decode()
    print(f"llama-server: {llama_cmd.strip()}")
    print(f"agent pid {agent.pid} on :{agent_port}, bare relay pid {relay.pid} on :{relay_port}, "
          f"llama-server pid {llama_pid} on :{llama_port}; set-up {setup_s:.1f}s")
    print(f"rounds: (a) {args.rounds}  (b) {args.ttfb_rounds}  (c) {args.long_rounds}  "
          f"(d) {args.load_clients} clients x {args.load_seconds:g}s\n")

    path = "/v1/chat/completions"
    # warm every path (connections, caches) before measuring
    interleaved(targets, 20, path, chat_body(1, False), False, False)
    interleaved(targets, 5, path, chat_body(4, True), True, True)

    # The agent reads (and logs) its llama-server's output for every request that server
    # answers, the direct and floor ones included: measure that background cost alone.
    n_bg = max(20, args.rounds // 3)
    cpu0 = cpu_seconds(agent.pid)
    interleaved({"direct": targets["direct"]}, n_bg, path, chat_body(1, False), False, False)
    background = (cpu_seconds(agent.pid) - cpu0) / n_bg

    # (a) non-streaming 1-token chat completion
    cpu0s = {"floor": cpu_seconds(relay.pid), "agent": cpu_seconds(agent.pid)}
    t0 = time.monotonic()
    lat = interleaved(targets, args.rounds, path, chat_body(1, False), False, False)
    cpu_per_round = {k: (cpu_seconds(p) - cpu0s[k]) / args.rounds
                     for k, p in (("floor", relay.pid), ("agent", agent.pid))}
    t_a = time.monotonic() - t0

    # (b) time to first SSE byte
    ttfb = interleaved(targets, args.ttfb_rounds, path, chat_body(4, True), True, True)

    # (c) total time of a 400-token stream
    long_targets = targets  # the floor too: what any Python hop costs a long stream here
    long_body = chat_body(args.long_tokens, True, long=True)
    _, _, _, sample = targets["agent"].post(path, long_body, stream=True)
    tokens = count_stream_tokens(sample)
    long = interleaved(long_targets, args.long_rounds, path, long_body, True, False)

    # (d) RSS under concurrent load
    load = rss_under_load(agent.pid, agent_port, args.load_clients, args.load_seconds)

    # -- report ---------------------------------------------------------------------
    print(f"(a) non-streaming 1-token chat completion, {args.rounds} rounds interleaved ({t_a:.1f}s)")
    print("    path        p50 ms    p90 ms    p99 ms   mean ms   x direct")
    d50 = pct(lat["direct"], 0.5)
    for name in ("direct", "floor", "agent"):
        v = lat[name]
        print(f"    {name:<8} {ms(pct(v, .5))}  {ms(pct(v, .9))}  {ms(pct(v, .99))}  {ms(statistics.mean(v))}"
              f"   {pct(v, .5) / d50:6.2f}")
    f50, a50 = pct(lat["floor"], 0.5), pct(lat["agent"], 0.5)
    ok_a = a50 <= TARGET_P50_RATIO * f50
    print(f"    agent p50 / floor p50 = {a50 / f50:.3f} (target <= {TARGET_P50_RATIO:.2f})"
          f"  agent - floor = {(a50 - f50) * 1000:+.3f} ms   {verdict(ok_a)}")
    own = cpu_per_round["agent"] - 3 * background
    print(f"    CPU (from /proc/<pid>/stat): bare relay {cpu_per_round['floor'] * 1000:.3f} ms per request; agent "
          f"{cpu_per_round['agent'] * 1000:.3f} ms per round = its own request ~{own * 1000:.3f} ms + 3 x "
          f"{background * 1000:.3f} ms reading/logging llama-server's output for each request it answers "
          f"(measured alone over {n_bg} direct requests)\n")

    print(f"(b) time to first SSE byte (stream, max_tokens 4), {args.ttfb_rounds} rounds interleaved")
    print("    path        p50 ms    p90 ms    p99 ms")
    for name in ("direct", "floor", "agent"):
        v = ttfb[name]
        print(f"    {name:<8} {ms(pct(v, .5))}  {ms(pct(v, .9))}  {ms(pct(v, .99))}")
    fb_f, fb_a = pct(ttfb["floor"], 0.5), pct(ttfb["agent"], 0.5)
    ok_b = fb_a - fb_f <= TARGET_TTFB_MS / 1000
    print(f"    agent - floor (p50) = {(fb_a - fb_f) * 1000:+.3f} ms (target <= +{TARGET_TTFB_MS} ms)   "
          f"{verdict(ok_b)}\n")

    print(f"(c) {args.long_tokens}-token stream (temperature 0, ignore_eos; {tokens} content events seen), "
          f"{args.long_rounds} rounds interleaved")
    print("    path        p50 ms    min ms    max ms")
    for name in long_targets:
        v = long[name]
        print(f"    {name:<8} {ms(pct(v, .5))}  {ms(min(v))}  {ms(max(v))}")
    ratio_c = pct(long["direct"], 0.5) / pct(long["agent"], 0.5)
    ok_c = ratio_c >= TARGET_STREAM_RATIO
    print(f"    direct / agent (p50) = {ratio_c:.4f} (target >= {TARGET_STREAM_RATIO})   {verdict(ok_c)}\n")

    rss_mb = load["peak_kb"] / 1024
    ok_d = rss_mb < TARGET_RSS_MB and not load["errors"]
    print(f"(d) agent RSS with {args.load_clients} concurrent clients for {args.load_seconds:g}s "
          f"(3 of 4 requests 1-token, 1 of 4 an 8-token stream)")
    print(f"    before {load['before_kb'] / 1024:.1f} MB, median {load['median_kb'] / 1024:.1f} MB, "
          f"peak {rss_mb:.1f} MB, VmHWM {load['hwm_kb'] / 1024:.1f} MB (target < {TARGET_RSS_MB:g} MB)   "
          f"{verdict(ok_d)}")
    print(f"    answers: {dict(sorted(load['statuses'].items()))}"
          + (f"; client errors: {load['errors'][:3]}" if load["errors"] else ""))
    retries = {k: c.retries for k, c in targets.items() if c.retries}
    if retries:
        print(f"    (stale kept-alive connections retried by the client: {retries})")

    ok_e = None
    if args.telemetry_rounds > 0:
        print()
        ok_e = telemetry_on_off(args, procs, workdir, binary, model, path)

    print(f"\nsummary: (a) {verdict(ok_a)}  (b) {verdict(ok_b)}  (c) {verdict(ok_c)}  (d) {verdict(ok_d)}"
          + ("" if ok_e is None else f"  (e) {verdict(ok_e)}"))
    for c in targets.values():
        c.close()
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description="Agent request-path overhead vs. llama-server and a bare relay.")
    parser.add_argument("--rounds", type=int, default=300, help="(a) rounds of 1-token requests (default 300)")
    parser.add_argument("--ttfb-rounds", type=int, default=200, help="(b) rounds of short streams (default 200)")
    parser.add_argument("--long-rounds", type=int, default=12, help="(c) rounds of long streams (default 12)")
    parser.add_argument("--long-tokens", type=int, default=400, help="(c) tokens per long stream (default 400)")
    parser.add_argument("--n-embd", type=int, default=64,
                        help="generated model's embedding size (default 64: the tiny model; 512 makes tokens ~10x "
                             "slower, closer to a real model's pace)")
    parser.add_argument("--n-layer", type=int, default=2, help="generated model's layers (default 2)")
    parser.add_argument("--llama-threads", type=int, metavar="N",
                        help="the model's `threads` (llama-server --threads); default: llama-server's own")
    parser.add_argument("--load-clients", type=int, default=8, help="(d) concurrent clients (default 8)")
    parser.add_argument("--load-seconds", type=float, default=5.0, help="(d) seconds of load (default 5)")
    parser.add_argument("--telemetry-rounds", type=int, default=200,
                        help="(e) rounds per path with telemetry sampling on and off (default 200; 0 skips)")
    parser.add_argument("--telemetry-interval", type=float, default=0.25,
                        help="(e) seconds between telemetry samples of the 'on' agent (default 0.25)")
    parser.add_argument("--agent-log-format", choices=("text", "json"), default="text")
    parser.add_argument("--profile-agent", metavar="FILE",
                        help="run the agent under bench/cpu_profile.py, stats to FILE")
    parser.add_argument("--agent-module", default="rolemesh.cli", metavar="MODULE",
                        help="module run as the agent with -m (default rolemesh.cli; for what-if experiments: "
                             "a module that patches something, then calls rolemesh.cli.main)")
    parser.add_argument("--llama-server", metavar="BIN", help="llama-server binary (default: the llama extra's)")
    parser.add_argument("--keep", action="store_true", help="keep the work directory (logs, config)")
    args = parser.parse_args(argv)
    return run_in_workdir(run, args, "rolemesh-bench-")


def run_in_workdir(run: Callable[[argparse.Namespace, "Processes", str], int], args: argparse.Namespace,
                   prefix: str) -> int:
    """Run a benchmark in a fresh work directory; whatever happens (SIGTERM,
    Ctrl-C, an error), stop every process it started and remove the
    directory unless ``args.keep``."""
    import shutil

    def on_term(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    procs = Processes()
    workdir = tempfile.mkdtemp(prefix=prefix)
    started = time.monotonic()
    try:
        return run(args, procs, workdir)
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
    finally:
        procs.stop_all()
        print(f"(total {time.monotonic() - started:.1f}s; work directory {workdir}"
              + (" kept)" if args.keep else " removed)"), file=sys.stderr)
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
