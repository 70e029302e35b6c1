"""hpx.Forks and hpx.Engine over several gloo processes where the ranks' set-ups differ in ways a
user does not see (a branch taken on one rank only, more processes than the checkpoint's, a
sharded model given to the wrong backend), and the state a resume restores without being asked."""

from __future__ import annotations

import io
import pickle

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hpx
from hpx.errors import ConfigError, ConsistencyError
from tests._dist import run_distributed
from tests.test_forks import BATCHES, PROBE, STEPS, _loss, _net


class _TwoHeads(nn.Module):
    def __init__(self, bias_b: bool = True) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body, self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 1), nn.Linear(16, 1, bias=bias_b)

    def forward(self, x, head: str = "a"):
        return (self.a if head == "a" else self.b)(torch.tanh(self.body(x)))


def _branching(rank: int, world: int, bias_b: bool, overlap: bool = True) -> str:
    """Rank 0's batches take head a, rank 1's head b (a branch chosen by the data); ``overlap=False``:
    each fork's all-reduce after every backward (``forks._overlap``, hpx.forks.early)."""
    model = _TwoHeads(bias_b)
    forks = hpx.Forks(model, torch.optim.SGD(model.parameters(), lr=0.05), total_steps=20, probe=PROBE,
                      loss_fn=lambda rep, b: F.mse_loss(rep.model(b[0]).squeeze(-1), b[1]),
                      backend=hpx.backends.TorchDistributed())
    forks._overlap = overlap
    head = "a" if rank == 0 else "b"
    try:
        for b in BATCHES[:20]:
            forks.step(lambda rep, b: F.mse_loss(rep.model(b[0], head).squeeze(-1), b[1]), b)
    except ConsistencyError as e:
        return f"{forks.step_count}: {e}"
    return "trained"


def _both_branchings(rank: int, world: int) -> dict:
    """Each case in turn in one launch (starting the processes costs more than a case)."""
    return {bias_b: _branching(rank, world, bias_b) for bias_b in (True, False)}


@pytest.fixture(scope="module")
def branchings() -> list[dict]:
    return run_distributed(_both_branchings, 2)


@pytest.mark.parametrize("bias_b", [True, False], ids=["same-sizes", "other-sizes"])
def test_a_parameter_reached_on_some_ranks_only_is_named_at_the_first_decision(branchings, bias_b):
    """Its gradient was summed into another parameter's (same sizes: the ranks ended apart without a
    word) or gloo aborted on buffers of different lengths."""
    out = [r[bias_b] for r in branchings]
    steps = [int(o.split(":")[0]) for o in out]
    assert steps[0] == steps[1] <= 4  # the first cut's decision, not the run's end
    assert all("under torch.distributed some ranks' losses reached a parameter" in o for o in out)


def _save(rank: int, world: int, folder: str) -> None:
    model = _net(p=0.0)
    forks = hpx.Forks(model, torch.optim.SGD(model.parameters(), lr=0.05), total_steps=STEPS, probe=PROBE,
                      backend=hpx.backends.TorchDistributed())
    for b in BATCHES[:4]:
        forks.step(_loss, b)
    hpx.save_checkpoint(folder, forks)


def _load(rank: int, world: int, folder: str) -> str:
    model = _net(p=0.0)
    forks = hpx.Forks(model, torch.optim.SGD(model.parameters(), lr=0.05), total_steps=STEPS, probe=PROBE,
                      backend=hpx.backends.TorchDistributed())
    try:
        return f"resumed at {hpx.load_checkpoint(folder, forks)}"
    except ConfigError as e:
        return str(e)


def test_resuming_on_more_processes_than_saved_is_refused_naming_the_count(tmp_path):
    """The extra rank had no file, so no step was common: the run started afresh, with a warning
    that blamed damaged files."""
    run_distributed(_save, 2, str(tmp_path))
    out = run_distributed(_load, 3, str(tmp_path))
    assert all("step 4 was saved by a run of 2 processes, this one has 3: resume with the saved run's "
               "process count" in o for o in out)


