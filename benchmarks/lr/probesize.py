"""What the probe's size does to a search, on the same tasks: their probes cut smaller.

    python -m benchmarks.lr.probesize [--method Forks] [--tasks ...] [--sizes 100]

Across the suite, the tasks whose probe is small are also the small-data tasks, so a search that
misses on them may miss for either reason. This separates the two: it reruns the method on tasks
whose probe holds more than 200 examples (design tasks by default), from the suite's three starts
and two seeds, with each task's probe cut to its first ``n`` examples (tokens for a language model,
in whole sequences; ``get_task("<task>@probe<n>")``), everything else as in the suite (data,
batches, model, optimizer, schedule, the plain-training grid it is judged against). The table
reads the bar's quality rows for each task with its whole probe (the method's stored suite runs,
``python -m benchmarks.lr eval``) and cut. Results go to ``benchmarks/lr/stored/probesize.json``
(committed: about 30 min on two cores for the default tasks and ``--sizes 200 100``); the section
goes to docs/benchmarks.md from that run (``--method Forks --sizes 200 100``, the default tasks):
another method's, tasks' or sizes' run prints its table and leaves the section as it is.
``--report-only`` with the same flags runs nothing and rebuilds the section from the committed
stores alone, or names the command that makes what is missing.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from benchmarks import _store
from benchmarks.lr.__main__ import (
    GRIDS,
    PROBE_SPLIT,
    SEEDS,
    STORED,
    _load,
    _run_all,
    bar_counts,
    cells,
    numerics_problem,
    probe_size,
    suite_runs,
    table,
    write_section,
)
from benchmarks.lr.run import METHODS, Run
from benchmarks.lr.tasks import HELD_OUT, TASKS

__all__ = ["main"]

STORE = STORED / "probesize.json"
METHOD, SIZES = "Forks", [200, 100]  # the section's: on the default tasks
COMMAND = f"python -m benchmarks.lr.probesize --method {METHOD} --sizes {' '.join(map(str, SIZES))}"
TITLE = "What the probe's size does: the same tasks, their probes cut"


def _as_base(store: dict[str, Any], variant: str, base: str, method: str) -> dict[str, Any]:
    """The variant's runs keyed as the base task's, so the suite's table reads them."""
    out = {}
    for key, r in store.items():
        task, m, rest = key.split("|", 2)
        if task == variant and m == method:
            out[f"{base}|{m}|{rest}"] = r
    return out


def markdown(method: str, sizes: list[int], tasks: list[str], full: dict[str, list[dict[str, Any]]],
             cut: dict[tuple[str, int], list[dict[str, Any]]]) -> str:
    def cell(rows: list[dict[str, Any]]) -> str:
        c = bar_counts(rows)
        return f"{c[0]}/{c[1]}, {c[2]}/{c[3]}, {c[4]}/{c[5]}"

    command = f"python -m benchmarks.lr.probesize --method {method} --sizes {' '.join(map(str, sizes))}"
    lines = [f"Produced by `{command}` (which writes this section), one thread per run, two runs at a "
             "time.", "",
             "Across the suite the tasks whose probe is small are also the small-data ones, so a miss "
             "there has two suspects. This reruns the method on tasks whose probe holds more than 200 "
             "examples, from the suite's three starts and two seeds, with the probe cut to its first "
             "`n` examples (tokens for a language model, in whole sequences); the data, batches, model, "
             "optimizer, schedule and the grid it is judged against are the suite's. Each cell reads "
             "the bar's quality rows: no harm (tasks), recovered from 10x off (cells), the lr within 3x "
             "of the grid's best (cells).", "",
             "| task | held out | probe | " + " | ".join(f"probe cut to {n}" for n in sizes) + " |",
             "| --- | --- | --- | " + " | ".join("---" for _ in sizes) + " |"]
    for t in tasks:
        lines.append(f"| {t} | {'yes' if t in HELD_OUT else ''} | {probe_size(t)}: {cell(full[t])} | "
                     + " | ".join(cell(cut[(t, n)]) for n in sizes) + " |")
    every = [r for t in tasks for r in full[t]]
    lines.append(f"| all | | {cell(every)} | "
                 + " | ".join(cell([r for t in tasks for r in cut[(t, n)]]) for n in sizes) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.lr.probesize", description=__doc__.split("\n")[0])
    p.add_argument("--method", default="Forks", choices=sorted(METHODS))
    p.add_argument("--tasks", nargs="*",
                   default=[t for t in TASKS if t not in HELD_OUT and probe_size(t) > PROBE_SPLIT])
    p.add_argument("--sizes", nargs="+", type=int, default=[100])
    p.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1))
    p.add_argument("--mixed-numerics", action="store_true",
                   help="run against a stored grid whose runs this machine does not repeat bit for bit")
    p.add_argument("--report-only", action="store_true",
                   help="run nothing: the section from the committed stores (give the same flags as the run)")
    a = p.parse_args(argv)
    grids = _load(GRIDS)
    # the method's whole-probe runs are the suite's: without them nothing here is worth running
    suite = suite_runs(a.method, a.tasks, grids)
    store = _load(STORE)
    runs = [Run(f"{t}@probe{n}", a.method, lr, s) for t in a.tasks for n in a.sizes
            for lr in cells(t, grids).values() for s in SEEDS]
    if a.report_only:  # every run the section reads must be stored: else say which command makes them
        lacking = sorted({r.task for r in runs if r.key not in store})
        if lacking:
            _store.refuse(STORE, COMMAND, lacks=", ".join(lacking), note="about 30 min")
    else:
        if not a.mixed_numerics:
            numerics_problem(a.tasks[0], grids)
        _run_all(runs, store, STORE, a.jobs)
    body = section(a.method, a.sizes, a.tasks, grids, suite, store)
    print(body)
    # the section is one method's on the default tasks, a column per size: a run of another method,
    # of fewer tasks or sizes writes nothing there, where it would take a table, row or column away
    if a.method == METHOD and a.sizes == SIZES and a.tasks == p.get_default("tasks"):
        write_section("lr-probesize", TITLE, body, after="lr-ceiling")
    else:
        _store.leave("lr-probesize", "its --method, --tasks or --sizes are not the section's",
                     f"{COMMAND} --report-only")
    return 0


def section(method: str, sizes: list[int], tasks: list[str], grids: dict[str, Any], suite: dict[str, Any],
            store: dict[str, Any]) -> str:
    """The section's body from the method's suite runs (``suite``, the whole probe) and the runs with
    the probe cut (``store``)."""
    full = {t: table(method, [t], grids, suite) for t in tasks}
    cut = {(t, n): table(method, [t], grids, _as_base(store, f"{t}@probe{n}", t, method))
           for t in tasks for n in sizes}
    return markdown(method, sizes, tasks, full, cut)


if __name__ == "__main__":
    raise SystemExit(main())
