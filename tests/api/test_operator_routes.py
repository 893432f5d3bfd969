"""Operator routes that warm or free a device, and the listener's 413 path:
the same queue and switch rules as requests."""

from __future__ import annotations

from typing import Any, List

from rolemesh.api.answers import request_body
from rolemesh.children.state import READY, STOPPED, STOPPING
from rolemesh.node.node import Lease
from tests.api.test_app import ApiTestCase


class LoadUnloadTests(ApiTestCase):
    top = {"max_pending_requests_per_device": 2}

    def test_load_then_unload(self) -> None:
        h = self.h
        d = h.send("POST", "/v1/node/devices/gpu:0/load", {"model": "a"})
        h.node_h.answer("alpha")
        answer = h.finish(d)
        self.assertEqual(answer.code, 200, answer.body)
        self.assertEqual((answer.json()["model"], answer.json()["state"]), ("a", READY))
        d = h.send("POST", "/v1/node/devices/gpu:0/unload")
        h.treq.flush()
        self.assertEqual(h.node_h.sup().state, STOPPING)
        h.node_h.reap()
        answer = h.finish(d)
        self.assertEqual((answer.code, answer.json()["state"]), (200, STOPPED))
        self.assertIsNone(h.node.scheduler.devices["gpu:0"].model)

    def test_load_by_role(self) -> None:
        d = self.h.send("POST", "/v1/node/devices/gpu:0/load", {"model": "summarize"})
        self.h.node_h.answer("b")
        self.assertEqual(self.h.finish(d).json()["model"], "b")

    def test_unload_waits_for_in_flight_requests(self) -> None:
        h = self.h
        h.node_h.load("a")
        held: List[Any] = []
        h.node.acquire(h.node_h.model("a")).addCallback(held.append)
        self.assertIsInstance(held[0], Lease)
        d = h.send("POST", "/v1/node/devices/gpu:0/unload")
        h.treq.flush()
        self.assertEqual(h.node_h.sup().state, READY, "not stopped under a request in flight")
        held[0].release()
        self.assertEqual(h.node_h.sup().state, STOPPING)
        h.node_h.reap()
        self.assertEqual(h.finish(d).code, 200)

    def test_unload_of_stopped_device(self) -> None:
        self.assertEqual(self.h.call("POST", "/v1/node/devices/gpu:0/unload").code, 200)

    def test_unknown_device_and_model(self) -> None:
        self.assertError(self.h.call("POST", "/v1/node/devices/gpu:9/load", {"model": "a"}), 404, "device_not_found")
        self.assertError(self.h.call("POST", "/v1/node/devices/gpu:9/unload"), 404, "device_not_found")
        self.assertError(self.h.call("POST", "/v1/node/devices/gpu:0/load", {"model": "zz"}), 404, "model_not_found")
        self.assertError(self.h.call("POST", "/v1/node/devices/gpu:0/load", b"[]"), 400)

    def test_load_queue_full_is_429(self) -> None:
        h = self.h
        h.node_h.load("a")
        for _ in range(2):
            h.node.acquire(h.node_h.model("a"))
        answer = h.call("POST", "/v1/node/devices/gpu:0/load", {"model": "b"})
        self.assertError(answer, 429, "queue_full")
        self.assertError(h.call("POST", "/v1/node/devices/gpu:0/unload"), 429, "queue_full")


class AuthOnOperatorRoutesTests(ApiTestCase):
    keys = ("k1",)

    def test_key_required(self) -> None:
        self.assertError(self.h.call("POST", "/v1/node/devices/gpu:0/unload", key=None), 401, "invalid_api_key")
        self.assertEqual(self.h.call("POST", "/v1/node/devices/gpu:0/unload").code, 200)


class BodyDiscardedByListenerTests(ApiTestCase):
    def test_body_too_large_flag_is_413(self) -> None:
        from twisted.web.test.requesthelper import DummyRequest

        request = DummyRequest([b""])
        request.body_too_large = True  # what rolemesh.http.listener.LimitedRequest sets
        error = None
        try:
            request_body(request, self.h.config.max_request_body_bytes)
        except Exception as e:  # noqa: BLE001
            error = e
        self.assertEqual((error.status, error.code), (413, "request_too_large"))  # type: ignore[union-attr]


class RefusedConnectionTests(ApiTestCase):
    """A child that died a moment before the supervisor heard of it: the
    connection is refused, nothing was sent, so the request goes to a fresh
    child once."""

    def setUp(self) -> None:
        super().setUp()
        from twisted.internet.error import ConnectionRefusedError

        from tests.api.test_app import json_answer

        self.refusals = 1

        def answer(attempt: Any) -> Any:
            if self.refusals > 0:
                self.refusals -= 1
                attempt.fail(ConnectionRefusedError("127.0.0.1", 1))
                return None
            return json_answer(attempt)

        self.h.agent.auto = answer

    def test_refused_once_is_retried_on_a_fresh_child(self) -> None:
        h = self.h
        h.node_h.load("a")
        old_pid = h.node_h.sup().pid
        h.node_h.probe.ready = set()  # the child is dead: its probe fails
        d = h.send("POST", "/v1/chat/completions", {"model": "a", "messages": []})
        h.treq.flush()
        h.node_h.reap()  # ... so it is stopped and reaped, and a fresh one starts
        h.node_h.answer("alpha")
        answer = h.finish(d)
        self.assertEqual(answer.code, 200, answer.body)
        self.assertNotEqual(h.node_h.sup().pid, old_pid)
        self.assertEqual(len(h.agent.attempts), 2)

    def test_refused_twice_is_502(self) -> None:
        h = self.h
        self.refusals = 2
        h.node_h.load("a")
        h.node_h.probe.ready = set()
        d = h.send("POST", "/v1/chat/completions", {"model": "a", "messages": []})
        h.treq.flush()
        h.node_h.reap()
        h.node_h.answer("alpha")
        self.assertError(h.finish(d), 502, "upstream_error")
        self.assertTrue(h.node.scheduler.is_idle("gpu:0"), "the slot was released")


class UnknownRoutesNeedAKeyTests(ApiTestCase):
    keys = ("k1",)

    def test_401_before_404_or_405(self) -> None:
        self.assertError(self.h.call("GET", "/v1/secret-route", key=None), 401, "invalid_api_key")
        self.assertError(self.h.call("DELETE", "/v1/models", key=None), 401, "invalid_api_key")
        self.assertError(self.h.call("GET", "/v1/secret-route"), 404, "not_found")
        self.assertError(self.h.call("DELETE", "/v1/models"), 405, "method_not_allowed")
        self.assertError(self.h.call("POST", "/health", key=None), 405, "method_not_allowed")
