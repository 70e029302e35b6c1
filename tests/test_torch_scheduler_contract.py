"""PyTorch's own scheduler tests (test/optim/test_lrscheduler.py), ported: what they check, said
again for hpx.OneCycleLR and for torch schedulers wrapped in hpx.ExploreLR.

With one replica (no spread) both are torch's scheduler: every test runs the torch scheduler and
hpx's side by side on twin optimizers and asserts the same floats (``==``, not approximately),
the same counters and the same warnings, besides the values torch's tests expect. The few of
torch's tests that cannot apply are listed, with the reason, in docs/migrating-from-onecycle.md
("PyTorch's scheduler tests").
"""

from __future__ import annotations

import copy
import io
import math
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.optim import lr_scheduler as tls
from torch.optim.swa_utils import SWALR

import hpx

Make = Callable[[torch.optim.Optimizer], tls.LRScheduler]


def _opt(kind: str = "sgd") -> torch.optim.Optimizer:
    """torch's test optimizer: two groups, the second with its own lr as a tensor."""
    groups = [{"params": [torch.nn.Parameter(torch.zeros(2))]},
              {"params": [torch.nn.Parameter(torch.zeros(2))], "lr": torch.tensor(0.5)}]
    if kind == "adam":
        return torch.optim.Adam(groups, lr=0.05)
    return torch.optim.SGD(groups, lr=0.05, momentum=0.9)


def _num(v: Any) -> float:
    return v.item() if torch.is_tensor(v) else v


def _lrs(opt: torch.optim.Optimizer) -> list[Any]:
    return [(type(g["lr"]), _num(g["lr"])) for g in opt.param_groups]


def _moms(opt: torch.optim.Optimizer) -> list[Any]:
    return [g["betas"][0] if "betas" in g else g.get("momentum") for g in opt.param_groups]


def _same(a: torch.optim.Optimizer, b: torch.optim.Optimizer, where: Any) -> None:
    assert _lrs(a) == _lrs(b), (where, _lrs(a), _lrs(b))
    assert _moms(a) == _moms(b), (where, _moms(a), _moms(b))


def _steps(scheds: list[Any], opt: torch.optim.Optimizer, arg: Any = None) -> None:
    opt.step()
    for s in scheds:
        s.step() if arg is None else s.step(arg)


def _both_onecycle(ref_opt: torch.optim.Optimizer, opt: torch.optim.Optimizer,
                   **kwargs: Any) -> tuple[tls.OneCycleLR, hpx.OneCycleLR]:
    return tls.OneCycleLR(ref_opt, **kwargs), hpx.OneCycleLR(opt, **kwargs)


def _explore(sched: tls.LRScheduler) -> hpx.ExploreLR:
    return hpx.ExploreLR(sched, sync_every=3)


# ------------------------------------------------------------------------------------------
# OneCycleLR's own tests


def test_onecycle_refuses_what_torch_refuses() -> None:
    for kwargs in ({"total_steps": 10, "anneal_strategy": "CATS"}, {"total_steps": 10, "pct_start": 1.1}, {}):
        with pytest.raises(ValueError):
            tls.OneCycleLR(_opt(), max_lr=1e-3, **kwargs)
        with pytest.raises(ValueError):
            hpx.OneCycleLR(_opt(), max_lr=1e-3, **kwargs)


def _anneal_cos(start: float, end: float, pct: float) -> float:
    return end + (start - end) / 2.0 * (math.cos(math.pi * pct) + 1)


_COS_LR = [1, 13, 25, *(_anneal_cos(25, 0.5, i / 7) for i in range(1, 7)), 0.5]
_COS_MOM = [22, 11.5, 1, *(_anneal_cos(1, 22, i / 7) for i in range(1, 7)), 22]
# (torch's arguments, expected lrs, expected momenta, optimizer): momentum cycles from 1 to 22 here
ONECYCLE_CASES = {
    "linear": ({"anneal_strategy": "linear", "final_div_factor": 2},
               [1, 13, 25, 21.5, 18, 14.5, 11, 7.5, 4, 0.5], [22, 11.5, 1, 4, 7, 10, 13, 16, 19, 22], "sgd"),
    "linear-three-phases": ({"anneal_strategy": "linear", "pct_start": 0.4, "final_div_factor": 4,
                             "three_phase": True},
                            [1, 9, 17, 25, 17, 9, 1, 0.75, 0.5, 0.25],
                            [22, 15, 8, 1, 8, 15, 22, 22, 22, 22], "sgd"),
    "cosine": ({"final_div_factor": 2}, _COS_LR, _COS_MOM, "sgd"),
    "adam-beta1": ({"anneal_strategy": "linear", "final_div_factor": 2},
                   [1, 13, 25, 21.5, 18, 14.5, 11, 7.5, 4, 0.5],
                   [22, 11.5, 1, 4, 7, 10, 13, 16, 19, 22], "adam"),
}


