"""docs/architecture.md's pictures of the node, the supervisor and the
dispatcher client name parts that exist, where they say they are (the
node's: every part it has), and the events the supervisor really emits."""

from __future__ import annotations

import ast
import importlib
import os
import re
from typing import List, Tuple

from twisted.trial.unittest import SynchronousTestCase

from rolemesh.children.record import CHILD_STATE, COUNTED_EVENTS

DOC = os.path.join(os.path.dirname(__file__), os.pardir, "docs", "architecture.md")


def section(title: str) -> str:
    with open(DOC, encoding="utf-8") as f:
        text = f.read()
    return text.split(f"## {title}", 1)[1].split("\n## ", 1)[0]


def supervisor_section() -> str:
    return section("The supervisor's parts")


def node_parts() -> List[Tuple[str, str]]:
    """(class, module) of each part the node diagram names."""
    diagram = section("The node's parts").split("```")[1]
    found = re.findall(r"^[│├└─\s]*(\w+)(?: \.\.\.)?\s+rolemesh/([\w/]+)\.py", diagram, re.MULTILINE)
    return [(name, module.replace("/", ".")) for name, module in found]


#: The modules cut out of rolemesh/node/node.py (issue 30): none imports it.
NODE_PART_MODULES = ("scheduling.placement", "node.admission", "node.leases", "node.drain", "node.timers",
                     "node.sampling", "node.views")


class NodePartsDocTests(SynchronousTestCase):
    def test_each_part_lives_in_the_module_the_diagram_names(self) -> None:
        parts = node_parts()
        self.assertEqual(parts[0], ("Node", "node.node"))
        self.assertGreaterEqual(len(parts), 15, parts)
        for name, module in parts:
            found = importlib.import_module("rolemesh." + module.replace("/", "."))
            self.assertTrue(hasattr(found, name), (name, module))

    def test_the_diagram_names_every_part_a_node_has(self) -> None:
        from tests.node.test_node import NodeHarness

        node = NodeHarness(devices=2).node
        named = {(name, module) for name, module in node_parts()}
        held = {(type(v).__name__, type(v).__module__.split(".", 1)[1]) for v in vars(node).values()
                if type(v).__module__.startswith("rolemesh.") and type(v).__name__ != "NodeConfig"}
        held |= {(type(s).__name__, type(s).__module__.split(".", 1)[1]) for s in node.supervisors.values()}
        self.assertEqual(held - named, set(), "parts the diagram does not show")

    def test_no_part_cut_out_of_the_node_imports_it(self) -> None:
        root = os.path.join(os.path.dirname(__file__), os.pardir, "rolemesh")
        for module in NODE_PART_MODULES:
            with open(os.path.join(root, *module.split(".")) + ".py", encoding="utf-8") as f:
                tree = ast.parse(f.read())
            imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
            imported |= {f"{n.module}.{a.name}" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)
                         for a in n.names}
            imported |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
            self.assertNotIn("rolemesh.node.node", imported, module)
            self.assertIn(module, {m for _, m in node_parts()}, "shown in the diagram")


class SupervisorPartsDocTests(SynchronousTestCase):
    def test_each_part_lives_in_the_module_the_diagram_names(self) -> None:
        diagram = supervisor_section().split("```")[1]
        parts = re.findall(r"(\w+)(?:: Events)?[\s─┐◀┘]+rolemesh/([\w/]+)\.py", diagram)
        self.assertEqual(len(parts), 15, parts)
        for name, module in parts:
            if name == "events":
                name = "Events"
            found = importlib.import_module("rolemesh." + module.replace("/", "."))
            self.assertTrue(hasattr(found, name), (name, module))

    def test_the_events_listed_are_the_ones_emitted(self) -> None:
        diagram = supervisor_section().split("```")[1]
        listed = set(re.findall(r"\b(child_state|load(?:_failure|_timeout)?|crash|restart|safe_mode_retry)\b",
                                diagram.split("events: Events", 1)[1].split("Node._supervisor_changed")[0]))
        self.assertEqual(listed, set(COUNTED_EVENTS) | {CHILD_STATE})


class DispatcherPartsDocTests(SynchronousTestCase):
    def test_each_part_lives_in_the_module_the_diagram_names(self) -> None:
        diagram = section("The dispatcher client's parts").split("```")[1]
        parts = re.findall(r"(\w+)[\s─├└│]+rolemesh/([\w/]+)\.py", diagram)
        self.assertEqual(len(parts), 5, parts)
        for name, module in parts:
            found = importlib.import_module("rolemesh." + module.replace("/", "."))
            self.assertTrue(hasattr(found, name), (name, module))
