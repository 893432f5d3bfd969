"""docs/api.md's table of which routes need the key, against a running agent:
every route, without a key and with one."""

from __future__ import annotations

import os
import socket
from typing import Tuple

from twisted.trial.unittest import SynchronousTestCase

from tests.api.test_route_keys import route_key_table
from tests.integration.harness import AgentProcess, require_llama_server, tiny_model

KEY = "route-key"


class RouteKeysTests(SynchronousTestCase):
    def status_only(self, port: int, head: bytes) -> Tuple[int, bytes]:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.sendall(head)
            first = b""
            while b"\r\n" not in first:
                chunk = sock.recv(1024)
                if not chunk:
                    break
                first += chunk
        return int(first.split(b" ", 2)[1]), first

    def test_every_route_of_the_table_against_the_agent(self) -> None:
        require_llama_server()
        directory = os.path.abspath(self.mktemp())
        agent = AgentProcess(directory, {"api_key": KEY, "models": [
            {"model_id": "tiny-a", "path": tiny_model(directory, "a", 1)}]})
        self.addCleanup(agent.stop)
        table = route_key_table()
        self.assertGreater(len(table), 10)
        for (method, path), needed in sorted(table.items()):
            concrete = path.replace("{device}", "cpu:0").replace("{model}", "tiny-a").replace("{rest}", "props")
            upstream = path.startswith("/upstream/")
            body = {"model": "tiny-a", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
                    "prompt": "hi", "input": "hi"} if method == "POST" else None
            status, headers, answer = agent.request(method, concrete, body)
            where = f"{method} {path} without a key -> {status} {answer[:200]!r}"
            if upstream and method == "GET" and not concrete.endswith("/props"):
                pass  # a keyless look at a child's web UI: its static files, or a page (never a load)
            elif needed:
                self.assertEqual(status, 401, where)
                self.assertIn("bearer", headers.get("www-authenticate", "").lower(), where)
            else:
                self.assertNotEqual(status, 401, where)
            if path == "/v1/node/events":  # a stream that does not end: its status line is enough
                status, answer = self.status_only(agent.port, f"GET {path} HTTP/1.1\r\nHost: x\r\n"
                                                  f"Authorization: Bearer {KEY}\r\n\r\n".encode())
            else:
                status, _, answer = agent.request(method, concrete, body, headers={"Authorization": f"Bearer {KEY}"})
            where = f"{method} {path} with the key -> {status} {answer[:200]!r}"
            if upstream:  # the child's own answer (its 404 for what it does not serve), never the node's
                self.assertNotEqual(status, 401, where)
                self.assertNotIn(b"no route", answer, where)
                self.assertNotIn(b"model_not_found", answer, where)
            else:
                self.assertNotIn(status, (401, 404, 405), where)
        status, _, _ = agent.request("GET", "/v1/no-such-route")
        self.assertEqual(status, 401, "no route, no key: 401 before saying which routes exist")
        status, _, _ = agent.request("GET", "/v1/no-such-route", headers={"Authorization": f"Bearer {KEY}"})
        self.assertEqual(status, 404)
