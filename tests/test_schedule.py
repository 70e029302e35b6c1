"""The drop-in schedulers: hpx.schedule.OneCycleLR against torch's, ExploreLR on top of torch
schedulers, the paper's rule, and the reference scheduler's defects (HDET.md), each caught.

Spread behaviour needs several replicas: in process it is tested through an Engine built from
the same plan/knobs the schedulers use (``OneCyclePlan``, ``explore_knobs``), and end to end
through one launch of two real gloo processes (``_scenario``).
"""

from __future__ import annotations

import inspect
import io
import math
import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn
from torch.optim import lr_scheduler as tls

import hpx
from hpx._onecycle import OneCycleShape
from hpx.errors import ConfigError
from hpx.schedule import ExploreLR, OneCycleLR, OneCyclePlan, explore_knobs
from tests._dist import run_distributed

# hpx writes ``1.0 * rho * f(t)`` with rho = 1.0 and f(t) torch's own float, so with no spread its
# values are bit-identical to OneCycleShape's (asserted with ==). Against torch itself we allow a
# relative 1e-12, as tests/test_onecycle_shape.py does, so a harmless re-association inside a
# future torch does not fail the suite; a real discrepancy is many orders of magnitude larger.
REL = 1e-12


def close(a: float, b: float, rel: float = REL) -> bool:
    return math.isclose(a, b, rel_tol=rel, abs_tol=0.0)


def make_optimizer(kind: str, n_groups: int = 1, lr: float = 0.1) -> torch.optim.Optimizer:
    groups = [{"params": [nn.Parameter(torch.zeros(1))]} for _ in range(n_groups)]
    if kind == "sgd":
        return torch.optim.SGD(groups, lr=lr, momentum=0.9)
    if kind == "adam":
        return torch.optim.Adam(groups, lr=lr)
    if kind == "adagrad":
        return torch.optim.Adagrad(groups, lr=lr)
    raise AssertionError(kind)


def momenta(opt: torch.optim.Optimizer) -> list[float]:
    return [g["betas"][0] if "betas" in g else g["momentum"] for g in opt.param_groups]


def lrs(opt: torch.optim.Optimizer) -> list[float]:
    return [g["lr"] for g in opt.param_groups]


