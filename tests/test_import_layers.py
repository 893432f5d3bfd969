"""rolemesh/ imports in layers, with no import circle.

The import graph is built from the source (the AST), not by importing it:
every ``import`` and ``from ... import`` counts, at module level, inside a
function and under ``if TYPE_CHECKING:`` alike -- an import the type
checker alone runs still says one part needs the other.  Two rules hold:

- no circle: no module reaches itself through the imports of others;
- the layers docs/architecture.md states (its "## Layers" table, read here
  as data): a module imports only modules of its own layer and of the
  layers its row names.

An edge goes to the module an import names, as precisely as it can be told
(``from rolemesh.backends import detect`` is ``backends.detect``, ``from
rolemesh.backends import BackendUnavailable`` is ``backends``); the parent
packages Python runs on the way are not edges, so a package's ``__init__``
must import nothing of the agent's when it is imported (checked too).

Beside them: the Protocols passed down instead of upward imports are met by
the real parts (at run time, on the service tree built on fakes), and
setup.py ships every package under rolemesh/.
"""

from __future__ import annotations

import ast
import os
import re
from typing import Dict, Iterable, Iterator, List, Mapping, Optional, Set, Tuple

import attr
from twisted.trial.unittest import SynchronousTestCase

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(ROOT, "rolemesh")
DOC = os.path.join(ROOT, "docs", "architecture.md")

#: ``rolemesh/__init__.py`` (and each package's ``__init__.py``) in the
#: doc's table and in messages: ``__init__`` for the top package, the
#: package's dotted name for the others.
TOP = "__init__"


# ---------------------------------------------------------------------------
# The graph


def module_files(package_dir: str) -> Dict[str, str]:
    """``{dotted name under the package: file}``; the package itself is ``__init__``."""
    found: Dict[str, str] = {}
    for folder, dirs, files in os.walk(package_dir):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        for name in sorted(files):
            if not name.endswith(".py"):
                continue
            parts = os.path.relpath(os.path.join(folder, name), package_dir)[:-3].split(os.sep)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join(parts) or TOP] = os.path.join(folder, name)
    return found


def _is_package(name: str, files: Mapping[str, str]) -> bool:
    return os.path.basename(files[name]) == "__init__.py"


def _local(dotted: str, package: str) -> Optional[str]:
    """``rolemesh.x.y`` -> ``x.y`` (``rolemesh`` -> ``__init__``); None if outside the package."""
    if dotted == package:
        return TOP
    if dotted.startswith(package + "."):
        return dotted[len(package) + 1:]
    return None


def _known(name: str, files: Mapping[str, str]) -> Optional[str]:
    """The module ``name`` is, or the innermost package holding it."""
    while name not in files:
        if "." not in name:
            return TOP if TOP in files and name == "" else None
        name = name.rpartition(".")[0]
    return name


def imports_of(name: str, files: Mapping[str, str], package: str = "rolemesh") -> Set[str]:
    """The modules of the package that module ``name`` imports, anywhere in it."""
    with open(files[name], encoding="utf-8") as f:
        tree = ast.parse(f.read(), files[name])
    here = [] if name == TOP else name.split(".")
    if not _is_package(name, files):
        here = here[:-1]  # a module's relative imports start from its package
    found: Set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                local = _local(alias.name, package)
                if local is not None:
                    found.add(_known("" if local == TOP else local, files) or TOP)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here[:len(here) - (node.level - 1)] if node.level > 1 else here
                dotted = ".".join([package, *base, *([node.module] if node.module else [])])
            else:
                dotted = node.module or ""
            local = _local(dotted, package)
            if local is None:
                continue
            start = "" if local == TOP else local
            for alias in node.names:
                submodule = f"{start}.{alias.name}" if start else alias.name
                if submodule in files:
                    found.add(submodule)
                else:
                    found.add(_known(start, files) or TOP)
    found.discard(name)
    return found


def import_graph(package_dir: str = PACKAGE, package: str = "rolemesh") -> Dict[str, Set[str]]:
    files = module_files(package_dir)
    return {name: imports_of(name, files, package) for name in files}


