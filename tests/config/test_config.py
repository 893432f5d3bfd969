"""Configuration: loading, the override merge, every validation rule, defaults, redaction.

Each validation rule has its own test asserting the exact one-line message:
the key path, what was expected, and the bad value.
"""

from __future__ import annotations

import builtins
import json
import os
import shutil
import socket
import stat
from contextlib import contextmanager
from typing import Any, Iterator

import attr
from hypothesis import given
from hypothesis import strategies as st
from twisted.trial.unittest import SynchronousTestCase

import rolemesh.config.file
from rolemesh.base.errors import ConfigError
from rolemesh.config.file import (
    MODEL_KEYS,
    TOP_LEVEL_KEYS,
    ModelConfig,
    NodeConfig,
    as_dict,
    check_environment,
    deep_merge,
    is_loopback,
    load_config,
    load_yaml,
    parse,
    plain_key,
    redacted,
    render_default,
    validate,
)

ONE_PLACE = "set it in one place"
FORBIDDEN_REASON = (
    "itself (children always bind 127.0.0.1 on a port the agent picks, and load the model's path); remove it"
)


def model(**fields: Any) -> dict:
    """A minimal valid ``models[]`` entry with ``fields`` on top."""
    entry: dict = {"model_id": "coder", "path": "/models/coder.gguf"}
    entry.update(fields)
    return entry


def second(**fields: Any) -> dict:
    """A second model entry, so errors land at ``models[1]``."""
    entry: dict = {"model_id": "chat", "path": "/models/chat.gguf"}
    entry.update(fields)
    return entry


class ConfigTestCase(SynchronousTestCase):
    def valid(self, data: dict, **kwargs: Any) -> NodeConfig:
        kwargs.setdefault("check_files", False)
        kwargs.setdefault("environ", {})
        return validate(data, **kwargs)

    def error(self, data: dict, **kwargs: Any) -> str:
        """The ConfigError message ``data`` raises; always exactly one line."""
        kwargs.setdefault("check_files", False)
        kwargs.setdefault("environ", {})
        message = str(self.assertRaises(ConfigError, validate, data, **kwargs))
        self.assertNotIn("\n", message)
        self.assertNotIn("Traceback", message)
        return message

    def assertError(self, data: dict, expected: str, **kwargs: Any) -> None:
        self.assertEqual(self.error(data, **kwargs), expected)

    def write(self, text: str, mode: int = 0o644) -> str:
        path = self.mktemp()
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
        os.chmod(path, mode)
        return path


# --------------------------------------------------------------------------
# Unknown keys


class UnknownKeyTests(ConfigTestCase):
    def test_unknown_top_level_key_with_hint(self) -> None:
        self.assertError({"listen_prot": 8090}, 'listen_prot: unknown key (did you mean "listen_port"?)')

    def test_unknown_top_level_key_without_hint(self) -> None:
        self.assertError({"frobnicate": 1}, "frobnicate: unknown key")

    def test_unknown_model_key_with_hint(self) -> None:
        self.assertError(
            {"models": [model(), second(flash_atn=True)]},
            'models[1].flash_atn: unknown key (did you mean "flash_attn"?)',
        )

    def test_unknown_model_key_without_hint(self) -> None:
        self.assertError({"models": [model(), second(temperature=0.2)]}, "models[1].temperature: unknown key")

    def test_unknown_key_that_is_not_one_line_is_quoted(self) -> None:
        self.assertError({"a\nb": 1}, '"a\\nb": unknown key')

    def test_every_documented_key_is_known(self) -> None:
        """No key in the documentation tables is rejected as unknown."""
        for key in TOP_LEVEL_KEYS:
            try:
                validate({key.name: None}, check_files=False, environ={})
            except ConfigError as e:
                self.assertNotIn("unknown key", str(e))
        for key in MODEL_KEYS:
            try:
                validate({"models": [model(**{key.name: None})]}, check_files=False, environ={})
            except ConfigError as e:
                self.assertNotIn("unknown key", str(e))


# --------------------------------------------------------------------------
# Typed top-level fields


