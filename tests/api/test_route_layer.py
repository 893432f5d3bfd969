"""One route table: Klein's routes and the fast path's dispatch both come
from rolemesh.api.app.ROUTES.  (That the routes go through the node and
import none of the supervisor's modules is pyproject.toml's
``api-through-the-node`` contract, checked by ``lint-imports``.)"""

from __future__ import annotations

import ast
import glob
import os
from typing import List, Set, Tuple

from twisted.trial.unittest import SynchronousTestCase

from tests.fixtures import REPO

PACKAGE = os.path.join(REPO, "rolemesh")
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
    rolemesh.api.app.ROUTES, and nothing else declares a route."""

    def setUp(self) -> None:
        from tests.api.test_app import ApiHarness

        self.api = ApiHarness().api

    def klein_routes(self) -> Set[Tuple[str, str]]:
        from rolemesh.api.app import NodeAPI

        return {(method, rule.rule) for rule in NodeAPI.app.url_map.iter_rules() for method in rule.methods or ()
                if method not in ("HEAD", "OPTIONS")}

    def test_klein_routes_are_the_table(self) -> None:
        from rolemesh.api.app import ROUTES

        self.assertEqual(self.klein_routes(), {(r.method, r.path) for r in ROUTES})
        self.assertEqual(len(ROUTES), len(self.klein_routes()))

    def test_every_fast_route_is_a_klein_route_with_the_same_method_and_path(self) -> None:
        from rolemesh.api.app import ROUTES

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

        from rolemesh.api.app import ERROR_HANDLERS, ROUTES

        for name in [r.handler for r in ROUTES] + [name for _, name in ERROR_HANDLERS]:
            self.assertTrue(callable(operator.attrgetter(name)(self.api)), name)

    def test_the_head_check_knows_the_table(self) -> None:
        from rolemesh.api.app import ROUTES

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
