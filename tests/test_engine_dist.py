"""The engine over TorchDistributed on real gloo processes, against the in-process engine.

One launch of 4 ranks runs every scenario (``_world4``) and returns what each rank
saw; the in-process references run here, in the test process, with the same
seed, data and settings (``replicas=4``, where replica ``r`` gets chunk ``r`` of
each batch, as rank ``r`` does). The tests below each check one aspect of those
observations. World size 1 runs in this process on a one-rank group.
"""

from __future__ import annotations

import contextlib
import datetime
import inspect
import logging
import math
import tempfile
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel as DDP

import hpx
from hpx.backends import InProcess
from hpx.backends.dist import TorchDistributed, _HookState, finite_mean_hook
from hpx.errors import BackendError, ConsistencyError, NonFiniteError
from tests._dist import free_port, run_distributed

WORLD = 4
STEPS, T, BATCH = 40, 10, 64
NAN_STEP = 13  # replica 1's loss is NaN at this step (0-based) in the NaN scenario


# --- one training run, the same code in process and on every rank ---------------------


def _digits() -> tuple[torch.Tensor, torch.Tensor]:
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    return torch.tensor(x / 16.0, dtype=torch.float32), torch.tensor(y, dtype=torch.long)


def _batches(steps: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The same sequence of whole batches in every process."""
    x, y = _digits()
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        idx = torch.randint(0, len(x), (BATCH,), generator=gen)
        out.append((x[idx], y[idx]))
    return out


class _Net(nn.Module):
    def __init__(self, batchnorm: bool = True) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(64, 32), nn.BatchNorm1d(32) if batchnorm else nn.Identity(),
                                  nn.ReLU())
        self.head = nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def _optimizer(model: nn.Module) -> torch.optim.Optimizer:
    net = model.module if isinstance(model, DDP) else model
    return torch.optim.SGD(
        [{"params": net.body.parameters(), "name": "body", "weight_decay": 1e-3},
         {"params": net.head.parameters(), "name": "head"}],
        lr=0.1, momentum=0.9,
    )


def _knobs(spread: float) -> list[hpx.Knob]:
    return [hpx.LearningRate("lr/body", group="body", spread=spread),
            hpx.LearningRate("lr/head", group="head", spread=spread),
            hpx.WeightDecay("wd", group="body", spread=spread)]


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    net = model.module if isinstance(model, DDP) else model
    return {k: v.detach().clone() for k, v in net.state_dict().items()}


def _ddp(model: nn.Module) -> DDP:
    """DDP without the per-forward buffer broadcast: hpx averages buffers at syncs."""
    if "forward_sync_buffers" in inspect.signature(DDP.__init__).parameters:  # torch >= 2.12
        return DDP(model, forward_sync_buffers=False)
    return DDP(model, broadcast_buffers=False)


def _train(backend: hpx.Collective, *, mode: str = "shared", ddp: bool = False, spread: float = 0.3,
           nan_step: int | None = None, steps: int = STEPS, own_hook: bool = False,
           accumulate: bool = False, **settings: Any) -> dict:
    """Train on the digits; return the history and every local replica's final state.

    ``own_hook``: the DDP model comes with DDP's plain all-reduce hook already
    registered, so hpx cannot install its own (``prepare_model`` keeps the user's).
    """
    world, rank = backend.world_size, backend.rank
    torch.manual_seed(0)  # model init: the engine broadcasts rank 0's anyway
    model: nn.Module = _Net()
    if ddp:
        model = _ddp(model)
        if own_hook:
            model.register_comm_hook(None, allreduce_hook)
    replicas = 4 if isinstance(backend, InProcess) else 1
    engine = hpx.Engine(model, _optimizer, _knobs(spread), backend=backend, replicas=replicas,
                        mode=mode, sync_every=T, warmup=T, seed=0, **settings)

    def loss_fn(rep: hpx.Replica, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        loss = F.cross_entropy(rep.model(batch[0]), batch[1])
        if engine.step_count == nan_step and rep.index == 1:
            loss = loss * math.nan
        return loss

    for x, y in _batches(steps):
        if world > 1:  # rank r trains on chunk r, as in-process replica r does
            x, y = x.tensor_split(world)[rank], y.tensor_split(world)[rank]
        if not accumulate:
            engine.step(loss_fn, (x, y))
            continue
        # two micro-batches per replica (each half of its part), then a clipped step
        parts = [(px, py) for px, py in zip(x.tensor_split(replicas), y.tensor_split(replicas))]
        for k in range(2):
            engine.backward(loss_fn, batches=[(px.tensor_split(2)[k], py.tensor_split(2)[k])
                                              for px, py in parts], scale=0.5)
        engine.optimizer_step(max_grad_norm=1.0)
    return {"history": [asdict(r) for r in engine.history],
            "states": [_state(r.model) for r in engine.replicas]}


def _train_autolr(backend: hpx.Collective, *, ddp: bool = True) -> dict:
    """The recommended setup: hpx.autolr with a probe batch, its search window included."""
    world, rank = backend.world_size, backend.rank
    torch.manual_seed(0)
    model: nn.Module = _ddp(_Net()) if ddp else _Net()
    engine = hpx.autolr(model, _optimizer, total_steps=STEPS, probe=_batches(1, seed=7), backend=backend,
                        replicas=4 if isinstance(backend, InProcess) else 1, seed=0)
    for x, y in _batches(STEPS):
        if world > 1:
            x, y = x.tensor_split(world)[rank], y.tensor_split(world)[rank]
        engine.step(lambda rep, b: F.cross_entropy(rep.model(b[0]), b[1]), (x, y))
    return {"history": [asdict(r) for r in engine.history],
            "states": [_state(r.model) for r in engine.replicas]}


def _autolr_saved(backend: hpx.Collective) -> dict:
    """autolr over the ranks (DDP, one replica each) saved inside its search window, for a test in
    process to resume elastically."""
    import tempfile

    world, rank = backend.world_size, backend.rank
    root = backend.broadcast_object(tempfile.mkdtemp(prefix="hpx-autolr-") if rank == 0 else None, 0)
    torch.manual_seed(0)
    engine = hpx.autolr(_ddp(_Net()), _optimizer, total_steps=STEPS, probe=_batches(1, seed=7),
                        backend=backend, seed=0)
    for x, y in _batches(10):
        x, y = x.tensor_split(world)[rank], y.tensor_split(world)[rank]
        engine.step(lambda rep, b: F.cross_entropy(rep.model(b[0]), b[1]), (x, y))
    hpx.save_checkpoint(root, engine)
    return {"root": root, "bases": engine.bases}


def _checkpoint_resume(backend: hpx.Collective, ddp: bool = False) -> dict:
    """Save every 10 steps, "die" at step 25 with rank 1's step-20 files lost (killed while
    saving), resume every rank with hpx.load_checkpoint and finish: compare with a run that
    never stopped."""
    import shutil
    import tempfile

    world, rank = backend.world_size, backend.rank
    root = backend.broadcast_object(tempfile.mkdtemp(prefix="hpx-ckpt-") if rank == 0 else None, 0)

    def build() -> hpx.Engine:
        torch.manual_seed(0)
        return hpx.Engine(_ddp(_Net()) if ddp else _Net(), _optimizer, _knobs(0.3), backend=backend,
                          replicas=1, sync_every=T, seed=0)

    def train(engine: hpx.Engine, until: int, save: bool) -> None:
        for x, y in _batches(STEPS)[engine.step_count:until]:
            x, y = x.tensor_split(world)[rank], y.tensor_split(world)[rank]
            engine.step(lambda rep, b: F.cross_entropy(rep.model(b[0]), b[1]), (x, y))
            if save and engine.step_count % 10 == 0:
                hpx.save_checkpoint(root, engine)

    full = build()
    train(full, STEPS, save=False)
    first = build()
    train(first, 25, save=True)
    dist.barrier()
    if rank == 1:
        (Path(root) / "step-000000020" / "rank-00001.pt.sha256").unlink()
    dist.barrier()
    resumed = build()
    step = hpx.load_checkpoint(root, resumed)
    train(resumed, STEPS, save=False)
    same = all(torch.equal(a, b) for a, b in zip(_state(full.model).values(), _state(resumed.model).values()))
    diff = max(float((a - b).abs().max()) for a, b in zip(_state(full.model).values(),
                                                          _state(resumed.model).values()))
    out = {"step": step, "same": same, "diff": diff, "root": root,
           "history_same": [{**asdict(r), "wall": None} for r in full.history]
           == [{**asdict(r), "wall": None} for r in resumed.history],  # all but the clock
           "bases_at_10": next(r.bases for r in first.history if r.step == 10)}
    dist.barrier()
    if rank == 0 and ddp:  # the other run's directory is resumed elastically by a test in process
        shutil.rmtree(root, ignore_errors=True)
    return out


def _plain_ddp(steps: int) -> dict[str, torch.Tensor]:
    """The same run as plain DDP: no hpx, no hook."""
    world, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    model = _ddp(_Net())
    opt = _optimizer(model)
    for x, y in _batches(steps):
        x, y = x.tensor_split(world)[rank], y.tensor_split(world)[rank]
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        opt.step()
    return _state(model)


class _Overflow(torch.autograd.Function):
    """Identity forward; an inf gradient backward (a GradScaler's overflow)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        return g * math.inf


OVERFLOW_STEPS = (2, 5)  # rank 1's gradient overflows at these steps (0-based) in the scaler scenario


def _scaler_ddp(steps: int = 12) -> dict:
    """DDP with a GradScaler, rank 1's gradient overflowing at two steps: plain DDP, and hpx's
    engine on the same DDP model (its comm hook, no spread, no controller). The overflow must
    reach every rank's scaler through hpx's hook as through DDP's (the step skipped, the scale
    halved), not be left out as a sick rank; every other step is DDP's own."""
    world, rank = dist.get_world_size(), dist.get_rank()
    out = {}
    for who in ("plain", "hpx"):
        torch.manual_seed(0)
        model = _ddp(_Net())
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
        if who == "plain":
            opt = _optimizer(model)
        else:
            engine = hpx.Engine(model, _optimizer, _knobs(0.0), backend=TorchDistributed(), replicas=1,
                                sync_every=4, warmup=4, seed=0, controller=False)
        scales = []
        for t, (x, y) in enumerate(_batches(steps)):
            x, y = x.tensor_split(world)[rank], y.tensor_split(world)[rank]

            def loss(m: nn.Module, x: torch.Tensor = x, y: torch.Tensor = y, t: int = t) -> torch.Tensor:
                out = m(x)
                return F.cross_entropy(_Overflow.apply(out) if rank == 1 and t in OVERFLOW_STEPS else out, y)

            if who == "plain":
                opt.zero_grad(set_to_none=True)
                scaler.scale(loss(model)).backward()
                scaler.step(opt)
                scaler.update()
            else:
                engine.backward(lambda rep, b: loss(rep.model), (x, y), scaler=scaler)
                engine.optimizer_step(scaler=scaler)
            scales.append(float(scaler.get_scale()))
        out[who] = {"state": _state(model), "scales": scales,
                    "nonfinite": [] if who == "plain" else [r.nonfinite for r in engine.history]}
    return out


@contextlib.contextmanager
def _counting(name: str) -> Iterator[list[int]]:
    """Record the numel of every ``torch.distributed.<name>`` call (the real one still runs)."""
    calls: list[int] = []
    real = getattr(dist, name)

    def counting(tensor: torch.Tensor, *args: object, **kwargs: object) -> object:
        calls.append(tensor.numel())
        return real(tensor, *args, **kwargs)

    setattr(dist, name, counting)
    try:
        yield calls
    finally:
        setattr(dist, name, real)


@contextlib.contextmanager
def _captured_log(level: int = logging.WARNING) -> Iterator[list[str]]:
    """Messages of hpx's log records (``level`` and up) while the block runs."""
    messages: list[str] = []
    handler = logging.Handler(level)
    handler.emit = lambda record: messages.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("hpx")
    logger.addHandler(handler)
    try:
        yield messages
    finally:
        logger.removeHandler(handler)


def _sync_calls(backend: TorchDistributed) -> dict:
    """Collective calls made by one sync of an independent-mode engine (no per-step traffic)."""
    torch.manual_seed(0)
    engine = hpx.Engine(_Net(), _optimizer, _knobs(0.3), backend=backend, replicas=1,
                        mode="independent", sync_every=2, seed=0)
    x, y = _batches(1)[0]

    def loss_fn(rep, b):
        return F.cross_entropy(rep.model(b[0]), b[1])

    engine.step(loss_fn, (x, y))
    gather = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"
    with _counting("all_reduce") as reduces, _counting(gather) as gathers:
        engine.step(loss_fn, (x, y))  # the sync
    n_float = sum(t.numel() for t in hpx.averaging.float_state(engine.model))
    return {"reduces": reduces, "gathers": gathers, "n_float": n_float}


def _inconsistent(backend: TorchDistributed) -> str | None:
    """Rank 1's permutation stream leaves step after construction: the debug check must say so."""
    torch.manual_seed(0)
    engine = hpx.Engine(_Net(), _optimizer, _knobs(0.3), backend=backend, replicas=1,
                        sync_every=2, seed=0, check_consistency=True)
    if backend.rank == 1:
        engine.knobs.reseed(12345)
    x, y = _batches(1)[0]
    try:
        for _ in range(2):
            engine.step(lambda rep, b: F.cross_entropy(rep.model(b[0]), b[1]), (x, y))
    except ConsistencyError as exc:
        return str(exc)
    return None


def _disagreements(backend: TorchDistributed) -> dict:
    """Ranks built or resumed differently: every rank raises a ConsistencyError that names
    the disagreement, at once (no hang, no collective paired across steps)."""
    rank, out = backend.rank, {}

    def build(**kw: Any) -> hpx.Engine:
        torch.manual_seed(0)
        knobs = kw.pop("knobs", _knobs(0.3))
        return hpx.Engine(_Net(), _optimizer, knobs, backend=backend, replicas=1, seed=0,
                          **{"sync_every": 2, **kw})

    for case, kw in (("sync_every", {"sync_every": 3} if rank == 1 else {}),
                     ("knobs", {"knobs": _knobs(0.3)[:2]} if rank == 2 else {}),
                     ("mode", {"mode": "independent"} if rank == 3 else {})):
        try:
            build(**kw)
            out[case] = None
        except ConsistencyError as exc:
            out[case] = str(exc)
    x, y = _batches(1)[0]
    step = lambda e: e.step(lambda rep, b: F.cross_entropy(rep.model(b[0]), b[1]), (x, y))  # noqa: E731
    src = build()
    for _ in range(3):
        step(src)
        if src.step_count == 1:
            early = src.state_dict()
    late = src.state_dict()
    resumed = build()
    resumed.load_state_dict(early if rank == 1 else late)  # rank 1 picked another file
    try:
        step(resumed)
        out["step"] = None
    except ConsistencyError as exc:
        out["step"] = str(exc)
    return out


def _uneven_steps(backend: TorchDistributed) -> dict:
    """Shared mode, where every step all-reduces the gradient: one rank runs one step fewer
    (one process per replica: the engine's gradient buckets) or one step more (two replicas per
    process: the one gradient). Every rank raises a ConsistencyError that says so, the ones at a
    training step and the one converging alike; no gloo abort, no hang."""
    rank, out = backend.rank, {}
    x, y = _batches(1)[0]
    for case, replicas, steps in (("fewer", 1, 4 if rank == 1 else 5), ("more", 2, 6 if rank == 1 else 5)):
        torch.manual_seed(0)
        engine = hpx.Engine(_Net(), _optimizer, _knobs(0.3), backend=backend, replicas=replicas,
                            sync_every=3, seed=0)
        done, error = 0, None
        try:
            for _ in range(steps):
                engine.step(lambda rep, b: F.cross_entropy(rep.model(b[0]), b[1]), (x, y))
                done += 1
            engine.converge()
        except ConsistencyError as exc:
            error = str(exc)
        out[case] = {"error": error, "steps": done, "step_count": engine.step_count}
    # rank 1 starts training where the others load a checkpoint (a first run: nothing to load)
    torch.manual_seed(0)
    engine = hpx.Engine(_Net(), _optimizer, _knobs(0.3), backend=backend, replicas=1, sync_every=3, seed=0)
    try:
        if rank == 1:
            engine.step(lambda rep, b: F.cross_entropy(rep.model(b[0]), b[1]), (x, y))
        else:
            hpx.load_checkpoint(Path(tempfile.mkdtemp()) / "run", engine)
        out["no_load"] = None
    except ConsistencyError as exc:
        out["no_load"] = str(exc)
    return out


def _seeds(backend: TorchDistributed) -> dict:
    """Ranks given different seeds still draw rank 0's permutations."""
    engine = hpx.Engine(_Net(), _optimizer, _knobs(0.3), backend=backend, replicas=1,
                        seed=100 + backend.rank)
    return {"slots": engine._slots.clone(), "seed": engine.knobs.seed}


def _hook_grads(rank: int, world: int) -> dict:
    """finite_mean_hook's gradients, with and without a NaN on rank 1, on both of its paths."""
    x, y = _batches(1)[0]
    x, y = x.tensor_split(world)[rank], y.tensor_split(world)[rank]
    torch.manual_seed(0)
    plain = _Net(batchnorm=False)
    F.cross_entropy(plain(x), y).backward()
    out: dict = {"own": [p.grad.clone() for p in plain.parameters()]}
    for read_host in (None, False):  # host verdict on CPU, and the accelerator path
        for nan in (False, True):
            torch.manual_seed(0)
            model = DDP(_Net(batchnorm=False), bucket_cap_mb=1e-4)  # one bucket per tensor group
            state = _HookState(None, world, read_host)
            calls = []

            def counting(state, bucket, calls=calls):
                calls.append(bucket.index())
                return finite_mean_hook(state, bucket)

            counting.__annotations__ = finite_mean_hook.__annotations__
            model.register_comm_hook(state, counting)
            F.cross_entropy(model(x), y).backward()  # DDP forms its real buckets after step 1
            model.zero_grad()
            calls.clear()
            loss = F.cross_entropy(model(x), y)
            if nan and rank == 1:
                loss = loss * math.nan
            loss.backward()
            out[(read_host, nan)] = [p.grad.clone() for p in model.parameters()]
            out["buckets"] = calls
    # Three ranks of four: 1/3 is inexact, so this checks the hook scales as DDP does.
    sub = dist.new_group([0, 1, 2])
    if rank < 3:
        grads = []
        for hook in (False, True):
            torch.manual_seed(0)
            model = DDP(_Net(batchnorm=False), process_group=sub)
            if hook:
                model.register_comm_hook(_HookState(sub, 3), finite_mean_hook)
            for _ in range(2):
                model.zero_grad()
                F.cross_entropy(model(x), y).backward()
            grads.append([p.grad.clone() for p in model.parameters()])
        out["three_ranks_equal"] = all(torch.equal(a, b) for a, b in zip(*grads))
        dist.destroy_process_group(sub)
    return out


def _world4(rank: int, world_size: int) -> dict:
    backend = TorchDistributed()
    out: dict = {"rank": rank}
    out["hook"] = _hook_grads(rank, world_size)
    out["ddp"] = _train(backend, ddp=True, check_consistency=True)
    out["grads"] = _train(backend)  # shared mode without DDP: the engine's gradient buckets
    out["independent"] = _train(backend, mode="independent")
    out["nan"] = _train(backend, ddp=True, nan_step=NAN_STEP)
    with _captured_log() as warnings:
        try:
            _train(backend, ddp=True, nan_step=NAN_STEP % T, own_hook=True, steps=T)
            error = None
        except NonFiniteError as exc:
            error = str(exc)
    out["nan_own_hook"] = (error, warnings)
    out["alpha0_fixed"] = _train(backend, ddp=True, spread=0.0, controller=False)
    out["alpha0"] = _train(backend, ddp=True, spread=0.0)
    out["plain_ddp"] = _plain_ddp(STEPS)
    out["scaler_ddp"] = _scaler_ddp()
    out["autolr"] = _train_autolr(backend)
    out["autolr_saved"] = _autolr_saved(backend)
    out["checkpoint"] = _checkpoint_resume(backend)
    out["accumulate_ddp"] = _train(backend, ddp=True, accumulate=True)
    out["accumulate"] = _train(backend, accumulate=True)
    out["checkpoint_ddp"] = _checkpoint_resume(backend, ddp=True)
    out["sync_calls"] = _sync_calls(backend)
    out["inconsistent"] = _inconsistent(backend)
    out["disagree"] = _disagreements(backend)
    out["uneven"] = _uneven_steps(backend)
    out["seeds"] = _seeds(backend)
    logger, was = logging.getLogger("hpx"), logging.getLogger("hpx").level
    logger.setLevel(logging.INFO)
    with _captured_log(logging.INFO) as lines:
        _train_autolr(backend)
    logger.setLevel(was)
    out["sync_lines"] = len([m for m in lines if m.startswith("sync at step")])
    model = DDP(_Net())
    hpx.Engine(model, _optimizer, _knobs(0.3), backend=backend, replicas=1)
    out["engine_prepared"] = bool(getattr(model, "_hpx_finite_mean", False))
    return out


# --- fixtures: one launch, and the in-process references --------------------------------


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return run_distributed(_world4, WORLD, timeout=150.0)


@pytest.fixture(scope="module")
def local() -> dict[str, dict]:
    backend = InProcess()
    return {
        "shared": _train(backend),
        "independent": _train(backend, mode="independent"),
        "nan": _train(backend, nan_step=NAN_STEP),
        "autolr": _train_autolr(backend, ddp=False),
        "accumulate": _train(backend, accumulate=True),
    }


def _assert_histories_match(dist_hist: list[dict], local_hist: list[dict]) -> None:
    assert len(dist_hist) == len(local_hist) == STEPS // T
    for d, l in zip(dist_hist, local_hist):
        assert d["step"] == l["step"]
        assert d["nonfinite"] == l["nonfinite"]
        for name, base in l["bases"].items():
            assert d["bases"][name] == pytest.approx(base, rel=1e-5), (d["step"], name)
        for name, values in l["values"].items():
            assert d["values"][name] == pytest.approx(values, rel=1e-5), (d["step"], name)
        assert d["scores"] == pytest.approx(l["scores"], rel=1e-4, nan_ok=True), d["step"]


def _assert_states_close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], what: str) -> None:
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-5, msg=lambda m, k=k: f"{what} {k}: {m}")


