"""The learning-rate suite: plain-training grids, a search method from three starts, the table.

    python -m benchmarks.lr grid                   # 2-seed grids of peak lrs (benchmarks/lr/grids.json)
    python -m benchmarks.lr eval --method autolr   # the method from 0.1x, 1x, 10x the grid's best
    python -m benchmarks.lr report --method autolr # its table into docs/benchmarks.md (the others' kept)
    python -m benchmarks.lr same --method A B      # do two methods' stored runs agree, cell by cell?
    python -m benchmarks.lr eval --quick           # a smoke run of every task (few steps)

On a machine whose floating-point kernels do not repeat the committed grid (``eval`` says so),
``--here`` makes this machine's own grid of the named tasks beside it (``runs/lr/grids-here.json``)
and runs and reports the methods against that one (``runs/lr/<method>-here.json``): the committed
stores and docs/benchmarks.md are left alone.

Every command resumes from what it already has (``--fresh`` starts the named tasks over, and keeps
every other task's runs in the store). The stores the docs'
sections are written from (``Forks`` and ``autolr`` runs here; the cost, co-exploration and noise
commands' too) are committed in ``benchmarks/lr/stored/`` beside the grids, so a clone rebuilds
those sections (``tests/test_stored_sections.py``); every other store goes to ``runs/lr/``
(gitignored).

The grid of a task is extended by half-decades until its best learning rate has two grid points
on each side, so that 10x below and 10x above the best are grid points too (plain training at
every start).
Held-out tasks (``benchmarks.lr.tasks.HELD_OUT``) are reported in a table of their own.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import sys
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path
from typing import Any

from benchmarks import _store
from benchmarks.lr.prototypes import LOOPS
from benchmarks.lr.run import METHODS, Run, execute
from benchmarks.lr.tasks import HELD_OUT, TASKS, get_task

ROOT = Path(__file__).resolve().parents[2]
GRIDS = Path(__file__).with_name("grids.json")
RUNS = ROOT / "runs" / "lr"  # exploratory stores (gitignored)
STORED = Path(__file__).with_name("stored")  # the stores the docs' sections read (committed)
REPORTED = ("Forks", "autolr")  # the methods whose suite runs docs/benchmarks.md reports
DOC = ROOT / "docs" / "benchmarks.md"
SEEDS = (0, 1)
STARTS = {"0.1x": 0.1, "1x": 1.0, "10x": 10.0}
QUICK_STEPS = 12


def _load(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.exists() else {}


def study_args(command: str, doc: str, tasks_help: str, argv: list[str] | None) -> argparse.Namespace:
    """The arguments of a study that writes one section from one store (``benchmarks.lr.carve``,
    ``benchmarks.lr.warmup``): ``--tasks`` (None: the study's own), ``--jobs``, ``--report-only``."""
    p = argparse.ArgumentParser(prog=command, description=doc.split("\n")[0])
    p.add_argument("--tasks", nargs="*", default=None, help=f"default: {tasks_help}")
    p.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1))
    p.add_argument("--report-only", action="store_true",
                   help="run nothing: the section from the committed stores")
    return p.parse_args(argv)


def forget(store: dict[str, Any], tasks: list[str]) -> dict[str, Any]:
    """``store`` without the runs of ``tasks`` (what ``--fresh`` starts over): a store holds every
    task's runs, and a rerun of some must not drop the others' when it is written back."""
    named = set(tasks)
    return {k: v for k, v in store.items() if k.split("|")[0] not in named}


def store_path(method: str, quick: bool = False, here: bool = False) -> Path:
    """Where ``eval --method method`` keeps its runs: committed (:data:`STORED`) for a method the
    docs report, ``runs/lr`` otherwise and for a quick run or one against this machine's own grid
    (``here``)."""
    folder = STORED if method in REPORTED and not quick and not here else RUNS
    return folder / f"{method}{'-quick' if quick else ''}{'-here' if here else ''}.json"


def grid_path(quick: bool = False, here: bool = False) -> Path:
    """Where the grid is kept: committed (:data:`GRIDS`), or in ``runs/lr`` for a quick run or this
    machine's own grid (``here``)."""
    if not quick and not here:
        return GRIDS
    return RUNS / f"grids{'-quick' if quick else ''}{'-here' if here else ''}.json"