@pytest.mark.parametrize("case", list(ONECYCLE_CASES))
def test_onecycle_trajectories_with_torchs_momentum_bounds(case: str) -> None:
    kwargs, want_lr, want_mom, kind = ONECYCLE_CASES[case]
    kwargs = {"max_lr": 25, "base_momentum": 1, "max_momentum": 22, "total_steps": 10, **kwargs}
    ref_opt, opt = _opt(kind), _opt(kind)
    ref, sched = _both_onecycle(ref_opt, opt, **kwargs)
    for t in range(10):
        _same(opt, ref_opt, t)
        for g in opt.param_groups:
            assert _num(g["lr"]) == pytest.approx(want_lr[t], abs=1e-5)
            assert _moms(opt)[0] == pytest.approx(want_mom[t], abs=1e-5)
        _steps([ref], ref_opt), _steps([sched], opt)
    assert (sched.last_epoch, sched._step_count) == (ref.last_epoch, ref._step_count)


def test_onecycle_copies_tensor_arguments() -> None:
    """Tensors given as max_lr and momentum bounds are read once: changing them later moves nothing."""
    lr, base, top = torch.tensor(0.1), torch.tensor(0.85), torch.tensor(0.95)
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr, momentum=0.9)
    sched = hpx.OneCycleLR(opt, max_lr=lr, total_steps=10, base_momentum=base, max_momentum=top)
    before = copy.deepcopy([{k: _num(v) for k, v in g.items() if k != "params"} for g in opt.param_groups])
    for i in range(2):
        for t in (lr, base, top):
            t.mul_(0.5)
        opt.step()
        with pytest.warns(UserWarning, match="epoch parameter"):
            sched.step(i)
        g = opt.param_groups[0]
        for key in ("initial_lr", "max_lr", "min_lr", "max_momentum", "base_momentum"):
            assert _num(g[key]) == before[0][key]
        assert (_num(g["max_momentum"]), _num(g["base_momentum"])) == pytest.approx((0.95, 0.85), rel=1e-6)


def _through_bytes(state: dict[str, Any]) -> dict[str, Any]:
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def test_onecycle_state_dict_saves_and_loads_as_plain_data() -> None:
    make = lambda o: hpx.OneCycleLR(o, max_lr=0.01, total_steps=10, anneal_strategy="linear")  # noqa: E731
    opt = _opt()
    state = make(opt).state_dict()
    again = make(opt)
    again.load_state_dict(_through_bytes(state))
    assert repr(again.state_dict()) == repr(state)


def test_onecycle_rebuilt_with_last_epoch_reads_the_groups() -> None:
    """A scheduler rebuilt with last_epoch on restored groups takes the cycle from the groups (as
    torch does), not from its constructor's max_lr."""
    ref_opt, opt = _opt(), _opt()
    ref, sched = _both_onecycle(ref_opt, opt, max_lr=0.1, total_steps=30)
    for _ in range(17):
        _steps([ref], ref_opt), _steps([sched], opt)
    ref = tls.OneCycleLR(ref_opt, max_lr=0.5, total_steps=30, last_epoch=17)
    sched = hpx.OneCycleLR(opt, max_lr=0.5, total_steps=30, last_epoch=17)
    for t in range(18, 30):  # the rebuilt scheduler has taken its initial step: 18
        assert sched.last_epoch == ref.last_epoch == t
        _same(opt, ref_opt, t)
        _steps([ref], ref_opt), _steps([sched], opt)
    # and the checkpoint pattern of torch's tests: a new optimizer, its state loaded, last_epoch=0
    model = torch.nn.Linear(3, 3)
    o1 = torch.optim.AdamW(model.parameters())
    s1 = hpx.OneCycleLR(o1, max_lr=0.01, total_steps=10)
    o1.step(), s1.step()
    o2 = torch.optim.AdamW(model.parameters())
    o2.load_state_dict(o1.state_dict())
    rebuilt = hpx.OneCycleLR(o2, max_lr=0.01, total_steps=10, last_epoch=0)
    assert rebuilt.get_last_lr()[0] == o1.param_groups[0]["lr"]


