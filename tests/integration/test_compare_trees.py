"""``bench/compare_trees.py`` (the A/B of two agent trees that
docs/performance.md quotes) in a short form, so CI runs it too."""

from __future__ import annotations

import os
import re
import subprocess
import sys

from twisted.trial.unittest import SynchronousTestCase

from tests.integration.harness import require_llama_server

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class CompareTreesTest(SynchronousTestCase):
    def test_a_tree_against_itself(self) -> None:
        require_llama_server()
        done = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "compare_trees.py"), ROOT, ROOT,
                               "--blocks", "2", "--requests", "5"], cwd=ROOT, stdin=subprocess.DEVNULL,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=120)
        output = done.stdout.decode("utf-8", "replace")
        self.assertEqual(done.returncode, 0, output)
        for side in "AB":
            self.assertRegex(output, rf"(?m)^{side} .*: median \d+\.\d{{4}} ms per request")
        ratio = float(re.search(r"B / A: median of 2 block ratios (\d+\.\d+)", output).group(1))  # type: ignore[union-attr]
        self.assertGreater(ratio, 0)