def quiet(fn, *args, **kwargs):
    """Call ``fn`` with hpx's one-replica warning silenced (spread with a single replica)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*has nothing to explore")
        return fn(*args, **kwargs)


def same_state(a: Any, b: Any) -> bool:
    """Deep equality of state dicts that hold tensors."""
    if torch.is_tensor(a) or torch.is_tensor(b):
        return torch.is_tensor(a) and torch.is_tensor(b) and a.shape == b.shape and bool((a == b).all())
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same_state(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(map(same_state, a, b))
    return a == b or (isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b))


def mlp(seed: int = 0, bn: bool = True) -> nn.Module:
    g = torch.Generator().manual_seed(seed)
    layers: list[nn.Module] = [nn.Linear(6, 8)]
    if bn:
        layers.append(nn.BatchNorm1d(8))
    layers += [nn.ReLU(), nn.Linear(8, 2)]
    model = nn.Sequential(*layers)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return model


def data(seed: int, n: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 6, generator=g)
    return x, (x[:, 0] + 0.5 * x[:, 1] > 0).long()


def batch(xy, step: int, size: int = 32, seed: int = 0):
    x, y = xy
    idx = torch.randint(0, len(x), (size,), generator=torch.Generator().manual_seed(seed * 100_003 + step))
    return x[idx], y[idx]


def ce(rep: hpx.Replica, b) -> torch.Tensor:
    return F.cross_entropy(rep.model(b[0]), b[1])


# ------------------------------------------------------------------------------------------
# OneCycleLR is torch's OneCycleLR: every step, hypothesis-generated configurations

unit = st.floats(0.0, 1.0, exclude_max=True)


@st.composite
def configurations(draw: st.DrawFn) -> tuple[str, int, dict[str, Any], float]:
    n_groups = draw(st.integers(1, 3))
    max_lrs = [10 ** draw(st.floats(-6, 1)) for _ in range(n_groups)]
    total = draw(st.integers(2, 200))
    pct = draw(st.floats(0.0, 1.0, exclude_min=True, exclude_max=True) | st.just(0.0) | st.just(1.0))

    def mom() -> float | list[float]:
        return draw(unit) if draw(st.booleans()) else [draw(unit) for _ in range(n_groups)]

    kwargs: dict[str, Any] = {
        "max_lr": max_lrs if n_groups > 1 or draw(st.booleans()) else max_lrs[0],
        "pct_start": pct,
        "anneal_strategy": draw(st.sampled_from(["cos", "linear"])),
        "cycle_momentum": draw(st.booleans()),
        "base_momentum": mom(),
        "max_momentum": mom(),
        "div_factor": 10 ** draw(st.floats(-2, 6)),
        "final_div_factor": 10 ** draw(st.floats(-2, 8)),
        "three_phase": draw(st.booleans()),
    }
    divisors = [d for d in range(1, total + 1) if total % d == 0]
    if draw(st.booleans()):
        kwargs["total_steps"] = total
    else:
        spe = draw(st.sampled_from(divisors))
        kwargs.update(epochs=total // spe, steps_per_epoch=spe)
    spread = draw(st.sampled_from([0.0, 0.0, 0.3]))  # one replica: any spread is still torch's
    return draw(st.sampled_from(["sgd", "adam"])), n_groups, kwargs, spread


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(configurations())
def test_drop_in_writes_torchs_lrs_and_momenta_at_every_step(config) -> None:
    kind, n_groups, kwargs, spread = config
    ref_opt, opt = make_optimizer(kind, n_groups), make_optimizer(kind, n_groups)
    try:
        ref = tls.OneCycleLR(ref_opt, **kwargs)
    except ZeroDivisionError:  # torch dies when pct_start * total_steps == 1; hpx says why
        with pytest.raises(ConfigError, match=r"pct_start \* total_steps"):
            quiet(OneCycleLR, opt, **kwargs, spread=spread)
        return
    sched = quiet(OneCycleLR, opt, **kwargs, spread=spread)
    total = ref.total_steps
    shape = OneCycleShape.from_args(n_groups, **kwargs)
    for step in range(total + 2):
        assert sched.last_epoch == ref.last_epoch == step
        assert all(map(close, lrs(opt), lrs(ref_opt))), (step, lrs(opt), lrs(ref_opt))
        assert all(map(close, sched.get_last_lr(), ref.get_last_lr()))
        assert lrs(opt) == shape.lrs(step)  # bit for bit: 1.0 * 1.0 * f(t)
        assert all(map(close, momenta(opt), momenta(ref_opt))), (step, momenta(opt), momenta(ref_opt))
        if kwargs["cycle_momentum"]:
            assert momenta(opt) == shape.momentums(step)
        else:
            assert momenta(opt) == momenta(ref_opt) == [0.9] * n_groups  # left alone, as torch does
        ref_opt.step()
        opt.step()
        try:
            ref.step()
        except (ValueError, ZeroDivisionError):  # torch refuses this step; so must hpx, lrs untouched
            before = lrs(opt)
            with pytest.raises(ValueError):
                sched.step(torch.tensor(1.0))
            assert lrs(opt) == before  # and the counters have moved on as torch's did
            assert (sched.last_epoch, sched._step_count) == (ref.last_epoch, ref._step_count)
            return
        sched.step(torch.tensor(1.0))
    raise AssertionError("torch never refused a step")


def test_is_a_torch_lr_scheduler_with_torchs_group_entries() -> None:
    ref_opt, opt = make_optimizer("sgd", 2), make_optimizer("sgd", 2)
    kwargs = {"max_lr": [0.3, 0.07], "total_steps": 50, "base_momentum": [0.8, 0.7], "div_factor": 7.0}
    ref, sched = tls.OneCycleLR(ref_opt, **kwargs), OneCycleLR(opt, **kwargs)
    assert isinstance(sched, tls.LRScheduler)  # frameworks that check the type accept it
    keys = ("initial_lr", "max_lr", "min_lr", "base_momentum", "max_momentum", "lr", "momentum")
    for ours, theirs in zip(opt.param_groups, ref_opt.param_groups):
        assert {k: ours[k] for k in keys} == {k: theirs[k] for k in keys}
    assert sched.base_lrs == ref.base_lrs and sched.total_steps == ref.total_steps
    assert sched.engine is None and sched.n_replicas == 1


def test_zero_spread_through_the_engine_is_torchs_onecycle() -> None:
    """Several replicas and syncs, no spread: every replica writes torch's numbers."""
    kwargs = {"max_lr": [0.3, 0.05], "total_steps": 30, "anneal_strategy": "linear"}
    ref_opt = make_optimizer("sgd", 2)
    ref = tls.OneCycleLR(ref_opt, **kwargs)
    plan = OneCyclePlan(OneCycleShape.from_args(2, **kwargs), sync_every=4)
    engine = _plan_engine(plan, n=3)
    xy = data(7)
    for step in range(31):
        for r in engine.replicas:
            assert lrs(r.optimizer) == lrs(ref_opt) and momenta(r.optimizer) == momenta(ref_opt), step
        if step < 30:
            engine.step(ce, batch(xy, step, size=48))
            ref_opt.step(), ref.step()
    assert engine.bases["lr/0"] == engine.bases["lr/1"] == 1.0 and len(engine.history) == 7


def test_epochs_and_steps_per_epoch_are_accepted() -> None:
    # The reference scheduler needed total_steps (epochs/steps_per_epoch alone: TypeError).
    ref_opt, opt = make_optimizer("adam"), make_optimizer("adam")
    ref = tls.OneCycleLR(ref_opt, max_lr=0.01, epochs=3, steps_per_epoch=7)
    sched = OneCycleLR(opt, max_lr=0.01, epochs=3, steps_per_epoch=7)
    assert sched.total_steps == ref.total_steps == 21
    for _ in range(21):
        assert lrs(opt) == lrs(ref_opt) and momenta(opt) == momenta(ref_opt)
        ref_opt.step(), opt.step(), ref.step(), sched.step()
    with pytest.raises(ConfigError, match="give total_steps, or both epochs and steps_per_epoch"):
        OneCycleLR(make_optimizer("sgd"), max_lr=0.01, epochs=3)


@pytest.mark.parametrize("wrap", [False, True], ids=["OneCycleLR", "ExploreLR"])
def test_a_tensor_lr_stays_a_tensor_as_in_torch(wrap: bool) -> None:
    """Capturable/compiled optimizers keep their lr tensor (written in place, as torch does)."""

    def make():
        return torch.optim.Adam([nn.Parameter(torch.zeros(2))], lr=torch.tensor(0.01), capturable=True)

    ref_opt, opt = make(), make()
    ref = tls.OneCycleLR(ref_opt, max_lr=0.1, total_steps=20)
    lr_tensor = opt.param_groups[0]["lr"]
    sched = ExploreLR(tls.OneCycleLR(opt, max_lr=0.1, total_steps=20)) if wrap else \
        OneCycleLR(opt, max_lr=0.1, total_steps=20)
    for _ in range(20):
        assert opt.param_groups[0]["lr"] is lr_tensor
        assert torch.equal(lr_tensor, ref_opt.param_groups[0]["lr"])
        assert torch.equal(sched.get_last_lr()[0], ref.get_last_lr()[0])
        assert momenta(opt) == momenta(ref_opt)
        ref_opt.step(), opt.step(), ref.step(), sched.step()


