"""The lanes prototype of the co-exploration suite (``benchmarks/knobs/lanes.py``): the lr's forks
cut among themselves, each knob's lower fork kept only while it scores better than your run, and a
second rung for a lane kept at the first cut."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import hpx
from benchmarks.knobs.lanes import Lanes
from tests.test_forks import BATCHES, PROBE, _net

pytestmark = pytest.mark.quick


def _shifted(rep, b):  # trains on targets moved by a knob of the user's: any shift but 0 costs
    return F.mse_loss(rep.model(b[0]).squeeze(-1), b[1] + getattr(rep.model, "shift", 0.0))


def _plain(rep, b):
    return F.mse_loss(rep.model(b[0]).squeeze(-1), b[1])


def _run(weight_decay: float, second: hpx.Knob, lane_cuts: int | None = None) -> Lanes:
    model = _net(p=0.6)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=weight_decay)
    torch.manual_seed(5)
    forks = Lanes(model, opt, total_steps=60, probe=PROBE, loss_fn=_plain,
                  knobs=[hpx.WeightDecay(group=0, span=10), second], lane_cuts=lane_cuts)
    for b in BATCHES:
        forks.step(_shifted, b)
    forks.converge()
    return forks


def _settings(rec: hpx.SyncRecord) -> list[tuple[float, ...]]:
    return list(zip(*rec.values.values()))


SHIFT = hpx.Custom("shift", set=lambda rep, v: setattr(rep.model, "shift", v), base=0.0, kind="add",
                   spread=1.0, bounds=(-5, 5))
CASES = {"too much weight decay and dropout": (30.0, hpx.Dropout(spread=0.2)),
         "a shift only 0 serves": (0.01, SHIFT)}


@pytest.mark.parametrize("case", list(CASES))
def test_lanes_keep_a_lower_fork_only_while_it_beats_your_run_and_deepen_it_once(case):
    weight_decay, knob = CASES[case]
    forks = _run(weight_decay, knob)
    names = list(forks.history[0].values)
    assert names == ["lr", "weight_decay", knob.name]
    cuts = [r for r in forks.history if r.phase == "cut"]
    assert len(cuts) == 2 and forks.history[-1].phase == "end"
    first, second = cuts
    yours = first.scores[0]
    assert math.isfinite(yours)  # your run is scored at a cut while a lane runs (an annealed copy)
    start = _settings(first)[0]
    lanes = [(s, x) for s, x in zip(_settings(first)[1:], first.scores[1:]) if s[0] == 1.0]
    assert len(lanes) == 2  # a lower fork per knob from the start
    kept = []
    for s, score in lanes:
        assert (s in _settings(second)) == (score < yours)  # judged against your run alone
        moved = 1 if s[1] != start[1] else 2
        step = s[moved] - start[moved] if moved == 2 else s[1] / start[1]
        rung = list(s)
        rung[moved] = s[moved] + step if moved == 2 else s[1] * step  # one more spread down
        if moved == 2:
            rung[2] = max(rung[2], knob.low)  # onto the lower bound (dropout's 0)
        deeper = [t for t in _settings(second) if t[0] == 1.0 and t == pytest.approx(tuple(rung))]
        assert len(deeper) == (score < yours)  # a lane kept at the first cut: its second rung beside it
        kept.append(score < yours)
    # the lr's forks are cut among themselves to the counts a run without knobs keeps
    assert sum(s[0] != 1.0 for s in _settings(second)) == 2
    assert sum(s[0] != 1.0 for s in _settings(forks.history[-1])) == 1
    if case == "a shift only 0 serves":
        assert kept == [True, False]  # the weight decay's lane leads; the shift's is dropped at once
    else:
        assert all(kept)


def test_lanes_at_the_first_cut_only_then_one_race_for_the_places():
    """lane_cuts=1: the first cut as in lanes; at the second the lanes' forks and the lr's race for
    the one place a run without knobs keeps there, so the end holds one raced challenger (and the
    upper fork branched late)."""
    forks = _run(30.0, hpx.Dropout(spread=0.2), lane_cuts=1)
    first, second = [r for r in forks.history if r.phase == "cut"]
    assert [r.values for r in (first, second)] == [r.values for r in _cuts(30.0)]  # the same forks
    end = _settings(forks.history[-1])
    raced = [s for s in end[1:] if s[0] != 1.0 or s[1] < end[0][1] or s[2] < end[0][2]]
    assert len(raced) == 1
    challengers = _settings(second)[1:]
    best = min(range(len(challengers)), key=lambda i: second.scores[1:][i])
    assert raced == [challengers[best]]  # the best of the lanes' forks and the lr's, alone


def _cuts(weight_decay: float) -> list[hpx.SyncRecord]:
    return [r for r in _run(weight_decay, hpx.Dropout(spread=0.2)).history if r.phase == "cut"]
