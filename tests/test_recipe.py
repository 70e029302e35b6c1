"""The recommended setup (hpx.autolr), its learning-rate knob, and geometric spreads."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import hpx
from hpx.search import Stretch
from tests._digits import ce, data, mlp


def two_groups(m: nn.Module, lr: float = 0.1) -> torch.optim.Optimizer:
    return torch.optim.SGD([{"params": m[0].parameters(), "lr": lr},
                            {"params": m[2].parameters(), "lr": lr / 10}], lr=lr)


# --- geometric spreads ---------------------------------------------------------------------


def test_span_spreads_values_evenly_in_log_space_around_the_base():
    k = hpx.LearningRate(base=0.1, span=4.0)
    v = k.values(torch.arange(4))
    assert v.tolist() == pytest.approx([0.1 * 4 ** u for u in (-1, -1 / 3, 1 / 3, 1)])
    assert float(v.log().mean().exp()) == pytest.approx(0.1)  # the base is the geometric mean
    assert k.span == pytest.approx(4.0) and k.spacing == "log" and "span=4" in repr(k)


def test_span_of_one_is_no_spread_and_odd_replica_counts_keep_the_base():
    assert hpx.LearningRate(base=0.1, span=1.0).values(torch.arange(3)).tolist() == [0.1] * 3
    assert hpx.LearningRate(base=0.1, span=3.0).values(torch.arange(3))[1].item() == pytest.approx(0.1)


def test_span_problems_are_reported_together():
    with pytest.raises(hpx.ConfigError) as e:
        hpx.Knob("k", base=1.0, spread=0.2, span=0.5)
    assert "span of knob 'k' must be a number >= 1" in str(e.value)
    assert "not both" in str(e.value)
    with pytest.raises(hpx.ConfigError, match="additive"):
        hpx.Knob("d", base=0.1, kind="add", span=2.0)


def test_set_spread_checks_and_is_kept_in_the_knob_state():
    k = hpx.LearningRate(base=0.1, spread=0.2)
    with pytest.raises(hpx.ConfigError, match="spacing='log'"):
        k.set_spread(1.5, "linear")
    with pytest.raises(hpx.ConfigError, match="no geometric"):
        hpx.Dropout(base=0.1).set_spread(0.1, "log")
    k.set_spread(math.log(3), "log")
    other = hpx.LearningRate(base=0.1, spread=0.2)
    other.load_state_dict(k.state_dict())
    assert other.spacing == "log" and other.span == pytest.approx(3.0)
    fixed = hpx.LearningRate(base=0.1, explore=False)
    fixed.set_spread(0.5, "log")
    assert fixed.spread == 0.0  # a knob that does not explore keeps no spread


# --- LearningRateScale ------------------------------------------------------------------------


def test_learning_rate_scale_keeps_the_groups_ratios():
    model = mlp()
    opt = two_groups(model, 0.2)
    rep = hpx.Replica(0, model, opt)
    knob = hpx.LearningRateScale("lr", schedule=lambda t: 0.5)
    setter = knob.bind(rep)
    setter(3.0 * knob.scale(7))
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([0.3, 0.03])


def test_learning_rate_scale_needs_a_positive_lr():
    model = mlp()
    rep = hpx.Replica(0, model, torch.optim.SGD(model.parameters(), lr=0.0))
    with pytest.raises(hpx.ConfigError, match="every group's lr is 0"):
        hpx.LearningRateScale().bind(rep)


# --- autolr ---------------------------------------------------------------------------------------


def test_autolr_builds_the_recommended_engine(digits):
    engine = hpx.autolr(mlp(), lambda m: two_groups(m, 0.1), total_steps=200, probe=data(digits, 1))
    # one model: between syncs replicas would be identical; the search's 4 points are scored in turn
    assert isinstance(engine.search, Stretch) and engine.n_replicas == 1
    assert engine.state_dict()["placement"].numel() == 4
    assert engine.search.span == pytest.approx(1.5) and engine.search.end == 80
    assert isinstance(engine.signal, hpx.ProbeStream)
    assert engine.knobs.names == ["lr"] and engine.knobs["lr"].spread == 0.0
    # every replica trains at the optimizer's own learning rates (the search places them at syncs)
    for rep in engine.replicas:
        assert [g["lr"] for g in rep.optimizer.param_groups] == pytest.approx([0.1, 0.01])
    no_probe = hpx.autolr(mlp(), lambda m: two_groups(m), total_steps=50)
    assert isinstance(no_probe.signal, hpx.SharedBatch)


def test_autolr_follows_a_torch_scheduler_relative_to_its_peak():
    template = two_groups(mlp(), 0.1)
    sched = torch.optim.lr_scheduler.OneCycleLR(template, max_lr=[0.1, 0.01], total_steps=100)
    engine = hpx.autolr(mlp(), lambda m: two_groups(m, 0.1), total_steps=100, schedule=sched,
                        replicas=1)
    knob = engine.knobs["lr"]
    peak = max(knob.scale(t) for t in range(101))
    assert peak == pytest.approx(1.0)
    assert knob.scale(0) == pytest.approx(1 / 25)  # OneCycle starts at max_lr / div_factor
    assert template.param_groups[0]["lr"] == pytest.approx(0.1 / 25)  # the user's scheduler untouched
    # the scheduler's peaks are what is scaled, whatever lr its optimizer holds now
    group_lrs = [g["lr"] for g in engine.replicas[0].optimizer.param_groups]
    assert group_lrs == pytest.approx([0.1 / 25, 0.01 / 25])


def test_autolr_on_the_optimizer_its_scheduler_already_drives():
    """One replica per process: the scheduler was built on the very optimizer given, which OneCycle
    has already set to max_lr / 25; the peaks still come from the scheduler."""
    model = mlp()
    opt = two_groups(model, 0.1)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=[0.2, 0.02], total_steps=50)
    engine = hpx.autolr(model, opt, total_steps=50, schedule=sched, replicas=1)
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([0.2 / 25, 0.02 / 25])
    knob = engine.knobs["lr"]
    peak = max(range(51), key=knob.scale)
    knob.bind(engine.replicas[0])(knob.scale(peak))
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([0.2, 0.02])


def test_autolr_refuses_groups_with_different_shapes():
    template = two_groups(mlp(), 0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(template, [lambda t: 1.0, lambda t: 1.0 / (1 + t)])
    with pytest.raises(hpx.ConfigError, match="another shape"):
        hpx.autolr(mlp(), lambda m: two_groups(m), total_steps=10, schedule=sched)


def test_autolr_refuses_an_optimizer_that_needs_a_closure_before_anything_trains():
    model = mlp()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(hpx.ConfigError, match="LBFGS needs a closure at every step"):
        hpx.autolr(model, torch.optim.LBFGS(model.parameters()), total_steps=10)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_autolr_lists_every_bad_setting():
    with pytest.raises(hpx.ConfigError) as e:
        hpx.autolr(mlp(), lambda m: two_groups(m), total_steps=0, meta_lr=0.1, schedule=3,
                   probe=5, knobs=[hpx.Dropout("lr")])
    msg = str(e.value)
    for part in ("total_steps", "meta_lr", "schedule", "probe", "'lr'"):
        assert part in msg


def test_autolr_raises_a_too_low_lr_on_digits(digits):
    """From 30x below a good SGD lr the search moves the base up during its window."""
    engine = hpx.autolr(mlp(), lambda m: torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9),
                        total_steps=300, probe=data(digits, 1, seed=9, size=256))
    for b in data(digits, 60, seed=1, size=64):
        engine.step(ce, b)
    assert engine.bases["lr"] >= 2.0


def test_autolr_without_a_probe_scores_the_placed_replicas_on_the_sync_batch(digits):
    """With no probe the replicas are scored where the sync places them (a batch scored
    before the placement would see identical replicas and never move the lr)."""
    engine = hpx.autolr(mlp(), lambda m: torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9),
                        total_steps=300)
    assert isinstance(engine.signal, hpx.SharedBatch)
    for b in data(digits, 60, seed=1, size=64):
        engine.step(ce, b)
    scored = [r.scores for r in engine.history if r.phase in ("stretch", "burn-in")]
    assert scored and all(len(set(s)) > 1 for s in scored)  # the placed points differ
    assert engine.bases["lr"] > 1.0


# --- the schedule kept whole: momentum and beta1 cycles ---------------------------------------


def _momentum(group: dict) -> float:
    return group["betas"][0] if "betas" in group else group["momentum"]


def _torch_momenta(make_opt, make_sched, steps: int) -> list[list[float]]:
    """What torch's own scheduler writes into each group's momentum (or beta1) before each step."""
    opt = make_opt(mlp())
    sched = make_sched(opt)
    out = []
    for _ in range(steps):
        out.append([_momentum(g) for g in opt.param_groups])
        opt.step()
        sched.step()
    return out


_CYCLING = {
    "onecycle-sgd": (lambda m: torch.optim.SGD([{"params": m[0].parameters(), "lr": 0.1},
                                                {"params": m[2].parameters(), "lr": 0.01}], momentum=0.9),
                     lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=[0.1, 0.01], total_steps=40)),
    "onecycle-adamw": (lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3),
                       lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=1e-3, total_steps=40,
                                                                     base_momentum=0.8, max_momentum=0.97)),
    "cycliclr-sgd": (lambda m: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9),
                     lambda o: torch.optim.lr_scheduler.CyclicLR(o, base_lr=0.005, max_lr=0.05,
                                                                 step_size_up=7)),
}


@pytest.mark.parametrize("replicas", [1, 2])
@pytest.mark.parametrize("case", sorted(_CYCLING))
def test_autolr_follows_the_schedulers_momentum_cycle_step_by_step(digits, case, replicas):
    """OneCycleLR and CyclicLR also cycle SGD's momentum or Adam's beta1: under autolr the
    optimizers train with exactly the values torch's scheduler gives at every step (the lr is
    the search's to scale; the momentum is not explored)."""
    make_opt, make_sched = _CYCLING[case]
    steps = 40
    want = _torch_momenta(make_opt, make_sched, steps)
    assert len({tuple(w) for w in want}) > 5  # the cycle moves
    model = mlp()
    opt = make_opt(model) if replicas == 1 else make_opt
    sched = make_sched(make_opt(mlp()))
    engine = hpx.autolr(model, opt, total_steps=steps, schedule=sched, replicas=replicas,
                        probe=data(digits, 1, seed=9))
    seen, shared = [], []
    for b in data(digits, steps, size=16):
        seen.append([_momentum(g) for g in engine.replicas[-1].optimizer.param_groups])
        engine.step(ce, b)
        if engine._state is not None:  # one optimizer state for the replicas: it steps with them too
            shared.append([_momentum(g) for g in engine._state.optimizer.param_groups])
    assert seen == want  # exactly: the scheduler's own floats
    if replicas > 1:
        assert engine.unshared_reason is None and shared == want
    assert engine.history and engine.bases["lr"] != 1.0  # the search still ran on the lr


