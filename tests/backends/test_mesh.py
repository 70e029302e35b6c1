"""Sharded replicas (hpx.backends.Mesh) on 4 real gloo processes: 2 replicas x 2 FSDP2 shards,
and one replica sharded over all 4, against the same runs unsharded in one process."""

from __future__ import annotations

import pytest
import torch

import hpx
from tests._digits import ce, data, mlp
from tests._dist import run_distributed

pytest.importorskip("torch.distributed.fsdp")

WORLD = 4
STEPS = 24


def _knobs():
    return [hpx.LearningRate("lr", spread=0.5)]


def _engine_kw(probe):
    return dict(sync_every=5, seed=0, signal=hpx.ProbeStream(probe, loss_fn=ce))


def _full(model) -> torch.Tensor:
    """Every parameter, whole (gathered from the shards), flat."""
    parts = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in model.parameters()]
    return torch.cat([p.detach().reshape(-1) for p in parts])


def _hist(engine):
    return [(r.step, r.bases, r.values, r.scores, r.points) for r in engine.history]


def _train_step(engine, mode, batch):
    """shared: Engine.step; independent: backward, then a clipped optimizer step (the norm of a
    sharded model's gradient is its whole gradient's)."""
    if mode == "shared":
        engine.step(ce, batch)
    else:
        engine.backward(ce, batch)
        engine.optimizer_step(max_grad_norm=0.5)


def _scenario(rank, world_size, batches, probe, ckpt):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from hpx.backends import Mesh

    out = {}
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    quarter = 2 * mesh.get_local_rank("replicate") + mesh.get_local_rank("shard")
    for mode in ("shared", "independent"):
        model = mlp()
        fully_shard(model, mesh=mesh if mode == "shared" else mesh["shard"])  # HSDP, or within a replica
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        engine = hpx.Engine(model, opt, _knobs(), backend=Mesh(mesh), mode=mode, **_engine_kw(probe))
        for x, y in batches[:STEPS]:
            _train_step(engine, mode, (x[quarter * 8:(quarter + 1) * 8], y[quarter * 8:(quarter + 1) * 8]))
        out[mode] = {"history": _hist(engine), "params": _full(model),
                     "replica": engine.collective.rank, "n": engine.n_replicas}
        if mode == "shared":  # a sharded checkpoint, one file per process, and an exact resume
            hpx.save_checkpoint(ckpt, engine)
            for x, y in batches[STEPS:]:
                engine.step(ce, (x[quarter * 8:(quarter + 1) * 8], y[quarter * 8:(quarter + 1) * 8]))
            again_model = mlp(seed=5)
            fully_shard(again_model, mesh=mesh)
            again = hpx.Engine(again_model, torch.optim.SGD(again_model.parameters(), lr=0.1, momentum=0.9),
                               _knobs(), backend=Mesh(mesh), **_engine_kw(probe))
            resumed = hpx.load_checkpoint(ckpt, again)
            for x, y in batches[STEPS:]:
                again.step(ce, (x[quarter * 8:(quarter + 1) * 8], y[quarter * 8:(quarter + 1) * 8]))
            out["resume"] = {"step": resumed, "same": torch.equal(_full(again_model), _full(model)),
                             "history_same": _hist(again) == _hist(engine), "params": _full(model),
                             "history": _hist(engine)}
    # one replica sharded over all four ranks: hpx.autolr, its points scored in turn
    flat = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("shard",))
    model = mlp()
    fully_shard(model, mesh=flat)
    auto = hpx.autolr(model, torch.optim.SGD(model.parameters(), lr=0.3, momentum=0.9), total_steps=STEPS,
                      probe=probe, loss_fn=ce, backend=Mesh(flat), seed=0)
    anchor_numel = sum(a.numel() for a in auto._anchor)  # this rank's shards of the start
    for x, y in batches[:STEPS]:
        auto.step(ce, (x[rank * 8:(rank + 1) * 8], y[rank * 8:(rank + 1) * 8]))
    out["autolr"] = {"history": _hist(auto), "params": _full(model), "anchor_numel": anchor_numel,
                     "freed": auto._anchor is None}
    dist.barrier()
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory, digits):
    batches = data(digits, 2 * STEPS, seed=3, size=32)
    probe = data(digits, 2, seed=9, size=64)
    ckpt = str(tmp_path_factory.mktemp("mesh_ckpt"))
    ranks = run_distributed(_scenario, WORLD, batches, probe, ckpt, timeout=300)
    local = {}
    for mode in ("shared", "independent"):
        model = mlp()
        engine = hpx.Engine(model, lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9), _knobs(),
                            replicas=2, mode=mode, **_engine_kw(probe))
        for b in batches[:STEPS]:
            _train_step(engine, mode, b)  # split in halves: replica r holds the quarters of mesh row r
        local[mode] = {"history": _hist(engine), "params": [_full(r.model) for r in engine.replicas]}
        if mode == "shared":  # the momentum, equal on both replicas (as a checkpoint holds it)
            st = engine.state_dict()["replicas"][0]["optimizer"]["state"]
            local[mode]["momentum"] = torch.cat([st[i]["momentum_buffer"].reshape(-1) for i in sorted(st)])
    model = mlp()
    auto = hpx.autolr(model, torch.optim.SGD(model.parameters(), lr=0.3, momentum=0.9), total_steps=STEPS,
                      probe=probe, loss_fn=ce, seed=0)
    for b in batches[:STEPS]:
        auto.step(ce, b)
    local["autolr"] = {"history": _hist(auto), "params": [_full(model)]}
    local["batches"], local["probe"], local["ckpt"] = batches, probe, ckpt
    return ranks, local


