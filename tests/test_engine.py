"""The in-process engine: fan-out, converge, controller, faults, checkpoints."""

from __future__ import annotations

import copy
import io
import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hpx


def mlp(seed: int = 0, dropout: float = 0.0, bn: bool = False) -> nn.Module:
    g = torch.Generator().manual_seed(seed)
    layers: list[nn.Module] = [nn.Linear(64, 32)]
    if bn:
        layers.append(nn.BatchNorm1d(32))
    layers += [nn.ReLU(), nn.Dropout(dropout), nn.Linear(32, 10)]
    model = nn.Sequential(*layers)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return model


def ce(rep: hpx.Replica, batch) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(rep.model(x), y)


def batches(digits, n: int, size: int = 64, seed: int = 0):
    x, y = digits
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        idx = torch.randint(0, 1400, (size,), generator=g)
        yield x[idx], y[idx]


def sgd(lr=0.1, **kw):
    return lambda m: torch.optim.SGD(m.parameters(), lr=lr, **kw)


def params(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


# --- the headline checks -------------------------------------------------------


@pytest.mark.parametrize("n", [1, 2, 4, 8])
def test_zero_spread_shared_equals_large_batch(digits, n):
    """alpha = 0 and shared gradients is plain large-batch training, bit for bit up to float rounding."""
    opt = lambda m: torch.optim.SGD(m.parameters(), lr=0.2, momentum=0.9, weight_decay=1e-3)  # noqa: E731
    engine = hpx.Engine(mlp(), opt, [hpx.LearningRate(spread=0.0)], replicas=n, sync_every=5)
    plain = mlp()
    plain_opt = opt(plain)
    for b in batches(digits, 23):
        engine.step(ce, b)
        plain_opt.zero_grad()
        F.cross_entropy(plain(b[0]), b[1]).backward()
        plain_opt.step()
    for rep in engine.replicas:
        torch.testing.assert_close(params(rep.model), params(plain), rtol=1e-5, atol=1e-6)
    assert engine.bases["lr"] == pytest.approx(0.2)


def test_spread_changes_the_result(digits):
    """The equivalence above is not vacuous: a spread makes replicas diverge between syncs."""
    engine = hpx.Engine(mlp(), sgd(0.2), [hpx.LearningRate(spread=0.5)], replicas=4, sync_every=5,
                        controller=False)
    for b in batches(digits, 3):
        engine.step(ce, b)
    p = [params(r.model) for r in engine.replicas]
    assert all((p[0] - q).abs().max() > 1e-6 for q in p[1:])


def _final_lr_ratio(digits, lr: float, seed: int) -> float:
    torch.manual_seed(seed)
    engine = hpx.Engine(mlp(seed), sgd(lr), [hpx.LearningRate(spread=0.5)], replicas=4,
                        sync_every=10, seed=seed, signal=hpx.SharedBatch())
    for b in batches(digits, 200, seed=seed):
        engine.step(ce, b)
    return engine.bases["lr"] / lr


@pytest.mark.parametrize("seed", [0, 1])
def test_controller_raises_a_too_low_lr(digits, seed):
    """On digits, SGD at lr 0.003 is far too low: the base must rise (here by > 3x in 20 syncs)."""
    assert _final_lr_ratio(digits, 0.003, seed) > 3.0


@pytest.mark.parametrize("seed", [0, 1])
def test_controller_lowers_a_too_high_lr(digits, seed):
    """SGD at lr 10 on the same task is far too high (its loss spikes): the base must fall."""
    assert _final_lr_ratio(digits, 10.0, seed) < 0.6


def test_a_custom_controller_replaces_hpxs(digits):
    class Upward(hpx.Controller):
        """Always doubles every base: easy to recognise."""

        def update(self, values, losses, bases, log_space, decay=None):
            out = super().update(values, losses, bases, log_space, decay)
            return hpx.ControllerStep(bases * 2, out.weights, out.direction, out.velocity, out.sigma)

    engine = hpx.Engine(mlp(), sgd(0.01), [hpx.LearningRate(spread=0.5)], replicas=2, sync_every=2,
                        controller=Upward())
    for b in batches(digits, 6):
        engine.step(ce, b)
    assert [r.bases["lr"] for r in engine.history] == pytest.approx([0.02, 0.04, 0.08])
    with pytest.raises(hpx.ConfigError, match="controller must be"):
        hpx.Engine(mlp(), sgd(), [], controller="fast")


def test_controller_off_keeps_bases(digits):
    engine = hpx.Engine(mlp(), sgd(0.003), [hpx.LearningRate(spread=0.5)], replicas=4, sync_every=10,
                        controller=False, signal=hpx.SharedBatch())
    for b in batches(digits, 50):
        engine.step(ce, b)
    assert engine.bases["lr"] == 0.003
    assert len(engine.history) == 5 and all(r.weights is None for r in engine.history)


def test_warmup_delays_the_controller(digits):
    engine = hpx.Engine(mlp(), sgd(0.003), [hpx.LearningRate(spread=0.5)], replicas=4, sync_every=10,
                        warmup=30, signal=hpx.SharedBatch())
    for b in batches(digits, 50):
        engine.step(ce, b)
    moved = [r.step for r in engine.history if r.bases["lr"] != 0.003]
    assert [r.weights is None for r in engine.history] == [True, True, False, False, False]
    assert moved and min(moved) >= 30


# --- fan-out ---------------------------------------------------------------------------


def test_values_written_from_step_zero():
    engine = hpx.Engine(mlp(dropout=0.2), sgd(0.1),
                        [hpx.LearningRate(spread=0.5), hpx.Dropout(spread=0.1)], replicas=4)
    lrs = sorted(r.optimizer.param_groups[0]["lr"] for r in engine.replicas)
    assert lrs == pytest.approx([0.05, 0.1 * (1 - 0.5 / 3), 0.1 * (1 + 0.5 / 3), 0.15])
    ps = sorted(r.model[2].p for r in engine.replicas)
    assert ps == pytest.approx([0.1, 0.2 - 0.1 / 3, 0.2 + 0.1 / 3, 0.3])
    for r in engine.replicas:
        assert r.value("lr") == r.optimizer.param_groups[0]["lr"]


def test_knobs_draw_independent_permutations(digits):
    engine = hpx.Engine(mlp(), sgd(0.1), [hpx.LearningRate("a", spread=0.5),
                                          hpx.Custom("b", base=1.0, spread=0.5, set=lambda r, v: None)],
                        replicas=8, sync_every=1, controller=False)
    same = 0
    for b in batches(digits, 20):
        engine.step(ce, b)
        same += engine.history[-1].values["a"] == engine.history[-1].values["b"]
    assert same < 3


def test_scheduled_lr_follows_its_shape(digits):
    shape = lambda t: min(1.0, (t + 1) / 10)  # noqa: E731 - a linear warm-up
    engine = hpx.Engine(mlp(), sgd(0.1), [hpx.LearningRate(spread=0.2, schedule=shape)], replicas=2,
                        sync_every=100)
    centre = [r.value("lr") / shape(0) for r in engine.replicas]  # b * rho_r, fixed until a sync
    assert sorted(centre) == pytest.approx([0.08, 0.12])
    for t, b in enumerate(batches(digits, 12)):
        lrs = [r.optimizer.param_groups[0]["lr"] for r in engine.replicas]
        assert lrs == pytest.approx([c * shape(t) for c in centre], rel=1e-12)
        engine.step(ce, b)


# --- converge --------------------------------------------------------------------------


def test_sync_averages_parameters_and_float_buffers(digits):
    engine = hpx.Engine(mlp(bn=True), sgd(0.1), [hpx.LearningRate(spread=0.5)], replicas=4,
                        sync_every=4, mode="independent", controller=False)
    it = batches(digits, 4)
    for b in [next(it) for _ in range(3)]:
        engine.step(ce, b)
    before = [copy.deepcopy(r.model.state_dict()) for r in engine.replicas]
    assert not torch.equal(before[0]["1.running_mean"], before[1]["1.running_mean"])
    # Run the 4th step by hand on copies to know what each replica holds just before averaging.
    expected = {}
    last = next(it)
    engine.step(ce, last)
    after = [r.model.state_dict() for r in engine.replicas]
    for key in after[0]:
        for s in after[1:]:
            assert torch.equal(after[0][key], s[key]), key
    expected = before[0]["1.num_batches_tracked"] + 1
    assert int(after[0]["1.num_batches_tracked"]) == int(expected)
    assert not torch.equal(after[0]["1.running_mean"], before[0]["1.running_mean"])


def test_sync_result_is_the_mean(digits):
    """Stop just before a sync, compute the mean by hand, and compare."""
    engine = hpx.Engine(mlp(bn=True), sgd(0.1), [hpx.LearningRate(spread=0.5)], replicas=3,
                        sync_every=3, mode="independent", controller=False)
    bs = list(batches(digits, 3))
    for b in bs[:2]:
        engine.step(ce, b)
    mirror = copy.deepcopy(engine.replicas)  # replicas as they are before the last step
    parts = torch.tensor_split(bs[2][0], 3), torch.tensor_split(bs[2][1], 3)
    for r, x, y in zip(mirror, *parts):
        r.optimizer.zero_grad()
        F.cross_entropy(r.model(x), y).backward()
        r.optimizer.step()
    engine.step(ce, bs[2])
    for key, value in engine.replicas[0].model.state_dict().items():
        if value.is_floating_point():
            mean = torch.stack([r.model.state_dict()[key] for r in mirror]).mean(0)
            torch.testing.assert_close(value, mean, rtol=1e-5, atol=1e-6)


def test_independent_mode_diverges_shared_mode_shares_gradients(digits):
    shared = hpx.Engine(mlp(), sgd(0.1), [hpx.LearningRate(spread=0.5)], replicas=4, sync_every=100)
    indep = hpx.Engine(mlp(), sgd(0.1), [hpx.LearningRate(spread=0.0)], replicas=4, sync_every=100,
                       mode="independent")
    b = next(batches(digits, 1))
    shared.step(ce, b)
    indep.step(ce, b)
    g = [torch.cat([p.grad.reshape(-1) for p in r.model.parameters()]) for r in shared.replicas]
    assert all(torch.equal(g[0], h) for h in g[1:])
    g = [torch.cat([p.grad.reshape(-1) for p in r.model.parameters()]) for r in indep.replicas]
    assert all(not torch.allclose(g[0], h) for h in g[1:])


def test_the_shared_gradient_is_the_mean_in_flat_buckets(digits):
    """A gradient per replica (per-replica optimizers): every replica's gradient is a view of one
    flat buffer, and after the step each holds the mean of the replicas' own gradients (checked
    against each replica's backward run by hand), even after a zero_grad(set_to_none=True)."""
    from hpx.engine.step import _GradBuckets

    engine = hpx.Engine(mlp(), sgd(0.1), [hpx.LearningRate(spread=0.3)], replicas=3, sync_every=2,
                        shared_optimizer_state=False)
    assert isinstance(engine._grads, _GradBuckets)
    for i, b in enumerate(batches(digits, 5)):
        if i == 3:  # a user who zeroes grads to None
            engine.replicas[1].optimizer.zero_grad(set_to_none=True)
        twins = [copy.deepcopy(r.model) for r in engine.replicas]
        own = []
        rows = []
        for twin, part in zip(twins, zip(b[0].tensor_split(3), b[1].tensor_split(3))):
            F.cross_entropy(twin(part[0]), part[1]).backward()
            own.append(torch.cat([p.grad.reshape(-1) for p in twin.parameters()]))
            rows.append(len(part[1]))
        engine.step(ce, b)
        # each part's gradient weighted by its rows (the parts are uneven): the whole batch's mean
        mean = sum(g * n for g, n in zip(own, rows)) / sum(rows)
        for r in engine.replicas:
            torch.testing.assert_close(torch.cat([p.grad.reshape(-1) for p in r.model.parameters()]), mean)
    bufs = engine._grads.buffers
    assert len(bufs) == 1 and bufs[0].shape[0] == 3
    lo, hi = bufs[0].data_ptr(), bufs[0].data_ptr() + bufs[0].numel() * bufs[0].element_size()
    for r in engine.replicas:
        assert all(lo <= p.grad.data_ptr() < hi for p in r.model.parameters())


# --- faults ----------------------------------------------------------------------------


def test_nan_replica_is_left_out_and_reset(digits):
    engine = hpx.Engine(mlp(), sgd(0.1), [hpx.LearningRate(spread=0.5)], replicas=4, sync_every=5,
                        mode="independent")

    def poisoned(rep, batch):
        loss = ce(rep, batch)
        if rep.index == 2 and engine.step_count == 7:
            return loss * float("nan")
        return loss

    bs = list(batches(digits, 10))
    for b in bs[:9]:
        engine.step(poisoned, b)
    assert not torch.isfinite(params(engine.replicas[2].model)).all()
    healthy = [params(r.model) for i, r in enumerate(engine.replicas) if i != 2]
    engine.step(poisoned, bs[9])  # the sync at step 10
    rec = engine.history[-1]
    assert rec.nonfinite == [2] and math.isnan(rec.scores[2])
    # the controller counts it as the worst replica (evidence against its lr), not as absent
    assert rec.weights[2] < min(w for i, w in enumerate(rec.weights) if i != 2)
    assert sum(rec.weights) == pytest.approx(1.0)
    assert math.isfinite(engine.bases["lr"])
    for r in engine.replicas:
        assert torch.isfinite(params(r.model)).all()
    assert len(healthy) == 3


class _FixedScores:
    """A signal that does not look at the weights: a replica's NaN shows only in its weights."""

    def measure(self, ctx):
        return torch.arange(len(ctx.replicas), dtype=torch.float32)


@pytest.mark.parametrize("where", ["sync", "converge"])
def test_nonfinite_weights_behind_a_finite_score_are_found_at_the_merge(digits, where):
    """The health of the weights is read from the mean (one pass): a replica whose weights are
    NaN though nothing it reported was, is then found replica by replica, left out and reset."""
    engine = hpx.Engine(mlp(), sgd(0.1), [hpx.LearningRate(spread=0.5)], replicas=4, sync_every=5,
                        signal=_FixedScores())
    bs = list(batches(digits, 5))
    for b in bs[:4]:
        engine.step(ce, b)
    if where == "sync":  # the NaN arrives after the step's losses were taken, before the sync
        engine.backward(ce, bs[4])
    others = [params(r.model) for i, r in enumerate(engine.replicas) if i != 1]
    with torch.no_grad():
        next(engine.replicas[1].model.parameters())[0, 0] = float("nan")
    if where == "sync":
        engine.optimizer_step()
        rec = engine.history[-1]
        assert rec.step == 5 and rec.nonfinite == [1] and math.isnan(rec.scores[1])
        assert [rec.scores[i] for i in (0, 2, 3)] == [0.0, 2.0, 3.0]
    else:
        engine.converge()
        torch.testing.assert_close(params(engine.replicas[0].model), sum(others) / 3)
    for r in engine.replicas:
        assert torch.isfinite(params(r.model)).all()
        assert torch.equal(params(r.model), params(engine.replicas[0].model))


def test_nan_in_shared_mode_does_not_poison_the_others(digits):
    engine = hpx.Engine(mlp(), sgd(0.1), [hpx.LearningRate(spread=0.5)], replicas=4, sync_every=5)

    def poisoned(rep, batch):
        loss = ce(rep, batch)
        return loss * float("nan") if rep.index == 1 and engine.step_count == 2 else loss

    for b in batches(digits, 5):
        engine.step(poisoned, b)
    assert engine.history[-1].nonfinite == [1]
    for r in engine.replicas:
        assert torch.isfinite(params(r.model)).all()


def test_a_constructor_that_raises_leaves_the_model_as_it_was():
    model = mlp()
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(hpx.ConfigError, match="group"):
        hpx.Engine(model, sgd(0.1), [hpx.LearningRate(group=3, spread=0.5)], replicas=2, warm_init=0.1)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    # the same settings with a valid knob do add the warm-init noise
    hpx.Engine(model, sgd(0.1), [hpx.LearningRate(spread=0.5)], replicas=2, warm_init=0.1)
    assert not torch.equal(model.state_dict()["0.weight"], before["0.weight"])


def test_all_replicas_nan_weights_raise(digits):
    # independent mode: every replica steps on its own NaN gradient, so every weight is NaN
    engine = hpx.Engine(mlp(), sgd(0.1), [hpx.LearningRate(spread=0.5)], replicas=3, sync_every=2,
                        mode="independent")
    nan_loss = lambda rep, b: ce(rep, b) * float("nan")  # noqa: E731
    bs = batches(digits, 2)
    engine.step(nan_loss, next(bs))
    with pytest.raises(hpx.NonFiniteError, match="weights of all 3 replicas"):
        engine.step(nan_loss, next(bs))


def test_one_step_with_every_loss_nan_is_survived(digits, caplog):
    """A NaN batch for every replica (shared mode: the weights stay finite) must not poison
    the interval's scores for the rest of the run, nor stop the search."""
    bad_step = 3

    def run(poison: bool):
        engine = hpx.Engine(mlp(), sgd(0.1), [hpx.LearningRate(spread=0.5)], replicas=4, sync_every=5)

        def loss_fn(rep, b):
            loss = ce(rep, b)
            return loss * float("nan") if poison and engine.step_count + 1 == bad_step else loss

        for b in batches(digits, 20):
            engine.step(loss_fn, b)
        return engine

    clean, hit = run(False), run(True)
    assert [r.step for r in hit.history] == [5, 10, 15, 20]
    assert all(r.nonfinite == [] for r in hit.history)  # the bad step blames no replica
    assert all(math.isfinite(s) for r in hit.history for s in r.scores)
    assert hit.history[-1].bases["lr"] != hit.history[0].bases["lr"]  # the search kept moving
    for r in hit.replicas:
        assert torch.isfinite(params(r.model)).all()
    # the bad step changed the trajectory (its update was skipped), nothing else
    assert clean.history[0].scores != hit.history[0].scores


def test_every_loss_nan_for_a_whole_interval_averages_and_moves_nothing(digits, caplog):
    engine = hpx.Engine(mlp(), sgd(0.1), [hpx.LearningRate(spread=0.5)], replicas=4, sync_every=3)
    nan_loss = lambda rep, b: ce(rep, b) * float("nan")  # noqa: E731
    base = engine.bases["lr"]
    with caplog.at_level("WARNING", logger="hpx"):
        for b in batches(digits, 3):
            engine.step(nan_loss, b)
    assert "no replica has a finite score" in caplog.text
    assert engine.bases["lr"] == base and all(math.isnan(s) for s in engine.history[-1].scores)
    for b in batches(digits, 3, seed=1):  # and the run goes on
        engine.step(ce, b)
    assert engine.bases["lr"] != base


def test_a_value_that_makes_nan_pushes_the_base_away(digits):
    """Item: a replica that goes non-finite is the worst, so a value that breaks training
    does not keep pulling the base toward it."""
    engine = hpx.Engine(mlp(), sgd(0.05), [hpx.LearningRate(spread=0.5)], replicas=4, sync_every=4)

    def loss_fn(rep, b):
        loss = ce(rep, b)
        return loss * float("nan") if rep.value("lr") > 0.06 else loss

    for b in batches(digits, 160):
        engine.step(loss_fn, b)
    assert engine.bases["lr"] < 0.06  # left out instead, the NaN replicas let it end above (0.063)
    assert sum(bool(r.nonfinite) for r in engine.history) < len(engine.history) / 2  # then: 29 of 40


# --- determinism and checkpoints --------------------------------------------------------


def _run(digits, steps, seed=0, state=None, engine=None):
    knobs = [hpx.LearningRate(spread=0.4), hpx.Dropout(spread=0.05),
             hpx.LabelSmoothing(base=0.1, spread=0.05)]
    if engine is None:
        engine = hpx.Engine(mlp(dropout=0.1), sgd(0.1, momentum=0.9), knobs, replicas=4,
                            sync_every=5, seed=seed, signal=hpx.SharedBatch(), warm_init=0.01)
    if state is not None:
        engine.load_state_dict(state)
    loss = lambda r, b: F.cross_entropy(r.model(b[0]), b[1], label_smoothing=r.value("label_smoothing"))  # noqa: E731
    all_b = list(batches(digits, 40, seed=3))
    gen_state = torch.random.get_rng_state()
    for b in all_b[engine.step_count : steps]:
        torch.manual_seed(engine.step_count)  # the user's dropout draws, reproducible per step
        engine.step(loss, b)
    torch.random.set_rng_state(gen_state)
    return engine


def test_same_seed_same_trajectory_and_resume_is_exact(digits):
    full = _run(digits, 23)
    again = _run(digits, 23)
    assert [r.bases for r in full.history] == [r.bases for r in again.history]
    half = _run(digits, 12)  # mid-interval: accumulators and step count must be saved too
    buf = io.BytesIO()
    torch.save(half.state_dict(), buf)
    buf.seek(0)
    resumed = _run(digits, 23, state=torch.load(buf, weights_only=False))
    assert [r.bases for r in resumed.history] == [r.bases for r in full.history]
    for a, b in zip(full.replicas, resumed.replicas):
        assert torch.equal(params(a.model), params(b.model))
        assert a.values == b.values
    other = _run(digits, 23, seed=1)
    assert [r.values for r in other.history] != [r.values for r in full.history]


def _snapshot(engine) -> tuple:
    return (copy.deepcopy([(r.model.state_dict(), r.optimizer.state_dict()) for r in engine.replicas]),
            engine.step_count, dict(engine.bases), copy.deepcopy(engine.search.state_dict()),
            len(engine.history), engine.next_sync)


def _same(a: tuple, b: tuple) -> bool:
    (sa, *ra), (sb, *rb) = a, b
    for (ma, oa), (mb, ob) in zip(sa, sb):
        if any(not torch.equal(ma[k], mb[k]) for k in ma):
            return False
        if oa["param_groups"] != ob["param_groups"]:
            return False
    return ra == rb


@pytest.mark.parametrize("change, needle", [
    ("sync_every", "sync_every=3"),
    ("mode", "mode='independent'"),
    ("knob", "knobs ['lr'] but this run declares ['lr', 'wd']"),
    ("arch", "another architecture"),
    ("optimizer", "parameters per group"),
    ("replicas", "checkpoint has 3 replicas"),
])
def test_a_refused_checkpoint_changes_nothing(digits, change, needle):
    src = hpx.Engine(mlp(), sgd(0.1), [hpx.LearningRate(spread=0.5)], replicas=3, sync_every=3)
    for b in batches(digits, 4):
        src.step(ce, b)
    state = copy.deepcopy(src.state_dict())
    model, opt = mlp(seed=1), sgd(0.1)
    knobs = [hpx.LearningRate(spread=0.5)]
    settings = dict(replicas=3, sync_every=3)
    if change == "sync_every":
        settings["sync_every"] = 4
    elif change == "mode":  # a checkpoint from an independent-mode run
        state["settings"]["mode"] = "independent"
    elif change == "knob":
        knobs.append(hpx.WeightDecay("wd", base=1e-4))
    elif change == "arch":
        model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))
    elif change == "optimizer":
        opt = lambda m: torch.optim.SGD([{"params": list(m.parameters())[:2]},  # noqa: E731
                                         {"params": list(m.parameters())[2:]}], lr=0.1)
    elif change == "replicas":
        settings["replicas"] = 2
    dst = hpx.Engine(model, opt, knobs, **settings)
    for b in batches(digits, 2, seed=3):
        dst.step(ce, b)
    before = _snapshot(dst)
    with pytest.raises(hpx.ConfigError) as err:
        dst.load_state_dict(state)
    assert needle in str(err.value)
    assert _same(before, _snapshot(dst))
    if change == "sync_every":  # the message names the saved value and this engine's
        assert "sync_every=4" in str(err.value)


