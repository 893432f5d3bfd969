"""The route layer (rolemesh/api.py and the modules it is made of) goes
through the node: it imports nothing from the supervisor's modules, not
even for the type checker."""

from __future__ import annotations

import ast
import glob
import os
from typing import List, Set

from twisted.trial.unittest import SynchronousTestCase

PACKAGE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "rolemesh")
#: The supervisor and the parts it owns (docs/architecture.md, "The supervisor's parts").
SUPERVISOR_MODULES = frozenset({"rolemesh.supervisor", "rolemesh.child_process", "rolemesh.child_probes",
                                "rolemesh.restart_policy"})


def route_layer() -> List[str]:
    """The route layer's files: api.py, routes.py and every api_*.py."""
    names = ["api.py", "routes.py"] + [os.path.basename(p) for p in glob.glob(os.path.join(PACKAGE, "api_*.py"))]
    return sorted(os.path.join(PACKAGE, n) for n in names if os.path.exists(os.path.join(PACKAGE, n)))


def imported(source: str) -> Set[str]:
    """Every module ``source`` imports, anywhere in it (under TYPE_CHECKING, in a function), and
    for ``from package import name`` also ``package.name``."""
    found: Set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module is not None and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


class RouteLayerImportTests(SynchronousTestCase):
    def test_the_layer_is_found(self) -> None:
        self.assertIn(os.path.join(PACKAGE, "api.py"), route_layer())

    def test_no_route_module_imports_a_supervisor_module(self) -> None:
        for path in route_layer():
            with open(path, encoding="utf-8") as f:
                reached = imported(f.read()) & SUPERVISOR_MODULES
            self.assertEqual(reached, set(), f"{os.path.basename(path)} imports {sorted(reached)}")

    def test_the_check_sees_every_form_of_import(self) -> None:
        source = ("import rolemesh.supervisor\n"
                  "from rolemesh import child_probes\n"
                  "from typing import TYPE_CHECKING\n"
                  "if TYPE_CHECKING:\n    from rolemesh.restart_policy import RestartPolicy\n"
                  "def f():\n    from rolemesh.child_process import Launcher\n")
        self.assertEqual(imported(source) & SUPERVISOR_MODULES, set(SUPERVISOR_MODULES))
