"""docs/architecture.md's pictures of the supervisor and the dispatcher
client name parts that exist, where they say they are, and the events the
supervisor really emits."""

from __future__ import annotations

import importlib
import os
import re

from twisted.trial.unittest import SynchronousTestCase

from rolemesh.supervisor import CHILD_STATE, COUNTED_EVENTS

DOC = os.path.join(os.path.dirname(__file__), os.pardir, "docs", "architecture.md")


def section(title: str) -> str:
    with open(DOC, encoding="utf-8") as f:
        text = f.read()
    return text.split(f"## {title}", 1)[1].split("\n## ", 1)[0]


def supervisor_section() -> str:
    return section("The supervisor's parts")


class SupervisorPartsDocTests(SynchronousTestCase):
    def test_each_part_lives_in_the_module_the_diagram_names(self) -> None:
        diagram = supervisor_section().split("```")[1]
        parts = re.findall(r"(\w+)(?:: Events)?[\s─┐◀┘]+rolemesh/(\w+)\.py", diagram)
        self.assertEqual(len(parts), 14, parts)
        for name, module in parts:
            if name == "events":
                name = "Events"
            self.assertTrue(hasattr(importlib.import_module(f"rolemesh.{module}"), name), (name, module))

    def test_the_events_listed_are_the_ones_emitted(self) -> None:
        diagram = supervisor_section().split("```")[1]
        listed = set(re.findall(r"\b(child_state|load(?:_failure|_timeout)?|crash|restart|safe_mode_retry)\b",
                                diagram.split("events: Events", 1)[1].split("Node._supervisor_changed")[0]))
        self.assertEqual(listed, set(COUNTED_EVENTS) | {CHILD_STATE})


class DispatcherPartsDocTests(SynchronousTestCase):
    def test_each_part_lives_in_the_module_the_diagram_names(self) -> None:
        diagram = section("The dispatcher client's parts").split("```")[1]
        parts = re.findall(r"(\w+)[\s─├└│]+rolemesh/(\w+)\.py", diagram)
        self.assertEqual(len(parts), 5, parts)
        for name, module in parts:
            self.assertTrue(hasattr(importlib.import_module(f"rolemesh.{module}"), name), (name, module))
