"""History: saved, loaded, printed, plotted; the `hpx report` command; the demo."""

from __future__ import annotations

import copy
import dataclasses
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

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


@pytest.fixture(scope="module")
def forks_history():
    """A Forks run 10x too low (SGD at 0.003 on a linear teacher): two cuts, and an end the 10x
    fork wins; the forks' lr multiples 0.1, 0.316, 1, 3.16, 10 and a dropout fork pair."""
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(0)
    x = torch.randn(512, 8, generator=g)
    y = x @ torch.randn(8, 1, generator=g)
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Dropout(0.1),
                              torch.nn.Linear(32, 1))
    forks = hpx.Forks(net, torch.optim.SGD(net.parameters(), lr=0.003), total_steps=100,
                      probe=[(x[400:], y[400:])], knobs=[hpx.Dropout(spread=0.05)], knob_start=0)
    for i in range(100):
        j = (32 * i) % 384
        forks.step(lambda r, b: F.mse_loss(r.model(b[0]), b[1]), (x[j:j + 32], y[j:j + 32]))
    assert forks.factor == 10.0
    return forks.history


def test_a_forks_history_is_printed_decision_by_decision(forks_history):
    lines = hpx.format_history(forks_history).splitlines()
    assert lines[0].split()[:5] == ["step", "phase", "lr", "lr", "factor"]
    rows = [line.split(maxsplit=5) for line in lines[1:]]
    assert [(int(r[0]), r[1]) for r in rows] == [(rec.step, rec.phase) for rec in forks_history]
    # the lr and multiple your run trains at after each decision: yours at the cuts, the winner's at the end
    assert [float(r[2]) for r in rows] == pytest.approx([0.003, 0.003, 0.03], rel=1e-4)
    assert [float(r[3]) for r in rows] == [1.0, 1.0, 10.0]
    first = forks_history[0]
    shown = [("1x", 0), ("0.1x", 1), ("10x", 4), ("1x, dropout 0.05", 5), ("1x, dropout 0.15", 6)]
    for name, i in shown:  # a knob is named where a fork moved it from your value
        assert f"{name} {first.scores[i]:.4g}" in lines[1]
    end = forks_history[-1].metrics
    assert f"(gain {end['gain']:.3g} standard errors; bar {end['bar']:.3g})" in lines[-1]


def test_a_record_saved_before_the_bar_was_kept_shows_its_gain_alone(forks_history):
    """A history written before ``metrics["bar"]`` (the gain alone) still reads, showing what it has."""
    import dataclasses

    old = [dataclasses.replace(r, metrics={"gain": r.metrics["gain"]} if r.metrics else None)
           for r in forks_history]
    last = hpx.format_history(old).splitlines()[-1]
    assert last.endswith(f"(gain {old[-1].metrics['gain']:.3g} standard errors)")
    assert "bar" not in last


def test_a_forks_plot_shows_your_run_and_names_every_forks_probe_loss(forks_history, tmp_path, monkeypatch):
    import matplotlib.pyplot as plt

    figures = []
    monkeypatch.setattr(plt, "close", figures.append)  # keep the figure plot_history draws
    hpx.plot_history(forks_history, tmp_path / "f.png")
    lr_ax, _, _, score_ax = figures[0].axes
    yours = next(line for line in lr_ax.get_lines() if line.get_label() == "your run")
    assert list(yours.get_ydata()) == pytest.approx([0.003, 0.003, 0.03], rel=1e-4)
    assert yours.get_drawstyle() == "steps-post"  # your run trains at 1x until the end decides
    named = {(t.get_text(), t.xy) for t in score_ax.texts}
    assert named == {(name, (r.step, s)) for r in forks_history
                     for name, s in zip(hpx.history._fork_labels(r), r.scores) if math.isfinite(s)}
    assert score_ax.get_ylabel() == "probe loss"


def test_report_command(history, tmp_path, capsys):
    path = hpx.save_history(history, tmp_path / "h.json")
    assert main(["report", str(path), "--plot", str(tmp_path / "r.png")]) == 0
    out = capsys.readouterr().out
    assert "lr" in out and (tmp_path / "r.png").exists()
    assert main(["report", str(tmp_path / "missing.json")]) == 2
    assert "cannot read" in capsys.readouterr().err


