"""LoRA adapters served as models of their own, and draft models (issue 28):
the config fields, the child's argv, the per-request ``lora`` field the
agent sets, placement as the base model, ``/v1/models``, the memory
estimate of a draft, and the tiny LoRA fixture."""

from __future__ import annotations

import json
import os
from typing import Any, Dict, List

import attr
import gguf
import yaml
from twisted.trial.unittest import SynchronousTestCase

from rolemesh.base.errors import ConfigError
from rolemesh.children.adapters import adapter_entries, adapter_named, lora_field, with_lora
from rolemesh.children.llama_args import DRAFT_SPEC_TYPE, build_argv
from rolemesh.children.state import READY
from rolemesh.config.file import LoraAdapter, as_dict, validate
from rolemesh.scheduling.estimate import (
    AdapterFacts,
    EstimateError,
    GGUFFacts,
    estimate,
    estimate_on,
    facts_from_header,
    lora_bytes,
    parse_header,
    read_adapter_facts,
)
from tests.api.test_app import CHAT, ApiTestCase
from tests.fixtures import REPO
from tests.fixtures.fakes import make_config
from tests.fixtures.tiny_gguf import LORA_TARGETS, write_tiny_gguf, write_tiny_lora

ADAPTERS = [{"id": "base:formal", "path": "/models/formal.gguf", "scale": 0.5},
            {"id": "base:terse", "path": "/models/terse.gguf"}]
BASE = {"model_id": "base", "path": "/models/base.gguf", "alias": "b0", "roles": ["chat"], "lora_adapters": ADAPTERS}
PLAIN = {"model_id": "plain", "path": "/models/plain.gguf"}


def models(*entries: Dict[str, Any]) -> Any:
    return validate({"models": list(entries)}, check_files=False, environ={}).models


def error(entry: Dict[str, Any], *more: Dict[str, Any]) -> str:
    try:
        models(entry, *more)
    except ConfigError as e:
        return str(e)
    raise AssertionError(f"no ConfigError for {entry}")


