"""The fake dispatcher (:mod:`tests.fixtures.fake_dispatcher`) over real HTTP, in its own process.

Integration tests need a dispatcher that can really go away (connection
refused) and come back as a fresh process that forgot every node, so this
runs :class:`tests.fixtures.fake_dispatcher.FakeDispatcher` in a process of its own::

    python -m tests.integration.fake_dispatcher_server PORT [--token TOKEN] [--tls-cert CERT --tls-key KEY]

It listens on ``127.0.0.1:PORT`` (0 picks a free port; HTTPS with the
given PEM certificate and key, TLS 1.2 or newer) and prints
``listening <port>`` on stdout once it accepts connections.  Besides the
dispatcher's routes it answers control routes under ``/_fake/``:

- ``GET /_fake/received``: every request recorded so far, as a JSON list of
  ``{"kind", "method", "path", "headers", "body", "at"}`` (``at`` is the
  POSIX time it arrived);
- ``GET /_fake/info``: ``{"pid", "port", "started_at", "nodes", "view", "missed"}``
  (``started_at``: the POSIX time it began listening);
- ``POST /_fake/mode``: a JSON object setting any of ``refuse``, ``fail``,
  ``hang``, ``reject_auth`` (booleans), ``forget_status`` (404/410) and
  ``deregister_route``, ``events_route``, ``drop_events`` (booleans);
- ``POST /_fake/forget``: drop every registration;
- ``POST /_fake/release``: answer every hung request (503).

Control routes are not recorded.  SIGTERM/SIGINT release hung requests and
stop the process.  :class:`FakeDispatcherProcess` starts and drives it from
a (blocking) test.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from typing import Any, BinaryIO, Dict, List, Optional, Tuple

from klein import Klein

from rolemesh.fleet.dispatcher import DEREGISTER_PATH, EVENTS_PATH, HEARTBEAT_PATH, REGISTER_PATH
from tests.fixtures.fake_dispatcher import FakeDispatcher, Received

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_MODE_FLAGS = ("refuse", "fail", "hang", "reject_auth", "deregister_route", "events_route", "drop_events")


def received_to_json(r: Received) -> Dict[str, Any]:
    return {"kind": r.kind, "method": r.method, "path": r.path, "headers": r.headers, "body": r.body, "at": r.at}


class ServedFakeDispatcher(FakeDispatcher):
    """:class:`FakeDispatcher` plus the ``/_fake/`` control routes."""

    app = Klein()

    def __init__(self, token: Optional[str] = None, clock: Any = None) -> None:
        super().__init__(token=token, clock=clock)
        self.port: Optional[int] = None
        self.started_at = time.time()

    # The protocol routes, re-declared on this class's router.
    @app.route(REGISTER_PATH, methods=["POST"])
    def register(self, request: Any) -> Any:
        return self._handle(request, "register")

    @app.route(HEARTBEAT_PATH, methods=["POST"])
    def heartbeat(self, request: Any) -> Any:
        return self._handle(request, "heartbeat")

    @app.route(DEREGISTER_PATH, methods=["POST"])
    def deregister(self, request: Any) -> Any:
        return self._handle(request, "deregister")

    @app.route(EVENTS_PATH, methods=["POST"])
    def node_events(self, request: Any) -> Any:
        return self._handle(request, "events")

    # Control routes.
    @app.route("/_fake/received", methods=["GET"])
    def control_received(self, request: Any) -> bytes:
        return self._answer(request, 200, [received_to_json(r) for r in self.received])

    @app.route("/_fake/info", methods=["GET"])
    def control_info(self, request: Any) -> bytes:
        info = {"pid": os.getpid(), "port": self.port, "started_at": self.started_at, "nodes": sorted(self.nodes),
                "view": self.view, "missed": self.missed}
        return self._answer(request, 200, info)

    @app.route("/_fake/mode", methods=["POST"])
    def control_mode(self, request: Any) -> bytes:
        try:
            mode = json.loads(request.content.read())
        except ValueError:
            mode = None
        if not isinstance(mode, dict):
            return self._answer(request, 400, {"error": "expected a JSON object"})
        for key, value in mode.items():
            if key in _MODE_FLAGS:
                setattr(self, key, bool(value))
            elif key == "forget_status" and value in (404, 410):
                self.forget_status = value
            else:
                return self._answer(request, 400, {"error": f"unknown mode {key}={value!r}"})
        return self._answer(request, 200, {key: getattr(self, key) for key in (*_MODE_FLAGS, "forget_status")})

    @app.route("/_fake/forget", methods=["POST"])
    def control_forget(self, request: Any) -> bytes:
        self.forget()
        return self._answer(request, 200, {"ok": True})

    @app.route("/_fake/release", methods=["POST"])
    def control_release(self, request: Any) -> bytes:
        self.release()
        return self._answer(request, 200, {"ok": True})


def main(argv: List[str]) -> None:
    import argparse

    from twisted.internet import reactor as global_reactor

    reactor: Any = global_reactor
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("port", type=int)
    parser.add_argument("--token", default=None)
    parser.add_argument("--tls-cert", default=None)
    parser.add_argument("--tls-key", default=None)
    args = parser.parse_args(argv)

    fake = ServedFakeDispatcher(token=args.token, clock=reactor)
    if args.tls_cert:
        from twisted.internet import ssl
        from twisted.web.server import Site

        with open(args.tls_cert, "rb") as c, open(args.tls_key, "rb") as k:
            options = ssl.PrivateCertificate.loadPEM(c.read() + k.read()).options()
        site = Site(fake.resource())
        site.noisy = False
        port = reactor.listenSSL(args.port, site, options, interface="127.0.0.1")
    else:
        port = fake.listen(reactor, args.port)
    fake.port = port.getHost().port
    fake.started_at = time.time()  # when it began accepting connections

    def stop(signum: int, frame: Any) -> None:
        reactor.callFromThread(reactor.stop)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    reactor.addSystemEventTrigger("before", "shutdown", fake.release)
    reactor.callWhenRunning(lambda: print(f"listening {fake.port}", flush=True))
    reactor.run(installSignalHandlers=False)


class FakeDispatcherProcess:
    """Runs the server above as a subprocess; blocking helpers for tests."""

    def __init__(self, port: int = 0, token: Optional[str] = None, log_path: Optional[str] = None,
                 timeout: float = 20.0, tls: Optional[Tuple[str, str, str]] = None) -> None:
        """``tls``: (certificate file, key file, CA file the control calls trust) for HTTPS."""
        cmd = [sys.executable, "-m", "tests.integration.fake_dispatcher_server", str(port)]
        if token is not None:
            cmd += ["--token", token]
        self._tls = tls
        if tls is not None:
            cmd += ["--tls-cert", tls[0], "--tls-key", tls[1]]
        self._log: Optional[BinaryIO] = open(log_path, "ab") if log_path else None
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [REPO_ROOT, os.environ.get("PYTHONPATH")]))}
        self.process = subprocess.Popen(cmd, cwd=REPO_ROOT, stdout=subprocess.PIPE,
                                        stderr=self._log if self._log is not None else subprocess.DEVNULL,
                                        stdin=subprocess.DEVNULL, env=env)
        try:
            self.port = self._wait_listening(timeout)
        except BaseException:
            self.stop()
            raise
        self.url = f"{'https' if tls else 'http'}://127.0.0.1:{self.port}"

    def _wait_listening(self, timeout: float) -> int:
        assert self.process.stdout is not None
        deadline = time.monotonic() + timeout
        line = b""
        while not line.endswith(b"\n"):
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"fake dispatcher did not listen within {timeout}s")
            ready, _, _ = select.select([self.process.stdout], [], [], left)
            if ready:
                chunk = os.read(self.process.stdout.fileno(), 1)
                if not chunk:
                    raise AssertionError(f"fake dispatcher exited with {self.process.wait(5)} before listening")
                line += chunk
        word, _, port = line.decode().strip().partition(" ")
        assert word == "listening", line
        return int(port)

    def _call(self, method: str, path: str, body: Any = None) -> Any:
        if self._tls is not None:
            import http.client
            import ssl

            context = ssl.create_default_context(cafile=self._tls[2])
            conn = http.client.HTTPSConnection("localhost", self.port, timeout=10, context=context)
            try:
                conn.request(method, path, body=None if body is None else json.dumps(body))
                response = conn.getresponse()
                status, raw = response.status, response.read()
            finally:
                conn.close()
            assert status == 200, (status, raw)
            return json.loads(raw)
        from tests.fixtures.llama import http_request

        status, _, raw = http_request(method, self.url + path, body, timeout=10)
        assert status == 200, (status, raw)
        return json.loads(raw)

    def received(self, kind: Optional[str] = None) -> List[Dict[str, Any]]:
        records = self._call("GET", "/_fake/received")
        return [r for r in records if kind is None or r["kind"] == kind]

    def info(self) -> Dict[str, Any]:
        return self._call("GET", "/_fake/info")

    def mode(self, **flags: Any) -> Dict[str, Any]:
        return self._call("POST", "/_fake/mode", flags)

    def forget(self) -> None:
        self._call("POST", "/_fake/forget", {})

    def release(self) -> None:
        self._call("POST", "/_fake/release", {})

    def stop(self, timeout: float = 10.0) -> Optional[int]:
        """SIGTERM (then SIGKILL) and wait; safe to call twice."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout)
        if self.process.stdout is not None:
            self.process.stdout.close()
        if self._log is not None:
            self._log.close()
            self._log = None
        return self.process.returncode


if __name__ == "__main__":
    main(sys.argv[1:])