class TopLevelTypeTests(ConfigTestCase):
    def test_node_id(self) -> None:
        self.assertError({"node_id": ""}, 'node_id: expected a non-empty string, got ""')
        self.assertError({"node_id": 7}, "node_id: expected a non-empty string, got 7")

    def test_listen_host(self) -> None:
        self.assertError({"listen_host": 7}, "listen_host: expected an address or a list of addresses, got 7")
        self.assertError({"listen_host": ["a", ""]}, 'listen_host[1]: expected a non-empty string, got ""')
        self.assertError({"listen_host": "0.0.0.0 ::"},
                         'listen_host: an address (a host name or an IP) has no spaces: "0.0.0.0 ::"')
        self.assertError({"listen_host": []}, "listen_host: expected an address or a list of addresses, got []")
        one = self.valid({"listen_host": "::1"})
        self.assertEqual((one.listen_host, one.addresses), ("::1", ("::1",)))

    def test_several_listen_addresses(self) -> None:
        """llama-server's ``--host 127.0.0.1,::1``, or a list: each address, on one port."""
        for several in ("127.0.0.1,::1", "127.0.0.1, ::1,127.0.0.1", ["127.0.0.1", "::1"]):
            config = self.valid({"listen_host": several})
            self.assertEqual((config.listen_host, config.addresses), ("127.0.0.1", ("127.0.0.1", "::1")), several)
            self.assertFalse(config.exposed_without_key)
            self.assertEqual(validate(as_dict(config), check_files=False, environ={}), config)  # --check's output
        self.assertTrue(self.valid({"listen_host": ["127.0.0.1", "0.0.0.0"]}).exposed_without_key)
        listen = self.valid({"listen_host": "127.0.0.1,::1", "listen": "tcp6:9000:interface=\\:\\:1"})
        self.assertEqual(listen.addresses, ("::1",))  # ``listen`` wins, as for one address

    def test_listen_port(self) -> None:
        self.assertError({"listen_port": "http"}, 'listen_port: expected a port number 0-65535, got "http"')
        self.assertError({"listen_port": 70000}, "listen_port: expected a port number 0-65535, got 70000")
        self.assertError({"listen_port": -1}, "listen_port: expected a port number 0-65535, got -1")
        self.assertError({"listen_port": True}, "listen_port: expected a port number 0-65535, got true")

    def test_advertise_url(self) -> None:
        self.assertError(
            {"advertise_url": "ftp://node"},
            'advertise_url: expected an http:// or https:// URL, got "ftp://node"',
        )
        self.assertError(
            {"advertise_url": "http://"}, 'advertise_url: expected an http:// or https:// URL, got "http://"'
        )

    def test_backend(self) -> None:
        self.assertError(
            {"backend": "opencl"},
            'backend: expected one of auto, cuda, rocm, metal, sycl, vulkan, cpu, got "opencl"',
        )

    def test_devices(self) -> None:
        self.assertError({"devices": "gpu:0"}, 'devices: expected a list of strings, got "gpu:0"')
        self.assertError({"devices": ["gpu:0", 1]}, "devices[1]: expected a non-empty string, got 1")
        self.assertError(
            {"devices": []}, "devices: expected a non-empty list of device names (or leave it unset), got []"
        )

    def test_cpu_devices(self) -> None:
        self.assertError(
            {"cpu_devices": "many"}, 'cpu_devices: expected "numa" or a positive integer, got "many"'
        )
        self.assertError({"cpu_devices": 0}, 'cpu_devices: expected "numa" or a positive integer, got 0')
        self.assertError(
            {"cpu_devices": True}, 'cpu_devices: expected "numa" or a positive integer, got true'
        )
        self.assertError({"cpu_devices": 1.5}, 'cpu_devices: expected "numa" or a positive integer, got 1.5')
        self.assertEqual(self.valid({"cpu_devices": "numa"}).cpu_devices, "numa")
        self.assertEqual(self.valid({"cpu_devices": 4}).cpu_devices, 4)

    def test_llama_server_startup_timeout_s(self) -> None:
        self.assertError(
            {"llama_server_startup_timeout_s": 0},
            "llama_server_startup_timeout_s: expected a positive number, got 0",
        )
        self.assertError(
            {"llama_server_startup_timeout_s": "30s"},
            'llama_server_startup_timeout_s: expected a positive number, got "30s"',
        )

    def test_llama_server_probe_interval_s(self) -> None:
        self.assertError(
            {"llama_server_probe_interval_s": -0.5},
            "llama_server_probe_interval_s: expected a positive number, got -0.5",
        )

    def test_llama_server_stop_timeout_s(self) -> None:
        self.assertError(
            {"llama_server_stop_timeout_s": False},
            "llama_server_stop_timeout_s: expected a positive number, got false",
        )

    def test_max_pending_requests_per_device(self) -> None:
        self.assertError(
            {"max_pending_requests_per_device": 0},
            "max_pending_requests_per_device: expected a positive integer, got 0",
        )
        self.assertError(
            {"max_pending_requests_per_device": 2.5},
            "max_pending_requests_per_device: expected a positive integer, got 2.5",
        )

    def test_dispatcher_base_url(self) -> None:
        self.assertError(
            {"dispatcher_base_url": "dispatcher:9000"},
            'dispatcher_base_url: expected an http:// or https:// URL, got "dispatcher:9000"',
        )

    def test_heartbeat_interval_s(self) -> None:
        self.assertError(
            {"heartbeat_interval_s": "5"}, 'heartbeat_interval_s: expected a positive number, got "5"'
        )

    def test_api_key(self) -> None:
        self.assertError({"api_key": ""}, 'api_key: expected a non-empty string, got ""')
        self.assertError({"api_key": 12345}, "api_key: expected a non-empty string, got 12345")

    def test_api_keys(self) -> None:
        self.assertError({"api_keys": "k1"},
                         'api_keys: expected a list of strings or {name, key, ...} mappings, got "k1"')
        self.assertError({"api_keys": ["k1", ""]}, 'api_keys[1]: expected a non-empty string, got ""')

    def test_dispatcher_token(self) -> None:
        self.assertError({"dispatcher_token": 42}, "dispatcher_token: expected a non-empty string, got 42")

    def test_max_request_body_bytes(self) -> None:
        self.assertError(
            {"max_request_body_bytes": "8MiB"},
            'max_request_body_bytes: expected a positive integer, got "8MiB"',
        )

    def test_request_timeout_s(self) -> None:
        self.assertError({"request_timeout_s": 0}, "request_timeout_s: expected a positive number, got 0")

    def test_shutdown_grace_s(self) -> None:
        self.assertError({"shutdown_grace_s": -1}, "shutdown_grace_s: expected a non-negative number, got -1")
        self.assertEqual(self.valid({"shutdown_grace_s": 0}).shutdown_grace_s, 0.0)

    def test_idle_unload_s(self) -> None:
        self.assertError({"idle_unload_s": 0}, "idle_unload_s: expected a positive number, got 0")

    def test_state_dir(self) -> None:
        self.assertError({"state_dir": ""}, 'state_dir: expected a non-empty string, got ""')

    def test_log_format(self) -> None:
        self.assertError({"log_format": "xml"}, 'log_format: expected one of text, json, got "xml"')
        self.assertEqual(self.valid({"log_format": "json"}).log_format, "json")

    def test_models_must_be_a_list(self) -> None:
        self.assertError(
            {"models": {"coder": {}}}, 'models: expected a list of model entries, got {"coder": {}}'
        )

    def test_model_entry_must_be_a_mapping(self) -> None:
        self.assertError({"models": [model(), "chat"]}, 'models[1]: expected a mapping, got "chat"')


# --------------------------------------------------------------------------
# Typed model fields


