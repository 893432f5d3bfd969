"""The lanes: their books, which overlap, and a choice that changes nothing."""

from __future__ import annotations

from twisted.trial.unittest import SynchronousTestCase

from rolemesh.scheduling.books import QueueFull, Ticket
from rolemesh.scheduling.lanes import Lanes


class LanesTests(SynchronousTestCase):
    def test_a_group_overlaps_its_members_and_they_it(self) -> None:
        lanes = Lanes(["a", "b", "c"], {"ab": ["a", "b"]})
        overlaps = {name: [o.name for o in books] for name, books in lanes.overlaps.items()}
        self.assertEqual(overlaps, {"a": ["ab"], "b": ["ab"], "c": [], "ab": ["a", "b"]})
        self.assertEqual((lanes.devices["ab"].members, lanes.devices["ab"].is_group), (("a", "b"), True))

    def test_a_group_of_unknown_devices_or_of_none_is_refused(self) -> None:
        self.assertRaises(ValueError, Lanes, ["a"], {"ax": ["a", "x"]})
        self.assertRaises(ValueError, Lanes, ["a"], {"g": []})

    def test_choosing_reads_the_books_and_changes_none(self) -> None:
        lanes = Lanes(["a", "b"])
        lanes.devices["b"].model = "m"
        before = [(b.model, len(b.queue), len(b.running)) for b in lanes.devices.values()]
        self.assertEqual(lanes.choose("m", 2).name, "b")
        self.assertEqual(lanes.choose("other", 2).name, "a")  # one that holds no model
        self.assertEqual([(b.model, len(b.queue), len(b.running)) for b in lanes.devices.values()], before)

    def test_no_room_below_the_limit_is_queue_full(self) -> None:
        lanes = Lanes(["a"])
        lanes.devices["a"].running.append(Ticket(1, "m", device="a"))
        self.assertRaises(QueueFull, lanes.choose, "m", 1)
        self.assertEqual(lanes.choose("m", 2).name, "a")

    def test_what_an_overlapping_lane_holds_counts_as_freed(self) -> None:
        lanes = Lanes(["a", "b"], {"ab": ["a", "b"]})
        group, a = lanes.devices["ab"], lanes.devices["a"]
        group.free_memory, a.held = 10, 5
        self.assertEqual((lanes.fits(group, 15), lanes.fits(group, 16), lanes.fits(group, None)), (True, False, True))
