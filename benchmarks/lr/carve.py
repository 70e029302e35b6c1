"""What carving the probe out of the training data costs: plain training without the probe's
examples (as the suite trains, and as a user without a validation split of their own would) against
plain training on them too.

    python -m benchmarks.lr.carve [--tasks ...] [--jobs 2] [--report-only]

``hpx.Forks`` scores its forks on held-out batches, the probe. A user who has a validation split
already gives it as the probe and trains on everything else, as before: the probe costs nothing.
A user who has none carves the probe out of the training data, and trains on less. This measures
that price on every suite task whose data are rows (a language model's text is not split into
rows): each task's plain run at the grid's best peak lr, 4 seeds, trained on the training split
alone (as the grid trains) and on the training split with the probe's examples put back
(``get_task("<task>@whole")``), the same model, optimizer, schedule and number of steps, judged
on the same validation split. Another training set draws other batches, and on small data that
alone moves a run's end by tens of percent, so the ratio carved / whole is read as the geometric
mean over the seeds (paired: one seed, one initialisation) with its standard error. Runs go to
``benchmarks/lr/stored/carve.json`` (committed; about 5 minutes on two cores); the section goes to
docs/benchmarks.md. ``--report-only`` runs nothing and rebuilds
the section from the committed stores, or names the command that makes what is missing.
"""

from __future__ import annotations

import math
import statistics
from typing import Any

from benchmarks import _store
from benchmarks.lr.__main__ import (
    GRIDS,
    STORED,
    _load,
    _run_all,
    best_of_grid,
    numerics_problem,
    study_args,
    write_section,
)
from benchmarks.lr.run import Run
from benchmarks.lr.tasks import HELD_OUT, TASKS, WHOLE, get_task

__all__ = ["COMMAND", "STORE", "TITLE", "main", "rows", "section"]

STORE = STORED / "carve.json"
COMMAND = "python -m benchmarks.lr.carve"
TITLE = "What carving the probe out of the training data costs"
SEEDS = tuple(range(4))  # the grid's two and two more: one pair of runs is too noisy on small data


def row_tasks() -> list[str]:
    """The suite's tasks whose training data are rows (every one but the language models' texts)."""
    return [t for t in TASKS if "stream" not in get_task(t).data()]


def _runs(task: str, grids: dict[str, Any]) -> list[tuple[Run, Run]]:
    """Per seed, (carved, whole): plain training at the grid's best lr without and with the probe."""
    i, lrs, _ = best_of_grid(task, grids)
    return [(Run(task, "plain", lrs[i], s), Run(f"{task}{WHOLE}", "plain", lrs[i], s)) for s in SEEDS]


def _val(run: Run, grids: dict[str, Any], store: dict[str, Any]) -> float:
    """A run's validation loss: from the grid where it has the run (seeds 0 and 1 carved), else
    from this store; NaN for a run that diverged."""
    r = grids.get(run.key) or store[run.key]
    return float("nan") if r["val"] is None else r["val"]


def rows(tasks: list[str], grids: dict[str, Any], store: dict[str, Any]) -> list[dict[str, Any]]:
    """Per task: the probe's share of the rows, the mean validation loss carved and whole over the
    seeds, and carved / whole as the geometric mean of the seeds' paired ratios with its standard
    error (``se``, in the log: the ratio's 2-SE band is ``ratio * exp(+-2 se)``)."""
    out = []
    for task in tasks:
        data = get_task(task).data()
        probe = sum(len(y) for _, y in data["probe"])
        pairs = [(_val(c, grids, store), _val(w, grids, store)) for c, w in _runs(task, grids)]
        logs = [math.log(c / w) for c, w in pairs if c > 0 and w > 0]  # NaN (diverged) compares False
        mean = statistics.fmean(logs) if logs else float("nan")
        se = statistics.stdev(logs) / math.sqrt(len(logs)) if len(logs) > 1 else float("nan")
        share = probe / (probe + len(data["train"][1]))
        out.append({"task": task, "held_out": task in HELD_OUT, "share": share,
                    "carved": statistics.fmean(c for c, _ in pairs),
                    "whole": statistics.fmean(w for _, w in pairs),
                    "ratio": math.exp(mean), "se": se, "pairs": len(logs)})
    return out


