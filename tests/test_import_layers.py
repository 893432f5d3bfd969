"""rolemesh/ imports in layers: the contracts in pyproject.toml, and what
they do not cover.

``lint-imports`` (import-linter, run by ``tox -e lint``) checks the layers
and the forbidden imports pyproject.toml declares.  Here:

- docs/architecture.md's "## Layers" table is those layers, in order, and
  names every package under rolemesh/ (docs drift unless a test reads them);
- a package's ``__init__`` imports nothing of the agent's when it is
  imported: importing ``rolemesh.event_loop.reactor`` runs
  ``rolemesh/event_loop/__init__.py`` first, an import import-linter does not
  count;
- setup.py ships every package;
- the Protocols passed down instead of upward imports are met by the real
  parts (at run time, on the service tree built on fakes).
"""

from __future__ import annotations

import ast
import os
import re
from typing import Dict, List, Set

from twisted.trial.unittest import SynchronousTestCase

from tests.fixtures import REPO

PACKAGE = os.path.join(REPO, "rolemesh")
DOC = os.path.join(REPO, "docs", "architecture.md")

try:
    import tomllib
except ImportError:  # Python < 3.11: the oldest env; CI's py3 env reads it
    tomllib = None  # type: ignore[assignment]


def contracts() -> List[Dict[str, object]]:
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)["tool"]["importlinter"]["contracts"]  # type: ignore[no-any-return]


def contract_layers() -> List[List[str]]:
    """The layers contract's layers, highest first, each a list of names under rolemesh."""
    (layers,) = [c for c in contracts() if c["type"] == "layers"]
    return [re.split(r"\s*[|:]\s*", line.strip()) for line in layers["layers"]]  # type: ignore[attr-defined]


def doc_layers() -> List[List[str]]:
    """The rows of docs/architecture.md's "## Layers" table, highest first:
    ``| layer | `package`, ... | what it is |``."""
    with open(DOC, encoding="utf-8") as f:
        section = f.read().split("\n## Layers\n", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip().strip("|"))]  # "\|" is a cell's own
        if not line.startswith("|") or len(cells) < 2 or set(cells[0]) <= set("-: ") or cells[0] == "Layer":
            continue
        rows.append(re.findall(r"`([\w.]+)`", cells[1]))
    return rows


def packages_on_disk() -> Set[str]:
    """What sits at rolemesh/'s top: its packages and its modules (not ``__init__``)."""
    found = set()
    for name in os.listdir(PACKAGE):
        path = os.path.join(PACKAGE, name)
        if os.path.isdir(path) and os.path.exists(os.path.join(path, "__init__.py")):
            found.add(name)
        elif name.endswith(".py") and name != "__init__.py":
            found.add(name[:-3])
    return found


class LayersTests(SynchronousTestCase):
    def setUp(self) -> None:
        if tomllib is None:
            raise self.skipTest("reading pyproject.toml needs Python 3.11's tomllib")

    def test_the_doc_shows_the_contracts_layers(self) -> None:
        self.assertEqual(doc_layers(), contract_layers(),
                         "docs/architecture.md's Layers table and pyproject.toml's layers contract differ")

    def test_the_layers_hold_everything_at_the_top_of_rolemesh(self) -> None:
        listed = [name for layer in contract_layers() for name in layer]
        self.assertEqual(sorted(listed), sorted(packages_on_disk()))
        self.assertEqual(len(listed), len(set(listed)))

    def test_the_promises_are_contracts(self) -> None:
        ids = {c.get("id") for c in contracts()}
        self.assertLessEqual({"layers", "pure-scheduling", "backends-serve-nothing", "config-knows-no-node",
                              "api-through-the-node", "no-circles"}, ids)

    def test_at_most_ten_modules_at_the_root(self) -> None:
        modules = [n for n in os.listdir(PACKAGE) if n.endswith(".py")]
        self.assertLessEqual(len(modules), 10, sorted(modules))