class ModelTypeTests(ConfigTestCase):
    def assertModelError(self, fields: dict, expected: str) -> None:
        self.assertError({"models": [model(), second(**fields)]}, expected)

    def test_model_id(self) -> None:
        self.assertModelError({"model_id": 3}, "models[1].model_id: expected a non-empty string, got 3")
        self.assertModelError({"model_id": " "}, 'models[1].model_id: expected a non-empty string, got " "')

    def test_path(self) -> None:
        self.assertModelError({"path": ""}, 'models[1].path: expected a non-empty string, got ""')

    def test_roles(self) -> None:
        self.assertModelError({"roles": "coder"}, 'models[1].roles: expected a list of strings, got "coder"')
        self.assertModelError(
            {"roles": ["chat", 2]}, "models[1].roles[1]: expected a non-empty string, got 2"
        )

    def test_alias(self) -> None:
        self.assertModelError({"alias": ""}, 'models[1].alias: expected a non-empty string, got ""')

    def test_ctx_size(self) -> None:
        self.assertModelError(
            {"ctx_size": "big"}, 'models[1].ctx_size: expected a positive integer, got "big"'
        )
        self.assertModelError({"ctx_size": 0}, "models[1].ctx_size: expected a positive integer, got 0")
        self.assertModelError({"ctx_size": True}, "models[1].ctx_size: expected a positive integer, got true")

    def test_batch_size(self) -> None:
        self.assertModelError(
            {"batch_size": 512.5}, "models[1].batch_size: expected a positive integer, got 512.5"
        )

    def test_ubatch_size(self) -> None:
        self.assertModelError(
            {"ubatch_size": -1}, "models[1].ubatch_size: expected a positive integer, got -1"
        )

    def test_threads(self) -> None:
        self.assertModelError({"threads": "8"}, 'models[1].threads: expected a positive integer, got "8"')

    def test_threads_batch(self) -> None:
        self.assertModelError(
            {"threads_batch": 0}, "models[1].threads_batch: expected a positive integer, got 0"
        )

    def test_gpu_layers(self) -> None:
        self.assertModelError(
            {"gpu_layers": "most"}, 'models[1].gpu_layers: expected a non-negative integer, got "most"'
        )
        self.assertModelError(
            {"gpu_layers": -1}, "models[1].gpu_layers: expected a non-negative integer, got -1"
        )
        for good in (0, 99, "auto", "all"):
            self.assertEqual(self.valid({"models": [model(gpu_layers=good)]}).models[0].gpu_layers, good)

    def test_main_gpu(self) -> None:
        self.assertModelError({"main_gpu": -1}, "models[1].main_gpu: expected a non-negative integer, got -1")

    def test_tensor_split(self) -> None:
        expected = "models[1].tensor_split: expected a non-empty list of non-negative numbers, got "
        self.assertModelError({"tensor_split": "0.6,0.4"}, expected + '"0.6,0.4"')
        self.assertModelError({"tensor_split": []}, expected + "[]")
        self.assertModelError({"tensor_split": [0.6, -0.4]}, expected + "[0.6, -0.4]")
        self.assertModelError({"tensor_split": [True, 1]}, expected + "[true, 1]")
        self.assertEqual(
            self.valid({"models": [model(tensor_split=[0.6, 0.4])]}).models[0].tensor_split, (0.6, 0.4)
        )

    def test_flash_attn(self) -> None:
        self.assertModelError(
            {"flash_attn": "yes"}, 'models[1].flash_attn: expected one of on, off, auto, got "yes"'
        )
        self.assertModelError({"flash_attn": 1}, "models[1].flash_attn: expected one of on, off, auto, got 1")

    def test_flash_attn_true_is_on(self) -> None:
        """``flash_attn: true`` becomes ``on`` (llama-server takes on|off|auto, not a bare flag)."""
        cases = {True: "on", False: "off", "on": "on", "off": "off", "auto": "auto"}
        for given_value, stored in cases.items():
            self.assertEqual(
                self.valid({"models": [model(flash_attn=given_value)]}).models[0].flash_attn, stored
            )

    def test_server_args_must_be_a_mapping(self) -> None:
        self.assertModelError(
            {"server_args": ["--parallel", "2"]},
            'models[1].server_args: expected a mapping of llama-server flags, got ["--parallel", "2"]',
        )

    def test_server_args_key_must_be_a_flag_name(self) -> None:
        self.assertModelError(
            {"server_args": {"--": True}}, 'models[1].server_args: expected flag names as keys, got "--"'
        )
        self.assertModelError(
            {"server_args": {4: True}}, "models[1].server_args: expected flag names as keys, got 4"
        )

    def test_server_args_value_types(self) -> None:
        self.assertModelError(
            {"server_args": {"lora": {"a": 1}}},
            'models[1].server_args.lora: expected a scalar, a boolean, null or a list, got {"a": 1}',
        )
        self.assertModelError(
            {"server_args": {"lora": ["a.gguf", None]}},
            "models[1].server_args.lora[1]: expected a string or a number, got null",
        )

    def test_server_args_parallel(self) -> None:
        self.assertModelError(
            {"server_args": {"parallel": 0}},
            "models[1].server_args.parallel: expected a positive integer, got 0",
        )
        self.assertModelError(
            {"server_args": {"np": "4"}}, 'models[1].server_args.np: expected a positive integer, got "4"'
        )
        self.assertModelError(
            {"server_args": {"parallel": True}},
            "models[1].server_args.parallel: expected a positive integer, got true",
        )

    def test_parallel_slots(self) -> None:
        def slots(server_args: dict) -> int:
            return self.valid({"models": [model(server_args=server_args)]}).models[0].parallel

        self.assertEqual(slots({}), 1)
        self.assertEqual(slots({"parallel": 4}), 4)
        self.assertEqual(slots({"--np": 3}), 3)
        self.assertEqual(slots({"parallel": None}), 1)
        self.assertEqual(slots({"parallel": False}), 1)

    def test_preload(self) -> None:
        self.assertModelError({"preload": "yes"}, 'models[1].preload: expected true or false, got "yes"')

    def test_model_idle_unload_s(self) -> None:
        self.assertModelError(
            {"idle_unload_s": 0}, "models[1].idle_unload_s: expected a positive number, got 0"
        )

    def test_model_idle_unload_inherits_or_keeps_forever(self) -> None:
        config = self.valid(
            {
                "idle_unload_s": 300,
                "models": [
                    model(),
                    second(idle_unload_s=60),
                    {"model_id": "keep", "path": "/m/k.gguf", "idle_unload_s": None},
                ],
            }
        )
        inherits, own, keep = config.models
        self.assertEqual(config.idle_unload_for(inherits), 300.0)
        self.assertEqual(config.idle_unload_for(own), 60.0)
        self.assertIs(config.idle_unload_for(keep), None)


# --------------------------------------------------------------------------
# Required keys, names


class ModelIdentityTests(ConfigTestCase):
    def test_missing_model_id(self) -> None:
        self.assertError({"models": [model(), {"path": "/m/x.gguf"}]}, "models[1].model_id: required")

    def test_missing_path(self) -> None:
        self.assertError({"models": [model(), {"model_id": "chat"}]}, "models[1].path: required")

    def test_null_model_id_is_missing(self) -> None:
        self.assertError({"models": [model(model_id=None)]}, "models[0].model_id: required")

    def test_duplicate_model_id(self) -> None:
        self.assertError(
            {"models": [model(), second(), second(path="/m/other.gguf")]},
            'models[2].model_id: duplicate model_id "chat" (also models[1].model_id)',
        )

    def test_alias_collides_with_another_models_id(self) -> None:
        self.assertError(
            {"models": [model(), second(alias="coder")]},
            'models[1].alias: "coder" already names another model (models[0].model_id)',
        )

    def test_model_id_collides_with_an_earlier_alias(self) -> None:
        self.assertError(
            {"models": [model(alias="chat"), second()]},
            'models[1].model_id: "chat" already names another model (models[0].alias)',
        )

    def test_two_models_with_one_alias(self) -> None:
        self.assertError(
            {"models": [model(alias="fast"), second(alias="fast")]},
            'models[1].alias: "fast" already names another model (models[0].alias)',
        )

    def test_alias_equal_to_own_model_id_is_fine(self) -> None:
        config = self.valid({"models": [model(alias="coder")]})
        self.assertEqual(config.models[0].served_name, "coder")

    def test_several_aliases_and_tags(self) -> None:
        """llama-server's ``--alias a,b,c`` and ``--tags``: a list, or its comma-separated string."""
        config = self.valid({"models": [model(alias="fast", aliases=["code", "fim", "fast"], tags="chat, fim")]})
        m = config.models[0]
        self.assertEqual((m.names, m.served_name, m.tags), (("coder", "fast", "code", "fim"), "fast", ("chat", "fim")))
        self.assertEqual(self.valid({"models": [model(aliases="a,b")]}).models[0].aliases, ("a", "b"))

    def test_an_alias_in_the_list_that_names_another_model(self) -> None:
        self.assertError(
            {"models": [model(), second(aliases=["fim", "coder"])]},
            'models[1].aliases[1]: "coder" already names another model (models[0].model_id)',
        )
        self.assertError({"models": [model(aliases=[3])]}, "models[0].aliases[0]: expected a non-empty string, got 3")
        self.assertIn("models[0].tags: expected a list of strings", self.error({"models": [model(tags={"a": 1})]}))


# --------------------------------------------------------------------------
# Filesystem checks and placeholders


