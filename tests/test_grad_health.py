"""Gradient health in shared mode (issue 20, item 4): one replica's non-finite gradient (with a
finite loss) or one-step blow-up is left out of that step's shared mean and counted as the worst
at the next sync, on every gradient path; a checkpoint is never saved with non-finite weights."""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hpx
from hpx._health import _Health
from hpx._step import _GradBuckets, _OneGradient
from tests._dist import run_distributed

STEPS, T, FAULT = 100, 10, 25  # the fault hits replica 1 at step FAULT (0-based)
LR, MOMENTUM, BATCH = 0.05, 0.9, 256  # a calm run: its final loss does not hang on one step


class _InfGrad(torch.autograd.Function):
    """The identity forward; backward gives an infinite gradient (a finite loss, an Inf grad)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        return g * math.inf


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))


def _data(digits: tuple[torch.Tensor, torch.Tensor], n: int, size: int = 64) -> list[Any]:
    x, y = digits
    g = torch.Generator().manual_seed(1)
    return [(x[i], y[i]) for i in (torch.randint(0, 1400, (size,), generator=g) for _ in range(n))]


def _heldout_loss(model: nn.Module, digits: tuple[torch.Tensor, torch.Tensor]) -> float:
    x, y = digits
    with torch.no_grad():
        return float(F.cross_entropy(model(x[1400:]), y[1400:]))


def _run(digits: Any, fault: str | None, path: str, local: int = 4) -> tuple[hpx.Engine, float]:
    """``path``: which shared gradient the engine keeps ("foreach", "one", "one-device")."""
    engine = hpx.Engine(_mlp(), lambda m: torch.optim.SGD(m.parameters(), lr=LR, momentum=MOMENTUM),
                        [hpx.LearningRate(spread=0.25)], replicas=local, sync_every=T, seed=0,
                        shared_optimizer_state=path != "foreach")
    if path == "one-device":  # the accelerator's path (scratch gradient, nothing read back), on the CPU
        engine._one = _OneGradient(engine.replicas, host=False)
        engine._grad_health = _Health(torch.device("cpu"), host=False)  # judged on the "device"
    assert (engine._one is None) == (path == "foreach")

    def loss_fn(rep: hpx.Replica, b: Any) -> torch.Tensor:
        loss = F.cross_entropy(rep.model(b[0]), b[1])
        if fault == "inf-grad" and rep.index == 1 and engine.step_count == FAULT:
            return _InfGrad.apply(loss)
        return loss

    for t, b in enumerate(_data(digits, STEPS, BATCH)):
        opt = engine.replicas[1].optimizer
        if fault == "blow-up" and t == FAULT:
            lr = opt.param_groups[0]["lr"]
            opt.param_groups[0]["lr"] = 1e6
        engine.step(loss_fn, b)
        if fault == "blow-up" and t == FAULT:
            opt.param_groups[0]["lr"] = lr
    return engine, _heldout_loss(engine.converge(), digits)


@pytest.fixture(scope="module")
def clean(digits: Any) -> dict[str, float]:
    out = {}
    for p in ("foreach", "one", "one-device"):
        engine, out[p] = _run(digits, None, p)
        assert all(r.nonfinite == [] for r in engine.history)  # a healthy run: nothing flagged
    return out


@pytest.mark.parametrize("path", ["foreach", "one", "one-device"])
@pytest.mark.parametrize("fault", ["inf-grad", "blow-up"])
def test_one_replicas_bad_gradient_is_left_out_and_the_run_ends_within_2_percent(
        digits: Any, clean: dict[str, float], fault: str, path: str) -> None:
    engine, loss = _run(digits, fault, path)
    assert math.isfinite(loss) and abs(loss - clean[path]) <= 0.02 * clean[path], (loss, clean[path])
    rec = next(r for r in engine.history if r.step > FAULT)  # the sync after the fault
    assert 1 in rec.nonfinite and math.isnan(rec.scores[1])  # counted as the worst, then reset
    assert all(r.nonfinite == [] for r in engine.history if r.step <= FAULT)


def test_every_replicas_gradient_non_finite_still_reaches_a_grad_scaler(digits: Any) -> None:
    """An overflow on every replica is the GradScaler's to see: it skips the step and lowers
    its scale (a mean over no replica would hide the overflow from it)."""
    engine = hpx.Engine(_mlp(), lambda m: torch.optim.SGD(m.parameters(), lr=0.1),
                        [hpx.LearningRate(spread=0.25)], replicas=2, sync_every=T,
                        shared_optimizer_state=False)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    before = [p.detach().clone() for p in engine.replicas[0].model.parameters()]
    b = _data(digits, 1)[0]
    engine.backward(lambda rep, x: _InfGrad.apply(F.cross_entropy(rep.model(x[0]), x[1])), b, scaler=scaler)
    engine.optimizer_step(scaler=scaler)
    assert scaler.get_scale() == 2.0 ** 9  # it saw the overflow
    assert all(torch.equal(a, p) for a, p in zip(before, engine.replicas[0].model.parameters()))


def test_a_checkpoint_is_not_saved_with_non_finite_weights(digits: Any, tmp_path: Path,
                                                           caplog: pytest.LogCaptureFixture) -> None:
    engine = hpx.Engine(_mlp(), lambda m: torch.optim.SGD(m.parameters(), lr=0.1),
                        [hpx.LearningRate(spread=0.25)], replicas=2, sync_every=T, mode="independent")
    data = _data(digits, 3)

    def ce(rep: hpx.Replica, b: Any) -> torch.Tensor:
        return F.cross_entropy(rep.model(b[0]), b[1])

    engine.step(ce, data[0])
    assert hpx.save_checkpoint(tmp_path, engine) is not None
    with torch.no_grad():
        next(engine.replicas[1].model.parameters())[0, 0] = math.nan
    engine.step(ce, data[1])
    with caplog.at_level(logging.WARNING, logger="hpx"):
        assert hpx.save_checkpoint(tmp_path, engine) is None
    assert "step 2" in caplog.text and "replica(s) [1]" in caplog.text and "not saved" in caplog.text
    assert sorted(p.name for p in tmp_path.glob("step-*")) == ["step-000000001"]
    fresh = hpx.Engine(_mlp(), lambda m: torch.optim.SGD(m.parameters(), lr=0.1),
                       [hpx.LearningRate(spread=0.25)], replicas=2, sync_every=T, mode="independent")
    assert hpx.load_checkpoint(tmp_path, fresh) == 1


# --- across processes: one replica per rank, the flat-bucket mean over gloo ----------------


def _dist_run(rank: int, world: int, fault: str | None) -> dict[str, Any]:
    from sklearn.datasets import load_digits

    torch.set_num_threads(1)
    x, y = load_digits(return_X_y=True)
    digits = torch.tensor(x / 16.0, dtype=torch.float32), torch.tensor(y, dtype=torch.long)
    engine = hpx.Engine(_mlp(), lambda m: torch.optim.SGD(m.parameters(), lr=LR, momentum=MOMENTUM),
                        [hpx.LearningRate(spread=0.25)], backend=hpx.backends.TorchDistributed(),
                        sync_every=T, seed=0)
    assert isinstance(engine._grads, _GradBuckets)

    def loss_fn(rep: hpx.Replica, b: Any) -> torch.Tensor:
        loss = F.cross_entropy(rep.model(b[0]), b[1])
        if fault == "inf-grad" and rank == 1 and engine.step_count == FAULT:
            return _InfGrad.apply(loss)
        return loss

    half = BATCH // 2
    for t, b in enumerate(_data(digits, STEPS, BATCH)):
        opt = engine.replicas[0].optimizer
        if fault == "blow-up" and rank == 1 and t == FAULT:
            lr = opt.param_groups[0]["lr"]
            opt.param_groups[0]["lr"] = 1e6
        engine.step(loss_fn, (b[0][rank * half:(rank + 1) * half], b[1][rank * half:(rank + 1) * half]))
        if fault == "blow-up" and rank == 1 and t == FAULT:
            opt.param_groups[0]["lr"] = lr
    loss = _heldout_loss(engine.converge(), digits)
    return {"loss": loss, "nonfinite": [(r.step, r.nonfinite) for r in engine.history]}


@pytest.mark.parametrize("fault", ["inf-grad", "blow-up"])
def test_across_gloo_processes_a_ranks_bad_gradient_is_left_out(fault: str) -> None:
    clean = run_distributed(_dist_run, 2, None, timeout=120)
    faulted = run_distributed(_dist_run, 2, fault, timeout=120)
    ref, got = clean[0]["loss"], faulted[0]["loss"]
    assert faulted[0]["loss"] == faulted[1]["loss"]
    assert math.isfinite(got) and abs(got - ref) <= 0.02 * ref, (got, ref)
    after = next(nf for step, nf in faulted[0]["nonfinite"] if step > FAULT)
    assert after == [1]
    assert all(nf == [] for _, nf in clean[0]["nonfinite"])
