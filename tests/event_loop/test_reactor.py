"""rolemesh.event_loop.reactor: the one lazy look-up of the global reactor."""

from __future__ import annotations

import os
import re

from twisted.internet.task import Clock
from twisted.trial.unittest import SkipTest, SynchronousTestCase

from rolemesh.event_loop.reactor import UsesReactor, resolve_reactor
from tests.fixtures import REPO

ROOT = REPO
GLOBAL_IMPORT = re.compile(r"^\s*from twisted\.internet import reactor\b", re.MULTILINE)


class User(UsesReactor):
    def __init__(self, reactor: object = None) -> None:
        self._reactor = reactor


class ResolveTests(SynchronousTestCase):
    def test_injected_reactor_wins(self) -> None:
        clock = Clock()
        self.assertIs(resolve_reactor(clock), clock)
        self.assertIs(User(clock).reactor, clock)

    def test_global_reactor_looked_up_when_needed(self) -> None:
        from twisted.internet import reactor

        self.assertIs(resolve_reactor(None), reactor)
        user = User()
        self.assertIs(user._reactor, None)  # nothing looked up at construction
        self.assertIs(user.reactor, reactor)

    def test_the_lookup_lives_in_one_module(self) -> None:
        """Library code asks rolemesh.event_loop.reactor; only the entry
        point (cli.py, which runs the reactor) imports it."""
        found = set()
        for folder, _, files in os.walk(os.path.join(ROOT, "rolemesh")):
            for name in files:
                if name.endswith(".py"):
                    path = os.path.join(folder, name)
                    with open(path, encoding="utf-8") as f:
                        if GLOBAL_IMPORT.search(f.read()):
                            found.add(os.path.relpath(path, ROOT))
        self.assertEqual(found, {"rolemesh/event_loop/reactor.py", "rolemesh/cli.py"})


class ReactorInterfaceTests(SynchronousTestCase):
    def test_the_real_reactor_provides_every_named_set(self) -> None:
        """The ``I...Reactor`` typing names ask only for what every POSIX
        reactor declares (the class, not the installed global reactor)."""
        from twisted.internet.posixbase import PosixReactorBase
        from zope.interface.interface import InterfaceClass

        from rolemesh.base.interfaces import IAgentReactor, IBackendReactor, IHTTPClientReactor

        for name in (IAgentReactor, IBackendReactor, IHTTPClientReactor):
            bases = [b for b in name.__iro__ if isinstance(b, InterfaceClass) and b.__module__.startswith("twisted.")]
            self.assertTrue(bases, name)
            for base in bases:
                self.assertTrue(base.implementedBy(PosixReactorBase), f"{name.__name__}: {base.__name__}")


class AgentReactorClassTests(SynchronousTestCase):
    def test_the_agents_reactor_is_an_epoll_reactor_with_every_named_set(self) -> None:
        from rolemesh.base.interfaces import IAgentReactor, IBackendReactor, IHTTPClientReactor
        from rolemesh.event_loop import twisted_compat  # where the class lives

        if twisted_compat.AgentEPollReactor is None:
            raise SkipTest("no epoll here")
        from twisted.internet.epollreactor import EPollReactor

        self.assertTrue(issubclass(twisted_compat.AgentEPollReactor, EPollReactor))
        from zope.interface.interface import InterfaceClass

        for name in (IAgentReactor, IBackendReactor, IHTTPClientReactor):  # as for the POSIX reactors above
            for base in name.__iro__:
                if isinstance(base, InterfaceClass) and base.__module__.startswith("twisted."):
                    self.assertTrue(base.implementedBy(twisted_compat.AgentEPollReactor), base)

    def test_install_leaves_an_installed_reactor_alone(self) -> None:
        import twisted.internet.reactor  # noqa: F401 - trial's, installed already

        from rolemesh import event_loop

        self.assertFalse(event_loop.install())
