"""The stack files that docs/ commands use are in the repository and resolve."""

from __future__ import annotations

from pathlib import Path

import pytest

from dynaspec.runtime.stacks import resolve_stack

DOCS = Path(__file__).resolve().parent.parent / "docs"


@pytest.mark.parametrize("path", sorted((DOCS / "stacks").glob("*.toml")), ids=lambda p: p.name)
def test_docs_stack_files_resolve(path):
    stack = resolve_stack(str(path))
    assert stack.name and stack.target in ("gemma3-270m", "qwen2.5-coder-0.5b")


def test_every_toml_named_in_docs_is_there():
    import re

    named = {m for doc in DOCS.glob("*.md") if doc.name != "history.md"
             for m in re.findall(r"docs/stacks/([\w.-]+\.toml)", doc.read_text())}
    missing = sorted(n for n in named if not (DOCS / "stacks" / n).exists())
    assert missing == []
