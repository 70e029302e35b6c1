"""The co-exploration suite: the lr and one or two knobs besides it, against a grid of plain runs.

    python -m benchmarks.knobs grid [--jobs 2]           # plain runs on every task's grid
    python -m benchmarks.knobs eval --method Forks       # the method from each task's starts
    python -m benchmarks.knobs report --method Forks     # its table into docs/benchmarks.md
    python -m benchmarks.knobs limits                    # the end's bar swept, a perfect search's reach

Each task (``benchmarks/knobs/tasks.py``) has a grid of plain runs: five peak lrs half a decade
apart times four values of one knob, or times three values of each of two knobs, 2 seeds per cell
(``benchmarks/knobs/stored/grid.json``, committed; a grid whose best lr lies at its edge is
extended by half-decades, twice at most). A method starts from:

* the grid's best cell (bar: within 2% of plain training there);
* every other cell at the best cell's lr whose plain run is at least 5% worse than the best cell's
  (a bad knob value; bar: at least 2% better than plain training there, and within 5% of the
  grid's best).

Values are the mean of the 2 seeds' validation losses. Stores: ``benchmarks/knobs/stored/`` (the
grid and the reported methods' runs, committed); ``--store runs`` keeps a method's runs in
``runs/knobs/`` (gitignored) for exploration. The held-out sets (``FIRST_HELD_OUT``, read since,
``SECOND_HELD_OUT`` and ``THIRD_HELD_OUT``) are reported apart from the design tasks and from each other.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path
from typing import Any

from benchmarks.knobs.run import METHODS, key, run
from benchmarks.knobs.tasks import FIRST_HELD_OUT, HELD_OUT, SECOND_HELD_OUT, TASKS, THIRD_HELD_OUT, CoTask

ROOT = Path(__file__).resolve().parents[2]
STORED = Path(__file__).with_name("stored")
RUNS = ROOT / "runs" / "knobs"
GRID = STORED / "grid.json"
DOC = ROOT / "docs" / "benchmarks.md"
SEEDS = (0, 1)
EXTEND = 2  # half-decades a grid may grow by on a side where its best lr lies


def _load(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.exists() else {}


def _save(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(dict(sorted(data.items())), indent=0, sort_keys=True) + "\n")
    tmp.replace(path)


def _execute(runs: list[tuple[str, str, tuple[float, ...], int]], store: dict[str, Any], path: Path,
             jobs: int) -> None:
    todo = [r for r in runs if key(*r) not in store]
    if not todo:
        return
    print(f"{len(todo)} runs on {jobs} processes", file=sys.stderr)
    with ProcessPoolExecutor(jobs) as pool:
        futures = [pool.submit(run, r) for r in todo]
        for i, f in enumerate(as_completed(futures), 1):
            k, res = f.result()
            store[k] = res
            print(f"[{i}/{len(todo)}] {k}: val {res['val']} {res['seconds']:.1f}s", file=sys.stderr)
            if i % 20 == 0:
                _save(path, store)
    _save(path, store)


# ----------------------------------------------------------------------------- the grid


def lrs_of(ct: CoTask, grid: dict[str, Any]) -> list[float]:
    """The task's grid lrs, with the half-decades it was extended by."""
    lo, hi = grid.get(f"extend|{ct.name}", [0, 0])
    return [ct.task.center * 10 ** (k / 2) for k in range(-2 - lo, 3 + hi)]


def cells_of(ct: CoTask, grid: dict[str, Any]) -> list[tuple[float, ...]]:
    out: list[tuple[float, ...]] = [(lr,) for lr in lrs_of(ct, grid)]
    for _, values in ct.axes:
        out = [(*c, v) for c in out for v in values]
    return out


def mean_val(store: dict[str, Any], method: str, name: str, cell: tuple[float, ...]) -> float:
    vals = [store.get(key(method, name, cell, s), {}).get("val", math.nan) for s in SEEDS]
    return math.nan if any(v is None or math.isnan(v) for v in vals) else statistics.fmean(vals)


def best_cell(ct: CoTask, grid: dict[str, Any]) -> tuple[float, tuple[float, ...]]:
    vals = [(mean_val(grid, "plain", ct.name, c), c) for c in cells_of(ct, grid)]
    return min((v, c) for v, c in vals if not math.isnan(v))


def make_grid(names: list[str], jobs: int) -> dict[str, Any]:
    grid = _load(GRID)
    for _ in range(EXTEND + 1):
        todo = [("plain", n, c, s) for n in names for c in cells_of(TASKS[n], grid) for s in SEEDS]
        _execute(todo, grid, GRID, jobs)
        grown = False
        for n in names:
            ct = TASKS[n]
            lrs = lrs_of(ct, grid)
            _, cell = best_cell(ct, grid)
            lo, hi = grid.get(f"extend|{n}", [0, 0])
            if cell[0] == lrs[0] and lo < EXTEND:
                lo, grown = lo + 1, True
            elif cell[0] == lrs[-1] and hi < EXTEND:
                hi, grown = hi + 1, True
            grid[f"extend|{n}"] = [lo, hi]
        _save(GRID, grid)
        if not grown:
            break
    return grid