def test_a_checkpoint_records_its_settings(digits):
    engine = hpx.Engine(mlp(), sgd(0.1), [hpx.LearningRate(spread=0.5)], replicas=2, sync_every=7,
                        mode="independent")
    rec = engine.state_dict()["settings"]
    assert rec["sync_every"] == 7 and rec["mode"] == "independent" and rec["replicas"] == 2
    assert rec["search"] == "HDET"
    assert rec["knobs"] == [["lr", "LearningRate", "mul", ["lr of parameter group 0"]]]


def test_global_rng_untouched(digits):
    model = mlp()  # building nn.Linear draws from the global RNG: that is torch's, not hpx's
    torch.manual_seed(123)
    before = torch.random.get_rng_state()
    engine = hpx.Engine(model, sgd(0.1), [hpx.LearningRate(spread=0.5)], replicas=4, sync_every=2,
                        warm_init=0.01, signal=hpx.SharedBatch())
    for b in batches(digits, 4):
        engine.step(ce, b)
    assert torch.equal(torch.random.get_rng_state(), before)


def test_warm_init_noise(digits):
    engine = hpx.Engine(mlp(), sgd(0.1), [], replicas=4, warm_init=0.05, seed=7)
    ref = mlp()
    w0 = ref[0].weight
    for r in engine.replicas:
        eps = r.model[0].weight - w0
        expected = 0.05 * w0.detach().norm() / math.sqrt(w0.numel())
        assert float(eps.detach().std()) == pytest.approx(float(expected), rel=0.15)
    a, b = (params(r.model) for r in engine.replicas[:2])
    assert not torch.equal(a, b)
    again = hpx.Engine(mlp(), sgd(0.1), [], replicas=4, warm_init=0.05, seed=7)
    assert torch.equal(params(again.replicas[3].model), params(engine.replicas[3].model))


