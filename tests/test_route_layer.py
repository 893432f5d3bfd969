"""The route layer (rolemesh/api.py and the modules it is made of) goes
through the node: it imports nothing from the supervisor's modules, not
even for the type checker."""

from __future__ import annotations

import ast
import glob
import os
from typing import List, Set, Tuple

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


def route_declarations(source: str) -> List[str]:
    """What in ``source`` declares a route: ``Klein()``, ``x.route(...)``, ``x.handle_errors(...)``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Attribute) and func.attr in ("route", "handle_errors"):
                found.append(func.attr)
            elif isinstance(func, ast.Name) and func.id == "Klein":
                found.append(func.id)
    return found


class OneRouteTableTests(SynchronousTestCase):
    """Klein's routes and the fast path's dispatch both come from
    rolemesh.api.ROUTES, and nothing else declares a route."""

    def setUp(self) -> None:
        from tests.test_api import ApiHarness

        self.api = ApiHarness().api

    def klein_routes(self) -> Set[Tuple[str, str]]:
        from rolemesh.api import NodeAPI

        return {(method, rule.rule) for rule in NodeAPI.app.url_map.iter_rules() for method in rule.methods or ()
                if method not in ("HEAD", "OPTIONS")}

    def test_klein_routes_are_the_table(self) -> None:
        from rolemesh.api import ROUTES

        self.assertEqual(self.klein_routes(), {(r.method, r.path) for r in ROUTES})
        self.assertEqual(len(ROUTES), len(self.klein_routes()))

    def test_every_fast_route_is_a_klein_route_with_the_same_method_and_path(self) -> None:
        from rolemesh.api import ROUTES

        fast = self.api.fast_routes()
        self.assertEqual(set(fast), {r.key for r in ROUTES if r.fast})
        self.assertGreaterEqual(len(fast), 6)
        routes = self.api.app.url_map.bind("localhost")
        for method, path in fast:
            endpoint, _ = routes.match(path.decode(), method.decode())
            self.assertEqual(endpoint, f"{method.decode()} {path.decode()}")
            self.assertIn((method.decode(), path.decode()), self.klein_routes())

    def test_every_handler_named_in_the_table_exists(self) -> None:
        import operator

        from rolemesh.api import ERROR_HANDLERS, ROUTES

        for name in [r.handler for r in ROUTES] + [name for _, name in ERROR_HANDLERS]:
            self.assertTrue(callable(operator.attrgetter(name)(self.api)), name)

    def test_the_head_check_knows_the_table(self) -> None:
        from rolemesh.api import ROUTES

        for route in ROUTES:
            path = route.path.replace("<device>", "gpu:0").encode()
            self.assertIsNone(self.api.refuse_head(route.method.encode(), path, {}), route)

    def test_no_other_module_declares_a_route(self) -> None:
        for path in sorted(glob.glob(os.path.join(PACKAGE, "**", "*.py"), recursive=True)):
            if os.path.basename(path) == "routes.py":
                continue
            with open(path, encoding="utf-8") as f:
                source = f.read()
            self.assertEqual(route_declarations(source), [], path)
            for node in ast.walk(ast.parse(source)):
                if isinstance(node, ast.keyword) and node.arg == "fast_routes":
                    self.assertIn(".fast_routes()", ast.unparse(node.value), path)  # built from the table

    def test_the_check_sees_a_route_declared_elsewhere(self) -> None:
        source = "app = Klein()\n@app.route('/x')\ndef f(r): pass\napp.handle_errors(E)(g)\nroute(request)\n"
        self.assertEqual(sorted(route_declarations(source)), ["Klein", "handle_errors", "route"])
