"""What the probe can tell: every grid run scored on the probe split at its end.

    python -m benchmarks.lr.ceiling [--tasks ...] [--jobs 2]
    python -m benchmarks.lr.ceiling --chunks 30 100 200   # the same, the probe cut smaller

A search reads the probe split (held-out batches carved from the training side); the suite judges
it on the validation split. This reruns every point of each task's grid (both seeds, plain
training, the same batches as ``python -m benchmarks.lr grid``), keeps the final weights' probe
loss beside the validation loss (and checks the latter against the stored grid; grid runs made
since the suite records the probe loss are read, not rerun), and asks which
peak lr the probe would choose among the complete runs of one seed: the *probe's pick*. That is
the ceiling of any search that learns from the probe, a selection made with the whole grid's
compute and the end of every run in hand. Where the probe's pick is not the grid's best, no
reading of the probe, early or late, cheap or not, points to the grid's best except by chance.

The table's criteria are the suite's bar read on the probe's pick (a selection does not depend on
the start, so it recovers from 10x below and above alike): its validation loss over plain
training's at the grid's best (mean of the 2 seeds, each seed's own pick), and its lr over the
grid's best. Reruns go to ``benchmarks/lr/stored/ceiling.json`` (every grid run keeps its probe
loss today, so there are none), the chunks' and the halves' runs beside it (committed:
``--report-only`` with the same flags rebuilds the section from them alone,
``tests/test_stored_sections.py``); held-out tasks are included (a property of the task and its
split, read by no design) and reported apart.

With ``--chunks``, the tasks whose probe is larger than the largest size given are rerun and each
run is scored on every disjoint chunk of its probe of about each size: how often the pick of a
probe cut that small is still the grid's best. It tests whether the probe's size, rather than the
task's family, is what decides the pick.
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import statistics
from typing import Any

from benchmarks import _store
from benchmarks.lr.__main__ import (
    DOC,
    GRIDS,
    SEEDS,
    STORED,
    _load,
    _run_all,
    _val,
    best_of_grid,
    grid_lrs,
    probe_picks,
    probe_size,
    write_section,
)
from benchmarks.lr.run import Run, execute
from benchmarks.lr.tasks import HELD_OUT, TASKS, get_task

__all__ = ["main", "pick_counts", "pick_rows", "section"]

STORE = STORED / "ceiling.json"
CHUNKS = STORED / "ceiling-chunks.json"
HALVES = STORED / "ceiling-val.json"
SECTION_CHUNKS = [30, 100, 200]  # the chunks the section shows (and, with --val-halves, the halves)
COMMAND = f"python -m benchmarks.lr.ceiling --chunks {' '.join(map(str, SECTION_CHUNKS))} --val-halves"


def pick_rows(tasks: list[str], grids: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per task: the probe's pick of each seed (over the grid's best lr), the validation
    loss there (mean of the seeds) and over the grid's best; every grid run must carry its probe
    loss (:func:`benchmarks.lr.__main__.probe_picks`)."""
    rows = []
    for task in tasks:
        i, lrs, means = best_of_grid(task, grids)
        lrs_picked = probe_picks(task, grids)
        assert lrs_picked is not None  # main() scored every grid run
        picks = [(lr, _val(grids, Run(task, "plain", lr, s))) for lr, s in zip(lrs_picked, SEEDS)]
        val = statistics.fmean(v for _, v in picks)
        ratio = math.exp(statistics.fmean(math.log(lr / lrs[i]) for lr, _ in picks))
        probe = probe_size(task)  # examples (tokens for an LM)
        rows.append({"task": task, "held_out": task in HELD_OUT, "best": lrs[i], "oracle": means[i],
                     "picks": [lr / lrs[i] for lr, _ in picks], "val": val, "vs_best": val / means[i],
                     "lr_ratio": ratio, "probe": probe})
    return rows