def test_last_epoch_resumes_where_torch_resumes() -> None:
    ref_opt, opt = make_optimizer("sgd", 2), make_optimizer("sgd", 2)
    kwargs = {"max_lr": [0.1, 0.2], "total_steps": 30, "three_phase": True}
    tls.OneCycleLR(ref_opt, **kwargs)  # puts initial_lr etc. in the groups, as a checkpoint would
    OneCycleLR(opt, **kwargs)
    ref, sched = tls.OneCycleLR(ref_opt, **kwargs, last_epoch=9), OneCycleLR(opt, **kwargs, last_epoch=9)
    for step in range(10, 31):
        assert sched.last_epoch == ref.last_epoch == step
        assert lrs(opt) == lrs(ref_opt) and momenta(opt) == momenta(ref_opt)
        if step < 30:
            ref_opt.step(), opt.step(), ref.step(), sched.step()
    with pytest.raises(ValueError, match="Tried to step 31 times"):
        OneCycleLR(make_optimizer("sgd", 2), **kwargs, last_epoch=30)


def test_migrating_is_the_import_plus_the_loss() -> None:
    """The same training loop with torch's scheduler and with hpx's trains the same weights."""
    xy = data(1)

    def train(make_sched, with_loss: bool) -> torch.Tensor:
        model = mlp(3)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
        sched = make_sched(opt, max_lr=0.5, total_steps=60)
        for step in range(60):
            x, y = batch(xy, step)
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step(loss) if with_loss else sched.step()
        state = model.state_dict().values()
        return torch.cat([p.detach().reshape(-1) for p in state if p.is_floating_point()])

    assert torch.equal(train(tls.OneCycleLR, False), train(OneCycleLR, True))


# ------------------------------------------------------------------------------------------
# state_dict / load_state_dict, as torch's own scheduler tests check them


def test_state_dict_round_trip_between_differently_built_schedulers() -> None:
    """The saved schedule (length, phases, annealing) replaces b's; the cycle's anchors are read
    from b's param groups (b's constructor wrote them there), exactly as torch's OneCycleLR does."""
    opt_a, opt_b, ref_opt, ref_opt_b = (make_optimizer("adam", 2) for _ in range(4))
    a_args = {"max_lr": [0.05, 0.2], "total_steps": 30, "anneal_strategy": "linear", "three_phase": True,
              "base_momentum": 0.7}
    b_args = {"max_lr": 0.3, "epochs": 10, "steps_per_epoch": 10}
    a = OneCycleLR(opt_a, **a_args, sync_every=5)
    b = OneCycleLR(opt_b, **b_args, sync_every=5)
    ref, ref_b = tls.OneCycleLR(ref_opt, **a_args), tls.OneCycleLR(ref_opt_b, **b_args)
    for _ in range(11):
        opt_a.step(), ref_opt.step(), a.step(torch.tensor(2.0)), ref.step()
    state = a.state_dict()
    assert "optimizer" not in state and "replicas" not in state["hpx"]  # torch's contract
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    b.load_state_dict(torch.load(buf, weights_only=True))  # plain data: loads without pickle code
    ref_b.load_state_dict(ref.state_dict())
    assert b.get_last_lr() == a.get_last_lr() and b.last_epoch == a.last_epoch == 11
    assert b.total_steps == 30 and b.shape.max_lrs == (0.3, 0.3)
    for _ in range(19):  # b continues as torch's b does after the same load
        for o in (opt_a, opt_b, ref_opt, ref_opt_b):
            o.step()
        a.step(), b.step(), ref.step(), ref_b.step()
        assert lrs(opt_a) == lrs(ref_opt) and lrs(opt_b) == lrs(ref_opt_b)
        assert momenta(opt_b) == momenta(ref_opt_b)


def test_paper_rule_state_resumes_the_same_trajectory() -> None:
    """Resuming mid-decay continues the same lrs (bases after the handover are restored)."""
    kwargs = {"max_lr": 0.1, "total_steps": 60, "rule": "paper", "sync_every": 5, "warmup": 20}
    opt_a, opt_b = make_optimizer("sgd"), make_optimizer("sgd")
    a = OneCycleLR(opt_a, **kwargs)
    shape, q = a.shape, 1 - a.plan.decay
    for t in range(1, 34):  # one replica: OneCycle, then the rule's decay from OneCycle's lr at 20
        opt_a.step(), a.step()  # the optimizer first, as torch asks (no gradients: nothing moves)
        want = shape.lr(0, t) if t < 20 else shape.lr(0, 20) * q ** ((t - 20) / 5)
        assert lrs(opt_a)[0] == pytest.approx(want, rel=1e-12)
    b = OneCycleLR(opt_b, **kwargs)
    b.load_state_dict(a.state_dict())
    assert lrs(opt_b) == lrs(opt_a)
    for _ in range(27):
        opt_a.step(), opt_b.step(), a.step(), b.step()
        assert lrs(opt_b) == lrs(opt_a) and momenta(opt_b) == momenta(opt_a)
    with pytest.raises(ConfigError, match="sync_every=5, this scheduler has sync_every=6"):
        OneCycleLR(make_optimizer("sgd"), **{**kwargs, "sync_every": 6}).load_state_dict(a.state_dict())


