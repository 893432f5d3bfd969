"""docs/architecture.md's picture of the API names parts that exist, where
it says they are, and the node's views the routes read."""

from __future__ import annotations

import importlib
import os
import re

from twisted.trial.unittest import SynchronousTestCase

from rolemesh.node.node import Node

DOC = os.path.join(os.path.dirname(__file__), os.pardir, "docs", "architecture.md")


def api_diagram() -> str:
    with open(DOC, encoding="utf-8") as f:
        text = f.read()
    return text.split("## The API's parts", 1)[1].split("\n## ", 1)[0].split("```")[1]


class ApiPartsDocTests(SynchronousTestCase):
    def test_each_part_lives_in_the_module_the_diagram_names(self) -> None:
        parts = re.findall(r"(\w+)\s+rolemesh/([\w/]+)\.py", api_diagram())
        self.assertEqual(len(parts), 10, parts)
        for name, module in parts:
            found = importlib.import_module("rolemesh." + module.replace("/", "."))
            self.assertTrue(hasattr(found, name), (name, module))

    def test_the_names_beside_them_exist(self) -> None:
        import rolemesh.api.app as api
        import rolemesh.api.routes as routes

        diagram = api_diagram()
        for name in ("ROUTES", "ERROR_HANDLERS"):
            self.assertIn(name, diagram)
            self.assertTrue(hasattr(api, name), name)
        for name in ("klein_app", "fast_dispatch"):
            self.assertIn(name, diagram)
            self.assertTrue(hasattr(routes, name), name)
        self.assertTrue(hasattr(api.NodeAPI, "refuse_head"))

    def test_the_views_named_are_the_nodes(self) -> None:
        views = re.findall(r"Node\.(\w+)", api_diagram())
        self.assertGreaterEqual(len(views), 5, views)
        for view in views:
            self.assertTrue(callable(getattr(Node, view, None)), view)
