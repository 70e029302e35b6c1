"""Side-by-side CPU timing and the hand-written average shared by the overhead benchmarks
(bench_step, scaling, vmap_probe)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch


def side_by_side(a: Callable[[], object], b: Callable[[], object], rounds: int,
                 reps: int) -> tuple[float, float]:
    """Median over rounds of CPU seconds per call of ``a`` and ``b``, alternating which runs first
    each round so that machine noise hits both alike (after two untimed calls of each)."""
    for _ in range(2):
        a(), b()
    ta, tb = [], []
    for r in range(rounds):
        for f, out in ((a, ta), (b, tb)) if r % 2 == 0 else ((b, tb), (a, ta)):
            t = time.process_time()
            for _ in range(reps):
                f()
            out.append((time.process_time() - t) / reps)
    return statistics.median(ta), statistics.median(tb)


@torch.no_grad()
def hand_average(lists: list[list[torch.Tensor]]) -> None:
    """Every list's tensors <- the mean over the lists, with foreach ops (what a user would write
    by hand, the baseline hpx's sync is measured against)."""
    mean = torch._foreach_add(lists[0], lists[1])
    for ts in lists[2:]:
        torch._foreach_add_(mean, ts)
    torch._foreach_div_(mean, len(lists))
    for ts in lists:
        torch._foreach_copy_(ts, mean)
