"""hpx.Forks from a knob at 0, by one rule for every bound: a side past a bound is left out, a
side equal to your value is left out, so from a value at a bound a knob explores inward only, and a
multiplicative knob at 0 explores upward to its ``from_zero``. The HDET engine, whose replicas sit
on both sides of the base, refuses the same knobs, naming why."""

from __future__ import annotations

import io

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hpx

STEPS = 20

_g = torch.Generator().manual_seed(0)
X = torch.randn(256, 8, generator=_g)
Y = X @ (0.05 * torch.randn(8, generator=_g))  # small true weights: decay towards 0 helps
BATCHES = [(X[16 * i:16 * i + 16], Y[16 * i:16 * i + 16]) for i in range(12)]
PROBE = [(X[192:], Y[192:])]


class _Net(nn.Module):
    """A linear model 10 times too large, a dropout rate and a multiplicative attribute ``temp``."""

    def __init__(self, p: float = 0.0, temp: float = 1.0) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(8, 1, bias=False)
        with torch.no_grad():
            self.lin.weight.mul_(10)
        self.drop = nn.Dropout(p)
        self.temp = temp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(self.drop(x)).squeeze(-1)


def _loss(rep, b):
    return F.mse_loss(rep.model(b[0]), b[1])


def _forks(model, opt, knob, **kw) -> hpx.Forks:
    return hpx.Forks(model, opt, total_steps=STEPS, probe=PROBE, multiples=(1.0,), cuts=(), knobs=[knob],
                     **{"knob_start": 0, **kw})  # the knob forks from the start: read at once


def _train(forks: hpx.Forks, steps: range) -> None:
    for t in steps:
        forks.step(_loss, BATCHES[t % len(BATCHES)])


def _sgd(model: nn.Module, wd: float = 0.0) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.01, weight_decay=wd)


def _wds(forks: hpx.Forks) -> list[float]:
    return [f.optimizer.param_groups[0]["weight_decay"] for f in forks._forks]


# --- additive knobs at a bound: inward only ------------------------------------------------------


def test_label_smoothing_at_0_forks_upward_only_and_the_engine_refuses_its_spread():
    knob = hpx.LabelSmoothing(spread=0.1)  # base 0: the lower side, -0.1, is past the bound
    seen = set()

    def smoothed(rep, b):
        seen.add(rep.value("label_smoothing"))
        return _loss(rep, b)

    model = _Net()
    forks = _forks(model, _sgd(model), knob, loss_fn=_loss)
    assert [f.values["label_smoothing"] for f in forks._forks] == [0.0, 0.1]
    forks.step(smoothed, BATCHES[0])
    assert seen == {0.0, 0.1}
    model = _Net()
    top = _forks(model, _sgd(model), hpx.LabelSmoothing(base=0.99, spread=0.2), loss_fn=_loss)
    assert [f.values["label_smoothing"] for f in top._forks] == [0.99, pytest.approx(0.79)]  # from the top
    with pytest.raises(hpx.ConfigError, match=r"knob 'label_smoothing' would span \[-0.1, 0.1\], past its "
                       r"bounds \[0, 0.99\]: .*use a spread <= 0"):
        hpx.Engine(_Net(), _sgd, [hpx.LabelSmoothing(spread=0.1)], replicas=2)


@pytest.mark.parametrize(("p", "spread", "forks_at"), [
    (0.0, 0.2, [pytest.approx(0.2)]),  # at the lower bound: upward only
    (0.99, 0.2, [pytest.approx(0.79)]),  # at the upper bound: downward only
    (0.5, 0.2, [pytest.approx(0.3), pytest.approx(0.7)]),  # inside: both sides
])
def test_dropout_at_a_bound_explores_inward_only(p, spread, forks_at):
    model = _Net(p=p)
    forks = _forks(model, _sgd(model), hpx.Dropout(spread=spread))
    assert [f.values["dropout"] for f in forks._forks[1:]] == forks_at
    assert [f.model.drop.p for f in forks._forks[1:]] == forks_at


# --- multiplicative knobs at 0: upward to from_zero ----------------------------------------------


def _adamw(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.0)


@pytest.mark.parametrize(("make_opt", "knob", "up"), [
    (_adamw, hpx.WeightDecay(span=10), 0.01),  # decoupled decay: torch's AdamW default
    (lambda m: torch.optim.Adam(m.parameters(), lr=0.01, decoupled_weight_decay=True),
     hpx.WeightDecay(span=10), 0.01),  # Adam with decoupled decay is AdamW
    (lambda m: torch.optim.Adam(m.parameters(), lr=0.01), hpx.WeightDecay(span=10), 5e-4),  # coupled L2
    (_sgd, hpx.WeightDecay(group=0, span=10), 5e-4),
    (_sgd, hpx.WeightDecay(group=0, span=10, from_zero=0.02), 0.02),
    (_adamw, hpx.WeightDecay(spread=0.5, from_zero=0.1), 0.1),  # a linear spread alike
])
def test_weight_decay_at_0_forks_at_from_zero_only(make_opt, knob, up):
    model = _Net()
    forks = _forks(model, make_opt(model), knob)
    assert _wds(forks) == [0.0, up]  # no fork below 0, none at a ratio of 0
    assert [f.values["weight_decay"] for f in forks._forks] == [0.0, up]
    assert forks.bases == {"lr": 1.0, "weight_decay": 0.0}


