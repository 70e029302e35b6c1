"""hpx.Forks' fault audit on 2 gloo ranks (AdamW and OneCycleLR, 40 steps, each rank its half of every
batch): ranks that trained apart for one step, the lr doubled on one rank by ``forks.each`` and
rewritten by the schedule at the next step, are caught at the next decision, naming the step and the
forks; a NaN in one rank's batch is an error naming the step it appeared at and the rank, as in one
process (with ``shard=`` too)."""

from __future__ import annotations

import math
import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hpx
from hpx.errors import ConsistencyError, NonFiniteError
from tests._dist import run_distributed

STEPS = 40


def _data() -> tuple[list[tuple[torch.Tensor, torch.Tensor]], list[tuple[torch.Tensor, torch.Tensor]]]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(704, 8, generator=g)
    y = torch.tanh(x @ torch.randn(8, 1, generator=g)).squeeze(-1) + 0.1 * torch.randn(704, generator=g)
    return [(x[16 * i:16 * i + 16], y[16 * i:16 * i + 16]) for i in range(STEPS)], [(x[640:], y[640:])]


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 24), nn.Tanh(), nn.Linear(24, 1))


def _loss(rep, b):
    return F.mse_loss(rep.model(b[0]).squeeze(-1), b[1])


def _build(world: int, sharded: bool = False, backend: bool = True):
    shard = None
    if sharded:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))

        def shard(m):
            fully_shard(m, mesh=mesh)

    model = _net()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-2)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=3e-2, total_steps=STEPS)
    return hpx.Forks(model, opt, total_steps=STEPS, schedule=sched, probe=_data()[1],
                     backend=hpx.backends.TorchDistributed() if backend else None, shard=shard)


def _double_lr(rep) -> None:
    for g in rep.optimizer.param_groups:
        g["lr"] *= 2


def _nudge(rep) -> None:
    with torch.no_grad():
        rep.model[0].weight[0, 0] += 1e-4


