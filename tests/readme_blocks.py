"""README.md's named code blocks, run as a user would type them."""

from __future__ import annotations

from tests.jobs_scenario import fenced as readme_block


def run_readme_block(name: str, broker, monkeypatch) -> dict:
    """Run a python block with ``raymq.connect`` giving ``broker``; its variables."""
    import raymq

    monkeypatch.setattr(raymq, "connect", lambda *a, **k: broker, raising=False)
    scope: dict = {}
    exec(compile(readme_block(name), f"README.md ({name})", "exec"), scope)
    return scope