def suite_runs(method: str, tasks: list[str], grids: dict[str, Any], steps: int | None = None,
               here: bool = False) -> dict[str, Any]:
    """The method's stored suite runs, for a report that writes from them: every cell (start x
    seed) of ``tasks``; when the store is missing or lacks a task's cell, an exit that names the
    ``eval`` command that makes them (nothing written)."""
    path = store_path(method, quick=steps is not None, here=here)
    command = (f"python -m benchmarks.lr eval --method {method}{' --quick' if steps is not None else ''}"
               f"{' --here' if here else ''}")
    note = "hours on two cores" if steps is None else ""
    store = _store.load(path, command, DOC, note)
    missing = [t for t in tasks if any(Run(t, method, lr, s, steps).key not in store
                                       for lr in cells(t, grids, steps).values() for s in SEEDS)]
    if missing:
        _store.refuse(path, f"{command} --tasks {' '.join(missing)}", DOC, lacks=", ".join(missing),
                      note=note)
    return store


def _save(path: Path, data: dict[str, Any]) -> None:
    """Write a store; a committed one (:data:`STORED`) without each run's decision history, which no
    report reads (autolr's holds every sync: megabytes where the reports read a few numbers a run)."""
    if path.parent.resolve() == STORED.resolve():
        data = {k: {f: v for f, v in r.items() if f != "history"} if isinstance(r, dict) else r
                for k, r in data.items()}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(compact(data))
    os.replace(tmp, path)


def compact(data: dict[str, Any]) -> str:
    """``data`` as JSON, one compact line per key (sorted): small, and a rerun's diff is by run."""
    def line(key: str) -> str:
        value = json.dumps(data[key], separators=(",", ":"), sort_keys=True, default=_refuse)
        return f"{json.dumps(key)}:{value}"

    return "{\n" + ",\n".join(line(k) for k in sorted(data)) + "\n}\n"


def _refuse(x: Any) -> Any:
    raise TypeError(f"cannot save {x!r}")


def _run_all(runs: list[Run], store: dict[str, Any], path: Path, jobs: int,
             fn: Callable[[Run], dict[str, Any]] = execute) -> None:
    todo = [r for r in runs if r.key not in store]
    if not todo:
        return
    print(f"{len(todo)} runs on {jobs} processes", file=sys.stderr)
    with ProcessPoolExecutor(jobs) as pool:
        futs = {pool.submit(fn, r): r for r in todo}
        for i, f in enumerate(as_completed(futs), 1):
            r = futs[f]
            res = f.result()
            store[r.key] = {k: (None if isinstance(v, float) and math.isnan(v) else v)
                            for k, v in res.items()}
            if i % 10 == 0 or i == len(todo):
                _save(path, store)
            print(f"[{i}/{len(todo)}] {r.key}: val {res['val']:.4g} lr {res['end_lr']:.3g} "
                  f"{res['seconds']:.1f}s", file=sys.stderr)
    _save(path, store)


def _val(store: dict[str, Any], run: Run) -> float:
    v = store[run.key]["val"]
    return math.nan if v is None else v


def _mean(xs: list[float]) -> float:
    """Mean over seeds; a diverged seed makes the cell diverged (NaN)."""
    return math.nan if any(math.isnan(x) for x in xs) else statistics.fmean(xs)


# ----------------------------------------------------------------------------- grids


def grid_lrs(task: str, store: dict[str, Any], steps: int | None = None) -> list[float]:
    """The task's grid as computed so far (ascending)."""
    return sorted({r["lr"] for k, r in store.items() if k.startswith(f"{task}|plain|")
                   and (r.get("steps") == steps)})


def grid_complete(task: str, store: dict[str, Any], steps: int | None = None) -> bool:
    """Whether the store holds the task's grid: some peak lr, and every seed's run at each (a grid
    stopped part way holds a seed's run without the other's)."""
    lrs = grid_lrs(task, store, steps)
    return bool(lrs) and all(Run(task, "plain", lr, s, steps).key in store for lr in lrs for s in SEEDS)


def best_of_grid(task: str, store: dict[str, Any],
                 steps: int | None = None) -> tuple[int, list[float], list[float]]:
    """(index of the best lr, the lrs, their mean validation losses over the seeds)."""
    lrs = grid_lrs(task, store, steps)
    means = [_mean([_val(store, Run(task, "plain", lr, s, steps)) for s in SEEDS]) for lr in lrs]
    finite = [(m, i) for i, m in enumerate(means) if not math.isnan(m)]
    return min(finite)[1], lrs, means


