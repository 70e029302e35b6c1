"""The learning-rate suite (benchmarks/lr): its tasks, its committed grids, its runner and criteria.

Quick runs check the plumbing, not the numbers; the numbers come from ``python -m benchmarks.lr``.
"""

from __future__ import annotations

import itertools
import math

import pytest

pytest.importorskip("sklearn")
pytest.importorskip("transformers")
pytest.importorskip("pydoc_data.topics")

import torch

from benchmarks.lr.__main__ import GRIDS, SEEDS, _load, best_of_grid, cells, grid_lrs, verdict
from benchmarks.lr.run import Run, execute
from benchmarks.lr.tasks import HELD_OUT, TASKS


def test_the_suite_covers_what_the_issue_asks_for():
    ts = list(TASKS.values())
    assert len(ts) >= 12
    for opt in ("sgd", "adam", "adamw"):
        assert sum(t.optim == opt for t in ts) >= 3, opt
    assert sum(t.sched == "onecycle" for t in ts) >= 4
    assert {"cosine", "linear", "step"} <= {t.sched for t in ts}
    assert any(t.steps <= 150 for t in ts) and any(t.steps >= 3000 for t in ts)
    assert {"mlp", "cnn", "transformer", "rnn", "tabular"} <= {t.family for t in ts}


def test_a_third_is_held_out_with_the_families_spread():
    assert set(HELD_OUT) <= set(TASKS)
    assert len(HELD_OUT) * 3 >= len(TASKS)
    assert len({TASKS[t].family for t in HELD_OUT}) >= 4
    design = [t for t in TASKS if t not in HELD_OUT]
    assert {TASKS[t].family for t in HELD_OUT} <= {TASKS[t].family for t in design}


def test_every_committed_grid_has_an_interior_best_with_both_starts_on_it():
    grids = _load(GRIDS)
    for name, task in TASKS.items():
        lrs = grid_lrs(name, grids)
        assert len(lrs) >= 7, name
        ratios = [b / a for a, b in itertools.pairwise(lrs)]
        assert all(r == pytest.approx(10 ** 0.5, rel=1e-6) for r in ratios), name  # half-decades
        i, _, means = best_of_grid(name, grids)
        assert 2 <= i <= len(lrs) - 3, name
        assert means[i] < 0.9 * task.constant_loss(), name  # the best trains
        c = cells(name, grids)
        assert c["10x"] == pytest.approx(lrs[i + 2], rel=1e-6)
        assert c["0.1x"] == pytest.approx(lrs[i - 2], rel=1e-6)


def test_a_task_is_deterministic_in_its_seed_and_leaves_the_global_rng_alone():
    task = TASKS["digits_mlp"]
    before = torch.random.get_rng_state()
    a, b, c = task.model(0), task.model(0), task.model(1)
    assert torch.equal(torch.random.get_rng_state(), before)
    pa, pb, pc = (torch.cat([p.reshape(-1) for p in m.parameters()]) for m in (a, b, c))
    assert torch.equal(pa, pb) and not torch.equal(pa, pc)


def test_the_onecycle_tasks_cycle_momentum_as_torch_does():
    task = TASKS["digits_cnn_bn"]  # AdamW: OneCycle cycles beta1
    opt = task.optimizer(task.model(0), 0.1)
    sched = task.scheduler(opt)
    betas = []
    for _ in range(task.steps):
        betas.append(opt.param_groups[0]["betas"][0])
        opt.step()
        sched.step()
    assert max(betas) == pytest.approx(0.95) and min(betas) == pytest.approx(0.85)


@pytest.mark.parametrize("name", sorted(TASKS))
def test_every_task_trains_plainly_and_under_autolr(name):
    task = TASKS[name]
    plain = execute(Run(name, "plain", task.center, 0, steps=12))
    assert math.isfinite(plain["val"]) and plain["seconds"] > 0 and plain["end_lr"] == task.center
    hpx = execute(Run(name, "autolr", task.center, 0, steps=12))
    assert math.isfinite(hpx["val"]) and hpx["end_lr"] > 0 and hpx["history"]
    assert isinstance(hpx["lost"], bool)


def _row(start, vs_plain, vs_oracle, end, lost=False, cost=1.05):
    return {"start": start, "vs_plain": vs_plain, "vs_oracle": vs_oracle, "end_vs_oracle": end,
            "lost": lost, "cost": cost}


def test_verdict_reads_the_criteria_off_the_rows():
    rows = [_row("1x", 1.01, 1.01, 1.0), _row("1x", 1.04, 1.04, 2.0), _row("1x", math.nan, 1.0, 4.0),
            _row("0.1x", 0.5, 1.04, 0.5), _row("10x", 1.03, 1.2, 3.5, lost=True, cost=1.3),
            _row("0.1x", math.nan, 1.01, 1.0)]
    v = verdict(rows)
    assert v["no_harm_102"] == pytest.approx(1 / 3)
    assert v["no_harm_105_all"] is False  # a NaN ratio at the best lr is not "no harm"
    assert v["recover_105"] == pytest.approx(2 / 3)
    assert v["recover_vs_plain"] is False  # 1.03x plain from 10x off
    assert v["fixed_point_3x"] == pytest.approx(4 / 6)
    assert v["lost"] == 1 and v["cost_max"] == pytest.approx(1.3)
    assert SEEDS == (0, 1)
