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


def test_the_readme_use_snippet_forks_decides_and_prints(caplog: pytest.LogCaptureFixture) -> None:
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
    forks = scope["forks"]
    assert [r.phase for r in forks.history] == ["cut", "cut", "end"]  # it decided within the run
    assert forks.decided and scope["model"] is forks.model
    assert forks.factor != 1.0  # 3e-4 is low for AdamW here: a challenger wins with confidence
    printed = out.getvalue().splitlines()
    assert len([line for line in printed if line.startswith("epoch ")]) == scope["epochs"]
    assert printed[-1] == f"the run ended at {forks.factor:g} x your lr"
    assert any("forks at step" in r.getMessage() for r in caplog.records)


def test_the_readmes_first_lines_say_where_the_default_cuts_are_decided() -> None:
    """The first paragraph names the steps at which the log shows each cut: a cut's annealed copies
    branch at its share of the run and are scored ``cool`` later (the demo logged 15% and 30% while
    the README said 10% and 25%)."""
    from hpx.forks import COOL, CUTS

    opening = README.read_text().split("\n\n")[1]
    said = " ".join(opening.split())
    for s, k in CUTS:
        assert f"to {k} at {round(100 * (s + COOL))}%" in said, (s, k, said)
        assert f"to {k} at {round(100 * s)}%" not in said  # where the copies branch, not the cut
    assert f"annealed over the {round(100 * COOL)}% before it" in said
