#!/usr/bin/env python3
"""Print the configuration key tables that ``docs/configuration.md`` holds.

The tables come from ``rolemesh.config.file.TOP_LEVEL_KEYS`` and ``MODEL_KEYS``,
which are read off the key declarations (``key(...)`` / ``derived(...)``
fields of ``NodeConfig`` and ``ModelConfig``): one declaration per key gives
its check, its record default and its row here.  After changing a
declaration, run this from the repository root to rewrite the two tables in
``docs/configuration.md`` in place (without ``--write`` it prints them)::

    python docs/gen_config_doc.py --write

``tests/test_docs.py`` fails while a table in the document differs from what
this script prints, so the document and the code cannot drift apart.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # run as a script from a checkout
    sys.path.insert(0, ROOT)

from rolemesh.config.file import MODEL_KEYS, TOP_LEVEL_KEYS, KeyDoc  # noqa: E402

HEADER = ("key", "type", "default", "meaning")


def cell(text: str) -> str:
    """Markdown table cell text: a ``|`` (even inside backticks) would split the cell."""
    return text.replace("|", "\\|")


def table(keys: Iterable[KeyDoc]) -> str:
    """One Markdown table, a row per key, ending in a newline."""
    lines = ["| " + " | ".join(HEADER) + " |", "|" + " --- |" * len(HEADER)]
    for key in keys:
        lines.append(f"| `{key.name}` | {cell(key.type)} | {cell(key.default)} | {cell(key.meaning)} |")
    return "\n".join(lines) + "\n"


def tables() -> dict[str, str]:
    """Section title -> generated table, in document order."""
    return {
        "Top-level keys": table(TOP_LEVEL_KEYS),
        "Model keys (`models[]` entries)": table(MODEL_KEYS),
    }


DOC = os.path.join(ROOT, "docs", "configuration.md")


def rewrite(document: str) -> str:
    """``document`` with each section's first table replaced by the generated one."""
    for title, text in tables().items():
        start = document.index(f"## {title}\n")
        begin = document.index("| key |", start)
        end = document.find("\n\n", begin)
        end = len(document) if end < 0 else end + 1
        document = document[:begin] + text + document[end:]
    return document


def main() -> None:
    if sys.argv[1:] == ["--write"]:
        with open(DOC, encoding="utf-8") as f:
            document = f.read()
        with open(DOC, "w", encoding="utf-8") as f:
            f.write(rewrite(document))
        return
    for title, text in tables().items():
        print(f"## {title}\n")
        print(text)


if __name__ == "__main__":
    main()