def test_onecycle_follows_an_edited_group_max_lr() -> None:
    ref_opt, opt = _opt(), _opt()
    ref, sched = _both_onecycle(ref_opt, opt, max_lr=0.1, total_steps=20)
    for t in range(20):
        if t == 5:
            for o in (ref_opt, opt):
                o.param_groups[0]["max_lr"] = 0.3
                o.param_groups[1]["base_momentum"] = 0.5
        _same(opt, ref_opt, t)
        _steps([ref], ref_opt), _steps([sched], opt)


def test_onecycle_state_loaded_into_another_build_keeps_the_groups_anchors() -> None:
    a_args = {"max_lr": [0.05, 0.2], "total_steps": 30, "anneal_strategy": "linear"}
    b_args = {"max_lr": 0.3, "total_steps": 40}
    opts = [_opt() for _ in range(4)]
    ref_a, a = tls.OneCycleLR(opts[0], **a_args), hpx.OneCycleLR(opts[1], **a_args)
    ref_b, b = tls.OneCycleLR(opts[2], **b_args), hpx.OneCycleLR(opts[3], **b_args)
    for _ in range(11):
        _steps([ref_a], opts[0]), _steps([a], opts[1])
    ref_b.load_state_dict(ref_a.state_dict())
    b.load_state_dict(a.state_dict())
    for t in range(11, 30):
        _steps([ref_b], opts[2]), _steps([b], opts[3])
        _same(opts[3], opts[2], t)


def test_stepping_past_the_end_counts_as_torch_counts() -> None:
    ref_opt, opt = _opt(), _opt()
    ref, sched = _both_onecycle(ref_opt, opt, max_lr=0.1, total_steps=3)
    ref_x = _explore(tls.OneCycleLR(x_opt := _opt(), max_lr=0.1, total_steps=3))
    for _ in range(3):
        _steps([ref], ref_opt), _steps([sched], opt), _steps([ref_x], x_opt)
    for _ in range(2):
        for o, s in ((ref_opt, ref), (opt, sched), (x_opt, ref_x)):
            o.step()
            with pytest.raises(ValueError, match="Tried to step"):
                s.step()
        assert (sched.last_epoch, sched._step_count) == (ref.last_epoch, ref._step_count)
        assert (ref_x.last_epoch, ref_x._step_count) == (ref.last_epoch, ref._step_count)
        _same(opt, ref_opt, "past the end")


# ------------------------------------------------------------------------------------------
# torch's warnings


def _new(kind: str, opt: torch.optim.Optimizer) -> Any:
    if kind == "onecycle":
        return hpx.OneCycleLR(opt, max_lr=0.1, total_steps=50)
    return _explore(tls.StepLR(opt, step_size=3, gamma=0.1))


@pytest.mark.parametrize("kind", ["onecycle", "explore"])
def test_the_scheduler_stepped_before_the_optimizer_warns(kind: str) -> None:
    sched = _new(kind, _opt())
    with pytest.warns(UserWarning, match="how-to-adjust-learning-rate"):
        for _ in range(3):
            sched.step()
            sched.optimizer.step()


@pytest.mark.parametrize("kind", ["onecycle", "explore"])
def test_an_overridden_optimizer_step_warns(kind: str) -> None:
    opt = _opt()
    sched = _new(kind, opt)
    inner = opt.step
    opt.step = lambda *a, **k: inner(*a, **k)  # type: ignore[method-assign]
    with pytest.warns(UserWarning, match=r"`optimizer.step\(\)` has been overridden"):
        for _ in range(3):
            opt.step()
            sched.step()


