"""Finished-run sweeps replayed on the grid: what the end's test reads at each ``z`` when every
candidate run is complete.

    python -m benchmarks.lr.sweep      # needs runs/lr/units.json: python -m benchmarks.lr.trainsplit

``hpx.Forks`` cuts its forks early and compares your run with one finished challenger. A sweep that
ran every candidate to the end (3 runs a decade apart, or 5 half a decade apart, around your
start) is the most a comparison of finished runs can read, at 3x or 5x plain training's steps. It
is replayed here on the grid's own runs (the candidates are grid runs, with their probe losses per
example as ``benchmarks.lr.trainsplit`` stores them): for each start (0.1x, 1x, 10x the grid's best)
and seed, the candidate with the lowest probe loss replaces the start only if it beats it by ``z``
standard errors of the per-example difference (``z = 0``: whenever it scores lower), the end's test
of ``hpx.Forks``. The table reads the suite's quality rows on what each sweep keeps: how far the
cuts of ``Forks`` fall short of a sweep, and what the test's ``z`` trades between the no-harm row
and the recovery row. The design tasks only (the held-out tasks are not read).

A caveat of the replay: the suite's starts are decade multiples of the grid's best, so a sweep of
decade-spaced candidates has the grid's best among them from 10x off, which a start between grid
points would not give it (``python -m benchmarks.lr.offgrid`` measures that for a search).
"""

from __future__ import annotations

import argparse
import math
import statistics
from typing import Any

import torch

from benchmarks.lr.__main__ import SEEDS, _val, best_of_grid
from benchmarks.lr.run import Run
from benchmarks.lr.trainsplit import stored_design_runs
from hpx.forks.fork import paired_gain

__all__ = ["SWEEPS", "ZS", "kept", "main", "read"]

SWEEPS: dict[str, tuple[int, ...]] = {
    "3 runs, a decade apart": (-2, 0, 2),
    "5 runs, half a decade apart": (-2, -1, 0, 1, 2),
}
"""Each sweep's candidates, in half-decade grid steps from the start."""
ZS: tuple[float, ...] = (0.0, 1.0, 1.5, 2.0)


def kept(task: str, k: int, seed: int, offsets: tuple[int, ...], z: float, grids: dict[str, Any],
         store: dict[str, Any]) -> int:
    """The grid index the sweep around grid index ``k`` ends at: the candidate with the lowest probe
    loss if it beats the start's by ``z`` standard errors, example by example, else ``k`` (ties go to
    the candidate nearer the start; a lost start gives way to any candidate that is not)."""
    _, lrs, _ = best_of_grid(task, grids)
    runs = {j: Run(task, "plain", lrs[j], seed) for j in (k + d for d in offsets) if 0 <= j < len(lrs)}

    def probe(j: int) -> float:
        p = grids[runs[j].key].get("probe")
        return math.inf if p is None or not math.isfinite(p) else p

    best = min((j for j in runs if j != k), key=lambda j: (probe(j), abs(j - k)))
    if not probe(best) < probe(k):
        return k
    if z <= 0 or not math.isfinite(probe(k)):
        return best
    ua, ub = store[runs[best].key]["units"], store[runs[k].key]["units"]
    gain = paired_gain(torch.tensor(ua["probe"], dtype=torch.float64),
                       torch.tensor(ub["probe"], dtype=torch.float64))
    return best if gain >= z else k


def read(tasks: list[str], offsets: tuple[int, ...], z: float, grids: dict[str, Any],
         store: dict[str, Any]) -> dict[str, Any]:
    """The quality rows on the sweep's ends: no harm (tasks within 2% of plain training from the
    grid's best, and the largest ratio), recovered cells (within 5% of the oracle from 10x off), and
    cells whose end lr (geometric mean of the seeds) is within 3x of the grid's best, as the bar
    counts them."""
    harm, ratios, rec, near, n_off = 0, [], 0, 0, 0
    for task in tasks:
        i, lrs, means = best_of_grid(task, grids)
        for start, k0 in (("0.1x", -2), ("1x", 0), ("10x", 2)):
            ends = [kept(task, i + k0, s, offsets, z, grids, store) for s in SEEDS]
            val = statistics.fmean(_val(grids, Run(task, "plain", lrs[j], s)) for j, s in zip(ends, SEEDS))
            plain = statistics.fmean(_val(grids, Run(task, "plain", lrs[i + k0], s)) for s in SEEDS)
            end = math.exp(statistics.fmean(math.log(lrs[j] / lrs[i]) for j in ends))
            near += 1 / 3 <= end <= 3
            if start == "1x":
                ratios.append(val / plain)
                harm += val <= 1.02 * plain
            else:
                n_off += 1
                rec += val <= 1.05 * means[i]
    return {"harm": harm, "tasks": len(tasks), "largest": max(ratios), "recovered": rec, "off": n_off,
            "near": near, "cells": 3 * len(tasks)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.lr.sweep", description=__doc__.split("\n")[0])
    p.parse_args(argv)
    tasks, grids, store = stored_design_runs()
    print("| sweep | z | no harm (<= 1.02) | the largest | recovered (<= 1.05x the oracle) | "
          "lr within 3x |\n| --- | ---: | ---: | ---: | ---: | ---: |")
    for name, offsets in SWEEPS.items():
        for z in ZS:
            r = read(tasks, offsets, z, grids, store)
            print(f"| {name} | {z:g} | {r['harm']} of {r['tasks']} | {r['largest']:.3f} | "
                  f"{r['recovered']} of {r['off']} | {r['near']} of {r['cells']} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
