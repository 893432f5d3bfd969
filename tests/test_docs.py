"""docs/configuration.md agrees with the code.

The key tables must be exactly what ``docs/gen_config_doc.py`` prints from
``TOP_LEVEL_KEYS`` / ``MODEL_KEYS``; the worked examples in the document (the
override merge, the llama-server command line, the error messages) must be
what the code really does.
"""

from __future__ import annotations

import importlib.util
import io
import os
import re
import shlex
from contextlib import redirect_stdout
from types import ModuleType

import attr
import yaml
from twisted.trial.unittest import SynchronousTestCase

from rolemesh.base.errors import ConfigError
from rolemesh.children.llama_args import build_argv
from rolemesh.config.file import MODEL_KEYS, TOP_LEVEL_KEYS, ModelConfig, NodeConfig, deep_merge, validate

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOC = os.path.join(ROOT, "docs", "configuration.md")
GENERATOR = os.path.join(ROOT, "docs", "gen_config_doc.py")

FENCE = re.compile(r"^```(\w*)\n(.*?)^```$", re.MULTILINE | re.DOTALL)


def load_generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gen_config_doc", GENERATOR)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def read_doc() -> str:
    with open(DOC, encoding="utf-8") as f:
        return f.read()


def blocks(text: str) -> list[tuple[str, str]]:
    """Every fenced block as ``(language, body)``, in document order."""
    return [(m.group(1), m.group(2)) for m in FENCE.finditer(text)]


def yaml_block(text: str, first_line: str) -> str:
    matches = [body for lang, body in blocks(text) if lang == "yaml" and body.startswith(first_line)]
    if len(matches) != 1:
        raise AssertionError(f"expected one yaml block starting {first_line!r}, found {len(matches)}")
    return matches[0]


class GeneratedTableTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.generator = load_generator()
        self.doc = read_doc()

    def test_tables_appear_verbatim(self) -> None:
        for title, table in self.generator.tables().items():
            self.assertIn(
                f"## {title}\n\n{table}",
                self.doc,
                f"regenerate the {title!r} table: python docs/gen_config_doc.py",
            )

    def test_one_row_per_key(self) -> None:
        tables = list(self.generator.tables().values())
        for keys, table in zip((TOP_LEVEL_KEYS, MODEL_KEYS), tables):
            rows = table.splitlines()[2:]
            self.assertEqual([row.split(" | ")[0] for row in rows], [f"| `{k.name}`" for k in keys])
            for row in rows:
                # An unescaped "|" would add a column.
                self.assertEqual(len(re.split(r"(?<!\\)\|", row)), 6, row)

    def test_cells_escape_pipes(self) -> None:
        self.assertEqual(self.generator.cell("`on|off`"), "`on\\|off`")

    def test_script_prints_the_tables(self) -> None:
        out = io.StringIO()
        with redirect_stdout(out):
            self.generator.main()
        for table in self.generator.tables().values():
            self.assertIn(table, out.getvalue())


class KeyTableMatchesRecordsTests(SynchronousTestCase):
    """Every documented key is a record field and every field is documented."""

    def test_top_level(self) -> None:
        documented = {k.name for k in TOP_LEVEL_KEYS}
        fields = {f.name for f in attr.fields(NodeConfig)}
        # The four key sources fold into NodeConfig.api_keys (and the mapping entries' tenants);
        # listen_hosts records a listen_host that names several addresses.
        self.assertEqual(documented - {"api_key", "api_key_env", "api_key_file"}, fields - {"tenants", "listen_hosts"})

    def test_models(self) -> None:
        documented = {k.name for k in MODEL_KEYS}
        fields = {f.name for f in attr.fields(ModelConfig)}
        # keep_loaded records "idle_unload_s: null".
        self.assertEqual(documented, fields - {"keep_loaded"})

    def test_no_key_twice(self) -> None:
        for keys in (TOP_LEVEL_KEYS, MODEL_KEYS):
            names = [k.name for k in keys]
            self.assertEqual(len(names), len(set(names)))


class WorkedExampleTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.doc = read_doc()

    def test_override_example(self) -> None:
        base = yaml.safe_load(yaml_block(self.doc, "# node_agent.yaml\n"))
        local = yaml.safe_load(yaml_block(self.doc, "# node_agent.local.yaml\n"))
        merged = yaml.safe_load(yaml_block(self.doc, "# merged\n"))
        self.assertEqual(deep_merge(base, local), merged)
        config = validate(merged, check_files=False, environ={})
        self.assertEqual(config.model("llama-chat").path, "/srv/weights/llama-3.1-8b-instruct-q4_k_m.gguf")
        self.assertEqual(config.model("llama-chat").roles, ("chat",))
        self.assertEqual(config.model("qwen-coder").parallel, 4)
        message = str(self.assertRaises(ConfigError, validate, base, check_files=False, environ={}))
        self.assertIn("placeholder", message)

    def test_argv_example(self) -> None:
        entry = yaml_block(self.doc, "# argv example: port 41001\n")
        after = self.doc.index(entry) + len(entry) + len("```")
        following = [body for lang, body in blocks(self.doc[after:]) if lang == "text"][0]
        model = validate({"models": [yaml.safe_load(entry)]}, check_files=False, environ={}).models[0]
        self.assertEqual(shlex.join(build_argv("llama-server", model, 41001)), following.strip())

    def test_error_examples(self) -> None:
        examples = [
            body for lang, body in blocks(self.doc) if lang == "yaml" and body.startswith("# error: ")
        ]
        self.assertGreaterEqual(len(examples), 5)
        for body in examples:
            expected = body.splitlines()[0][len("# error: ") :]
            e = self.assertRaises(ConfigError, validate, yaml.safe_load(body), check_files=False, environ={})
            self.assertEqual(str(e), expected)

    def test_small_complete_file_is_valid(self) -> None:
        first = [body for lang, body in blocks(self.doc) if lang == "yaml"][0]
        config = validate(yaml.safe_load(first), check_files=False, environ={})
        self.assertEqual(config.models[0].flash_attn, "on")

    def test_null_claims(self) -> None:
        """The document's list of keys that accept ``null`` as "the default"."""
        accepting = [
            "node_id",
            "listen_host",
            "advertise_url",
            "devices",
            "cpu_devices",
            "llama_server_bin",
            "state_dir",
            "models",
            "dispatcher_base_url",
            "api_key",
            "api_keys",
            "api_key_env",
            "api_key_file",
            "dispatcher_token",
            "idle_unload_s",
            "preload",
            "listen",
            "tls_cert_file",
            "tls_key_file",
            "tls_client_ca_file",
            "dispatcher_ca_file",
            "dispatcher_client_cert_file",
            "dispatcher_client_key_file",
            "models_dir",
            "default_model",
        ]
        for key in accepting:
            validate({key: None}, check_files=False, environ={})
        for key in {k.name for k in TOP_LEVEL_KEYS} - set(accepting):
            self.assertRaises(ConfigError, validate, {key: None}, check_files=False, environ={})


