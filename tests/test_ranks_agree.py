"""Ranks that disagree are caught (issue 20, item 7): different probe data or probe length, a
different optimizer setting, or a different number of steps is a clear ConsistencyError on every
rank, never a silent run or a gloo abort. One launch of 2 real gloo processes runs every case."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hpx
from hpx.errors import ConsistencyError
from tests._dist import run_distributed


def _ce(rep: hpx.Replica, b: Any) -> torch.Tensor:
    return F.cross_entropy(rep.model(b[0]), b[1])


def _batches(seed: int, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)) for _ in range(n)]


class _Stream:
    """An iterable that is not a list (a DataLoader's kind): its batches are read only at syncs."""

    def __init__(self, batches: list[Any]) -> None:
        self.batches = batches

    def __iter__(self) -> Iterator[Any]:
        return iter(self.batches)


def _case(rank: int, name: str) -> str:
    torch.manual_seed(0)
    model = nn.Linear(6, 3)
    lr, momentum, knob = 0.1, 0.0, hpx.LearningRate(spread=0.25)
    probe: Any = _batches(7, 4)
    steps, mode = 9, "shared"
    if name == "probe data" and rank == 1:
        probe = _batches(8, 4)
    if name == "probe length" and rank == 1:
        probe = probe[:3]
    if name == "probe stream":
        probe = _Stream(_batches(7 + rank, 4))
    if name == "lr under autolr's knob":
        knob = hpx.LearningRateScale(spread=0.25)
        lr = 0.1 if rank == 0 else 0.4
    if name == "momentum" and rank == 1:
        momentum = 0.9
    if name == "steps":
        mode, steps = "independent", 6 + rank  # rank 1 runs one step more, then converges
    try:
        engine = hpx.Engine(model, torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum), [knob],
                            backend=hpx.backends.TorchDistributed(), sync_every=3, mode=mode,
                            signal=hpx.ProbeStream(probe, _ce))
        for b in _batches(rank, steps):
            engine.step(_ce, b)
        engine.converge()
    except ConsistencyError as e:
        return str(e)
    return "no error"


def _all_cases(rank: int, world: int, names: list[str]) -> dict[str, str]:
    torch.set_num_threads(1)
    return {name: _case(rank, name) for name in names}


CASES = {
    "probe data": r"the signal's data .*rank\(s\) \[1\] differ",
    "probe length": r"the signal's data .*rank\(s\) \[1\] differ from rank 0 \(this rank's: \((3|4), 1",
    "probe stream": r"at the sync of step 3 .*rank\(s\) \[1\] differ from rank 0 in their probe data",
    "lr under autolr's knob": r"the settings knobs scale .*rank\(s\) \[1\] differ .*\(0, 0\.(1|4)\)",
    "momentum": r"optimizer settings \(other than what knobs write\): rank\(s\) \[1\] differ .*'momentum': 0",
    "steps": r"converging at the end of training.*step: rank 0 has 6, rank 1 has 7",
}


@pytest.fixture(scope="module")
def seen() -> list[dict[str, str]]:
    return run_distributed(_all_cases, 2, list(CASES), timeout=120)


@pytest.mark.parametrize("name", list(CASES))
def test_ranks_that_disagree_get_a_clear_error_on_every_rank(seen: list[dict[str, str]], name: str) -> None:
    for rank in range(2):
        assert seen[rank][name] != "no error", f"rank {rank} ran {name!r} to the end silently"
        assert re.search(CASES[name], seen[rank][name]), seen[rank][name]
