"""The bar's resolution: a perfect search, measured. Plain training at the grid's best peak lr
nudged by a part in a million (``lr * (1 + k * 1e-6)``, k = 1, 2, 3), 2 seeds each, read the way
the suite reads a method that ends at the grid's best lr by another path.

    python -m benchmarks.lr.noise [--tasks ...] [--jobs 2]   # prints the table

Its runs go to ``benchmarks/lr/stored/noise.json`` (committed), where ``python -m benchmarks.lr.bar``
reads them.

A nudge that small changes no learning rate a search could tell apart; it changes the rounding
of every step, and on some tasks a run's end depends on the rounding chaotically (see
``python -m benchmarks.lr.numerics``). So each nudged pair is what a search that lands exactly on
the grid's best lr, by a path other than the grid's own run, would score: its 2-seed mean over
the grid's ("oracle") is the ratio the bar's "recovered: within 5% of the oracle" reads for it,
and the bar's "no harm: within 2% of plain training" for a search that moved away and back.
"""

from __future__ import annotations

import argparse
import os
import statistics
from typing import Any

from benchmarks.lr.__main__ import GRIDS, SEEDS, STORED, _load, _mean, _run_all, best_of_grid
from benchmarks.lr.run import Run, execute
from benchmarks.lr.tasks import HELD_OUT, TASKS

__all__ = ["NUDGES", "main", "rows"]

NUDGES = (1, 2, 3)  # parts in a million added to the grid's best lr
PATH = STORED / "noise.json"


def _nudged(task: str, grids: dict[str, Any], k: int, seed: int) -> Run:
    i, lrs, _ = best_of_grid(task, grids)
    return Run(task, f"nudge{k}", lrs[i] * (1 + k * 1e-6), seed)


def _execute(run: Run) -> dict[str, Any]:
    """A nudged run is plain training at its (nudged) lr."""
    return execute(Run(run.task, "plain", run.lr, run.seed, run.steps))


def rows(tasks: list[str], grids: dict[str, Any], store: dict[str, Any]) -> list[dict[str, Any]]:
    """Per task: the oracle (the grid's 2-seed mean at its best lr) and each nudge's 2-seed mean
    over it."""
    out = []
    for task in tasks:
        i, _, means = best_of_grid(task, grids)
        ratios = [_mean([store[_nudged(task, grids, k, s).key]["val"] or float("nan") for s in SEEDS])
                  / means[i] for k in NUDGES]
        out.append({"task": task, "held_out": task in HELD_OUT, "oracle": means[i], "ratios": ratios})
    return out


def markdown(table: list[dict[str, Any]]) -> str:
    ks = ", ".join(map(str, NUDGES))
    lines = [f"| task | held out | oracle | nudged / oracle (k = {ks}) | worst |",
             "| --- | --- | --- | --- | --- |"]
    for r in table:
        lines.append(f"| {r['task']} | {'yes' if r['held_out'] else ''} | {r['oracle']:.4f} | "
                     + ", ".join(f"{x:.3f}" for x in r["ratios"]) + f" | {max(r['ratios']):.3f} |")
    cells = [x for r in table for x in r["ratios"]]
    over5 = [r["task"] for r in table if max(r["ratios"]) > 1.05]
    over2 = [r["task"] for r in table if max(r["ratios"]) > 1.02]
    lines += ["", f"Of {len(cells)} nudged pairs, {sum(x > 1.05 for x in cells)} end more than 5% above the "
              f"oracle and {sum(x > 1.02 for x in cells)} more than 2%; by task, the worst nudge is above "
              f"1.05 on {len(over5)} of {len(table)} ({', '.join(over5) or 'none'}) and above 1.02 on "
              f"{len(over2)}. Median |ratio - 1| {statistics.median(abs(x - 1) for x in cells):.3f}."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.lr.noise", description=__doc__.split("\n")[0])
    p.add_argument("--tasks", nargs="*", default=list(TASKS))
    p.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1))
    a = p.parse_args(argv)
    grids = _load(GRIDS)
    store = _load(PATH)
    runs = [_nudged(t, grids, k, s) for t in a.tasks for k in NUDGES for s in SEEDS]
    _run_all(runs, store, PATH, a.jobs, fn=_execute)
    print(markdown(rows(a.tasks, grids, store)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