@pytest.mark.parametrize("kind", ["onecycle", "explore"])
def test_the_right_order_gives_no_warning_and_get_lr_outside_step_does(kind: str) -> None:
    opt = _opt()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sched = _new(kind, opt)
        for _ in range(10):
            opt.step()
            sched.step()
    with pytest.warns(UserWarning, match=r"please use `get_last_lr\(\)`"):
        sched.get_lr()


# ------------------------------------------------------------------------------------------
# step(epoch): torch's deprecated form keeps torch's meaning; a tensor is hpx's loss


def _epoch_warned(sched: Any, epoch: float) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sched.step(epoch)
    assert [str(w.message) for w in caught] == [tls.EPOCH_DEPRECATION_WARNING]


EPOCH_SCHEDULERS: dict[str, Make] = {
    "step": lambda o: tls.StepLR(o, 2),
    "exponential": lambda o: tls.ExponentialLR(o, gamma=0.9),
    "constant": lambda o: tls.ConstantLR(o),
    "linear": lambda o: tls.LinearLR(o),
    "polynomial": lambda o: tls.PolynomialLR(o, power=0.9),
    "multistep": lambda o: tls.MultiStepLR(o, gamma=0.1, milestones=[2, 5, 9]),
    "cosine": lambda o: tls.CosineAnnealingLR(o, T_max=5, eta_min=1e-10),
}


@pytest.mark.parametrize("name", list(EPOCH_SCHEDULERS))
def test_step_with_an_epoch_is_torchs_epoch(name: str) -> None:
    """step(2) again and again holds the lr; step(epoch) over a loop is torch's closed form."""
    make = EPOCH_SCHEDULERS[name]
    for epochs in ([2] * 10, list(range(20))):
        ref_opt, opt = _opt(), _opt()
        _step_both_by_epochs(make(ref_opt), _explore(make(opt)), ref_opt, opt, epochs)


def test_onecycle_step_with_an_epoch_is_torchs_epoch() -> None:
    ref_opt, opt = _opt(), _opt()
    ref, sched = _both_onecycle(ref_opt, opt, max_lr=0.1, total_steps=20)
    _step_both_by_epochs(ref, sched, ref_opt, opt, [3, 3, 7, 4, 20])


def _step_both_by_epochs(ref, sched, ref_opt, opt, epochs) -> None:
    """torch's scheduler and hpx's stepped with the same epochs: the same lrs, counters and warning."""
    for e in epochs:
        ref_opt.step(), opt.step()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ref.step(e)
        _epoch_warned(sched, e)
        _same(opt, ref_opt, e)
        assert sched.last_epoch == ref.last_epoch == e


def test_a_tensor_or_loss_keyword_is_a_loss_not_an_epoch() -> None:
    ref_opt, opt = _opt(), _opt()
    ref, sched = tls.StepLR(ref_opt, 2), _explore(tls.StepLR(opt, 2))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for t in range(6):
            _steps([ref], ref_opt)
            opt.step()
            sched.step(torch.tensor(5.0)) if t % 2 else sched.step(loss=5.0)
            _same(opt, ref_opt, t)
    with pytest.raises(TypeError, match="loss as a tensor or loss="):
        sched.step("5")


@pytest.mark.parametrize("t_mult", [1, 2])
def test_warm_restarts_with_fractional_and_interleaved_epochs(t_mult: int) -> None:
    make = lambda o: tls.CosineAnnealingWarmRestarts(o, T_0=10, T_mult=t_mult, eta_min=1e-10)  # noqa: E731
    ref_opt, opt = _opt(), _opt()
    ref, sched = make(ref_opt), _explore(make(opt))
    epochs = [round(i / 4, 2) for i in range(0, 120)] + [0, 1, 2, 3, 4, 5, 25, 32, 33, 34, 80, 81, 3]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for e in epochs:
            ref.step(e), sched.step(e)
            _same(opt, ref_opt, e)
            if e == 34:  # and plain steps in between, as torch's interleaved test
                ref.step(), sched.step()
                _same(opt, ref_opt, "after 34")


def test_sequential_lr_refuses_an_epoch_as_torch_does() -> None:
    opt = _opt()
    sched = _explore(tls.SequentialLR(opt, [tls.ConstantLR(opt, 0.1, 3), tls.ExponentialLR(opt, 0.9)], [3]))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(TypeError):
            sched.step(2)