# ----------------------------------------------------------------------------- starts and the table


def starts(ct: CoTask, grid: dict[str, Any]) -> list[tuple[str, tuple[float, ...]]]:
    """``("best", the best cell)``, then ``("bad", c)`` for every cell at the best cell's lr whose
    plain run is at least 5% worse."""
    best, cell = best_cell(ct, grid)
    out: list[tuple[str, tuple[float, ...]]] = [("best", cell)]
    for c in cells_of(ct, grid):
        if c[0] == cell[0] and c != cell and mean_val(grid, "plain", ct.name, c) >= 1.05 * best:
            out.append(("bad", c))
    return out


def _shown(cell: tuple[float, ...]) -> str:
    return ", ".join(f"{v:.3g}" for v in cell)


def gridded(ct: CoTask, grid: dict[str, Any]) -> bool:
    """Whether every cell of the task's grid has both seeds' runs."""
    return all(key("plain", ct.name, c, s) in grid for c in cells_of(ct, grid) for s in SEEDS)


# The task sets the tables report apart: the design tasks, the first held-out set (read: its cell-by-cell
# reading informed the design after it, so it no longer counts as held out), the second and the third.
GROUPS: dict[str, str] = {"design": "design", "first": "first held-out set (read)",
                          "second": "second held-out set", "third": "third held-out set"}
_SETS = {"first": FIRST_HELD_OUT, "second": SECOND_HELD_OUT, "third": THIRD_HELD_OUT}


def in_group(name: str, group: str) -> bool:
    """Whether task ``name`` belongs to ``group`` (a key of :data:`GROUPS`)."""
    if group == "design":
        return name not in HELD_OUT
    return name in _SETS[group]


def rows(method: str, store: dict[str, Any], grid: dict[str, Any], group: str) -> list[dict[str, Any]]:
    out = []
    for name, ct in TASKS.items():
        if not in_group(name, group) or not gridded(ct, grid):
            continue
        best, _ = best_cell(ct, grid)
        for kind, cell in starts(ct, grid):
            plain = mean_val(grid, "plain", name, cell)
            got = mean_val(store, method, name, cell)
            runs = [store.get(key(method, name, cell, s)) for s in SEEDS]
            done = all(r is not None for r in runs)
            ends = ""
            if done:
                lr = math.exp(statistics.fmean(math.log(cell[0] * r["lr_factor"]) for r in runs))
                ends = ", ".join([f"{lr:.3g}"] + [f"{statistics.fmean(r['values'][k] for r in runs):.3g}"
                                                  for k in ct.knob_names()])
            out.append({"task": name, "knobs": " x ".join(ct.knob_names()), "late": ct.late, "start": kind,
                        "cell": cell, "plain": plain, "got": got, "best": best, "ends": ends, "done": done,
                        "steps": statistics.fmean(r["steps"] for r in runs) if done else math.nan})
    return out


def table(method: str, store: dict[str, Any], grid: dict[str, Any], group: str) -> list[str]:
    out = ["| task | knobs | late | start | cell (lr, knobs) | plain | hpx | hpx / plain | hpx / grid's best "
           "| ends at | steps / plain |",
           "| --- | --- | --- | --- | --- | ---: | ---: | ---: | ---: | --- | ---: |"]
    for r in rows(method, store, grid, group):
        if not r["done"]:
            out.append(f"| {r['task']} | {r['knobs']} | {'yes' if r['late'] else ''} | {r['start']} | "
                       f"{_shown(r['cell'])} | {r['plain']:.4f} | not run | | | | |")
            continue
        out.append(f"| {r['task']} | {r['knobs']} | {'yes' if r['late'] else ''} | {r['start']} | "
                   f"{_shown(r['cell'])} | {r['plain']:.4f} | {r['got']:.4f} | {r['got'] / r['plain']:.3f} | "
                   f"{r['got'] / r['best']:.3f} | {r['ends']} | {r['steps']:.2f}x |")
    return out


