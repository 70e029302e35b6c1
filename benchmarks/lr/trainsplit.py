"""Does the training split tell the end's test what a small probe cannot?

    python -m benchmarks.lr.trainsplit [--jobs 2]

The confident end (``hpx.Forks``) replaces your run with the challenger only when the challenger
beats it on the probe by 2 standard errors, example by example. On probes of 200 examples or fewer
that test lets too few better challengers through: a run started 10x too low keeps its start.
A run 10x too low is mostly *underfit*, and underfitting shows on the training split too, which
holds far more examples than the probe. The hypothesis, set before any of this ran: where the
probe leads the same way by at least 1 standard error and the training split (a fixed sample of at
most 2,000 of its units, in eval mode) by at least 3, the challenger is better on validation. The
danger is overfitting: a faster run that fits the training split better and generalises worse,
which the probe's lead of 1 standard error is there to guard against.

It reruns every grid run of the design tasks (both seeds, plain training, the grid's batches; the
held-out tasks are not read), keeps each run's losses per unit on the probe and on the training
sample (``runs/lr/units.json``), and replays the end's test on finished runs: for each start
(0.1x, 1x, 10x the grid's best) and each challenger a half or a whole decade either side of it,
which rule lets the challenger through, and what that does on validation. Rules:

- ``probe z>=2``: the end's test today;
- ``probe z>=1 and train z>=3``: the hypothesis' addition (``either``: the two together);
- ``train z>=3``: the training split alone, to see how far it misleads;
- ``either, steps for train`` and ``steps z>=3``: the same with the run's own training losses in
  place of the sample (paired step by step over the steps after 25% of the run: what a loop has
  for free).

A pass is *good* when the challenger's validation loss is at least 2% below the start's, *bad*
when it is more than 2% above. Passes from the grid's best (1x) can only do harm.
"""

from __future__ import annotations

import argparse
import functools
import math
import os
from collections.abc import Callable
from typing import Any

import torch

from benchmarks.lr.__main__ import GRIDS, RUNS, SEEDS, _load, _run_all, _val, best_of_grid, grid_lrs
from benchmarks.lr.run import Run, execute
from benchmarks.lr.tasks import HELD_OUT, TASKS
from hpx.forks.fork import paired_gain

__all__ = ["main", "replay_pairs", "stored_design_runs", "val_ratio"]

STORE = RUNS / "units.json"

RULES = {
    "probe z>=2": lambda p, t, s: p >= 2,
    "probe z>=1 and train z>=3": lambda p, t, s: p >= 1 and t >= 3,
    "either": lambda p, t, s: p >= 2 or (p >= 1 and t >= 3),
    "train z>=3": lambda p, t, s: t >= 3,
    "either, steps for train": lambda p, t, s: p >= 2 or (p >= 1 and s >= 3),
    "steps z>=3": lambda p, t, s: s >= 3,
}


def stored_design_runs() -> tuple[list[str], dict[str, Any], dict[str, Any]]:
    """The design tasks, the grid and the runs this module stores (their losses per unit), for the
    replays that read them (``benchmarks.lr.endtest``, ``benchmarks.lr.sweep``); exits naming this
    command when the store lacks a design task."""
    tasks = [t for t in TASKS if t not in HELD_OUT]
    grids, store = _load(GRIDS), _load(STORE)
    missing = [t for t in tasks if not any(k.startswith(f"{t}|") for k in store)]
    if missing:
        raise SystemExit(f"{STORE} holds no runs of {', '.join(missing)}: run "
                         "`python -m benchmarks.lr.trainsplit` first (it stores them)")
    return tasks, grids, store


def val_ratio(va: float, vb: float) -> float:
    """The challenger's validation loss ``vb`` over the start's ``va``: 0 when only the start is lost,
    ``inf`` when the challenger is (or the start's loss is 0 and the challenger's is not), 1 when
    both are 0 (a run can fit a small validation split exactly)."""
    if not math.isfinite(vb):
        return math.inf
    if not math.isfinite(va):
        return 0.0
    if va == 0:
        return 1.0 if vb == 0 else math.inf
    return vb / va


def _gain(store: dict[str, Any], a: Run, b: Run, part: str) -> float:
    """``b``'s lead over ``a`` on ``part`` (``"probe"`` or ``"train"``) in standard errors of the
    paired per-unit difference (``inf`` when ``a`` is lost and ``b`` is not)."""
    ua, ub = store[a.key]["units"], store[b.key]["units"]
    if ub is None:
        return -math.inf
    if ua is None:
        return math.inf
    return paired_gain(torch.tensor(ub[part], dtype=torch.float64),
                       torch.tensor(ua[part], dtype=torch.float64))


