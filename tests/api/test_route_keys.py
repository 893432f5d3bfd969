"""docs/api.md's table of which routes need the key, against the routes the code declares."""

from __future__ import annotations

import os
import re
from typing import Dict, Tuple

from twisted.trial.unittest import SynchronousTestCase

from rolemesh.api.app import OPEN_ROUTES, ROUTES, NodeAPI
from tests.fixtures import REPO

DOCS = os.path.join(REPO, "docs", "api.md")


def route_key_table() -> Dict[Tuple[str, str], bool]:
    """``{(method, path with {params}): key needed}`` from docs/api.md."""
    with open(DOCS, encoding="utf-8") as f:
        text = f.read()
    table = text.split("<!-- route-keys -->", 1)[1].split("<!-- /route-keys -->", 1)[0]
    rows = {}
    for method, path, needed in re.findall(r"^\| `(GET|POST|PUT|PATCH|DELETE) ([^`]+)` \| (yes|no) \|$", table, re.M):
        rows[(method, path)] = needed == "yes"
    return rows


def declared_routes() -> Dict[Tuple[str, str], bool]:
    """Every (method, path) Klein routes, with ``<param>`` written ``{param}``."""
    routes = {}
    for rule in NodeAPI.app.url_map.iter_rules():
        path = re.sub(r"<(?:[^:>]+:)?([^>]+)>", r"{\1}", rule.rule)
        for method in rule.methods or ():
            if method not in ("HEAD", "OPTIONS"):
                routes[(method, path)] = path.encode() not in OPEN_ROUTES
    return routes


class RouteKeyTableTests(SynchronousTestCase):
    def test_the_table_lists_every_route_and_what_the_code_does(self) -> None:
        self.assertEqual(route_key_table(), declared_routes())

    def test_the_fast_paths_are_routes_of_the_table(self) -> None:
        table = route_key_table()
        for route in ROUTES:
            if route.relayed is not None:
                self.assertIn((route.method, re.sub(r"<(?:[^:>]+:)?([^>]+)>", r"{\1}", route.path)), table)
        for path in ("/v1/models", "/health", "/ready"):
            self.assertIn(("GET", path), table)
