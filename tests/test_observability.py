"""What a run shows while it trains: applied values, wall time and user metrics in every sync
record, on_sync callbacks, TensorBoard (the real package), and plots with sensible axes."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hpx
from hpx.history import _log_scale, _score_series
from tests._board import written
from tests._digits import ce, data, mlp

T = 4


def _engine(**kw) -> hpx.Engine:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))
    return hpx.Engine(model, lambda m: torch.optim.SGD(m.parameters(), lr=0.1),
                      [hpx.LearningRate(spread=0.5, schedule=lambda t: 1.0 / (1 + t))],
                      replicas=2, sync_every=T, **kw)


def test_a_record_holds_the_applied_values_wall_time_and_metrics(digits):
    seen = []
    engine = _engine(on_sync=seen.append)
    used: dict[int, list[float]] = {}

    def loss_fn(rep, b):
        used.setdefault(engine.step_count, []).append(rep.optimizer.param_groups[0]["lr"])
        return F.cross_entropy(rep.model(b[0]), b[1])

    for i, b in enumerate(data(digits, 2 * T)):
        engine.step(loss_fn, b)
        if i == 1:
            engine.log({"val_acc": torch.tensor(0.5), "epoch": 0})
        if i == 2:
            engine.log({"val_acc": 0.75})  # the latest value of a name wins
    first, second = engine.history
    assert seen == [first, second]  # the callback got every record, in order
    assert first.applied["lr"] == pytest.approx(used[T - 1])  # what the optimizers used last
    assert first.applied["lr"] == pytest.approx([v / T for v in first.values["lr"]])
    assert second.applied["lr"] == pytest.approx(used[2 * T - 1])
    assert 0 < first.wall <= second.wall
    assert first.metrics == {"val_acc": 0.75, "epoch": 0.0} and second.metrics is None


def test_on_sync_must_be_callable():
    with pytest.raises(hpx.ConfigError, match="on_sync must be a function"):
        _engine(on_sync=3)
    with pytest.raises(hpx.ConfigError, match="log takes a dict"):
        _engine().log([("a", 1)])


def test_tensorboard_writes_the_trajectories(digits, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    board = hpx.TensorBoard(tmp_path / "tb")
    engine = _engine(on_sync=board)
    for i, b in enumerate(data(digits, 3 * T)):
        engine.step(lambda r, b: F.cross_entropy(r.model(b[0]), b[1]), b)
        engine.log({"train/step": float(i)})
    board.close()
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    base = [(e.step, e.value) for e in acc.Scalars("hpx/base/lr")]
    assert base == [(r.step, pytest.approx(r.bases["lr"])) for r in engine.history]
    applied = [e.value for e in acc.Scalars("hpx/applied/lr/max")]
    assert applied == pytest.approx([max(r.applied["lr"]) for r in engine.history])
    # a value logged after the step that synced goes to the next record
    assert [e.value for e in acc.Scalars("metrics/train/step")] == [2.0, 6.0, 10.0]
    best = [(e.step, e.value) for e in acc.Scalars("hpx/score/best")]
    assert best == [(r.step, pytest.approx(min(r.scores))) for r in engine.history if r.searched]
    assert best  # the search read scores at some syncs
    with pytest.raises(hpx.ConfigError, match="a directory or a SummaryWriter"):
        hpx.TensorBoard(42)


def test_a_missing_tensorboard_is_an_import_error_with_the_install_hint(monkeypatch, tmp_path):
    """Like the other extras (tqdm, matplotlib, Lightning, transformers): ImportError, and how to
    install it."""
    import sys

    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # the import fails
    with pytest.raises(ImportError, match=r'pip install "hpx-hdet\[tensorboard\]" \(or pip install '
                                          r"tensorboard\)") as e:
        hpx.TensorBoard(tmp_path / "tb")
    assert not isinstance(e.value, hpx.ConfigError) and not (tmp_path / "tb").exists()


def test_plot_axes():
    assert _log_scale([0.01, 0.1, 1.0])            # positive, wide: log
    assert not _log_scale([0.0, 0.1, 0.2])         # a replica at 0 would vanish from a log axis
    assert not _log_scale([0.5, 0.6, 1.0])         # narrow: linear
    assert not _log_scale([])


def test_records_say_whether_the_search_read_their_scores_and_the_plot_keeps_them_apart(digits, tmp_path):
    """autolr's hold syncs record the training loss, not probe scores: the plot draws it as its
    own line instead of joining it to the scores (a jump that would not be the run's)."""
    model = mlp()
    engine = hpx.autolr(model, torch.optim.SGD(model.parameters(), lr=0.1), total_steps=40,
                        probe=data(digits, 1, seed=9, size=128), loss_fn=ce)
    for b in data(digits, 40):
        engine.step(ce, b)
    hist = engine.history
    assert [r.searched for r in hist] == [r.phase != "hold" for r in hist]
    assert any(r.searched for r in hist) and not all(r.searched for r in hist)
    series = _score_series(hist)
    for i, r in enumerate(hist):
        assert math.isnan(series["best"][1][i]) != bool(r.searched)
        assert math.isnan(series["training loss"][1][i]) == bool(r.searched)
    assert series["best"][1][0] == min(hist[0].scores)
    old = [hpx.SyncRecord(step=1, bases={}, values={}, scores=[1.0, 2.0])]  # written before the field
    assert _score_series(old) == {"best": ([1], [1.0]), "mean": ([1], [1.5])}
    hold = next(r for r in hist if not r.searched)
    assert "train loss" in hpx.ProgressBar.postfix(hold) and "best" not in hpx.ProgressBar.postfix(hold)
    assert "best" in hpx.ProgressBar.postfix(hist[0])
    acc = written(hist, tmp_path / "tb")
    assert [e.step for e in acc.Scalars("hpx/score/best")] == [r.step for r in hist if r.searched]
    assert [e.step for e in acc.Scalars("hpx/train_loss")] == [r.step for r in hist if not r.searched]


def test_plot_a_knob_that_reaches_zero_and_a_sync_without_scores(tmp_path):
    recs = [hpx.SyncRecord(step=4 * i, bases={"dropout": 0.05}, values={"dropout": [0.0, 0.1]},
                           scores=[2.3 / (i + 1), 2.0 / (i + 1)]) for i in range(1, 6)]
    recs.append(hpx.SyncRecord(step=24, bases={"dropout": 0.05}, values={"dropout": [0.0, 0.1]},
                               scores=[math.nan, math.nan]))
    png = hpx.plot_history(recs, tmp_path / "p.png")
    assert png.stat().st_size > 5000


def test_progress_bar_advances_at_each_sync_and_closes_at_the_end(digits):
    import io

    out = io.StringIO()
    bar = hpx.ProgressBar(3 * T, stream=out, ncols=100)
    engine = _engine(on_sync=bar)
    batches = data(digits, 3 * T)
    for b in batches[: 2 * T]:
        engine.step(lambda rep, x: F.cross_entropy(rep.model(x[0]), x[1]), b)
    assert bar._bar.n == 2 * T  # tqdm's own counter follows the syncs
    text = out.getvalue()
    assert f"{2 * T}/{3 * T}" in text and f"lr {engine.bases['lr']:.4g}" in text and "best " in text
    for b in batches[2 * T:]:
        engine.step(lambda rep, x: F.cross_entropy(rep.model(x[0]), x[1]), b)
    assert bar._bar is None and f"{3 * T}/{3 * T}" in out.getvalue()  # closed at 100%


def test_progress_bar_settings_are_checked():
    with pytest.raises(hpx.ConfigError, match=r"total_steps must be an integer >= 1 or None \(got 0\)"):
        hpx.ProgressBar(0)
