"""``rolemesh-node-agent``: validate a config (``--check``) or run the agent;
``rolemesh-node-agent status`` asks a running one (:mod:`rolemesh.status`).

``--model PATH.gguf`` (repeatable) serves a GGUF file with no config file
at all: its model id is the file name without ``.gguf``, every other key
has its default; with ``--config`` the files are added to the config's
models.

Every configuration mistake is one line on stderr and exit status 2; the
command never shows a traceback for bad input.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, Dict, List, Optional, Sequence, TextIO, Tuple, cast

import yaml

from rolemesh import __version__
from rolemesh.backends.groups import group_name, pin_child
from rolemesh.base.devices import DeviceRef
from rolemesh.base.errors import ConfigError
from rolemesh.children.llama_args import build_argv
from rolemesh.config.file import NodeConfig, as_dict, load_config

PROG = "rolemesh-node-agent"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="RoleMesh Node Agent: one llama-server per device behind an OpenAI-compatible API. "
                    "`rolemesh-node-agent status [--config FILE | --url URL] [--json] [--watch]` shows a "
                    "running agent.",
    )
    parser.add_argument("--config", metavar="BASE", help="base YAML configuration file")
    parser.add_argument("--model", action="append", default=[], metavar="PATH.gguf",
                        help="serve this GGUF file as the model named after it (without .gguf); repeatable; "
                             "with --config, added to its models")
    parser.add_argument("--config-override", metavar="LOCAL",
                        help="YAML file deep-merged over the base (models merge by model_id)")
    parser.add_argument("--check", action="store_true",
                        help="validate, print the resolved config and each model's llama-server command, exit")
    parser.add_argument("--log-format", choices=("text", "json"), help="override log_format from the config")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    return parser


def check_report(config: NodeConfig, out: TextIO) -> None:
    """What ``--check`` prints: resolved config, backend, devices, argv lists."""
    from rolemesh.service import build_report, choose_backend, resolve_binary

    tls = tls_report(config)  # before any output: a bad certificate is one line and exit 2
    choice = choose_backend(config)
    binary = resolve_binary(config)
    out.write("# resolved configuration (secrets redacted)\n")
    out.write(yaml.safe_dump(as_dict(config), sort_keys=False))
    out.write(f"\n# backend: {choice.backend.name} ({choice.reason})\n")
    for fine, about in build_report(binary, choice.backend, choice.devices):
        out.write(f"# {about}\n" if fine else f"# WARNING: {about}\n")
    out.write("# devices: " + ", ".join(d.name for d in choice.devices) + "\n")
    for line in tls:
        out.write(f"# tls: {line}\n")
    out.write("\n# llama-server command per model and device (<port> is picked at start)\n")
    by_name = {d.name: d for d in choice.devices}
    for model in config.models:
        lanes = [[by_name[n] for n in model.devices if n in by_name]] if model.devices else [
            [d] for d in choice.devices]
        for members in lanes:
            if not members:
                continue
            defaults, env, _ = pin_child(choice.backend, members, {})
            argv = build_argv(binary, model, 0, device_defaults=defaults)
            argv[argv.index("--port") + 1] = "<port>"
            pins = " ".join(f"{k}={v}" for k, v in sorted(env.items()))
            name = group_name([d.name for d in members])
            out.write(f"{model.model_id} @ {name}: " + (pins + " " if pins else "") + " ".join(argv) + "\n")
    for warning in slot_warnings(config):
        out.write(f"# WARNING: {warning}\n")
    memory_report(config, choice.backend.name, choice.devices, out)
    template_report(config, out)


def template_report(config: NodeConfig, out: TextIO) -> None:
    """Which chat template each model uses (the field, the GGUF's own, or
    llama-server's ChatML fallback), and what the models folder left out."""
    from rolemesh.children import chat_templates
    from rolemesh.config import models_dir

    out.write("\n# chat template per model\n")
    for model in config.models:
        out.write(f"{model.model_id}: {chat_templates.summary(chat_templates.describe_model(model))}\n")
    if config.models_dir:
        _, notes = models_dir.discover(config.models_dir)
        for note in notes:
            out.write(f"# WARNING: {note}\n")


def slot_warnings(config: NodeConfig) -> List[str]:
    """Models whose slots the pending limit keeps from being used: a device
    admits ``max_pending_requests_per_device`` requests in flight plus queued,
    so with fewer than ``parallel`` some slots never get a request."""
    limit = config.max_pending_requests_per_device
    return [f"{model.model_id}: llama-server gets {model.parallel} slots (parallel) but a device admits "
            f"{limit} requests (max_pending_requests_per_device): at most {limit} run at once; raise "
            "max_pending_requests_per_device to use every slot"
            for model in config.models if model.parallel > limit]


def memory_report(config: NodeConfig, backend: str, devices: Sequence[DeviceRef], out: TextIO) -> None:
    """Each model's memory estimate and the devices/groups that can hold it;
    a model that none can ever hold is a warning naming it."""
    from rolemesh.scheduling.estimate import (
        EstimateError,
        capacity_of,
        estimate_on,
        gib,
        read_adapter_facts,
        read_facts,
    )

    by_name = {d.name: d for d in devices}
    reserve = config.device_memory_reserve_bytes
    out.write(f"\n# memory estimate per model (device_memory_reserve_bytes: {reserve})\n")
    for model in config.models:
        try:
            facts = read_facts(model.path)
            draft = read_facts(model.draft_model) if model.draft_model is not None else None
            adapters = [read_adapter_facts(adapter.path) for adapter in model.lora_adapters]
        except EstimateError as e:
            out.write(f"{model.model_id}: no estimate ({e})\n")
            continue
        lanes = [list(model.devices)] if model.devices else [[d.name] for d in devices]
        fits, largest = [], None
        for names in lanes:
            members = [by_name[n] for n in names if n in by_name]
            capacity = capacity_of([d.memory_total_bytes for d in members], backend)
            need = estimate_on(facts, model, backend, len(members), reserve, draft, adapters)
            if capacity is None or need.total_bytes <= capacity:
                fits.append(group_name(names))
            if largest is None or (capacity or 0) > (largest[1] or 0):
                largest = (group_name(names), capacity, need)
        assert largest is not None
        need = largest[2]
        if fits:
            out.write(f"{model.model_id}: {need.describe()}; fits on {', '.join(fits)}\n")
        else:
            out.write(f"# WARNING: {model.model_id}: needs an estimated {need.describe()}, but the largest "
                      f"device or group it may use, {largest[0]}, has {gib(largest[1])} in total: "
                      "requests for it get model_too_large\n")


def tls_report(config: NodeConfig) -> List[str]:
    """Check the TLS files (readable, key matches certificate, not expired);
    one line per fact, never key material.  Raises ConfigError."""
    from rolemesh.config.tls import check_client_files, check_server_files

    lines = check_server_files(config.tls) if config.tls is not None else ["listener: plain HTTP (no tls_cert_file)"]
    if (config.dispatcher_base_url or "").startswith("https://"):
        lines += check_client_files(config.dispatcher_tls)
    return lines


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["status"]:  # the one subcommand; everything else is the agent's own flags
        from rolemesh import status

        return status.main(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    if not args.config and not args.model:
        parser.error("give --config FILE, or --model PATH.gguf (or both)")
    if args.config_override and not args.config:
        parser.error("--config-override needs --config")
    try:
        config = load_config(args.config, args.config_override, model_files=args.model)
        if args.log_format:
            import attr

            config = attr.evolve(config, log_format=args.log_format)
        if args.check:
            check_report(config, sys.stdout)
            return 0
        overrides = {"log_format": args.log_format} if args.log_format else {}
        return run(config, (args.config, args.config_override), overrides, model_files=args.model)
    except ConfigError as e:
        sys.stderr.write(f"{PROG}: {e}\n")
        return 2


def run(config: NodeConfig, config_paths: Tuple[Optional[str], Optional[str]] = (None, None),
        overrides: Optional[Dict[str, Any]] = None, model_files: Sequence[str] = ()) -> int:
    """Run the agent in the foreground until a signal stops it; SIGHUP
    re-reads ``config_paths`` (base, override), with ``overrides`` (the
    command line's) over them and the ``--model`` files added again."""
    from rolemesh import event_loop

    event_loop.install()  # before the global reactor is first imported
    from twisted.internet import reactor
    from twisted.logger import Logger, globalLogBeginner

    from rolemesh.base.interfaces import IAgentReactor
    from rolemesh.base.logs import make_observer
    from rolemesh.service import make_service

    # Twisted types the global reactor with the interfaces every platform has;
    # the POSIX reactors provide the rest too (tests/event_loop/test_reactor.py).
    agent_reactor = cast(IAgentReactor, reactor)
    service = make_service(config, reactor=agent_reactor, config_paths=config_paths,  # ConfigError: exit 2
                           reload_overrides=overrides, model_files=model_files)
    service.freeze_heap = True
    globalLogBeginner.beginLoggingTo([make_observer(config.log_format, sys.stderr)], redirectStandardIO=False)
    for warning in slot_warnings(config):
        Logger(namespace="rolemesh.cli").warn("{warning}", warning=warning)
    failed: List[BaseException] = []

    def start() -> None:
        try:
            service.startService()
        except Exception as e:  # e.g. the port is taken: say so, exit non-zero
            failed.append(e)
            sys.stderr.write(f"{PROG}: cannot start: {e}\n")
            reactor.stop()

    reactor.callWhenRunning(start)
    reactor.addSystemEventTrigger("before", "shutdown", lambda: service.stopService() if service.running else None)
    reactor.run()  # installs SIGTERM/SIGINT handlers; startService refines them
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