def _assert_identical(states: list[dict[str, torch.Tensor]], what: str) -> None:
    for i, s in enumerate(states[1:], start=1):
        for k in s:
            assert torch.equal(s[k], states[0][k]), f"{what}: rank {i} differs from rank 0 in {k}"


# --- the DDP hook -----------------------------------------------------------------------


@pytest.mark.parametrize("path", [None, False], ids=["host-verdict", "device-verdict"])
def test_finite_mean_hook_averages_over_the_finite_ranks(ranks, path):
    assert ranks[0]["hook"]["buckets"] == [0, 1, 2]
    own = [obs["hook"]["own"] for obs in ranks]
    for obs in ranks:
        plain, with_nan = obs["hook"][(path, False)], obs["hook"][(path, True)]
        for i, (g, g_nan) in enumerate(zip(plain, with_nan)):
            everyone = sum(o[i] for o in own) / WORLD
            all_but_1 = sum(o[i] for r, o in enumerate(own) if r != 1) / (WORLD - 1)
            torch.testing.assert_close(g, everyone)
            torch.testing.assert_close(g_nan, all_but_1)
        # the two paths agree bit for bit
        for g, h in zip(with_nan, obs["hook"][(None, True)]):
            assert torch.equal(g, h)


def test_finite_mean_hook_equals_ddps_own_reduction_bit_for_bit_on_three_ranks(ranks):
    assert [obs["hook"].get("three_ranks_equal") for obs in ranks] == [True, True, True, None]


