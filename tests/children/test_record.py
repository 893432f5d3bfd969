"""A supervisor's record: counting and state changes are told, once each."""

from __future__ import annotations

from typing import Any, List, Tuple

from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from rolemesh.base.events import Events
from rolemesh.children.process import OutputRing
from rolemesh.children.record import CHILD_STATE, DeviceRecord
from rolemesh.children.restart_policy import RestartPolicy
from rolemesh.children.state import READY, STARTING


class Record(DeviceRecord):
    def __init__(self) -> None:
        self.name, self.events, self.output, self.policy = "gpu:0", Events(), OutputRing(), RestartPolicy()
        self._reactor = Clock()  # type: ignore[assignment]
        self.changes = 0
        self._init_record()

    def _state_changed(self) -> None:
        self.changes += 1


class DeviceRecordTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.record = Record()
        self.told: List[Tuple[str, Any]] = []
        self.record.events.subscribe(lambda event, **fields: self.told.append((event, fields.get("state"))))

    def test_a_change_is_told_and_hooked_once_a_same_state_not_at_all(self) -> None:
        self.record._set_state(STARTING)
        self.record._set_state(STARTING)
        self.assertEqual((self.told, self.record.changes), ([(CHILD_STATE, STARTING)], 1))

    def test_told_only_once_the_transition_is_over(self) -> None:
        self.record._outbox.enter()
        self.record._count("load", seconds=1.0)
        self.assertEqual((self.record.loads, self.told), (1, []))
        self.record._outbox.leave()
        self.assertEqual(self.told, [("load", None)])

    def test_an_error_is_stamped_and_cleared(self) -> None:
        self.record._reactor.advance(5)  # type: ignore[union-attr]
        self.record._note_error("unhealthy", "the probe failed")
        self.assertEqual((self.record.last_error_code, self.record.last_error_at), ("unhealthy", 5))
        self.record._note_error(None, None)
        self.assertEqual((self.record.last_error, self.record.last_error_at), (None, None))

    def test_no_endpoint_unless_ready_with_a_port(self) -> None:
        self.assertIsNone(self.record.endpoint)
        self.record.state = READY
        self.assertIsNone(self.record.endpoint)