# ------------------------------------------------------------------------------------------
# ExploreLR with no spread is the scheduler it wraps, bit for bit


def _sequential(o: torch.optim.Optimizer, parts: list[Make], milestones: list[int]) -> tls.LRScheduler:
    return tls.SequentialLR(o, [p(o) for p in parts], milestones=milestones)


WRAPPED: dict[str, Make] = {
    "step": lambda o: tls.StepLR(o, gamma=0.1, step_size=3),
    "multistep": lambda o: tls.MultiStepLR(o, gamma=0.1, milestones=[2, 5, 9]),
    "constant": lambda o: tls.ConstantLR(o, factor=0.5, total_iters=5),
    "linear": lambda o: tls.LinearLR(o, start_factor=0.25, end_factor=0.6, total_iters=4),
    "exponential": lambda o: tls.ExponentialLR(o, gamma=0.9),
    "polynomial": lambda o: tls.PolynomialLR(o, power=0.9, total_iters=5),
    "cosine": lambda o: tls.CosineAnnealingLR(o, T_max=10, eta_min=1e-10),
    "lambda": lambda o: tls.LambdaLR(o, lr_lambda=[lambda e: 0.9**e, lambda e: 0.8**e]),
    "multiplicative": lambda o: tls.MultiplicativeLR(o, lr_lambda=[lambda e: 0.9, lambda e: 0.8]),
    "warm-restarts-2": lambda o: tls.CosineAnnealingWarmRestarts(o, T_0=10, T_mult=2, eta_min=1e-10),
    "sequential-exp-step": lambda o: _sequential(
        o, [lambda p: tls.ExponentialLR(p, 0.8), lambda p: tls.StepLR(p, 4, 0.1)], [3]),
    "sequential-three": lambda o: _sequential(
        o, [lambda p: tls.ConstantLR(p, 0.1, 3), lambda p: tls.ExponentialLR(p, 0.8),
            lambda p: tls.StepLR(p, 2, 0.1)], [3, 6]),
    "sequential-of-chained": lambda o: _sequential(
        o, [lambda p: tls.ChainedScheduler([tls.LinearLR(p, 0.1, total_iters=5), tls.ConstantLR(p, 0.1, 5)]),
            lambda p: tls.ConstantLR(p, 0.5, 5)], [5]),
    "chained": lambda o: tls.ChainedScheduler(
        [tls.ExponentialLR(o, 0.9), tls.ConstantLR(o, 0.2, 4), tls.StepLR(o, 3, 0.1)]),
    "cyclic-triangular2": lambda o: tls.CyclicLR(o, base_lr=1, max_lr=5, step_size_up=2, step_size_down=6,
                                                 base_momentum=1, max_momentum=5, mode="triangular2"),
    "cyclic-exp-range": lambda o: tls.CyclicLR(o, base_lr=[1, 5], max_lr=[5, 12], step_size_up=4,
                                               base_momentum=[1, 5], max_momentum=[5, 12], mode="exp_range",
                                               gamma=0.9),
    "onecycle": lambda o: tls.OneCycleLR(o, max_lr=25, total_steps=30, base_momentum=1, max_momentum=22),
    "swa": lambda o: SWALR(o, anneal_epochs=5, anneal_strategy="linear", swa_lr=[0.01, 0.02]),
}


@pytest.mark.parametrize("name", list(WRAPPED))
def test_explore_without_spread_is_the_wrapped_scheduler(name: str) -> None:
    make = WRAPPED[name]
    ref_opt, opt = _opt(), _opt()
    ref, wrapped = make(ref_opt), make(opt)  # (torch warns building a SequentialLR of a ChainedScheduler)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sched = _explore(wrapped)
        for t in range(30):
            _same(opt, ref_opt, t)
            assert [_num(v) for v in sched.get_last_lr()] == [_num(v) for v in ref.get_last_lr()]
            _steps([ref], ref_opt), _steps([sched], opt)
    assert sched.last_epoch == getattr(ref, "last_epoch", 30)  # a ChainedScheduler counts in its children


