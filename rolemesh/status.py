"""``rolemesh-node-agent status``: what a running agent holds, at a glance.

Asks a running agent (``GET /v1/node/inventory`` and ``GET /v1/models``)
and prints what ``ollama ps`` and ``nvidia-smi`` print together: per
device (and device group) the backend, model, state, memory (the model's
estimate, and what the device measures in use), slots busy/total, queue,
tokens/s and the last error; then each model and where it is.

Where the agent listens and its key come from the same config the agent
runs with (``--config``/``--config-override``), or ``--url`` and
``--api-key``.  ``--json`` prints both answers as one JSON object for
scripts; ``--watch [SECONDS]`` redraws until interrupted.  When no agent
answers: one line on stderr, exit status 1.

:func:`render` is pure (the two answers in, the text out); :func:`fetch`
is the only network I/O (plain blocking HTTP: this is a command, not the
agent).
"""

from __future__ import annotations

import argparse
import json
import ssl
import sys
import time
import urllib.error
import urllib.request
from typing import Any, Callable, Dict, List, Optional, Sequence, TextIO, Tuple

from rolemesh.base.errors import ConfigError

PROG = "rolemesh-node-agent status"


class StatusError(Exception):
    """No usable answer from the agent; ``str()`` is the one line printed."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG, description="Show a running agent's devices, models, memory, slots, queues and errors.")
    parser.add_argument("--config", metavar="BASE", help="the agent's config: where it listens and its API key")
    parser.add_argument("--config-override", metavar="LOCAL", help="YAML file deep-merged over the base")
    parser.add_argument("--url", help="the agent's URL (default: from --config, else http://127.0.0.1:8090)")
    parser.add_argument("--api-key", help="the API key (default: the config's first key)")
    parser.add_argument("--json", action="store_true", help="print the inventory and the models as one JSON object")
    parser.add_argument("--watch", nargs="?", type=float, const=2.0, metavar="SECONDS",
                        help="redraw every SECONDS (default 2) until interrupted")
    parser.add_argument("--timeout", type=float, default=5.0, metavar="SECONDS",
                        help="how long to wait for the agent (default 5)")
    return parser


def address_from_config(config: Any) -> Tuple[str, Optional[str]]:
    """(URL, API key) of the agent a config describes: its listen address
    (a wildcard address is asked on loopback) and its first key."""
    if config.listen is not None and not config.listen.startswith(("tcp:", "tcp6:")):
        raise ConfigError(f"listen: {config.listen} is not a TCP address; give --url")
    host = config.listen_host
    if host in ("0.0.0.0", ""):
        host = "127.0.0.1"
    elif host == "::":
        host = "::1"
    if ":" in host:
        host = f"[{host}]"
    scheme = "https" if config.tls is not None else "http"
    return f"{scheme}://{host}:{config.listen_port}", (config.api_keys[0] if config.api_keys else None)


def fetch(url: str, key: Optional[str], timeout: float) -> Dict[str, Any]:
    """``{"url", "inventory", "models"}`` from the agent at ``url``, or StatusError."""
    context = ssl.create_default_context() if url.startswith("https://") else None
    out: Dict[str, Any] = {"url": url}
    for name, path in (("inventory", "/v1/node/inventory"), ("models", "/v1/models")):
        request = urllib.request.Request(url.rstrip("/") + path, headers={"Accept": "application/json"})
        if key:
            request.add_header("Authorization", f"Bearer {key}")
        try:
            with urllib.request.urlopen(request, timeout=timeout, context=context) as answer:
                body = answer.read()
        except urllib.error.HTTPError as e:
            if e.code == 401:
                raise StatusError(f"the agent at {url} refused the API key (401); give --api-key or --config")
            raise StatusError(f"the agent at {url} answered {path} with HTTP {e.code}")
        except (urllib.error.URLError, OSError) as e:
            reason = getattr(e, "reason", e)
            raise StatusError(f"no agent answers at {url} ({reason})")
        try:
            out[name] = json.loads(body)
        except ValueError:
            raise StatusError(f"the agent at {url} answered {path} with something that is not JSON")
    return out


# --------------------------------------------------------------------------
# The table (pure)


def size(n: Optional[float]) -> str:
    """Bytes in the unit that reads best: ``512.0 MiB``, ``7.45 GiB``; ``-`` for none."""
    if n is None:
        return "-"
    if n >= 1 << 30:
        return f"{n / (1 << 30):.2f} GiB"
    if n >= 1 << 20:
        return f"{n / (1 << 20):.1f} MiB"
    return f"{n / 1024:.0f} KiB"


def _cell(value: Any) -> str:
    return "-" if value is None or value == "" else str(value)


def _table(header: Sequence[str], rows: List[List[str]]) -> List[str]:
    widths = [max(len(header[i]), *(len(r[i]) for r in rows)) for i in range(len(header))]
    lines = ["  ".join(h.ljust(w) for h, w in zip(header, widths)).rstrip()]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    return lines


def _one_line(text: Optional[str], width: int = 60) -> str:
    if not text:
        return "-"
    line = " ".join(str(text).split())
    return line if len(line) <= width else line[: width - 3] + "..."


DEVICE_HEADER = ("DEVICE", "BACKEND", "MODEL", "STATE", "MEMORY EST", "MEMORY USED", "SLOTS", "QUEUE", "TOK/S",
                 "LAST ERROR")
MODEL_HEADER = ("MODEL", "LOADED ON", "LOADING ON", "CAN RUN ON", "MEMORY EST", "CHAT TEMPLATE")


def _device_row(entry: Dict[str, Any], backend: str, estimates: Dict[str, Optional[int]]) -> List[str]:
    model = entry.get("model")
    state = str(entry.get("state") or "-")
    load = entry.get("load") or {}
    if state == "starting" and isinstance(load, dict) and load.get("progress") is not None:
        state += f" {float(load['progress']) * 100:.0f}%"
    metrics = entry.get("metrics") or {}
    used, total = metrics.get("memory_used_bytes"), metrics.get("memory_total_bytes") or entry.get(
        "memory_total_bytes")
    measured = size(used) + (f" / {size(total)}" if total else "") if used is not None else (
        f"- / {size(total)}" if total else "-")
    busy, slots = entry.get("slots_busy"), entry.get("slots_total")
    tokens = entry.get("tokens_per_s")
    return [
        str(entry.get("device") or entry.get("group")),
        backend,
        _cell(model),
        state,
        size(estimates.get(model)) if model else "-",
        measured,
        f"{_cell(busy)}/{_cell(slots)}" if slots is not None else "-",
        f"{entry.get('queued', 0)}/{entry.get('pending_limit', '-')}",
        f"{tokens:.1f}" if isinstance(tokens, (int, float)) else "-",
        _one_line(entry.get("last_error")),
    ]


def render(answer: Dict[str, Any]) -> str:
    """The text ``status`` prints for ``answer`` (what :func:`fetch` returns)."""
    inventory, models = answer["inventory"], answer["models"].get("data", [])
    backend = str(inventory.get("backend", "-"))
    estimates: Dict[str, Optional[int]] = {}
    templates: Dict[str, str] = {}
    for m in inventory.get("models", []):
        estimates[m["model_id"]] = (m.get("memory_estimate") or {}).get("total_bytes")
        t = m.get("chat_template") or {}
        templates[m["model_id"]] = {"config": f"{t.get('template')}", "gguf": "gguf", "fallback": "chatml (fallback)",
                                    }.get(str(t.get("source")), "-")
    lines = [f"node {inventory.get('node_id', '-')} at {answer.get('url', '-')}: backend {backend}"
             + (", draining" if inventory.get("draining") else "")]
    rows = [_device_row(d, backend, estimates) for d in inventory.get("devices", [])]
    rows += [_device_row(g, backend, estimates) for g in inventory.get("groups", []) if g.get("state") != "stopped"]
    lines += [""] + _table(DEVICE_HEADER, rows)
    model_rows = [[
        str(m.get("id")),
        ", ".join(m.get("loaded_on") or []) or "-",
        ", ".join(m.get("loading_on") or []) or "-",
        ", ".join(m.get("fits_on") or []) or "none (too large)",
        size(estimates.get(m.get("id"), (m.get("memory_estimate") or {}).get("total_bytes"))),
        templates.get(str(m.get("id")), "-"),
    ] for m in models]
    lines += [""] + (_table(MODEL_HEADER, model_rows) if model_rows else ["no models"])
    for warning in inventory.get("warnings", []):
        lines.append(f"warning: {_one_line(warning, 200)}")
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------
# The command


#: What ``status`` reads of a config: where the node listens and its keys.
#: Nothing else (its models' paths may be placeholders an override fills in
#: on the host, or files only the agent's user can read).
ADDRESS_KEYS = ("listen", "listen_host", "listen_port", "api_key", "api_key_env", "api_key_file", "api_keys",
                "tls_cert_file", "tls_key_file", "tls_client_ca_file")


def address_config(path: str, override_path: Optional[str] = None) -> Any:
    """The config at ``path`` (with ``override_path`` merged over it), reduced to :data:`ADDRESS_KEYS`."""
    from rolemesh.config.file import check_environment, deep_merge, load_yaml, parse

    raw = load_yaml(path)
    if override_path:
        raw = deep_merge(raw, load_yaml(override_path))
    address = {name: raw[name] for name in ADDRESS_KEYS if name in raw}
    return check_environment(parse(address), address)


def target(args: argparse.Namespace) -> Tuple[str, Optional[str]]:
    """(URL, key) from the flags, the config filling in what they leave out."""
    url, key = args.url, args.api_key
    if args.config and (url is None or key is None):
        config_url, config_key = address_from_config(address_config(args.config, args.config_override))
        url, key = url or config_url, key if key is not None else config_key
    return (url or "http://127.0.0.1:8090").rstrip("/"), key


CLEAR = "\x1b[H\x1b[2J"


def main(argv: Optional[List[str]] = None, out: TextIO = sys.stdout, err: TextIO = sys.stderr,
         get: Callable[[str, Optional[str], float], Dict[str, Any]] = fetch,
         sleep: Callable[[float], None] = time.sleep, rounds: Optional[int] = None) -> int:
    """Run ``status``; 0 on an answer, 1 when no agent answers, 2 for a bad
    config or flag.  ``rounds`` bounds ``--watch`` (tests)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.config_override and not args.config:
        parser.error("--config-override needs --config")
    if args.watch is not None and not args.watch > 0:
        parser.error("--watch needs a positive number of seconds")
    try:
        url, key = target(args)
    except ConfigError as e:
        err.write(f"{PROG}: {e}\n")
        return 2
    if args.watch is None:
        try:
            answer = get(url, key, args.timeout)
        except StatusError as e:
            err.write(f"{PROG}: {e}\n")
            return 1
        out.write(json.dumps(answer, indent=2) + "\n" if args.json else render(answer))
        return 0
    done = 0
    try:
        while rounds is None or done < rounds:
            try:
                answer = get(url, key, args.timeout)
                text = json.dumps(answer, indent=2) + "\n" if args.json else render(answer)
            except StatusError as e:  # the agent may come back: keep watching
                text = f"{PROG}: {e}\n"
            out.write(CLEAR + time.strftime("%H:%M:%S ") + f"every {args.watch:g}s (Ctrl-C to stop)\n\n" + text)
            out.flush()
            done += 1
            if rounds is None or done < rounds:
                sleep(args.watch)
    except KeyboardInterrupt:
        pass
    return 0