def test_report_needs_no_torch_and_says_when_matplotlib_is_missing(history, tmp_path):
    path = hpx.save_history(history, tmp_path / "h.json")
    probe = ("import sys; from hpx.cli import main; code = main(['report', sys.argv[1]]); "
             "print('torch imported' if 'torch' in sys.modules else 'no torch'); sys.exit(code)")
    out = subprocess.run([sys.executable, "-c", probe, str(path)], capture_output=True, text=True,
                         timeout=60, check=True).stdout
    assert out.strip().endswith("no torch") and "lr" in out
    no_mpl = ("import sys; sys.modules['matplotlib'] = None; from hpx.cli import main; "
              "sys.exit(main(['report', sys.argv[1], '--plot', sys.argv[2]]))")
    run = subprocess.run([sys.executable, "-c", no_mpl, str(path), str(tmp_path / "p.png")],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and "Traceback" not in run.stderr
    assert run.stderr.strip() == ("hpx: --plot needs matplotlib: pip install matplotlib "
                                  "(or the hpx-hdet[plot] extra)")


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0 and capsys.readouterr().out.strip() == f"hpx {hpx.__version__}"


def test_help_is_plain_text(capsys):
    """``hpx --help`` is read in a terminal: no reStructuredText markup from the docstrings."""
    for argv in (["--help"], ["report", "--help"]):
        with pytest.raises(SystemExit) as exit_:
            main(argv)
        out = capsys.readouterr().out
        assert exit_.value.code == 0 and "``" not in out and ":func:" not in out and "hpx.save_history" in out


def test_demo_raises_a_low_lr(tmp_path):
    """The README's demo, shortened: it runs, the lr rises from its low start (hpx.Forks keeps a
    challenger above it), and it reports hpx's and plain training's test metrics and plots the
    forks (a history whose records hold 5, 3, then 2 of them)."""
    out = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "digits.py"), "--steps", "300", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=120, check=True,
    ).stdout
    start, end = out.split("\nlr ")[1].split(";")[0].split(" -> ")
    assert float(start) == 0.03 and float(end) > 0.06
    hpx_acc = float(out.split("hpx.Forks: test loss ")[1].split("accuracy ")[1].split(" ")[0])
    plain_acc = float(out.split("plain at lr 0.03: test loss ")[1].split("accuracy ")[1].split()[0])
    assert hpx_acc > 0.8 and 0 < plain_acc <= 1
    assert (tmp_path / "trajectories.png").exists() and (tmp_path / "history.json").exists()


# --- retention and the history file ----------------------------------------------------------


def _hist_engine(**kw) -> hpx.Engine:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 16), torch.nn.ReLU(), torch.nn.Linear(16, 10))
    return hpx.Engine(model, lambda m: torch.optim.SGD(m.parameters(), lr=0.1),
                      [hpx.LearningRate(spread=0.5)], replicas=2, sync_every=2, **kw)


def _hist_run(engine, batches, until):
    import torch.nn.functional as F

    while engine.step_count < until:
        x, y = batches[engine.step_count]
        engine.step(lambda rep, b: F.cross_entropy(rep.model(b[0]), b[1]), (x, y))


def test_history_limit_keeps_the_newest_and_the_file_keeps_all(tmp_path, digits, capsys):
    from tests._digits import data

    batches = data(digits, 12)
    log = tmp_path / "run" / "history.jsonl"  # the engine creates the directory
    engine = _hist_engine(history_limit=3, history_file=str(log))
    _hist_run(engine, batches, 12)
    assert [r.step for r in engine.history] == [8, 10, 12]
    assert [r["step"] for r in engine.state_dict()["history"]] == [8, 10, 12]
    full = hpx.load_history(log)
    assert [r.step for r in full] == [2, 4, 6, 8, 10, 12]
    assert full[-3:] == engine.history
    assert main(["report", str(log)]) == 0  # the report reads the file as it is
    assert capsys.readouterr().out.strip().splitlines()[-1].split()[0] == "12"
    unlimited = _hist_engine(history_limit=None)
    _hist_run(unlimited, batches, 12)
    assert [r.bases for r in unlimited.history] == [r.bases for r in full]


def test_history_file_after_a_resume_holds_one_line_per_sync(tmp_path, digits):
    from tests._digits import data

    batches = data(digits, 12)
    straight = tmp_path / "straight.jsonl"
    _hist_run(_hist_engine(history_file=str(straight)), batches, 12)
    log = tmp_path / "resumed.jsonl"
    first = _hist_engine(history_file=str(log))
    _hist_run(first, batches, 5)
    saved = copy.deepcopy(first.state_dict())  # at step 5; the run goes on to step 9, then dies
    _hist_run(first, batches, 9)
    assert [r.step for r in hpx.load_history(log)] == [2, 4, 6, 8]
    again = _hist_engine(history_file=str(log))
    again.load_state_dict(saved)
    assert [r.step for r in hpx.load_history(log)] == [2, 4]
    _hist_run(again, batches, 12)
    def timeless(path):
        return [dataclasses.replace(r, wall=None) for r in hpx.load_history(path)]

    assert timeless(log) == timeless(straight)