COMPOUND: list[tuple[str, str]] = [("step", "multistep"), ("step", "exponential"),
                                   ("multistep", "exponential"), ("linear", "exponential"),
                                   ("step", "constant"), ("multistep", "linear"),
                                   ("cosine", "step"), ("cosine", "multistep"), ("linear", "cosine"),
                                   ("cosine", "exponential")]


@pytest.mark.parametrize(("first", "second"), COMPOUND)
def test_two_explore_schedulers_on_one_optimizer_compose_as_torchs(first: str, second: str) -> None:
    ref_opt, opt = _opt(), _opt()
    refs = [WRAPPED[first](ref_opt), WRAPPED[second](ref_opt)]
    scheds = [WRAPPED[first](opt), WRAPPED[second](opt)]
    scheds = [_explore(s) for s in scheds]
    for t in range(12):
        _same(opt, ref_opt, t)
        _steps(refs, ref_opt), _steps(scheds, opt)


STATE: dict[str, tuple[Make, Make]] = {
    "step": (lambda o: tls.StepLR(o, gamma=0.1, step_size=3),
             lambda o: tls.StepLR(o, gamma=0.005, step_size=1)),
    "multistep": (lambda o: tls.MultiStepLR(o, gamma=0.1, milestones=[2, 5, 9]),
                  lambda o: tls.MultiStepLR(o, gamma=0.01, milestones=[1, 4, 6])),
    "exponential": (lambda o: tls.ExponentialLR(o, gamma=0.1), lambda o: tls.ExponentialLR(o, gamma=0.01)),
    "cosine": (lambda o: tls.CosineAnnealingLR(o, T_max=10, eta_min=1e-10),
               lambda o: tls.CosineAnnealingLR(o, T_max=5, eta_min=5e-11)),
    "warm-restarts": (lambda o: tls.CosineAnnealingWarmRestarts(o, T_0=10, T_mult=2),
                      lambda o: tls.CosineAnnealingWarmRestarts(o, T_0=100)),
}


@pytest.mark.parametrize("name", list(STATE))
def test_explore_state_loads_into_a_scheduler_built_otherwise(name: str) -> None:
    first, second = STATE[name]
    ref_opt, opt = _opt(), _opt()
    ref, a = first(ref_opt), _explore(first(opt))
    for _ in range(10):
        _steps([ref], ref_opt), _steps([a], opt)
    b = _explore(second(opt_b := _opt()))
    b.load_state_dict(_through_bytes(a.state_dict()))
    assert b.get_last_lr() == a.get_last_lr() and b.last_epoch == a.last_epoch
    for t in range(10):
        _steps([ref], ref_opt), _steps([b], opt_b)
        assert [_num(v) for v in b.get_last_lr()] == [_num(v) for v in ref.get_last_lr()], t


RESUMABLE: dict[str, Callable[[torch.optim.Optimizer, int], tls.LRScheduler]] = {
    "step": lambda o, e: tls.StepLR(o, step_size=3, gamma=0.1, last_epoch=e),
    "exponential": lambda o, e: tls.ExponentialLR(o, gamma=0.9, last_epoch=e),
    "cosine": lambda o, e: tls.CosineAnnealingLR(o, T_max=10, last_epoch=e),
    "warm-restarts": lambda o, e: tls.CosineAnnealingWarmRestarts(o, T_0=20, last_epoch=e),
    "cyclic": lambda o, e: tls.CyclicLR(o, base_lr=0.01, max_lr=0.1, last_epoch=e),
    "onecycle": lambda o, e: tls.OneCycleLR(o, max_lr=0.01, total_steps=10, last_epoch=e),
}


@pytest.mark.parametrize("name", list(RESUMABLE))
def test_explore_over_a_scheduler_rebuilt_with_last_epoch(name: str) -> None:
    """torch's checkpoint pattern: a new optimizer holding the old one's state, the scheduler
    rebuilt with last_epoch=0 and wrapped: the lr is the one the old optimizer holds."""
    make = RESUMABLE[name]
    model = torch.nn.Linear(3, 3)
    o1 = torch.optim.AdamW(model.parameters())
    s1 = _explore(make(o1, -1))
    o1.step(), s1.step()
    o2 = torch.optim.AdamW(model.parameters())
    o2.load_state_dict(o1.state_dict())
    assert _explore(make(o2, 0)).get_last_lr()[0] == o1.param_groups[0]["lr"]