class FileTests(ConfigTestCase):
    def test_model_path_does_not_exist(self) -> None:
        missing = self.mktemp()
        self.assertError(
            {"models": [model(path=missing)]},
            f"models[0].path: file not found: {json.dumps(missing)}",
            check_files=True,
        )

    def test_model_path_is_a_directory(self) -> None:
        directory = self.mktemp()
        os.mkdir(directory)
        self.assertError(
            {"models": [model(path=directory)]},
            f"models[0].path: not a regular file: {json.dumps(directory)}",
            check_files=True,
        )

    def test_model_path_that_exists(self) -> None:
        weights = self.write("GGUF")
        self.assertEqual(
            self.valid({"models": [model(path=weights)]}, check_files=True).models[0].path, weights
        )

    def test_check_files_false_skips_the_path_check(self) -> None:
        self.assertEqual(self.valid({"models": [model(path=self.mktemp())]}).models[0].model_id, "coder")

    def test_placeholder_model_path(self) -> None:
        self.assertError(
            {"models": [model(), second(path="/path/to/model-weights/chat.gguf")]},
            'models[1].path: placeholder value "/path/to/model-weights/chat.gguf" is still in place; '
            "set a real value (e.g. in a --config-override file)",
        )

    def test_placeholder_llama_server_bin(self) -> None:
        self.assertError(
            {"llama_server_bin": "/path/to/llama-server"},
            'llama_server_bin: placeholder value "/path/to/llama-server" is still in place; '
            "set a real value (e.g. in a --config-override file)",
        )

    def test_llama_server_bin_not_executable(self) -> None:
        binary = self.write("#!/bin/sh\n", mode=0o644)
        self.assertError(
            {"llama_server_bin": binary},
            f"llama_server_bin: not an executable file: {json.dumps(binary)}",
            check_files=True,
        )

    def test_llama_server_bin_missing(self) -> None:
        binary = os.path.abspath(self.mktemp())
        self.assertError(
            {"llama_server_bin": binary},
            f"llama_server_bin: not an executable file: {json.dumps(binary)}",
            check_files=True,
        )

    def test_llama_server_bin_is_a_directory(self) -> None:
        directory = os.path.abspath(self.mktemp())
        os.mkdir(directory)
        self.assertError(
            {"llama_server_bin": directory},
            f"llama_server_bin: not an executable file: {json.dumps(directory)}",
            check_files=True,
        )

    def test_llama_server_bin_executable(self) -> None:
        binary = self.write("#!/bin/sh\n", mode=0o755)
        self.assertEqual(self.valid({"llama_server_bin": binary}, check_files=True).llama_server_bin, binary)

    def test_llama_server_bin_not_on_path(self) -> None:
        self.patchPath(os.path.abspath(self.mktemp()))
        self.assertError(
            {"llama_server_bin": "llama-server-nowhere"},
            'llama_server_bin: "llama-server-nowhere" not found on PATH',
            check_files=True,
        )

    def test_llama_server_bin_found_on_path(self) -> None:
        directory = os.path.abspath(self.mktemp())
        os.mkdir(directory)
        binary = os.path.join(directory, "llama-server")
        with open(binary, "w") as f:
            f.write("#!/bin/sh\n")
        os.chmod(binary, stat.S_IRWXU)
        self.patchPath(directory)
        self.assertEqual(
            self.valid({"llama_server_bin": "llama-server"}, check_files=True).llama_server_bin, binary
        )

    def patchPath(self, value: str) -> None:
        old = os.environ.get("PATH")
        os.environ["PATH"] = value

        def restore() -> None:
            if old is None:
                os.environ.pop("PATH", None)
            else:
                os.environ["PATH"] = old

        self.addCleanup(restore)


# --------------------------------------------------------------------------
# server_args


class ServerArgsRuleTests(ConfigTestCase):
    def test_forbidden_flags_in_every_spelling(self) -> None:
        for key, flag in [
            ("host", "host"),
            ("--host", "host"),
            ("port", "port"),
            ("--port", "port"),
            ("model", "model"),
            ("--model", "model"),
            ("m", "m"),
            ("-m", "m"),
        ]:
            self.assertError(
                {"models": [model(), second(server_args={"parallel": 2, key: "x"})]},
                f"models[1].server_args.{key}: the agent sets --{flag} {FORBIDDEN_REASON}",
            )

    def test_forbidden_even_when_false(self) -> None:
        self.assertError(
            {"models": [model(server_args={"port": None})]},
            f"models[0].server_args.port: the agent sets --port {FORBIDDEN_REASON}",
        )

    def test_conflicts_with_structured_field(self) -> None:
        self.assertError(
            {"models": [model(ctx_size=4096, server_args={"ctx-size": 8192})]},
            "models[0].server_args.ctx-size: conflicts with the structured field models[0].ctx_size; "
            + ONE_PLACE,
        )

    def test_conflicts_with_structured_field_short_spelling(self) -> None:
        self.assertError(
            {"models": [model(), second(ctx_size=4096, server_args={"c": 8192})]},
            "models[1].server_args.c: conflicts with the structured field models[1].ctx_size; " + ONE_PLACE,
        )

    def test_conflicts_in_every_structured_spelling(self) -> None:
        cases = [
            ("batch_size", 512, "--batch_size"),
            ("ubatch_size", 512, "ub"),
            ("threads", 8, "-t"),
            ("threads_batch", 8, "tb"),
            ("gpu_layers", 99, "ngl"),
            ("gpu_layers", "all", "n_gpu_layers"),
            ("gpu_layers", 10, "gpu-layers"),
            ("main_gpu", 0, "mg"),
            ("tensor_split", [1, 1], "ts"),
            ("flash_attn", True, "fa"),
        ]
        for field, value, key in cases:
            self.assertError(
                {"models": [model(**{field: value, "server_args": {key: value}})]},
                f"models[0].server_args.{key}: conflicts with the structured field models[0].{field}; "
                + ONE_PLACE,
            )

    def test_conflict_even_when_server_args_value_is_false(self) -> None:
        self.assertError(
            {"models": [model(threads=4, server_args={"threads": False})]},
            "models[0].server_args.threads: conflicts with the structured field models[0].threads; "
            + ONE_PLACE,
        )

    def test_alias_belongs_to_the_agent(self) -> None:
        for key in ("alias", "--alias", "a"):
            self.assertError(
                {"models": [model(server_args={key: "other"})]},
                f"models[0].server_args.{key}: the agent sets --alias itself; use models[0].alias instead",
            )

    def test_structured_flag_in_server_args_without_the_field_is_allowed(self) -> None:
        config = self.valid({"models": [model(server_args={"ngl": 20})]})
        self.assertEqual(config.models[0].server_args, (("ngl", 20),))

    def test_same_flag_twice(self) -> None:
        self.assertError(
            {"models": [model(server_args={"no_mmap": True, "--no-mmap": True})]},
            "models[0].server_args.--no-mmap: the same flag as models[0].server_args.no_mmap",
        )

    def test_same_structured_flag_in_two_spellings(self) -> None:
        self.assertError(
            {"models": [model(server_args={"ngl": 10, "n-gpu-layers": 20})]},
            "models[0].server_args.n-gpu-layers: the same flag as models[0].server_args.ngl",
        )

    def test_parallel_in_two_spellings(self) -> None:
        self.assertError(
            {"models": [model(server_args={"parallel": 2, "np": 4})]},
            "models[0].server_args.np: the same flag as models[0].server_args.parallel",
        )

    def test_keys_are_normalised_in_config_order(self) -> None:
        config = self.valid(
            {
                "models": [
                    model(server_args={"--cont_batching": True, "cache-type-k": "q8_0", "lora": ["a", "b"]})
                ]
            }
        )
        self.assertEqual(
            config.models[0].server_args,
            (("cont-batching", True), ("cache-type-k", "q8_0"), ("lora", ("a", "b"))),
        )