# --- the distributed engine equals the in-process one ------------------------------------


@pytest.mark.parametrize(("scenario", "reference"), [("ddp", "shared"), ("grads", "shared"),
                                                     ("independent", "independent")])
def test_knob_trajectories_match_in_process(ranks, local, scenario, reference):
    expected = local[reference]["history"]
    assert any(r["direction"] for r in expected), "the controller never ran: the test would be vacuous"
    for obs in ranks:
        _assert_histories_match(obs[scenario]["history"], expected)


@pytest.mark.parametrize(("scenario", "reference"), [("ddp", "shared"), ("grads", "shared"),
                                                     ("independent", "independent")])
def test_final_parameters_match_in_process(ranks, local, scenario, reference):
    expected = local[reference]["states"]
    for obs in ranks:
        (state,) = obs[scenario]["states"]
        _assert_states_close(state, expected[obs["rank"]], f"{scenario} rank {obs['rank']}")


@pytest.mark.parametrize("scenario", ["ddp", "grads", "independent", "nan", "alpha0"])
def test_all_ranks_hold_identical_parameters_and_buffers_after_a_sync(ranks, scenario):
    states = [obs[scenario]["states"][0] for obs in ranks]
    assert any("running_mean" in k for k in states[0]), "the model should have buffers to check"
    _assert_identical(states, scenario)