def run_grid(tasks: list[str], store: dict[str, Any], jobs: int, steps: int | None = None,
             path: Path = GRIDS) -> None:
    """Each task's 9-point grid, extended until the best has two points on each side."""
    def plan(task: str, ks: range) -> list[Run]:
        t = get_task(task)
        return [Run(task, "plain", t.center * 10 ** (k / 2), s, steps) for k in ks for s in SEEDS]

    runs = [r for t in tasks for r in plan(t, range(-4, 5))]
    for _ in range(8):
        _run_all(runs, store, path, jobs)
        for r in runs:  # remember each run's coordinates beside its result
            store[r.key].update(lr=r.lr, seed=r.seed, steps=r.steps)
        runs = []
        for task in tasks:
            i, lrs, _ = best_of_grid(task, store, steps)
            t = get_task(task)
            k_lo = round(2 * math.log10(lrs[0] / t.center))
            k_hi = round(2 * math.log10(lrs[-1] / t.center))
            if i < 2:
                runs += plan(task, range(k_lo - (2 - i), k_lo))
            if i > len(lrs) - 3:
                runs += plan(task, range(k_hi + 1, k_hi + 1 + (i - (len(lrs) - 3))))
        if not runs:
            break
    _save(path, store)


def numerics_problem(task: str, grids: dict[str, Any], steps: int | None = None) -> None:
    """Exit with the fix when the stored grid's plain runs do not repeat here bit for bit: ``task``'s
    run at its grid's best lr (seed 0), and both seeds' runs there of the three tasks whose grid
    runs were quickest (a few seconds in all; one run alone repeats across some pairs of machines).
    A run's end depends chaotically on floating-point rounding: another CPU's kernels (AVX-512
    against AVX2, another BLAS) end the same seed and batches at a validation loss tens of percent
    away on some tasks, so a method run here and a grid run elsewhere differ by that much even
    where the method is plain training."""
    seconds: dict[str, float] = {}
    for key, r in grids.items():
        name = key.split("|")[0]
        if r.get("steps") == steps:
            seconds[name] = seconds.get(name, 0.0) + r["seconds"]
    quick = sorted((t for t in seconds if t in TASKS), key=seconds.__getitem__)[:3]
    runs = []
    for name, seeds in [(task, SEEDS[:1]), *[(t, SEEDS) for t in quick]]:
        i, lrs, _ = best_of_grid(name, grids, steps)
        runs += [Run(name, "plain", lrs[i], s, steps) for s in seeds]
    for run in runs:
        stored, now = grids[run.key]["val"], execute(run)["val"]
        if stored != now and not (stored is None and math.isnan(now)):
            raise SystemExit(
                f"the stored grid does not repeat on this machine: {run.key} ended at validation loss "
                f"{stored} there and {now} here (other floating-point kernels). Its plain runs cannot be "
                f"compared with method runs made here: rerun the grid here (python -m benchmarks.lr grid "
                f"--fresh), make this machine's own grid beside it and compare against that (--here), or "
                f"pass --mixed-numerics to compare them anyway")


# ----------------------------------------------------------------------------- a method's cells


def cells(task: str, grids: dict[str, Any], steps: int | None = None) -> dict[str, float]:
    i, lrs, _ = best_of_grid(task, grids, steps)
    return {name: lrs[i] * f for name, f in STARTS.items()}


def grid_point(task: str, lr: float, grids: dict[str, Any], steps: int | None) -> float:
    """The grid's lr equal to ``lr`` (up to rounding); an error if the grid has none."""
    near = min(grid_lrs(task, grids, steps), key=lambda x: abs(math.log(x / lr)))
    if abs(math.log(near / lr)) > 1e-6:
        raise SystemExit(f"{task}: no grid point at lr {lr:.3g}; run `python -m benchmarks.lr grid`")
    return near


def plain_at(task: str, lr: float, grids: dict[str, Any], steps: int | None) -> list[dict[str, Any]]:
    """Plain training's runs at ``lr`` (a grid point), one per seed."""
    at = grid_point(task, lr, grids, steps)
    return [grids[Run(task, "plain", at, s, steps).key] for s in SEEDS]


def probe_picks(task: str, grids: dict[str, Any], steps: int | None = None) -> list[float] | None:
    """Each seed's *probe's pick*: the grid lr whose complete run scores lowest on the probe split
    (``python -m benchmarks.lr.ceiling``); None where some grid run has no probe loss recorded."""
    scored = {**_load(RUNS / "ceiling.json"), **{k: r for k, r in grids.items() if "probe" in r}}
    lrs = grid_lrs(task, grids, steps)
    picks = []
    for seed in SEEDS:
        runs = [(scored.get(Run(task, "plain", lr, seed, steps).key, {}), lr) for lr in lrs]
        if any("probe" not in r for r, _ in runs):
            return None
        picks.append(min((r["probe"], lr) for r, lr in runs if r["probe"] is not None)[1])
    return picks