# --------------------------------------------------------------------------
# API keys from the environment and from files


class ApiKeySourceTests(ConfigTestCase):
    def test_api_key_env_unset(self) -> None:
        self.assertError(
            {"api_key_env": "ROLEMESH_KEY"},
            "api_key_env: environment variable ROLEMESH_KEY is not set or empty",
            environ={},
        )

    def test_api_key_env_empty(self) -> None:
        self.assertError(
            {"api_key_env": "ROLEMESH_KEY"},
            "api_key_env: environment variable ROLEMESH_KEY is not set or empty",
            environ={"ROLEMESH_KEY": "  "},
        )

    def test_api_key_env_set(self) -> None:
        config = self.valid(
            {"api_key": "k1", "api_key_env": "ROLEMESH_KEY"}, environ={"ROLEMESH_KEY": "k2\n"}
        )
        self.assertEqual(config.api_keys, ("k1", "k2"))

    def test_api_key_file_missing(self) -> None:
        missing = self.mktemp()
        self.assertError(
            {"api_key_file": missing},
            f"api_key_file: cannot read {json.dumps(missing)}: No such file or directory",
            check_files=True,
        )

    def test_api_key_file_empty(self) -> None:
        empty = self.write("# no keys yet\n\n")
        self.assertError(
            {"api_key_file": empty}, f"api_key_file: {json.dumps(empty)} holds no key", check_files=True
        )

    def test_api_key_file_keys(self) -> None:
        keys = self.write("# rotated 2024-05\nold-key\n\n  new-key  \nold-key\n")
        config = self.valid({"api_keys": ["first"], "api_key_file": keys}, check_files=True)
        self.assertEqual(config.api_keys, ("first", "old-key", "new-key"))


# --------------------------------------------------------------------------
# Loading YAML


class LoadYamlTests(ConfigTestCase):
    def loadError(self, path: str) -> str:
        message = str(self.assertRaises(ConfigError, load_yaml, path))
        self.assertNotIn("\n", message)
        return message

    def test_invalid_yaml_names_line_and_column(self) -> None:
        path = self.write("listen_port: 8090\nmodels: [1, 2\nbackend: cpu\n")
        self.assertEqual(
            self.loadError(path),
            f"{path}: invalid YAML at line 3, column 8: expected ',' or ']', but got ':'",
        )

    def test_invalid_yaml_mapping_values(self) -> None:
        path = self.write("node_id: a: b\n")
        self.assertEqual(
            self.loadError(path),
            f"{path}: invalid YAML at line 1, column 11: mapping values are not allowed here",
        )

    def test_invalid_yaml_tab(self) -> None:
        path = self.write("models:\n\t- model_id: x\n")
        self.assertEqual(
            self.loadError(path),
            f"{path}: invalid YAML at line 2, column 1: found character '\\t' that cannot start any token",
        )

    def test_python_tags_are_refused(self) -> None:
        """``safe_load``: no arbitrary objects."""
        path = self.write("node_id: !!python/object/apply:os.getcwd []\n")
        self.assertIn(
            f"{path}: invalid YAML at line 1, column 10: could not determine a constructor",
            self.loadError(path),
        )

    def test_unacceptable_character(self) -> None:
        path = self.write("node_id: \x00\n")
        self.assertEqual(
            self.loadError(path),
            f"{path}: invalid YAML: unacceptable character #x0000: special characters are not allowed",
        )

    def test_top_level_list(self) -> None:
        path = self.write("- model_id: coder\n  path: /m/c.gguf\n")
        self.assertEqual(self.loadError(path), f"{path}: expected a mapping at the top level, got a list")

    def test_top_level_scalar(self) -> None:
        path = self.write("just words\n")
        self.assertEqual(self.loadError(path), f"{path}: expected a mapping at the top level, got a string")

    def test_missing_file(self) -> None:
        path = self.mktemp()
        self.assertEqual(self.loadError(path), f"{path}: no such file")

    def test_directory(self) -> None:
        path = self.mktemp()
        os.mkdir(path)
        self.assertEqual(self.loadError(path), f"{path}: is a directory, expected a YAML file")

    def test_not_utf8(self) -> None:
        path = self.mktemp()
        with open(path, "wb") as f:
            f.write(b"node_id: \xff\xfe\n")
        self.assertEqual(self.loadError(path), f"{path}: not UTF-8 text")

    def test_empty_file_is_an_empty_mapping(self) -> None:
        self.assertEqual(load_yaml(self.write("")), {})
        self.assertEqual(load_yaml(self.write("# only a comment\n")), {})

    def test_load_config_missing_override(self) -> None:
        base = self.write("listen_port: 9000\n")
        missing = self.mktemp()
        message = str(self.assertRaises(ConfigError, load_config, base, missing, check_files=False))
        self.assertEqual(message, f"{missing}: no such file")


# --------------------------------------------------------------------------
# Defaults