def test_stepping_past_the_end_raises_torchs_error_and_changes_no_value() -> None:
    opt = make_optimizer("sgd")
    sched = OneCycleLR(opt, max_lr=0.1, total_steps=5)
    for _ in range(5):
        opt.step(), sched.step()  # the optimizer first, as torch asks (no gradients: nothing moves)
    before = (lrs(opt), momenta(opt), sched.state_dict()["hpx"]["step"])
    with pytest.raises(ValueError, match="Tried to step 6 times"):
        sched.step()
    assert (lrs(opt), momenta(opt), sched.state_dict()["hpx"]["step"]) == before
    assert sched.last_epoch == 6  # counted, as torch counts a step it then refuses


# ------------------------------------------------------------------------------------------
# ExploreLR on top of torch schedulers


def _cosine(o):
    return tls.CosineAnnealingLR(o, T_max=40, eta_min=1e-4)


def _warmup_decay(o):  # LambdaLR: linear warm-up over 8 steps, then linear decay to 0 at 40
    return tls.LambdaLR(o, lambda t: (t + 1) / 8 if t < 8 else max(0.0, (40 - t) / 32))


def _warmup_cosine(o):  # SequentialLR: LinearLR warm-up, then cosine
    return tls.SequentialLR(o, [tls.LinearLR(o, 0.1, 1.0, total_iters=6), tls.CosineAnnealingLR(o, 34)],
                            milestones=[6])


def _wsd(o, warm: int = 5, decay_at: int = 25, gamma: float = 0.85):
    # warmup-stable-decay from chainable pieces (ExponentialLR computes from the last lr)
    return tls.SequentialLR(o, [tls.LinearLR(o, 0.2, 1.0, total_iters=warm), tls.ConstantLR(o, 1.0, 1),
                                tls.ExponentialLR(o, gamma)], milestones=[warm, decay_at])


def _torch_onecycle(o):  # momentum cycling is passed through
    return tls.OneCycleLR(o, max_lr=[0.2, 0.5], total_steps=40, three_phase=True)


SCHEDULERS = {"cosine": _cosine, "lambda-warmup-decay": _warmup_decay, "sequential-warmup-cosine":
              _warmup_cosine, "wsd": _wsd, "torch-onecycle": _torch_onecycle}


@pytest.mark.parametrize("kind", ["sgd", "adam"])
@pytest.mark.parametrize("name", list(SCHEDULERS))
def test_explore_without_spread_writes_the_schedulers_own_lrs(name: str, kind: str) -> None:
    make = SCHEDULERS[name]
    ref_opt, opt = make_optimizer(kind, 2), make_optimizer(kind, 2)
    ref = make(ref_opt)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no scheduler-order warnings from the shadow copy
        sched = ExploreLR(make(opt), sync_every=4)
        for step in range(40):
            assert lrs(opt) == lrs(ref_opt), (step, lrs(opt), lrs(ref_opt))
            assert momenta(opt) == momenta(ref_opt)
            assert sched.get_last_lr() == ref.get_last_lr()
            ref_opt.step(), opt.step(), ref.step(), sched.step(torch.tensor(1.0))
    assert sched.last_epoch == ref.last_epoch


def test_explore_state_round_trip_between_differently_built_schedulers() -> None:
    opt_a, opt_b, ref_opt = (make_optimizer("sgd", 2) for _ in range(3))
    a, ref = ExploreLR(_wsd(opt_a), sync_every=4), _wsd(ref_opt)
    b = ExploreLR(_wsd(opt_b, warm=3, decay_at=10, gamma=0.5), sync_every=4)
    for _ in range(27):  # into the ExponentialLR phase, which computes from the previous lr
        opt_a.step(), ref_opt.step(), a.step(), ref.step()
    buf = io.BytesIO()
    torch.save(a.state_dict(), buf)
    buf.seek(0)
    b.load_state_dict(torch.load(buf, weights_only=True))
    assert same_state(b.state_dict(), a.state_dict()) and b.get_last_lr() == a.get_last_lr()
    for _ in range(10):
        for o in (opt_a, opt_b, ref_opt):
            o.step()
        a.step(), b.step(), ref.step()
        assert lrs(opt_b) == lrs(opt_a) == lrs(ref_opt)


@pytest.mark.parametrize("name", ["cosine", "lambda-warmup-decay", "wsd", "sequential-warmup-cosine"])
def test_explore_with_spread_keeps_the_schedules_shape(name: str) -> None:
    """Replica r trains at b * rho_r * lr(t): between syncs consecutive lrs have the torch
    scheduler's own ratio; at syncs only the correction b and the assignment of rho move."""
    make = SCHEDULERS[name]
    ref_opt, template = make_optimizer("sgd", 1, lr=0.2), make_optimizer("sgd", 1, lr=0.2)
    ref = make(ref_opt)
    n, alpha, T = 4, 0.3, 5
    engine = hpx.Engine(mlp(), lambda m: torch.optim.SGD(m.parameters(), lr=0.2, momentum=0.9),
                        explore_knobs(make(template), spread=alpha), replicas=n, sync_every=T)
    xy = data(2)
    rhos = sorted(1 + alpha * u for u in hpx.slot_offsets(n).tolist())
    prev = None
    moved = False
    for step in range(40):
        want = ref_opt.param_groups[0]["lr"]
        got = [r.optimizer.param_groups[0]["lr"] for r in engine.replicas]
        b = engine.bases["lr/0"]
        moved |= b != 1.0
        assert sorted(got) == pytest.approx([b * r * want for r in rhos], rel=1e-12)
        if prev is not None and step % T != 0 and prev[1] > 0:
            for g, p in zip(got, prev[0]):
                assert g / p == pytest.approx(want / prev[1], rel=1e-12)
        prev = (got, want)
        engine.step(ce, batch(xy, step, size=64))
        ref_opt.step(), ref.step()
    assert moved  # the controller did learn a correction