def test_a_nan_rank_is_outvoted_and_reset_as_in_process(ranks, local):
    expected = local["nan"]["history"]
    sync = NAN_STEP // T  # the sync that ends the interval with the NaN
    assert expected[sync]["nonfinite"] == [1]
    assert all(not r["nonfinite"] for i, r in enumerate(expected) if i != sync)
    for obs in ranks:
        _assert_histories_match(obs["nan"]["history"], expected)
        (state,) = obs["nan"]["states"]
        assert all(torch.isfinite(v).all() for v in state.values() if v.is_floating_point())
        _assert_states_close(state, local["nan"]["states"][obs["rank"]], f"nan rank {obs['rank']}")


def test_a_users_own_ddp_hook_is_kept_with_a_warning_and_nan_then_reaches_all(ranks):
    for obs in ranks:
        error, warnings = obs["nan_own_hook"]
        assert any("already has a communication hook" in w for w in warnings), warnings
        assert error is not None, f"rank {obs['rank']} did not raise"
        assert f"all {WORLD} replicas are non-finite" in error


# --- alpha = 0 is plain DDP ----------------------------------------------------------------


# Parameters only: hpx also averages BatchNorm statistics at syncs, which plain DDP
# (broadcast_buffers=False) leaves to each rank.
_PARAMS = {k for k, _ in _Net().named_parameters()}


