"""Property tests of the zero-order controller (HDET section 3): ``Controller.update``
and ``softmax_weights``."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st

from hpx import ConfigError, Controller, NonFiniteError, slot_offsets, softmax_weights

SETTINGS = settings(max_examples=60, deadline=None)

EPS = 2.0**-52
F64 = torch.float64
spaces = st.sampled_from(["log", "linear"])
temperatures = st.just("auto") | st.floats(1e-3, 1e3) | st.sampled_from([1e-300, 0.002, 0.1])


@st.composite
def knob_case(draw, space: str | None = None, n_min: int = 1, n_max: int = 16, k_max: int = 3):
    """Bases ``[K]``, per-replica values ``[K, N]`` spread around them, and the space.

    Log space gets multiplicative spreads of positive bases; linear space mixes
    multiplicative and additive (possibly negative) ones.
    """
    space = space or draw(spaces)
    n = draw(st.integers(n_min, n_max))
    k = draw(st.integers(1, k_max))
    bases, rows = [], []
    u = slot_offsets(n)
    for _ in range(k):
        perm = torch.tensor(draw(st.permutations(range(n))), dtype=torch.int64)
        if space == "log" or draw(st.booleans()):
            b = draw(st.floats(1e-6, 1e6))
            a = draw(st.floats(0.0, 0.95))
            rows.append(b * (1 + a * u[perm]))
        else:
            b = draw(st.floats(-100.0, 100.0))
            a = draw(st.floats(0.0, 50.0))
            rows.append(b + a * u[perm])
        bases.append(b)
    return space, torch.tensor(bases, dtype=F64), torch.stack(rows)


def z_of(x: torch.Tensor, space: str) -> torch.Tensor:
    return x.log() if space == "log" else x


def mask(space: str, k: int) -> torch.Tensor:
    return torch.full((k,), space == "log", dtype=torch.bool)


def finite_losses(n: int) -> st.SearchStrategy[torch.Tensor]:
    return st.lists(st.floats(-1e3, 1e3), min_size=n, max_size=n).map(lambda xs: torch.tensor(xs, dtype=F64))


# --- equal losses: no signal, no move ------------------------------------------------


@SETTINGS
@given(knob_case(), temperatures, st.floats(-1e6, 1e6), st.floats(0.0, 5.0), st.floats(0.0, 0.99))
def test_equal_losses_give_zero_direction_and_keep_bases(case, temperature, loss, meta_lr, momentum):
    space, bases, values = case
    k, n = values.shape
    ctl = Controller(meta_lr=meta_lr, momentum=momentum, temperature=temperature, space=space)
    b = bases
    z = z_of(values, space)
    zmax = z.abs().amax(dim=1)
    # zero up to the rounding of a mean of N numbers; the base moves by at most that
    # rounding times meta_lr per update, plus (log space) the ulps of exp(log b)
    d_tol = 16 * EPS * zmax
    per_step = meta_lr * d_tol + 4 * EPS * (z_of(bases, space).abs() + 1)
    for i in range(1, 6):
        out = ctl.update(values, torch.full((n,), loss, dtype=F64), b, mask(space, k))
        assert torch.equal(out.weights, torch.full((n,), 1.0 / n, dtype=F64))
        assert bool((out.direction.abs() <= d_tol).all()), out.direction
        assert bool((out.velocity.abs() <= d_tol).all()), out.velocity
        moved = (z_of(out.bases, space) - z_of(bases, space)).abs()
        assert bool((moved <= i * per_step).all()), (out.bases, bases)
        b = out.bases


@SETTINGS
@given(knob_case(), temperatures, st.floats(-1e6, 1e6))
@example(
    case=("log", torch.tensor([0.1], dtype=F64), 0.1 * (1 + 0.5 * slot_offsets(3))[None]),
    temperature="auto",
    loss=0.7,
)
def test_equal_losses_give_exactly_zero_direction_and_same_bases(case, temperature, loss):
    """Regression: D was z @ w - mean(z) (rounding noise) and log space rebuilt b as exp(log b)."""
    space, bases, values = case
    k, n = values.shape
    out = Controller(temperature=temperature, space=space).update(
        values, torch.full((n,), loss, dtype=F64), bases, mask(space, k)
    )
    assert bool((out.direction == 0).all()), out.direction
    assert torch.equal(out.bases, bases), (out.bases, bases)


@settings(max_examples=30, deadline=None)
@given(st.floats(1e-6, 1.0), st.integers(2, 8), st.integers(0, 2**31), spaces)
@example(base=0.1, n=4, seed=0, space="log")
def test_zero_spread_never_moves_the_base(base, n, seed, space):
    """Regression: with alpha = 0 (plain DDP) the controller drifted the base by ulps."""
    gen = torch.Generator().manual_seed(seed)
    ctl = Controller(space=space)
    b = torch.tensor([base], dtype=F64)
    for _ in range(50):
        values = torch.full((1, n), base, dtype=F64)  # what Knob.values gives with spread 0
        b = ctl.update(values, torch.randn(n, generator=gen, dtype=F64), b, mask(space, 1)).bases
        assert b.item() == base


# --- relabelling replicas ------------------------------------------------------------


@SETTINGS
@given(knob_case(n_min=2), temperatures, st.data())
def test_relabelling_replicas_permutes_weights_and_keeps_bases(case, temperature, data):
    space, bases, values = case
    k, n = values.shape
    losses = data.draw(finite_losses(n))
    if data.draw(st.booleans()):
        bad = data.draw(st.lists(st.integers(0, n - 1), max_size=n - 1, unique=True))
        losses[bad] = data.draw(st.sampled_from([math.nan, math.inf, -math.inf]))
    perm = torch.tensor(data.draw(st.permutations(range(n))), dtype=torch.int64)
    v0 = torch.tensor(data.draw(st.lists(st.floats(-0.1, 0.1), min_size=k, max_size=k)), dtype=F64)
    outs = []
    for vals, ls in ((values, losses), (values[:, perm], losses[perm])):
        ctl = Controller(temperature=temperature, space=space)
        ctl.velocity = v0.clone()
        outs.append(ctl.update(vals, ls, bases, mask(space, k)))
    a, b = outs
    assert torch.allclose(b.weights, a.weights[perm], rtol=1e-9, atol=1e-12)
    scale = z_of(values, space).abs().amax(dim=1)
    assert bool(((a.direction - b.direction).abs() <= 1e-12 * (1 + scale)).all())
    assert torch.allclose(a.bases, b.bases, rtol=1e-12, atol=1e-12)


# --- direction: follows the better side ----------------------------------------------


@SETTINGS
@given(
    space=spaces,
    n=st.integers(2, 16),
    data=st.data(),
    fixed=st.booleans(),
    ratio=st.floats(0.01, 100.0),
    c=st.floats(1e-3, 1e3),
    meta_lr=st.floats(0.05, 2.0),
    momentum=st.floats(0.0, 0.95),
    better_high=st.booleans(),
)
def test_base_moves_toward_the_side_with_lower_loss(space, n, data, fixed, ratio, c, meta_lr, momentum,
                                                    better_high):
    perm = torch.tensor(data.draw(st.permutations(range(n))), dtype=torch.int64)
    u = slot_offsets(n)[perm]
    if space == "log" or data.draw(st.booleans()):
        base = data.draw(st.floats(1e-3, 1e3))
        x = base * (1 + data.draw(st.floats(0.05, 0.9)) * u)
    else:
        base = data.draw(st.floats(-10.0, 10.0))
        x = base + data.draw(st.floats(0.05, 5.0)) * u
    sign = 1.0 if better_high else -1.0
    losses = -sign * c * x  # strictly decreasing in x when better_high, else strictly increasing
    temperature = ratio * c * float(x.max() - x.min()) if fixed else "auto"
    ctl = Controller(meta_lr=meta_lr, momentum=momentum, temperature=temperature, space=space)
    out = ctl.update(x[None], losses, torch.tensor([base], dtype=F64), mask(space, 1))
    assert sign * out.direction.item() > 0
    assert sign * (out.bases.item() - base) > 0, (base, out.bases.item())
    # the lowest loss gets the largest weight
    assert out.weights.argmax().item() == losses.argmin().item()


# --- bounded: one sync moves z by at most the explored range --------------------------


@SETTINGS
@given(
    knob_case(),
    st.data(),
    st.floats(0.01, 10.0),
    st.floats(0.1, 0.99),
    temperatures,
)
def test_one_update_is_clipped_to_the_explored_range(case, data, meta_lr, momentum, temperature):
    space, bases, values = case
    k, n = values.shape
    losses = data.draw(finite_losses(n))
    huge = data.draw(st.lists(st.sampled_from([1e300, -1e300]) | st.floats(-1e300, 1e300), min_size=k,
                              max_size=k))
    ctl = Controller(meta_lr=meta_lr, momentum=momentum, temperature=temperature, space=space)
    ctl.velocity = torch.tensor(huge, dtype=F64)
    out = ctl.update(values, losses, bases, mask(space, k))
    assert bool(torch.isfinite(out.bases).all())
    z = z_of(values, space)
    # the documented clip, half the explored range, is within the brief's max_r |z_r - mean z|
    half = (z.amax(dim=1) - z.amin(dim=1)) / 2
    reach = (z - z.mean(dim=1, keepdim=True)).abs().amax(dim=1)
    zb, zn = z_of(bases, space), z_of(out.bases, space)
    tol = 16 * EPS * (zb.abs() + reach + 1)  # b * exp(step) rounds to ulps of b, not of step
    moved = zn - zb
    assert bool((moved.abs() <= half + tol).all()), (moved, half)
    assert bool((moved.abs() <= reach + tol).all()), (moved, reach)
    # a huge carried velocity moves the base all the way to the clip, in its own direction
    big = out.velocity.abs() * meta_lr > 1e3 * (reach + 1)
    assert bool(((moved - torch.sign(out.velocity) * half).abs() <= tol)[big].all()), (moved, half)


# --- softmax -------------------------------------------------------------------------


@SETTINGS
@given(
    st.lists(st.integers(-50, 50), min_size=1, max_size=16),
    st.floats(1e290, 1e300) | st.floats(1e-300, 1e-290) | st.sampled_from([1e300, 1e-300, 1.0]),
    st.just("auto") | st.floats(5e-324, 1e-290) | st.sampled_from([1e-300, 0.002, 1.0, 1e300]),
    st.floats(0.001, 1000.0),
)
def test_softmax_is_finite_and_sums_to_one_at_extreme_gaps(ints, gap, temperature, scale):
    losses = torch.tensor(ints, dtype=F64) * gap
    w, sigma = softmax_weights(losses, temperature, scale)
    assert w.dtype == F64 and w.shape == losses.shape
    assert bool(torch.isfinite(w).all() and (w >= 0).all())
    assert abs(float(w.sum()) - 1.0) <= 1e-12
    assert not math.isnan(sigma)
    # a lower loss never gets less weight
    lower = losses[:, None] < losses[None, :]
    assert bool((w[:, None] >= w[None, :])[lower].all())


@SETTINGS
@given(
    st.lists(st.integers(-1000, 1000), min_size=1, max_size=16),
    st.floats(1e-3, 1e3),
    st.floats(-1e3, 1e3),
    st.floats(0.1, 10.0),
)
def test_auto_weights_are_invariant_to_shift_and_scale(ints, a, shift, temperature_scale):
    losses = torch.tensor(ints, dtype=F64)
    w0, s0 = softmax_weights(losses, "auto", temperature_scale)
    w1, s1 = softmax_weights(a * losses + shift * a, "auto", temperature_scale)
    assert torch.allclose(w0, w1, rtol=0, atol=1e-9), (w0, w1)
    if len(set(ints)) > 1:
        assert math.isclose(s1, a * s0, rel_tol=1e-9, abs_tol=0.0)
    else:
        assert torch.equal(w1, torch.full_like(w1, 1.0 / len(ints)))


@SETTINGS
@given(
    st.lists(st.integers(-1000, 1000), min_size=2, max_size=16).filter(lambda xs: len(set(xs)) > 1),
    st.floats(1e200, 1e300) | st.floats(1e-300, 1e-200),
)
@example(ints=[0, 1], a=1e300)
@example(ints=[0, 1], a=1e-300)
def test_auto_weights_are_invariant_to_extreme_scales(ints, a):
    """Regression: std(L) from squared deviations overflowed/underflowed, giving uniform weights."""
    losses = torch.tensor(ints, dtype=F64)
    w0, _ = softmax_weights(losses)
    w1, _ = softmax_weights(a * losses)
    assert torch.allclose(w0, w1, rtol=0, atol=1e-9), (w0, w1)


@SETTINGS
@given(
    st.lists(st.floats(-10.0, 10.0), min_size=1, max_size=16),
    st.just("auto") | st.floats(0.05, 100.0),
    st.floats(0.1, 10.0),
)
def test_softmax_matches_eq4(losses, temperature, scale):
    """w_r = softmax((Lbar - L_r) / sigma), sigma the given temperature or scale * std_r(L_r)."""
    L = torch.tensor(losses, dtype=F64)
    w, sigma = softmax_weights(L, temperature, scale)
    std = math.sqrt(math.fsum((x - math.fsum(losses) / len(losses)) ** 2 for x in losses) / len(losses))
    if temperature == "auto":
        if len(set(losses)) == 1:  # equal losses: uniform weights
            assert torch.equal(w, torch.full_like(w, 1.0 / len(losses)))
            return
        assume(std > 1e-6)  # the float reference below loses precision on tinier gaps
        assert math.isclose(sigma, scale * std, rel_tol=1e-9)
    else:
        assert sigma == temperature
    ref = torch.softmax((L.mean() - L) / sigma, dim=0)
    assert torch.allclose(w, ref, rtol=1e-9, atol=1e-12), (w, ref)


@SETTINGS
@given(knob_case(space="linear"), st.data(), st.floats(0.0, 0.99), temperatures)
def test_velocity_and_step_follow_eq7(case, data, momentum, temperature):
    """The paper's rule (debias=False): v <- beta v + (1 - beta) D, and (inside the clip)
    z_b <- z_b + lambda v."""
    space, bases, values = case
    k, n = values.shape
    losses = data.draw(finite_losses(n))
    v0 = torch.tensor(data.draw(st.lists(st.floats(-1.0, 1.0), min_size=k, max_size=k)), dtype=F64)
    meta_lr = 1e-6  # small enough to stay inside the clip unless the spread is ~0
    ctl = Controller(meta_lr=meta_lr, momentum=momentum, temperature=temperature, space=space,
                     debias=False)
    ctl.velocity = v0.clone()
    out = ctl.update(values, losses, bases, mask(space, k))
    d = out.direction
    assert torch.allclose(out.velocity, momentum * v0 + (1 - momentum) * d, rtol=1e-12, atol=1e-15)
    assert torch.allclose(ctl.velocity, out.velocity, rtol=0, atol=0)
    # D = sum_r w_r z_r - mean_r z_r
    ref_d = values @ out.weights - values.mean(dim=1)
    assert bool(((d - ref_d).abs() <= 1e-12 * (1 + values.abs().amax(dim=1))).all()), (d, ref_d)
    half = (values.amax(dim=1) - values.amin(dim=1)) / 2
    inside = (meta_lr * out.velocity).abs() < half * 0.5
    moved = out.bases - bases
    expected = meta_lr * out.velocity
    assert bool(((moved - expected).abs() <= 8 * EPS * (bases.abs() + 1))[inside].all()), (moved, expected)


@SETTINGS
@given(knob_case(n_min=2), st.data(), st.floats(0.0, 0.99))
def test_debiased_velocity_takes_full_steps_from_the_start(case, data, momentum):
    """debias=True: after k updates the step is lambda v / (1 - beta^k); a constant D gives
    the step lambda D at every sync, the first included (inside the clip)."""
    space, bases, values = case
    k, n = values.shape
    losses = data.draw(finite_losses(n))
    meta_lr = 1e-6
    ctl = Controller(meta_lr=meta_lr, momentum=momentum, space=space)
    paper = Controller(meta_lr=meta_lr, momentum=momentum, space=space, debias=False)
    half = (values.amax(dim=1) - values.amin(dim=1)) / 2
    for i in range(1, 4):
        out = ctl.update(values, losses, bases, mask(space, k))
        ref = paper.update(values, losses, bases, mask(space, k))
        assert torch.equal(out.velocity, ref.velocity)  # the state is the paper's velocity
        inside = (meta_lr * out.direction).abs() < half * 0.5
        moved = z_of(out.bases, space) - z_of(bases, space)
        assert bool(((moved - meta_lr * out.direction).abs() <= 1e-9 * meta_lr * (out.direction.abs() + 1)
                     + 8 * EPS * (z_of(bases, space).abs() + 1))[inside].all()), (i, moved, out.direction)
    restored = Controller(meta_lr=meta_lr, momentum=momentum, space=space)
    restored.load_state_dict(ctl.state_dict())
    assert restored.updates == ctl.updates == 3


# --- non-finite losses ---------------------------------------------------------------


@SETTINGS
@given(knob_case(n_min=2), temperatures, st.data())
def test_nonfinite_replicas_get_zero_weight_and_are_ignored(case, temperature, data):
    space, bases, values = case
    k, n = values.shape
    losses = data.draw(finite_losses(n))
    bad = data.draw(st.lists(st.integers(0, n - 1), min_size=1, max_size=n - 1, unique=True))
    for i in bad:
        losses[i] = data.draw(st.sampled_from([math.nan, math.inf, -math.inf]))
    values = values.clone()
    values[:, bad] = values[:, bad].abs() * 1e3 + 1.0  # whatever a diverged replica held: ignored
    out = Controller(temperature=temperature, space=space).update(values, losses, bases, mask(space, k))
    assert bool((out.weights[bad] == 0).all())
    assert abs(float(out.weights.sum()) - 1.0) <= 1e-12
    assert bool(torch.isfinite(out.bases).all() and torch.isfinite(out.direction).all())
    # same result as if the failed replicas had never existed
    ok = torch.isfinite(losses)
    ref = Controller(temperature=temperature, space=space).update(values[:, ok], losses[ok], bases,
                                                                  mask(space, k))
    assert torch.allclose(out.weights[ok], ref.weights, rtol=0, atol=1e-12)
    assert torch.allclose(out.bases, ref.bases, rtol=1e-12, atol=1e-12)


@SETTINGS
@given(
    st.lists(st.sampled_from([math.nan, math.inf, -math.inf]), min_size=1, max_size=16),
    temperatures,
    spaces,
)
def test_all_nonfinite_losses_raise(losses, temperature, space):
    losses = torch.tensor(losses, dtype=F64)
    n = losses.numel()
    with pytest.raises(NonFiniteError):
        softmax_weights(losses, temperature)
    ctl = Controller(temperature=temperature, space=space)
    with pytest.raises(NonFiniteError):
        ctl.update(torch.ones(1, n, dtype=F64), losses, torch.ones(1, dtype=F64), mask(space, 1))
    assert ctl.velocity is None, "a failed update must not touch the velocity"


# --- decay ---------------------------------------------------------------------------


@SETTINGS
@given(knob_case(), st.data(), temperatures)
def test_decay_multiplies_the_base_by_one_minus_gamma(case, data, temperature):
    space, bases, values = case
    k, n = values.shape
    bases = bases.abs() + 1e-3  # decay shrinks a positive base
    values = values.abs() + 1e-3
    gamma = torch.tensor(data.draw(st.lists(st.floats(1e-9, 0.99), min_size=k, max_size=k)), dtype=F64)
    ctl = Controller(temperature=temperature, space=space)
    out = ctl.update(values, torch.full((n,), 1.5, dtype=F64), bases, mask(space, k), gamma)
    expected = bases * (1 - gamma)
    scale = bases + (values.abs().amax(dim=1) if space == "linear" else 0)
    assert bool(((out.bases - expected).abs() <= 64 * EPS * scale).all()), (out.bases, expected)
    assert bool((out.bases < bases).all())


@SETTINGS
@given(knob_case(space="log"), st.floats(0.0, 1e-15))
@example(case=("log", torch.tensor([0.1], dtype=F64), 0.1 * (1 + 0.5 * slot_offsets(3))[None]), gamma=1e-17)
def test_tiny_decay_never_increases_the_base(case, gamma):
    """Regression: exp(log b + log1p(-gamma)) could exceed b for gamma below ~1e-16."""
    space, bases, values = case
    k, n = values.shape
    out = Controller(space=space).update(
        values, torch.zeros(n, dtype=F64), bases, mask(space, k), torch.full((k,), gamma, dtype=F64)
    )
    assert bool((out.bases <= bases).all()), (out.bases, bases)


# --- checkpointing -------------------------------------------------------------------


@SETTINGS
@given(knob_case(), temperatures, st.integers(0, 4), st.integers(1, 4), st.integers(0, 2**31))
def test_state_dict_round_trip_gives_identical_updates(case, temperature, before, after, seed):
    space, bases, values = case
    k, n = values.shape
    gen = torch.Generator().manual_seed(seed)
    lmask = mask(space, k)

    def losses():
        return torch.randn(n, generator=gen, dtype=F64)

    c1 = Controller(temperature=temperature, space=space, momentum=0.8)
    b = bases
    for _ in range(before):
        b = c1.update(values, losses(), b, lmask).bases
    state = c1.state_dict()
    inputs = [losses() for _ in range(after)]
    c2 = Controller(temperature=temperature, space=space, momentum=0.8)
    c2.update(values, torch.randn(n, dtype=F64), bases, lmask)  # its own, different history
    c2.load_state_dict(state)
    b1 = b2 = b
    first = None
    for ls in inputs:
        o1, o2 = c1.update(values, ls, b1, lmask), c2.update(values, ls, b2, lmask)
        for f in ("bases", "weights", "direction", "velocity"):
            assert torch.equal(getattr(o1, f), getattr(o2, f)), f
        first = first or o1
        b1, b2 = o1.bases, o2.bases
    # the saved state is a snapshot: the updates made since did not change it
    c3 = Controller(temperature=temperature, space=space, momentum=0.8)
    c3.load_state_dict(state)
    o3 = c3.update(values, inputs[0], b, lmask)
    assert torch.equal(o3.bases, first.bases) and torch.equal(o3.velocity, first.velocity)


# --- construction --------------------------------------------------------------------

BAD = {
    "meta_lr": [-1.0, -1e-9, math.nan, math.inf, "0.5", True, None],
    "momentum": [1.0, -0.1, 1.5, math.nan, math.inf, None, "0.9"],
    "temperature": [0, 0.0, -1.0, math.nan, math.inf, "hot", None, False],
    "temperature_scale": [0.0, -2.0, math.nan, math.inf, "1"],
    "space": ["cubic", "LOG", None, ""],
}


@SETTINGS
@given(st.data())
def test_constructor_lists_every_problem(data):
    chosen = data.draw(st.sets(st.sampled_from(sorted(BAD)), min_size=1))
    kwargs = {name: data.draw(st.sampled_from(BAD[name])) for name in chosen}
    with pytest.raises(ConfigError) as info:
        Controller(**kwargs)
    problems = info.value.problems
    assert len(problems) == len(chosen), problems
    for name in BAD:
        assert any(p.startswith(f"{name} must") for p in problems) == (name in chosen), (name, problems)


@SETTINGS
@given(
    st.floats(0.0, 1e3),
    st.floats(0.0, 1.0, exclude_max=True),
    st.just("auto") | st.floats(5e-324, 1e300),
    st.floats(1e-6, 1e6),
    st.sampled_from(["auto", "log", "linear"]),
)
def test_constructor_accepts_valid_settings(meta_lr, momentum, temperature, temperature_scale, space):
    ctl = Controller(meta_lr=meta_lr, momentum=momentum, temperature=temperature,
                     temperature_scale=temperature_scale, space=space)
    assert ctl.velocity is None and ctl.meta_lr == meta_lr and ctl.momentum == momentum


@SETTINGS
@given(st.lists(st.sampled_from(["mul", "add"]), min_size=1, max_size=6))
def test_log_mask_follows_the_space(kinds):
    auto = Controller(space="auto").log_mask(kinds)
    assert auto.tolist() == [k == "mul" for k in kinds]
    assert Controller(space="linear").log_mask(kinds).tolist() == [False] * len(kinds)
    if "add" in kinds:
        with pytest.raises(ConfigError):
            Controller(space="log").log_mask(kinds)
    else:
        assert Controller(space="log").log_mask(kinds).tolist() == [True] * len(kinds)
