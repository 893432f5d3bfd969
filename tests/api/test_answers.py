"""rolemesh/api/answers.py: the JSON and error answers, the body checks, and
the error handlers Klein and the fast path answer failures with."""

from __future__ import annotations

import io
import json
from typing import Any, Dict, List, Optional, Tuple

from twisted.internet import defer
from twisted.logger import capturedLogs
from twisted.python.failure import Failure
from twisted.trial.unittest import SynchronousTestCase
from werkzeug.exceptions import MethodNotAllowed, NotFound
from werkzeug.routing import RequestRedirect

from rolemesh.api.answers import (
    ErrorAnswers,
    bad_request,
    error_answer,
    json_answer,
    parse_body,
    request_body,
)
from rolemesh.api.keys import ApiKeys
from rolemesh.base import errors
from rolemesh.base.errors import ApiError


class FakeRequest:
    """What the answers touch of a request: the status, headers, path, method."""

    def __init__(self, path: bytes = b"/x", method: bytes = b"GET", headers: Optional[Dict[bytes, bytes]] = None,
                 body: bytes = b"") -> None:
        self.path = path
        self.method = method
        self.code: Optional[int] = None
        self.headers_out: List[Tuple[bytes, bytes]] = []
        self._headers = headers or {}
        self.content = io.BytesIO(body)

    def setResponseCode(self, code: int, message: Optional[bytes] = None) -> None:  # noqa: N802
        self.code = code

    def setHeader(self, name: bytes, value: bytes) -> None:  # noqa: N802
        self.headers_out.append((name, value))

    def getHeader(self, name: bytes) -> Optional[bytes]:  # noqa: N802
        return self._headers.get(name)

    def header(self, name: bytes) -> Optional[bytes]:
        found = [v for n, v in self.headers_out if n == name]
        return found[-1] if found else None


def failure_of(exception: BaseException) -> Failure:
    try:
        raise exception
    except BaseException:
        return Failure()


class JsonAndErrorAnswerTests(SynchronousTestCase):
    def test_json_answer(self) -> None:
        request = FakeRequest()
        body = json_answer(request, 201, {"a": [1]})
        self.assertEqual((request.code, json.loads(body)), (201, {"a": [1]}))
        self.assertEqual(request.header(b"content-type"), b"application/json")

    def test_error_answer_has_the_status_shape_and_headers(self) -> None:
        request = FakeRequest()
        body = error_answer(request, errors.ApiError(429, "full", "server_error", "queue_full", 3))
        self.assertEqual(request.code, 429)
        self.assertEqual(json.loads(body), {"error": {"message": "full", "type": "server_error",
                                                      "code": "queue_full"}})
        self.assertEqual(request.header(b"retry-after"), b"3")

    def test_bad_request(self) -> None:
        error = bad_request("no", "why")
        self.assertEqual((error.status, error.type, error.code), (400, "invalid_request_error", "why"))


class RequestBodyTests(SynchronousTestCase):
    def test_the_body(self) -> None:
        self.assertEqual(request_body(FakeRequest(body=b"abc"), 10), b"abc")  # type: ignore[arg-type]

    def test_a_body_the_listener_did_not_keep_is_413(self) -> None:
        request = FakeRequest(body=b"")
        request.body_too_large = True  # type: ignore[attr-defined]  # what LimitedRequest sets
        with self.assertRaises(ApiError) as caught:
            request_body(request, 10)  # type: ignore[arg-type]
        self.assertEqual((caught.exception.status, caught.exception.code), (413, "request_too_large"))
        self.assertIn("10 bytes", caught.exception.message)


class ErrorAnswersTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.answers = ErrorAnswers(ApiKeys(["k"]), frozenset({b"/open"}))

    def answer(self, body: bytes) -> Dict[str, Any]:
        return json.loads(body)["error"]  # type: ignore[no-any-return]

    def test_api_error(self) -> None:
        request = FakeRequest()
        body = self.answers.api_error(request, failure_of(errors.ApiError(404, "gone", code="x")))  # type: ignore[arg-type]
        self.assertEqual((request.code, self.answer(body)["code"]), (404, "x"))

    def test_not_found_says_401_first(self) -> None:
        request = FakeRequest(b"/secret")
        body = self.answers.not_found(request, failure_of(NotFound()))  # type: ignore[arg-type]
        self.assertEqual((request.code, self.answer(body)["code"]), (401, "invalid_api_key"))
        request = FakeRequest(b"/secret", headers={b"authorization": b"Bearer k"})
        body = self.answers.not_found(request, failure_of(NotFound()))  # type: ignore[arg-type]
        self.assertEqual((request.code, self.answer(body)["message"]), (404, "no route /secret"))

    def test_not_allowed_names_the_methods_and_needs_no_key_on_an_open_path(self) -> None:
        request = FakeRequest(b"/open", b"POST")
        body = self.answers.not_allowed(request, failure_of(MethodNotAllowed(["GET"])))  # type: ignore[arg-type]
        self.assertEqual((request.code, self.answer(body)["code"]), (405, "method_not_allowed"))
        self.assertEqual(request.header(b"allow"), b"GET")
        request = FakeRequest(b"/closed", b"POST")
        self.answers.not_allowed(request, failure_of(MethodNotAllowed(["GET"])))  # type: ignore[arg-type]
        self.assertEqual(request.code, 401)

    def test_a_redirect_says_where_to(self) -> None:
        request = FakeRequest()
        self.answers.http_exception(request, failure_of(RequestRedirect("http://node/v1/models")))  # type: ignore[arg-type]
        self.assertEqual((request.code, request.header(b"location")), (308, b"http://node/v1/models"))

    def test_unexpected_is_a_logged_500_without_the_traceback(self) -> None:
        request = FakeRequest()
        with capturedLogs() as events:
            body = self.answers.unexpected(request, failure_of(ZeroDivisionError("boom")))  # type: ignore[arg-type]
        self.assertEqual((request.code, self.answer(body)["code"]), (500, "internal_error"))
        self.assertNotIn(b"boom", body)
        self.assertEqual([e["log_namespace"] for e in events], ["rolemesh.api"])
        self.flushLoggedErrors(ZeroDivisionError)

    def test_fast_error_answers_as_klein_and_lets_a_cancellation_through(self) -> None:
        request = FakeRequest()
        body = self.answers.fast_error(failure_of(errors.ApiError(400, "bad")), request)  # type: ignore[arg-type]
        self.assertEqual(request.code, 400)
        self.assertEqual(self.answer(body)["message"], "bad")
        cancelled = failure_of(defer.CancelledError())
        self.assertIs(self.answers.fast_error(cancelled, FakeRequest()), cancelled)  # type: ignore[arg-type]
        with capturedLogs():
            self.answers.fast_error(failure_of(KeyError("k")), request)  # type: ignore[arg-type]
        self.assertEqual(request.code, 500)
        self.flushLoggedErrors(KeyError)


class ParseBodyTests(SynchronousTestCase):
    def test_returns_the_payload(self) -> None:
        self.assertEqual(parse_body(b'{"model": "a", "x": [1]}', 100), {"model": "a", "x": [1]})

    def test_limit(self) -> None:
        with self.assertRaises(ApiError) as caught:
            parse_body(b'{"model": "a"}', 5)
        self.assertEqual(caught.exception.status, 413)

    def test_each_rejection_is_400(self) -> None:
        for body in (b"\xff", b"{", b"[]", b"{}", b'{"model": 1}', b'{"model": ""}', b"[" * 50000):
            with self.assertRaises(ApiError) as caught:
                parse_body(body, 1 << 20)
            self.assertEqual(caught.exception.status, 400, body[:20])
