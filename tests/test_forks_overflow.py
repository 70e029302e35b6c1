"""A run whose outputs overflow their dtype on the probe while its weights are still finite is a run
blowing up (lost, handed to a challenger that ended finite), not a fault of the probe's loss: seen
on a Friedman regression under SGD 10x above its best lr, where the probe's squared error of your run
overflowed float32 at the first cut and the whole run was stopped as "the probe's loss is at fault"."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hpx

pytestmark = pytest.mark.quick

STEPS = 40


def _data(n: int, scale: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g) * scale
    return x, x.sum(dim=1, keepdim=True)


BATCHES = [_data(16, 1.0, i) for i in range(STEPS)]
PROBE = [_data(32, 1e3, 100 + i) for i in range(2)]  # inputs 1,000x the training ones: overflow first


def _loss(rep: hpx.Replica, b: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return F.mse_loss(rep.model(b[0]), b[1])


def _per_example(rep: hpx.Replica, b: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return F.mse_loss(rep.model(b[0]), b[1], reduction="none").squeeze(1)


@pytest.mark.parametrize("probe_loss", [None, _per_example])
def test_a_probe_loss_that_overflows_for_your_finite_run_makes_it_lost_not_an_error(probe_loss, caplog):
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    forks = hpx.Forks(model, torch.optim.SGD(model.parameters(), lr=0.01), total_steps=STEPS, probe=PROBE,
                      loss_fn=probe_loss)
    for i, b in enumerate(BATCHES):
        if i == 2:  # your weights large but finite: the training loss finite, the probe's not in float32
            with torch.no_grad():
                model.weight.fill_(2e16)
        forks.step(_loss, b)
    final = forks.converge()
    end = forks.history[-1]
    assert end.phase == "end" and not math.isfinite(end.scores[0])  # your run: non-finite in float32
    assert math.isfinite(end.scores[1])
    assert forks.factor != 1.0 and forks.decided  # a finished challenger, not your blown-up run
    assert all(torch.isfinite(p).all() for p in final.parameters())
    assert "overflowed (finite in float64)" in caplog.text


def test_a_probe_loss_non_finite_in_float64_too_is_still_the_probes_fault():
    """The float64 rescoring answers only for overflow: a log of 0 stays the probe loss's fault."""
    def probe_loss(rep, b):
        out = _per_example(rep, b)
        return torch.log(out * 0) if on["broken"] and rep.value("lr") == 1.0 else out

    on = {"broken": False}
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    forks = hpx.Forks(model, torch.optim.SGD(model.parameters(), lr=0.01), total_steps=STEPS, probe=PROBE,
                      loss_fn=probe_loss)
    with pytest.raises(hpx.NonFiniteError, match=r"the probe's loss_fn gave your run a non-finite loss while "
                                                 r"its weights are finite"):
        for i, b in enumerate(BATCHES):
            on["broken"] = i >= 2
            forks.step(_loss, b)
    assert forks.factor == 1.0
