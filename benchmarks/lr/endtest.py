"""Which paired statistic should the end's test read? The mean's z against robust ones.

    python -m benchmarks.lr.endtest        # needs runs/lr/units.json: python -m benchmarks.lr.trainsplit

The confident end (``hpx.Forks``) passes the challenger when the mean of the per-example
difference of the two runs' probe losses is at least 2 standard errors below 0. A probe's
per-example losses are heavy-tailed (a few confidently wrong examples carry much of a
cross-entropy's mean), and a mean's standard error grows with its tail: on probes of 30-200
examples the test passes few of the challengers that validation says are better. The hypothesis,
set before any robust statistic was computed: a robust paired statistic at the same nominal level
passes more of the better challengers without passing worse ones, because the tail examples of the
probe say little about those of the validation split. The rule, set with it: a statistic is taken
into the loop only if, replayed on finished runs, it passes no challenger more than 2% worse on
validation from the grid's best, no more such challengers from 10x off than the mean's z, and at
least 10 more of the challengers at least 5% better from 10x off.

The statistics, each in units of its own standard error (positive: the challenger lower):

- ``mean``: the end's test today (:func:`hpx.forks.fork.paired_gain`);
- ``trim10``, ``trim20``: Yuen's trimmed mean (10% or 20% cut from each tail of the differences)
  over its winsorized standard error;
- ``signrank``: Wilcoxon's signed-rank statistic, standardised (ties averaged, zeros dropped).

It reads the runs ``python -m benchmarks.lr.trainsplit`` stores (every grid run of the design
tasks, both seeds, with its losses per unit on the probe) and replays the test for each start
(0.1x, 1x, 10x the grid's best) against each challenger a half or a whole decade from it, as that
module does. The held-out tasks are not read.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from typing import Any

import torch

from benchmarks.lr.run import Run
from benchmarks.lr.trainsplit import replay_pairs, stored_design_runs
from hpx.forks.fork import paired_gain

__all__ = ["STATISTICS", "main", "signrank_z", "trimmed_z"]


def trimmed_z(d: torch.Tensor, trim: float) -> float:
    """Yuen's statistic of the paired differences ``d``: their mean with ``trim`` of them cut
    from each tail, over its standard error (the winsorized standard deviation over
    ``(1 - 2 trim) sqrt(n)``). ``trim = 0`` is the mean's z."""
    n = len(d)
    g = math.floor(trim * n)
    if n - 2 * g < 2:
        return 0.0
    s, _ = torch.sort(d.double())
    kept = s[g:n - g]
    w = torch.cat([kept[:1].expand(g), kept, kept[-1:].expand(g)])  # winsorized
    se = float(w.std()) / ((1 - 2 * g / n) * math.sqrt(n))
    m = float(kept.mean())
    if se == 0.0:
        return 0.0 if m == 0.0 else math.copysign(math.inf, m)
    return m / se


def signrank_z(d: torch.Tensor) -> float:
    """Wilcoxon's signed-rank statistic of the paired differences ``d``, standardised under
    symmetry about 0 (zeros dropped, tied magnitudes given their mean rank, the variance
    corrected for ties): positive when ``d`` leans positive."""
    d = d.double()
    d = d[d != 0]
    n = len(d)
    if n == 0:
        return 0.0
    mag = d.abs()
    order = torch.argsort(mag)
    ranks = torch.empty(n, dtype=torch.float64)
    srt = mag[order]
    i, ties = 0, 0.0
    while i < n:  # mean rank over each run of equal magnitudes
        j = i
        while j + 1 < n and srt[j + 1] == srt[i]:
            j += 1
        ranks[order[i:j + 1]] = (i + j) / 2 + 1
        t = j - i + 1
        ties += t ** 3 - t
        i = j + 1
    w = float(ranks[d > 0].sum())
    mean = n * (n + 1) / 4
    var = n * (n + 1) * (2 * n + 1) / 24 - ties / 48
    return 0.0 if var <= 0 else (w - mean) / math.sqrt(var)


STATISTICS: dict[str, Callable[[torch.Tensor], float]] = {
    "mean": lambda d: paired_gain(torch.zeros_like(d), d),
    "trim10": lambda d: trimmed_z(d, 0.10),
    "trim20": lambda d: trimmed_z(d, 0.20),
    "signrank": signrank_z,
}


def _gains(store: dict[str, Any], a: Run, b: Run) -> dict[str, float]:
    """``b``'s lead over ``a`` on the probe, by every statistic (``inf`` when only ``a`` is lost)."""
    ua, ub = store[a.key]["units"], store[b.key]["units"]
    if ub is None or ua is None:
        return dict.fromkeys(STATISTICS, -math.inf if ub is None else math.inf)
    pa = torch.tensor(ua["probe"], dtype=torch.float64)
    pb = torch.tensor(ub["probe"], dtype=torch.float64)
    fa, fb = bool(torch.isfinite(pa).all()), bool(torch.isfinite(pb).all())
    if not (fa and fb):
        return dict.fromkeys(STATISTICS, math.inf if fa else -math.inf)
    return {k: f(pa - pb) for k, f in STATISTICS.items()}


def pairs(tasks: list[str], grids: dict[str, Any], store: dict[str, Any]) -> list[dict[str, Any]]:
    """Every (start, challenger) pair of ``benchmarks.lr.trainsplit.pairs``, with every statistic."""
    def gains(a: Run, b: Run) -> dict[str, Any]:
        units = store[a.key]["units"]
        return {"units": len(units["probe"]) if units else 0, **_gains(store, a, b)}

    return replay_pairs(tasks, grids, gains)


def table(rows: list[dict[str, Any]], z: float = 2.0) -> str:
    """One line per statistic: what passing at ``z`` does, as ``benchmarks.lr.trainsplit`` counts it."""
    lines = [f"| statistic (passes at z >= {z:g}) | from 1x: bad passes | from 10x off: good passes (of "
             "better by 5%+) | from 10x off: bad passes | all: good / bad passes |",
             "| --- | --- | --- | --- | --- |"]
    off = [r for r in rows if r["start"] != "1x"]
    better = [r for r in off if r["ratio"] <= 1 / 1.05]
    for name in STATISTICS:
        passed = [r for r in rows if r[name] >= z]
        bad_best = sum(r["start"] == "1x" and r["ratio"] > 1.02 for r in passed)
        good_off = sum(r[name] >= z for r in better)
        bad_off = sum(r["start"] != "1x" and r["ratio"] > 1.02 for r in passed)
        good = sum(r["ratio"] < 0.98 for r in passed)
        bad = sum(r["ratio"] > 1.02 for r in passed)
        lines.append(f"| {name} | {bad_best} | {good_off} of {len(better)} | {bad_off} | {good} / {bad} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.lr.endtest")
    p.add_argument("--z", type=float, nargs="+", default=[2.0], help="the thresholds to read")
    p.add_argument("--show", action="store_true", help="print every pair the statistics disagree on")
    a = p.parse_args(argv)
    tasks, grids, store = stored_design_runs()
    rows = pairs(tasks, grids, store)
    for z in a.z:
        print(table(rows, z))
        print()
    if a.show:
        for r in rows:
            verdicts = " ".join("P" if r[k] >= a.z[0] else "." for k in STATISTICS)
            if len(set(verdicts.split())) > 1:
                stats = " ".join(f"{k} {r[k]:6.2f}" for k in STATISTICS)
                print(f"{r['task']:24s} {r['start']:5s} {r['dk']:+d} s{r['seed']} n {r['units']:5d} val "
                      f"{r['ratio']:.3f} {stats}  {verdicts}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
