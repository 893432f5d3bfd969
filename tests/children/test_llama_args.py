"""llama-server argument vectors: worked examples and Hypothesis properties.

Model entries are always built through :func:`rolemesh.config.file.validate` (with
``check_files=False``), so the properties exercise the same path the agent uses.
"""

from __future__ import annotations

from typing import Any

from hypothesis import given
from hypothesis import strategies as st
from twisted.trial.unittest import SynchronousTestCase

from rolemesh.base.errors import ConfigError
from rolemesh.children.llama_args import build_argv, flags_set_by, server_args, structured_args
from rolemesh.config.file import FORBIDDEN_FLAGS, STRUCTURED_FLAGS, ModelConfig, validate

BIN = "/opt/llama/bin/llama-server"
PATH = "/srv/weights/coder.gguf"


def entry(**fields: Any) -> dict:
    raw: dict = {"model_id": "coder", "path": PATH}
    raw.update(fields)
    return raw


def make(**fields: Any) -> ModelConfig:
    return validate({"models": [entry(**fields)]}, check_files=False, environ={}).models[0]


def tail(**fields: Any) -> list:
    """The argv after the agent's own ``binary --model P --host H --port N --metrics``
    (and its ``--parallel 1``, checked here, where the model does not set it)."""
    model = make(**fields)
    argv = build_argv(BIN, model, 8081)
    if not {"parallel", "np"} & flags_set_by(model):
        assert argv[8:10] == ["--parallel", "1"], argv
        return argv[10:]
    return argv[8:]


def spellings(flag_names: Any) -> set:
    """Every way a flag can appear in an argv: ``-ngl``, ``--ngl``, ``--n-gpu-layers`` ..."""
    return {prefix + name for name in flag_names for prefix in ("-", "--")}


