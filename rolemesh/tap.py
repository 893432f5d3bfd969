"""``twistd rolemesh-node``: the same service tree as the CLI, for twistd."""

from __future__ import annotations

import sys

from twisted.python import usage

from rolemesh.base.errors import ConfigError
from rolemesh.cli import PROG
from rolemesh.config.file import NodeConfig, load_config


class Options(usage.Options):
    optParameters = [
        ["config", "c", None, "Base YAML configuration file."],
        ["config-override", None, None, "YAML file deep-merged over the base."],
        ["log-format", None, None, "Override log_format: text or json."],
    ]

    config: NodeConfig

    def postOptions(self) -> None:
        if not self["config"]:
            raise usage.UsageError("--config is required")
        try:
            self.config = load_config(self["config"], self["config-override"])
        except ConfigError as e:
            sys.stderr.write(f"{PROG}: {e}\n")
            raise SystemExit(2)
        if self["log-format"] not in (None, "text", "json"):
            raise usage.UsageError("--log-format must be text or json")
        log_format = self["log-format"] or self.config.log_format
        if log_format != self.config.log_format:
            import attr

            self.config = attr.evolve(self.config, log_format=log_format)
        # twistd owns logging: hand it our JSON observer unless --logger was given.
        parent = getattr(self, "parent", None)
        if log_format == "json" and parent is not None and parent.get("logger") is None:
            parent["logger"] = "rolemesh.base.logs.json_logger"


def makeService(options: Options):  # noqa: N802 - twistd's name
    from rolemesh.service import make_service

    try:
        # The files SIGHUP and POST /v1/node/reload re-read, as in the CLI.
        service = make_service(options.config, config_paths=(options["config"], options["config-override"]))
        service.freeze_heap = True
        return service
    except ConfigError as e:
        sys.stderr.write(f"{PROG}: {e}\n")
        raise SystemExit(2)