def _train(forks, rank: int, world: int, how: str) -> dict:
    """``how``: "alike"; "each" (rank 1 doubles every fork's lr before step 8, which OneCycleLR rewrites
    at step 9's); "weights" (rank 1 moves a weight of every fork before step 8); "nan" (a NaN in rank
    1's half of step 9's batch)."""
    batches = _data()[0]
    t0 = time.monotonic()
    try:
        for i, (x, y) in enumerate(batches):
            part = slice(rank * 16 // world, (rank + 1) * 16 // world)
            x = x[part].clone()
            if rank == 1 and how in ("each", "weights") and i == 7:
                forks.each(_double_lr if how == "each" else _nudge)
            if rank == 1 and how == "nan" and i == 8:
                x[0, 3] = math.nan
            forks.step(_loss, (x, y[part]))
        forks.converge()
        out = "ok"
    except (ConsistencyError, NonFiniteError) as e:
        out = f"{type(e).__name__}: {e}"
    return {"out": out, "step": forks.step_count, "seconds": time.monotonic() - t0,
            "history": [(r.step, r.phase, tuple(r.values["lr"]), r.bases["lr"]) for r in forks.history],
            "params": [p.detach().clone() for p in forks.model.parameters()]}


def _scenarios(rank: int, world: int) -> dict:
    """Each case in turn in one launch (starting the processes costs more than a case)."""
    return {how: _train(_build(world), rank, world, how) for how in ("alike", "each", "weights", "nan")}


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return run_distributed(_scenarios, 2, timeout=240)


@pytest.mark.procs
def test_ranks_that_train_alike_decide_alike_with_equal_weights_and_no_error(ranks):
    """The check compares the weights exactly: ranks that train alike hold bit-identical forks (each
    fork's gradients are all-reduced, every optimizer step is the same on every rank)."""
    a, b = (r["alike"] for r in ranks)
    assert a["out"] == b["out"] == "ok" and a["step"] == STEPS
    assert a["history"] == b["history"] and len(a["history"]) == 3
    assert all(torch.equal(p, q) for p, q in zip(a["params"], b["params"]))


@pytest.mark.procs
def test_an_lr_doubled_on_one_rank_that_the_schedule_rewrote_is_caught_at_the_next_decision(ranks):
    """Rank 1 doubles its lr through forks.each before step 8; OneCycleLR writes the lr anew after
    that step, so the settings agree again at the next decision (step 12), where they used to pass:
    the ranks ended with weights 0.02 apart. Now every rank raises there, naming rank 1, step 8 and
    the forks whose weights differ."""
    for r in ranks:
        msg, step, seconds = r["each"]["out"], r["each"]["step"], r["each"]["seconds"]
        assert msg.startswith("ConsistencyError: deciding at step 12,"), msg
        assert step == 12 and seconds < 60
        assert "ranks [1] trained apart from rank 0" in msg
        assert "first differed at step 8" in msg
        assert "the weights of your run" in msg and "differ" in msg
        assert "forks.each" in msg  # the fix


@pytest.mark.procs
def test_a_weight_changed_on_one_rank_alone_is_caught_at_the_next_decision_naming_the_forks(ranks):
    for r in ranks:
        msg = r["weights"]["out"]
        assert msg.startswith("ConsistencyError: deciding at step 12, ranks [1] trained apart from rank 0: "
                              "the weights of your run, the fork at 3.16x, the fork at 10x"), msg
        assert "differ while every step applied the same settings" in msg and "first differed" not in msg


@pytest.mark.procs
def test_a_nan_in_one_ranks_batch_names_the_step_it_appeared_at_and_the_rank(ranks):
    """It was named at the decision that found it, 'at step 12', with no rank."""
    for r in ranks:
        msg = r["nan"]["out"]
        assert msg.startswith("NonFiniteError: at step 12 every fork's"), msg
        assert "first went non-finite at step 9 on rank 1" in msg, msg


def test_a_nan_in_the_batch_names_its_step_in_one_process():
    forks = _build(1, backend=False)
    batches = _data()[0]
    with pytest.raises(NonFiniteError, match=r"at step 9 every fork's loss was non-finite"):
        for i, (x, y) in enumerate(batches):
            x = x.clone()
            if i == 8:
                x[0, 3] = math.nan
            forks.step(_loss, (x, y))
    assert forks.step_count == 9


def _sharded(rank: int, world: int) -> dict:
    return {how: _train(_build(world, sharded=True), rank, world, how) for how in ("alike", "each", "nan")}


@pytest.mark.procs
def test_sharded_forks_name_an_lr_set_apart_and_a_nan_with_its_step_and_rank():
    """Each rank holds another shard of every fork, so no weights are compared; what each step applied
    is, and it finds the step. A NaN was named at the decision, 'at step 12', with no rank."""
    for r in run_distributed(_sharded, 2, timeout=240):
        assert r["alike"]["out"] == "ok" and len(r["alike"]["history"]) == 3
        msg = r["each"]["out"]
        assert msg.startswith("ConsistencyError: deciding at step 12, ranks [1] trained apart from rank 0: "
                              "the settings a step applied"), msg
        assert "first differed at step 8" in msg and "the weights of" not in msg
        msg = r["nan"]["out"]
        assert msg.startswith("NonFiniteError: at step 12 every fork's"), msg
        assert "first went non-finite at step 9 on rank 1" in msg, msg


class _Held:
    def __init__(self, model: nn.Module) -> None:
        self.model = model


def test_the_weights_digest_changes_with_one_bit_a_swap_or_a_nan_and_not_otherwise():
    from hpx.forks.ranks import weights_digest

    def digest(change=None):
        model = _net()
        if change is not None:
            with torch.no_grad():
                change(model[0].weight)
        return weights_digest([_Held(model)])[0]

    def next_up(w):
        w[1, 2] = torch.nextafter(w[1, 2], torch.tensor(math.inf))

    def swap(w):
        w[0, 0], w[0, 1] = w[0, 1].clone(), w[0, 0].clone()

    same = digest()
    assert torch.equal(same, digest()) and int(same[2]) == 0
    assert abs(int(digest(next_up)[0]) - int(same[0])) == 1  # one float one step to the next: its bits by 1
    swapped = digest(swap)
    assert swapped[0] == same[0] and swapped[1] != same[1]  # the plain sum misses a swap: the weighted not
    assert int(digest(lambda w: w.__setitem__((0, 0), math.nan))[2]) == 1