def test_alpha_zero_with_ddp_equals_plain_ddp_bit_for_bit(ranks):
    for obs in ranks:
        (state,) = obs["alpha0_fixed"]["states"]
        for k in _PARAMS:
            assert torch.equal(state[k], obs["plain_ddp"][k]), f"rank {obs['rank']}: {k} differs"


def test_ddp_with_a_grad_scaler_lets_overflows_reach_the_scaler_as_plain_ddp_does(ranks):
    for obs in ranks:
        plain, ours = obs["scaler_ddp"]["plain"], obs["scaler_ddp"]["hpx"]
        halved = [i for i in range(1, len(plain["scales"])) if plain["scales"][i] < plain["scales"][i - 1]]
        assert plain["scales"][0] == 2.0 ** 10 and halved == list(OVERFLOW_STEPS)  # each overflow seen
        assert ours["scales"] == plain["scales"]
        assert all(not n for n in ours["nonfinite"])  # an overflow is not a sick rank
        for k in _PARAMS:
            assert torch.equal(ours["state"][k], plain["state"][k]), f"rank {obs['rank']}: {k} differs"


def test_alpha_zero_with_the_controller_on_stays_plain_ddp(ranks):
    for obs in ranks:
        bases = [r["bases"] for r in obs["alpha0"]["history"]]
        assert all(b == pytest.approx(bases[0], rel=1e-12) for b in bases)
        (state,) = obs["alpha0"]["states"]
        _assert_states_close({k: state[k] for k in _PARAMS},
                             {k: obs["plain_ddp"][k] for k in _PARAMS}, f"alpha0 rank {obs['rank']}")