# ------------------------------------------------------------------------------------------
# The reference scheduler's defects (HDET.md), each with a test that would catch it


def _grouped_sgd(model: nn.Module, n_groups: int) -> torch.optim.Optimizer:
    params = list(model.parameters())
    if n_groups == 1:
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    return torch.optim.SGD([{"params": params[:2]}, {"params": params[2:]}], lr=0.1, momentum=0.9)


def _plan_engine(plan: OneCyclePlan, n: int = 4, model: nn.Module | None = None, **settings) -> hpx.Engine:
    return hpx.Engine(model or mlp(), lambda m: _grouped_sgd(m, plan.shape.n_groups), plan.knobs(),
                      replicas=n, **{**plan.settings(), **settings})


def test_spread_is_active_from_step_0() -> None:
    """Defect: the spread went into base_lrs, which OneCycleLR never reads, so every replica
    trained at one lr until the auto-LR warm-up ended."""
    shape = OneCycleShape.from_args(2, [0.1, 0.4], total_steps=100)
    plan = OneCyclePlan(shape, spread=0.25, rule="paper", sync_every=10)
    engine = _plan_engine(plan)
    rhos = [1 + 0.25 * u for u in hpx.slot_offsets(4).tolist()]
    for g in range(2):
        got = [r.optimizer.param_groups[g]["lr"] for r in engine.replicas]
        assert sorted(got) == pytest.approx([rho * shape.lr(g, 0) for rho in rhos], rel=1e-12)
        assert len(set(got)) == 4


def test_averaging_runs_without_the_controller_and_includes_buffers() -> None:
    """Defects: with auto-LR off there was no converge stage at all; and only optimizer
    parameters were averaged, not buffers (BatchNorm statistics)."""
    shape = OneCycleShape.from_args(1, 0.3, total_steps=40)
    engine = _plan_engine(OneCyclePlan(shape, spread=0.3, sync_every=5), controller=False, mode="independent")
    xy = data(3)
    for step in range(10):
        engine.step(ce, batch(xy, step, size=64))
        states = [r.model.state_dict() for r in engine.replicas]
        differ = {k: any(not torch.equal(v, s[k]) for s in states[1:]) for k, v in states[0].items()}
        if engine.step_count % 5 == 0:
            assert not any(differ.values()), (step, differ)
        else:  # trained apart: BatchNorm statistics and weights differ until the next sync
            assert differ["1.running_mean"] and differ["1.running_var"] and differ["3.weight"], step
    assert engine.bases["lr/0"] == 1.0  # nothing moved the base


def test_paper_rule_decays_to_onecycles_floor_smoothly_and_keeps_cycling_momentum() -> None:
    """Defects: gamma negative with OneCycle's defaults (the base grew 400x); flat lr between
    syncs; momentum stopped cycling once the controller started; decay matched to
    div_factor / final_div_factor instead of OneCycle's own floor."""
    total, T, warmup = 120, 10, 36
    shape = OneCycleShape.from_args(1, 0.2, total_steps=total)  # div 25, final_div 1e4: defaults
    plan = OneCyclePlan(shape, spread=0.2, rule="paper", sync_every=T, warmup=warmup)
    H = plan.handover
    K = (total - H) / T
    assert H == 40 and plan.decay > 0
    assert 1 - math.exp(-math.log(25 / 1e4) / K) < 0  # the paper's Eq. 8: a growth, not a decay
    # meta_lr=0 leaves only the rule's deterministic part: b <- b (1 - gamma) at each sync.
    engine = _plan_engine(plan, meta_lr=0.0)
    xy, q = data(4), 1 - plan.decay
    means = []
    for step in range(total + 1):
        vals = engine.values("lr/0")
        means.append(sum(vals) / len(vals))
        assert engine.values("momentum/0") == [shape.momentum(0, step)] * 4
        if step < total:
            engine.step(ce, batch(xy, step, size=64))
    for t in range(H):
        assert means[t] == pytest.approx(shape.lr(0, t), rel=1e-12)
    for t in range(H, total + 1):  # geometric from OneCycle's lr at H: no jump, never flat
        assert means[t] == pytest.approx(shape.lr(0, H) * q ** ((t - H) / T), rel=1e-9)
        assert means[t] < means[t - 1]
    assert means[total] == pytest.approx(shape.min_lr(0), rel=1e-9)  # OneCycle's own floor
    assert engine.bases["lr/0"] < plan.bases[0]


def test_paper_rule_takes_over_with_the_linear_rule_and_fixed_temperature() -> None:
    shape = OneCycleShape.from_args(1, 0.2, total_steps=120)
    plan = OneCyclePlan(shape, spread=0.2, rule="paper", sync_every=10)
    assert plan.warmup == 36 and plan.handover == 40  # default warmup: OneCycle's peak
    engine = _plan_engine(plan)
    xy = data(5)
    for step in range(60):
        engine.step(ce, batch(xy, step, size=64))
    controlled = [r for r in engine.history if r.weights is not None]
    assert [r.step for r in controlled] == [40, 50, 60]
    assert all(r.sigma == 0.1 for r in controlled)
    assert engine.config.space == "linear" and engine.controller.space == "linear"
    assert engine.bases["lr/0"] > 0  # kept positive


