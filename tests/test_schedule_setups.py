"""hpx's drop-in schedulers where a run is continued torch-style, or composed with torch's own
schedulers: the paper rule continues on its path, and the compositions hpx cannot follow are
refused with the one that works instead of being overwritten silently."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.optim import lr_scheduler as L

import hpx
from hpx.errors import ConfigError
from tests._dist import run_distributed


def _opt(lr: float = 0.1) -> torch.optim.SGD:
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr, momentum=0.9)


PAPER = dict(max_lr=0.5, total_steps=60, rule="paper", sync_every=5)


def _lrs_after(opt, sched, steps: int) -> list[float]:
    out = [opt.param_groups[0]["lr"]]
    for _ in range(steps):
        opt.step()
        sched.step()
        out.append(opt.param_groups[0]["lr"])
    return out


def _paper_run(steps: int = 60) -> tuple[list[float], dict]:
    opt = _opt()
    sched = hpx.OneCycleLR(opt, **PAPER)
    lrs = [opt.param_groups[0]["lr"]]
    saved = None
    for t in range(steps):
        opt.step()
        sched.step()
        lrs.append(opt.param_groups[0]["lr"])
        if t + 1 == 37:
            saved = opt.state_dict()
    return lrs, saved


def test_the_paper_rule_rebuilt_with_last_epoch_continues_as_the_uninterrupted_run():
    lrs, saved = _paper_run()
    opt = _opt()
    opt.load_state_dict(saved)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sched = hpx.OneCycleLR(opt, last_epoch=36, **PAPER)  # torch's way: steps taken - 1
        assert _lrs_after(opt, sched, 8) == lrs[37:46]  # it jumped to 2.5x max_lr: 1.25


def test_the_paper_rule_continuing_a_torch_onecycle_checkpoint_takes_the_paper_path():
    lrs, _ = _paper_run()
    opt = _opt()
    torch_sched = L.OneCycleLR(opt, 0.5, total_steps=60)
    for _ in range(37):
        opt.step()
        torch_sched.step()
    mine = _opt()
    mine.load_state_dict(opt.state_dict())
    sched = hpx.OneCycleLR(mine, **PAPER)
    sched.load_state_dict(torch_sched.state_dict())
    assert _lrs_after(mine, sched, 4) == pytest.approx(lrs[37:42], rel=1e-12)


def test_an_hpx_scheduler_inside_torchs_sequentiallr_is_refused_naming_the_way_round():
    opt = _opt()
    with pytest.raises(ConfigError, match=r"inside torch's SequentialLR.*hpx.ExploreLR\(SequentialLR"):
        L.SequentialLR(opt, [hpx.OneCycleLR(opt, 0.5, total_steps=10), L.ConstantLR(opt, 0.5, 5)], [6])


def test_a_torch_scheduler_beside_explorelr_is_refused_at_the_step_that_would_overwrite_it():
    opt = _opt(1.0)
    chained = L.ChainedScheduler([hpx.ExploreLR(L.ExponentialLR(opt, 0.9)), L.StepLR(opt, 2, 0.1)])
    opt.step()
    chained.step()  # ExploreLR writes 0.9; StepLR changes nothing yet
    opt.step()
    chained.step()  # ExploreLR writes 0.81, then StepLR makes it 0.081
    opt.step()
    with pytest.raises(ConfigError, match=r"learning rates are \[0.081\] where hpx.ExploreLR wrote \[0.81\]"):
        chained.step()
    inside = _opt(1.0)
    torch_ref = _opt(1.0)
    wrapped = hpx.ExploreLR(L.ChainedScheduler([L.ExponentialLR(inside, 0.9), L.StepLR(inside, 2, 0.1)]))
    ref = L.ChainedScheduler([L.ExponentialLR(torch_ref, 0.9), L.StepLR(torch_ref, 2, 0.1)])
    assert _lrs_after(inside, wrapped, 6) == pytest.approx(_lrs_after(torch_ref, ref, 6), rel=1e-12)


def test_a_new_explorelr_starts_from_an_lr_set_by_hand_as_torchs_scheduler_does():
    opt = _opt(0.5)
    first = hpx.ExploreLR(L.StepLR(opt, 2, 0.5))
    _lrs_after(opt, first, 3)
    opt.param_groups[0]["lr"] = 0.01
    second = hpx.ExploreLR(L.ExponentialLR(opt, 0.9))
    ref = _opt(0.01)
    torch_lrs = _lrs_after(ref, L.ExponentialLR(ref, 0.9), 4)
    assert _lrs_after(opt, second, 4) == pytest.approx(torch_lrs, rel=1e-12)


def test_autolr_with_a_schedule_shorter_than_the_run_names_total_steps():
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    with pytest.raises(ConfigError, match="ends before the run's total_steps=40: stepping it to step 31"):
        hpx.autolr(model, opt, total_steps=40, schedule=L.OneCycleLR(opt, 0.5, total_steps=30))


def _two_driven(rank: int, world: int) -> str:
    backend = hpx.backends.TorchDistributed()
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(3, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    hpx.ExploreLR(L.ExponentialLR(opt, 0.9), model=model, spread=0.2, backend=backend)
    try:
        hpx.ExploreLR(L.StepLR(opt, 3, 0.1), model=model, spread=0.2, backend=backend)
    except ConfigError as e:
        return str(e)
    return "accepted"


def test_a_second_hpx_scheduler_with_replicas_on_one_optimizer_is_refused():
    out = run_distributed(_two_driven, 2)
    assert all("already has an hpx scheduler with replicas to explore" in o for o in out)