class ConfigTests(SynchronousTestCase):
    def test_adapters_and_draft_fields(self) -> None:
        (m,) = models(dict(BASE, draft_model="/models/draft.gguf", draft_max=8, draft_min=2, draft_gpu_layers=0))
        self.assertEqual(m.lora_adapters, (LoraAdapter("base:formal", "/models/formal.gguf", 0.5),
                                           LoraAdapter("base:terse", "/models/terse.gguf", 1.0)))
        self.assertEqual((m.draft_model, m.draft_max, m.draft_min, m.draft_gpu_layers),
                         ("/models/draft.gguf", 8, 2, 0))

    def test_check_output_is_a_config_that_gives_the_same_models(self) -> None:
        data = {"models": [dict(BASE, draft_model="/d.gguf", draft_max=4), PLAIN]}
        config = validate(data, check_files=False, environ={})
        again = validate(as_dict(config), check_files=False, environ={})
        self.assertEqual(again.models, config.models)
        self.assertNotIn("lora_adapters", as_dict(config)["models"][1])

    def test_mistakes_are_one_line_errors_naming_the_key(self) -> None:
        cases = [
            (dict(PLAIN, lora_adapters="a.gguf"),
             'models[0].lora_adapters: expected a list of {id, path, scale} mappings, got "a.gguf"'),
            (dict(PLAIN, lora_adapters=["a.gguf"]),
             'models[0].lora_adapters[0]: expected a mapping with id, path and scale, got "a.gguf"'),
            (dict(PLAIN, lora_adapters=[{"path": "/a.gguf"}]), "models[0].lora_adapters[0].id: required"),
            (dict(PLAIN, lora_adapters=[{"id": "x"}]), "models[0].lora_adapters[0].path: required"),
            (dict(PLAIN, lora_adapters=[{"id": "x", "path": "/a.gguf", "scal": 1}]),
             'models[0].lora_adapters[0].scal: unknown key (did you mean "scale"?)'),
            (dict(PLAIN, lora_adapters=[{"id": "x", "path": "/a.gguf", "scale": True}]),
             "models[0].lora_adapters[0].scale: expected a number, got true"),
            (dict(PLAIN, lora_adapters=[{"id": "x", "path": "/a,b.gguf"}]),
             'models[0].lora_adapters[0].path: "/a,b.gguf" has a comma, and llama-server takes its adapter '
             "paths comma-separated (--lora a,b); rename the file"),
            (dict(PLAIN, lora_adapters=[{"id": "x", "path": "/a.gguf"}, {"id": "x", "path": "/b.gguf"}]),
             'models[0].lora_adapters[1].id: duplicate adapter id "x" (also models[0].lora_adapters[0].id)'),
            (dict(PLAIN, lora_adapters=[{"id": "plain", "path": "/a.gguf"}]),
             'models[0].lora_adapters[0].id: "plain" already names another model (models[0].model_id)'),
            (dict(BASE, server_args={"lora": "/x.gguf"}),
             "models[0].server_args.lora: conflicts with the structured field models[0].lora_adapters; "
             "set it in one place"),
            (dict(PLAIN, draft_max=4), "models[0].draft_max: only used with draft_model (the draft GGUF); set it too"),
            (dict(PLAIN, draft_model="/d.gguf", draft_max=2, draft_min=3),
             "models[0].draft_min: 3 is more than draft_max (2)"),
            (dict(PLAIN, draft_model="/d.gguf", draft_max=0),
             "models[0].draft_max: expected a positive integer, got 0"),
            (dict(PLAIN, draft_model="/d.gguf", draft_gpu_layers="most"),
             'models[0].draft_gpu_layers: expected a non-negative integer, got "most"'),
            (dict(PLAIN, draft_model="/d.gguf", server_args={"--model-draft": "/e.gguf"}),
             "models[0].server_args.model-draft: conflicts with the structured field models[0].draft_model; "
             "set it in one place"),
        ]
        for entry, message in cases:
            self.assertEqual(error(entry), message)

    def test_an_adapter_id_may_not_name_another_model(self) -> None:
        self.assertEqual(error(PLAIN, dict(BASE, lora_adapters=[{"id": "plain", "path": "/a.gguf"}])),
                         'models[1].lora_adapters[0].id: "plain" already names another model (models[0].model_id)')
        self.assertEqual(error(BASE, dict(PLAIN, model_id="base:terse")),
                         'models[1].model_id: "base:terse" already names another model '
                         "(models[0].lora_adapters[1].id)")

    def test_server_args_may_set_lora_and_draft_flags_when_the_fields_are_unset(self) -> None:
        (m,) = models(dict(PLAIN, server_args={"lora": "/x.gguf", "md": "/d.gguf"}))
        self.assertEqual(m.server_args, (("lora", "/x.gguf"), ("md", "/d.gguf")))

    def test_missing_adapter_or_draft_files_are_named(self) -> None:
        tmp = self.mktemp()
        os.makedirs(tmp)
        path = write_tiny_gguf(os.path.join(tmp, "m.gguf"))
        for extra, message in (
                ({"lora_adapters": [{"id": "x", "path": path}, {"id": "y", "path": tmp + "/no.gguf"}]},
                 f'models[0].lora_adapters[1].path: file not found: "{tmp}/no.gguf"'),
                ({"draft_model": tmp}, f'models[0].draft_model: not a regular file: "{tmp}"')):
            data = {"llama_server_bin": "/bin/sh", "models": [dict({"model_id": "m", "path": path}, **extra)]}
            try:
                validate(data, environ={})
            except ConfigError as e:
                self.assertEqual(str(e), message)
            else:
                self.fail(f"no error for {extra}")


class ArgvTests(SynchronousTestCase):
    def argv(self, **entry: Any) -> List[str]:
        (m,) = models(dict(PLAIN, **entry))
        return build_argv("llama-server", m, 9000)

    def test_adapters_are_loaded_not_applied_in_their_order(self) -> None:
        argv = self.argv(lora_adapters=ADAPTERS)
        at = argv.index("--lora")
        self.assertEqual(argv[at:at + 3], ["--lora", "/models/formal.gguf,/models/terse.gguf",
                                           "--lora-init-without-apply"])
        self.assertEqual(argv.count("--lora"), 1)

    def test_draft_fields_and_the_speculation_type(self) -> None:
        argv = self.argv(draft_model="/d.gguf", draft_max=16, draft_min=1, draft_gpu_layers="all")
        at = argv.index("--spec-draft-model")
        self.assertEqual(argv[at:], ["--spec-draft-model", "/d.gguf", "--spec-draft-n-max", "16",
                                     "--spec-draft-n-min", "1", "--spec-draft-ngl", "all",
                                     "--spec-type", DRAFT_SPEC_TYPE])
        only = self.argv(draft_model="/d.gguf")
        self.assertEqual(only[only.index("--spec-draft-model"):],
                         ["--spec-draft-model", "/d.gguf", "--spec-type", DRAFT_SPEC_TYPE])

    def test_server_args_may_choose_other_speculation_types(self) -> None:
        argv = self.argv(draft_model="/d.gguf", server_args={"spec-type": "draft-simple,ngram-mod"})
        self.assertEqual(argv.count("--spec-type"), 1)
        self.assertEqual(argv[argv.index("--spec-type") + 1], "draft-simple,ngram-mod")

    def test_nothing_without_the_fields(self) -> None:
        argv = self.argv()
        for flag in ("--lora", "--lora-init-without-apply", "--spec-draft-model", "--spec-type"):
            self.assertNotIn(flag, argv)


