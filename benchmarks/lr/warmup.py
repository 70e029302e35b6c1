"""Recovery under a warm-up: hpx.Forks' cuts against the same cuts after the schedule's peak.

``hpx.Forks`` and its prototype loop with their cuts at shares of the whole run, against the
prototype with the same cuts placed in the steps after the schedule's peak, on every OneCycleLR
task of the suite.

    python -m benchmarks.lr.warmup [--tasks ...] [--jobs 2] [--report-only]

Under OneCycleLR's default 30% warm-up, ``hpx.Forks``' first cut (10% of the run) and second (25%)
fall where a fork's lr is still a fraction of its peak, and a slower fork has made a fraction of a
faster one's progress. The variant is hpx.Forks' prototype loop (``halving-end-cool-z2-lost-last``,
which ends every suite cell it was checked on at hpx.Forks' lr and loss, bit for bit: ``python -m
benchmarks.lr same``) with ``peaked=True`` (``benchmarks/lr/prototypes.py``): a cut at ``c`` of the
run moves to ``p + c (1 - p)``, ``p`` the share of the run before the schedule's peak (0.3 here:
cuts at 37% and 47.5%); a schedule that starts at its peak keeps its cuts.

A run's end depends on the machine's floating-point kernels, chaotically on some tasks, so this
benchmark makes its own grid of its tasks on the machine that runs the searches, into its own store
(``benchmarks/lr/stored/warmup.json``, committed; about 20 minutes on two cores): plain training at
each peak lr as ``python -m benchmarks.lr grid`` makes it, then the three searches from 0.1x, 1x and
10x the grid's best, 2 seeds; a store made on another machine is refused before anything runs (the
check ``python -m benchmarks.lr eval`` makes). Design and held-out tasks are reported apart. The
prototype decides a cut at once on copies trained on the batches ahead, so its cut forks stop
there, while hpx.Forks trains them through the copies' window: the steps are compared between the
prototype's two placements. ``--report-only`` runs
nothing and rebuilds the section from the committed store, or names the command that makes what is
missing.
"""

from __future__ import annotations

import math
import statistics
from typing import Any

from benchmarks import _store
from benchmarks.lr.__main__ import (
    SEEDS,
    STORED,
    _load,
    _run_all,
    agreement,
    cells,
    grid_complete,
    numerics_problem,
    run_grid,
    study_args,
    table,
    write_section,
)
from benchmarks.lr.run import Run
from benchmarks.lr.tasks import HELD_OUT, TASKS, get_task

__all__ = ["COMMAND", "METHODS", "STORE", "TITLE", "main", "onecycle_tasks", "section", "summary"]

STORE = STORED / "warmup.json"
COMMAND = "python -m benchmarks.lr.warmup"
TITLE = "Recovery under a warm-up: cuts after the schedule's peak"
METHODS = {"Forks": "hpx.Forks: at 10% and 25% of the run",
           "halving-end-cool-z2-lost-last": "its prototype loop: the same",
           "halving-end-cool-z2-lost-last-peak": "the prototype: the same shares of the steps after the peak"}
SHARES, PEAK = "halving-end-cool-z2-lost-last", "halving-end-cool-z2-lost-last-peak"  # the pair compared


def onecycle_tasks() -> list[str]:
    """The suite's tasks under OneCycleLR with torch's default warm-up (30% of the run)."""
    return [t for t in TASKS if get_task(t).sched == "onecycle"]


def _method_runs(tasks: list[str], store: dict[str, Any]) -> list[Run]:
    return [Run(t, m, lr, s) for m in METHODS for t in tasks for lr in cells(t, store).values()
            for s in SEEDS]


def _apart(x: float, y: float) -> bool:
    """Whether two readings differ (a run diverged under one method alone counts as apart)."""
    return math.isnan(x) != math.isnan(y) or (not math.isnan(x) and abs(x - y) > 1e-9 * max(1.0, abs(x)))


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The rows the section reads, per set of rows (one method, one set of tasks): no harm at the
    grid's best (and the largest ratio to plain training there), recovered from 0.1x and from 10x
    (within 5% of the oracle), the lr within 3x of the grid's best."""
    def within(start: str) -> tuple[int, int]:
        part = [r for r in rows if r["start"] == start]
        return sum(r["vs_oracle"] <= 1.05 for r in part), len(part)

    at = [r for r in rows if r["start"] == "1x"]
    return {"no_harm": (sum(r["vs_plain"] <= 1.02 for r in at), len(at)),
            "worst": max((r["vs_plain"] for r in at if not math.isnan(r["vs_plain"])), default=math.nan),
            "low": within("0.1x"), "high": within("10x"),
            "lr3": (sum(1 / 3 <= r["end_vs_oracle"] <= 3 for r in rows), len(rows))}