class ExampleTests(SynchronousTestCase):
    def test_minimal_model(self) -> None:
        self.assertEqual(
            build_argv(BIN, make(), 8081),
            [BIN, "--model", PATH, "--host", "127.0.0.1", "--port", "8081", "--metrics", "--parallel", "1",
             "--alias", "coder"],
        )

    def test_slots_are_always_given(self) -> None:
        """Without ``--parallel`` this llama-server makes 4 slots while the
        agent admits one request at a time (issue 26): the child is always
        told, once, in the spelling the model used or as ``--parallel 1``."""
        for args, expected in (
            ({}, ["--parallel", "1"]),
            ({"parallel": None}, ["--parallel", "1"]),
            ({"parallel": False}, ["--parallel", "1"]),
            ({"parallel": 4}, ["--parallel", "4"]),
            ({"np": 3}, ["-np", "3"]),
        ):
            model = make(server_args=args)
            argv = build_argv(BIN, model, 8081)
            given = [(a, b) for a, b in zip(argv, argv[1:]) if a in ("--parallel", "-np", "--np")]
            self.assertEqual(given, [tuple(expected)], args)
            self.assertEqual(int(expected[1]), model.parallel)

    def test_agent_flags_come_first(self) -> None:
        argv = build_argv("llama-server", make(ctx_size=4096), 40123, host="127.0.0.2")
        self.assertEqual(
            argv[:7], ["llama-server", "--model", PATH, "--host", "127.0.0.2", "--port", "40123"]
        )

    def test_no_alias_means_model_id(self) -> None:
        """Responses name the model as the client asked for it, never the file path."""
        self.assertEqual(tail(), ["--alias", "coder"])

    def test_alias(self) -> None:
        self.assertEqual(tail(alias="qwen-coder"), ["--alias", "qwen-coder"])

    def test_flash_attn_true_is_on(self) -> None:
        self.assertEqual(tail(flash_attn=True), ["--alias", "coder", "--flash-attn", "on"])
        self.assertEqual(tail(flash_attn=False), ["--alias", "coder", "--flash-attn", "off"])
        self.assertEqual(tail(flash_attn="auto"), ["--alias", "coder", "--flash-attn", "auto"])

    def test_tensor_split_is_comma_joined(self) -> None:
        self.assertEqual(tail(tensor_split=[0.6, 0.4]), ["--alias", "coder", "--tensor-split", "0.6,0.4"])
        self.assertEqual(tail(tensor_split=[3.0, 1]), ["--alias", "coder", "--tensor-split", "3,1"])

    def test_gpu_layers(self) -> None:
        self.assertEqual(tail(gpu_layers="all"), ["--alias", "coder", "--n-gpu-layers", "all"])
        self.assertEqual(tail(gpu_layers="auto"), ["--alias", "coder", "--n-gpu-layers", "auto"])
        self.assertEqual(tail(gpu_layers=0), ["--alias", "coder", "--n-gpu-layers", "0"])

    def test_every_structured_field(self) -> None:
        self.assertEqual(
            tail(
                ctx_size=8192,
                batch_size=2048,
                ubatch_size=512,
                threads=8,
                threads_batch=16,
                gpu_layers=99,
                main_gpu=1,
                tensor_split=[1, 1],
                flash_attn="on",
                alias="c",
            ),
            [
                "--alias",
                "c",
                "--ctx-size",
                "8192",
                "--batch-size",
                "2048",
                "--ubatch-size",
                "512",
                "--threads",
                "8",
                "--threads-batch",
                "16",
                "--n-gpu-layers",
                "99",
                "--main-gpu",
                "1",
                "--tensor-split",
                "1,1",
                "--flash-attn",
                "on",
            ],
        )

    def test_server_args_value(self) -> None:
        self.assertEqual(tail(server_args={"parallel": 1}), ["--alias", "coder", "--parallel", "1"])

    def test_server_args_true_is_a_bare_flag(self) -> None:
        self.assertEqual(tail(server_args={"jinja": True}), ["--alias", "coder", "--jinja"])

    def test_server_args_false_and_null_are_omitted(self) -> None:
        self.assertEqual(tail(server_args={"jinja": False, "mlock": None}), ["--alias", "coder"])

    def test_underscore_and_dash_are_equivalent(self) -> None:
        expected = ["--alias", "coder", "--no-mmap", "--cache-type-k", "q8_0"]
        for args in (
            {"no_mmap": True, "cache_type_k": "q8_0"},
            {"no-mmap": True, "cache-type-k": "q8_0"},
            {"--no-mmap": True, "--cache_type_k": "q8_0"},
        ):
            self.assertEqual(tail(server_args=args), expected, args)

    def test_short_flags_take_one_dash(self) -> None:
        self.assertEqual(
            tail(server_args={"np": 4, "ngl": 20, "c": 2048, "--fa": "on", "cb": True}),
            ["--alias", "coder", "-np", "4", "-ngl", "20", "-c", "2048", "-fa", "on", "-cb"],
        )

    def test_long_only_three_letter_flag(self) -> None:
        """llama-server knows ``--rpc`` but not ``-rpc``."""
        self.assertEqual(
            tail(server_args={"rpc": "10.0.0.2:50052"}), ["--alias", "coder", "--rpc", "10.0.0.2:50052"]
        )

    def test_lists_repeat_the_flag(self) -> None:
        self.assertEqual(
            tail(server_args={"lora": ["a.gguf", "b.gguf"]}),
            ["--alias", "coder", "--lora", "a.gguf", "--lora", "b.gguf"],
        )

    def test_lists_llama_server_takes_joined(self) -> None:
        self.assertEqual(
            tail(server_args={"device": ["CUDA0", "CUDA1"], "ts": [3, 1]}),
            ["--alias", "coder", "--device", "CUDA0,CUDA1", "-ts", "3,1"],
        )

    def test_numbers(self) -> None:
        self.assertEqual(
            tail(server_args={"temp": 0.7, "n_predict": -1, "rope-freq-scale": 2.0}),
            ["--alias", "coder", "--temp", "0.7", "--n-predict", "-1", "--rope-freq-scale", "2"],
        )

    def test_structured_fields_then_server_args_in_config_order(self) -> None:
        self.assertEqual(
            tail(server_args={"seed": 1, "jinja": True, "parallel": 2}, ctx_size=4096),
            ["--alias", "coder", "--ctx-size", "4096", "--seed", "1", "--jinja", "--parallel", "2"],
        )

    def test_argv_is_strings(self) -> None:
        argv = build_argv(
            BIN, make(ctx_size=1, tensor_split=[0.5], server_args={"n": [1, 2.5], "x": True}), 1
        )
        self.assertTrue(all(isinstance(a, str) for a in argv), argv)


