"""Sharded forks (``shard=``, FSDP2) on 2 and 3 real gloo processes whose ranks fall out of step: a
rank one step short or one step long, a skipped batch, a rank that stops early and calls
``converge()``, saves at different steps, a load on one rank only. Each used to end in gloo (the
short rank aborted with SIGABRT, the other got "Connection reset by peer"); now every rank raises
hpx's ``ConsistencyError`` within seconds, naming each rank's point and step, before any of FSDP's
collectives pair with something else."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hpx
from hpx.errors import ConsistencyError
from tests._dist import run_distributed

STEPS = 12
_CASES = ("fewer", "skip", "extra", "stops", "saves", "load")


def _data(rank: int) -> tuple[list, list]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(320, 8, generator=g)
    y = torch.tanh(x @ torch.randn(8, 1, generator=g)).squeeze(-1)
    batches = [(x[16 * i + 4 * rank:16 * i + 4 * rank + 4], y[16 * i + 4 * rank:16 * i + 4 * rank + 4])
               for i in range(STEPS + 2)]
    return batches, [(x[256:], y[256:])]


def _loss(rep, b):
    return F.mse_loss(rep.model(b[0]).squeeze(-1), b[1])


def _probe_loss(rep, b):
    return F.mse_loss(rep.model(b[0]).squeeze(-1), b[1], reduction="none")


def _build(mesh, rank: int):
    from torch.distributed.fsdp import fully_shard

    def shard(m):
        fully_shard(m[2], mesh=mesh)  # a block first, then the whole, as FSDP2 training does
        fully_shard(m, mesh=mesh)

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=3e-3, total_steps=STEPS)
    return hpx.Forks(model, opt, total_steps=STEPS, schedule=sched, probe=_data(rank)[1], loss_fn=_probe_loss,
                     confidence=0, backend=hpx.backends.TorchDistributed(), shard=shard)


def _out_of_step(rank: int, world: int, folder: str) -> dict:
    """An even run first (saving step 4 for the load case, and its decisions to compare), then each
    case in turn, the last rank (or rank 0 for saves and the load) out of step."""
    import time
    from pathlib import Path

    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    batches = _data(rank)[0]
    last = rank == world - 1
    forks = _build(mesh, rank)
    for i in range(STEPS):
        forks.step(_loss, batches[i])
        if forks.step_count == 4:
            hpx.save_checkpoint(Path(folder) / "even", forks)
    forks.converge()
    from hpx.forks.ranks import _host_marker

    out: dict = {"even": [(r.step, tuple(r.values["lr"])) for r in forks.history],
                 "host": _host_marker(forks.collective)}
    for how in _CASES:
        forks = _build(mesh, rank)
        steps = STEPS + (-1 if how == "fewer" and last else 1 if how == "extra" and last else 0)
        t0 = time.monotonic()
        try:
            if how == "load" and rank == 0:  # the others' loops forgot the load
                hpx.load_checkpoint(Path(folder) / "even", forks)
            for i in range(forks.step_count, steps):
                if last and ((how == "skip" and i == 7) or (how == "stops" and i >= 6)):
                    continue
                forks.step(_loss, batches[i])
                if how == "saves" and forks.step_count == (4 if rank == 0 else 5):
                    hpx.save_checkpoint(Path(folder) / "saves", forks)
            forks.converge()
            out[how] = ("ok", time.monotonic() - t0)
        except ConsistencyError as e:
            out[how] = (str(e), time.monotonic() - t0)
    out["saved"] = sorted(str(p.relative_to(folder)) for p in (Path(folder) / "saves").glob("step-*/*"))
    return out


@pytest.fixture(scope="module", params=[2, 3])
def ranks(request, tmp_path_factory):
    world = request.param
    folder = str(tmp_path_factory.mktemp(f"steps{world}"))
    return world, run_distributed(_out_of_step, world, folder, timeout=300)


def test_an_even_sharded_run_is_not_refused_and_decides(ranks):
    _, out = ranks
    assert all(r["host"] for r in out)  # gloo takes CPU tensors: each marker read at once
    assert all(r["even"] == out[0]["even"] for r in out)
    assert [s for s, _ in out[0]["even"]][-1] == STEPS  # decided at the end: the marker let it through


@pytest.mark.parametrize("how", _CASES)
def test_a_sharded_rank_out_of_step_raises_on_every_rank_naming_ranks_and_steps(ranks, how):
    world, out = ranks
    for r in out:
        msg, seconds = r[how]
        assert "the ranks were at different points" in msg, (how, msg)
        assert "ran different numbers of optimizer steps" in msg, (how, msg)
        assert all(f"rank {k} " in msg for k in range(world)), msg
        assert seconds < 30, (how, seconds)  # a hang waited for the process group's timeout
    said = out[0][how][0]
    odd = world - 1
    expected = {  # what the odd rank was doing when the others were at their next point
        "fewer": f"rank {odd} in converge() at step {STEPS - 1}",
        "skip": f"rank {odd} in converge() at step {STEPS - 1}",
        "extra": f"rank {odd} starting step {STEPS + 1}",
        "stops": f"rank {odd} in converge() at step 6",
        "saves": "rank 0 saving step 4",
        "load": "rank 0 loading a checkpoint at step 0",
    }[how]
    assert expected in said, said


def test_saves_at_different_steps_under_shard_leave_nothing_saved(ranks):
    _, out = ranks
    assert all(r["saved"] == [] for r in out)


def test_a_device_marker_keeps_the_first_mismatch_for_the_next_decision():
    """Under NCCL alone a step's table stays on the device (no host read per step): the flag of any
    mismatch so far and the first mismatched table are kept, and read at the next decision."""
    from hpx.forks.ranks import held_marker, marker_problem

    even, odd = torch.tensor([[0, 3], [0, 3]]), torch.tensor([[0, 4], [2, 4]])
    held = held_marker(held_marker(held_marker(None, even), odd), torch.tensor([[0, 5], [0, 5]]))
    assert bool(held[0]) and torch.equal(held[1], odd)
    assert not bool(held_marker(held_marker(None, even), even)[0])
    assert marker_problem(even, "x") is None
    said = marker_problem(held[1], "deciding at step 6")
    assert said is not None and "rank 0 starting step 5; rank 1 in converge() at step 4" in said


def _leaves(rank: int, world: int) -> str:
    """The last rank returns after 6 steps (its loop ended early, no converge()): its process ends."""
    from torch.distributed.device_mesh import init_device_mesh

    forks = _build(init_device_mesh("cpu", (world,)), rank)
    batches = _data(rank)[0]
    try:
        for i in range(STEPS):
            if rank == world - 1 and i == 6:
                return "left"
            forks.step(_loss, batches[i])
        forks.converge()
        return "ok"
    except ConsistencyError as e:
        return str(e)


def test_a_rank_whose_process_ended_is_named_by_the_next_marker_not_a_bare_gloo_error():
    out = run_distributed(_leaves, 2, timeout=120)
    assert out[1] == "left"
    said = "starting step 7, the ranks' step marker could not be exchanged: another rank has left the run"
    assert out[0].startswith(said), out[0]
    assert "Connection closed by peer" in out[0] or "Connection reset" in out[0], out[0]