def test_a_multiplicative_knob_at_0_without_from_zero_is_refused_naming_it():
    def custom(**kw):
        return hpx.Custom("temp", get=lambda r: r.model.temp, set=lambda r, v: setattr(r.model, "temp", v),
                          span=4, **kw)

    model = _Net(temp=0.0)
    with pytest.raises(hpx.ConfigError, match=r"temp: your value is 0, and a multiplicative knob cannot move "
                       r"from 0 by a ratio .*give from_zero=\.\.\. "
                       r"\(e\.g\. Custom\(\.\.\., from_zero=0\.01\)\)"):
        _forks(model, _sgd(model), custom())
    forks = _forks(model, _sgd(model), custom(from_zero=0.5))
    assert [f.model.temp for f in forks._forks] == [0.0, 0.5]
    model = _Net()
    with pytest.raises(hpx.ConfigError, match=r"weight_decay: your value is 0 and its upper fork would take "
                       r"from_zero=0.01, outside its bounds \[0, 0.0001\]: give from_zero=\.\.\. inside "
                       r"them"):
        _forks(model, _adamw(model), hpx.WeightDecay(span=10, bounds=(0.0, 1e-4)))
    with pytest.raises(hpx.ConfigError, match=r"from_zero of knob 'weight_decay' must be a number > 0 inside "
                       r"its bounds \[0, 1\] \(got 2.0\)"):
        hpx.WeightDecay(span=10, bounds=(0.0, 1.0), from_zero=2.0)


def test_the_engine_refuses_a_weight_decay_of_0_naming_the_fix():
    with pytest.raises(hpx.ConfigError, match=r"knob 'weight_decay' reads weight_decay=0.0 from parameter "
                       r"group 0 .*needs a value > 0 to spread around: give a group whose weight_decay is > "
                       r"0, or base=\.\.\. > 0; or use hpx.Forks, which explores a knob at 0 upward"):
        hpx.Engine(_Net(), _sgd, [hpx.WeightDecay(span=10)], replicas=2)
    with pytest.raises(hpx.ConfigError, match=r"knob 'weight_decay' has base 0, .*every replica would stay "
                       r"at 0: give a base > 0 \(base=\.\.\.\), or use hpx.Forks"):
        hpx.Engine(_Net(), _sgd, [hpx.WeightDecay(base=0.0, span=10)], replicas=2)
    engine = hpx.Engine(_Net(), _sgd, [hpx.WeightDecay(base=0.0, explore=False)], replicas=2)  # held at 0
    assert engine.values("weight_decay") == [0.0, 0.0]


# --- the winner, written back; a resume ----------------------------------------------------------


def test_an_upward_fork_that_wins_is_written_into_the_group_and_a_later_run_forks_around_it():
    """The task's weights start 10 times too large, so decay (coupled, 1.0 at lr 0.01) scores lower
    on the probe than none: with confidence 0 the fork at from_zero wins, its value goes into your
    optimizer's group and forks.values, and a later run from it forks at value / span and value *
    span as usual."""
    model = _Net()
    opt = _sgd(model)
    forks = _forks(model, opt, hpx.WeightDecay(span=10, from_zero=1.0), confidence=0)
    _train(forks, range(STEPS))
    end = forks.history[-1]
    assert end.phase == "end" and end.values["weight_decay"] == [0.0, 1.0]
    assert end.scores[1] < end.scores[0]  # the decayed fork truly scores lower
    assert forks.decided and forks.values == {"weight_decay": 1.0}
    assert forks.bases == {"lr": 1.0, "weight_decay": 1.0} and end.bases["weight_decay"] == 1.0
    assert opt.param_groups[0]["weight_decay"] == 1.0
    later = _forks(model, opt, hpx.WeightDecay(span=10))
    assert _wds(later) == [1.0, pytest.approx(0.1), pytest.approx(10.0)]


def test_a_resumed_run_keeps_the_from_zero_forks():
    """state_dict / load_state_dict: a fresh Forks (its knob read at 0 again) takes the saved forks,
    the fork at 5e-4 (SGD's default) included, and ends as the uninterrupted run."""
    model = _Net()
    forks = _forks(model, _sgd(model), hpx.WeightDecay(span=10), confidence=0)
    _train(forks, range(8))
    buf = io.BytesIO()
    torch.save(forks.state_dict(), buf)
    buf.seek(0)
    fresh = _Net()
    again = _forks(fresh, _sgd(fresh), hpx.WeightDecay(span=10), confidence=0)
    again.load_state_dict(torch.load(buf, weights_only=False))
    assert _wds(again) == [0.0, 5e-4] and [f.values for f in again._forks] == [{"weight_decay": 0.0},
                                                                               {"weight_decay": 5e-4}]
    assert torch.equal(again._forks[1].model.lin.weight, forks._forks[1].model.lin.weight)
    _train(forks, range(8, STEPS))
    _train(again, range(8, STEPS))
    assert again.history[-1].scores == forks.history[-1].scores
    assert again.values == forks.values and again.history[-1].values["weight_decay"] == [0.0, 5e-4]
    assert fresh.lin.weight.equal(model.lin.weight)