# --- communication, consistency, rank agreement ---------------------------------------------


def test_a_sync_is_one_gather_and_one_flat_all_reduce(ranks):
    for obs in ranks:
        calls = obs["sync_calls"]
        assert len(calls["gathers"]) == 1  # [scores, health] of every replica at once
        assert calls["reduces"] == [calls["n_float"]]  # params + float buffers, one bucket


def test_consistency_check_names_the_disagreeing_rank_on_every_rank(ranks):
    for obs in ranks:
        message = obs["inconsistent"]
        assert message is not None, f"rank {obs['rank']} did not raise"
        assert "knob bases and permutations after the sync at step 2" in message
        assert "ranks [1] disagree with rank 0" in message


def test_ranks_with_different_seeds_draw_rank_0s_permutations(ranks):
    expected = hpx.Knobs(*_knobs(0.3), seed=100).draw_slots(WORLD)
    for obs in ranks:
        assert obs["seeds"]["seed"] == 100
        assert torch.equal(obs["seeds"]["slots"], expected)


def test_engine_installs_the_finite_mean_hook_on_a_ddp_model(ranks):
    assert all(obs["engine_prepared"] for obs in ranks)


# --- one rank: plain training; no process group: a clear error --------------------------------


@pytest.fixture
def one_rank_group() -> Iterator[None]:
    assert not dist.is_initialized(), "a test left a default process group behind"
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                            world_size=1, timeout=datetime.timedelta(seconds=60))
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("ddp", [False, True], ids=["bare", "ddp"])
def test_world_size_one_is_plain_training(one_rank_group, ddp):
    steps = 2 * T
    backend = TorchDistributed()
    got = _train(backend, ddp=ddp, steps=steps)
    assert [len(v) for v in got["history"][-1]["values"].values()] == [1, 1, 1]
    torch.manual_seed(0)
    model = _Net()
    opt = _optimizer(model)
    for x, y in _batches(steps):
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    (state,) = got["states"]
    for k, v in _state(model).items():
        assert torch.equal(state[k], v), k


