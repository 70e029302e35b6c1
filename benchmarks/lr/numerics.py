"""Two stored grids of the suite, made on machines with other floating-point kernels, compared run
by run: how far the same run (task, peak lr, seed, batches) ends apart when only the rounding
differs.

    git show 0491d99:benchmarks/lr/grids.json > /tmp/grids-there.json   # the grid made elsewhere
    python -m benchmarks.lr.numerics /tmp/grids-there.json               # against the committed one

A run's end depends chaotically on rounding on some tasks (a BatchNorm CNN, an LSTM, a row
transformer): the same seed and batches end tens of percent apart. So a method's run and plain
training are only compared when both were made on one machine (``python -m benchmarks.lr eval``
checks that the stored grid repeats here), and a gap of a few percent between two runs that took
different paths is within this noise on those tasks.
"""

from __future__ import annotations

import argparse
import math
import statistics
from pathlib import Path
from typing import Any

from benchmarks.lr.__main__ import GRIDS, SEEDS, _load, best_of_grid
from benchmarks.lr.tasks import HELD_OUT, TASKS, get_task

__all__ = ["compare", "main"]


def compare(there: dict[str, Any], here: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per task both grids hold: its best lr in each, how many of the runs both made ended
    at the same validation loss bit for bit, the runs that trained in both (below 90% of the
    constant predictor's loss) whose losses differ by more than 1% and by how much at most, and
    the 2-seed mean at ``there``'s best lr, ``here`` over ``there``."""
    rows = []
    for name in TASKS:
        keys = [k for k in there if k.startswith(f"{name}|plain|") and k in here]
        if not keys:
            continue
        const = get_task(name).constant_loss()
        i, lrs, _ = best_of_grid(name, there)
        j, lrs_here, _ = best_of_grid(name, here)
        same, apart, largest = 0, 0, 0.0
        for k in keys:
            a, b = there[k]["val"], here[k]["val"]
            same += a == b
            if a is not None and b is not None and max(a, b) < 0.9 * const:
                change = abs(math.log(b / a))
                apart += change > math.log(1.01)
                largest = max(largest, change)
        at = [f"{name}|plain|{lrs[i]:.6g}|{s}" for s in SEEDS]
        ratio = (statistics.fmean(here[k]["val"] for k in at) / statistics.fmean(there[k]["val"] for k in at)
                 if all(here.get(k, {}).get("val") and there[k]["val"] for k in at) else math.nan)
        rows.append({"task": name, "held_out": name in HELD_OUT, "best_there": lrs[i],
                     "best_here": lrs_here[j], "runs": len(keys), "same": same, "apart": apart,
                     "largest": math.exp(largest) - 1, "at_best": ratio})
    return rows


def markdown(rows: list[dict[str, Any]]) -> str:
    out = ["| task | held out | best lr there | best lr here | runs bit for bit | runs > 1% apart | "
           "largest change | 2-seed mean at the best, here / there |",
           "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        moved = "" if math.isclose(r["best_there"], r["best_here"]) else " (moved)"
        out.append(f"| {r['task']} | {'yes' if r['held_out'] else ''} | {r['best_there']:.3g} | "
                   f"{r['best_here']:.3g}{moved} | {r['same']} of {r['runs']} | {r['apart']} | "
                   f"{r['largest']:.0%} | {r['at_best']:.3f} |")
    moved = sum(not math.isclose(r["best_there"], r["best_here"]) for r in rows)
    apart = sum(r["apart"] for r in rows)
    big = [r["task"] for r in rows if abs(math.log(r["at_best"])) > math.log(1.05)]
    runs = sum(r["runs"] for r in rows)
    out += ["", f"The best lr moved on {moved} of {len(rows)} tasks; {apart} of {runs} runs"
            f" ended more than 1% apart; the 2-seed mean at the best lr moved by more than 5% on "
            f"{len(big)} tasks ({', '.join(big) or 'none'})."]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.lr.numerics", description=__doc__.split("\n")[0])
    p.add_argument("there", type=Path, help="a grid made on another machine (grids.json)")
    p.add_argument("here", type=Path, nargs="?", default=GRIDS, help="default: the committed grid")
    a = p.parse_args(argv)
    print(markdown(compare(_load(a.there), _load(a.here))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
