"""README.md's named code blocks, run as a user would type them."""

from __future__ import annotations

import os

README = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")


def readme_block(name: str) -> str:
    """The text of README.md's block opened by ```` ```name ````, e.g. "python addresses"."""
    with open(README) as f:
        text = f.read()
    start = text.index(f"```{name}\n") + len(f"```{name}\n")
    return text[start : text.index("```\n", start)]


def run_readme_block(name: str, broker, monkeypatch) -> dict:
    """Run a python block with ``raymq.connect`` giving ``broker``; its variables."""
    import raymq

    monkeypatch.setattr(raymq, "connect", lambda *a, **k: broker, raising=False)
    scope: dict = {}
    exec(compile(readme_block(name), f"README.md ({name})", "exec"), scope)
    return scope