def _steps_gain(store: dict[str, Any], a: Run, b: Run, after: float = 0.25) -> float:
    """``b``'s lead over ``a`` in training loss, paired step by step over the steps after ``after``
    of the run (both see the same batches), in standard errors (steps as units)."""
    la, lb = store[a.key]["step_losses"], store[b.key]["step_losses"]
    k = round(after * len(la))
    return paired_gain(torch.tensor(lb[k:], dtype=torch.float64), torch.tensor(la[k:], dtype=torch.float64))


def replay_pairs(tasks: list[str], grids: dict[str, Any],
                 gains: Callable[[Run, Run], dict[str, float]]) -> list[dict[str, Any]]:
    """Every (start, challenger) pair the end's test could face on the grid's finished runs: each
    start (0.1x, 1x, 10x the grid's best) against each challenger a half or a whole decade from it,
    both seeds, with the challenger's validation loss over the start's (``ratio``) and what
    ``gains(start, challenger)`` reads."""
    out = []
    for task in tasks:
        i, lrs, _ = best_of_grid(task, grids)
        for start, k0 in (("0.1x", -2), ("1x", 0), ("10x", 2)):
            for dk in (-2, -1, 1, 2):
                if not (0 <= i + k0 < len(lrs) and 0 <= i + k0 + dk < len(lrs)):
                    continue
                for seed in SEEDS:
                    a, b = (Run(task, "plain", lrs[i + k], seed) for k in (k0, k0 + dk))
                    out.append({"task": task, "start": start, "dk": dk, "seed": seed,
                                "ratio": val_ratio(_val(grids, a), _val(grids, b)), **gains(a, b)})
    return out


def pairs(tasks: list[str], grids: dict[str, Any], store: dict[str, Any]) -> list[dict[str, Any]]:
    """Every (start, challenger) pair the end's test could face, with both gains and the outcome."""
    return replay_pairs(tasks, grids, lambda a, b: {
        "probe": _gain(store, a, b, "probe"), "train": _gain(store, a, b, "train"),
        "steps": _steps_gain(store, a, b)})


def _table(rows: list[dict[str, Any]]) -> str:
    lines = ["| rule | from 1x: bad passes | from 10x off: good passes (of better by 5%+) | "
             "from 10x off: bad passes | all: good / bad passes |",
             "| --- | --- | --- | --- | --- |"]
    for name, rule in RULES.items():
        passed = [r for r in rows if rule(r["probe"], r["train"], r["steps"])]
        best = [r for r in passed if r["start"] == "1x" and r["ratio"] > 1.02]
        off = [r for r in rows if r["start"] != "1x"]
        better = [r for r in off if r["ratio"] <= 1 / 1.05]
        good_off = [r for r in better if rule(r["probe"], r["train"], r["steps"])]
        bad_off = [r for r in passed if r["start"] != "1x" and r["ratio"] > 1.02]
        good = sum(r["ratio"] < 0.98 for r in passed)
        bad = sum(r["ratio"] > 1.02 for r in passed)
        lines.append(f"| {name} | {len(best)} | {len(good_off)} of {len(better)} | {len(bad_off)} | "
                     f"{good} / {bad} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.lr.trainsplit")
    p.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1))
    p.add_argument("--show", action="store_true", help="print every pair a rule passes or fails to pass")
    a = p.parse_args(argv)
    tasks = [t for t in TASKS if t not in HELD_OUT]
    grids = _load(GRIDS)
    store = _load(STORE)
    runs = [Run(t, "plain", lr, s) for t in tasks for lr in grid_lrs(t, grids) for s in SEEDS]
    _run_all(runs, store, STORE, a.jobs, functools.partial(execute, units=True))
    for r in runs:  # the rerun is the grid's run
        new, old = store[r.key]["val"], grids[r.key]["val"]
        if (new is None) != (old is None) or (new is not None and abs(new - old) > 1e-3 * abs(old)):
            raise SystemExit(f"{r.key}: the rerun's validation loss {new} is not the grid's {old}")
    rows = pairs(tasks, grids, store)
    print(_table(rows))
    if a.show:
        for r in rows:
            verdicts = " ".join("P" if rule(r["probe"], r["train"], r["steps"]) else "."
                                for rule in RULES.values())
            print(f"{r['task']:24s} {r['start']:5s} {r['dk']:+d} s{r['seed']} val {r['ratio']:.3f} probe z "
                  f"{r['probe']:6.2f} train z {r['train']:6.2f} steps z {r['steps']:6.2f}  {verdicts}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