def _steps(tasks: list[str], method: str, store: dict[str, Any]) -> list[float]:
    return [store[r.key]["steps"] for r in _method_runs(tasks, store) if r.method == method]


def section(tasks: list[str], store: dict[str, Any]) -> str:
    """The section's body from the store."""
    sets = (("design", [t for t in tasks if t not in HELD_OUT]),
            ("held out", [t for t in tasks if t in HELD_OUT]))
    runs = {m: {k: v for k, v in store.items() if f"|{m}|" in k} for m in (SHARES, "Forks")}
    both, differ = agreement(SHARES, "Forks", runs[SHARES], runs["Forks"])
    lines = [f"Produced by `{COMMAND}` (which writes this section) from its store (`{_store.shown(STORE)}`): "
             "each task's grid of peak lrs rerun by it, on the machine that ran the searches, then each "
             "search from 0.1x, 1x and 10x the grid's best, 2 seeds: hpx.Forks, its prototype loop "
             f"(`benchmarks/lr/prototypes.py`; it ends {both - len(differ)} of these {both} runs at "
             "hpx.Forks' lr and validation loss), and the prototype with every cut moved among the steps "
             "after the schedule's peak (at 37% and 47.5% of a OneCycleLR run, whose warm-up is 30% of "
             "it). The prototype decides a cut at once, on annealed copies trained on the batches to "
             "come, so the forks it cuts stop there; hpx.Forks, which sees one batch at a time, trains "
             "them through the copies' window: the two count their steps apart, and the pair compared is "
             "the prototype's.", "",
             "| tasks | cuts | no harm (<= 1.02 plain at the best) | the largest | recovered from 0.1x "
             "| recovered from 10x above | lr within 3x | optimizer steps / plain's (median) |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    frac = lambda x: f"{x[0]} of {x[1]}"  # noqa: E731
    for name, part in sets:
        if not part:
            continue
        for method, what in METHODS.items():
            s = summary(table(method, part, store, store))
            steps = _steps(part, method, store)
            lines.append(f"| {name} ({len(part)}) | {what} | {frac(s['no_harm'])} | {s['worst']:.3f} | "
                         f"{frac(s['low'])} | {frac(s['high'])} | {frac(s['lr3'])} | "
                         f"{statistics.median(steps):.2f}x |")
    lines += ["", "Cell by cell, where the prototype's two placements differ (the search's validation loss "
              "over the oracle's, mean of 2 seeds, and the lr it ends at over the grid's best):", "",
              "| task | held out | start | shares of the run | after the peak |",
              "| --- | --- | --- | --- | --- |"]
    whole, peak = (table(m, tasks, store, store) for m in (SHARES, PEAK))
    for a, b in zip(whole, peak):
        if _apart(a["vs_oracle"], b["vs_oracle"]) or _apart(a["end_vs_oracle"], b["end_vs_oracle"]):
            lines.append(f"| {a['task']} | {'yes' if a['held_out'] else ''} | {a['start']} | "
                         f"{a['vs_oracle']:.3f} (lr {a['end_vs_oracle']:.3g}x) | "
                         f"{b['vs_oracle']:.3f} (lr {b['end_vs_oracle']:.3g}x) |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    a = study_args(COMMAND, __doc__, "every OneCycleLR task", argv)
    tasks = a.tasks if a.tasks is not None else onecycle_tasks()
    store = _load(STORE)
    if a.report_only:
        lacking = [t for t in tasks if not grid_complete(t, store)
                   or any(r.key not in store for r in _method_runs([t], store))]
        if lacking:
            _store.refuse(STORE, f"{COMMAND} --tasks {' '.join(lacking)}", lacks=", ".join(lacking),
                          note="about 1 min a task")
    else:
        held = [t for t in tasks if grid_complete(t, store)]
        if held:  # a store made elsewhere would mix two machines' kernels: refused, naming the fix
            numerics_problem(held[0], store)
        run_grid(tasks, store, a.jobs, None, STORE)
        _run_all(_method_runs(tasks, store), store, STORE, a.jobs)
    body = section(tasks, store)
    print(body)
    if a.tasks is None:
        write_section("lr-warmup", TITLE, body, after="lr-carve")
    else:  # the section shows every task: a row or a total of fewer would take the others' away
        _store.leave("lr-warmup", "--tasks was given (the section shows every task)",
                     f"{COMMAND} --report-only")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
