"""hpx.Forks with each fork sharded over the ranks by FSDP2 (``shard=``), on 4 real gloo processes:
the same decisions and the same weights (to rounding) as forks held whole on every rank, a fork's
memory per rank a quarter of it, a resume bit for bit, and a checkpoint of the other layout
refused by name."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hpx
from tests._dist import run_distributed

WORLD = 4
STEPS = 30


def _data() -> tuple[list[tuple[torch.Tensor, torch.Tensor]], list[tuple[torch.Tensor, torch.Tensor]]]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(512, 8, generator=g)
    y = torch.tanh(x @ torch.randn(8, 1, generator=g)).squeeze(-1) + 0.1 * torch.randn(512, generator=g)
    batches = [(x[16 * i:16 * i + 16], y[16 * i:16 * i + 16]) for i in range(STEPS)]
    return batches, [(x[448:], y[448:])]


def _net() -> nn.Module:
    torch.manual_seed(0)
    # no bias before the BatchNorm: its gradient is rounding noise, which Adam would blow up to the lr
    return nn.Sequential(nn.Linear(8, 30), nn.Tanh(), nn.Linear(30, 30, bias=False), nn.BatchNorm1d(30),
                         nn.Tanh(), nn.Linear(30, 1))


def _loss(rep, b):
    return F.mse_loss(rep.model(b[0]).squeeze(-1), b[1])


def _probe_loss(rep, b):
    return F.mse_loss(rep.model(b[0]).squeeze(-1), b[1], reduction="none")


def _build(sharded: bool):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    def shard(m):
        fully_shard(m[2], mesh=mesh)  # a block first, then the whole, as FSDP2 training does
        fully_shard(m, mesh=mesh)

    mesh = init_device_mesh("cpu", (WORLD,)) if sharded else None
    model = _net()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=3e-3, total_steps=STEPS)
    forks = hpx.Forks(model, opt, total_steps=STEPS, schedule=sched, probe=_data()[1], loss_fn=_probe_loss,
                      confidence=0, backend=hpx.backends.TorchDistributed(), shard=shard if sharded else None)
    return model, forks


def _train(forks, rank, start: int = 0, stop: int = STEPS, directory=None, save_at=None):
    batches = _data()[0]
    for i in range(start, stop):
        x, y = batches[i]
        part = slice(rank * 4, rank * 4 + 4)  # this rank's quarter of the batch
        forks.step(_loss, (x[part], y[part]))
        if save_at is not None and forks.step_count == save_at:
            hpx.save_checkpoint(directory, forks)


def _whole(model: nn.Module) -> list[torch.Tensor]:
    return [p.full_tensor() if hasattr(p, "full_tensor") else p.detach().clone() for p in model.parameters()]


def _decisions(forks) -> list[tuple]:
    return [(r.step, r.phase, tuple(r.values["lr"]), r.bases["lr"]) for r in forks.history]


def _scenario(rank: int, world: int, directory: str) -> dict:
    import hpx.forks.ranks

    out: dict = {}
    hpx.forks.ranks._BUCKET = 100  # the whole forks' gradients all-reduced in many small buckets
    model, whole = _build(sharded=False)
    _train(whole, rank)
    out["whole"] = (_decisions(whole), [r.scores for r in whole.history], [t.clone() for t in _whole(model)])

    model, sharded = _build(sharded=True)
    numel = [(p.numel(), p.shape[0]) for p in _net().parameters()]
    out["local"] = [[p.to_local().numel() for p in f.model.parameters()] for f in sharded._forks]
    out["numel"] = numel
    seen_clones = []
    batches = _data()[0]
    for i in range(STEPS):
        x, y = batches[i]
        sharded.step(_loss, (x[rank * 4:rank * 4 + 4], y[rank * 4:rank * 4 + 4]))
        if sharded._clones:
            seen_clones.append([[p.to_local().numel() for p in c.model.parameters()]
                                for c in sharded._clones])
        if sharded.step_count == 9:  # inside the second cut's window (8-10): annealed copies in flight
            assert sharded._clones
            hpx.save_checkpoint(directory, sharded)
    out["clones"] = seen_clones
    out["sharded"] = (_decisions(sharded), [r.scores for r in sharded.history], _whole(model))
    out["type"] = type(model).__name__

    again, resumed = _build(sharded=True)
    out["resumed_at"] = hpx.load_checkpoint(directory, resumed)
    _train(resumed, rank, start=9)
    out["resumed"] = (_decisions(resumed), [r.scores for r in resumed.history],
                      [p.to_local().clone() for p in again.parameters()],
                      [p.to_local().clone() for p in model.parameters()])

    _, other = _build(sharded=False)
    try:
        hpx.load_checkpoint(directory, other)
        out["other_layout"] = "loaded"
    except hpx.ConfigError as e:
        out["other_layout"] = str(e)
    out["other_unchanged"] = other.step_count == 0
    return out


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return run_distributed(_scenario, WORLD, str(tmp_path_factory.mktemp("sharded")), timeout=600)


def test_sharded_forks_take_the_same_decisions_and_end_at_the_same_weights(ranks):
    for r in ranks:
        whole, sharded = r["whole"], r["sharded"]
        assert sharded[0] == whole[0] and len(whole[0]) == 3  # two cuts and the end, the same choices
        assert any(d[3] != 1.0 for d in whole[0])  # a challenger won somewhere (confidence=0)
        for a, b in zip(sharded[1], whole[1]):
            assert all(math.isclose(x, y, rel_tol=1e-4, abs_tol=1e-6) or (math.isnan(x) and math.isnan(y))
                       for x, y in zip(a, b))  # nan: your run at a cut, not scored there
        assert all(torch.allclose(a, b, rtol=1e-4, atol=1e-6) for a, b in zip(sharded[2], whole[2]))
    assert all(torch.equal(a, b) for r in ranks[1:] for a, b in zip(r["sharded"][2], ranks[0]["sharded"][2]))


def test_each_rank_holds_a_quarter_of_every_fork_and_annealed_copy(ranks):
    for r in ranks:
        quarter = [math.ceil(rows / WORLD) * (n // rows) for n, rows in r["numel"]]  # FSDP2 shards dim 0
        assert len(r["local"]) == 5 and r["clones"]
        for held in [*r["local"], *(c for step in r["clones"] for c in step)]:
            assert all(h <= q for h, q in zip(held, quarter))
        assert r["type"].startswith("FSDP")  # your model itself is sharded in place
    assert sum(sum(r["local"][0]) for r in ranks) == sum(n for n, _ in ranks[0]["numel"])  # the shards: whole


def test_a_sharded_run_resumes_bit_for_bit(ranks):
    for r in ranks:
        assert r["resumed_at"] == 9
        decisions, scores, resumed, uninterrupted = r["resumed"]
        assert decisions == r["sharded"][0] and repr(scores) == repr(r["sharded"][1])
        assert all(torch.equal(a, b) for a, b in zip(resumed, uninterrupted))


def test_a_checkpoint_of_another_layout_is_refused_naming_both(ranks):
    for r in ranks:
        assert "laid out over 4 process(es), each fork sharded over them (shard=...)" in r["other_layout"]
        assert "this one's over 4 process(es), each holding every fork" in r["other_layout"]
        assert r["other_unchanged"]


def _refused(**kw) -> str:
    model = _net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if kw.pop("stepped", False):
        F.mse_loss(model(torch.randn(4, 8)).squeeze(-1), torch.zeros(4)).backward()
        opt.step()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(hpx.ConfigError) as e:
        hpx.Forks(model, opt, total_steps=STEPS, probe=_data()[1], **kw)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert all(type(p) is nn.Parameter for p in model.parameters())  # nothing was sharded
    return str(e.value)


def test_a_shard_that_is_no_function_or_shards_nothing_is_refused_by_name():
    assert "shard must be a function that shards a model in place" in _refused(shard="fsdp")
    assert "shard= left every parameter whole" in _refused(shard=lambda m: None)
    stepped = _refused(shard=lambda m: None, stepped=True)
    assert "shard= needs an optimizer that has not stepped yet" in stepped


def test_gradients_travel_in_buckets_of_a_bounded_size():
    from hpx.forks.ranks import _BUCKET, _buckets

    ps = [torch.empty(n) for n in (10, _BUCKET - 10, 1, _BUCKET + 5, 3)]
    got = [[p.numel() for p in b] for b in _buckets(ps)]
    assert got == [[10, _BUCKET - 10], [1], [_BUCKET + 5], [3]]  # a larger tensor goes alone