class DeviceDefaultTests(SynchronousTestCase):
    DEFAULTS = {"threads": 8, "cpu-range": "0-7"}

    def argv(self, **fields: Any) -> list:
        return build_argv(BIN, make(**fields), 8081, device_defaults=self.DEFAULTS)[10:]

    def test_defaults_apply_when_the_model_is_silent(self) -> None:
        self.assertEqual(self.argv(), ["--alias", "coder", "--threads", "8", "--cpu-range", "0-7"])

    def test_structured_field_wins(self) -> None:
        self.assertEqual(self.argv(threads=2), ["--alias", "coder", "--threads", "2", "--cpu-range", "0-7"])

    def test_server_args_win_in_any_spelling(self) -> None:
        for key in ("threads", "--threads", "t", "-t"):
            self.assertEqual(
                self.argv(server_args={key: 3}),
                [
                    "--alias",
                    "coder",
                    "-t" if key.lstrip("-") == "t" else "--threads",
                    "3",
                    "--cpu-range",
                    "0-7",
                ],
                key,
            )
        self.assertEqual(
            self.argv(server_args={"cpu_range": "8-15"}),
            ["--alias", "coder", "--cpu-range", "8-15", "--threads", "8"],
        )

    def test_server_args_false_lets_the_default_through(self) -> None:
        self.assertEqual(
            self.argv(server_args={"threads": False}),
            ["--alias", "coder", "--threads", "8", "--cpu-range", "0-7"],
        )

    def test_default_spelled_short_still_yields_to_the_model(self) -> None:
        argv = build_argv(BIN, make(threads=2), 1, device_defaults={"t": 8, "cpu_mask": "ff"})[10:]
        self.assertEqual(argv, ["--alias", "coder", "--threads", "2", "--cpu-mask", "ff"])

    def test_a_default_named_twice_appears_once(self) -> None:
        argv = build_argv(BIN, make(), 1, device_defaults={"threads": 8, "t": 4, "cpu_range": None})[10:]
        self.assertEqual(argv, ["--alias", "coder", "--threads", "8"])

    def test_device_defaults_never_add_a_second_alias(self) -> None:
        argv = build_argv(BIN, make(), 1, device_defaults={"alias": "x", "a": "y"})
        self.assertEqual(argv.count("--alias"), 1)

    def test_flags_set_by(self) -> None:
        flags = flags_set_by(make(ctx_size=1, server_args={"t": 2, "jinja": False, "mlock": True}))
        self.assertTrue({"ctx-size", "c", "t", "mlock", "alias", "a"} <= flags, flags)
        self.assertNotIn("jinja", flags)
        self.assertNotIn("threads-batch", flags)


class PieceTests(SynchronousTestCase):
    def test_structured_args(self) -> None:
        self.assertEqual(structured_args(make(main_gpu=0)), ["--alias", "coder", "--main-gpu", "0"])

    def test_server_args_pairs(self) -> None:
        self.assertEqual(
            server_args(
                [("parallel", 2), ("jinja", True), ("mlock", False), ("x", None), ("lora", ("a", "b"))]
            ),
            ["--parallel", "2", "--jinja", "--lora", "a", "--lora", "b"],
        )


# --------------------------------------------------------------------------
# Properties

#: Flags that are not structured, forbidden, or another spelling of one another.
EXTRA_FLAGS = (
    "cont-batching",
    "no-mmap",
    "mlock",
    "jinja",
    "cache-type-k",
    "cache-type-v",
    "seed",
    "temp",
    "n-predict",
    "lora",
    "cpu-range",
    "rpc",
    "device",
    "override-tensor",
    "keep",
    "metrics",
    "slots",
    "defrag-thold",
    "split-mode",
    "ctx-checkpoints",
    "reasoning-format",
    "chat-template",
)

safe_text = st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789._:/,", min_size=1, max_size=10)
scalar_values = st.integers(-10, 100_000) | st.floats(0, 1e6, allow_nan=False) | safe_text
server_values = st.none() | st.booleans() | scalar_values | st.lists(scalar_values, min_size=1, max_size=3)

STRUCTURED_VALUES = {
    "ctx_size": st.integers(1, 1 << 20),
    "batch_size": st.integers(1, 8192),
    "ubatch_size": st.integers(1, 8192),
    "threads": st.integers(1, 256),
    "threads_batch": st.integers(1, 256),
    "gpu_layers": st.integers(0, 200) | st.sampled_from(["auto", "all"]),
    "main_gpu": st.integers(0, 7),
    "tensor_split": st.lists(
        st.floats(0, 100, allow_nan=False) | st.integers(0, 100), min_size=1, max_size=4
    ),
    "flash_attn": st.sampled_from([True, False, "on", "off", "auto"]),
    "alias": st.from_regex(r"[a-z][a-z0-9._-]{0,11}", fullmatch=True),
    "mmproj": st.just("/srv/weights/mmproj-f16.gguf"),
}