class DefaultTests(ConfigTestCase):
    def test_defaults_match_the_spec(self) -> None:
        config = self.valid({}, environ={"XDG_STATE_HOME": "/var/state"})
        self.assertEqual(config.node_id, socket.gethostname())
        self.assertEqual(config.listen_host, "127.0.0.1")
        self.assertEqual(config.listen_port, 8090)
        self.assertEqual(config.advertise_url, "http://127.0.0.1:8090")
        self.assertEqual(config.backend, "auto")
        self.assertIs(config.devices, None)
        self.assertIs(config.cpu_devices, None)
        self.assertIs(config.llama_server_bin, None)
        self.assertEqual(config.llama_server_startup_timeout_s, 30.0)
        self.assertEqual(config.llama_server_probe_interval_s, 0.5)
        self.assertEqual(config.llama_server_stop_timeout_s, 5.0)
        self.assertEqual(config.max_pending_requests_per_device, 2)
        self.assertIs(config.dispatcher_base_url, None)
        self.assertEqual(config.heartbeat_interval_s, 5.0)
        self.assertEqual(config.api_keys, ())
        self.assertIs(config.dispatcher_token, None)
        self.assertEqual(config.max_request_body_bytes, 8 * 1024 * 1024)
        self.assertEqual(config.request_timeout_s, 600.0)
        self.assertEqual(config.shutdown_grace_s, 30.0)
        self.assertIs(config.idle_unload_s, None)
        self.assertEqual(config.state_dir, "/var/state/rolemesh-node")
        self.assertEqual(config.log_format, "text")
        self.assertEqual(config.models, ())

    def test_defaults_equal_the_record_defaults(self) -> None:
        """``validate({})`` and ``NodeConfig``'s own defaults agree."""
        config = self.valid({}, environ={})
        bare = NodeConfig(node_id=config.node_id)
        for name in (
            "listen_host",
            "listen_port",
            "backend",
            "llama_server_startup_timeout_s",
            "llama_server_probe_interval_s",
            "llama_server_stop_timeout_s",
            "max_pending_requests_per_device",
            "heartbeat_interval_s",
            "max_request_body_bytes",
            "request_timeout_s",
            "shutdown_grace_s",
            "idle_unload_s",
            "log_format",
        ):
            self.assertEqual(getattr(config, name), getattr(bare, name), name)

    def test_state_dir_without_xdg(self) -> None:
        config = self.valid({}, environ={})
        self.assertEqual(
            config.state_dir, os.path.join(os.path.expanduser("~"), ".local", "state", "rolemesh-node")
        )

    def test_state_dir_expands_user(self) -> None:
        self.assertEqual(
            self.valid({"state_dir": "~/rm"}).state_dir, os.path.join(os.path.expanduser("~"), "rm")
        )

    def test_model_defaults(self) -> None:
        (entry,) = self.valid({"models": [model()]}).models
        self.assertEqual(entry.roles, ())
        self.assertIs(entry.alias, None)
        self.assertEqual(entry.served_name, "coder")
        self.assertEqual(entry.names, ("coder",))
        for field in (
            "ctx_size",
            "batch_size",
            "ubatch_size",
            "threads",
            "threads_batch",
            "gpu_layers",
            "main_gpu",
            "tensor_split",
            "flash_attn",
            "idle_unload_s",
        ):
            self.assertIs(getattr(entry, field), None, field)
        self.assertEqual(entry.server_args, ())
        self.assertFalse(entry.preload)
        self.assertFalse(entry.keep_loaded)

    def test_advertise_url_derived_from_listen_address(self) -> None:
        self.assertEqual(
            self.valid({"listen_host": "10.0.0.5", "listen_port": 9000}).advertise_url, "http://10.0.0.5:9000"
        )
        self.assertEqual(self.valid({"listen_host": "::1"}).advertise_url, "http://[::1]:8090")
        wildcard = self.valid({"listen_host": "0.0.0.0"}).advertise_url
        self.assertEqual(wildcard, f"http://{socket.getfqdn()}:8090")

    def test_advertise_url_and_dispatcher_lose_trailing_slash(self) -> None:
        config = self.valid(
            {"advertise_url": "https://node.example/", "dispatcher_base_url": "http://d:9000/"}
        )
        self.assertEqual(config.advertise_url, "https://node.example")
        self.assertEqual(config.dispatcher_base_url, "http://d:9000")

    def test_null_optional_keys_mean_unset(self) -> None:
        config = self.valid({"node_id": None, "dispatcher_base_url": None, "api_key": None, "models": None})
        self.assertEqual(config.node_id, socket.gethostname())
        self.assertIs(config.dispatcher_base_url, None)
        self.assertEqual(config.api_keys, ())
        self.assertEqual(config.models, ())

    def test_records_are_frozen(self) -> None:
        config = self.valid({"models": [model()]})
        self.assertRaises(AttributeError, setattr, config, "listen_port", 1)
        self.assertRaises(AttributeError, setattr, config.models[0], "path", "/x")


# --------------------------------------------------------------------------
# Override merge


class DeepMergeTests(SynchronousTestCase):
    def test_mappings_merge_recursively(self) -> None:
        base = {"a": {"x": 1, "y": {"p": 1, "q": 2}}, "b": 1}
        override = {"a": {"y": {"q": 3, "r": 4}}}
        self.assertEqual(deep_merge(base, override), {"a": {"x": 1, "y": {"p": 1, "q": 3, "r": 4}}, "b": 1})

    def test_scalars_replace(self) -> None:
        self.assertEqual(
            deep_merge({"listen_port": 8090, "backend": "auto"}, {"listen_port": 9000}),
            {"listen_port": 9000, "backend": "auto"},
        )

    def test_lists_replace(self) -> None:
        self.assertEqual(
            deep_merge({"devices": ["gpu:0", "gpu:1"]}, {"devices": ["gpu:1"]}), {"devices": ["gpu:1"]}
        )

    def test_a_mapping_replaces_a_scalar_and_back(self) -> None:
        self.assertEqual(deep_merge({"a": 1}, {"a": {"b": 2}}), {"a": {"b": 2}})
        self.assertEqual(deep_merge({"a": {"b": 2}}, {"a": 1}), {"a": 1})

    def test_null_replaces(self) -> None:
        self.assertEqual(
            deep_merge({"dispatcher_base_url": "http://d"}, {"dispatcher_base_url": None}),
            {"dispatcher_base_url": None},
        )

    def test_override_sets_one_models_path(self) -> None:
        base = {
            "models": [
                {
                    "model_id": "coder",
                    "path": "/path/to/model-weights/coder.gguf",
                    "roles": ["code"],
                    "ctx_size": 8192,
                },
                {"model_id": "chat", "path": "/path/to/model-weights/chat.gguf", "roles": ["chat"]},
            ]
        }
        override = {"models": [{"model_id": "chat", "path": "/srv/weights/chat.gguf"}]}
        self.assertEqual(
            deep_merge(base, override),
            {
                "models": [
                    {
                        "model_id": "coder",
                        "path": "/path/to/model-weights/coder.gguf",
                        "roles": ["code"],
                        "ctx_size": 8192,
                    },
                    {"model_id": "chat", "path": "/srv/weights/chat.gguf", "roles": ["chat"]},
                ]
            },
        )

    def test_model_fields_merge_recursively_and_lists_inside_replace(self) -> None:
        base = {
            "models": [
                {
                    "model_id": "m",
                    "path": "/a",
                    "roles": ["x", "y"],
                    "server_args": {"parallel": 2, "jinja": True},
                }
            ]
        }
        override = {
            "models": [{"model_id": "m", "roles": ["z"], "server_args": {"parallel": 4, "jinja": None}}]
        }
        self.assertEqual(
            deep_merge(base, override)["models"],
            [{"model_id": "m", "path": "/a", "roles": ["z"], "server_args": {"parallel": 4, "jinja": None}}],
        )

    def test_new_model_ids_append(self) -> None:
        base = {"models": [{"model_id": "a", "path": "/a"}]}
        override = {"models": [{"model_id": "b", "path": "/b"}, {"model_id": "a", "ctx_size": 1}]}
        self.assertEqual(
            deep_merge(base, override)["models"],
            [{"model_id": "a", "path": "/a", "ctx_size": 1}, {"model_id": "b", "path": "/b"}],
        )

    def test_models_without_a_base_list_are_taken_as_they_are(self) -> None:
        override = {"models": [{"model_id": "a", "path": "/a"}]}
        self.assertEqual(deep_merge({"listen_port": 1}, override), {"listen_port": 1, **override})

    def test_override_entry_without_model_id(self) -> None:
        base = {"models": [{"model_id": "a", "path": "/a"}]}
        for entry in ({"path": "/b"}, {"model_id": 3, "path": "/b"}, "a"):
            e = self.assertRaises(ConfigError, deep_merge, base, {"models": [{"model_id": "a"}, entry]})
            self.assertEqual(
                str(e), "models[1] (override): each override entry needs a model_id to match a base entry"
            )

    def test_only_top_level_models_merge_by_id(self) -> None:
        base = {"x": {"models": [{"model_id": "a", "path": "/a"}]}}
        override = {"x": {"models": [{"model_id": "b"}]}}
        self.assertEqual(deep_merge(base, override), {"x": {"models": [{"model_id": "b"}]}})

    def test_inputs_are_not_modified(self) -> None:
        base = {"a": {"b": 1}, "models": [{"model_id": "m", "path": "/a", "server_args": {"x": 1}}]}
        override = {"a": {"c": 2}, "models": [{"model_id": "m", "server_args": {"y": 2}}, {"model_id": "n"}]}
        before = json.dumps([base, override], sort_keys=True)
        deep_merge(base, override)
        self.assertEqual(json.dumps([base, override], sort_keys=True), before)

    @given(
        st.dictionaries(
            st.sampled_from(["a", "b", "c"]),
            st.integers()
            | st.dictionaries(
                st.sampled_from(["x", "y"]), st.integers() | st.lists(st.integers(), max_size=2), max_size=2
            ),
            max_size=3,
        )
    )
    def test_merging_nothing_and_merging_twice(self, data: dict) -> None:
        self.assertEqual(deep_merge(data, {}), data)
        self.assertEqual(deep_merge({}, data), data)
        self.assertEqual(deep_merge(deep_merge(data, data), data), deep_merge(data, data))


