"""What real loops do around the optimizer step: gradient accumulation, clipping, AMP's
GradScaler, and a loop of one's own that steps the optimizers itself. Each is checked
against the same arithmetic written by hand, and the shared-gradient mean must never be
skipped silently."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hpx
from tests._digits import data

N, T = 2, 3


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))


def _engine(mode: str = "shared", **kw) -> hpx.Engine:
    return hpx.Engine(_model(), lambda m: torch.optim.SGD(m.parameters(), lr=0.2, momentum=0.9),
                      [hpx.LearningRate(spread=0.5)], replicas=N, sync_every=T, mode=mode, **kw)


def _ce(rep, b) -> torch.Tensor:
    return F.cross_entropy(rep.model(b[0]), b[1])


def _params(engine) -> list[torch.Tensor]:
    return [p.detach().clone() for r in engine.replicas for p in r.model.parameters()]


def _close(a, b, **tol) -> bool:
    return all(torch.allclose(x, y, **tol) for x, y in zip(a, b))


@pytest.mark.parametrize("mode", ["shared", "independent"])
def test_accumulating_micro_batches_equals_the_whole_batch(digits, mode):
    whole, accum = _engine(mode), _engine(mode)
    for x, y in data(digits, 7, size=64):
        whole.step(_ce, (x, y))
        # 4 micro-batches of 16, each split among the 2 replicas as the whole batch would be
        per_replica = [(x[i * 32:(i + 1) * 32], y[i * 32:(i + 1) * 32]) for i in range(N)]
        for k in range(4):
            accum.backward(_ce, batches=[(px[k * 8:(k + 1) * 8], py[k * 8:(k + 1) * 8])
                                         for px, py in per_replica], scale=0.25)
        accum.optimizer_step()
    assert accum.step_count == whole.step_count == 7 and len(accum.history) == 2
    assert _close(_params(whole), _params(accum), atol=1e-6)
    assert [r.bases["lr"] for r in accum.history] == pytest.approx([r.bases["lr"] for r in whole.history])


@pytest.mark.parametrize("mode", ["shared", "independent"])
def test_clipping_is_the_hand_written_loop(digits, mode):
    engine, hand = _engine(mode), _engine(mode)
    seen = []
    for x, y in data(digits, 6, size=64):
        norms = engine.backward(_ce, (x, y)) is not None and engine.optimizer_step(max_grad_norm=0.2)
        seen.append(norms)
        hand.backward(_ce, (x, y))
        hand.reduce()
        expect = []
        for r in hand.replicas:
            expect.append(torch.nn.utils.clip_grad_norm_(r.model.parameters(), 0.2))
            r.optimizer.step()
        hand.advance()
        assert torch.equal(norms, torch.stack(expect))
        if mode == "shared":  # after the mean every replica clips the same gradient
            assert torch.equal(norms[0], norms[1])
    assert all(torch.equal(a, b) for a, b in zip(_params(engine), _params(hand)))
    assert float(torch.stack(seen).max()) > 0.2  # the clip did bite


def test_grad_scaler_skips_a_step_with_inf_gradients_on_every_replica(digits):
    engine = _engine()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    batches = data(digits, 4, size=64)
    for x, y in batches[:3]:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            engine.backward(_ce, (x, y), scaler=scaler)
        engine.optimizer_step(scaler=scaler)
    assert scaler.get_scale() == 2.0 ** 10
    before = _params(engine)
    x, y = batches[3]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        engine.backward(lambda r, b: _ce(r, b) * (1e38 if r.index == 1 else 1.0), (x, y), scaler=scaler)
    engine.optimizer_step(scaler=scaler)  # replica 1's gradient overflows: the mean does too
    assert scaler.get_scale() == 2.0 ** 9
    assert all(torch.equal(a, b) for a, b in zip(before, _params(engine)))  # no replica stepped
    assert engine.step_count == 4


def test_grad_scaler_is_the_hand_written_loop(digits):
    engine, hand = _engine(), _engine()
    s1, s2 = torch.amp.GradScaler("cpu"), torch.amp.GradScaler("cpu")
    for x, y in data(digits, 5, size=64):
        engine.backward(_ce, (x, y), scaler=s1)
        engine.optimizer_step(max_grad_norm=1.0, scaler=s1)
        hand.backward(_ce, (x, y), scaler=s2)
        hand.reduce()
        for r in hand.replicas:
            s2.unscale_(r.optimizer)
            torch.nn.utils.clip_grad_norm_(r.model.parameters(), 1.0)
            s2.step(r.optimizer)
        s2.update()
        hand.advance()
    assert all(torch.equal(a, b) for a, b in zip(_params(engine), _params(hand)))


def test_a_loop_of_its_own_must_apply_the_mean(digits):
    ref, own, forgot = _engine(), _engine(), _engine()
    batches = data(digits, 4, size=64)
    for x, y in batches:
        ref.step(_ce, (x, y))
        for e in (own,):
            for rep, (px, py) in zip(e.replicas, zip(x.tensor_split(N), y.tensor_split(N))):
                rep.optimizer.zero_grad(set_to_none=True)  # the usual loop moves grads out of hpx's buffer
                loss = F.cross_entropy(rep.model(px), py)
                loss.backward()
                e.record(loss, rep.index)
            e.reduce()
            for rep in e.replicas:
                rep.optimizer.step()
            e.advance()
    assert _close(_params(ref), _params(own), atol=1e-7)
    x, y = batches[0]
    for rep, (px, py) in zip(forgot.replicas, zip(x.tensor_split(N), y.tensor_split(N))):
        loss = F.cross_entropy(rep.model(px), py)
        loss.backward()
        forgot.record(loss, rep.index)
        rep.optimizer.step()
    with pytest.raises(hpx.ConfigError, match=r"never averaged: call engine.reduce\(\)"):
        forgot.advance()


def test_optimizer_step_needs_a_backward_and_a_sane_norm(digits):
    engine = _engine()
    with pytest.raises(hpx.ConfigError, match=r"call engine\.backward"):
        engine.optimizer_step()
    x, y = data(digits, 1, size=64)[0]
    engine.backward(_ce, (x, y))
    with pytest.raises(hpx.ConfigError, match=r"max_grad_norm must be a number > 0 or None \(got -1\)"):
        engine.optimizer_step(max_grad_norm=-1)
    with pytest.raises(hpx.ConfigError, match=r"scale must be a number > 0 \(got '2'\)"):
        engine.backward(_ce, (x, y), scale="2")
    with pytest.raises(hpx.ConfigError, match=r"scaler must be a torch\.amp\.GradScaler or None \(got 2\)"):
        engine.backward(_ce, (x, y), scaler=2)