def _clear(r: dict[str, Any]) -> int:
    """1 where carving costs this task more than 2% and more than twice the ratio's standard error,
    -1 where it gains that much, else 0."""
    log = math.log(r["ratio"])
    return int(abs(log) > max(math.log(1.02), 2 * r["se"])) * (1 if log > 0 else -1)


def _worse(r: dict[str, Any]) -> bool:
    return _clear(r) > 0


def _summary(name: str, table: list[dict[str, Any]]) -> str:
    ratios = [r["ratio"] for r in table]
    return (f"{name}: {len(table)} tasks, carved / whole median {statistics.median(ratios):.3f} "
            f"(range {min(ratios):.3f}-{max(ratios):.3f}); worse carved by more than 2% and 2 standard "
            f"errors on {sum(map(_worse, table))} of {len(table)}, better so on "
            f"{sum(_clear(r) < 0 for r in table)}")


def section(tasks: list[str], grids: dict[str, Any], store: dict[str, Any]) -> str:
    """The section's body from the stores."""
    table = sorted(rows(tasks, grids, store), key=lambda r: (r["held_out"], -r["share"]))
    lines = [f"Produced by `{COMMAND}` (which writes this section) from its runs "
             f"(`{_store.shown(STORE)}`) and the grid's.", "",
             f"Each task's plain run at the grid's best peak lr, {len(SEEDS)} seeds, trained without the "
             "probe's examples (the probe carved out of the training data, as the suite trains) and "
             "with them (nothing carved): the same model, optimizer, schedule and steps, judged on the "
             "same validation split. *carved / whole* is the geometric mean of the seeds' paired ratios "
             "(another training set draws other batches, which alone moves a small task's end by tens "
             "of percent); *2 SE* is the band of two standard errors around it; *worse* marks a task "
             "whose carving costs more than 2% and more than that band.", "",
             "| task | held out | probe's share of the rows | carved val | whole val | carved / whole "
             "| 2 SE | worse |",
             "| --- | --- | ---: | ---: | ---: | ---: | --- | --- |"]
    for r in table:
        band = f"{r['ratio'] * math.exp(-2 * r['se']):.3f}-{r['ratio'] * math.exp(2 * r['se']):.3f}"
        lines.append(f"| {r['task']} | {'yes' if r['held_out'] else ''} | {r['share']:.0%} | "
                     f"{r['carved']:.4g} | {r['whole']:.4g} | {r['ratio']:.3f} | {band} | "
                     f"{'yes' if _worse(r) else ''} |")
    lines.append("")
    for name, part in (("design", [r for r in table if not r["held_out"]]),
                       ("held out", [r for r in table if r["held_out"]])):
        if part:
            lines.append(f"- {_summary(name, part)};")
    for lo, hi in ((0.0, 0.10), (0.10, 0.20), (0.20, 1.0)):
        part = [r for r in table if lo <= r["share"] < hi]
        if part:
            lines.append(f"- probe {lo:.0%} to {hi:.0%} of the rows: {_summary('both sets', part)};")
    lines[-1] = lines[-1][:-1] + "."
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    a = study_args(COMMAND, __doc__, "every task of rows", argv)
    tasks = a.tasks if a.tasks is not None else row_tasks()
    grids, store = _load(GRIDS), _load(STORE)
    runs = [r for t in tasks for pair in _runs(t, grids) for r in pair if r.key not in grids]
    if a.report_only:
        lacking = sorted({r.task.removesuffix(WHOLE) for r in runs if r.key not in store})
        if lacking:
            _store.refuse(STORE, COMMAND, lacks=", ".join(lacking), note="about 10 min")
    else:
        numerics_problem(tasks[0], grids)
        _run_all(runs, store, STORE, a.jobs)
    body = section(tasks, grids, store)
    print(body)
    if a.tasks is None:
        write_section("lr-carve", TITLE, body, after="lr-probesize")
    else:  # the section shows every task: a row or a total of fewer would take the others' away
        _store.leave("lr-carve", "--tasks was given (the section shows every task)",
                     f"{COMMAND} --report-only")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