class LoadConfigTests(ConfigTestCase):
    BASE = (
        "listen_port: 8090\n"
        "llama_server_bin: /path/to/llama-server\n"
        "models:\n"
        "  - model_id: coder\n"
        "    path: /path/to/model-weights/coder.gguf\n"
        "    roles: [code]\n"
        "    ctx_size: 8192\n"
        "  - model_id: chat\n"
        "    path: /path/to/model-weights/chat.gguf\n"
        "    flash_attn: true\n"
    )

    def test_base_alone_fails_on_the_placeholder(self) -> None:
        base = self.write(self.BASE)
        message = str(self.assertRaises(ConfigError, load_config, base, environ={}))
        self.assertEqual(
            message,
            'models[0].path: placeholder value "/path/to/model-weights/coder.gguf" is still in place; '
            "set a real value (e.g. in a --config-override file)",
        )

    def test_override_supplies_real_paths(self) -> None:
        coder = self.write("GGUF")
        chat = self.write("GGUF")
        binary = self.write("#!/bin/sh\n", mode=0o755)
        base = self.write(self.BASE)
        override = self.write(
            f"llama_server_bin: {binary}\n"
            "listen_port: 9001\n"
            "models:\n"
            f"  - model_id: chat\n    path: {chat}\n"
            f"  - model_id: coder\n    path: {coder}\n"
        )
        config = load_config(base, override, environ={})
        self.assertEqual(config.listen_port, 9001)
        self.assertEqual(config.llama_server_bin, binary)
        self.assertEqual([m.model_id for m in config.models], ["coder", "chat"])
        self.assertEqual(config.model("coder").path, coder)
        self.assertEqual(config.model("coder").ctx_size, 8192)
        self.assertEqual(config.model("coder").roles, ("code",))
        self.assertEqual(config.model("chat").path, chat)
        self.assertEqual(config.model("chat").flash_attn, "on")

    def test_override_error_in_merged_entry_names_the_merged_index(self) -> None:
        base = self.write(self.BASE)
        override = self.write(
            "models:\n  - model_id: coder\n    path: /srv/c.gguf\n"
            "  - model_id: chat\n    path: /srv/h.gguf\n    ctx_size: big\n"
            "llama_server_bin: /srv/llama-server\n"
        )
        message = str(
            self.assertRaises(ConfigError, load_config, base, override, check_files=False, environ={})
        )
        self.assertEqual(message, 'models[1].ctx_size: expected a positive integer, got "big"')


# --------------------------------------------------------------------------
# Secrets


class RedactionTests(ConfigTestCase):
    SECRETS = {"api_key": "sk-top", "api_keys": ["sk-one", "sk-two"], "dispatcher_token": "dt-secret"}

    def test_redacted_raw_data(self) -> None:
        raw = dict(self.SECRETS, listen_port=9000, api_key_env="ROLEMESH_KEY")
        self.assertEqual(
            redacted(raw),
            {
                "api_key": "***",
                "api_keys": ["***", "***"],
                "dispatcher_token": "***",
                "listen_port": 9000,
                "api_key_env": "ROLEMESH_KEY",
            },
        )
        self.assertEqual(raw["api_key"], "sk-top", "redacted() must not modify its input")

    def test_redacted_leaves_unset_secrets_alone(self) -> None:
        self.assertEqual(redacted({"api_key": None, "api_keys": []}), {"api_key": None, "api_keys": []})

    def test_as_dict_redacts(self) -> None:
        config = self.valid(
            dict(self.SECRETS, api_key_env="K", models=[model(server_args={"lora": ["a", "b"]})]),
            environ={"K": "sk-env"},
        )
        data = as_dict(config)
        self.assertEqual(data["api_keys"], ["***"] * 4)
        self.assertEqual(data["dispatcher_token"], "***")
        self.assertEqual(data["models"][0]["server_args"], {"lora": ["a", "b"]})
        text = json.dumps(data)
        for secret in ("sk-top", "sk-one", "sk-two", "dt-secret", "sk-env"):
            self.assertNotIn(secret, text)

    def test_as_dict_is_itself_valid_config(self) -> None:
        config = self.valid(dict(
            self.SECRETS,
            idle_unload_s=300,
            cpu_devices=2,
            preload=["a", {"model": "b", "device": "cpu:1"}],
            models=[
                model(model_id="a", path="/m/a.gguf", idle_unload_s=None, tensor_split=[1, 2], flash_attn=True,
                      roles=["chat"], server_args={"lora": ["x", "y"], "parallel": 2, "no-mmap": True}),
                model(model_id="b", path="/m/b.gguf", idle_unload_s=30, preload=True),
                model(model_id="c", path="/m/c.gguf"),
            ],
        ))
        again = validate(as_dict(config), check_files=False, environ={})
        self.assertEqual(attr.evolve(again, api_keys=config.api_keys, dispatcher_token=config.dispatcher_token),
                         config)
        self.assertTrue(again.model("a").keep_loaded)
        self.assertNotIn("keep_loaded", json.dumps(as_dict(config)))

    def test_as_dict_without_secrets(self) -> None:
        data = as_dict(self.valid({}))
        self.assertEqual(data["api_keys"], [])
        self.assertIs(data["dispatcher_token"], None)

    def test_repr_hides_secrets(self) -> None:
        config = self.valid(dict(self.SECRETS))
        for secret in ("sk-top", "sk-one", "dt-secret"):
            self.assertNotIn(secret, repr(config))
        self.assertEqual(config.api_keys, ("sk-top", "sk-one", "sk-two"))
        self.assertEqual(config.dispatcher_token, "dt-secret")


# --------------------------------------------------------------------------
# Robustness: whatever the YAML holds, the answer is a config or one line


scalars = (
    st.none() | st.booleans() | st.integers(-5, 100_000) | st.floats(allow_nan=False) | st.text(max_size=12)
)
yaml_keys = st.text(max_size=8) | st.integers(-2, 2) | st.booleans() | st.none()
values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(yaml_keys, inner, max_size=3),
    max_leaves=8,
)
top_keys = st.sampled_from([k.name for k in TOP_LEVEL_KEYS]) | yaml_keys
model_keys = st.sampled_from([k.name for k in MODEL_KEYS]) | st.text(max_size=8)
model_entries = st.fixed_dictionaries(
    {"model_id": st.text(min_size=1, max_size=6), "path": st.text(min_size=1, max_size=12)},
) | st.dictionaries(model_keys, values, max_size=6)