def _markdown(rows: list[dict[str, Any]]) -> str:
    out = []
    for held, title in ((False, "Design tasks"), (True, "Held-out tasks")):
        part = [r for r in rows if r["held_out"] == held]
        if not part:
            continue
        out += [f"#### {title}", "",
                "| task | probe size | grid's best lr | probe's pick / best (seed 0, 1) | val at the pick | "
                "pick / grid's best (val) |", "| --- | ---: | ---: | --- | ---: | ---: |"]
        for r in part:
            seeds = ", ".join(f"{x:.3g}" for x in r["picks"])
            out.append(f"| {r['task']} | {r['probe']} | {r['best']:.3g} | {seeds} | {r['val']:.4f} | "
                       f"{r['vs_best']:.3f} |")
        harm, rec, lr3, n = pick_counts(part)
        out += ["", f"The suite's bar read on the probe's pick ({title.lower()}): within 2% of the grid's "
                f"best on {harm} of {n} tasks (the no-harm bar: 90%), within 5% on {rec} of {n} (the "
                f"recovery bar: 75% of cells), the lr within 3x of the grid's best in {lr3} of {2 * n} "
                f"runs (bar: 80%).", ""]
    for small, what in ((True, f"at most {_SMALL} examples"), (False, f"more than {_SMALL}")):
        part = [r for r in rows if (r["probe"] <= _SMALL) == small]
        hits = sum(all(x == 1.0 for x in r["picks"]) for r in part)
        out.append(f"Probes of {what}: the pick is the grid's best on both seeds on {hits} of {len(part)} "
                   f"tasks (both sets).")
    return "\n".join(out)


def pick_counts(rows: list[dict[str, Any]]) -> tuple[int, int, int, int]:
    """The suite's bar read on the probe's pick of :func:`pick_rows`: tasks within 2% of the grid's
    best, within 5%, runs whose pick is within 3x of the grid's best lr, and the tasks counted."""
    harm = sum(r["vs_best"] <= 1.02 for r in rows)
    rec = sum(r["vs_best"] <= 1.05 for r in rows)
    lr3 = sum(1 / 3 <= x <= 3 for r in rows for x in r["picks"])
    return harm, rec, lr3, len(rows)


_SMALL = 200  # examples in the probe split (tokens for a language model)


def _chunk_table(tasks: list[str], grids: dict[str, Any], store: dict[str, Any],
                 sizes: list[int]) -> str:
    """How often a probe cut to ``size`` examples picks the grid's best: for each disjoint chunk of
    that size and each seed, the lr whose finished run scores lowest on the chunk."""
    out = ["| task | probe size | " + " | ".join(f"chunks of ~{k}: picks on the grid's best" for k in sizes)
           + " |", "| --- | ---: | " + " | ".join("---:" for _ in sizes) + " |"]
    totals = {k: [0, 0] for k in sizes}
    for task in tasks:
        i, lrs, _ = best_of_grid(task, grids)
        cells = []
        for k in sizes:
            hit = n = 0
            for seed in SEEDS:
                runs = [(store[Run(task, "plain", lr, seed).key]["chunks"][str(k)], lr) for lr in lrs]
                for c in range(min(len(ch) for ch, _ in runs if ch is not None)):
                    pick = min((ch[c], lr) for ch, lr in runs if ch is not None and math.isfinite(ch[c]))[1]
                    hit, n = hit + (pick == lrs[i]), n + 1
            totals[k][0] += hit
            totals[k][1] += n
            cells.append(f"{hit} of {n}")
        size = probe_size(task)
        out.append(f"| {task} | {size} | " + " | ".join(cells) + " |")
    out.append("| all | | " + " | ".join(f"{h / n:.0%} ({h} of {n})" for h, n in totals.values()) + " |")
    return "\n".join(out)


def _half_best(ok: dict[tuple[float, int], list[float]], lrs: list[float], half: int,
               seeds: tuple[int, ...]) -> float:
    """The lr whose runs (mean over ``seeds``) score lowest on validation half ``half``."""
    scored = [(statistics.fmean(ok[(lr, s)][half] for s in seeds), lr) for lr in lrs
              if all((lr, s) in ok for s in seeds)]
    return min(scored)[1]