def spell(name: str, draw: Any) -> str:
    """One of the ways a user may write a flag name as a server_args key."""
    prefix = draw(st.sampled_from(["", "-", "--"]))
    return prefix + (name.replace("-", "_") if draw(st.booleans()) else name)


@st.composite
def raw_models(draw: Any) -> dict:
    """A raw ``models[]`` entry that validates: structured fields, and server_args that do not clash."""
    raw: dict = {
        "model_id": draw(st.from_regex(r"[a-z][a-z0-9._-]{0,11}", fullmatch=True)),
        "path": "/srv/weights/" + draw(safe_text) + ".gguf",
    }
    chosen = draw(st.sets(st.sampled_from(sorted(STRUCTURED_VALUES))))
    for field in chosen:
        raw[field] = draw(STRUCTURED_VALUES[field])
    args: dict = {}
    for name in draw(st.sets(st.sampled_from(EXTRA_FLAGS), max_size=5)):
        args[spell(name, draw)] = draw(server_values)
    # A structured flag the structured fields leave unset may go in server_args (one spelling).
    unset = sorted(set(STRUCTURED_FLAGS) - chosen - {"alias"})
    for field in draw(st.sets(st.sampled_from(unset), max_size=2)) if unset else ():
        name = draw(st.sampled_from(STRUCTURED_FLAGS[field]))
        args[spell(name, draw)] = draw(st.none() | st.just(True) | scalar_values)
    if draw(st.booleans()):
        args[spell(draw(st.sampled_from(["parallel", "np"])), draw)] = draw(st.none() | st.integers(1, 16))
    if args:
        raw["server_args"] = args
    return raw


def validated(raw: dict) -> ModelConfig:
    return validate({"models": [raw]}, check_files=False, environ={}).models[0]


binaries = st.sampled_from([BIN, "llama-server", "/usr/local/bin/llama-server"])
ports = st.integers(1, 65535)
device_defaults = st.dictionaries(
    st.sampled_from(["threads", "t", "cpu-range", "cpu_mask", "threads-batch", "ngl"]),
    st.integers(1, 64) | safe_text,
    max_size=3,
)