def test_world_size_one_defaults_to_one_replica(one_rank_group):
    engine = hpx.Engine(DDP(_Net()), _optimizer, _knobs(0.3), backend=TorchDistributed())
    assert engine.n_replicas == 1


def test_without_a_process_group_the_error_says_how_to_launch():
    assert not dist.is_initialized()
    with pytest.raises(BackendError, match=r"torchrun --nproc_per_node=4 .*init_process_group"):
        hpx.Engine(_Net(), _optimizer, _knobs(0.3), backend=hpx.backends.TorchDistributed())


def test_ranks_built_or_resumed_differently_fail_at_once_naming_why(ranks):
    for r in ranks:
        d = r["disagree"]
        assert "sync_every: rank 0 has 2, rank 1 has 3" in d["sync_every"]
        assert "knobs: rank(s) [2] differ from rank 0" in d["knobs"]
        assert "mode: rank(s) [3] differ" in d["mode"] and "building the engine" in d["mode"]
        assert "step: rank 0 has 3, rank 1 has 1" in d["step"] and "resuming" in d["step"]


def test_a_run_of_4_processes_resumes_elastically_in_one(ranks):
    """The 4-rank run's checkpoints (rank 1 lost its newest) resume in one process with 3
    replicas: the step all ranks saved, its bases, and the mean of the 4 ranks' weights."""
    import shutil

    root = Path(ranks[0]["checkpoint"]["root"])
    try:
        torch.manual_seed(0)
        engine = hpx.Engine(_Net(), _optimizer, _knobs(0.3), replicas=3, sync_every=T, seed=0)
        assert hpx.load_checkpoint(root, engine, elastic=True) == 10
        assert engine.bases == ranks[0]["checkpoint"]["bases_at_10"]
        saved = [torch.load(root / "step-000000010" / f"rank-{r:05d}.pt", weights_only=False)
                 for r in range(WORLD)]
        w = torch.stack([s["engine"]["replicas"][0]["model"]["head.weight"] for s in saved]).mean(0)
        for rep in engine.replicas:
            torch.testing.assert_close(rep.model.head.weight.detach(), w)
        x, y = _batches(1)[0]
        for _ in range(T):
            engine.step(lambda rep, b: F.cross_entropy(rep.model(b[0]), b[1]), (x, y))
        assert engine.history[-1].step == 20 and len(engine.history[-1].values["lr/body"]) == 3
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.mark.parametrize("m", [1, 2])
def test_autolr_of_4_processes_resumes_elastically_in_one(ranks, m):
    """autolr saved by 4 DDP ranks inside its search window resumes in one process with 1 or 2
    replicas and trains to the end (it used to stop at the first sync: "land=1.0 at a sync that
    scored no placed points")."""
    root = Path(ranks[0]["autolr_saved"]["root"])
    torch.manual_seed(0)
    engine = hpx.autolr(_Net(), _optimizer, total_steps=STEPS, probe=_batches(1, seed=7), replicas=m, seed=0)
    assert hpx.load_checkpoint(root, engine, elastic=True) == 10
    assert engine.bases == ranks[0]["autolr_saved"]["bases"]
    for x, y in _batches(STEPS)[10:]:
        engine.step(lambda rep, b: F.cross_entropy(rep.model(b[0]), b[1]), (x, y))
    assert engine.step_count == STEPS and [r.step for r in engine.history if r.step > 10]
    assert all(torch.isfinite(p).all() for p in engine.converge().parameters())
    placed = [r for r in engine.history if r.step > 11 and r.points is not None]
    assert placed and all(len(r.points) == 4 for r in placed)  # the search went on, with the new count


