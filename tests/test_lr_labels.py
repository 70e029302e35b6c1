"""Under autolr the knob named "lr" is a factor on the optimizer's learning rates (a
LearningRateScale): every surface shows the learning rate the optimizer used as "lr" and the
knob as "lr factor" (issue 21, item 5): the records, the INFO log line, the progress bar,
``hpx report``, the plot and TensorBoard."""

from __future__ import annotations

import dataclasses
import json
import logging

import pytest
import torch

import hpx
from hpx.cli import main
from tests._board import written
from tests._digits import ce, data, mlp

LR = 0.003  # the optimizer's lr: the factor the search finds multiplies it
STEPS = 12


def _shape(t: int) -> float:
    return 1.0 - t / 200  # a schedule: the lr used is LR x factor x shape, not LR x base


def _run(digits, groups=None):
    """A short autolr run; each step's learning rate as the optimizer held it."""
    model = mlp()
    opt = torch.optim.SGD(groups(model) if groups else model.parameters(), lr=LR)
    engine = hpx.autolr(model, opt, total_steps=100, schedule=_shape, probe=data(digits, 1, seed=9),
                        loss_fn=ce)
    used: dict[int, list[float]] = {}

    def loss_fn(rep, b):
        used[engine.step_count] = [g["lr"] for g in rep.optimizer.param_groups]
        return ce(rep, b)

    for b in data(digits, STEPS):
        engine.step(loss_fn, b)
    return engine, used


def _labelled(engine: hpx.Engine) -> list[hpx.SyncRecord]:
    """The run's records as the engine keeps them once it labels them (engine.py calls
    ``self.knobs.label_lr(rec)`` when it builds a record)."""
    out = [dataclasses.replace(r) for r in engine.history]
    for r in out:
        engine.knobs.label_lr(r)
    return out


@pytest.fixture(scope="module")
def run(digits):
    engine, used = _run(digits)
    hist = _labelled(engine)
    assert len(hist) >= 3 and any(r.bases["lr"] != 1.0 for r in hist)  # the factor moved
    return engine, used, hist


def test_a_record_holds_the_lr_the_optimizer_used(run, digits):
    _, used, hist = run
    for r in hist:
        assert r.lr_factor == "lr"
        assert r.lr == pytest.approx([used[r.step - 1][0]], rel=1e-12)  # the interval's last step
        assert r.lr != pytest.approx(r.applied["lr"])  # not the factor
    # the first group with a nonzero lr (a frozen group 0 at lr 0 says nothing)
    engine, used = _run(digits, lambda m: [{"params": m[0].parameters(), "lr": 0.0},
                                           {"params": m[2].parameters()}])
    rec = _labelled(engine)[-1]
    assert used[rec.step - 1][0] == 0.0 and rec.lr == pytest.approx([used[rec.step - 1][1]], rel=1e-12)


def test_records_without_a_factor_knob_and_old_histories_are_left_as_they_were(digits, tmp_path):
    engine = hpx.Engine(mlp(), lambda m: torch.optim.SGD(m.parameters(), lr=0.1),
                        [hpx.LearningRate(spread=0.5)], replicas=2, sync_every=2)
    for b in data(digits, 2):
        engine.step(ce, b)
    rec = dataclasses.replace(engine.history[0])
    engine.knobs.label_lr(rec)
    assert rec.lr is None and rec.lr_factor is None and rec.label("lr") == "lr"  # "lr" is the lr
    assert rec.summary() == f"lr {rec.bases['lr']:.4g}"
    old = {"step": 4, "bases": {"lr": 2.5}, "values": {"lr": [2.5]}, "scores": [0.5]}  # before the fields
    path = tmp_path / "old.jsonl"
    path.write_text(json.dumps(old) + "\n")
    (back,) = hpx.load_history(path)
    assert back.lr is None and back.lr_factor is None and hpx.ProgressBar.postfix(back) == "lr 2.5, best 0.5"


def test_the_sync_summary_names_the_factor(run):
    """The text of the sync's INFO log line (engine.py logs ``rec.summary()``)."""
    _, used, hist = run
    r = hist[-1]
    assert r.summary() == f"lr {used[r.step - 1][0]:.4g}, lr factor {r.bases['lr']:.4g}"


def test_progress_bar_shows_the_lr_and_the_factor(run):
    _, used, hist = run
    r = next(r for r in hist if r.searched)
    text = hpx.ProgressBar.postfix(r)
    assert text.startswith(f"lr {used[r.step - 1][0]:.4g}, lr factor {r.bases['lr']:.4g}, best ")


def test_report_has_an_lr_column_and_a_factor_column(run, tmp_path, capsys):
    _, used, hist = run
    path = hpx.save_history(hist, tmp_path / "h.json")
    back = hpx.load_history(path)
    assert [(r.lr, r.lr_factor) for r in back] == [(r.lr, r.lr_factor) for r in hist]
    assert main(["report", str(path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["step", "lr", "lr", "factor", "best", "score"]
    for line, r in zip(lines[1:], hist):
        step, lr, factor = line.split()[:3]
        assert int(step) == r.step and float(lr) == pytest.approx(used[r.step - 1][0], rel=1e-4)
        assert float(factor) == pytest.approx(r.bases["lr"], rel=1e-4)


def test_plot_shows_the_lr_and_labels_the_factor(run, tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure

    _, used, hist = run
    figures = []
    save = Figure.savefig
    monkeypatch.setattr(Figure, "savefig", lambda fig, *a, **k: (figures.append(fig), save(fig, *a, **k))[1])
    hpx.plot_history(hist, tmp_path / "p.png")
    (fig,) = figures
    assert [ax.get_ylabel() for ax in fig.axes] == ["lr", "lr factor", "score"]
    mean = fig.axes[0].get_lines()[-1]
    assert list(mean.get_xdata()) == [r.step for r in hist]
    assert list(mean.get_ydata()) == pytest.approx([used[r.step - 1][0] for r in hist], rel=1e-12)


def test_tensorboard_writes_the_lr_and_the_factor(run, tmp_path):
    _, used, hist = run
    acc = written(hist, tmp_path / "tb")
    tags = acc.Tags()["scalars"]
    assert "hpx/base/lr" not in tags and "hpx/applied/lr_factor" in tags
    assert [e.value for e in acc.Scalars("hpx/applied/lr")] == pytest.approx(
        [used[r.step - 1][0] for r in hist], rel=1e-6)
    assert [e.value for e in acc.Scalars("hpx/base/lr_factor")] == pytest.approx(
        [r.bases["lr"] for r in hist], rel=1e-6)


def test_the_engine_labels_its_records_and_logs_the_lr(digits, caplog):
    with caplog.at_level(logging.INFO, logger="hpx"):
        engine, used = _run(digits)
    r = engine.history[-1]
    assert r.lr_factor == "lr" and r.lr == pytest.approx([used[r.step - 1][0]], rel=1e-12)
    line = f"sync at step {r.step}: lr {used[r.step - 1][0]:.4g}, lr factor {r.bases['lr']:.4g}"
    assert line in caplog.text