class LoraFieldTests(SynchronousTestCase):
    def setUp(self) -> None:
        (self.base,) = models(BASE)

    def test_the_named_adapter_at_its_scale_the_others_at_zero(self) -> None:
        self.assertEqual(lora_field(self.base, "base:formal"), [{"id": 0, "scale": 0.5}, {"id": 1, "scale": 0.0}])
        self.assertEqual(lora_field(self.base, "base:terse"), [{"id": 0, "scale": 0.0}, {"id": 1, "scale": 1.0}])

    def test_the_bare_base_by_any_name_has_every_adapter_at_zero(self) -> None:
        for name in ("base", "b0", "chat"):
            self.assertEqual(lora_field(self.base, name), [{"id": 0, "scale": 0.0}, {"id": 1, "scale": 0.0}])
        self.assertIsNone(adapter_named(self.base, "base"))
        self.assertEqual(adapter_named(self.base, "base:terse"), self.base.lora_adapters[1])

    def test_the_body_keeps_everything_but_the_clients_lora(self) -> None:
        payload = {"model": "base:terse", "prompt": "x", "lora": [{"id": 0, "scale": 9}], "extra": [1]}
        self.assertEqual(json.loads(with_lora(payload, self.base)),
                         {"model": "base:terse", "prompt": "x", "extra": [1],
                          "lora": [{"id": 0, "scale": 0.0}, {"id": 1, "scale": 1.0}]})
        self.assertEqual(payload["lora"], [{"id": 0, "scale": 9}], "the parsed payload is not changed")


class AdapterEntryTests(SynchronousTestCase):
    def test_the_adapters_of_a_leaving_base_are_leaving_too(self) -> None:
        base = models(BASE)[0]
        entry = {"id": "base", "object": "model", "loaded_on": ["gpu:0"], "memory_estimate": None}
        self.assertEqual([e.get("leaving") for e in adapter_entries({**entry, "leaving": True}, base)],
                         [True, True])
        self.assertNotIn("leaving", adapter_entries(entry, base)[0])