def _halves_table(tasks: list[str], grids: dict[str, Any], store: dict[str, Any]) -> str:
    """Whether the two halves of the validation split agree on the best lr: per seed, and for the
    mean of the seeds (how the grid's best is chosen)."""
    out = ["| task | probe size | validation size | halves agree: seed 0, seed 1 | "
           "halves' best (2-seed mean) over the grid's best |", "| --- | ---: | ---: | --- | --- |"]
    agree = {True: [0, 0], False: [0, 0]}  # probe larger than _SMALL -> [runs agreeing, runs]
    stable = 0  # tasks where each half, like the whole split, picks the grid's best
    for task in tasks:
        i, lrs, _ = best_of_grid(task, grids)
        halves = {(lr, s): store[Run(task, "plain", lr, s).key]["val_halves"] for lr in lrs for s in SEEDS}
        ok = {k: v for k, v in halves.items() if v is not None}

        per_seed = [_half_best(ok, lrs, 0, (s,)) == _half_best(ok, lrs, 1, (s,)) for s in SEEDS]
        big = probe_size(task) > _SMALL
        agree[big][0] += sum(per_seed)
        agree[big][1] += len(per_seed)
        val = sum(y.numel() for _, y in get_task(task).data()["val"])
        probe = probe_size(task)
        bests = [_half_best(ok, lrs, h, SEEDS) for h in (0, 1)]
        stable += all(b == lrs[i] for b in bests)
        means = ", ".join(f"{b / lrs[i]:.3g}" for b in bests)
        out.append(f"| {task} | {probe} | {val} | {', '.join('yes' if a else 'no' for a in per_seed)} | "
                   f"{means} |")
    out.append("")
    for big, what in ((True, f"more than {_SMALL}"), (False, f"at most {_SMALL}")):
        a, n = agree[big]
        out.append(f"Tasks whose probe holds {what} examples: the halves agree in {a} of {n} runs.")
    out.append(f"Each half alone picks the grid's best (2-seed mean) on {stable} of {len(tasks)} tasks.")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.lr.ceiling")
    p.add_argument("--tasks", nargs="*", default=list(TASKS))
    p.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1))
    p.add_argument("--chunks", nargs="*", type=int, default=[],
                   help="score each grid run on disjoint chunks of the probe of about this many examples "
                        "(tasks whose probe is larger than the largest; "
                        "benchmarks/lr/stored/ceiling-chunks.json)")
    p.add_argument("--val-halves", action="store_true",
                   help="rerun every grid run and ask whether the two halves of the validation split agree "
                        "on the best lr (benchmarks/lr/stored/ceiling-val.json)")
    p.add_argument("--report-only", action="store_true",
                   help="run nothing: the section from the committed stores (give the same --chunks and "
                        "--val-halves as the run)")
    a = p.parse_args(argv)
    grids = _load(GRIDS)
    store, chunked, halved = _load(STORE), _load(CHUNKS), _load(HALVES)
    runs = [Run(t, "plain", lr, s) for t in a.tasks for lr in grid_lrs(t, grids) for s in SEEDS]
    big = [t for t in a.tasks if sum(y.numel() for _, y in get_task(t).probe()) > max(a.chunks)] if a.chunks \
        else []
    big_runs = [Run(t, "plain", lr, s) for t in big for lr in grid_lrs(t, grids) for s in SEEDS]
    if a.report_only:  # every run the section reads must be stored: else say which command makes them
        for path, need in ((STORE, [r for r in runs if "probe" not in grids[r.key]]),
                           (CHUNKS, big_runs), (HALVES, runs if a.val_halves else [])):
            stored = _load(path)  # once: read again for every run it took 25 s
            lacking = sorted({r.task for r in need if r.key not in stored})
            if lacking:
                _store.refuse(path, COMMAND, DOC, lacks=", ".join(lacking), note="about 35 min")
    else:
        # grid runs made since the suite records the probe loss carry it already; the rest are rerun
        _run_all([r for r in runs if "probe" not in grids[r.key]], store, STORE, a.jobs)
        if a.chunks:
            chunk = functools.partial(execute, probe_chunks=tuple(a.chunks))
            _run_all(big_runs, chunked, CHUNKS, a.jobs, chunk)
        if a.val_halves:
            _run_all(runs, halved, HALVES, a.jobs, functools.partial(execute, val_halves=True))
    md = section(a.tasks, grids, store, chunked, halved, a.chunks, a.val_halves)
    print(md)
    # the section shows every task with the chunks' and the halves' tables (its intro names the
    # command): a run of fewer writes nothing there, where it would take a table or a row away
    if a.tasks == list(TASKS) and a.chunks == SECTION_CHUNKS and a.val_halves:
        write_section("lr-ceiling", "What the probe can tell: the grid's runs scored on the probe",
                      _INTRO + md, after="lr-suite")
    else:
        _store.leave("lr-ceiling", "its --tasks, --chunks or --val-halves are not the section's",
                     f"{COMMAND} --report-only")
    return 0


