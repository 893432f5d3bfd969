"""Replicas on purpose (issue 27): the config keys, and how the node uses them.

The scheduler's part (scale out under the cap, never past it) is
tests.test_scheduler.ReplicaTests and the state machine there.
"""

from __future__ import annotations

from twisted.trial.unittest import SynchronousTestCase

from rolemesh.config import validate
from rolemesh.errors import ConfigError

PLAIN = {"model_id": "plain", "path": "/models/plain.gguf"}


def models(*entries):
    return validate({"models": list(entries)}, check_files=False, environ={}).models


def error(entry) -> str:
    try:
        models(entry)
    except ConfigError as e:
        return str(e)
    raise AssertionError(f"no ConfigError for {entry}")


class ConfigTests(SynchronousTestCase):
    def test_defaults_keep_todays_behaviour(self) -> None:
        (model,) = models(PLAIN)
        self.assertEqual((model.min_replicas, model.max_replicas), (1, None))

    def test_values_are_kept(self) -> None:
        (model,) = models(dict(PLAIN, min_replicas=2, max_replicas=3))
        self.assertEqual((model.min_replicas, model.max_replicas), (2, 3))

    def test_mistakes_are_one_line_each(self) -> None:
        cases = [
            (dict(PLAIN, max_replicas=0), "models[0].max_replicas: expected a positive integer, got 0"),
            (dict(PLAIN, min_replicas="two"), 'models[0].min_replicas: expected a positive integer, got "two"'),
            (dict(PLAIN, min_replicas=3, max_replicas=2), "models[0].min_replicas: 3 is more than max_replicas (2)"),
            (dict(PLAIN, min_replicas=2, devices=["cpu0"]),
             "models[0].min_replicas: a model with `devices` runs on one device (or one group); "
             "drop min_replicas or devices"),
        ]
        for entry, message in cases:
            self.assertEqual(error(entry), message)
