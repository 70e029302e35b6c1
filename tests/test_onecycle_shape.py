"""OneCycleShape must reproduce torch's OneCycleLR number for number, and reject bad settings.

The reference is always a real ``torch.optim.lr_scheduler.OneCycleLR`` driving a real optimizer;
we compare against what it writes into ``param_groups``, since that is what a drop-in replaces.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hpx._onecycle import OneCycleShape, ScheduleStepError
from hpx.errors import ConfigError

# OneCycleShape repeats torch's float operations in torch's order, so in practice its values
# are bit-identical. The comparison still allows a relative 1e-12 (some thousands of ulps) so
# that a harmless re-association inside a future torch does not fail the suite, while any real
# discrepancy (a phase boundary off by one step, a wrong anchor, the other anneal formula)
# moves values by many orders of magnitude more. abs_tol stays 0: tiny lrs are compared too.
REL_TOL = 1e-12


def same(ours: float, theirs: float) -> bool:
    return math.isclose(ours, theirs, rel_tol=REL_TOL, abs_tol=0.0)


# --------------------------------------------------------------------------------------------
# The torch reference


def make_optimizer(kind: str, n_groups: int) -> torch.optim.Optimizer:
    groups = [{"params": [torch.nn.Parameter(torch.zeros(1))]} for _ in range(n_groups)]
    if kind == "sgd":
        return torch.optim.SGD(groups, lr=0.1, momentum=0.9)
    if kind == "adam":
        return torch.optim.Adam(groups, lr=0.1)
    raise AssertionError(kind)


def written_momentum(group: dict[str, Any]) -> float:
    """The value OneCycleLR cycles: beta1 for Adam-style optimizers, else ``momentum``."""
    return group["betas"][0] if "betas" in group else group["momentum"]


def torch_trace(kind: str, n_groups: int, **kwargs: Any) -> tuple[list, list, BaseException]:
    """Run OneCycleLR until it refuses a step.

    Returns the lrs and momenta it wrote at steps 0, 1, ... (one list per step) and the
    exception that ended the run.
    """
    opt = make_optimizer(kind, n_groups)
    lrs: list[list[float]] = []
    moms: list[list[float]] = []
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a warning would mean the trace is not the normal one
        try:
            sched = torch.optim.lr_scheduler.OneCycleLR(opt, **kwargs)
            while True:
                lrs.append([g["lr"] for g in opt.param_groups])
                moms.append([written_momentum(g) for g in opt.param_groups])
                opt.step()  # no gradients, so no update; keeps torch's order-of-calls check quiet
                sched.step()
        except (ValueError, ZeroDivisionError) as exc:
            return lrs, moms, exc


# --------------------------------------------------------------------------------------------
# Property test: random configurations against torch

unit = st.floats(0.0, 1.0, exclude_max=True)


@st.composite
def configurations(draw: st.DrawFn) -> tuple[str, int, dict[str, Any]]:
    n_groups = draw(st.integers(1, 3))
    max_lrs = [10 ** draw(st.floats(-6, 1)) for _ in range(n_groups)]
    total_steps = draw(st.integers(2, 300))
    # Mostly interior values, plus the legal edges, where torch's phase arithmetic is odd.
    pct_start = draw(
        st.floats(0.0, 1.0, exclude_min=True, exclude_max=True) | st.just(0.0) | st.just(1.0)
    )

    def momentum() -> float | list[float]:
        if draw(st.booleans()):
            return draw(unit)
        return [draw(unit) for _ in range(n_groups)]

    kwargs = {
        "max_lr": max_lrs if n_groups > 1 or draw(st.booleans()) else max_lrs[0],
        "total_steps": total_steps,
        "pct_start": pct_start,
        "anneal_strategy": draw(st.sampled_from(["cos", "linear"])),
        "cycle_momentum": draw(st.booleans()),
        "base_momentum": momentum(),
        "max_momentum": momentum(),
        "div_factor": 10 ** draw(st.floats(-2, 6)),
        "final_div_factor": 10 ** draw(st.floats(-2, 8)),
        "three_phase": draw(st.booleans()),
    }
    return draw(st.sampled_from(["sgd", "adam"])), n_groups, kwargs


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(configurations())
def test_every_step_matches_torch(config: tuple[str, int, dict[str, Any]]) -> None:
    kind, n_groups, kwargs = config
    torch_lrs, torch_moms, torch_exc = torch_trace(kind, n_groups, **kwargs)
    total = kwargs["total_steps"]

    if not torch_lrs:
        # torch died while constructing: only possible through pct_start * total_steps == 1.
        assert isinstance(torch_exc, ZeroDivisionError)
        with pytest.raises(ConfigError, match="pct_start \\* total_steps"):
            OneCycleShape.from_args(n_groups, **kwargs)
        return

    shape = OneCycleShape.from_args(n_groups, **kwargs)
    # torch evaluates steps 0..total_steps (one more than total_steps values) unless the last
    # one hits a zero-length phase; either way the next step is refused.
    assert len(torch_lrs) in (total, total + 1)
    for step, (lrs, moms) in enumerate(zip(torch_lrs, torch_moms, strict=True)):
        assert all(map(same, shape.lrs(step), lrs)), (step, shape.lrs(step), lrs)
        for g in range(n_groups):
            assert same(shape.lr(g, step), lrs[g])
            ours = shape.momentum(g, step)
            if kwargs["cycle_momentum"]:
                assert ours is not None and same(ours, moms[g]), (step, g, ours, moms[g])
            else:
                assert ours is None
                assert moms[g] == 0.9  # torch left the optimizer's own momentum/beta1 alone

    past = len(torch_lrs)
    if past == total:
        assert isinstance(torch_exc, ZeroDivisionError)
        with pytest.raises(ScheduleStepError, match="zero length"):
            shape.lr(0, past)
    else:
        assert isinstance(torch_exc, ValueError) and "Tried to step" in str(torch_exc)
        with pytest.raises(ScheduleStepError, match="Tried to step"):
            shape.lr(0, past)


# --------------------------------------------------------------------------------------------
# Targeted checks of torch behaviour a drop-in must keep


def test_group_anchors_match_what_torch_stores() -> None:
    opt = make_optimizer("sgd", 2)
    kwargs = {
        "max_lr": [0.3, 0.07],
        "total_steps": 50,
        "base_momentum": [0.8, 0.7],
        "div_factor": 7.0,
    }
    torch.optim.lr_scheduler.OneCycleLR(opt, **kwargs)
    shape = OneCycleShape.from_args(2, **kwargs)
    for g, group in enumerate(opt.param_groups):
        assert shape.initial_lr(g) == group["initial_lr"]
        assert shape.min_lr(g) == group["min_lr"]
        assert shape.max_lrs[g] == group["max_lr"]
        assert shape.momentum_bounds(g) == (group["base_momentum"], group["max_momentum"])


def test_step_total_steps_extrapolates_like_torch() -> None:
    # With total_steps=3 and pct_start=0.3 the warm-up ends at step -0.1: step 0 is already in
    # the decay, and step 3 lies past its end, so linear annealing gives a negative lr there.
    kwargs = {"max_lr": 1.0, "total_steps": 3, "anneal_strategy": "linear"}
    torch_lrs, _, exc = torch_trace("sgd", 1, **kwargs)
    shape = OneCycleShape.from_args(1, **kwargs)
    assert len(torch_lrs) == 4 and "Tried to step 4 times" in str(exc)
    assert shape.lr(0, 0) != shape.initial_lr(0)
    assert shape.lr(0, 3) < 0 and same(shape.lr(0, 3), torch_lrs[3][0])
    assert shape.momentum(0, 3) > 0.95


def test_stepping_past_total_steps_is_refused() -> None:
    shape = OneCycleShape.from_args(2, 0.1, total_steps=10)
    shape.lr(1, 10)  # the extra step torch allows
    with pytest.raises(ScheduleStepError) as info:
        shape.lr(1, 11)
    assert isinstance(info.value, ValueError)  # what torch raises, so existing handlers work
    assert "Tried to step 11 times" in str(info.value) and "total steps is 10" in str(info.value)
    for bad_step in (12, 1000):
        with pytest.raises(ScheduleStepError):
            shape.momentum(0, bad_step)
        with pytest.raises(ScheduleStepError):
            shape.lrs(bad_step)


@pytest.mark.parametrize("step", [-1, 1.0, True, "3"])
def test_step_must_be_a_non_negative_int(step: Any) -> None:
    shape = OneCycleShape.from_args(1, 0.1, total_steps=10)
    with pytest.raises(ScheduleStepError, match="step must be an integer"):
        shape.lr(0, step)


@pytest.mark.parametrize("group", [-1, 2, 0.0])
def test_group_must_exist(group: Any) -> None:
    shape = OneCycleShape.from_args(2, 0.1, total_steps=10)
    with pytest.raises(IndexError, match="group must be an integer in \\[0, 2\\)"):
        shape.lr(group, 0)


def test_zero_length_last_phase_fails_only_at_the_extra_step() -> None:
    # pct_start=1.0: warm-up fills the whole cycle and the decay phase has zero length, which
    # torch only notices (ZeroDivisionError) when asked for step total_steps.
    _, _, exc = torch_trace("sgd", 1, max_lr=0.1, total_steps=10, pct_start=1.0)
    assert isinstance(exc, ZeroDivisionError)
    shape = OneCycleShape.from_args(1, 0.1, total_steps=10, pct_start=1.0)
    assert same(shape.lr(0, 9), 0.1)
    with pytest.raises(ScheduleStepError, match="zero length"):
        shape.lr(0, 10)


@pytest.mark.parametrize(("epochs", "steps_per_epoch"), [(1, 1), (3, 7), (10, 25)])
def test_epochs_and_steps_per_epoch_give_their_product(epochs: int, steps_per_epoch: int) -> None:
    by_epochs = OneCycleShape.from_args(
        2, [0.1, 0.2], epochs=epochs, steps_per_epoch=steps_per_epoch, three_phase=True
    )
    by_total = OneCycleShape.from_args(
        2, [0.1, 0.2], total_steps=epochs * steps_per_epoch, three_phase=True
    )
    assert by_epochs == by_total
    assert by_epochs.total_steps == epochs * steps_per_epoch


def test_total_steps_takes_precedence_over_epochs() -> None:
    # As in torch, epochs/steps_per_epoch are ignored (not even checked) next to total_steps.
    shape = OneCycleShape.from_args(1, 0.1, total_steps=20, epochs=-3, steps_per_epoch="x")
    assert shape.total_steps == 20


def test_ignored_momentum_bounds_without_cycle_momentum() -> None:
    shape = OneCycleShape.from_args(
        2, 0.1, total_steps=10, cycle_momentum=False, base_momentum=[0.1, 0.2, 0.3]
    )
    assert shape.momentums(0) == [None, None]
    assert shape.momentum_bounds(1) is None
    assert shape == OneCycleShape.from_args(2, 0.1, total_steps=10, cycle_momentum=False)


def test_shape_is_a_frozen_hashable_value() -> None:
    a = OneCycleShape.from_args(2, [0.1, 0.2], total_steps=10, max_momentum=[0.9, 0.95])
    b = OneCycleShape(max_lrs=(0.1, 0.2), total_steps=10, max_momentum=(0.9, 0.95))
    assert a == b and hash(a) == hash(b)
    assert a.n_groups == 2 and a.phase_ends == (2.0, 9.0)
    with pytest.raises(AttributeError):
        a.total_steps = 11  # type: ignore[misc]


# --------------------------------------------------------------------------------------------
# Validation: every problem reported, each naming argument and value

BASE = {"n_groups": 2, "max_lr": 0.1, "total_steps": 100}

INVALID = [
    # (overrides of BASE, text the single problem must contain)
    ({"total_steps": 0}, "total_steps must be a positive integer (got 0)"),
    ({"total_steps": -5}, "total_steps must be a positive integer (got -5)"),
    ({"total_steps": 2.5}, "total_steps must be a positive integer (got 2.5)"),
    ({"total_steps": True}, "total_steps must be a positive integer (got True)"),
    ({"total_steps": "10"}, "total_steps must be a positive integer (got '10')"),
    ({"total_steps": None}, "give total_steps, or both epochs and steps_per_epoch (got neither)"),
    ({"total_steps": None, "epochs": 5}, "(got epochs=5 but no steps_per_epoch)"),
    ({"total_steps": None, "steps_per_epoch": 8}, "(got steps_per_epoch=8 but no epochs)"),
    (
        {"total_steps": None, "epochs": 0, "steps_per_epoch": 8},
        "epochs must be a positive integer (got 0)",
    ),
    (
        {"total_steps": None, "epochs": 2, "steps_per_epoch": -1},
        "steps_per_epoch must be a positive integer (got -1)",
    ),
    ({"pct_start": -0.1}, "pct_start must be in [0, 1] (got -0.1)"),
    ({"pct_start": 1.5}, "pct_start must be in [0, 1] (got 1.5)"),
    ({"pct_start": float("nan")}, "pct_start must be in [0, 1] (got nan)"),
    ({"pct_start": 0.01}, "pct_start * total_steps must not be exactly 1 (got pct_start=0.01"),
    ({"anneal_strategy": "foo"}, "anneal_strategy must be 'cos' or 'linear' (got 'foo')"),
    ({"max_lr": [0.1, 0.2, 0.3]}, "max_lr must be one number or a list of 2"),
    ({"max_lr": -1.0}, "max_lr must be a finite number >= 0 (got -1.0)"),
    ({"max_lr": [0.1, float("inf")]}, "max_lr[1] must be a finite number >= 0 (got inf)"),
    ({"max_lr": "0.1"}, "max_lr must be a finite number >= 0 (got '0.1')"),
    ({"div_factor": 0}, "div_factor must be a finite number > 0 (got 0)"),
    ({"div_factor": -25.0}, "div_factor must be a finite number > 0 (got -25.0)"),
    ({"final_div_factor": 0.0}, "final_div_factor must be a finite number > 0 (got 0.0)"),
    ({"base_momentum": float("inf")}, "base_momentum must be a finite number (got inf)"),
    ({"max_momentum": [0.9]}, "max_momentum must be one number or a list of 2"),
    ({"cycle_momentum": "yes"}, "cycle_momentum must be True or False (got 'yes')"),
    ({"three_phase": 1}, "three_phase must be True or False (got 1)"),
    ({"n_groups": 0}, "n_groups must be a positive integer (got 0)"),
]


@pytest.mark.parametrize(("overrides", "message"), INVALID)
def test_each_invalid_argument_is_named(overrides: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        OneCycleShape.from_args(**{**BASE, **overrides})
    assert len(info.value.problems) == 1, info.value.problems
    assert message in info.value.problems[0]
    assert isinstance(info.value, ValueError)  # torch raises ValueError for these


@pytest.mark.parametrize(
    "overrides",
    [
        {"total_steps": 0},
        {"total_steps": 2.5},
        {"total_steps": None},
        {"total_steps": None, "epochs": 0, "steps_per_epoch": 8},
        {"pct_start": 1.5},
        {"anneal_strategy": "foo"},
        {"max_lr": [0.1, 0.2, 0.3]},
        {"max_momentum": [0.9]},
    ],
)
def test_torch_rejects_these_too(overrides: dict[str, Any]) -> None:
    """The checks hpx shares with torch: the drop-in refuses nothing torch would accept here."""
    kwargs = {**BASE, **overrides}
    n_groups = kwargs.pop("n_groups")
    with pytest.raises(ValueError):
        torch.optim.lr_scheduler.OneCycleLR(make_optimizer("sgd", n_groups), **kwargs)


def test_all_problems_are_reported_at_once() -> None:
    with pytest.raises(ConfigError) as info:
        OneCycleShape.from_args(
            n_groups=2,
            max_lr=[0.1, 0.2, 0.3],
            total_steps=-4,
            pct_start=1.5,
            anneal_strategy="foo",
            div_factor=0,
            base_momentum="high",
        )
    problems = info.value.problems
    assert len(problems) == 6, problems
    for name, value in [
        ("max_lr", "3 values"),
        ("total_steps", "-4"),
        ("pct_start", "1.5"),
        ("anneal_strategy", "'foo'"),
        ("div_factor", "0"),
        ("base_momentum", "'high'"),
    ]:
        assert any(p.startswith(name) and f"got {value}" in p for p in problems), (name, problems)
    assert str(info.value).startswith("6 problems: ")


def test_direct_construction_is_validated_too() -> None:
    with pytest.raises(ConfigError) as info:
        OneCycleShape(max_lrs=(), total_steps=0, anneal_strategy="step")  # type: ignore[arg-type]
    assert len(info.value.problems) == 3
    with pytest.raises(ConfigError, match="max_momentum must be one number or a list of 2"):
        OneCycleShape(max_lrs=(0.1, 0.2), total_steps=10, max_momentum=(0.9, 0.9, 0.9))
