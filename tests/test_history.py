"""History: saved, loaded, printed, plotted; the `hpx report` command; the demo."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest

import hpx
from hpx.cli import main
from tests.test_engine import batches, ce, mlp, sgd

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def history(digits):
    engine = hpx.Engine(mlp(dropout=0.1), sgd(0.05), [hpx.LearningRate(spread=0.5), hpx.Dropout(spread=0.05)],
                        replicas=3, sync_every=4)

    def nan_once(rep, b):
        loss = ce(rep, b)
        return loss * float("nan") if rep.index == 1 and engine.step_count == 5 else loss

    for b in batches(digits, 12):
        engine.step(nan_once, b)
    return engine.history


def test_save_load_round_trip(history, tmp_path):
    path = hpx.save_history(history, tmp_path / "h.json")
    back = hpx.load_history(path)
    assert [r.bases for r in back] == [r.bases for r in history]
    assert math.isnan(back[1].scores[1]) and back[1].nonfinite == [1]


def test_format_history_rows(history):
    text = hpx.format_history(history, every=2)
    lines = text.splitlines()
    assert lines[0].split()[:3] == ["step", "lr", "dropout"]
    assert [int(line.split()[0]) for line in lines[1:]] == [4, 12]
    assert hpx.format_history([]) == "(no syncs yet)"


def test_plot_writes_a_png(history, tmp_path):
    png = hpx.plot_history(history, tmp_path / "p.png", title="t")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000
    with pytest.raises(ValueError, match="empty"):
        hpx.plot_history([], tmp_path / "q.png")


def test_report_command(history, tmp_path, capsys):
    path = hpx.save_history(history, tmp_path / "h.json")
    assert main(["report", str(path), "--plot", str(tmp_path / "r.png")]) == 0
    out = capsys.readouterr().out
    assert "lr" in out and (tmp_path / "r.png").exists()
    assert main(["report", str(tmp_path / "missing.json")]) == 2
    assert "cannot read" in capsys.readouterr().err


def test_demo_raises_a_low_lr(tmp_path):
    """The README's demo, shortened: it runs, the lr rises from its low start, and it reports
    hpx's and plain training's test metrics."""
    out = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "digits.py"), "--steps", "300", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=120, check=True,
    ).stdout
    start, end = out.split("\nlr ")[1].split(" (")[0].split(" -> ")
    assert float(start) == 0.03 and float(end) > 0.06
    hpx_acc = float(out.split("hpx.autolr: test loss ")[1].split("accuracy ")[1].split(" ")[0])
    plain_acc = float(out.split("plain at lr 0.03: test loss ")[1].split("accuracy ")[1].split()[0])
    assert hpx_acc > 0.8 and 0 < plain_acc <= 1
    assert (tmp_path / "trajectories.png").exists() and (tmp_path / "history.json").exists()