def table(method: str, tasks: list[str], grids: dict[str, Any], store: dict[str, Any],
          steps: int | None = None) -> list[dict[str, Any]]:
    """One row per task x start, and what the acceptance criteria read from it."""
    rows = []
    for task in tasks:
        t = get_task(task)
        i, lrs, means = best_of_grid(task, grids, steps)
        oracle_lr, oracle = lrs[i], means[i]
        const = t.constant_loss()
        picks = probe_picks(task, grids, steps)
        for name, lr in cells(task, grids, steps).items():
            plain_runs = plain_at(task, lr, grids, steps)
            plain = [math.nan if r["val"] is None else r["val"] for r in plain_runs]
            runs = [store[Run(task, method, lr, s, steps).key] for s in SEEDS]
            vals = [math.nan if r["val"] is None else r["val"] for r in runs]
            hpx_mean = _mean(vals)
            plain_mean = _mean(plain)
            end = math.exp(statistics.fmean(math.log(r["end_lr"]) for r in runs))
            plain_trains = not math.isnan(plain_mean) and plain_mean < 0.98 * const
            rows.append({
                "task": task, "start": name, "held_out": task in HELD_OUT, "lr": lr,
                "oracle_lr": oracle_lr, "oracle": oracle, "plain": plain_mean, "hpx": hpx_mean,
                "vs_plain": hpx_mean / plain_mean if plain_trains else math.nan,
                "vs_oracle": hpx_mean / oracle, "end_lr": end, "end_vs_oracle": end / oracle_lr,
                # the probe resolves the grid: its pick is the grid's best on both seeds
                "resolved": picks is not None and all(p == oracle_lr for p in picks),
                # each seed's end over that seed's probe's pick, geometric mean over the seeds
                "end_vs_pick": math.nan if picks is None else math.exp(statistics.fmean(
                    math.log(r["end_lr"] / p) for r, p in zip(runs, picks))),
                "lost": any(r["lost"] for r in runs) and plain_trains,
                "cost": statistics.fmean(r["seconds"] for r in runs)
                / statistics.fmean(r["seconds"] for r in plain_runs),
            })
    return rows