def _assert_same_history(got, want):
    assert [h[0] for h in got] == [h[0] for h in want] and len(want) >= 3
    for (step, bases, values, scores, points), (_, b, v, s, p) in zip(got, want):
        assert points == p, step
        for k in b:
            assert bases[k] == pytest.approx(b[k], rel=1e-5), step
            assert values[k] == pytest.approx(v[k], rel=1e-5), step
        assert scores == pytest.approx(s, rel=1e-4), step


@pytest.mark.parametrize("mode", ["shared", "independent"])
def test_two_sharded_replicas_equal_the_unsharded_run(runs, mode):
    """HSDP (shared gradients) or FSDP within each replica (independent): the same decisions,
    values, scores and weights as two unsharded replicas in one process."""
    ranks, local = runs
    for rank, r in enumerate(ranks):
        got = r[mode]
        assert got["n"] == 2 and got["replica"] == rank // 2  # replicas along the replicate dim
        _assert_same_history(got["history"], local[mode]["history"])
        assert any(h[1]["lr"] != local[mode]["history"][0][1]["lr"] for h in got["history"])  # it moved
        torch.testing.assert_close(got["params"], local[mode]["params"][rank // 2], rtol=1e-5, atol=1e-6)


def test_sharded_checkpoint_resumes_exactly(runs):
    ranks, _ = runs
    for r in ranks:
        assert (r["resume"]["step"], r["resume"]["same"], r["resume"]["history_same"]) == (STEPS, True, True)


def _resume_on_two(rank, world_size, batches, probe, ckpt):
    """The 2 x 2 run's checkpoint resumed by 2 processes: the same 2 replicas, 1 shard each."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from hpx.backends import Mesh

    mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("replicate", "shard"))
    model = mlp(seed=7)
    fully_shard(model, mesh=mesh)
    engine = hpx.Engine(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), _knobs(),
                        backend=Mesh(mesh), **_engine_kw(probe))
    step = hpx.load_checkpoint(ckpt, engine)
    for x, y in batches[STEPS:]:  # replica r: the two quarters its two processes trained on
        engine.step(ce, (x[rank * 16:(rank + 1) * 16], y[rank * 16:(rank + 1) * 16]))
    return {"step": step, "params": _full(model), "history": _hist(engine)}


def test_a_sharded_checkpoint_resumes_on_another_number_of_shards(runs):
    """torch.distributed.checkpoint reshards: the 2 x 2 run's checkpoint, resumed by 2 processes
    (2 replicas of 1 shard), continues as the 4 processes did."""
    ranks, local = runs
    resumed = run_distributed(_resume_on_two, 2, local["batches"], local["probe"], local["ckpt"], timeout=180)
    for replica, r in enumerate(resumed):
        want = ranks[2 * replica]["resume"]  # the 4-process run's first process of that replica
        assert r["step"] == STEPS
        _assert_same_history(r["history"], want["history"])
        torch.testing.assert_close(r["params"], want["params"], rtol=1e-5, atol=1e-6)
    assert not torch.allclose(resumed[0]["params"], resumed[1]["params"])  # the replicas differ


def _resume_elastic(rank, world_size, batches, probe, ckpt):
    """The 2 x 2 run's checkpoint resumed elastically as 1 replica sharded over 2 processes."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from hpx.backends import Mesh

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("shard",))
    model = mlp(seed=7)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    engine = hpx.Engine(model, opt, _knobs(), backend=Mesh(mesh), **_engine_kw(probe))
    try:
        hpx.load_checkpoint(ckpt, engine)
        refused = ""
    except hpx.ConfigError as e:
        refused = str(e)
    step = hpx.load_checkpoint(ckpt, engine, elastic=True)
    out = {"refused": refused, "step": step, "params": _full(model), "bases": engine.bases,
           "next_sync": engine.next_sync, "n": engine.n_replicas,
           "momentum": torch.cat([opt.state[p]["momentum_buffer"].full_tensor().reshape(-1)
                                  for p in model.parameters()])}
    for x, y in batches[STEPS:]:  # and it trains on, through the next sync
        engine.step(ce, (x[rank * 16:(rank + 1) * 16], y[rank * 16:(rank + 1) * 16]))
    out["syncs"] = [h[0] for h in _hist(engine)]
    out["after"] = _full(model)
    return out


def test_sharded_replicas_resume_elastically_from_their_mean(runs):
    """Another replica count: the 2 x 2 run's checkpoint (mid-interval, the replicas differ)
    resumed as one replica sharded over 2 processes starts from the mean of the two replicas'
    weights, with the saved step, bases and search, and trains on."""
    ranks, local = runs
    resumed = run_distributed(_resume_elastic, 2, local["batches"], local["probe"], local["ckpt"],
                              timeout=180)
    saved = [ranks[0]["shared"], ranks[2]["shared"]]  # replica 0's and replica 1's weights at the save
    assert not torch.allclose(saved[0]["params"], saved[1]["params"])
    mean = (saved[0]["params"] + saved[1]["params"]) / 2
    want_bases = saved[0]["history"][-1][1]
    for r in resumed:
        assert "checkpoint has 2 replicas, this engine 1" in r["refused"]  # not without asking
        assert (r["step"], r["n"], r["next_sync"]) == (STEPS, 1, 25)
        torch.testing.assert_close(r["params"], mean, rtol=1e-6, atol=1e-7)
        assert r["bases"] == pytest.approx(want_bases)
        torch.testing.assert_close(r["momentum"], local["shared"]["momentum"], rtol=1e-5, atol=1e-6)
        assert 25 in r["syncs"] and not torch.equal(r["after"], r["params"])
    torch.testing.assert_close(resumed[0]["after"], resumed[1]["after"])  # one replica: its two shards agree


def test_autolr_on_one_replica_sharded_over_four_ranks(runs):
    """One model sharded over every rank scores autolr's 4 points in turn, as one unsharded
    model does; each rank keeps a quarter of the anchor."""
    ranks, local = runs
    n_params = sum(p.numel() for p in mlp().parameters())
    for r in ranks:
        _assert_same_history(r["autolr"]["history"], local["autolr"]["history"])
        torch.testing.assert_close(r["autolr"]["params"], local["autolr"]["params"][0], rtol=1e-5, atol=1e-6)
        assert 0 < r["autolr"]["anchor_numel"] <= n_params // WORLD + 64 and r["autolr"]["freed"]
    assert any(h[1]["lr"] != 1.0 for h in local["autolr"]["history"])


# --- bad input, in a world of one process ---------------------------------------------------


@pytest.fixture
def one_process():
    import datetime

    import torch.distributed as dist

    from tests._dist import free_port

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=60))
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_mesh_names_what_is_wrong_with_the_mesh(one_process):
    from torch.distributed.device_mesh import init_device_mesh

    from hpx.backends import Mesh

    with pytest.raises(hpx.ConfigError, match=r"must be a torch\.distributed DeviceMesh"):
        Mesh("cpu")
    with pytest.raises(hpx.ConfigError, match=r"dims \('replicate', 'shard'\) in this order"):
        Mesh(init_device_mesh("cpu", (1, 1), mesh_dim_names=("shard", "replicate")))
    with pytest.raises(hpx.ConfigError, match="its dim must be named 'shard'"):
        Mesh(init_device_mesh("cpu", (1,), mesh_dim_names=("dp",)))
    one = Mesh(init_device_mesh("cpu", (1,), mesh_dim_names=("shard",)))
    assert (one.rank, one.world_size, one.process_rank) == (0, 1, 0)


def test_a_sharded_model_is_one_replica_without_warm_noise(one_process):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from hpx.backends import Mesh

    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("shard",))
    model = mlp()
    fully_shard(model, mesh=mesh)
    before = _full(model).clone()
    with pytest.raises(hpx.ConfigError, match=r"give replicas=1 \(got 2\) and no warm_init \(got 0\.01\)"):
        hpx.Engine(model, lambda m: torch.optim.SGD(m.parameters(), lr=0.1), _knobs(), backend=Mesh(mesh),
                   replicas=2, warm_init=0.01)
    assert torch.equal(_full(model), before)  # refused before anything was touched


def test_mesh_without_a_process_group_says_how_to_start_one():
    from hpx.backends.mesh import Mesh

    with pytest.raises(hpx.BackendError, match="init_process_group"):
        Mesh(None)