def test_the_users_global_rng_is_untouched() -> None:
    """Defect: torch.manual_seed(1024) in the constructor overwrote the user's seed."""
    model = mlp()  # nn.Linear's own init draws from the global RNG: build it before looking
    torch.manual_seed(1234)
    before = torch.random.get_rng_state()
    opt = make_optimizer("sgd", 2)
    a = quiet(OneCycleLR, opt, max_lr=0.1, total_steps=30, spread=0.2, sync_every=3)
    b = ExploreLR(_warmup_cosine(make_optimizer("sgd", 2)), sync_every=3)
    plan = OneCyclePlan(OneCycleShape.from_args(1, 0.1, total_steps=30), spread=0.2, sync_every=3)
    engine = _plan_engine(plan, model=model)
    assert torch.equal(torch.random.get_rng_state(), before)
    for step in range(30):
        opt.step(), b.optimizer.step()  # the optimizers first, as torch asks (no gradients: nothing moves)
        a.step(torch.tensor(1.0)), b.step()
        engine.step(ce, batch(data(6), step, size=16))
    assert torch.equal(torch.random.get_rng_state(), before)


def test_sync_every_zero_is_a_clear_error() -> None:
    # The reference scheduler died with ZeroDivisionError.
    with pytest.raises(ConfigError, match=r"sync_every must be an integer >= 1 \(got 0\)"):
        OneCycleLR(make_optimizer("sgd"), max_lr=0.1, total_steps=10, sync_every=0)


# ------------------------------------------------------------------------------------------
# Errors: every problem at once, each naming the argument, the value and what is allowed


class _TwoProcesses:
    """A Collective stand-in that reports two processes (only the configuration is checked)."""

    rank, world_size = 0, 2

    def all_reduce_sum_(self, tensors): ...
    def all_gather(self, tensor): ...
    def broadcast_(self, tensor, src=0): ...
    def broadcast_object(self, obj, src=0): ...
    def check_same(self, tensor, what): ...


def test_every_problem_is_listed_at_once() -> None:
    with pytest.raises(ConfigError) as info:
        OneCycleLR(make_optimizer("sgd", 2), max_lr=[0.1], total_steps=0, spread=1.5, rule="greedy",
                   sync_every=0, warmup=-3, temperature=-1.0, replicas=4, model="net")
    problems = info.value.problems
    for text in ["max_lr must be one number or a list of 2",
                 "total_steps must be a positive integer (got 0)",
                 "spread must be a number in [0, 1)", "rule must be 'hpx' or 'paper' (got 'greedy')",
                 "sync_every must be an integer >= 1 (got 0)",
                 "warmup must be an integer >= 0 or None (got -3)",
                 "replicas is not a setting of OneCycleLR (got 4)",
                 "model must be a torch.nn.Module or None (got str)",
                 "temperature must be 'auto' or a number > 0 (got -1.0)"]:
        assert any(text in p for p in problems), (text, problems)
    assert len(problems) == 9 and isinstance(info.value, ValueError)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"spread": 0.2}, "spread=0.2 with 2 replicas needs model=..."),
        ({"spread": 0.2, "model": nn.Linear(1, 1)}, "mode='shared' with 2 processes needs the model wrapped"),
        ({"rule": "paper", "decay": 0.1}, "decay is set by rule='paper' (got decay=0.1)"),
        ({"rule": "paper", "final_div_factor": 0.01}, "rule='paper' decays the lr from OneCycle's value"),
        ({"temperature": "hot"}, "temperature must be 'auto' or a number > 0"),
        ({"cycle_momentum": True, "_opt": "adagrad"}, "cycle_momentum=True needs an optimizer with momentum"),
    ],
)
def test_single_problems_name_what_to_do(kwargs: dict[str, Any], message: str) -> None:
    opt = make_optimizer(kwargs.pop("_opt", "sgd"))
    with pytest.raises(ConfigError) as info:
        OneCycleLR(opt, max_lr=0.1, total_steps=100, backend=_TwoProcesses(), **kwargs)
    assert len(info.value.problems) == 1 and message in info.value.problems[0], info.value.problems


def test_explore_refuses_what_it_cannot_follow() -> None:
    opt = make_optimizer("sgd")
    with pytest.raises(ConfigError, match="ReduceLROnPlateau follows a metric"):
        ExploreLR(tls.ReduceLROnPlateau(opt))
    with pytest.raises(ConfigError, match=r"must be a torch\.optim\.lr_scheduler\.LRScheduler"):
        ExploreLR(opt)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="already an hpx scheduler"):
        ExploreLR(ExploreLR(_cosine(opt)))


def test_a_spread_with_one_replica_warns_and_stays_torchs_schedule() -> None:
    opt, ref_opt = make_optimizer("sgd"), make_optimizer("sgd")
    with pytest.warns(UserWarning, match=r"spread=0.3 has nothing to explore"):
        OneCycleLR(opt, max_lr=0.1, total_steps=10, spread=0.3)
    tls.OneCycleLR(ref_opt, max_lr=0.1, total_steps=10)
    assert lrs(opt) == lrs(ref_opt)


# ------------------------------------------------------------------------------------------
# Two real processes: the schedulers end to end under torch.distributed (one launch)

W, T, ALPHA = 2, 5, 0.5


def _snapshot(model: nn.Module) -> torch.Tensor:
    m = getattr(model, "module", model)
    return torch.cat([t.detach().reshape(-1).clone() for t in [*m.parameters(), *m.buffers()]
                      if t.is_floating_point()])


