"""Agreement before action (issue 20, item 1a), on real gloo processes: when one rank cannot
take the checkpoint, every rank raises a ConfigError that says which rank refused and why,
within seconds and before any rank changes; a user who catches it and starts fresh on every
rank then trains on in step (it used to hang: one rank resumed at step 20, the other started
fresh, and their collectives paired across steps). A rank built with another optimizer is
caught earlier, as the engines are built (the ranks' agreement on optimizer settings)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hpx
from tests._dist import run_distributed

STEPS, T = 24, 4


def _batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(16, 8, generator=g), torch.randint(0, 3, (16,), generator=g)) for _ in range(n)]


def _engine(backend: hpx.Collective, opt: str = "sgd") -> hpx.Engine:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    make = (lambda m: torch.optim.Adam(m.parameters(), lr=1e-3)) if opt == "adam" else (
        lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9))
    return hpx.Engine(model, make, [hpx.LearningRate(spread=0.3)], backend=backend, replicas=1,
                      sync_every=T, seed=0)


def _train(engine: hpx.Engine, until: int, rank: int, world: int, root: str | None = None) -> None:
    for x, y in _batches(STEPS)[engine.step_count:until]:
        engine.step(lambda rep, b: F.cross_entropy(rep.model(b[0]), b[1]),
                    (x.tensor_split(world)[rank], y.tensor_split(world)[rank]))
        if root is not None and engine.step_count % 10 == 0:
            hpx.save_checkpoint(root, engine)


class _Counter:
    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, s: dict) -> None:
        pass


def _refused_on_one_rank(rank: int, world: int, case: str) -> dict:
    import tempfile

    import torch.distributed as dist

    backend = hpx.backends.TorchDistributed()
    root = backend.broadcast_object(tempfile.mkdtemp(prefix="hpx-agree-") if rank == 0 else None, 0)
    saver = _engine(backend)
    _train(saver, 20, rank, world, root)
    dist.barrier()
    if case == "damaged" and rank == 1:  # a file that matches its digest but is no checkpoint
        path = Path(root) / "step-000000020" / "rank-00001.pt"
        torch.save([1, 2, 3], path)
        from hpx._files import _digest, _sidecar

        _sidecar(path).write_text(json.dumps({"sha256": _digest(path), "world_size": 2}) + "\n")
    dist.barrier()
    if case == "adam":  # another optimizer on one rank is caught as the engines are built, before a load
        try:
            _engine(backend, opt="adam" if rank == 1 else "sgd")
            out: dict = {"error": None}
        except hpx.ConsistencyError as e:
            out = {"error": str(e)}
        engine = _engine(backend)  # the user builds every rank alike and starts fresh
        _train(engine, STEPS, rank, world)
        return {**out, "step": engine.step_count, "bases": engine.bases}
    engine = _engine(backend)
    before = [p.detach().clone() for p in engine.model.parameters()]
    t0 = time.monotonic()
    extra = {"sched": _Counter()} if case == "extra" and rank == 1 else None  # never saved
    try:
        hpx.load_checkpoint(root, engine, extra=extra)
        out = {"error": None}
    except hpx.ConfigError as e:
        out = {"error": str(e)}
    out["seconds"] = time.monotonic() - t0
    out["unchanged"] = engine.step_count == 0 and all(
        torch.equal(a, b) for a, b in zip(before, engine.model.parameters()))
    _train(engine, STEPS, rank, world)  # the user starts fresh on every rank: no hang, in step
    out["step"] = engine.step_count
    out["bases"] = engine.bases
    return out


CASES = ["extra", "adam", "damaged"]


def _every_case(rank: int, world: int) -> dict:
    """Each case in turn in one launch (starting the processes costs more than a case)."""
    return {case: _refused_on_one_rank(rank, world, case) for case in CASES}


@pytest.fixture(scope="module")
def refused() -> list[dict]:
    return run_distributed(_every_case, 2, timeout=180)


@pytest.mark.parametrize("case", CASES)
def test_a_load_refused_on_one_rank_is_an_error_on_every_rank(refused, case):
    ranks = [r[case] for r in refused]
    for r, out in enumerate(ranks):
        assert out["error"] is not None, f"rank {r} went on alone"
        assert out["step"] == STEPS
        if case == "adam":  # the ranks' agreement at construction names the optimizer settings
            assert "optimizer settings" in out["error"] and "rank(s) [1]" in out["error"]
            continue
        assert "rank 1:" in out["error"] and "rank(s) [1]" in out["error"]
        want = {"extra": "holds no state for ['sched']",
                "damaged": "rank-00001.pt holds a list, not a checkpoint"}[case]
        assert want in out["error"]
        assert out["seconds"] < 20 and out["unchanged"]
    assert ranks[0]["bases"] == ranks[1]["bases"]