class AdapterApiTests(ApiTestCase):
    top = {"models": [BASE, PLAIN]}

    def sent(self, model: str) -> Dict[str, Any]:
        answer = self.h.chat({"model": model, **CHAT})
        self.assertEqual(answer.code, 200, answer.body)
        return json.loads(self.h.agent.last.body)

    def test_adapters_and_the_base_share_one_child_with_their_own_scales(self) -> None:
        self.loaded("base")
        spawned = list(self.h.reactor.processes)
        self.assertEqual(len(spawned), 1)
        self.assertIn("--lora-init-without-apply", spawned[0].argv)
        seen = {name: self.sent(name) for name in ("base:formal", "base", "base:terse", "b0")}
        self.assertEqual(seen["base:formal"]["lora"], [{"id": 0, "scale": 0.5}, {"id": 1, "scale": 0.0}])
        self.assertEqual(seen["base:terse"]["lora"], [{"id": 0, "scale": 0.0}, {"id": 1, "scale": 1.0}])
        for name in ("base", "b0"):
            self.assertEqual(seen[name]["lora"], [{"id": 0, "scale": 0.0}, {"id": 1, "scale": 0.0}])
        self.assertEqual({name: body["model"] for name, body in seen.items()},
                         {name: name for name in seen}, "the model the client named is what the child sees")
        self.assertEqual(self.h.reactor.processes, spawned, "no switch, no restart")
        self.assertEqual(self.h.node_h.model_on(), "base")

    def test_a_reload_that_changes_a_scale_applies_it_without_a_new_child(self) -> None:
        self.loaded("base")
        spawned = list(self.h.reactor.processes)
        changed = [dict(ADAPTERS[0], scale=0.25), ADAPTERS[1]]
        config = make_config([dict(BASE, lora_adapters=changed), PLAIN])
        self.h.node.reconfigure(config)
        self.h.api.use_config(config)
        self.assertEqual(self.sent("base:formal")["lora"], [{"id": 0, "scale": 0.25}, {"id": 1, "scale": 0.0}])
        self.assertEqual(self.h.reactor.processes, spawned)
        self.assertEqual(self.h.node_h.sup().state, READY)

    def test_a_reload_that_adds_an_adapter_gives_the_base_a_new_child_on_next_use(self) -> None:
        self.loaded("base")
        added = ADAPTERS + [{"id": "base:new", "path": "/models/new.gguf"}]
        config = make_config([dict(BASE, lora_adapters=added), PLAIN])
        self.h.node.reconfigure(config)
        self.h.api.use_config(config)
        pending = self.h.send("POST", "/v1/chat/completions", {"model": "base:new", **CHAT})
        for _ in range(20):  # the old child stops, the new one starts and answers its probe
            self.h.treq.flush()
            for process in self.h.reactor.processes:
                if process.signals and not process.ended:
                    process.exit(0)
            self.h.reactor.advance(0.5)
        self.assertEqual(self.h.finish(pending).code, 200)
        newest = self.h.reactor.processes[-1].argv
        self.assertEqual(len(self.h.reactor.processes), 2)
        self.assertEqual(newest[newest.index("--lora") + 1],
                         "/models/formal.gguf,/models/terse.gguf,/models/new.gguf")
        self.assertEqual(json.loads(self.h.agent.last.body)["lora"],
                         [{"id": 0, "scale": 0.0}, {"id": 1, "scale": 0.0}, {"id": 2, "scale": 1.0}])

    def test_a_cold_adapter_request_loads_its_base(self) -> None:
        h = self.h
        pending = h.send("POST", "/v1/chat/completions", {"model": "base:terse", **CHAT})
        h.treq.flush()
        self.assertEqual(h.node_h.model_on(), "base")
        h.node_h.answer("b0")
        self.assertEqual(h.finish(pending).code, 200)
        self.assertEqual(json.loads(h.agent.last.body)["lora"][1], {"id": 1, "scale": 1.0})

    def test_a_model_without_adapters_gets_the_clients_bytes(self) -> None:
        self.loaded("plain")
        raw = b'{"model":  "plain", "messages": [{"role": "user", "content": "hi"}], "lora": []}'
        answer = self.h.call("POST", "/v1/chat/completions", raw)
        self.assertEqual(answer.code, 200, answer.body)
        self.assertEqual(self.h.agent.last.body, raw)

    def test_models_lists_each_adapter_with_its_base(self) -> None:
        self.loaded("base")
        data = self.h.call("GET", "/v1/models").json()["data"]
        self.assertEqual([m["id"] for m in data], ["base", "base:formal", "base:terse", "plain"])
        by_id = {m["id"]: m for m in data}
        for adapter, scale in (("base:formal", 0.5), ("base:terse", 1.0)):
            entry = by_id[adapter]
            self.assertEqual((entry["base_model"], entry["lora"], entry["loaded_on"], entry["object"]),
                             ("base", {"scale": scale}, ["gpu:0"], "model"))
            self.assertEqual(entry["roles"], [])
            self.assertNotIn("memory_estimate", entry)
        self.assertNotIn("base_model", by_id["base"])

    def test_the_request_log_names_the_base(self) -> None:
        self.loaded("base")
        self.sent("base:formal")
        self.assertEqual([o["model"] for o in self.h.observed if o["event"] == "request"], ["base"])


def tiny_facts(path: str, **kw: Any) -> GGUFFacts:
    with open(write_tiny_gguf(path, **kw), "rb") as f:
        return facts_from_header(*parse_header(f.read()))