@pytest.mark.parametrize("scenario", ["accumulate", "accumulate_ddp"])
def test_accumulation_and_clipping_match_in_process(ranks, local, scenario):
    """Two micro-batches per step and a clipped optimizer step: over DDP (which reduces in
    backward) and over hpx's own gradient mean, the same run as 4 replicas in one process."""
    ref = local["accumulate"]
    for rank, r in enumerate(ranks):
        _assert_histories_match(r[scenario]["history"], ref["history"])
        _assert_states_close(r[scenario]["states"][0], ref["states"][rank], scenario)


def test_checkpoint_resume_agrees_on_the_newest_common_step(ranks):
    """4 gloo ranks; rank 1 lost its newest checkpoint (killed while saving): every rank
    resumes from the step all of them have, and the run ends bit for bit as one that never
    stopped."""
    assert [r["checkpoint"]["step"] for r in ranks] == [10] * WORLD
    assert all(r["checkpoint"]["same"] and r["checkpoint"]["history_same"] for r in ranks)
    # Over DDP the first step after the resume runs with DDP's initial bucket layout (it
    # rebuilds its buckets after its own first step), so with more than 2 ranks its gradient
    # sums may differ from the uninterrupted run's in the last bit: equal to float tolerance.
    assert [r["checkpoint_ddp"]["step"] for r in ranks] == [10] * WORLD
    assert all(r["checkpoint_ddp"]["diff"] < 1e-5 for r in ranks)


def test_autolr_over_ddp_matches_in_process(ranks, local):
    """The recommended setup under torchrun: the same decisions, values and weights, with each
    rank's replica placed on the run's displacement at the window's syncs."""
    ref = local["autolr"]["history"]
    phases = [r["phase"] for r in ref]
    assert "stretch" in phases and phases[-1] == "hold"  # the window ran to its end
    assert any(r["bases"]["lr"] != 1.0 for r in ref)  # the search moved the base
    for r in ranks:
        hist = r["autolr"]["history"]
        assert [h["step"] for h in hist] == [h["step"] for h in ref]
        assert [h["phase"] for h in hist] == phases
        for d, l in zip(hist, ref):
            assert d["bases"]["lr"] == pytest.approx(l["bases"]["lr"], rel=1e-5), d["step"]
            assert d["values"]["lr"] == pytest.approx(l["values"]["lr"], rel=1e-5), d["step"]
        _assert_states_close(r["autolr"]["states"][0], local["autolr"]["states"][0], "autolr")


def test_ranks_that_ran_different_numbers_of_steps_fail_clearly_in_shared_mode(ranks):
    """One rank one step short (or one step long): the step that meets the other's converge
    fails on the ranks that took it, and converge fails on the other, each with the fix named.
    Before the marker all-reduce this aborted in gloo (a size mismatch) or hung."""
    for case in ("fewer", "more"):
        for r, out in enumerate(ranks):
            got = out["uneven"][case]
            assert got["error"] is not None, (case, r, got)
            assert "different numbers of optimizer steps" in got["error"], got["error"]
            assert "drop_last=True" in got["error"]
        odd = ranks[1]["uneven"][case]
        rest = [ranks[r]["uneven"][case] for r in (0, 2, 3)]
        if case == "fewer":  # rank 1 converges after 4 steps; the others' 5th step meets it
            assert odd["steps"] == 4 and "converging at the end of training at step 4" in odd["error"]
            assert all(o["steps"] == 4 and "met another rank's sync" in o["error"] for o in rest)
        else:  # rank 1's 6th step meets the others' converge after 5
            assert odd["steps"] == 5 and "met another rank's sync" in odd["error"]
            assert all(o["steps"] == 5 and "converging at the end of training at step 5" in o["error"]
                       for o in rest)


def test_a_rank_that_trains_while_the_others_load_a_checkpoint_fails_clearly(ranks):
    """Every rank must call load_checkpoint: one that starts training instead meets the others'
    load, and every rank says so (before: a gloo abort on a size mismatch)."""
    assert "met another rank's sync, converge() or load_checkpoint" in ranks[1]["uneven"]["no_load"]
    for r in (0, 2, 3):
        got = ranks[r]["uneven"]["no_load"]
        assert "loading a checkpoint at step 0, another rank was at a training step" in got


def test_the_sync_log_line_is_written_once_not_once_per_rank(ranks):
    """One INFO line per sync from rank 0 (every rank wrote it: four copies under torchrun)."""
    assert ranks[0]["sync_lines"] == len(ranks[0]["autolr"]["history"]) > 0
    assert all(r["sync_lines"] == 0 for r in ranks[1:])