# -- the documents' shape and their links -------------------------------------------------------

DOCS = os.path.join(ROOT, "docs")
OPERATIONS_PAGES = os.path.join(DOCS, "operations")
#: Every markdown file whose relative links must resolve: the docs (with the task pages), the
#: README and the benchmarks' README.
LINK_CHECKED = [os.path.join(ROOT, "README.md"), os.path.join(ROOT, "bench", "README.md")] + sorted(
    os.path.join(folder, name) for folder, _, names in os.walk(DOCS) for name in names if name.endswith(".md")
)
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
CODE = re.compile(r"^```.*?^```$|`[^`\n]*`", re.MULTILINE | re.DOTALL)


def read(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces as hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(path: str) -> set:
    found: set = set()
    seen: dict = {}
    text = re.sub(r"^```.*?^```$", "", read(path), flags=re.MULTILINE | re.DOTALL)
    for match in re.finditer(r"^#{1,6} (.+)$", text, re.MULTILINE):
        base = slug(match.group(1))
        n = seen.get(base, 0)
        seen[base] = n + 1
        found.add(base if n == 0 else f"{base}-{n}")
    return found


def links(path: str) -> list:
    """The relative link targets in a markdown file, outside code."""
    text = CODE.sub("", read(path))
    return [t for t in LINK.findall(text) if not re.match(r"[a-z][a-z0-9+.-]*:", t)]


class DocumentShapeTests(SynchronousTestCase):
    """Issue 40: performance.md states today's figures; operations are short pages by task."""

    def test_performance_is_today_s_figures(self) -> None:
        text = read(os.path.join(DOCS, "performance.md"))
        self.assertLessEqual(len(text.splitlines()), 300, "docs/performance.md: today's figures, no history")
        for script in re.findall(r"`python (bench/\w+\.py)", text):
            self.assertTrue(os.path.exists(os.path.join(ROOT, script)), script)

    def test_every_operations_page_is_linked_from_the_index(self) -> None:
        pages = sorted(name for name in os.listdir(OPERATIONS_PAGES) if name.endswith(".md"))
        self.assertGreaterEqual(len(pages), 8)
        for name in ("install.md", "systemd.md", "kubernetes.md", "upgrade.md", "metrics.md", "troubleshoot.md"):
            self.assertIn(name, pages)
        index = {os.path.normpath(t.split("#")[0]) for t in links(os.path.join(DOCS, "index.md"))}
        operations = {os.path.normpath(t.split("#")[0]) for t in links(os.path.join(DOCS, "operations.md"))}
        for name in pages:
            self.assertIn(os.path.join("operations", name), index, f"docs/index.md does not link operations/{name}")
            self.assertIn(os.path.join("operations", name), operations, f"docs/operations.md does not link {name}")

    def test_task_pages_are_short(self) -> None:
        for name in os.listdir(OPERATIONS_PAGES):
            lines = len(read(os.path.join(OPERATIONS_PAGES, name)).splitlines())
            self.assertLessEqual(lines, 250, f"docs/operations/{name}: {lines} lines")


class LinkTests(SynchronousTestCase):
    """Every relative link in the docs, the README and bench/README.md names a file that exists,
    and its #anchor a heading of that file."""

    def test_the_checker_sees_the_pages(self) -> None:
        self.assertIn(os.path.join(OPERATIONS_PAGES, "metrics.md"), LINK_CHECKED)
        self.assertEqual(slug("Relay capacity (`bench/capacity.py`)"), "relay-capacity-benchcapacitypy")
        self.assertEqual(slug("Back-off: a model that keeps failing on a device"),
                         "back-off-a-model-that-keeps-failing-on-a-device")
        self.assertIn("operations/metrics.md", links(os.path.join(DOCS, "index.md")))

    def test_links_resolve(self) -> None:
        broken = []
        for path in LINK_CHECKED:
            for target in links(path):
                file_part, _, anchor = target.partition("#")
                where = os.path.normpath(os.path.join(os.path.dirname(path), file_part)) if file_part else path
                name = os.path.relpath(path, ROOT)
                if not os.path.exists(where):
                    broken.append(f"{name}: {target} (no such file)")
                elif anchor and where.endswith(".md") and anchor not in anchors(where):
                    broken.append(f"{name}: {target} (no such heading)")
        self.assertEqual(broken, [])