class DraftEstimateTests(SynchronousTestCase):
    def setUp(self) -> None:
        tmp = self.mktemp()
        os.makedirs(tmp)
        self.target = tiny_facts(os.path.join(tmp, "t.gguf"), seed=1, n_embd=128, n_layer=4, n_ctx=4096)
        self.draft = tiny_facts(os.path.join(tmp, "d.gguf"), seed=2)

    def model(self, **entry: Any) -> Any:
        return models(dict(PLAIN, ctx_size=2048, draft_model="/d.gguf", **entry))[0]

    def test_the_draft_adds_its_weights_kv_cache_and_compute_sized_as_the_target(self) -> None:
        m = self.model(server_args={"parallel": 2})
        without = estimate(self.target, m, "cpu")
        with_draft = estimate(self.target, m, "cpu", draft=self.draft)
        self.assertEqual(with_draft.total_bytes - without.total_bytes, with_draft.draft_bytes)
        self.assertEqual(with_draft.to_json()["draft_bytes"], with_draft.draft_bytes)
        # The draft's context has the target's 2048 cells (not its own 256): 2 layers x 64 x 2048 x (K+V) f16.
        kv = 2 * 64 * 2048 * 2 * 2
        self.assertGreater(with_draft.draft_bytes, self.draft.weight_bytes + kv)
        self.assertIn("draft model", with_draft.describe())
        self.assertEqual(without.draft_bytes, 0)

    def test_draft_cache_types_and_gpu_layers(self) -> None:
        f16 = estimate(self.target, self.model(), "cpu", draft=self.draft).draft_bytes
        q8 = estimate(self.target, self.model(server_args={"ctkd": "q8_0", "ctvd": "q8_0"}), "cpu",
                      draft=self.draft).draft_bytes
        elements = 2 * 64 * 2048  # of K (and of V): 2 layers x 64 x 2048 cells
        self.assertEqual(f16 - q8, 2 * (elements * 2 - elements * 34 // 32))
        target_q8 = estimate(self.target, self.model(server_args={"ctk": "q8_0"}), "cpu", draft=self.draft)
        self.assertEqual(target_q8.draft_bytes, f16, "the target's cache type is not the draft's")
        on_gpu = estimate(self.target, self.model(), "gpu", draft=self.draft).draft_bytes
        none_on_gpu = estimate(self.target, self.model(draft_gpu_layers=0), "gpu", draft=self.draft).draft_bytes
        # No layer on the GPU: neither the repeating layers and the output head nor their KV cache.
        self.assertEqual(on_gpu - none_on_gpu, self.draft.weight_bytes - self.draft.other_bytes + 2 * elements * 2)

    def test_estimate_on_passes_the_draft(self) -> None:
        m = self.model()
        self.assertEqual(estimate_on(self.target, m, "cpu", 1, 0, self.draft).draft_bytes,
                         estimate(self.target, m, "cpu", draft=self.draft).draft_bytes)


class LoraEstimateTests(SynchronousTestCase):
    """The memory estimate counts a model's LoRA adapters where llama.cpp puts them."""

    def setUp(self) -> None:
        tmp = self.mktemp()
        os.makedirs(tmp)
        self.base_path = write_tiny_gguf(os.path.join(tmp, "base.gguf"), seed=1)
        self.base = facts_from_header(*parse_header(open(self.base_path, "rb").read()))
        self.lora_path = write_tiny_lora(os.path.join(tmp, "l.gguf"), seed=3, rank=4)
        self.reader = gguf.GGUFReader(self.lora_path)
        self.model = models(dict(PLAIN, lora_adapters=[{"id": "plain:l", "path": self.lora_path}]))[0]

    def tensor_bytes(self, prefix: str = "") -> int:
        return sum(int(t.n_bytes) for t in self.reader.tensors if t.name.startswith(prefix))

    def test_an_adapters_facts_are_its_tensor_bytes_by_layer(self) -> None:
        facts = read_adapter_facts(self.lora_path)
        self.assertEqual(facts.total_bytes, self.tensor_bytes())
        self.assertEqual(facts.layer_bytes, (self.tensor_bytes("blk.0."), self.tensor_bytes("blk.1.")))
        self.assertGreater(facts.layer_bytes[1], 0)

    def test_a_model_is_no_adapter_and_an_adapter_no_model(self) -> None:
        with self.assertRaises(EstimateError) as caught:
            read_adapter_facts(self.base_path)
        self.assertIn("not a LoRA adapter", str(caught.exception))
        self.assertNotIn("\n", str(caught.exception))
        with self.assertRaises(EstimateError):
            read_adapter_facts(self.base_path + ".missing")

    def test_on_a_cpu_every_adapter_tensor_counts(self) -> None:
        adapter = read_adapter_facts(self.lora_path)
        without = estimate(self.base, self.model, "cpu")
        with_two = estimate(self.base, self.model, "cpu", adapters=[adapter, adapter])
        self.assertEqual(with_two.lora_bytes, 2 * adapter.total_bytes)
        self.assertEqual(with_two.total_bytes - without.total_bytes, with_two.lora_bytes)
        self.assertEqual(with_two.to_json()["lora_bytes"], with_two.lora_bytes)
        self.assertEqual((without.lora_bytes, without.to_json()["lora_bytes"]), (0, 0))
        self.assertIn("LoRA adapters", with_two.describe())
        self.assertNotIn("LoRA", without.describe())
        self.assertEqual(estimate_on(self.base, self.model, "cpu", 1, 0, None, [adapter]).lora_bytes,
                         adapter.total_bytes)

    def test_on_a_gpu_only_the_offloaded_layers_adapters(self) -> None:
        adapter = AdapterFacts(layer_bytes=(100, 200), output_bytes=30, other_bytes=4000)
        facts = attr.evolve(self.base, n_layer=2)

        def on_gpu(gpu_layers: Any) -> int:
            return lora_bytes([adapter], facts, attr.evolve(self.model, gpu_layers=gpu_layers), "gpu")

        self.assertEqual(on_gpu(None), 330)  # every layer and the head; the embeddings' stay on the host
        self.assertEqual(on_gpu(3), 330)
        self.assertEqual(on_gpu(2), 230)  # the head and the last layer
        self.assertEqual(on_gpu(1), 30)  # the head alone
        self.assertEqual(on_gpu(0), 0)
        self.assertEqual(lora_bytes([adapter], facts, self.model, "cpu"), 4330)


class LoraFixtureTests(SynchronousTestCase):
    def test_an_adapter_of_the_tiny_model(self) -> None:
        tmp = self.mktemp()
        os.makedirs(tmp)
        path = write_tiny_lora(os.path.join(tmp, "l.gguf"), seed=3, rank=2)
        reader = gguf.GGUFReader(path)

        def value(key: str) -> Any:
            return reader.fields[key].contents()

        self.assertEqual((value("general.type"), value("general.architecture"), value("adapter.type")),
                         ("adapter", "llama", "lora"))
        self.assertEqual(value("adapter.lora.alpha"), 8.0)
        shapes = {t.name: tuple(int(n) for n in t.shape) for t in reader.tensors}  # ggml order
        self.assertEqual(len(shapes), 2 * 2 * len(LORA_TARGETS))
        self.assertEqual(shapes["blk.1.ffn_up.weight.lora_a"], (64, 2))
        self.assertEqual(shapes["blk.1.ffn_up.weight.lora_b"], (2, 128))
        with open(path, "rb") as f:
            first = f.read()
        with open(write_tiny_lora(os.path.join(tmp, "again.gguf"), seed=3, rank=2), "rb") as f:
            self.assertEqual(f.read(), first)


class FastChannelAdapterApiTests(AdapterApiTests):
    """The same through the listener's fast channel (the agent's usual path)."""

    fast = True


class DocExampleTests(SynchronousTestCase):
    def test_the_configuration_doc_example_validates_and_gives_these_flags(self) -> None:
        doc = os.path.join(REPO, "docs", "configuration.md")
        with open(doc, encoding="utf-8") as f:
            text = f.read()
        section = text[text.index("## LoRA adapters and draft models"):]
        block = section[section.index("```yaml\n") + 8:section.index("```", section.index("```yaml\n") + 8)]
        (m,) = validate(yaml.safe_load(block), check_files=False, environ={}).models
        argv = build_argv("llama-server", m, 1)
        self.assertEqual(argv[argv.index("--lora"):], [
            "--lora", "/srv/lora/sql.gguf,/srv/lora/formal.gguf", "--lora-init-without-apply",
            "--spec-draft-model", "/srv/weights/qwen2.5-0.5b-instruct-q4_k_m.gguf", "--spec-draft-n-max", "16",
            "--spec-draft-n-min", "1", "--spec-draft-ngl", "all", "--spec-type", "draft-simple"])
        self.assertIn("`--lora sql.gguf,formal.gguf --lora-init-without-apply`", section)