def module_level_imports(path: str, package: str = "rolemesh") -> List[str]:
    """The package's modules a file imports when it is imported (not in a function)."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    found = []
    pending: List[ast.stmt] = list(tree.body)
    while pending:
        node = pending.pop(0)
        if isinstance(node, ast.Import):
            found.extend(a.name for a in node.names if (a.name == package or a.name.startswith(package + ".")))
        elif isinstance(node, ast.ImportFrom):
            if node.level or ((node.module or "") == package or (node.module or "").startswith(package + ".")):
                found.append("." * node.level + (node.module or ""))
        elif isinstance(node, (ast.If, ast.Try)):
            pending.extend(ast.iter_child_nodes(node))  # type: ignore[arg-type]
    return found


class PackageInitTests(SynchronousTestCase):
    def test_package_inits_import_nothing_of_the_agents_when_imported(self) -> None:
        """Importing ``rolemesh.event_loop.reactor`` runs ``rolemesh/event_loop/__init__.py``
        first: a package's own module must not pull the rest of its layer in
        (import-linter does not count those implicit imports)."""
        inits = [os.path.join(folder, "__init__.py") for folder, _, files in os.walk(PACKAGE) if "__init__.py" in files]
        self.assertGreater(len(inits), 8)
        for path in inits:
            self.assertEqual(module_level_imports(path), [], path)

    def test_module_level_imports_are_told_from_function_ones(self) -> None:
        root = self.mktemp()
        os.makedirs(root)
        path = os.path.join(root, "m.py")
        with open(path, "w", encoding="utf-8") as f:
            f.write("import os\nfrom rolemesh import errors\nif 1:\n    import rolemesh.config.file\n"
                    "def f():\n    from rolemesh import node\n")
        self.assertEqual(module_level_imports(path), ["rolemesh", "rolemesh.config.file"])


class PackagingTests(SynchronousTestCase):
    def test_every_package_under_rolemesh_is_shipped(self) -> None:
        """setup.py lists its packages by name: a new one must be on the
        list, or an installed agent lacks it."""
        with open(os.path.join(REPO, "setup.py"), encoding="utf-8") as f:
            tree = ast.parse(f.read())
        listed = next(ast.literal_eval(node.value) for node in tree.body if isinstance(node, ast.Assign)
                      and any(isinstance(t, ast.Name) and t.id == "PACKAGES" for t in node.targets))
        on_disk = {name for name in packages_on_disk() if os.path.isdir(os.path.join(PACKAGE, name))}
        self.assertEqual(set(listed), on_disk)
        for name in listed:
            subpackages = [d for d in os.listdir(os.path.join(PACKAGE, name))
                           if os.path.exists(os.path.join(PACKAGE, name, d, "__init__.py"))]
            self.assertEqual(subpackages, [], f"rolemesh/{name}: setup.py lists no subpackages")


# ---------------------------------------------------------------------------
# What is passed down instead of imported: each real part has what the
# Protocol its lower part declares asks of it (mypy checks the types; this
# checks the names at run time, on the service tree built on fakes)


def protocol_members(protocol: type) -> Set[str]:
    names: Set[str] = set()
    for klass in protocol.__mro__:
        if klass is object or klass.__module__ in ("typing", "typing_extensions"):
            continue
        names.update(n for n in vars(klass) if not n.startswith("_"))
        names.update(getattr(klass, "__annotations__", {}))
    return names


class PassedDownTests(SynchronousTestCase):
    def assertProvides(self, part: object, protocol: type) -> None:  # noqa: N802 - unittest's style
        members = protocol_members(protocol)
        self.assertTrue(members, protocol)
        missing = sorted(m for m in members if not hasattr(part, m))
        self.assertEqual(missing, [], f"{type(part).__name__} lacks what {protocol.__name__} asks")

    def test_the_service_trees_parts_have_what_their_protocols_ask(self) -> None:
        from rolemesh.api.metrics import MetricsRoot
        from rolemesh.config.tls import TLSConfig
        from rolemesh.node.feed import WatchedDevice, WatchedNode
        from rolemesh.node.reload import ReloadedAPI, ReloadedDispatcher, ReloadedNode, ReloadedService
        from tests.fixtures.service_harness import ServiceHarness

        h = ServiceHarness({"models": [{"model_id": "tiny"}], "dispatcher_base_url": "http://dispatcher.test"})
        self.addCleanup(h.cleanup)
        reloader = h.root.reloader
        assert reloader is not None
        self.assertProvides(reloader.node, ReloadedNode)
        self.assertProvides(reloader.api, ReloadedAPI)
        self.assertProvides(reloader.service, ReloadedService)
        self.assertIsNotNone(reloader.dispatcher)
        self.assertProvides(reloader.dispatcher, ReloadedDispatcher)
        self.assertProvides(h.root, MetricsRoot)
        self.assertProvides(reloader.node, WatchedNode)
        for supervisor in reloader.node.supervisors.values():  # type: ignore[attr-defined]
            self.assertProvides(supervisor, WatchedDevice)
        self.assertProvides(h.root.config, TLSConfig)

    def test_the_listeners_site_has_what_the_fast_channel_asks(self) -> None:
        from twisted.internet.task import Clock
        from twisted.web.resource import Resource

        from rolemesh.base.interfaces import ChannelSite
        from rolemesh.http.listener import GuardedSite

        self.assertProvides(GuardedSite(Resource(), reactor=Clock()), ChannelSite)

    def test_a_missing_member_is_noticed(self) -> None:
        from rolemesh.node.reload import ReloadedNode

        self.assertEqual(protocol_members(ReloadedNode), {"reconfigure", "preload", "preload_targets"})
        with self.assertRaises(self.failureException):
            self.assertProvides(object(), ReloadedNode)