def test_history_limit_must_be_positive():
    with pytest.raises(hpx.ConfigError, match="history_limit"):
        _hist_engine(history_limit=0)


def test_a_fresh_run_starts_its_history_file_anew(tmp_path, digits):
    """A second run with the same history_file wrote after the first one's lines, so the report and
    the plot mixed two runs; a fresh run starts the file, a resumed one adds to it (above)."""
    from tests._digits import data

    batches = data(digits, 12)
    log = tmp_path / "h.jsonl"
    _hist_run(_hist_engine(history_file=str(log)), batches, 8)
    _hist_run(_hist_engine(history_file=str(log)), batches, 6)
    assert [r.step for r in hpx.load_history(log)] == [2, 4, 6]


def test_a_forks_record_shows_your_runs_lr_not_the_forks_mean(forks_history, tmp_path):
    """The INFO line, the progress bar and TensorBoard's hpx/applied/lr read your run's learning rate
    (they read the mean over the forks, which climbed while your run stayed)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    yours = [0.003, 0.003, 0.03]
    assert [r.run_lr() for r in forks_history] == pytest.approx(yours, rel=1e-4)
    assert forks_history[0].summary().startswith("lr 0.003,")
    board = hpx.TensorBoard(tmp_path / "tb")
    for r in forks_history:
        board(r)
    board.close()
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    assert [e.value for e in acc.Scalars("hpx/applied/lr")] == pytest.approx(yours, rel=1e-4)


def test_a_plot_path_without_a_suffix_is_returned_as_written(history, tmp_path, capsys):
    assert hpx.plot_history(history, tmp_path / "bare") == tmp_path / "bare.png"
    assert (tmp_path / "bare.png").exists()
    empty = hpx.save_history([], tmp_path / "empty.json")
    assert main(["report", str(empty), "--plot", str(tmp_path / "e.png")]) == 2
    assert "hpx: no plot: history is empty" in capsys.readouterr().err


def test_history_functions_given_the_run_or_a_path_say_what_to_pass(tmp_path, forks_history):
    class Run:
        history = forks_history

    with pytest.raises(TypeError, match=r"save_history takes the records, not the Run: pass its \.history"):
        hpx.save_history(Run(), tmp_path / "h.json")
    with pytest.raises(TypeError, match=r"plot_history takes the records, not a path: pass hpx\.load_hist"):
        hpx.plot_history("forks.json", tmp_path / "x.png")


def test_fork_names_that_would_overlap_are_spread_and_a_single_decision_is_drawn(forks_history, tmp_path,
                                                                                monkeypatch):
    """Five forks scoring alike at a cut wrote their names over each other; they are stacked a
    twentieth of the panel apart, around their points, and stay inside the panel. A history of one
    decision (a run stopped after its first cut) drew no line for your run: it has a marker."""
    import matplotlib.pyplot as plt

    from hpx.history import _spread

    ys = [0.0, 0.001, 0.002, 1.0]
    out = _spread(ys, 0.05)
    assert all(out[i + 1] - out[i] >= 0.05 - 1e-12 for i in range(len(out) - 1))
    assert out[3] == 1.0 and abs(sum(out[:3]) / 3 - 0.001) < 1e-12  # a crowded run is centred on its points
    figures = []
    monkeypatch.setattr(plt, "close", figures.append)
    hpx.plot_history(forks_history[:1], tmp_path / "one.png")
    score_ax = figures[0].axes[-1]
    yours = next(line for line in score_ax.get_lines() if line.get_label() == "your run")
    assert yours.get_marker() == "o"
    lo, hi = score_ax.get_ylim()
    assert all(lo <= t.get_position()[1] <= hi for t in score_ax.texts)


def test_the_report_marks_the_rows_whose_best_score_is_a_training_loss():
    """While autolr's search does not act (hold), a record's scores are training losses: the report's
    'best score' column switched meaning without a word (0.3496 at one step, 0.0385 at the next)."""
    rec = hpx.SyncRecord(step=10, bases={"lr": 1.0}, values={"lr": [1.0]}, scores=[0.35], searched=True)
    hold = dataclasses.replace(rec, step=11, scores=[0.04], searched=False)
    rows = hpx.format_history([rec, hold]).splitlines()[1:]
    assert not rows[0].endswith("(training loss)") and rows[1].endswith("0.0400 (training loss)")
