"""The load test (``bench/load_test.py``) in a short form, so CI runs it too:
concurrent streaming clients well past the pending limit, every request a
success or a 429, none hung or lost, the agent's memory back to its baseline."""

from __future__ import annotations

import os
import subprocess
import sys

from twisted.trial.unittest import SynchronousTestCase

from tests.integration.harness import require_llama_server

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LOAD_TEST = os.path.join(ROOT, "bench", "load_test.py")


class ShortLoadTest(SynchronousTestCase):
    def test_short_load_passes(self) -> None:
        require_llama_server()
        args = ["--clients", "12", "--pending", "2", "--duration", "6", "--warmup", "2", "--settle", "3",
                "--hang-timeout", "20"]
        done = subprocess.run([sys.executable, LOAD_TEST, *args], cwd=ROOT, stdin=subprocess.DEVNULL,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=120)
        output = done.stdout.decode("utf-8", "replace")
        self.assertEqual(done.returncode, 0, output)
        self.assertIn("PASS", output)
