"""What the dispatcher protocol's answers mean (rolemesh.fleet.protocol): pure."""

from __future__ import annotations

from twisted.trial.unittest import SynchronousTestCase

from rolemesh.fleet import dispatcher
from rolemesh.fleet import protocol as dispatcher_protocol
from rolemesh.fleet.protocol import (
    AUTH,
    FORGOTTEN,
    MAX_ASKED_INTERVAL_S,
    MIN_ASKED_INTERVAL_S,
    OK,
    REJECTED,
    TRANSIENT,
    asked_interval,
    classify,
    json_object,
    without_userinfo,
)


class ClassifyTests(SynchronousTestCase):
    def test_table(self) -> None:
        table = [
            ("register", None, TRANSIENT), ("register", 200, OK), ("register", 201, OK),
            ("heartbeat", 204, OK), ("heartbeat", 404, FORGOTTEN), ("heartbeat", 410, FORGOTTEN),
            ("register", 404, REJECTED), ("register", 410, REJECTED), ("deregister", 404, FORGOTTEN),
            ("heartbeat", 401, AUTH), ("register", 403, AUTH), ("heartbeat", 500, TRANSIENT),
            ("heartbeat", 502, TRANSIENT), ("register", 503, TRANSIENT), ("heartbeat", 429, TRANSIENT),
            ("heartbeat", 408, TRANSIENT), ("register", 400, REJECTED), ("register", 422, REJECTED),
            ("register", 301, REJECTED), ("heartbeat", 405, REJECTED),
        ]
        for kind, code, expected in table:
            self.assertEqual(classify(kind, code), expected, (kind, code))


    def test_events_forgotten_only_on_410_and_404_is_a_refusal(self) -> None:
        """404 on the events route means a dispatcher without it (a verdict of
        the deltas), not a node it forgot."""
        self.assertEqual(classify("events", 410), FORGOTTEN)
        self.assertEqual(classify("events", 404), REJECTED)
        self.assertEqual(classify("events", 204), OK)


class AskedIntervalTests(SynchronousTestCase):
    def test_clamped_to_the_bounds(self) -> None:
        self.assertEqual(asked_interval('{"heartbeat_interval_s": 12}'), 12.0)
        self.assertEqual(asked_interval('{"heartbeat_interval_s": 0}'), MIN_ASKED_INTERVAL_S)
        self.assertEqual(asked_interval('{"heartbeat_interval_s": 86400}'), MAX_ASKED_INTERVAL_S)

    def test_anything_but_a_number_asks_nothing(self) -> None:
        for body in ("", "[]", "null", '{"heartbeat_interval_s": true}', '{"heartbeat_interval_s": NaN}',
                     '{"heartbeat_interval_s": null}', '{"other": 5}', "{not json"):
            self.assertIsNone(asked_interval(body), body)

    def test_json_object_is_a_dict_or_empty(self) -> None:
        self.assertEqual(json_object('{"a": 1}'), {"a": 1})
        for body in ("", "[1]", '"s"', "{"):
            self.assertEqual(json_object(body), {}, body)


class UrlTests(SynchronousTestCase):
    def test_userinfo_is_removed_and_the_rest_kept(self) -> None:
        self.assertEqual(without_userinfo("https://u:p@d.example:9/a/b?c"), "https://d.example:9/a/b?c")
        self.assertEqual(without_userinfo("http://d.example"), "http://d.example")
        self.assertEqual(without_userinfo("not a url"), "not a url")


class ReExportTests(SynchronousTestCase):
    def test_the_client_module_still_names_what_it_named(self) -> None:
        for name in ("classify", "asked_interval", "plaintext_off_loopback", "RequestKind", "Outcome",
                     "DispatcherState", "REGISTER_PATH", "HEARTBEAT_PATH", "DEREGISTER_PATH", "EVENTS_PATH",
                     "MIN_ASKED_INTERVAL_S", "MAX_ASKED_INTERVAL_S", "COALESCE_S", "UNREGISTERED", "REGISTERED",
                     "UNREACHABLE", "OK", "FORGOTTEN", "AUTH", "REJECTED", "TRANSIENT"):
            self.assertIs(getattr(dispatcher, name), getattr(dispatcher_protocol, name), name)
