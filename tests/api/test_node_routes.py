"""rolemesh/api/node_routes.py: the agent's own routes, called directly on a real
Node over fake children (the same routes over HTTP: tests/api/test_app.py,
tests/api/test_operator_routes.py)."""

from __future__ import annotations

import io
import json
from typing import Any, Dict, List, Optional

from twisted.trial.unittest import SynchronousTestCase
from twisted.web.test.requesthelper import DummyRequest

from rolemesh.api.keys import ApiKeys
from rolemesh.api.node_routes import MAX_LOG_TAIL, NodeRoutes
from rolemesh.api.readiness import Check, Readiness
from rolemesh.base.errors import ApiError
from rolemesh.node.reload import ReloadResult
from tests.node.test_node import NodeHarness


def request(args: Optional[Dict[bytes, List[bytes]]] = None, key: Optional[str] = None,
            body: bytes = b"") -> DummyRequest:
    r = DummyRequest([b""])
    r.args = args or {}
    if key is not None:
        r.requestHeaders.setRawHeaders(b"authorization", [f"Bearer {key}".encode()])
    r.content = io.BytesIO(body)
    return r


class NodeRoutesTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.h = NodeHarness(devices=2)
        self.keys = ApiKeys()
        self.routes = NodeRoutes(self.h.config, self.h.node, self.keys)

    def answer(self, r: DummyRequest, body: bytes) -> Any:
        self.assertEqual(r.responseHeaders.getRawHeaders(b"content-type"), [b"application/json"])
        return json.loads(body)

    def test_health(self) -> None:
        r = request()
        self.assertEqual(self.answer(r, self.routes.health(r)), {"status": "ok", "draining": False})
        self.assertEqual(r.responseCode, 200)

    def test_what_is_not_given_is_404(self) -> None:
        for route in (self.routes.ready, self.routes.reload, self.routes.registration, self.routes.metrics):
            with self.assertRaises(ApiError) as caught:
                route(request())
            self.assertEqual(caught.exception.status, 404, route)

    def test_ready_and_not(self) -> None:
        readiness = [Readiness((Check("devices", True, "2"),))]
        routes = NodeRoutes(self.h.config, self.h.node, self.keys, readiness=lambda: readiness[0])
        r = request()
        routes.ready(r)
        self.assertEqual(r.responseCode, 200)
        readiness[0] = Readiness((Check("devices", False, "none"),))
        r = request()
        routes.ready(r)
        self.assertEqual(r.responseCode, 503)

    def test_reload_says_what_failed_in_one_line(self) -> None:
        routes = NodeRoutes(self.h.config, self.h.node, self.keys,
                            reload=lambda why: ReloadResult(ok=False, error="models[0]: bad"))
        with self.assertRaises(ApiError) as caught:
            routes.reload(request())
        self.assertEqual((caught.exception.status, caught.exception.code, caught.exception.message),
                         (400, "invalid_config", "models[0]: bad"))

    def test_models_says_where_each_is_loaded(self) -> None:
        self.h.load("a", device="gpu:1")
        r = request()
        data = self.answer(r, self.routes.models(r))["data"]
        entry = next(e for e in data if e["id"] == "a")
        self.assertEqual((entry["loaded_on"], entry["loading_on"]), (["gpu:1"], []))
        self.assertEqual([e["loaded_on"] for e in data if e["id"] == "b"], [[]])

    def test_device_logs(self) -> None:
        self.h.load("a")
        self.h.child().output("one\n")
        r = request({b"tail": [b"1"]})
        self.assertEqual(self.answer(r, self.routes.device_logs(r, "gpu:0")), {"device": "gpu:0", "lines": ["one"]})
        with self.assertRaises(ApiError) as caught:
            self.routes.device_logs(request(), "gpu:9")
        self.assertEqual(caught.exception.code, "device_not_found")
        with self.assertRaises(ApiError) as caught:
            self.routes.device_logs(request({b"tail": [str(MAX_LOG_TAIL + 1).encode()]}), "gpu:0")
        self.assertEqual(caught.exception.code, "invalid_tail")

    def test_unload_answers_the_devices_state(self) -> None:
        d = self.routes.unload(request(), "gpu:1")
        body = json.loads(self.successResultOf(d))
        self.assertEqual((body["device"], body["state"]), ("gpu:1", "stopped"))
        self.failureResultOf(self.routes.unload(request(), "gpu:9"), ApiError)

    def test_a_key_is_needed_once_configured(self) -> None:
        self.keys.use(["k"])
        for route in (self.routes.models, self.routes.inventory, self.routes.registration, self.routes.metrics,
                      self.routes.reload):
            with self.assertRaises(ApiError) as caught:
                route(request())
            self.assertEqual(caught.exception.status, 401, route)
        r = request(key="k")
        self.assertEqual(self.answer(r, self.routes.inventory(r))["node_id"], self.h.config.node_id)
        self.failureResultOf(self.routes.load(request(body=b'{"model": "a"}'), "gpu:0"), ApiError)

    def test_use_config(self) -> None:
        import attr

        smaller = attr.evolve(self.h.config, max_request_body_bytes=5)
        self.routes.use_config(smaller)
        failure = self.failureResultOf(self.routes.load(request(body=b'{"model": "a"}'), "gpu:0"), ApiError)
        self.assertEqual(failure.value.status, 413)