def _train(rank: int, sched, model, opt, steps: int, seed: int, on_step=None) -> dict[str, Any]:
    xy = data(50 + rank)  # each rank its own data
    rec: dict[str, Any] = {"lr": [], "mom": [], "bases": [], "pre": {}, "post": {}, "rng_same": True}
    for step in range(steps):
        rec["lr"].append(lrs(opt))
        rec["mom"].append(momenta(opt))
        rec["bases"].append(dict(sched.bases))
        x, y = batch(xy, step, seed=seed)
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if (step + 1) % T == 0:
            rec["pre"][step + 1] = _snapshot(model)
        rng = torch.random.get_rng_state()
        sched.step(loss)
        rec["rng_same"] &= torch.equal(rng, torch.random.get_rng_state())
        if (step + 1) % T == 0:
            rec["post"][step + 1] = _snapshot(model)
        if on_step is not None:
            on_step(step + 1)
    rec["lr"].append(lrs(opt))
    rec["bases"].append(dict(sched.bases))
    return rec


def _scenario(rank: int, world_size: int) -> dict[str, Any]:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(1000 + rank)  # ranks' global RNGs differ: permutations must not care
    out: dict[str, Any] = {}

    def ddp_model() -> nn.Module:  # buffers not synced by DDP's forward: only hpx's sync averages them
        if "forward_sync_buffers" in inspect.signature(DDP).parameters:
            return DDP(mlp(0), forward_sync_buffers=False)
        return DDP(mlp(0), broadcast_buffers=False)

    def two_groups(model, **kw):
        m = model.module
        return torch.optim.SGD([{"params": m[0].parameters()}, {"params": [*m[1].parameters(),
                                *m[3].parameters()]}], lr=0.1, momentum=0.9, **kw)

    # (a) the drop-in with a spread; reloads rank 0's state on every rank at step 20
    model = ddp_model()
    opt = two_groups(model)
    rng = torch.random.get_rng_state()
    sched = OneCycleLR(opt, max_lr=[0.2, 0.05], total_steps=40, model=model, spread=ALPHA, sync_every=T)
    out["rng_construct"] = torch.equal(rng, torch.random.get_rng_state())
    out["engine"] = (sched.n_replicas, type(sched.engine.collective).__name__)

    def reload(step: int) -> None:
        if step == 20:
            box = [sched.state_dict() if rank == 0 else None]
            dist.broadcast_object_list(box, src=0)
            before = lrs(opt)
            sched.load_state_dict(box[0])
            out["reload_same_lrs"] = lrs(opt) == before

    out["a"] = _train(rank, sched, model, opt, 40, seed=rank, on_step=reload)

    # (b) averaging without the controller
    model = ddp_model()
    opt = two_groups(model)
    sched = OneCycleLR(opt, max_lr=0.2, total_steps=20, model=model, spread=ALPHA, sync_every=T,
                       controller=False)
    out["b"] = _train(rank, sched, model, opt, 20, seed=rank)

    # (c) ExploreLR over cosine, and the torch scheduler's own lrs for comparison
    model = ddp_model()
    opt = two_groups(model)
    ref_opt = make_optimizer("sgd", 2)
    ref = tls.CosineAnnealingLR(ref_opt, T_max=30, eta_min=1e-3)
    sched = ExploreLR(tls.CosineAnnealingLR(opt, T_max=30, eta_min=1e-3), model=model, spread=ALPHA,
                      sync_every=T)
    out["c"] = _train(rank, sched, model, opt, 30, seed=rank)
    ref_lrs = []
    for _ in range(31):
        ref_lrs.append(lrs(ref_opt))
        ref_opt.step()
        ref.step()
    out["c_ref"] = ref_lrs

    # (d) zero spread with a model: the engine runs, and the lrs are torch's own
    model = ddp_model()
    opt, ref_opt = two_groups(model), make_optimizer("sgd", 2)
    sched = OneCycleLR(opt, max_lr=[0.2, 0.05], total_steps=20, model=model, sync_every=T)
    ref = tls.OneCycleLR(ref_opt, max_lr=[0.2, 0.05], total_steps=20)
    same = True
    xy = data(60 + rank)
    for step in range(20):
        same &= lrs(opt) == lrs(ref_opt) and momenta(opt) == momenta(ref_opt)
        x, y = batch(xy, step, seed=rank)
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step(), ref_opt.step()
        sched.step(loss), ref.step()
    out["d_same"] = same and sched.engine is not None
    return out


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    return run_distributed(_scenario, W, timeout=120.0)


def _check_spread(recs: list[dict[str, Any]], reference, steps: int) -> None:
    """Every step: each rank's lr is b * rho * schedule with rho in {1 - a, 1 + a}, the ranks hold
    different slots (mean rho exactly 1), and the bases agree across ranks."""
    for t in range(steps + 1):
        assert recs[0]["bases"][t] == recs[1]["bases"][t]
        for g in range(2):
            want = reference(g, t) * recs[0]["bases"][t][f"lr/{g}"]
            got = sorted(r["lr"][t][g] for r in recs)
            assert got == pytest.approx([(1 - ALPHA) * want, (1 + ALPHA) * want], rel=1e-12), (t, g)


def _check_averaged(recs: list[dict[str, Any]]) -> None:
    """At each sync: parameters and BatchNorm buffers differ before, are the mean after."""
    for step, pre0 in recs[0]["pre"].items():
        pre1, post0, post1 = recs[1]["pre"][step], recs[0]["post"][step], recs[1]["post"][step]
        assert not torch.equal(pre0, pre1)
        assert torch.equal(post0, post1)
        assert torch.allclose(post0, (pre0 + pre1) / 2, rtol=1e-6, atol=1e-7)


@pytest.mark.procs
def test_dist_drop_in_spreads_from_step_0_with_consistent_permutations(ranks) -> None:
    shape = OneCycleShape.from_args(2, [0.2, 0.05], total_steps=40)
    recs = [r["a"] for r in ranks]
    assert ranks[0]["engine"] == (2, "TorchDistributed")  # picked up without backend=...
    _check_spread(recs, shape.lr, 40)
    assert recs[0]["lr"][0] != recs[1]["lr"][0]  # from step 0
    assert any(b["lr/0"] != 1.0 for b in recs[0]["bases"])  # the controller learned a correction
    for r in recs:  # momentum cycles exactly as OneCycle's, on every rank
        assert r["mom"] == [shape.momentums(t) for t in range(40)]


