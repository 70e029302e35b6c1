"""Starts between the grid's points: does a search depend on starting at a half-decade multiple of
the grid's best?

    python -m benchmarks.lr.offgrid --method M [--tasks ...] [--offsets -0.75 -0.25 0.25 0.75]

The suite starts every method at 0.1x, 1x and 10x the grid's best, half-decade multiples of it. A
search whose forks sit at half-decade multiples of the start (the successive-halving prototypes in
``benchmarks.lr.prototypes``) then always has a fork exactly on the grid's best. This runs plain
training and the method from ``10 ** offset`` times the grid's best for each offset (default: a
quarter and three quarters of a decade on either side, between the grid's points), 2 seeds each, on
the same batches as the suite, and reports the method's loss over plain training's at that start
and over the grid's best (the oracle). Only design tasks are read by default. Results go to
``runs/lr/offgrid.json``; nothing is written to the docs.
"""

from __future__ import annotations

import argparse
import math
import os
from typing import Any

from benchmarks.lr.__main__ import (
    GRIDS,
    RUNS,
    SEEDS,
    _load,
    _mean,
    _run_all,
    _val,
    best_of_grid,
    numerics_problem,
)
from benchmarks.lr.prototypes import LOOPS
from benchmarks.lr.run import METHODS, Run
from benchmarks.lr.tasks import HELD_OUT, TASKS

__all__ = ["main", "rows"]

STORE = RUNS / "offgrid.json"


def rows(tasks: list[str], offsets: list[float], method: str, grids: dict[str, Any],
         store: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per task x offset: plain's and the method's mean validation loss, the oracle's, and
    the method's end lr over the grid's best (geometric mean over the seeds)."""
    out = []
    for task in tasks:
        i, lrs, means = best_of_grid(task, grids)
        best, oracle = lrs[i], means[i]
        for off in offsets:
            lr = best * 10 ** off
            plain = _mean([_val(store, Run(task, "plain", lr, s)) for s in SEEDS])
            hpx = _mean([_val(store, Run(task, method, lr, s)) for s in SEEDS])
            end = math.exp(sum(math.log(store[Run(task, method, lr, s).key]["end_lr"] / best)
                               for s in SEEDS) / len(SEEDS))
            out.append({"task": task, "offset": off, "plain": plain, "hpx": hpx, "oracle": oracle,
                        "end_vs_best": end})
    return out


def _markdown(table: list[dict[str, Any]], method: str) -> str:
    lines = [f"| task | start / best | plain | {method} | {method} / plain | {method} / oracle | "
             "lr it ends at / best |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in table:
        lines.append(f"| {r['task']} | {10 ** r['offset']:.3g}x | {r['plain']:.4f} | {r['hpx']:.4f} | "
                     f"{r['hpx'] / r['plain']:.3f} | {r['hpx'] / r['oracle']:.3f} | {r['end_vs_best']:.3g} |")
    near = [r for r in table if abs(r["offset"]) < 0.5]
    far = [r for r in table if abs(r["offset"]) >= 0.5]
    if near:
        ok = sum(r["hpx"] <= 1.02 * r["plain"] for r in near)
        lines.append(f"\nWithin half a decade of the grid's best: {method} within 2% of plain training "
                     f"at that start (or better) in {ok} of {len(near)} cells.")
    if far:
        ok = sum(r["hpx"] <= 1.05 * r["oracle"] for r in far)
        lines.append(f"Further off: within 5% of the oracle in {ok} of {len(far)} cells; more than 2% "
                     f"worse than plain training there in {sum(r['hpx'] > 1.02 * r['plain'] for r in far)}.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.lr.offgrid", description=__doc__.split("\n")[0])
    p.add_argument("--method", required=True, choices=sorted([*METHODS, *LOOPS]))
    p.add_argument("--tasks", nargs="*", default=[t for t in TASKS if t not in HELD_OUT])
    p.add_argument("--offsets", nargs="*", type=float, default=[-0.75, -0.25, 0.25, 0.75])
    p.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1))
    p.add_argument("--mixed-numerics", action="store_true",
                   help="run against a stored grid whose runs this machine does not repeat bit for bit")
    a = p.parse_args(argv)
    grids = _load(GRIDS)
    store = _load(STORE)
    runs = []
    if not a.mixed_numerics:
        numerics_problem(a.tasks[0], grids)
    for task in a.tasks:
        i, lrs, _ = best_of_grid(task, grids)
        for off in a.offsets:
            runs += [Run(task, m, lrs[i] * 10 ** off, s) for m in ("plain", a.method) for s in SEEDS]
    _run_all(runs, store, STORE, a.jobs)
    print(_markdown(rows(a.tasks, a.offsets, a.method, grids, store), a.method))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
