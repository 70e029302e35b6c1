"""How the best peak lr of a shortened run relates to the full run's: the premise of tuning on
short runs (a search that compares a few cheap, shortened runs instead of reading one run).

    python -m benchmarks.lr.short [--divisors 10 30] [--tasks ...] [--jobs 2]

For every design task (held-out tasks stay held out unless named) and each divisor ``k``, the
task's 9-point grid of plain runs (2 seeds) is rerun with ``steps // k`` steps: the same model,
optimizer, batch size and schedule shape, the schedule compressed to the shorter run. The table
gives the shortened grid's best peak lr over the full grid's best. A search could afford ``m``
shortened runs for ``m / k`` of one run's steps (3 runs at ``k = 30``: 10%); it places the lr
only if this ratio is about the same on every task (a constant can be divided out).
Results go to ``runs/lr/grids-short.json``.
"""

from __future__ import annotations

import argparse
import math
import statistics

from benchmarks.lr.__main__ import GRIDS, RUNS, _load, best_of_grid, run_grid
from benchmarks.lr.tasks import HELD_OUT, TASKS, get_task

STORE = RUNS / "grids-short.json"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.lr.short")
    p.add_argument("--tasks", nargs="*", default=[t for t in TASKS if t not in HELD_OUT])
    p.add_argument("--divisors", nargs="*", type=int, default=[10, 30])
    p.add_argument("--jobs", type=int, default=2)
    a = p.parse_args(argv)
    full = _load(GRIDS)
    store = _load(STORE)
    for k in a.divisors:
        for t in a.tasks:
            steps = max(2, get_task(t).steps // k)
            run_grid([t], store, a.jobs, steps, STORE)
    print("| task | steps | " + " | ".join(f"best at steps/{k} over best (steps)" for k in a.divisors) + " |")
    print("| --- | ---: | " + " | ".join("---:" for _ in a.divisors) + " |")
    logs: dict[int, list[float]] = {k: [] for k in a.divisors}
    for t in a.tasks:
        i, lrs, _ = best_of_grid(t, full)
        row = []
        for k in a.divisors:
            steps = max(2, get_task(t).steps // k)
            j, short_lrs, _ = best_of_grid(t, store, steps)
            r = short_lrs[j] / lrs[i]
            logs[k].append(math.log10(r))
            row.append(f"{r:.3g} ({steps} steps)")
        print(f"| {t} | {get_task(t).steps} | " + " | ".join(row) + " |")
    for k in a.divisors:
        xs = logs[k]
        spread = 10 ** statistics.pstdev(xs)
        print(f"steps/{k}: median ratio {10 ** statistics.median(xs):.3g}, range {10 ** min(xs):.3g}-"
              f"{10 ** max(xs):.3g}, geometric sd {spread:.3g}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