class PropertyTests(SynchronousTestCase):
    @given(raw_models(), binaries, ports, device_defaults)
    def test_every_set_structured_field_appears_exactly_once(
        self, raw: dict, binary: str, port: int, defaults: dict
    ) -> None:
        model = validated(raw)
        argv = build_argv(binary, model, port, device_defaults=defaults)
        own = structured_args(model)
        for field, names in STRUCTURED_FLAGS.items():
            count = sum(1 for token in argv if token in spellings(names))
            if field == "alias" or getattr(model, field) is not None:
                self.assertEqual(count, 1, (field, argv))
                flag = "--" + names[0]
                self.assertEqual(argv[argv.index(flag) + 1], own[own.index(flag) + 1])
            else:
                # Unset as a field: present once if server_args or a device default set it, else absent.
                in_args = any(f in names and v is not None and v is not False for f, v in model.server_args)
                in_defaults = any(k.lstrip("-").replace("_", "-") in names for k in defaults)
                self.assertEqual(count, 1 if in_args or in_defaults else 0, (field, argv))
        self.assertEqual(argv[argv.index("--alias") + 1], raw.get("alias", raw["model_id"]))

    @given(raw_models(), binaries, ports, device_defaults)
    def test_the_slot_count_is_given_once_and_is_the_models(
        self, raw: dict, binary: str, port: int, defaults: dict
    ) -> None:
        model = validated(raw)
        argv = build_argv(binary, model, port, device_defaults=defaults)
        at = [i for i, token in enumerate(argv) if token in spellings(["parallel", "np"])]
        self.assertEqual(len(at), 1, argv)
        self.assertEqual(int(argv[at[0] + 1]), model.parallel)

    @given(raw_models(), binaries, ports, st.sampled_from(["127.0.0.1", "::1"]), device_defaults)
    def test_no_forbidden_flag_but_the_agents_own(
        self, raw: dict, binary: str, port: int, host: str, defaults: dict
    ) -> None:
        argv = build_argv(binary, validated(raw), port, host=host, device_defaults=defaults)
        self.assertEqual(argv[1:7], ["--model", raw["path"], "--host", host, "--port", str(port)])
        for own in ("--model", "--host", "--port"):
            self.assertEqual(argv.count(own), 1, argv)
        for flag in FORBIDDEN_FLAGS:
            self.assertNotIn("-" + flag, argv)
            if flag == "m":
                self.assertNotIn("--m", argv)

    @given(raw_models(), binaries, ports, device_defaults)
    def test_deterministic(self, raw: dict, binary: str, port: int, defaults: dict) -> None:
        first = build_argv(binary, validated(raw), port, device_defaults=defaults)
        second = build_argv(binary, validated(dict(raw)), port, device_defaults=dict(defaults))
        self.assertEqual(first, second)
        self.assertTrue(all(isinstance(token, str) for token in first), first)

    @given(raw_models(), binaries, ports)
    def test_argv0_is_the_binary(self, raw: dict, binary: str, port: int) -> None:
        self.assertEqual(build_argv(binary, validated(raw), port)[0], binary)

    @given(
        raw_models(),
        st.sampled_from(sorted(FORBIDDEN_FLAGS)),
        st.sampled_from(["", "-", "--"]),
        server_values,
    )
    def test_forbidden_server_args_are_config_errors(
        self, raw: dict, flag: str, prefix: str, value: Any
    ) -> None:
        raw = dict(raw, server_args=dict(raw.get("server_args", {}), **{prefix + flag: value}))
        message = str(self.assertRaises(ConfigError, validated, raw))
        self.assertEqual(
            message,
            f"models[0].server_args.{prefix}{flag}: the agent sets --{flag} itself (children always bind "
            "127.0.0.1 on a port the agent picks, and load the model's path); remove it",
        )

    @given(raw_models(), st.sampled_from(sorted(STRUCTURED_FLAGS)), st.data())
    def test_structured_and_server_args_conflict(self, raw: dict, field: str, data: Any) -> None:
        raw = dict(raw, **{field: data.draw(STRUCTURED_VALUES[field])})
        args = {
            k: v
            for k, v in raw.get("server_args", {}).items()
            if k.lstrip("-").replace("_", "-") not in STRUCTURED_FLAGS[field]
        }
        key = spell(data.draw(st.sampled_from(STRUCTURED_FLAGS[field])), data.draw)
        args[key] = data.draw(server_values)
        raw["server_args"] = args
        message = str(self.assertRaises(ConfigError, validated, raw))
        self.assertIn(f"models[0].server_args.{key}: ", message)
        self.assertNotIn("\n", message)


class ChatTemplateArgsTests(SynchronousTestCase):
    """``chat_template`` (issue 28, item 7): a built-in name with jinja off
    (with jinja on this llama-server takes the name as the template itself),
    a file with ``--chat-template-file``; set in one place only."""

    def argv(self, **fields: Any) -> list:
        return build_argv(BIN, validated({"model_id": "g", "path": "/w/g.gguf", **fields}), 1)

    def test_a_built_in_name_turns_jinja_off(self) -> None:
        argv = self.argv(chat_template="gemma")
        self.assertEqual(argv[-3:], ["--no-jinja", "--chat-template", "gemma"])

    def test_a_file_is_a_template_file(self) -> None:
        argv = self.argv(chat_template="/etc/rolemesh/gemma.jinja")
        self.assertEqual(argv[-2:], ["--chat-template-file", "/etc/rolemesh/gemma.jinja"])
        self.assertNotIn("--no-jinja", argv)

    def test_unset_adds_nothing(self) -> None:
        self.assertFalse({"--chat-template", "--chat-template-file", "--no-jinja"} & set(self.argv()))

    def test_an_unknown_name_is_one_line_with_a_hint(self) -> None:
        e = self.assertRaises(ConfigError, self.argv, chat_template="gema")
        self.assertIn('models[0].chat_template: expected a built-in template name or a template file path, '
                      'got "gema" (did you mean "gemma"?)', str(e))

    def test_the_field_and_server_args_conflict(self) -> None:
        e = self.assertRaises(ConfigError, self.argv, chat_template="gemma",
                              server_args={"chat-template-file": "/x.jinja"})
        self.assertEqual(str(e), "models[0].server_args.chat-template-file: conflicts with the structured field "
                                 "models[0].chat_template; set it in one place")

    def test_mmproj_is_passed(self) -> None:
        argv = self.argv(mmproj="/w/mmproj-g.gguf")
        self.assertEqual(argv[argv.index("--mmproj") + 1], "/w/mmproj-g.gguf")