def counts(method: str, store: dict[str, Any], grid: dict[str, Any], group: str) -> dict[str, int]:
    """The bar's counts on a set of tasks (a key of :data:`GROUPS`): starts from the best cell within 2% of
    plain training (``best``, of ``best_n``), bad-value starts 2% better than plain (``better``,
    of ``bad_n``) and within 5% of the grid's best (``near``)."""
    rs = [r for r in rows(method, store, grid, group) if r["done"]]
    best = [r for r in rs if r["start"] == "best"]
    bad = [r for r in rs if r["start"] == "bad"]
    return {"best": sum(r["got"] <= 1.02 * r["plain"] for r in best), "best_n": len(best),
            "better": sum(r["got"] <= 0.98 * r["plain"] for r in bad), "bad_n": len(bad),
            "near": sum(r["got"] <= 1.05 * r["best"] for r in bad)}


def summary(method: str, store: dict[str, Any], grid: dict[str, Any]) -> list[str]:
    """The bar's rows, each set of tasks apart."""
    out = ["| tasks | from the best: within 2% of plain | the largest "
           "| from a bad value: 2%+ better than plain | ... within 5% of the grid's best "
           "| steps / plain (median) |",
           "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for group, name in GROUPS.items():
        rs = [r for r in rows(method, store, grid, group) if r["done"]]
        best = [r["got"] / r["plain"] for r in rs if r["start"] == "best"]
        bad = [r for r in rs if r["start"] == "bad"]
        n = len({r["task"] for r in rs})
        label = f"{name} ({n})"
        if not rs:
            out.append(f"| {name} | not run | | | | |")
            continue
        out.append(f"| {label} | {sum(x <= 1.02 for x in best)} of {len(best)} | "
                   f"{max(best, default=math.nan):.3f} | "
                   f"{sum(r['got'] <= 0.98 * r['plain'] for r in bad)} of {len(bad)} | "
                   f"{sum(r['got'] <= 1.05 * r['best'] for r in bad)} of {len(bad)} | "
                   f"{statistics.median([r['steps'] for r in rs]) if rs else math.nan:.2f}x |")
    return out


def grid_table(grid: dict[str, Any]) -> list[str]:
    out = ["| task | set | knobs | late | lrs | best cell (lr, knobs) | its loss | worst at its lr |",
           "| --- | --- | --- | --- | --- | --- | ---: | ---: |"]
    for name, ct in TASKS.items():
        if not gridded(ct, grid):
            continue
        best, cell = best_cell(ct, grid)
        row = [mean_val(grid, "plain", name, c) for c in cells_of(ct, grid) if c[0] == cell[0]]
        lrs = lrs_of(ct, grid)
        group = next(g for g in GROUPS if in_group(name, g))
        out.append(f"| {name} | {group} | {' x '.join(ct.knob_names())} | "
                   f"{'yes' if ct.late else ''} | {lrs[0]:.3g} .. {lrs[-1]:.3g} | {_shown(cell)} | "
                   f"{best:.4f} | {max(row) / best:.3f}x |")
    return out


MARKER = "knobs-suite"
# the methods whose committed runs the section shows, in this order: hpx.Forks at its defaults (the
# split design), at the defaults before it (two joint knob forks at 70%), at the defaults before issue
# 49 (knob forks from the start, cut with the lr's), Optuna at the same steps
REPORTED = ("Forks", "late70-joint", "Forks-start", "Optuna")
# defaults replaced before the third held-out set was made: not run on it (their tables say so)
BEFORE = ("late70-joint", "Forks-start")
LABELS = {"Forks": "hpx.Forks at its defaults (lower sides raced from the start, upper branched at 70%)",
          "late70-joint": "hpx.Forks with two joint knob forks branched at 70% of the run (defaults before)",
          "Forks-start": "hpx.Forks with the knob forks from the start, cut with the lr's (before issue 49)",
          "Optuna": "Optuna: TPE + successive halving over separate trials, at 2.9x plain training's steps"}
HEAD = """## Co-exploration suite: the lr and other knobs, from a bad knob value and from the best

Produced by `python -m benchmarks.knobs report` from the committed stores (`benchmarks/knobs/stored/`:
the grid, `python -m benchmarks.knobs grid`; each method's runs, `python -m benchmarks.knobs eval
--method M --store stored`, with `--held-out` for the held-out tasks; Optuna needs the `bench` extra).
Twenty-five set-ups, each with one or two knobs besides the lr. Ten are the design tasks. Five were
held out, committed with their grids before any search ran on the suite; their cell-by-cell reading
has since informed a design, so they are read ("first held-out set (read)"). Two sets of five more
were each committed with their grids before any search ran on them ("second held-out set", "third
held-out set"); the defaults replaced before the third was made were not run on it. A method starts from the
grid's best cell, and from every other cell at the best cell's lr whose plain run is at least 5%
worse (a bad knob value). Values are the mean validation loss of 2 seeds; "late": a set-up where the
better regularization should show only late (small data, long runs, a model that overfits)."""


def against(method: str, other: str, stores: dict[str, dict[str, Any]], grid: dict[str, Any]) -> list[str]:
    """Cell by cell (every start, the mean of its seeds): where ``method`` ends at or below ``other``."""
    out = [f"| tasks | {method} at or below {other} | ... from a bad value |", "| --- | ---: | ---: |"]
    for group, name in GROUPS.items():
        mine = {(r["task"], r["cell"]): r for r in rows(method, stores[method], grid, group) if r["done"]}
        theirs = {(r["task"], r["cell"]): r for r in rows(other, stores[other], grid, group) if r["done"]}
        both = [(mine[k], theirs[k]) for k in mine if k in theirs]
        bad = [(a, b) for a, b in both if a["start"] == "bad"]
        n = len({a["task"] for a, _ in both})
        at = sum(a["got"] <= b["got"] for a, b in both)
        out.append(f"| {name} ({n}) | {at} of {len(both)} | "
                   f"{sum(a['got'] <= b['got'] for a, b in bad)} of {len(bad)} |")
    return out


def section(grid: dict[str, Any], stores: dict[str, dict[str, Any]]) -> str:
    """The section's text from the grid and each reported method's store."""
    out = [HEAD, "", "### The grids", "", *grid_table(grid)]
    if "Forks" in stores and "Optuna" in stores:
        out += ["", "### hpx.Forks against Optuna, cell by cell", "",
                *against("Forks", "Optuna", stores, grid)]
    for method, store in stores.items():
        out += ["", f"### {LABELS.get(method, method)}", "", *summary(method, store, grid)]
        for group, name in GROUPS.items():
            if method in BEFORE and group == "third":
                continue
            out += ["", f"{name[0].upper() + name[1:]}:", "", *table(method, store, grid, group)]
    return "\n".join(out) + "\n"


def report(doc: Path = DOC) -> None:
    """Write the section into ``doc`` from the committed stores (refused, nothing written, when the
    grid or a reported method's store is missing or short of a start)."""
    from benchmarks import _store

    grid = _load(GRID)
    if not grid:
        _store.refuse(GRID, "python -m benchmarks.knobs grid", doc)
    stores = {}
    for method in REPORTED:
        path = STORED / f"{method}.json"
        store = _load(path)
        short = [n for n, ct in TASKS.items() for _, c in starts(ct, grid) for s in SEEDS
                 if key(method, n, c, s) not in store and not (method in BEFORE and n in THIRD_HELD_OUT)]
        if short:
            _store.refuse(path, f"python -m benchmarks.knobs eval --method {method} --store stored "
                          "(and again with --held-out)", doc, lacks=", ".join(sorted(set(short))))
        stores[method] = store
    text = doc.read_text()
    start, end = f"<!-- {MARKER} -->", f"<!-- /{MARKER} -->"
    body = "\n" + section(grid, stores)
    if start in text:
        text = text[:text.index(start) + len(start)] + body + text[text.index(end):]
    else:
        text = text.rstrip("\n") + f"\n\n{start}{body}{end}\n"
    doc.write_text(text)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.knobs", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("grid")
    g.add_argument("--tasks", nargs="+", default=list(TASKS))
    g.add_argument("--jobs", type=int, default=2)
    e = sub.add_parser("eval")
    e.add_argument("--method", required=True, choices=list(METHODS))
    e.add_argument("--tasks", nargs="+", default=None)
    e.add_argument("--held-out", action="store_true",
                   help="the tasks of both held-out sets (default: the design tasks)")
    e.add_argument("--jobs", type=int, default=2)
    e.add_argument("--store", choices=("stored", "runs"), default="runs")
    sub.add_parser("report")
    sub.add_parser("limits", help="the end's bar swept and a perfect search's reach, from the stores "
                   "(benchmarks/knobs/limits.py)")
    a = p.parse_args(argv)
    if a.cmd == "report":
        report()
        return 0
    if a.cmd == "limits":
        from benchmarks.knobs.limits import tables

        stores = {m: _load(STORED / f"{m}.json") for m in ("Forks", "Forks-z0", "finished-each", "Optuna")}
        print("\n".join(tables(_load(GRID), stores)))
        return 0
    if a.cmd == "grid":
        grid = make_grid(a.tasks, a.jobs)
        print("\n".join(grid_table(grid)))
        return 0
    grid = _load(GRID)
    names = a.tasks or [n for n in TASKS if (n in HELD_OUT) == a.held_out]
    path = (STORED if a.store == "stored" else RUNS) / f"{a.method}.json"
    store = _load(path)
    todo = [(a.method, n, cell, s) for n in names for _, cell in starts(TASKS[n], grid) for s in SEEDS]
    _execute(todo, store, path, a.jobs)
    for group, label in GROUPS.items():
        print(f"\n{label}:\n" + "\n".join(table(a.method, store, grid, group)))
    print("\n" + "\n".join(summary(a.method, store, grid)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