@pytest.mark.procs
def test_dist_parameters_and_buffers_are_averaged_with_and_without_controller(ranks) -> None:
    _check_averaged([r["a"] for r in ranks])
    _check_averaged([r["b"] for r in ranks])
    assert all(b == {"lr/0": 1.0, "lr/1": 1.0, "momentum/0": 1.0, "momentum/1": 1.0}
               for r in ranks for b in r["b"]["bases"])
    _check_spread([r["b"] for r in ranks], OneCycleShape.from_args(2, 0.2, total_steps=20).lr, 20)


@pytest.mark.procs
def test_dist_global_rng_untouched_and_rank0_state_loads_on_every_rank(ranks) -> None:
    for r in ranks:
        assert r["rng_construct"] and r["a"]["rng_same"] and r["b"]["rng_same"] and r["c"]["rng_same"]
        assert r["reload_same_lrs"]


@pytest.mark.procs
def test_dist_explore_keeps_the_schedulers_shape(ranks) -> None:
    recs, ref = [r["c"] for r in ranks], ranks[0]["c_ref"]
    _check_spread(recs, lambda g, t: ref[t][g], 30)
    for r in recs:
        for t in range(1, 31):
            if t % T:  # no sync between t-1 and t: the torch scheduler's own ratio
                for g in range(2):
                    assert r["lr"][t][g] / r["lr"][t - 1][g] == pytest.approx(ref[t][g] / ref[t - 1][g],
                                                                              rel=1e-12)
    _check_averaged(recs)


@pytest.mark.procs
def test_dist_zero_spread_with_the_engine_is_torchs_onecycle(ranks) -> None:
    assert all(r["d_same"] for r in ranks)


# --- the LRScheduler contract where frameworks rely on it ----------------------------------------


def _sgd(lr: float = 0.1) -> torch.optim.Optimizer:
    torch.manual_seed(0)
    return torch.optim.SGD(nn.Linear(4, 2).parameters(), lr=lr, momentum=0.9)


def test_explore_lr_wraps_a_chained_scheduler() -> None:
    ref_opt, opt = _sgd(), _sgd()
    ref = tls.ChainedScheduler([tls.StepLR(ref_opt, 3, 0.5), tls.ExponentialLR(ref_opt, 0.9)])
    sched = ExploreLR(tls.ChainedScheduler([tls.StepLR(opt, 3, 0.5), tls.ExponentialLR(opt, 0.9)]))
    for _ in range(8):
        ref_opt.step(), ref.step()
        opt.step(), sched.step()
        assert sched.get_last_lr() == ref.get_last_lr()
    assert sched.last_epoch == 8


# A copy's optimizer pickles without the step wrapper that torch's order check looks for, so its
# first step warns that optimizer.step() "has been overridden", as a copy of torch's scheduler does.
@pytest.mark.filterwarnings("ignore:Seems like `optimizer.step\\(\\)` has been overridden:UserWarning")
@pytest.mark.parametrize("make", [lambda o: OneCycleLR(o, max_lr=0.1, total_steps=20),
                                  lambda o: ExploreLR(tls.StepLR(o, 3, 0.5))], ids=["onecycle", "explore"])
def test_a_copy_or_an_unpickled_scheduler_drives_its_own_optimizer(make) -> None:
    import copy
    import pickle

    opt = _sgd()
    sched = make(opt)
    before = [dict(g) for g in opt.param_groups]
    for twin in (copy.deepcopy(sched), pickle.loads(pickle.dumps(sched))):
        for _ in range(4):
            twin.optimizer.step()
            twin.step()
        assert twin.optimizer is not opt and twin.last_epoch == 4
        assert twin.optimizer.param_groups[0]["lr"] == twin.get_last_lr()[0]
    assert [g["lr"] for g in opt.param_groups] == [g["lr"] for g in before]  # the original never moved
    assert [g["momentum"] for g in opt.param_groups] == [g["momentum"] for g in before]


def test_a_torch_onecycle_checkpoint_switches_to_hpx_mid_run() -> None:
    torch_opt, ref_opt = _sgd(), _sgd()
    torch_sched, ref = (tls.OneCycleLR(o, max_lr=0.1, total_steps=20) for o in (torch_opt, ref_opt))
    for _ in range(7):
        torch_opt.step(), torch_sched.step()
        ref_opt.step(), ref.step()
    opt = _sgd()
    sched = OneCycleLR(opt, max_lr=0.1, total_steps=20)
    sched.load_state_dict(torch_sched.state_dict())  # a running job's checkpoint, taken over
    assert sched.last_epoch == 7 and sched.get_last_lr() == ref.get_last_lr()
    for _ in range(13):
        opt.step(), sched.step()
        ref_opt.step(), ref.step()
        assert sched.get_last_lr() == ref.get_last_lr()
        assert opt.param_groups[0]["momentum"] == ref_opt.param_groups[0]["momentum"]
    other = OneCycleLR(_sgd(), max_lr=0.1, total_steps=30)
    with pytest.raises(ConfigError, match="total_steps=20, this scheduler 30"):
        other.load_state_dict(torch_sched.state_dict())
    with pytest.raises(ConfigError, match="has no hpx state"):
        ExploreLR(tls.StepLR(_sgd(), 3)).load_state_dict(tls.StepLR(_sgd(), 3).state_dict())
