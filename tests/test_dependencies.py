"""The agent's install dependencies earn their place (issue 30, item 6).

``gguf`` (and numpy with it) is a test dependency only: the memory
estimate reads GGUF headers itself and keeps ggml's block sizes in
:data:`rolemesh.scheduling.estimate.GGML_BLOCK_SIZES`, checked here against the
``gguf`` package's own table.  Nothing in ``rolemesh/`` imports either, not
even lazily inside a function, and a process that imports every module and
reads a GGUF's header does not load them.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys

import gguf
from twisted.trial.unittest import SynchronousTestCase

from rolemesh.scheduling.estimate import GGML_BLOCK_SIZES
from tests.fixtures.tiny_gguf import write_tiny_gguf

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(ROOT, "rolemesh")
#: What the agent must run without (the test extra installs them).
TEST_ONLY = ("gguf", "numpy")


def rolemesh_sources():
    for folder, _, names in os.walk(PACKAGE):
        for name in sorted(names):
            if name.endswith(".py"):
                yield os.path.join(folder, name)


def imported_roots(path: str):
    """The top-level package of every import in ``path`` (at any depth)."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name.split(".")[0], node.lineno
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.module.split(".")[0], node.lineno


class BlockSizeTableTests(SynchronousTestCase):
    def test_every_ggml_type_gguf_knows_has_its_block_size(self) -> None:
        for qtype, sizes in gguf.GGML_QUANT_SIZES.items():
            self.assertIn(int(qtype), GGML_BLOCK_SIZES,
                          f"ggml type {qtype.name} ({int(qtype)}) is missing from "
                          "rolemesh.scheduling.estimate.GGML_BLOCK_SIZES")
            self.assertEqual(GGML_BLOCK_SIZES[int(qtype)], tuple(sizes), qtype.name)

    def test_every_type_of_the_table_is_ggml_s(self) -> None:
        known = {int(t) for t in gguf.GGML_QUANT_SIZES}
        self.assertEqual(set(GGML_BLOCK_SIZES) - known, set(), "types gguf does not know")


class NoTestOnlyImportsTests(SynchronousTestCase):
    def test_no_module_of_rolemesh_imports_gguf_or_numpy(self) -> None:
        found = [(os.path.relpath(path, ROOT), line, name) for path in rolemesh_sources()
                 for name, line in imported_roots(path) if name in TEST_ONLY]
        self.assertEqual(found, [])

    def test_the_scan_sees_an_import_inside_a_function(self) -> None:
        path = self.mktemp() + ".py"
        with open(path, "w", encoding="utf-8") as f:
            f.write("def f():\n    import gguf\n    from numpy import array\n")
        self.assertEqual(list(imported_roots(path)), [("gguf", 2), ("numpy", 3)])

    def test_a_process_that_imports_everything_and_reads_a_header_loads_neither(self) -> None:
        model = os.path.abspath(self.mktemp() + ".gguf")
        write_tiny_gguf(model, seed=1, name="tiny")
        modules = sorted(
            "rolemesh." + os.path.relpath(path, PACKAGE)[:-3].replace(os.sep, ".").replace(".__init__", "")
            for path in rolemesh_sources())
        script = (
            "import importlib, sys\n"
            f"for name in {modules!r}:\n"
            "    importlib.import_module(name)\n"
            "from rolemesh.config.file import ModelConfig\n"
            "from rolemesh.scheduling.estimate import estimate, read_facts\n"
            f"facts = read_facts({model!r})\n"
            f"assert estimate(facts, ModelConfig(model_id='tiny', path={model!r})).weights_bytes > 0\n"
            f"print(sorted(m for m in sys.modules if m.split('.')[0] in {TEST_ONLY!r}))\n"
        )
        result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                                env={**os.environ, "PYTHONPATH": ROOT}, cwd=ROOT)
        self.assertEqual(result.returncode, 0, result.stderr[-3000:])
        self.assertEqual(result.stdout.strip(), "[]")