def _one_loads(rank: int, world: int, folder: str) -> tuple[str, float]:
    """Rank 0 resumes from the checkpoint, the others start fresh and train (their loop forgot the
    load): the fresh ranks died with gloo's 'Received data size doesn't match'."""
    import time

    model = _net(p=0.0)
    forks = hpx.Forks(model, torch.optim.SGD(model.parameters(), lr=0.05), total_steps=STEPS, probe=PROBE,
                      backend=hpx.backends.TorchDistributed())
    t0 = time.monotonic()
    try:
        if rank == 0:
            hpx.load_checkpoint(folder, forks)
        for b in BATCHES[:STEPS]:
            forks.step(_loss, b)
        return "ok", time.monotonic() - t0
    except ConsistencyError as e:
        return str(e), time.monotonic() - t0


@pytest.mark.procs
@pytest.mark.parametrize("world", [2, 3])
def test_a_load_on_one_rank_only_raises_on_every_rank_without_hanging(tmp_path, world):
    run_distributed(_save, world, str(tmp_path))
    out = run_distributed(_one_loads, world, str(tmp_path), timeout=120)
    for msg, seconds in out:
        assert "ran different numbers of optimizer steps" in msg or "met another rank's" in msg, msg
        assert seconds < 30, seconds
    assert any("loading a checkpoint" in msg for msg, _ in out)


def _sharded(rank: int, world: int) -> str:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
    before = [p.to_local().clone() for p in model.parameters()]
    try:
        hpx.Engine(model, torch.optim.SGD(model.parameters(), lr=0.1), [hpx.LearningRate(spread=0.5)],
                   backend=hpx.backends.TorchDistributed())
    except ConfigError as e:
        same = all(torch.equal(a, p.to_local()) for a, p in zip(before, model.parameters()))
        return f"{same}: {e}"
    return "accepted"


def test_a_sharded_model_on_a_backend_of_whole_replicas_is_refused_naming_mesh():
    """Rank 0's shards were broadcast over rank 1's (another slice of the model)."""
    out = run_distributed(_sharded, 2)
    assert all(o.startswith("True: 1 problem: the model is sharded") and "hpx.backends.Mesh(mesh)" in o
               for o in out)


def test_your_scaler_is_restored_by_a_resume_with_the_forks():
    def build():
        model = _net(p=0.0)
        scaler = torch.amp.GradScaler("cpu", init_scale=1.0, growth_interval=1)
        return scaler, hpx.Forks(model, torch.optim.SGD(model.parameters(), lr=0.01), total_steps=STEPS,
                                 probe=PROBE)

    scaler, forks = build()
    for b in BATCHES[:5]:
        forks.backward(_loss, b, scaler=scaler)
        forks.optimizer_step(scaler=scaler)
    assert scaler.get_scale() == 32.0  # doubled at every step
    buf = io.BytesIO()
    torch.save(forks.state_dict(), buf)
    buf.seek(0)
    fresh, again = build()
    again.load_state_dict(torch.load(buf, weights_only=True))
    again.backward(_loss, BATCHES[5], scaler=fresh)
    assert fresh.get_scale() == 32.0  # as saved, without being given to the checkpoint


@pytest.mark.parametrize("change, words", [
    (lambda m, o: o.param_groups[0].__setitem__("weight_decay", 0.5), "parameter group 0's weight_decay 0.5"),
    (lambda m, o: setattr(m[2], "p", 0.9), r"dropout rate 0\.9 in '2' where the copies have 0\.2"),
    (lambda m, o: m[3].weight.requires_grad_(False), r"parameter '3\.weight' frozen \(requires_grad=False\) "
                                                     r"where the copies' is not"),
])
def test_other_settings_changed_on_your_objects_alone_are_refused(change, words):
    model = _net(p=0.2)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    forks = hpx.Forks(model, opt, total_steps=STEPS, probe=PROBE)
    for b in BATCHES[:3]:
        forks.step(_loss, b)
    change(model, opt)
    with pytest.raises(ConfigError, match=words):
        forks.step(_loss, BATCHES[3])


def test_a_config_error_crosses_a_process_boundary_with_its_problems():
    e = pickle.loads(pickle.dumps(ConfigError(["first problem", "second"])))
    assert e.problems == ["first problem", "second"] and str(e) == "2 problems: first problem; second"


