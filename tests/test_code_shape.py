"""The codebase's shape (issue 40): no function under rolemesh/ over 60
lines, no class over 350, counted from the ``def``/``class`` line to the
last (docstrings and comments count).  A part that grows past the bar is
cut into parts a reader can name, not explained away."""

from __future__ import annotations

import ast
import os
from typing import Iterator, Tuple

from twisted.trial.unittest import SynchronousTestCase

from tests.fixtures import REPO

PACKAGE = os.path.join(REPO, "rolemesh")
CLASS_BAR = 350
FUNCTION_BAR = 60


def definitions(package: str = PACKAGE) -> Iterator[Tuple[str, str, str, int]]:
    """(file under the package, ``class`` or ``def``, name, lines) of every
    class and function, nested ones included."""
    for folder, dirs, files in os.walk(package):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        for name in sorted(files):
            if not name.endswith(".py"):
                continue
            path = os.path.join(folder, name)
            with open(path, encoding="utf-8") as f:
                tree = ast.parse(f.read(), path)
            for node in ast.walk(tree):
                if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                    kind = "class" if isinstance(node, ast.ClassDef) else "def"
                    size = (node.end_lineno or node.lineno) - node.lineno + 1
                    yield os.path.relpath(path, package), kind, node.name, size


class SizeTests(SynchronousTestCase):
    def test_no_class_over_the_bar(self) -> None:
        over = [f"{path}: {name} ({size} lines)" for path, kind, name, size in definitions()
                if kind == "class" and size > CLASS_BAR]
        self.assertEqual(over, [], f"classes over {CLASS_BAR} lines")

    def test_no_function_over_the_bar(self) -> None:
        over = [f"{path}: {name} ({size} lines)" for path, kind, name, size in definitions()
                if kind == "def" and size > FUNCTION_BAR]
        self.assertEqual(over, [], f"functions over {FUNCTION_BAR} lines")

    def test_the_walk_sees_the_code(self) -> None:
        found = {(path, name): size for path, _, name, size in definitions()}
        self.assertIn((os.path.join("node", "node.py"), "Node"), found)
        self.assertIn((os.path.join("node", "node.py"), "__init__"), found)
        self.assertGreater(len(found), 500)

    def test_a_long_one_is_seen(self) -> None:
        root = self.mktemp()
        os.makedirs(root)
        with open(os.path.join(root, "m.py"), "w", encoding="utf-8") as f:
            f.write("class C:\n    def f(self):\n" + "        x = 1\n" * 70)
        self.assertEqual(sorted(definitions(root)), [("m.py", "class", "C", 72), ("m.py", "def", "f", 71)])


class TestTreeTests(SynchronousTestCase):
    def test_the_unit_tests_mirror_the_packages(self) -> None:
        """tests/<package>/ for each package under rolemesh/ that has unit
        tests, and no folder that names none; fakes and fixtures live in
        tests/fixtures/, the integration tier in tests/integration/."""
        tests = os.path.join(REPO, "tests")
        folders = {d for d in os.listdir(tests) if os.path.isfile(os.path.join(tests, d, "__init__.py"))}
        packages = {d for d in os.listdir(PACKAGE) if os.path.isfile(os.path.join(PACKAGE, d, "__init__.py"))}
        self.assertEqual(folders - packages, {"fixtures", "integration"})
        self.assertLessEqual({"api", "node", "children", "scheduling", "http", "config", "fleet", "base"}, folders)
        stray = sorted(n for n in os.listdir(tests) if n.endswith(".py") and not n.startswith(("test_", "__init__")))
        self.assertEqual(stray, [], "support modules belong in tests/fixtures/")
