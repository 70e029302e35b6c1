"""hpx.Forks beside Optuna on the learning-rate suite's held-out tasks, on one machine's own grid.

    python -m benchmarks.lr.sidebyside [--jobs 2] [--report-only]

The suite's committed grid (``benchmarks/lr/grids.json``) was made on another machine, and where a
run ends depends on the floating-point kernels it ran on (docs/method.md, "What the suite can
resolve"), so this side-by-side makes its own grid of the 29 held-out tasks on the machine that
runs the searches and keeps it with them: ``benchmarks/lr/stored/sidebyside-grid.json`` (the 2-seed
grid, extended as the suite's is) and ``benchmarks/lr/stored/sidebyside.json`` (the two methods'
runs). Before it adds a run it checks that this machine repeats the stored grid bit for bit, and
refuses, naming the fix, where it does not. Two methods, from 0.1x, 1x and 10x each task's grid's
best, 2 seeds:

* ``Forks``: ``hpx.Forks`` at its defaults;
* ``Optuna``: the standard tool at the same budget of optimizer steps (TPE + successive halving over
  separate trials, the start enqueued first: ``benchmarks/optuna_route.py``; ``pip install -e
  ".[bench]"``).

The section is written from the two stores alone (``--report-only`` runs nothing), so a clone
rebuilds it (``tests/test_stored_sections.py``). About 70 minutes on two cores from nothing.
"""

from __future__ import annotations

from typing import Any

from benchmarks import _store
from benchmarks.lr.__main__ import (
    SEEDS,
    STORED,
    _load,
    _run_all,
    best_of_grid,
    cells,
    grid_complete,
    run_grid,
    study_args,
    table,
    write_section,
)
from benchmarks.lr.run import Run, execute
from benchmarks.lr.staged import beside
from benchmarks.lr.tasks import HELD_OUT

__all__ = ["COMMAND", "GRID", "MARKER", "METHODS", "STORE", "TITLE", "main", "section"]

STORE = STORED / "sidebyside.json"
GRID = STORED / "sidebyside-grid.json"
COMMAND = "python -m benchmarks.lr.sidebyside"
MARKER = "lr-sidebyside"
TITLE = "hpx.Forks beside Optuna on the 29 held-out tasks, on one machine's own grid"
METHODS = ("Forks", "Optuna")


def _runs(tasks: list[str], grids: dict[str, Any]) -> list[Run]:
    """Task by task, both methods' runs of a task together."""
    return [Run(t, m, lr, s) for t in tasks for m in METHODS for lr in cells(t, grids).values()
            for s in SEEDS]


def _repeats(task: str, grids: dict[str, Any]) -> None:
    """Refuse, naming the fix, unless this machine ends ``task``'s best grid run (seed 0) where the
    stored grid does: the methods' runs made here are compared with those plain runs."""
    i, lrs, _ = best_of_grid(task, grids)
    run = Run(task, "plain", lrs[i], SEEDS[0])
    stored, now = grids[run.key]["val"], execute(run)["val"]
    if stored != now:
        raise SystemExit(f"{_store.shown(GRID)} does not repeat on this machine: {run.key} ended at "
                         f"validation loss {stored} there and {now} here (other floating-point kernels), so "
                         f"runs made here cannot be compared with it. Rebuild the section from the stores "
                         f"(`{COMMAND} --report-only`), or move both stores aside and rerun `{COMMAND}` to "
                         "make this machine's own grid and runs (about 70 minutes on two cores)")


def section(grids: dict[str, Any], store: dict[str, Any]) -> str:
    """The section's body from the stored grid and runs."""
    tasks = list(HELD_OUT)
    found = {m: [{**r, "held_out": True} for r in table(m, tasks, grids, store)] for m in METHODS}
    lines = [f"Produced by `{COMMAND}` (which writes this section) from its stores "
             f"(`{_store.shown(GRID)}`, this machine's own 2-seed grid of the {len(tasks)} held-out tasks, "
             f"and `{_store.shown(STORE)}`): "
             "each method from 0.1x, 1x and 10x the grid's best, 2 seeds, every run on the machine that made "
             "the grid. `Optuna` is TPE + successive halving over separate trials at hpx.Forks' budget of "
             "optimizer steps, the start enqueued first (`benchmarks/optuna_route.py`). The suite's section "
             "above reads hpx.Forks against the committed grid, made on another machine.", ""]
    lines += beside(found, store, tasks, grids)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    a = study_args(COMMAND, __doc__, "every held-out task", argv)
    if a.tasks is not None:
        raise SystemExit(f"{COMMAND} runs every held-out task (the section shows them all): drop --tasks")
    tasks = list(HELD_OUT)
    grids, store = _load(GRID), _load(STORE)
    lacking = [t for t in tasks if not grid_complete(t, grids)]
    todo = [r for r in _runs(tasks, grids) if r.key not in store] if not lacking else [None]
    if todo and a.report_only:
        missing = sorted(lacking or {r.task for r in todo if r is not None})
        _store.refuse(STORE if not lacking else GRID, COMMAND, lacks=", ".join(missing),
                      note="about 70 minutes on two cores")
    done = [t for t in tasks if grid_complete(t, grids)]
    if done and todo:  # a grid made elsewhere is not added to here
        _repeats(done[0], grids)
    if lacking:
        run_grid(lacking, grids, a.jobs, path=GRID)
    todo = [r for r in _runs(tasks, grids) if r.key not in store]
    if todo:
        _run_all(todo, store, STORE, a.jobs)
    body = section(grids, store)
    print(body)
    write_section(MARKER, TITLE, body, after="lr-staged")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