def circles(graph: Mapping[str, Iterable[str]]) -> List[List[str]]:
    """The strongly connected parts of more than one module (Tarjan's, without recursion)."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack: Set[str] = set()
    found: List[List[str]] = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work: List[Tuple[str, Iterator[str]]] = []
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        work.append((start, iter(sorted(graph.get(start, ())))))
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = counter
                    counter += 1
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph.get(nxt, ())))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    part = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        part.append(member)
                        if member == node:
                            break
                    if len(part) > 1:
                        found.append(sorted(part))
    return sorted(found)


def describe_circle(part: List[str], graph: Mapping[str, Iterable[str]]) -> str:
    members = set(part)
    edges = [f"{a} -> {b}" for a in part for b in sorted(graph[a]) if b in members]
    return f"{', '.join(part)}: {'; '.join(edges)}"


# ---------------------------------------------------------------------------
# The layers, as docs/architecture.md states them


@attr.s(auto_attribs=True, frozen=True)
class Layer:
    name: str
    #: Module names; ``x.*`` is every module under the package ``x``.
    modules: Tuple[str, ...]
    #: The other layers its modules may import.
    may_import: Tuple[str, ...]

    def holds(self, module: str) -> bool:
        return any(module == p or (p.endswith(".*") and module.startswith(p[:-1])) for p in self.modules)


def layers_section(text: str) -> str:
    """The "## Layers" section ("" when there is none)."""
    if "\n## Layers\n" not in text:
        return ""
    return text.split("\n## Layers\n", 1)[1].split("\n## ", 1)[0]


def read_layers(text: str) -> List[Layer]:
    """The rows of the "## Layers" table: ``| layer | `module`, ... | layer, ... |``
    (``--`` or ``nothing``: no other layer), lowest first."""
    layers = []
    for line in layers_section(text).splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if not line.startswith("|") or len(cells) != 3 or set(cells[0]) <= set("-: ") or cells[0] == "Layer":
            continue
        name = cells[0].strip("*")
        modules = tuple(re.findall(r"`([\w.*]+)`", cells[1]))
        allowed = tuple(w for w in re.findall(r"[\w-]+", cells[2]) if w not in ("nothing", "else"))
        layers.append(Layer(name, modules, allowed))
    return layers


def layering_problems(layers: List[Layer]) -> List[str]:
    """A layer may name only layers below it (so the layers themselves make no circle)."""
    problems = []
    below: Set[str] = set()
    for layer in layers:
        for other in layer.may_import:
            if other not in below:
                problems.append(f"layer {layer.name} may import {other}, which is not a layer below it")
        below.add(layer.name)
    return problems


def placement_problems(modules: Iterable[str], layers: List[Layer]) -> List[str]:
    problems = []
    for module in sorted(modules):
        holding = [layer.name for layer in layers if layer.holds(module)]
        if len(holding) != 1:
            where = "no layer" if not holding else f"layers {', '.join(holding)}"
            problems.append(f"rolemesh/{module.replace('.', '/')}: in {where} of docs/architecture.md's "
                            "Layers table (put it on the row of the one it belongs to)")
    return problems


def import_problems(graph: Mapping[str, Iterable[str]], layers: List[Layer]) -> List[str]:
    by_name = {layer.name: layer for layer in layers}
    problems = []
    for module in sorted(graph):
        own = next((layer for layer in layers if layer.holds(module)), None)
        if own is None:
            continue
        allowed = [own, *(by_name[n] for n in own.may_import if n in by_name)]
        for target in sorted(graph[module]):
            if not any(layer.holds(target) for layer in allowed):
                theirs = next((layer.name for layer in layers if layer.holds(target)), "no layer")
                problems.append(f"{module} ({own.name}) imports {target} ({theirs}): "
                                f"{own.name} may import only {', '.join(own.may_import) or 'itself'}")
    return problems


# ---------------------------------------------------------------------------
# The tests on rolemesh/ itself


def doc_layers() -> List[Layer]:
    with open(DOC, encoding="utf-8") as f:
        return read_layers(f.read())


def assert_none(test: SynchronousTestCase, problems: List[str], what: str) -> None:
    if problems:
        test.fail(f"{what}:\n" + "\n".join(problems))


class ImportCircleTests(SynchronousTestCase):
    def test_no_import_circle_in_rolemesh(self) -> None:
        graph = import_graph()
        assert_none(self, [describe_circle(p, graph) for p in circles(graph)], "import circles")

    def test_the_graph_sees_the_agent(self) -> None:
        """A sanity check on the reading: known edges are there."""
        graph = import_graph()
        self.assertIn("config", graph["llama_args"])
        self.assertIn("node", graph["service"])
        self.assertGreater(len(graph), 40)


class LayerTests(SynchronousTestCase):
    def test_the_doc_states_layers(self) -> None:
        layers = doc_layers()
        self.assertGreaterEqual(len(layers), 4, layers)
        assert_none(self, layering_problems(layers), "layers that are not in order")

    def test_every_module_is_in_one_layer(self) -> None:
        assert_none(self, placement_problems(import_graph(), doc_layers()), "modules not in one layer")

    def test_every_import_goes_to_its_own_layer_or_one_it_may_import(self) -> None:
        assert_none(self, import_problems(import_graph(), doc_layers()), "imports across the layers")

    def test_every_module_the_doc_names_exists(self) -> None:
        files = module_files(PACKAGE)
        for layer in doc_layers():
            for pattern in layer.modules:
                if pattern.endswith(".*"):
                    self.assertTrue(any(m.startswith(pattern[:-1]) for m in files), pattern)
                else:
                    self.assertIn(pattern, files, f"layer {layer.name}")


def module_level_imports(path: str, package: str = "rolemesh") -> List[str]:
    """The package's modules a file imports when it is imported (not in a function)."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    found = []
    pending: List[ast.stmt] = list(tree.body)
    while pending:
        node = pending.pop(0)
        if isinstance(node, ast.Import):
            found.extend(a.name for a in node.names if _local(a.name, package) is not None)
        elif isinstance(node, ast.ImportFrom):
            if node.level or _local(node.module or "", package) is not None:
                found.append("." * node.level + (node.module or ""))
        elif isinstance(node, (ast.If, ast.Try)):
            pending.extend(ast.iter_child_nodes(node))  # type: ignore[arg-type]
    return found


