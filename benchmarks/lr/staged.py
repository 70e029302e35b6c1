"""The eighth held-out set: warm-ups with probes of 300 examples or more, hpx.Forks beside Optuna.

    python -m benchmarks.lr.staged [--jobs 2] [--report-only]

The seventh held-out set (OneCycleLR tasks, most with probes of 200 examples or fewer) has judged
one warm-up design already, so the warm-up row is read here on fresh tasks, committed with their
grids before any design work on them (``benchmarks.lr.tasks.STAGED``): three under a 25% linear
warm-up + cosine, four under OneCycleLR's 30% warm-up, every probe 300 examples or more. Every cell
is held out. Two methods run from 0.1x, 1x and 10x each task's grid's best, 2 seeds, on the
committed grid (``benchmarks/lr/grids.json``; these tasks' grids were made on the machine that ran
the searches, and the command checks that this machine repeats them before anything runs):

* ``Forks``: ``hpx.Forks`` at its defaults;
* ``Optuna``: the standard tool at the same budget of optimizer steps (TPE + successive halving over
  separate trials, the start enqueued first: ``benchmarks/optuna_route.py``; ``pip install -e
  ".[bench]"``).

Both store into ``benchmarks/lr/stored/staged.json`` (committed), and the section is written from it
alone (``--report-only`` runs nothing), so a clone rebuilds it (``tests/test_stored_sections.py``).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks import _store
from benchmarks.lr.__main__ import (
    GRIDS,
    SEEDS,
    STORED,
    _load,
    _run_all,
    best_of_grid,
    cells,
    grid_complete,
    markdown,
    study_args,
    table,
    write_section,
)
from benchmarks.lr.run import Run, execute
from benchmarks.lr.tasks import STAGED

__all__ = ["COMMAND", "MARKER", "METHODS", "STORE", "TITLE", "main", "rows", "section"]

STORE = STORED / "staged.json"
COMMAND = "python -m benchmarks.lr.staged"
MARKER = "lr-staged"
TITLE = "The eighth held-out set: warm-ups with probes of 300 examples or more, hpx.Forks beside Optuna"
METHODS = ("Forks", "Optuna")
# The task whose first hpx.Forks runs exposed a fault (a run whose outputs overflowed the probe's
# float32 loss was stopped as the probe loss's fault; fixed in hpx/forks/faults.py): reported with
# the rest, and also left out in a second reading, since a fix was made after seeing it.
EXPOSED = "friedman_sgd_onecycle"


def _runs(tasks: list[str], grids: dict[str, Any]) -> list[Run]:
    return [Run(t, m, lr, s) for m in METHODS for t in tasks for lr in cells(t, grids).values()
            for s in SEEDS]


def rows(method: str, tasks: list[str], grids: dict[str, Any], store: dict[str, Any]) -> list[dict[str, Any]]:
    """The suite's rows (``benchmarks.lr.table``) of ``method`` on ``tasks``, every one held out."""
    return [{**r, "held_out": True} for r in table(method, tasks, grids, store)]


def _repeats(task: str, grids: dict[str, Any], command: str = COMMAND) -> None:
    """Refuse, naming the fix, unless this machine ends ``task``'s best grid run (seed 0) where the
    committed grid does: a method run here is compared with those plain runs."""
    i, lrs, _ = best_of_grid(task, grids)
    run = Run(task, "plain", lrs[i], SEEDS[0])
    stored, now = grids[run.key]["val"], execute(run)["val"]
    if stored != now:
        raise SystemExit(f"the committed grid does not repeat on this machine: {run.key} ended at validation "
                         f"loss {stored} there and {now} here (other floating-point kernels); its searches "
                         f"cannot be compared with it: run `{command} --report-only` to rebuild the section")


def _within(part: list[dict[str, Any]], start: str, bar: float = 1.05) -> tuple[int, int]:
    cells_ = [r for r in part if r["start"] == start]
    return sum(not math.isnan(r["vs_oracle"]) and r["vs_oracle"] <= bar for r in cells_), len(cells_)