def test_autolr_without_a_momentum_cycle_leaves_the_optimizers_momentum_alone(digits):
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=20, cycle_momentum=False)
    engine = hpx.autolr(model, opt, total_steps=20, schedule=sched)
    assert [k.name for k in engine.knobs] == ["lr"]
    for b in data(digits, 20, size=16):
        engine.step(ce, b)
        assert opt.param_groups[0]["momentum"] == 0.9


# --- a scheduler stepped beside the engine -------------------------------------------------


def test_a_scheduler_given_as_schedule_and_also_stepped_is_an_error_at_the_first_sync(digits):
    """Stepping it would overwrite the explored lr at every step and silently turn the search off."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda t: 1.0 / (1 + 0.01 * t))
    engine = hpx.autolr(model, opt, total_steps=200, schedule=sched, probe=data(digits, 1, seed=9))
    with pytest.raises(hpx.ConfigError, match=r"scheduler\.step\(\)") as e:
        for b in data(digits, 200, size=16):
            engine.step(ce, b)
            sched.step()
    assert "parameter group 0's lr" in str(e.value)
    assert engine.step_count < engine.next_sync  # caught before the first sync acted


def test_an_lr_set_by_hand_on_a_knobs_group_is_an_error_and_the_engine_untouched_till_then(digits):
    engine = hpx.Engine(mlp(), lambda m: torch.optim.SGD(m.parameters(), lr=0.1),
                        [hpx.LearningRate("lr", base=0.1, spread=0.2)], replicas=2, sync_every=5, seed=0)
    batches = data(digits, 10, size=16)
    for b in batches[:3]:
        engine.step(ce, b)
    engine.replicas[1].optimizer.param_groups[0]["lr"] = 0.5
    engine.step(ce, batches[3])  # not yet the interval's last step: not read
    with pytest.raises(hpx.ConfigError, match="knob 'lr' wrote"):
        engine.step(ce, batches[4])
    assert engine.step_count == 4 and not engine.history


def test_the_drift_check_is_quiet_when_only_the_engine_writes(digits):
    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-3, total_steps=60)
    engine = hpx.autolr(model, opt, total_steps=60, schedule=sched, probe=data(digits, 1, seed=9))
    for b in data(digits, 60, size=16):
        engine.step(ce, b)
    assert len(engine.history) > 10
