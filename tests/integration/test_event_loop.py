"""rolemesh.event_loop: the agent's reactor, run for real in a child process
(the test process keeps trial's reactor): it serves TCP, runs timers, and a
protocol that raises is logged and dropped while the loop goes on."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from twisted.trial.unittest import SkipTest, SynchronousTestCase

CHECKOUT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SCRIPT = r"""
import json, sys
from rolemesh import event_loop
installed = event_loop.install()
from twisted.internet import reactor, protocol
from twisted.logger import globalLogBeginner
errors = []
def observe(event):
    failure = event.get("log_failure") or event.get("failure")  # a legacy log.err has the second
    if failure is not None:
        errors.append([failure.getErrorMessage(), event.get("log_system")])
globalLogBeginner.beginLoggingTo([observe], redirectStandardIO=False)
out = {"installed": installed, "reactor": type(reactor).__name__, "again": event_loop.install()}

class Server(protocol.Protocol):
    def dataReceived(self, data):
        if data.startswith(b"boom"):
            raise RuntimeError("a protocol bug")
        self.transport.write(data.upper())

class Client(protocol.Protocol):
    def __init__(self, send, done):
        self.send, self.done, self.got = send, done, b""
    def connectionMade(self):
        self.transport.write(self.send)
    def dataReceived(self, data):
        self.got += data
        if self.got == self.send.upper():  # the whole echo: done with this connection
            self.transport.loseConnection()
    def connectionLost(self, reason):
        self.done(self.got)

factory = protocol.Factory.forProtocol(Server)
port = reactor.listenTCP(0, factory, interface="127.0.0.1").getHost().port
results = {}

def connect(name, send, then):
    def done(got):
        results[name] = got.decode()
        then()
    protocol.ClientCreator(reactor, Client, send, done).connectTCP("127.0.0.1", port)

def finish():
    out.update(results=results, errors=errors, timer=timer_fired)
    print(json.dumps(out))
    reactor.stop()

timer_fired = []

def begin():  # from a timer: the exchange only starts if timers run
    timer_fired.append(True)
    connect("boom", b"boom", lambda: connect("echo", b"hello", finish))

reactor.callLater(0.01, begin)
reactor.callLater(20, reactor.stop)  # a bound, should the loop ever hang
reactor.run()
"""


def run_in_child(test: SynchronousTestCase, script: str) -> dict:
    """Run ``script`` in a fresh interpreter (its own global reactor) and
    return the JSON object its last line prints."""
    from rolemesh.event_loop import twisted_compat

    if twisted_compat.AgentEPollReactor is None:
        raise SkipTest("no epoll here: the agent runs on Twisted's default reactor")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([CHECKOUT, os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=60, env=env, cwd=CHECKOUT)
    test.assertEqual(done.returncode, 0, done.stderr.decode()[-2000:])
    return json.loads(done.stdout.decode().strip().splitlines()[-1])


class AgentReactorTests(SynchronousTestCase):
    def run_script(self) -> dict:
        return run_in_child(self, SCRIPT)

    def test_serves_runs_timers_and_survives_a_raising_protocol(self) -> None:
        out = self.run_script()
        self.assertEqual((out["installed"], out["reactor"], out["again"]), (True, "AgentEPollReactor", False))
        self.assertEqual(out["results"], {"boom": "", "echo": "HELLO"},
                         "the raising connection was dropped, the next one served")
        # Logged, as every reactor logs it; without the per-event log context
        # its system is "-" rather than the connection's (see the module).
        self.assertEqual(out["errors"], [["a protocol bug", "-"]], "the protocol's error was logged")
        self.assertEqual(out["timer"], [True])


FALLBACK = r"""
import json
from rolemesh.event_loop import twisted_compat
twisted_compat.CHECKED_DOPOLL = frozenset()  # as if a Twisted with another doPoll were installed
from twisted.logger import globalLogBeginner
warnings = []
globalLogBeginner.beginLoggingTo([lambda e: warnings.append(e.get("why"))], redirectStandardIO=False)
from rolemesh import event_loop
installed = event_loop.install()
from twisted.internet import reactor
print(json.dumps({"installed": installed, "reactor": type(reactor).__name__, "warnings": [w for w in warnings if w]}))
"""


class FallbackTests(SynchronousTestCase):
    def test_a_twisted_whose_loop_was_not_checked_gets_its_own_reactor_and_a_log_line(self) -> None:
        out = run_in_child(self, FALLBACK)
        self.assertEqual((out["installed"], out["reactor"]), (False, "EPollReactor"))
        self.assertEqual(len(out["warnings"]), 1, out)
        self.assertIn("doPoll", out["warnings"][0])
