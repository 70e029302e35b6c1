"""One optimizer state for the local replicas in shared mode: the same run as one state per
replica, stored once; and kept per replica wherever that is not provably the same."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hpx
from hpx.knobs import GroupKnob


def mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))


def ce(rep: hpx.Replica, batch) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(rep.model(x), y)


def train(engine: hpx.Engine, digits, steps: int, *, start: int = 0, **step_kw) -> None:
    x, y = digits
    g = torch.Generator().manual_seed(7)
    idx = [torch.randint(0, 1400, (64,), generator=g) for _ in range(start + steps)]
    for i in idx[start:]:
        # with a scaler: a loss large enough that its first scales overflow
        engine.backward(ce, (x[i], y[i]), scaler=step_kw.get("scaler"),
                        scale=1e4 if step_kw.get("scaler") else 1.0)
        engine.optimizer_step(**step_kw)


def build(opt, knobs=None, share: bool = True, **kw) -> hpx.Engine:
    knobs = knobs() if knobs is not None else [hpx.LearningRate(spread=0.5)]  # each engine its own
    return hpx.Engine(mlp(), opt, knobs, replicas=4, sync_every=5, shared_optimizer_state=share, **kw)


def assert_same_run(a: hpx.Engine, b: hpx.Engine) -> None:
    for ra, rb in zip(a.replicas, b.replicas):
        for p, q in zip(ra.model.parameters(), rb.model.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    assert a.bases == pytest.approx(b.bases, rel=1e-4)
    assert len(a.history) == len(b.history) > 0


SHAREABLE = {
    "SGD momentum": lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9),
    "SGD nesterov": lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9, nesterov=True),
    "Adam amsgrad": lambda m: torch.optim.Adam(m.parameters(), lr=3e-3, amsgrad=True),
    "AdamW": lambda m: torch.optim.AdamW(m.parameters(), lr=3e-3, weight_decay=0.1),
    "NAdam decoupled": lambda m: torch.optim.NAdam(m.parameters(), lr=3e-3, weight_decay=0.1,
                                                   decoupled_weight_decay=True),
    "RAdam": lambda m: torch.optim.RAdam(m.parameters(), lr=3e-3),
    "Adamax": lambda m: torch.optim.Adamax(m.parameters(), lr=3e-3),
    "RMSprop centered": lambda m: torch.optim.RMSprop(m.parameters(), lr=1e-3, momentum=0.5, centered=True),
    "Adagrad": lambda m: torch.optim.Adagrad(m.parameters(), lr=1e-2),
}


@pytest.mark.parametrize("name", list(SHAREABLE))
def test_one_state_runs_as_one_state_per_replica(digits, name):
    opt = SHAREABLE[name]
    a, b = build(opt), build(opt, share=False)
    assert a.unshared_reason is None and b.unshared_reason == "shared_optimizer_state=False"
    train(a, digits, 12)
    train(b, digits, 12)
    assert_same_run(a, b)
    assert all(not r.optimizer.state for r in a.replicas)  # stored once, not per replica
    assert all(len(r.optimizer.state) == 4 for r in b.replicas)
    for ra, rb in zip(a.state_dict()["replicas"], b.state_dict()["replicas"]):  # what a checkpoint holds
        for i, st in rb["optimizer"]["state"].items():
            for k, v in st.items():
                torch.testing.assert_close(ra["optimizer"]["state"][i][k], v, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("how", ["clip", "scaler"])
def test_one_state_with_clipping_and_a_grad_scaler(digits, how):
    opt = SHAREABLE["AdamW"]
    kw = {"max_grad_norm": 0.05} if how == "clip" else {}
    a, b = build(opt), build(opt, share=False)
    if how == "scaler":  # unscaled once, a step skipped when the scale overflows, as per replica
        sa, sb = (torch.amp.GradScaler("cpu", init_scale=2.0**127) for _ in range(2))
        train(a, digits, 12, scaler=sa)
        train(b, digits, 12, scaler=sb)
        assert sa.get_scale() == sb.get_scale() < 2.0**127  # overflowing steps were skipped
    else:
        train(a, digits, 12, **kw)
        train(b, digits, 12, **kw)
    assert_same_run(a, b)


def test_clipping_returns_each_replicas_norm(digits):
    x, y = digits
    a, b = build(SHAREABLE["AdamW"]), build(SHAREABLE["AdamW"], share=False)
    out = []
    for e in (a, b):
        e.backward(ce, (x[:64], y[:64]))
        out.append(e.optimizer_step(max_grad_norm=0.05))
    assert out[0].shape == (4,) and torch.allclose(out[0], out[1]) and (out[0] > 0.05).all()


def test_decoupled_weight_decay_is_each_replicas_own(digits):
    def knobs():
        return [hpx.LearningRate(spread=0.5), hpx.WeightDecay(spread=0.5)]

    a, b = build(SHAREABLE["AdamW"], knobs), build(SHAREABLE["AdamW"], knobs, share=False)
    assert a.unshared_reason is None
    assert len(set(a.values("weight_decay"))) == 4
    train(a, digits, 12)
    train(b, digits, 12)
    assert_same_run(a, b)


class Momentum(GroupKnob):
    key = "momentum"


@pytest.mark.parametrize("opt, knobs, why", [
    (lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-3), None,
     "weight_decay=0.001 enters its state"),
    (lambda m: torch.optim.Adam(m.parameters(), lr=1e-3, weight_decay=1e-3), None, "weight_decay=0.001"),
    (lambda m: torch.optim.SGD(m.parameters(), lr=0.1), None, "SGD without momentum keeps no state"),
    (lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9), lambda: [hpx.WeightDecay(base=0.1)],
     "a knob writes the weight decay, which SGD couples"),  # 0 when built: the shared step dropped it
    (lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9), lambda: [Momentum("mom", spread=0.1)],
     "knobs write the optimizer's momentum"),
    (lambda m: torch.optim.Rprop(m.parameters(), lr=0.01), None, "Rprop is not one of"),
])
def test_a_state_that_may_differ_stays_per_replica(digits, opt, knobs, why):
    e = build(opt, knobs)
    assert why in e.unshared_reason
    a = build(opt, knobs, share=False)
    train(e, digits, 6)
    train(a, digits, 6)
    assert_same_run(e, a)  # nothing changes: the replicas keep their own
    if e.replicas[0].optimizer.state:
        assert all(r.optimizer.state for r in e.replicas)


def test_adagrads_lr_decay_is_linear_in_lr_and_shares_one_state(digits):
    opt = lambda m: torch.optim.Adagrad(m.parameters(), lr=0.1, lr_decay=0.1)  # noqa: E731
    a, b = build(opt), build(opt, share=False)
    assert a.unshared_reason is None
    train(a, digits, 8)
    train(b, digits, 8)
    assert_same_run(a, b)


def test_a_coupled_weight_decay_set_after_the_engine_was_built_is_refused(digits):
    e = build(lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9))
    assert e.unshared_reason is None
    train(e, digits, 2)
    for r in e.replicas:
        r.optimizer.param_groups[0]["weight_decay"] = 0.1
    with pytest.raises(hpx.ConfigError, match=r"weight_decay=0.1, which SGD couples into its state"):
        train(e, digits, 1)


def test_independent_mode_and_one_replica_keep_their_own():
    opt = SHAREABLE["AdamW"]
    assert build(opt, mode="independent").unshared_reason is not None
    one = hpx.Engine(mlp(), opt, [hpx.LearningRate(spread=0.5)], replicas=1)
    assert one.unshared_reason is not None


@pytest.mark.parametrize("first, then", [(True, False), (False, True), (True, True)])
def test_checkpoints_carry_over_between_one_state_and_one_per_replica(digits, first, then):
    opt = SHAREABLE["AdamW"]
    whole = build(opt)
    train(whole, digits, 14)
    src = build(opt, share=first)
    train(src, digits, 8)
    state = src.state_dict()
    dst = build(opt, share=then)
    dst.load_state_dict(state)
    train(dst, digits, 6, start=8)
    assert_same_run(dst, whole)
    if then:
        assert all(not r.optimizer.state for r in dst.replicas)  # taken over at the first step


def test_a_replica_stepped_on_its_own_is_refused(digits):
    x, y = digits
    e = build(SHAREABLE["AdamW"])
    train(e, digits, 2)
    e.backward(ce, (x[:64], y[:64]))
    e.reduce()
    e.replicas[1].optimizer.step()  # a state of its own, beside the shared one
    with pytest.raises(hpx.ConfigError, match=r"replica 1's optimizer was stepped outside "
                                              r"engine.optimizer_step\(\).*shared_optimizer_state=False"):
        e.optimizer_step()


def test_a_custom_knob_that_writes_momentum_is_caught_at_the_next_step(digits):
    def set_momentum(rep, v):
        rep.optimizer.param_groups[0]["betas"] = (v, 0.999)

    knob = hpx.Custom("beta1", set=set_momentum, base=0.9, spread=0.05, bounds=(0.5, 0.99))
    e = build(SHAREABLE["AdamW"], lambda: [hpx.LearningRate(spread=0.5), knob])
    assert e.unshared_reason is None  # a custom knob's writes are unknown until it writes
    with pytest.raises(hpx.ConfigError, match=r"parameter group 0 has betas=.*shared_optimizer_state=False"):
        train(e, digits, 1)


def test_a_user_loop_stepping_each_optimizer_keeps_its_own_states(digits):
    x, y = digits
    e = build(SHAREABLE["AdamW"])
    for i in range(6):  # the manual loop: record, reduce, step each optimizer, advance
        for l, r in enumerate(e.replicas):
            part = slice(64 * i + 16 * l, 64 * i + 16 * (l + 1))
            loss = ce(r, (x[part], y[part]))
            loss.backward()
            e.record(loss, l)
        e.reduce()
        for r in e.replicas:
            r.optimizer.step()
            r.optimizer.zero_grad()
        e.advance()
    saved = e.state_dict()["replicas"]
    assert all(len(r.optimizer.state) == 4 for r in e.replicas)
    for rep, r in zip(saved, e.replicas):  # the checkpoint holds the states they have
        first = next(iter(r.model.parameters()))
        assert torch.equal(rep["optimizer"]["state"][0]["exp_avg"], r.optimizer.state[first]["exp_avg"])


# --- one gradient (one CPU process) ---------------------------------------------------


def test_the_replicas_keep_one_gradient(digits):
    x, y = digits
    e = build(SHAREABLE["AdamW"])
    e.backward(ce, (x[:64], y[:64]))
    firsts = [next(iter(r.model.parameters())) for r in e.replicas]
    assert all(p.grad is firsts[0].grad for p in firsts)  # every backward added into one tensor
    e.optimizer_step()
    assert all(p.grad is firsts[0].grad for p in firsts)


def _nan_on(replica: int, calls: set[int]):
    count = [0]

    def loss_fn(rep, batch):
        loss = ce(rep, batch)
        count[0] += 1
        return loss * float("nan") if rep.index == replica and count[0] in calls else loss
    return loss_fn


@pytest.mark.parametrize("host", [True, False])
def test_a_nan_loss_is_left_out_of_the_one_gradient(digits, host):
    from hpx.engine.step import _OneGradient

    x, y = digits
    a, b = build(SHAREABLE["AdamW"]), build(SHAREABLE["AdamW"], share=False)
    a._one = _OneGradient(a.replicas, host=host)
    for e in (a, b):  # replica 2's loss is NaN at the second step: the mean of the other three
        loss_fn = _nan_on(2, {4 + 3})
        for s in range(6):  # through the sync at step 5
            e.backward(loss_fn, (x[64 * s: 64 * (s + 1)], y[64 * s: 64 * (s + 1)]))
            e.optimizer_step()
    assert_same_run(a, b)
    assert all(torch.isfinite(p).all() for r in a.replicas for p in r.model.parameters())


def test_accumulation_with_a_nan_micro_batch_averages_the_pairs_that_ran(digits):
    x, y = digits
    e = hpx.Engine(mlp(), SHAREABLE["AdamW"], [hpx.LearningRate(spread=0.5)], replicas=2, sync_every=5)
    loss_fn = _nan_on(1, {4})  # calls: mb 1 -> replicas 0, 1 (1, 2); mb 2 -> 0, 1 (3, 4)
    mbs = [(x[:32], y[:32]), (x[32:64], y[32:64])]
    for mb in mbs:
        e.backward(loss_fn, mb, scale=0.5)
    e.reduce()  # a loop of its own reads the mean: each replica its own copy
    grads = [next(iter(r.model.parameters())).grad for r in e.replicas]
    assert grads[0] is not grads[1] and torch.equal(grads[0], grads[1])
    # by hand: the three (replica, micro-batch) gradients that ran, averaged
    ref = mlp()
    parts = []
    for rep_mb in [(0, 0), (1, 0), (0, 1)]:
        ref.zero_grad()
        xx, yy = mbs[rep_mb[1]]
        half = slice(0, 16) if rep_mb[0] == 0 else slice(16, 32)
        F.cross_entropy(ref(xx[half]), yy[half]).backward()
        parts.append(next(iter(ref.parameters())).grad.clone())
    torch.testing.assert_close(grads[0], torch.stack(parts).mean(0), rtol=1e-5, atol=1e-7)


def test_off_the_host_the_one_gradient_masks_on_the_device(digits):
    """Where reading a loss would wait for the device, every backward writes into a scratch
    gradient that is added in unless its loss is non-finite, decided on the device: the same
    run as the host path and as a gradient per replica (forced here on the CPU)."""
    from hpx.engine.step import _OneGradient

    x, y = digits
    runs = []
    for how in ("device", "host"):
        e = build(SHAREABLE["AdamW"])
        if how == "device":
            e._one = _OneGradient(e.replicas, host=False)
        loss_fn = _nan_on(2, {4 + 3})  # replica 2's loss is NaN at the second step
        for s in range(6):
            for mb in range(2):  # two micro-batches
                part = slice(64 * s + 32 * mb, 64 * s + 32 * (mb + 1))
                e.backward(loss_fn, (x[part], y[part]), scale=0.5)
            e.optimizer_step()
        runs.append(e)
    assert runs[0]._one._buffers[0][1] is not None  # it ran with a scratch gradient
    assert_same_run(runs[0], runs[1])


def _train_split(engine, x, y, rank: int, world: int, steps: int = 12) -> None:
    """Step ``steps`` batches of 64; this rank's share of each; global replica 2's loss NaN at
    step 1 (local replicas of a rank take consecutive parts, as in one process)."""
    at = [0]

    def loss_fn(rep, batch):
        loss = ce(rep, batch)
        return loss * float("nan") if rep.index == 2 and at[0] == 1 else loss

    share = 64 // world
    for s in range(steps):
        at[0] = s
        part = slice(64 * s + share * rank, 64 * s + share * (rank + 1))
        engine.step(loss_fn, (x[part], y[part]))


def _two_ranks_two_replicas(rank, world_size, x, y):
    e = hpx.Engine(mlp(), SHAREABLE["AdamW"], [hpx.LearningRate(spread=0.5)], replicas=2, sync_every=5,
                   backend=hpx.backends.TorchDistributed())
    assert e.unshared_reason is None and e._one is not None
    _train_split(e, x, y, rank, world_size)
    return {"params": [torch.cat([p.detach().reshape(-1) for p in r.model.parameters()]) for r in e.replicas],
            "bases": e.bases, "history": [(h.step, h.bases) for h in e.history]}


def test_one_gradient_over_processes_equals_one_process(digits):
    """2 gloo processes x 2 replicas, one gradient and one state per process, summed over the
    processes with the count of finite losses: the run of 4 replicas in one process."""
    from tests._dist import run_distributed

    x, y = digits
    got = run_distributed(_two_ranks_two_replicas, 2, x[:768], y[:768], timeout=120)
    one = build(SHAREABLE["AdamW"])
    _train_split(one, x, y, 0, 1)
    want = [torch.cat([p.detach().reshape(-1) for p in r.model.parameters()]) for r in one.replicas]
    for rank, r in enumerate(got):
        assert [h[0] for h in r["history"]] == [h.step for h in one.history] == [5, 10]
        assert r["bases"] == pytest.approx(one.bases, rel=1e-5)
        for l, p in enumerate(r["params"]):
            torch.testing.assert_close(p, want[2 * rank + l], rtol=1e-5, atol=1e-6)
    assert all(torch.isfinite(p).all() for p in want)


def test_frozen_parameters_take_no_room_in_the_shared_state(digits):
    def opt(m):
        m[0].weight.requires_grad_(False)  # a frozen layer, still in the optimizer's group
        return torch.optim.AdamW(m.parameters(), lr=3e-3)

    a, b = build(opt), build(opt, share=False)
    train(a, digits, 6)
    train(b, digits, 6)
    assert_same_run(a, b)
    assert a._state._dirs[0][0].numel() == 0 and a._state._dirs[0][1].numel() == 32
    for ra, rb in zip(a.state_dict()["replicas"], b.state_dict()["replicas"]):
        assert sorted(ra["optimizer"]["state"]) == sorted(rb["optimizer"]["state"]) == [1, 2, 3]


def test_settings_held_as_tensors_are_compared_by_value():
    from hpx.engine.shared_state import unshareable

    def replicas(beta2):
        out = []
        for i, b in enumerate(beta2):
            m = mlp()
            out.append(hpx.Replica(i, m, torch.optim.Adam(m.parameters(), lr=1e-3,
                                                          betas=(torch.tensor(0.9), torch.tensor(b)))))
        return out

    assert unshareable(replicas([0.999, 0.999]), ["lr"]) is None
    assert "betas" in unshareable(replicas([0.999, 0.99]), ["lr"])


def test_a_copied_engine_keeps_its_own_state_and_gradient(digits):
    import copy

    e = build(SHAREABLE["AdamW"])
    train(e, digits, 3)
    c = copy.deepcopy(e)
    before = [p.detach().clone() for p in e.replicas[0].model.parameters()]
    train(c, digits, 3, start=3)
    assert all(torch.equal(a, b) for a, b in zip(before, e.replicas[0].model.parameters()))  # untouched
    assert c._state._params[1][0][0] is next(iter(c.replicas[1].model.parameters()))
    train(e, digits, 3, start=3)
    assert_same_run(e, c)
