"""The marker that catches ranks at different steps (hpx/engine/aligned.py), in one process: the
arithmetic on each side. The real pairing across processes is tested on 4 gloo ranks in
tests/test_engine_dist.py (test_ranks_that_ran_different_numbers_of_steps_fail_clearly_...)."""

from __future__ import annotations

import pytest
import torch

from hpx.engine.aligned import check_aligned, met_a_sync
from hpx.errors import ConsistencyError


class _Untouchable:
    """A collective that must not be used."""

    world_size = 2

    def all_reduce_sum_(self, tensors):
        raise AssertionError("no collective may run once a rank knows its step met a sync")


def test_a_step_whose_count_came_back_negative_raises_on_the_cpu_at_once():
    with pytest.raises(ConsistencyError, match=r"met another rank's sync.*drop_last=True"):
        met_a_sync(torch.tensor([3.0 - 2.0 ** 40], dtype=torch.float64), None)
    assert met_a_sync(torch.tensor([3.0], dtype=torch.float64), None) is None  # a count: nothing


def test_a_remembered_crossing_raises_at_the_sync_before_any_collective():
    model = torch.nn.Linear(3, 2)
    with pytest.raises(ConsistencyError, match=r"found at the sync of step 7"):
        check_aligned(_Untouchable(), model, 7, "syncing", [None, torch.tensor(True)])


class _Peer:
    """Two ranks in one call: this rank's tensors plus what the other rank sends (``other``: the
    count it puts where a step's count goes, or None for the same marker)."""

    world_size = 2

    def __init__(self, other: float | None) -> None:
        self.other = other
        self.shapes: list[tuple] = []

    def all_reduce_sum_(self, tensors):
        self.shapes = [(tuple(t.shape), t.dtype) for t in tensors]
        flag = tensors[-1]
        flag.add_(flag if self.other is None else torch.full_like(flag, self.other))


def test_the_marker_is_shaped_like_a_step_and_tells_a_sync_from_a_step():
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2).double())
    same = _Peer(None)
    check_aligned(same, model, 5, "syncing", [None])  # both at the sync: silent
    # a step's all-reduce: one flat gradient per dtype, in order, then the float64 count
    assert same.shapes == [((16,), torch.float32), ((10,), torch.float64), ((1,), torch.float64)]
    with pytest.raises(ConsistencyError, match=r"syncing at step 5, another rank was at a training step"):
        check_aligned(_Peer(1.0), model, 5, "syncing", [None])  # the other rank sent a count of 1


def test_on_an_accelerator_a_crossing_is_kept_on_the_device_and_raised_at_the_next_sync():
    """The device path, run on the CPU: nothing is read back at the step; the flag, or-ed over
    steps, makes the next sync raise before its collective."""
    count = torch.tensor([1.0], dtype=torch.float64)
    crossed = met_a_sync(count, None, host=False)
    assert torch.is_tensor(crossed) and not bool(crossed)
    crossed = met_a_sync(torch.tensor([1.0 - 2.0 ** 40], dtype=torch.float64), crossed, host=False)
    crossed = met_a_sync(count, crossed, host=False)  # a later, normal step keeps it set
    assert bool(crossed)
    with pytest.raises(ConsistencyError, match=r"met another rank's sync.*found at the sync of step 9"):
        check_aligned(_Untouchable(), torch.nn.Linear(2, 2), 9, "syncing", [crossed])