def verdict(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The issue's acceptance criteria on ``rows`` (one set of tasks)."""
    at = [r for r in rows if r["start"] == "1x"]
    off = [r for r in rows if r["start"] != "1x"]
    harm = [r["vs_plain"] for r in at]
    nan_le = lambda x, b: not math.isnan(x) and x <= b  # noqa: E731
    return {
        "no_harm_102": sum(nan_le(x, 1.02) for x in harm) / len(harm),
        "no_harm_105_all": all(nan_le(x, 1.05) for x in harm),
        "recover_105": sum(nan_le(r["vs_oracle"], 1.05) for r in off) / len(off),
        "recover_vs_plain": all(math.isnan(r["vs_plain"]) or r["vs_plain"] <= 1.02 for r in off),
        "fixed_point_3x": sum(1 / 3 <= r["end_vs_oracle"] <= 3 for r in rows) / len(rows),
        "pick_3x": (math.nan if any(math.isnan(r["end_vs_pick"]) for r in rows)
                    else sum(1 / 3 <= r["end_vs_pick"] <= 3 for r in rows) / len(rows)),
        "lost": sum(r["lost"] for r in rows),
        "cost_max": max(r["cost"] for r in rows),
    }


def _pct(x: float) -> str:
    return "- (no probe losses: run `python -m benchmarks.lr.ceiling`)" if math.isnan(x) else f"{x:.0%}"


def _fmt(x: float, spec: str = ".3f") -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def markdown(method: str, rows: list[dict[str, Any]]) -> str:
    out = []
    for held, title in ((False, "Design tasks"), (True, "Held-out tasks")):
        part = [r for r in rows if r["held_out"] == held]
        if not part:
            continue
        v = verdict(part)
        out += [f"#### {title}", "",
                "| task | start | lr | plain | hpx | hpx / plain | hpx / oracle | lr it ends at / best "
                "| lr it ends at / probe's pick | lost |",
                "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        for r in part:
            out.append(f"| {r['task']} | {r['start']} | {r['lr']:.3g} | {_fmt(r['plain'], '.4f')} | "
                       f"{_fmt(r['hpx'], '.4f')} | {_fmt(r['vs_plain'])} | {_fmt(r['vs_oracle'])} | "
                       f"{r['end_vs_oracle']:.3g} | {_fmt(r['end_vs_pick'], '.3g')} | "
                       f"{'yes' if r['lost'] else ''} |")
        out += ["", f"Criteria ({title.lower()}): hpx / plain <= 1.02 at the best lr on "
                f"{v['no_harm_102']:.0%} of tasks (bar 90%), <= 1.05 on all: {v['no_harm_105_all']}; "
                f"from 10x off <= 1.05x the oracle in {v['recover_105']:.0%} of cells (bar 75%), never "
                f"> 1.02x plain at that start: {v['recover_vs_plain']}; the lr it ends at within 3x of "
                f"the grid's best in {v['fixed_point_3x']:.0%} of cells (bar 80%), within 3x of the probe's "
                f"pick in {_pct(v['pick_3x'])}; runs lost: {v['lost']} (the cost: "
                "`python -m benchmarks.lr.bar` in optimizer steps, `python -m benchmarks.lr.cost` in "
                "wall time).", ""]
        solved = [r for r in part if r["resolved"]]
        if solved:
            w = verdict(solved)
            names = ", ".join(dict.fromkeys(r["task"] for r in solved))
            out += [f"On the {len(solved) // len(STARTS)} of these tasks whose probe resolves the grid (its "
                    f"pick is the grid's best on both seeds: {names}): no harm on {w['no_harm_102']:.0%}, "
                    f"recovered in {w['recover_105']:.0%} of cells, the lr within 3x of the grid's best in "
                    f"{w['fixed_point_3x']:.0%}; runs lost: {w['lost']}.", ""]
    out += _by_probe_size(rows)
    return "\n".join(out)


PROBE_SPLIT = 200  # examples (tokens for a language model): where the probe's ceiling tables break


def probe_size(task: str) -> int:
    """The examples in ``task``'s probe (tokens for a language model)."""
    return sum(y.numel() for _, y in get_task(task).probe())


def bar_counts(rows: list[dict[str, Any]]) -> tuple[int, int, int, int, int, int]:
    """The bar's quality rows as counts on ``rows``: (no harm, tasks, recovered, cells from 10x off,
    the lr within 3x, cells); a NaN ratio counts as a miss."""
    at = [r for r in rows if r["start"] == "1x"]
    off = [r for r in rows if r["start"] != "1x"]
    ok = lambda x, b: not math.isnan(x) and x <= b  # noqa: E731
    return (sum(ok(r["vs_plain"], 1.02) for r in at), len(at),
            sum(ok(r["vs_oracle"], 1.05) for r in off), len(off),
            sum(1 / 3 <= r["end_vs_oracle"] <= 3 for r in rows), len(rows))


def _by_probe_size(rows: list[dict[str, Any]]) -> list[str]:
    """The bar's quality rows counted on both sets together, split by the probe's size."""
    size = {t: probe_size(t) for t in {r["task"] for r in rows} if t in TASKS}
    parts = []
    for big, words in ((True, f"more than {PROBE_SPLIT}"), (False, f"{PROBE_SPLIT} or fewer")):
        part = [r for r in rows if r["task"] in size and (size[r["task"]] > PROBE_SPLIT) == big]
        if not part:
            continue
        harm, n_at, rec, n_off, near, n = bar_counts(part)
        tasks = "task" if n_at == 1 else "tasks"
        parts.append(f"on the {n_at} {tasks} whose probe holds {words} examples (tokens for a language "
                     f"model), no harm on {harm} of {n_at}, recovered in {rec} of {n_off} cells, the "
                     f"lr within 3x of the grid's best in {near} of {n}; runs lost: "
                     f"{sum(r['lost'] for r in part)}")
    return [f"By the probe's size (both sets together): {'; '.join(parts)}.", ""] if parts else []


def grids_markdown(grids: dict[str, Any]) -> str:
    out = ["| task | family | optimizer | schedule | steps | held out | grid (peak lr) | best lr | "
           "best val loss | constant predictor |",
           "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, t in TASKS.items():
        if not grid_lrs(name, grids):
            continue
        i, lrs, means = best_of_grid(name, grids)
        out.append(f"| {name} | {t.family} | {t.optim} | {t.sched} | {t.steps} | "
                   f"{'yes' if name in HELD_OUT else ''} | {lrs[0]:.3g} .. {lrs[-1]:.3g} ({len(lrs)}) | "
                   f"{lrs[i]:.3g} | {means[i]:.4f} | {t.constant_loss():.3f} |")
    return "\n".join(out)


_INTRO = """\
Produced by `python -m benchmarks.lr grid`, `python -m benchmarks.lr eval --method {methods}` and
`python -m benchmarks.lr report --method {methods}` (which writes this section), one thread per run,
two runs at a time, on {machine}.

{n_tasks} tasks, each a user's set-up as they would write it (`benchmarks/lr/tasks.py`): the
data with a fixed train / probe / validation split, the model, the optimizer built at the peak
learning rate and the task's own torch scheduler; data from scikit-learn's bundled sets and
generators, CPython's pydoc text and fixed synthetic sets. {n_held} of them are **held out**
(`HELD_OUT` in `benchmarks/lr/tasks.py`): each was committed with its grid before any search ran on
it. A search is designed on the other {n_design} and judged on both, reported apart. A held-out
task that is used to choose a design stops being held out, and is then replaced by a fresh one.
That happened three times. The first five held-out tasks (commit 8f61738) were read before the current
dead zone was designed; eight fresh ones replaced them (commit 0ba6d86). Two of those
(wine_dropout, iris_short) showed the successive-halving prototype keeping a lost start, which
the rule designed next answers; four fresh ones replaced them (commit 8218a57: moons_dropout,
digits_cnn_adam, friedman_short, char_gru_adamw). Four held-out tasks (moons_dropout,
digits_cnn_adam, digits_mlp_adam_long, diabetes_short) had their runs read cut by cut while the
end's test was diagnosed; five fresh ones replaced them (commit 89c03bc: blobs_dropout,
digits_cnn_bn_adam, char_transformer_adam, digits_gru_sgd, sparse_dropout). Tasks read that way
are design tasks since. A fifth set was added to widen the held-out evidence, not to replace any
(commit 2667eea: digits_cnn_adamw, cancer_sgd, char_lstm_sgd, bert_tiny_cosine,
clusters_adam_step), and a sixth the same way (commit 9be234b: digits_mlp_adamw,
digits_cnn_bn_cosine, char_transformer_step, digits_lstm_adamw, friedman_dropout); `Forks` and
`autolr` ran on each once, unchanged.

Each task's grid: 9 (or more) peak learning rates half a decade apart, 2 seeds each, plain training (the
user's loop: backward, step, scheduler step); the best is the lowest mean validation loss, and
every best has two grid points on each side, so 0.1x and 10x the best are on the grid. Every run
seeds the global RNG, which dropout draws from, from its own seed, so it repeats exactly whatever
ran before it in its process. Before that was so, the six tasks with dropout (bert_tiny,
cancer_dropout, char_transformer, diabetes_dropout, digits_rows_transformer, wine_dropout) gave
results that depended on the order of the runs; their grids and the method's runs on them were
redone with the seed in place (no task's best lr moved).

A run's end also depends on the machine's floating-point kernels, chaotically on some tasks: the
grid committed at 0491d99, made on another machine, repeats here bit for bit in 244 of its 666 runs
and ends more than 1% apart in 77 (`python -m benchmarks.lr.numerics` compares two grids run by
run). No task's best lr moved, but the 2-seed mean at the best lr moved by 44% on digits_lstm, 15%
on digits_cnn_bn and 10% on digits_rows_transformer, and single runs of digits_cnn_bn,
digits_lstm, digits_cnn_adam, digits_rows_transformer, digits_cnn_adamw, cancer_dropout and
bert_tiny_cosine by 80-340%. So the grid is rerun on the machine the methods run on (it was, for
the tables below), and `eval` refuses a stored grid whose runs at the best lr of a few tasks do
not repeat here; and on those tasks a gap of several percent between two runs that took
different paths (a winner against the grid's run at the same lr) is within this noise
(`python -m benchmarks.lr.noise` measures it: docs/method.md, "What the suite can resolve").

{grids}

A method is run from 0.1x, 1x and 10x the grid's best peak lr, 2 seeds each, on the same batches as
plain training at that lr. Columns: the validation loss (mean of 2 seeds) of plain training and of
the method; their ratio; the method's over the grid's best ("oracle"); the peak lr the run ends at
(the search's factor times the start) over the grid's best (geometric mean of the seeds), and over
the probe's pick (each seed's end over that seed's pick: the lr whose complete run scores lowest on
the probe, the best a search that follows the probe can place it; see the next section); "lost":
a seed ends within 2% of the constant predictor's loss (or diverges) where plain training at
that start trains. No wall time is compared here: these runs were made two at a time, in separate
jobs on the machines named, beside a grid made at other times; `python -m benchmarks.lr.cost`
times each method's loop against plain training side by side. Below each table the bar is read again on the
tasks whose probe resolves the grid (the probe's pick is the grid's best on both seeds): on the
others no search that follows the probe can be expected to place the lr on the grid's best.

`Forks` is `hpx.Forks` with its defaults, given what `autolr` is given (the optimizer at the peak
lr, the task's own scheduler, its probe split). It is the training-loop prototype
`halving-end-cool-z2-lost-last` (`benchmarks/lr/prototypes.py`; docs/method.md, "A confident end")
built into hpx: `python -m benchmarks.lr same --method Forks halving-end-cool-z2-lost-last` finds
the same end lr and validation loss in every cell both were run on (102 of 102 when this was
written). `autolr` is `hpx.autolr` (the `Stretch` search), the recommended search before.

{tables}
"""


SUITE_TITLE = "The learning-rate suite: a search against plain training and the grid"


def machine() -> str:
    """This machine, as the suite's section names the one its runs were made on."""
    import platform

    import torch

    return (f"{platform.machine()}, {os.cpu_count()} logical cores; Python {platform.python_version()}, "
            f"torch {torch.__version__}")


def suite_section(methods: list[str], grids: dict[str, Any], tables: list[str],
                  on: str | None = None) -> str:
    """The suite's section (its body, below the title): one table per method; ``on``: the machine
    the runs were made on (default: this one)."""
    n_held = sum(t in HELD_OUT for t in TASKS)
    shown = "\n\n".join(f"### `{m}`\n\n{md}" for m, md in zip(methods, tables))
    return _INTRO.format(methods=" ".join(methods), machine=on or machine(), grids=grids_markdown(grids),
                         tables=shown, n_tasks=len(TASKS), n_held=n_held, n_design=len(TASKS) - n_held)


def section_methods(body: str) -> list[str]:
    """The methods a suite's section (its text between the markers) shows, in its order: those its
    "Produced by" line names."""
    command = re.search(r"`python -m benchmarks\.lr report --method ([^`]+)`", body)
    return command.group(1).split() if command else []


def section_tables(body: str, methods: list[str]) -> dict[str, str]:
    """Each of ``methods``' table in a suite's section (its text below ``### `method```)."""
    out = {}
    for m in methods:
        head = f"### `{m}`\n\n"
        if head not in body:
            continue
        start = body.index(head) + len(head)
        end = body.find("\n\n### `", start)
        out[m] = body[start:end if end >= 0 else len(body) - 1]  # the section ends in its last table and "\n"
    return out


def _current_section(marker: str) -> str | None:
    """The text of docs/benchmarks.md's section ``marker`` below its title (None: no such section)."""
    text = DOC.read_text() if DOC.exists() else ""
    start, end = f"<!-- {marker} -->", f"<!-- /{marker} -->"
    if start not in text or end not in text:
        return None
    section = text[text.index(start) + len(start):text.index(end)]
    return section.split("\n\n", 1)[1] if section.startswith("\n## ") else section


def write_docs(methods: list[str], grids: dict[str, Any], tables: list[str]) -> None:
    """Put ``methods``' tables into the suite's section of docs/benchmarks.md (between its markers),
    each in place of its own: a report of some of the methods the section shows rewrites their
    tables and leaves every other one byte for byte, with the text they share (the machine, the
    grids, the "Produced by" line, which names every method shown). Where that shared text is not
    what the section's own command would write now (the grid or the prose changed since), the
    others' tables would sit under text that is not theirs: refused, naming that command."""
    body = _current_section("lr-suite")
    shown = section_methods(body) if body is not None else []
    old = section_tables(body, shown) if body is not None else {}
    order = [m for m in shown if m in old] + [m for m in methods if m not in old]
    new = dict(zip(methods, tables))
    if set(old) <= set(new):  # every table the section shows: the whole section, on this machine
        write_section("lr-suite", SUITE_TITLE, suite_section(order, grids, [new[m] for m in order]))
        return
    on = re.search(r"two runs at a time, on (.+?)\.\n", body)  # the machine the shown runs were made on
    full = f"python -m benchmarks.lr report --method {' '.join(order)}"
    if on is None or suite_section(list(old), grids, list(old.values()), on.group(1)) != body:
        others = " and ".join(f"`{m}`'s" for m in old if m not in new)
        _store.refuse_narrower("lr-suite", f"{others} table under shared text (the grids' table, the "
                               "prose) that is not what this command writes now", full, DOC)
    write_section("lr-suite", SUITE_TITLE,
                  suite_section(order, grids, [new[m] if m in new else old[m] for m in order], on.group(1)))


def write_section(marker: str, title: str, body: str, after: str | None = None) -> None:
    """Put ``## title`` and ``body`` into docs/benchmarks.md between ``<!-- marker -->`` and
    ``<!-- /marker -->``: in place of the section if it is there, else after the section marked
    ``after`` (or at the top)."""
    text = DOC.read_text()
    start, end = f"<!-- {marker} -->", f"<!-- /{marker} -->"
    section = f"{start}\n## {title}\n\n{body}{end}"
    if start in text:
        text = text[:text.index(start)] + section + text[text.index(end) + len(end):]
    elif after is not None:
        i = text.index(f"<!-- /{after} -->") + len(f"<!-- /{after} -->")
        text = f"{text[:i]}\n\n{section}{text[i:]}"
    else:
        head, _, rest = text.partition("\n")
        text = f"{head}\n\n{section}\n{rest}"
    DOC.write_text(text)


def agreement(a: str, b: str, store_a: dict[str, Any], store_b: dict[str, Any]
              ) -> tuple[int, list[str]]:
    """How many cells (task, lr, seed) both methods ran, and the keys of those where they differ: in
    the lr they end at (relative 1e-9) or the validation loss (relative 1e-5; a diverged run on both
    sides agrees). For a method built into hpx from a prototype: do they train the same?"""
    both, differ = 0, []
    for key, ra in store_a.items():
        rb = store_b.get(key.replace(f"|{a}|", f"|{b}|", 1))
        if rb is None:
            continue
        both += 1
        va, vb = ra["val"], rb["val"]
        same_val = (va is None) == (vb is None) and (va is None or math.isclose(va, vb, rel_tol=1e-5))
        if not (same_val and math.isclose(ra["end_lr"], rb["end_lr"], rel_tol=1e-9)):
            differ.append(key)
    return both, differ


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.lr", description=__doc__.split("\n")[0])
    p.add_argument("command", choices=("grid", "eval", "report", "same"),
                   help="same: do two methods' stored runs end at the same lr and loss?")
    p.add_argument("--method", nargs="+", default=["autolr"], choices=sorted([*METHODS, *LOOPS]),
                   help="one or more methods: each is run (eval) and reported in its own table")
    p.add_argument("--tasks", nargs="*", default=list(TASKS))
    p.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1))
    p.add_argument("--quick", action="store_true",
                   help=f"{QUICK_STEPS} steps a run: checks the plumbing only")
    p.add_argument("--fresh", action="store_true",
                   help="forget the stored results of this command for the tasks named (--tasks; "
                   "all by default)")
    p.add_argument("--mixed-numerics", action="store_true",
                   help="eval against a stored grid whose runs this machine does not repeat bit for bit")
    p.add_argument("--here", action="store_true",
                   help="this machine's own grid of the tasks (made first where it lacks them) and the "
                   "methods' runs against it, in runs/lr: nothing committed is read or written")
    a = p.parse_args(argv)
    steps = QUICK_STEPS if a.quick else None
    gpath = grid_path(a.quick, a.here)
    grids = forget(_load(gpath), a.tasks) if a.fresh and a.command == "grid" else _load(gpath)
    if a.command == "grid" or a.quick or (a.here and a.command == "eval"):
        run_grid(a.tasks, grids, a.jobs, steps, gpath)
        print(grids_markdown(grids) if not a.quick else f"{len(grids)} grid runs")
        if a.command == "grid":
            return 0
    if a.command == "same":
        if len(a.method) != 2:
            p.error("same compares two methods: --method A B")
        x, y = a.method
        stores = [_load(store_path(m, a.quick, a.here)) for m in (x, y)]
        both, differ = agreement(x, y, *stores)
        print(f"{x} and {y}: {both} cells run by both; the same lr and validation loss in "
              f"{both - len(differ)}" + "".join(f"\n  differ: {k}" for k in differ))
        return 0
    lacking = [t for t in a.tasks if not grid_complete(t, grids, steps)]
    if lacking:  # a method's starts are read off the grid
        flags = f"{' --quick' if a.quick else ''}{' --here' if a.here else ''}"
        # writing into the committed grid needs a machine that repeats it
        note = "" if a.here or a.quick else (
            "or, on a machine that does not repeat the committed grid, its own grid: the same with --here")
        _store.refuse(gpath, f"python -m benchmarks.lr grid{flags} --tasks {' '.join(lacking)}", DOC,
                      lacks=", ".join(lacking), note=note)
    tables = []
    if a.command == "eval" and not a.mixed_numerics:
        numerics_problem(a.tasks[0], grids, steps)
    if a.command == "report":  # from stored runs only: refused, naming `eval`, where any lacks a run
        stored = {method: suite_runs(method, a.tasks, grids, steps, a.here) for method in a.method}
    for method in a.method:
        if a.command == "report":
            store = stored[method]
        else:
            path = store_path(method, a.quick, a.here)
            store = forget(_load(path), a.tasks) if a.fresh else _load(path)
            runs = [Run(t, method, lr, s, steps) for t in a.tasks
                    for lr in cells(t, grids, steps).values() for s in SEEDS]
            _run_all(runs, store, path, a.jobs)
        tables.append(markdown(method, table(method, a.tasks, grids, store, steps)))
        print(f"### {method}\n\n{tables[-1]}")
    if a.command == "report" and not a.quick and not a.here and a.tasks == list(TASKS):
        if set(a.method) <= set(REPORTED):
            write_docs(a.method, grids, tables)
        else:  # the docs show only what a clone can rebuild: the committed stores' methods
            others = ", ".join(m for m in a.method if m not in REPORTED)
            _store.leave("lr-suite", f"the runs of {others} are not committed (benchmarks.lr.REPORTED)",
                         f"python -m benchmarks.lr report --method {' '.join(REPORTED)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
