"""Gradient health (issue 20, item 4): one replica's non-finite gradient (with a finite loss) or
one-step blow-up is left out of that step's shared mean and counted as the worst at the next sync,
on every gradient path, DDP's comm hook included; in independent mode a replica whose own step
blows up is flagged at the next sync and reset; a checkpoint is never saved with non-finite
weights."""

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
from benchmarks.reliability import _InfGrad
from hpx._health import _Health
from hpx.engine.step import _GradBuckets, _OneGradient
from tests._dist import run_distributed

STEPS, T, FAULT = 100, 10, 25  # the fault hits replica 1 at step FAULT (0-based)
LR, MOMENTUM, BATCH = 0.05, 0.9, 256  # a calm run: its final loss does not hang on one step


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

    return _run_with_fault(engine, loss_fn, fault, digits)


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


def _dist_run(rank: int, world: int, fault: str | None, ddp: str | None = None) -> dict[str, Any]:
    """``ddp``: None (hpx's flat buckets), or the model in DistributedDataParallel with hpx's comm
    hook judging on the host ("host", as on a CPU) or on the device ("device", nothing read)."""
    from sklearn.datasets import load_digits

    torch.set_num_threads(1)
    x, y = load_digits(return_X_y=True)
    digits = torch.tensor(x / 16.0, dtype=torch.float32), torch.tensor(y, dtype=torch.long)
    model = _mlp()
    if ddp is not None:
        model = torch.nn.parallel.DistributedDataParallel(model)
    engine = hpx.Engine(model, lambda m: torch.optim.SGD(m.parameters(), lr=LR, momentum=MOMENTUM),
                        [hpx.LearningRate(spread=0.25)], backend=hpx.backends.TorchDistributed(),
                        sync_every=T, seed=0)
    if ddp is None:
        assert isinstance(engine._grads, _GradBuckets)
    else:
        assert engine._grads is None and engine._hook is not None
        engine._hook.read_host = ddp == "host"

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


def _ddp_runs(rank: int, world: int) -> dict[Any, dict[str, Any]]:
    """Every DDP case in one launch (spawning the processes costs more than a run)."""
    return {(path, fault): _dist_run(rank, world, fault, path)
            for path in ("host", "device") for fault in (None, "inf-grad", "blow-up")}


def _flat_runs(rank: int, world: int) -> dict[str | None, dict[str, Any]]:
    """The clean run and each fault on hpx's flat buckets, in one launch."""
    return {fault: _dist_run(rank, world, fault) for fault in (None, "inf-grad", "blow-up")}


@pytest.fixture(scope="module")
def flat_runs() -> list[dict[str | None, dict[str, Any]]]:
    return run_distributed(_flat_runs, 2, timeout=240)


@pytest.mark.parametrize("fault", ["inf-grad", "blow-up"])
def test_across_gloo_processes_a_ranks_bad_gradient_is_left_out(
        flat_runs: list[dict[str | None, dict[str, Any]]], fault: str) -> None:
    clean, faulted = [r[None] for r in flat_runs], [r[fault] for r in flat_runs]
    ref, got = clean[0]["loss"], faulted[0]["loss"]
    assert faulted[0]["loss"] == faulted[1]["loss"]
    assert math.isfinite(got) and abs(got - ref) <= 0.02 * ref, (got, ref)
    after = next(nf for step, nf in faulted[0]["nonfinite"] if step > FAULT)
    assert after == [1]
    assert all(nf == [] for _, nf in clean[0]["nonfinite"])


@pytest.fixture(scope="module")
def ddp_runs() -> list[dict[Any, dict[str, Any]]]:
    return run_distributed(_ddp_runs, 2, timeout=240)


@pytest.mark.parametrize("path", ["host", "device"])
@pytest.mark.parametrize("fault", ["inf-grad", "blow-up"])
def test_ddp_comm_hook_leaves_a_ranks_bad_gradient_out_and_the_run_ends_within_2_percent(
        ddp_runs: list[dict[Any, dict[str, Any]]], fault: str, path: str) -> None:
    """DDP's comm hook applies the rule: rank 1's Inf gradient (a finite loss) or its one-step
    blow-up (lr 1e6) is left out of the mean, counted as the worst at the next sync and reset."""
    clean, faulted = [r[(path, None)] for r in ddp_runs], [r[(path, fault)] for r in ddp_runs]
    ref, got = clean[0]["loss"], faulted[0]["loss"]
    assert faulted[0]["loss"] == faulted[1]["loss"]
    assert math.isfinite(got) and abs(got - ref) <= 0.02 * ref, (got, ref)
    after = next(nf for step, nf in faulted[0]["nonfinite"] if step > FAULT)
    assert after == [1]
    assert all(nf == [] for step, nf in faulted[0]["nonfinite"] if step <= FAULT)
    assert all(nf == [] for _, nf in clean[0]["nonfinite"])
    if path == "device":  # the device's verdict is the host's, bit for bit
        assert faulted[0] == ddp_runs[0][("host", fault)]


# --- independent mode: each replica's own step -----------------------------------------------


def _independent(digits: Any, fault: str | None, host: bool = True) -> tuple[hpx.Engine, float]:
    engine = hpx.Engine(_mlp(), lambda m: torch.optim.SGD(m.parameters(), lr=LR, momentum=MOMENTUM),
                        [hpx.LearningRate(spread=0.25)], replicas=4, sync_every=T, seed=0,
                        mode="independent")
    if not host:  # the accelerator's path (judged on the device, nothing read back), on the CPU
        engine._grad_health = _Health(torch.device("cpu"), host=False)

    def loss_fn(rep: hpx.Replica, b: Any) -> torch.Tensor:
        return F.cross_entropy(rep.model(b[0]), b[1])

    return _run_with_fault(engine, loss_fn, fault, digits)


@pytest.mark.parametrize("host", [True, False], ids=["host", "device"])
def test_independent_mode_a_replica_whose_step_blows_up_is_flagged_and_reset(digits: Any, host: bool) -> None:
    """Its loss is then far above the recent maximum: counted as non-finite for the interval,
    the worst at the next sync, left out of the average and reset from the others'."""
    clean_engine, ref = _independent(digits, None, host)
    assert all(r.nonfinite == [] for r in clean_engine.history)
    engine, got = _independent(digits, "blow-up", host)
    assert math.isfinite(got) and abs(got - ref) <= 0.02 * ref, (got, ref)
    rec = next(r for r in engine.history if r.step > FAULT)
    assert rec.nonfinite == [1] and math.isnan(rec.scores[1])
    assert all(r.nonfinite == [] for r in engine.history if r.step <= FAULT)


def _run_with_fault(engine: hpx.Engine, loss_fn: Any, fault: str, digits: Any) -> tuple[hpx.Engine, float]:
    """Train through the fault (replica 1's lr at 1e6 for step FAULT, for "blow-up"; the loss_fn
    injects the others) and return the engine with its held-out loss."""
    for t, b in enumerate(_data(digits, STEPS, BATCH)):
        opt = engine.replicas[1].optimizer
        if fault == "blow-up" and t == FAULT:
            lr = opt.param_groups[0]["lr"]
            opt.param_groups[0]["lr"] = 1e6
        engine.step(loss_fn, b)
        if fault == "blow-up" and t == FAULT:
            opt.param_groups[0]["lr"] = lr
    return engine, _heldout_loss(engine.converge(), digits)