def _at_or_below(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> tuple[int, int]:
    """Cells where ``a``'s validation loss (mean of the seeds) is at or below ``b``'s (NaN: a miss)."""
    ok = [not math.isnan(x["hpx"]) and (math.isnan(y["hpx"]) or x["hpx"] <= y["hpx"]) for x, y in zip(a, b)]
    return sum(ok), len(a)


def beside(found: dict[str, list[dict[str, Any]]], store: dict[str, Any], tasks: list[str],
           grids: dict[str, Any]) -> list[str]:
    """The lines a section of two methods side by side ends with: their bar's counts, each against
    the other cell by cell, their median steps, and each method's table (``found``: rows by method)."""
    frac = lambda x: f"{x[0]} of {x[1]}"  # noqa: E731
    methods = list(found)
    lines = ["| method | no harm (<= 1.02 plain at the best) | from 0.1x: within 1.05x the best "
             "| from 10x above: within 1.05x the best | at or below the other, cell by cell |",
             "| --- | ---: | ---: | ---: | ---: |"]
    for m, other in zip(methods, reversed(methods)):
        lines.append(f"| {m} | {frac(_harmless(found[m]))} | {frac(_within(found[m], '0.1x'))} | "
                     f"{frac(_within(found[m], '10x'))} | {frac(_at_or_below(found[m], found[other]))} |")
    steps = {m: statistics.median(store[Run(t, m, lr, s).key]["steps"] for t in tasks
                                  for lr in cells(t, grids).values() for s in SEEDS) for m in methods}
    lines += ["", "Optimizer steps over plain training's, median of the runs: "
              + ", ".join(f"{m} {steps[m]:.2f}x" for m in methods) + ".", ""]
    for m in methods:
        lines += [f"### {m}", "", markdown(m, found[m])]
    return lines


def _harmless(part: list[dict[str, Any]]) -> tuple[int, int]:
    """Starts at the grid's best that end within 2% of plain training there, of those started."""
    at = [r for r in part if r["start"] == "1x"]
    return sum(not math.isnan(r["vs_plain"]) and r["vs_plain"] <= 1.02 for r in at), len(at)


def section(grids: dict[str, Any], store: dict[str, Any]) -> str:
    """The section's body from the committed grid and the store."""
    tasks = list(STAGED)
    found = {m: rows(m, tasks, grids, store) for m in METHODS}
    frac = lambda x: f"{x[0]} of {x[1]}"  # noqa: E731
    kept = [t for t in tasks if t != EXPOSED]
    lines = [f"Produced by `{COMMAND}` (which writes this section) from its store "
             f"(`{_store.shown(STORE)}`) and the committed grid: {len(tasks)} tasks committed with their "
             "grids before any design work on them, every one held out; each method from 0.1x, 1x and 10x "
             "the grid's best, 2 seeds. `Optuna` is TPE + successive halving over separate trials at "
             "hpx.Forks' budget of optimizer steps, the start enqueued first "
             "(`benchmarks/optuna_route.py`).", "",
             "| tasks | method | no harm (<= 1.02 plain at the best) | from 0.1x: within 1.05x the best "
             "| from 10x above: within 1.05x the best | at or below the other, cell by cell |",
             "| --- | --- | ---: | ---: | ---: | ---: |"]
    for label, names in ((f"all {len(tasks)}", tasks), (f"without {EXPOSED} ({len(kept)})", kept)):
        part = {m: [r for r in found[m] if r["task"] in names] for m in METHODS}
        for m, other in zip(METHODS, reversed(METHODS)):
            at = [r for r in part[m] if r["start"] == "1x"]
            harm = sum(not math.isnan(r["vs_plain"]) and r["vs_plain"] <= 1.02 for r in at), len(at)
            lines.append(f"| {label} | {m} | {frac(harm)} | {frac(_within(part[m], '0.1x'))} | "
                         f"{frac(_within(part[m], '10x'))} | {frac(_at_or_below(part[m], part[other]))} |")
    steps = {m: statistics.median(store[Run(t, m, lr, s).key]["steps"] for t in tasks
                                  for lr in cells(t, grids).values() for s in SEEDS) for m in METHODS}
    lines += ["", "Optimizer steps over plain training's, median of the runs: "
              + ", ".join(f"{m} {steps[m]:.2f}x" for m in METHODS) + ".", "",
              f"{EXPOSED}'s first hpx.Forks runs exposed a fault: from 10x above, one seed's run blew up "
              "with its weights still finite and its probe loss overflowing float32, and the whole run was "
              "stopped as a fault of the probe's loss. The fix (a run whose probe loss is finite in "
              "float64 is lost, not an error) is a repair, not a tuned choice, but it was made after "
              "seeing this task, so the second reading leaves it out; digits_gru_onecycle was added, "
              "with its grid, before any search ran on it.", ""]
    for m in METHODS:
        lines += [f"### {m}", "", markdown(m, found[m])]
    return "\n".join(lines)


def study_set(argv: list[str] | None, doc: str, command: str, label: str, tasks: list[str], path: Path,
              section_of: Callable[[dict[str, Any], dict[str, Any]], str], marker: str, title: str,
              after: str, minutes: int) -> int:
    """A held-out set's command: every task of the set (``label`` names it in the help), hpx.Forks
    and Optuna from each start, into the store at ``path`` (a run refused where this machine does
    not repeat the committed grid), then the section (``section_of(grids, store)``) written after
    the one marked ``after``; ``--report-only`` writes it from the store alone."""
    a = study_args(command, doc, label, argv)
    if a.tasks is not None:
        raise SystemExit(f"{command} runs every task of the set (the section shows them all): drop --tasks")
    grids, store = _load(GRIDS), _load(path)
    lacking = [t for t in tasks if not grid_complete(t, grids)]
    if lacking:
        _store.refuse(GRIDS, f"python -m benchmarks.lr grid --tasks {' '.join(lacking)}",
                      lacks=", ".join(lacking))
    todo = [r for r in _runs(tasks, grids) if r.key not in store]
    if todo and a.report_only:
        missing = sorted({r.task for r in todo})
        _store.refuse(path, command, lacks=", ".join(missing), note=f"about {minutes} minutes on two cores")
    if todo:
        _repeats(tasks[0], grids, command)
        _run_all(todo, store, path, a.jobs)
    body = section_of(grids, store)
    print(body)
    write_section(marker, title, body, after=after)
    return 0


def main(argv: list[str] | None = None) -> int:
    return study_set(argv, __doc__, COMMAND, "every task of the eighth held-out set", list(STAGED), STORE,
                     section, MARKER, TITLE, "lr-warmup", 8)


if __name__ == "__main__":
    raise SystemExit(main())
