"""The chat template names llama-server knows, and the flags a model's
``chat_template`` field sets (pure, no imports of the agent's).

The config's check (``chat_template``: :mod:`rolemesh.config.file`) and what the
agent says of a model's template (:mod:`rolemesh.children.chat_templates`, which
reads the GGUF header) both use these; :mod:`rolemesh.config.file` sits below the
header reader, so the names live here, below both.
"""

from __future__ import annotations

#: The built-in templates of this llama-server (``llama-server --help``,
#: ``--chat-template``).
BUILT_IN = frozenset("""
bailing bailing-think bailing2 chatglm3 chatglm4 chatml command-r deepseek deepseek-ocr deepseek2
deepseek3 exaone-moe exaone3 exaone4 falcon3 gemma gigachat glmedge gpt-oss granite granite-4.0
granite-4.1 grok-2 hunyuan-dense hunyuan-moe hunyuan-vl kimi-k2 llama2 llama2-sys llama2-sys-bos
llama2-sys-strip llama3 llama4 megrez minicpm mistral-v1 mistral-v3 mistral-v3-tekken mistral-v7
mistral-v7-tekken monarch openchat orion pangu-embedded phi3 phi4 rwkv-world seed_oss smolvlm
solar-open vicuna vicuna-orca yandex zephyr
""".split())

#: What llama-server uses when the GGUF has no template and none is set.
FALLBACK = "chatml"

#: The flags the field sets (``server_args`` may not set them again).
FLAGS = ("chat-template", "chat-template-file")

#: The endings that make a ``chat_template`` value read as a file path (as does a ``/``).
FILE_SUFFIXES = (".jinja", ".j2", ".jinja2", ".tmpl", ".txt")


def is_file(value: str) -> bool:
    """A ``chat_template`` value names a file (not a built-in name)."""
    return value not in BUILT_IN
