"""rolemesh.base.enums: named states read exactly as the bare strings they replaced."""

from __future__ import annotations

import json

from twisted.logger import formatEvent
from twisted.trial.unittest import SynchronousTestCase

from rolemesh.api.readiness import decide
from rolemesh.fleet.dispatcher import DispatcherState, Outcome, RequestKind
from rolemesh.scheduling.books import TicketState


class StrEnumTests(SynchronousTestCase):
    def test_every_member_is_its_value_wherever_shown(self) -> None:
        for enum in (DispatcherState, Outcome, RequestKind, TicketState):
            for member in enum:
                value = member.value
                self.assertEqual(member, value)
                self.assertEqual(str(member), value)
                self.assertEqual(f"{member}", value)
                self.assertEqual(f"{member:>20}", f"{value:>20}")
                self.assertEqual(json.dumps({member: member}), json.dumps({value: value}))
                self.assertEqual(formatEvent({"log_format": "{s}", "s": member}), value)
                self.assertEqual(hash(member), hash(value))

    def test_the_ready_body_names_the_state_as_before(self) -> None:
        body = decide(listening=True, devices=1, preloading=0, draining=False,
                      dispatcher_state=DispatcherState.UNREACHABLE).to_json()
        self.assertEqual(json.loads(json.dumps(body))["failing"],
                         "dispatcher: not registered with the dispatcher (unreachable)")