class PackageInitTests(SynchronousTestCase):
    def test_package_inits_import_nothing_of_the_agents_when_imported(self) -> None:
        """Importing ``rolemesh.event_loop.reactor`` runs ``rolemesh/event_loop/__init__.py``
        first: a package's own module must not pull the rest of its layer in
        (the graph above does not count those implicit imports)."""
        files = module_files(PACKAGE)
        for name in files:
            if _is_package(name, files):
                self.assertEqual(module_level_imports(files[name]), [], files[name])

    def test_module_level_imports_are_told_from_function_ones(self) -> None:
        root = self.mktemp()
        os.makedirs(root)
        path = os.path.join(root, "m.py")
        with open(path, "w", encoding="utf-8") as f:
            f.write("import os\nfrom rolemesh import errors\nif 1:\n    import rolemesh.config\n"
                    "def f():\n    from rolemesh import node\n")
        self.assertEqual(module_level_imports(path), ["rolemesh", "rolemesh.config"])


class PackagingTests(SynchronousTestCase):
    def test_every_package_under_rolemesh_is_shipped(self) -> None:
        """setup.py lists its packages by name: a new one (rolemesh/event_loop/)
        must be on the list, or an installed agent lacks it."""
        with open(os.path.join(ROOT, "setup.py"), encoding="utf-8") as f:
            tree = ast.parse(f.read())
        listed = next(ast.literal_eval(k.value) for node in ast.walk(tree) if isinstance(node, ast.Call)
                      for k in node.keywords if k.arg == "packages")
        files = module_files(PACKAGE)
        packages = {"rolemesh" if m == TOP else f"rolemesh.{m}" for m in files if _is_package(m, files)}
        self.assertEqual(packages - set(listed), set())
        self.assertIn("rolemesh.event_loop", packages)


# ---------------------------------------------------------------------------
# The checker itself, on small made-up packages