def section(tasks: list[str], grids: dict[str, Any], store: dict[str, Any], chunked: dict[str, Any],
            halved: dict[str, Any], chunks: list[int], val_halves: bool) -> str:
    """The section's body (after its intro) from the stores: the reruns checked against the grid,
    the probe's picks, and the chunks' and the halves' tables when asked for."""
    runs = [Run(t, "plain", lr, s) for t in tasks for lr in grid_lrs(t, grids) for s in SEEDS]
    store = {**store, **{r.key: grids[r.key] for r in runs if "probe" in grids[r.key]}}
    worst = 0.0
    for r in runs:  # the rerun is the grid's run: the same batches, the same result up to float noise
        new, old = store[r.key]["val"], grids[r.key]["val"]
        if (new is None) != (old is None):
            what = "diverged" if new is None else "trained"
            raise SystemExit(f"{r.key}: the rerun {what}, the grid's run did not")
        if new is not None:
            worst = max(worst, abs(new - old) / abs(old) if old else abs(new))  # a loss of 0: absolute
    if worst > 1e-3:
        raise SystemExit(f"a rerun's validation loss is {worst:.2g} (relative) off the stored grid's")
    md = f"Reruns agree with the stored grid to {worst:.1g} (relative validation loss).\n\n"
    md += _markdown(pick_rows(tasks, grids))
    if chunks:
        big = [t for t in tasks if sum(y.numel() for _, y in get_task(t).probe()) > max(chunks)]
        md += _CHUNKS_INTRO.format(sizes=" ".join(map(str, chunks)))
        md += _chunk_table(big, grids, chunked, chunks) + "\n"
    if val_halves:
        md += _HALVES_INTRO + _halves_table(tasks, grids, halved) + "\n"
    return md


_HALVES_INTRO = """
#### The validation split cut in two (`--val-halves`)

Every grid run (both seeds) scored on each half of the validation split: whether the two halves
agree on the best lr, per seed and for the 2-seed mean the grid's best is chosen by. Where they
disagree, the grid's best is itself within the validation split's noise, and no search can be
expected to find it.

"""


_CHUNKS_INTRO = """
#### The probe cut smaller (`--chunks {sizes}`)

The tasks whose probe holds more than the largest size, every grid run (both seeds) scored on each
disjoint chunk of its probe of about that many examples; a cell counts the chunks (over both seeds)
whose pick is the grid's best.

"""


_INTRO = """\
Produced by `python -m benchmarks.lr.ceiling --chunks 30 100 200 --val-halves` (which writes this
section; about 35 minutes on two cores), from the suite's grids (`benchmarks/lr/grids.json`): every grid
run, both seeds, rerun with the same batches and scored on the probe split at its end, in eval
mode.

A search reads the probe split, batches carved from the training side; the suite judges it on the
validation split. The *probe's pick* is the peak lr whose complete run scores lowest on the probe,
for one seed: the choice of a search that had the whole grid's compute and the end of every run in
hand. A search that moves the lr toward what the probe prefers cannot place it better than this,
except where a bias of its own happens to cancel the probe's error. Columns: the probe's size
(examples, or tokens for a language model); the grid's best peak lr
(validation, mean of 2 seeds); each seed's pick over it; the validation loss at the picks (mean of
the seeds); that over the grid's best. The last line of each table reads the suite's bar on the
pick (it does not depend on the start: it recovers from 10x below and above alike). The last two
lines split the tasks by the probe's size, at 200 examples, where the tables break (a split chosen
after seeing them).

"""


if __name__ == "__main__":
    raise SystemExit(main())
