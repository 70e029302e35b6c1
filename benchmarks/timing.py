"""Side-by-side CPU timing shared by the overhead benchmarks (bench_step, scaling, vmap_probe)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable


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