class CheckerTests(SynchronousTestCase):
    def package(self, files: Mapping[str, str]) -> str:
        root = self.mktemp()
        for path, text in files.items():
            full = os.path.join(root, "pkg", path)
            os.makedirs(os.path.dirname(full), exist_ok=True)
            with open(full, "w", encoding="utf-8") as f:
                f.write(text)
        return os.path.join(root, "pkg")

    def test_imports_under_type_checking_and_in_functions_count(self) -> None:
        root = self.package({
            "__init__.py": "",
            "low.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.high import High\n",
            "high.py": "def f():\n    from pkg import low\n    return low\n",
        })
        graph = import_graph(root, "pkg")
        self.assertEqual(graph["low"], {"high"})
        self.assertEqual(graph["high"], {"low"})
        self.assertEqual(circles(graph), [["high", "low"]])
        self.assertIn("high -> low", describe_circle(["high", "low"], graph))

    def test_relative_and_package_imports_resolve(self) -> None:
        root = self.package({
            "__init__.py": "VERSION = 1\n",
            "sub/__init__.py": "from .. import VERSION\n",
            "sub/a.py": "from . import b\nfrom .b import x\nfrom pkg.sub import NAME\nimport pkg.c as c\n",
            "sub/b.py": "from ..c import y\n",
            "c.py": "import os\nimport pkg\n",
        })
        graph = import_graph(root, "pkg")
        self.assertEqual(graph["sub"], {TOP})
        self.assertEqual(graph["sub.a"], {"sub.b", "sub", "c"})
        self.assertEqual(graph["sub.b"], {"c"})
        self.assertEqual(graph["c"], {TOP})
        self.assertEqual(circles(graph), [])

    def test_a_longer_circle_is_one_part(self) -> None:
        graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"e"}}
        self.assertEqual(circles(graph), [["a", "b", "c"]])

    def test_layers_are_read_and_enforced(self) -> None:
        text = ("# x\n\n## Layers\n\n| Layer | Modules | May import |\n|---|---|---|\n"
                "| base | `errors`, `event_loop.*` | nothing |\n"
                "| config | `config` | base |\n"
                "| top | `service`, `cli` | config, base |\n\n## Next\n| a | `b` | c |\n")
        layers = read_layers(text)
        self.assertEqual([(la.name, la.modules, la.may_import) for la in layers], [
            ("base", ("errors", "event_loop.*"), ()),
            ("config", ("config",), ("base",)),
            ("top", ("service", "cli"), ("config", "base")),
        ])
        self.assertEqual(layering_problems(layers), [])
        self.assertTrue(layering_problems([Layer("a", ("x",), ("b",)), Layer("b", ("y",), ())]))
        graph = {"errors": set(), "event_loop.reactor": {"errors"}, "config": {"event_loop.reactor"},
                 "service": {"config", "cli"}, "cli": {"service"}}
        self.assertEqual(import_problems(graph, layers), [])
        self.assertEqual(placement_problems(graph, layers), [])
        graph["errors"] = {"config"}
        self.assertEqual(import_problems(graph, layers),
                         ["errors (base) imports config (config): base may import only itself"])
        self.assertEqual(placement_problems([*graph, "stray"], layers)[0][:15], "rolemesh/stray:")


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
        from rolemesh.metrics import MetricsRoot
        from rolemesh.node_events import WatchedDevice, WatchedNode
        from rolemesh.reload import ReloadedAPI, ReloadedDispatcher, ReloadedNode, ReloadedService
        from rolemesh.tls import TLSConfig
        from tests.service_harness import ServiceHarness

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

        from rolemesh.interfaces import ChannelSite
        from rolemesh.listener import GuardedSite

        self.assertProvides(GuardedSite(Resource(), reactor=Clock()), ChannelSite)

    def test_a_missing_member_is_noticed(self) -> None:
        from rolemesh.reload import ReloadedNode

        self.assertEqual(protocol_members(ReloadedNode), {"reconfigure", "preload", "preload_targets"})
        with self.assertRaises(self.failureException):
            self.assertProvides(object(), ReloadedNode)