def test_sixteen_replicas_and_one(digits):
    for n in (1, 16):
        engine = hpx.Engine(mlp(), sgd(0.1), [hpx.LearningRate(spread=0.5)], replicas=n, sync_every=2)
        for b in batches(digits, 4):
            losses = engine.step(ce, b)
        assert losses.shape == (n,) and len(engine.history) == 2
        assert len(engine.history[-1].values["lr"]) == n


# --- bad input -------------------------------------------------------------------------


def test_config_errors_list_every_problem():
    with pytest.raises(hpx.ConfigError) as err:
        hpx.Engine(mlp(), sgd(), [], sync_every=0, momentum=1.0, temperature=-1, replicas=0, foo=1)
    text = str(err.value)
    assert len(err.value.problems) == 5
    for needle in ("sync_every", "(got 0)", "momentum", "temperature", "replicas", "'foo'"):
        assert needle in text


def test_optimizer_factory_must_use_the_given_model():
    outside = mlp()
    with pytest.raises(hpx.ConfigError, match="not its model's"):
        hpx.Engine(mlp(), lambda m: torch.optim.SGD(outside.parameters(), lr=0.1), [], replicas=2)
    with pytest.raises(hpx.ConfigError, match="need one optimizer each"):
        hpx.Engine(mlp(), torch.optim.SGD(mlp().parameters(), lr=0.1), [], replicas=2)


