"""The README's "Use" snippet, run as written: a newcomer who pastes it sees the search act."""

from __future__ import annotations

import contextlib
import io
import logging
import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"


def _use_snippet() -> str:
    """The first python block under the README's "## Use" heading."""
    text = README.read_text()
    section = text[text.index("\n## Use\n"):]
    match = re.search(r"```python\n(.*?)```", section, re.S)
    assert match, "the README's Use section has no python block"
    return match.group(1)


def test_the_readme_use_snippet_syncs_moves_the_lr_and_prints(caplog: pytest.LogCaptureFixture) -> None:
    code = _use_snippet()
    assert "basicConfig" in code  # a logging line that prints: getLogger(...).setLevel alone does not
    out = io.StringIO()
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    try:
        with contextlib.redirect_stdout(out), caplog.at_level(logging.INFO, logger="hpx"):
            scope: dict[str, object] = {"__name__": "__readme__"}
            exec(compile(code, str(README), "exec"), scope)  # the README's own code
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)
    engine = scope["engine"]
    assert len(engine.history) > 0  # it synced within the run it was told about
    assert engine.bases["lr"] != 1.0  # and the search moved the learning rate
    printed = out.getvalue().splitlines()
    assert len([line for line in printed if line.startswith("epoch ")]) == scope["epochs"]
    assert any("sync at step" in r.getMessage() for r in caplog.records)