def _uneven(rank: int, world: int) -> dict:
    """Each case in turn: the last rank runs one step fewer, skips a batch, takes one step more, stops
    early, builds its optimizer at another lr, or sets another lr mid-run through each() (a branch
    only it takes). Each used to hang until the process group's timeout (30 minutes by default) or
    end in a bare gloo error; the last trained the ranks apart, only rank 0's decisions applied."""
    import time

    out = {}
    for how in ("fewer", "skip", "extra", "stops", "lr", "each"):
        model = _net(p=0.0)
        lr = 0.1 if how == "lr" and rank == world - 1 else 0.05
        last = rank == world - 1
        steps = STEPS + (-1 if how == "fewer" and last else 1 if how == "extra" and last else 0)
        t0 = time.monotonic()
        try:
            opt = torch.optim.SGD(model.parameters(), lr=lr)
            forks = hpx.Forks(model, opt, total_steps=STEPS, probe=PROBE,
                              backend=hpx.backends.TorchDistributed())
            for i, b in enumerate(BATCHES[:steps]):
                if last and ((how == "skip" and i == 7) or (how == "stops" and i >= 12)):
                    continue
                if last and how == "each" and i == 6:  # after the first cut's decision (step 5)
                    forks.each(lambda rep: rep.optimizer.param_groups[0].__setitem__("lr", 0.08))
                forks.step(_loss, b)
            forks.converge()
            out[how] = ("ok", time.monotonic() - t0)
        except ConsistencyError as e:
            out[how] = (str(e), time.monotonic() - t0)
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_ranks_that_step_unevenly_or_build_another_lr_raise_on_every_rank_without_hanging(world):
    ranks = run_distributed(_uneven, world, timeout=240)
    for r in ranks:
        for how in ("fewer", "skip", "extra", "stops"):
            msg, seconds = r[how]
            assert "ran different numbers of optimizer steps" in msg, (how, msg)
            assert seconds < 60, (how, seconds)  # a hang waited for the process group's timeout
        assert "the optimizer's settings" in r["lr"][0] and "differ across ranks" in r["lr"][0]
        msg, seconds = r["each"]  # found at the next decision, the second cut's (step 10), on every rank
        assert msg.startswith("deciding at step 10, the forks' settings") and "differ across ranks" in msg
        assert f"ranks [{world - 1}] disagree with rank 0" in msg and seconds < 60
    assert any("another rank was at a training step" in r["fewer"][0] for r in ranks)
    assert any("met another rank's decision, converge()" in r["fewer"][0] for r in ranks)


def _saves_apart(rank: int, world: int, folder: str) -> tuple[str, float]:
    """Rank 0 saves at step 8, the others at step 9: rank 0 waited in the save's first collective
    while the others were in step 9's gradient all-reduce (a hang until the process group's timeout,
    or gloo's 'Connection closed by peer')."""
    import time

    model = _net(p=0.0)
    forks = hpx.Forks(model, torch.optim.SGD(model.parameters(), lr=0.05), total_steps=STEPS, probe=PROBE,
                      backend=hpx.backends.TorchDistributed())
    t0 = time.monotonic()
    try:
        for b in BATCHES[:STEPS]:
            forks.step(_loss, b)
            if forks.step_count == (8 if rank == 0 else 9):
                hpx.save_checkpoint(folder, forks)
        return "ok", time.monotonic() - t0
    except ConsistencyError as e:
        return str(e), time.monotonic() - t0


@pytest.mark.procs
@pytest.mark.parametrize("world", [2, 3])
def test_saves_at_different_steps_raise_on_every_rank_without_hanging(tmp_path, world):
    ranks = run_distributed(_saves_apart, world, str(tmp_path), timeout=120)
    for msg, seconds in ranks:
        assert "ran different numbers of optimizer steps" in msg, msg
        assert seconds < 30, seconds
    assert any("saving step 8" in msg for msg, _ in ranks)
    assert not any(tmp_path.glob("step-*/rank-*.pt"))  # nothing saved on any rank


def test_the_reliability_doc_holds_the_ranks_table_naming_these_tests():
    from pathlib import Path

    from benchmarks import reliability

    assert all(callable(globals().get(test)) for *_, test in reliability.FORKS_RANKS_ROWS)
    doc = (Path(__file__).parents[1] / "docs" / "reliability.md").read_text()
    assert "\n".join(reliability.FORKS_RANKS_SECTION) in doc
