"""hpx.Forks' final decision before the run's end (a last cut that keeps one): checked against
plain training written out by hand, and the settings it must refuse."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hpx
from hpx.errors import ConfigError

STEPS = 40


def _data(n: int = 512) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 8, generator=g)
    return x, (x @ torch.randn(8, 1, generator=g)).squeeze(-1) + 0.1 * torch.randn(n, generator=g)


X, Y = _data()
BATCHES = [(X[(16 * i) % 384:(16 * i) % 384 + 16], Y[(16 * i) % 384:(16 * i) % 384 + 16]) for i in range(80)]
PROBE = [(X[384:512], Y[384:512])]


def _net(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))


def _loss(rep, b):
    return F.mse_loss(rep.model(b[0]).squeeze(-1), b[1])


def _onecycle(model: nn.Module, lr: float, steps: int = STEPS):
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    return opt, torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps)


def test_a_final_decision_before_the_end_adopts_the_winner_and_trains_it_plainly():
    """cuts ending in a cut to one: at 50% of the run every fork left, your run included, is copied
    and annealed; once scored the winner is in your objects (``decided``), and the rest of the run is
    plain training at its multiple: one optimizer step per step, and the end equal to plain training
    from the winner's state, bit for bit."""
    model = _net()
    opt, sched = _onecycle(model, 0.0005)  # far too low: a faster challenger wins
    forks = hpx.Forks(model, opt, total_steps=STEPS, schedule=sched, probe=PROBE,
                      cuts=((0.1, 2), (0.5, 1)), cool=0.1, confidence=0)
    for b in BATCHES[:20]:
        forks.step(_loss, b)
    assert len(forks._clones) == 2 and not forks.decided  # your run's copy and the challenger's
    for b in BATCHES[20:24]:
        forks.step(_loss, b)
    assert forks.decided and forks.factor > 1 and forks.step_count == 24
    assert [r.phase for r in forks.history] == ["cut", "end"] and forks.history[-1].step == 24
    ref, ref_opt, ref_sched = copy.deepcopy((model, opt, sched))
    taken = forks.fork_steps
    for b in BATCHES[24:STEPS]:
        forks.step(_loss, b)
    assert forks.fork_steps - taken == STEPS - 24  # one run left
    for b in BATCHES[24:STEPS]:
        loss = _loss(type("R", (), {"model": ref})(), b)
        ref_opt.zero_grad(set_to_none=True)
        loss.backward()
        ref_opt.step()
        ref_sched.step()
    assert all(torch.equal(a, b) for a, b in zip(forks.model.parameters(), ref.parameters()))
    assert forks.converge() is model
    # the steps: 5 forks to 4 + 4, 4 copies of 4, the challenger to 24, two copies of 4, then one run
    assert forks.fork_steps == 5 * 8 + 4 * 4 + 2 * 16 + 2 * 4 + (STEPS - 24)


def test_a_final_decision_before_the_end_keeps_your_run_unless_the_challenger_wins_with_confidence():
    """The same test as at the end, on the annealed copies: an unreachable confidence keeps your run,
    and then your objects train on as plain training does, bit for bit."""
    model = _net()
    opt, sched = _onecycle(model, 0.005)
    ref = _net()
    ref_opt, ref_sched = _onecycle(ref, 0.005)
    forks = hpx.Forks(model, opt, total_steps=STEPS, schedule=sched, probe=PROBE,
                      cuts=((0.1, 2), (0.5, 1)), cool=0.1, confidence=1e9)
    for b in BATCHES[:STEPS]:
        forks.step(_loss, b)
    assert forks.history[-1].phase == "end" and forks.history[-1].step == 24 and forks.factor == 1.0
    for b in BATCHES[:STEPS]:
        loss = _loss(type("R", (), {"model": ref})(), b)
        ref_opt.zero_grad(set_to_none=True)
        loss.backward()
        ref_opt.step()
        ref_sched.step()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), ref.parameters()))
    assert math.isfinite(forks.history[-1].scores[0])


@pytest.mark.parametrize("cuts, cool, match", [
    (((0.1, 1), (0.5, 1)), 0.05, r"counts falling, each at least 2 but the last"),
    (((0.1, 1), (0.5, 2)), 0.05, r"counts falling"),
    (((0.1, 2), (0.9, 1)), 0.1, r"cool=0.1 overlaps the cuts .* before the run's end"),
    (((0.9, 2),), 0.2, r"cool=0.2 overlaps the cuts .* before the run's end"),  # a last cut keeping 2 too
])
def test_cuts_that_cannot_be_made_are_refused_naming_the_fix(cuts, cool, match):
    with pytest.raises(ConfigError, match=match):
        hpx.Forks(_net(), torch.optim.SGD(_net().parameters(), lr=0.1), total_steps=STEPS, probe=PROBE,
                  cuts=cuts, cool=cool)


@pytest.mark.parametrize("at", [22, 30])  # inside the final decision's window, and after it
def test_a_run_with_a_final_cut_resumes_bit_for_bit(at):
    """Saved inside the final decision's annealed window (its copies in flight) or after it (one run
    left), then loaded into a Forks built the same way: the run ends as the uninterrupted one, bit
    for bit, at the same multiple."""
    def build():
        model = _net()
        opt, sched = _onecycle(model, 0.0005)
        return model, hpx.Forks(model, opt, total_steps=STEPS, schedule=sched, probe=PROBE,
                                cuts=((0.1, 2), (0.5, 1)), cool=0.1, confidence=0)

    ref_model, ref = build()
    for b in BATCHES[:STEPS]:
        ref.step(_loss, b)
    _, forks = build()
    for b in BATCHES[:at]:
        forks.step(_loss, b)
    state = copy.deepcopy(forks.state_dict())
    assert (len(state["clones"]) == 2) == (at == 22)
    model2, resumed = build()
    resumed.load_state_dict(state)
    for b in BATCHES[at:STEPS]:
        resumed.step(_loss, b)
    assert resumed.decided and resumed.factor == ref.factor != 1.0
    assert resumed.fork_steps == ref.fork_steps
    assert all(torch.equal(a, b) for a, b in zip(model2.parameters(), ref_model.parameters()))