class RobustnessTests(SynchronousTestCase):
    def check(self, data: dict) -> None:
        try:
            validate(data, check_files=False, environ={})
        except ConfigError as e:
            self.assertNotIn("\n", str(e))
            self.assertNotIn("\r", str(e))

    @given(st.dictionaries(top_keys, values, max_size=5))
    def test_any_top_level_mapping(self, data: dict) -> None:
        self.check(data)

    @given(st.lists(model_entries, max_size=3), st.dictionaries(model_keys, values, max_size=4))
    def test_any_model_entries(self, entries: list, extra: dict) -> None:
        self.check({"models": [dict(e, **extra) if isinstance(e, dict) else e for e in entries]})


class PreloadListTests(SynchronousTestCase):
    """The top-level ``preload`` list: model ids or {model, device} mappings."""

    def config(self, preload):
        return validate({"models": [{"model_id": "a", "path": "/m/a.gguf"}], "preload": preload},
                        check_files=False, environ={})

    def test_ids_and_mappings(self):
        self.assertEqual(self.config(["a", {"model": "a", "device": "gpu:1"}]).preload,
                         (("a", None), ("a", "gpu:1")))

    def test_unknown_model(self):
        with self.assertRaises(ConfigError) as e:
            self.config(["b"])
        self.assertEqual(str(e.exception), 'preload[0]: unknown model_id "b"')

    def test_unknown_key(self):
        with self.assertRaises(ConfigError) as e:
            self.config([{"model": "a", "gpu": 1}])
        self.assertEqual(str(e.exception), "preload[0].gpu: unknown key (expected model and device)")

    def test_not_a_list(self):
        with self.assertRaises(ConfigError) as e:
            self.config("a")
        self.assertIn("preload: expected a list", str(e.exception))


# --------------------------------------------------------------------------
# One declaration per key; pure validation, then the environment step


class DeclarationTests(SynchronousTestCase):
    """Each key's check, default and documentation row come from one
    declaration (``rolemesh.config.file.key``), so they cannot disagree."""

    def test_documented_defaults_render_the_record_defaults(self) -> None:
        for record in (NodeConfig, ModelConfig):
            for field in attr.fields(record):
                doc = plain_key(field)
                if doc is None or field.default in (None, "", (), attr.NOTHING):
                    continue  # "unset", "the host name", "llama-server's"...: said in words
                self.assertTrue(doc.default.startswith(render_default(field.default)), (field.name, doc.default))

    def test_absent_keys_are_the_record_defaults(self) -> None:
        self.assertEqual(parse({}), NodeConfig())
        self.assertEqual(parse({"models": [model()]}).models[0],
                         ModelConfig(model_id="coder", path="/models/coder.gguf"))

    def test_every_top_level_key_is_checked_once(self) -> None:
        """Each documented key names a plain field or a derived one's input, once."""
        plain = {f.name for f in attr.fields(NodeConfig) if plain_key(f) is not None}
        self.assertLessEqual(plain, {k.name for k in TOP_LEVEL_KEYS})
        self.assertIn("cpu_devices", plain)


def refuse(*args: Any, **kwargs: Any) -> Any:
    raise AssertionError("parse() asked the host")


class PureParseTests(SynchronousTestCase):
    """``parse`` does no I/O; ``check_environment`` asks the host."""

    HOSTY = {
        "listen_host": "0.0.0.0",
        "listen": "unix:/run/agent.sock",
        "llama_server_bin": "llama-server",
        "api_key": "k1",
        "api_key_env": "ROLEMESH_KEY",
        "api_key_file": "/etc/rolemesh/keys",
        "state_dir": "~/rm",
        "models": [model()],
    }

    @contextmanager
    def refusing_io(self) -> Iterator[None]:
        """Every host question parse() could ask raises while inside."""
        patched = [(socket, "getfqdn"), (socket, "gethostname"), (shutil, "which"), (os.path, "exists"),
                   (os.path, "isfile"), (os.path, "expanduser"), (os, "access"), (builtins, "open")]
        saved = [getattr(module, name) for module, name in patched]
        for module, name in patched:
            setattr(module, name, refuse)
        try:
            yield
        finally:
            for (module, name), original in zip(patched, saved):
                setattr(module, name, original)

    def test_parse_asks_nothing_of_the_host(self) -> None:
        with self.refusing_io():
            config = parse(self.HOSTY)
        self.assertEqual((config.node_id, config.advertise_url, config.state_dir), ("", "", "~/rm"))
        self.assertEqual((config.llama_server_bin, config.api_keys), ("llama-server", ("k1",)))

    @given(st.dictionaries(st.sampled_from([k.name for k in TOP_LEVEL_KEYS]), values, max_size=5))
    def test_parse_of_anything_asks_nothing(self, data: dict) -> None:
        with self.refusing_io():
            try:
                parse(data)
            except ConfigError:
                pass

    def test_check_environment_fills_in_the_host(self) -> None:
        self.patch(rolemesh.config.file.socket, "getfqdn", lambda: "node.example")
        self.patch(rolemesh.config.file.socket, "gethostname", lambda: "node")
        data = {"listen_host": "0.0.0.0", "api_key": "k1", "api_key_env": "K"}
        config = check_environment(parse(data), data, check_files=False,
                                   environ={"K": "k2", "XDG_STATE_HOME": "/var/state"})
        self.assertEqual(config.node_id, "node")
        self.assertEqual(config.advertise_url, "http://node.example:8090")
        self.assertEqual(config.state_dir, "/var/state/rolemesh-node")
        self.assertEqual(config.api_keys, ("k1", "k2"))

    def test_load_config_runs_both_steps(self) -> None:
        path = self.mktemp()
        with open(path, "w", encoding="utf-8") as f:
            f.write("api_key_env: K\n")
        e = self.assertRaises(ConfigError, load_config, path, environ={})
        self.assertEqual(str(e), "api_key_env: environment variable K is not set or empty")


class LoopbackTests(SynchronousTestCase):
    """One test of "this machine only", for the listener's missing-key warning and the dispatcher's."""

    def test_loopback_hosts(self) -> None:
        for host in ("127.0.0.1", "127.0.0.2", "127.255.255.254", "localhost", "LOCALHOST", "api.localhost",
                     "::1", "[::1]", " 127.0.0.1 "):
            self.assertTrue(is_loopback(host), host)

    def test_other_hosts(self) -> None:
        for host in ("0.0.0.0", "::", "10.0.0.2", "128.0.0.1", "localhost.example", "mylocalhost", "",
                     "node.example", "[::2]", "1.2.3.4.localhost.evil"[:-14]):
            self.assertFalse(is_loopback(host), host)

    def test_the_listener_warning_follows_it(self) -> None:
        for host, exposed in (("127.0.0.2", False), ("0.0.0.0", True), ("::1", False)):
            config = parse({"node_id": "n", "listen_host": host,
                            "models": [{"model_id": "m", "path": "/m.gguf"}]})
            self.assertEqual(config.exposed_without_key, exposed, host)