def test_batch_too_small_to_split(digits):
    engine = hpx.Engine(mlp(), sgd(), [], replicas=4)
    x, y = digits
    with pytest.raises(hpx.ConfigError, match="at least one example per replica"):
        engine.step(ce, (x[:3], y[:3]))


def test_record_and_advance_without_losses_names_the_fix():
    engine = hpx.Engine(mlp(), sgd(), [hpx.LearningRate(spread=0.3)], replicas=1, sync_every=2)
    engine.advance()
    with pytest.raises(hpx.ConfigError, match="record"):
        engine.advance()


def test_replicas_of_a_model_that_keeps_a_tensor_of_the_graph_are_copies_with_their_own_weights():
    """torch.nn.utils.weight_norm (and a forward that keeps its output: ``self.last = out``) leaves a
    tensor of the autograd graph on the model, which copy.deepcopy refuses. A replica in the same
    process copies it detached; its forward then computes from its own parameters."""
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch's: weight_norm moved to parametrizations
        model = nn.Sequential(torch.nn.utils.weight_norm(nn.Linear(4, 4)), nn.Linear(4, 1))
    engine = hpx.Engine(model, lambda m: torch.optim.SGD(m.parameters(), lr=0.1), replicas=2)
    copy_ = engine.replicas[1].model
    x = torch.randn(8, 4)
    assert torch.equal(copy_(x), model(x))
    copy_(x).sum().backward()
    assert copy_[0].weight_v.grad is not None and model[0].weight_v.grad is None
