"""The learning-rate search's bar in one table, read on stored runs: the design and held-out tasks apart.

    python -m benchmarks.lr.bar [--method Forks]   # prints the table and writes its docs section

Nothing is trained here. Each row reads what a command of the suite stored:

* no harm, recovery, the lr it ends at, lost runs: the method's suite runs
  (``python -m benchmarks.lr eval --method M``, ``benchmarks/lr/stored/<M>.json``), as the
  suite's report reads them;
* co-exploration (``Forks`` only, the README's route for a second knob):
  ``benchmarks/lr/stored/coexplore.json`` (``python -m benchmarks.lr.coexplore``);
* cost: the optimizer steps over plain training's that ``python -m benchmarks.lr.cost`` stores
  (``benchmarks/lr/stored/cost.json``: ``fork_steps / step_count`` at the defaults), its seconds
  beside them;
* the momentum cycle: the tests that check it step by step against torch (named in the row);
* the lines below the table: ``benchmarks/lr/stored/noise.json`` (``python -m
  benchmarks.lr.noise``) and the probe losses the committed grids carry.

Printed, a row whose runs are missing says which command makes them. The docs section
(``--method Forks``) is written only from stores that hold what it reads: where one is missing,
or the suite's store lacks a task, the command exits naming the command that makes it, and
docs/benchmarks.md is left as it is.
"""

from __future__ import annotations

import argparse
import math
import statistics
from typing import Any

from benchmarks import _store
from benchmarks.lr import __main__ as suite
from benchmarks.lr.__main__ import (
    GRIDS,
    PROBE_SPLIT,
    _load,
    bar_counts,
    probe_picks,
    probe_size,
    store_path,
    suite_runs,
    table,
    write_section,
)
from benchmarks.lr.coexplore import PAIRS, _cells, _mean, _starts
from benchmarks.lr.coexplore import PATH as COEXPLORE
from benchmarks.lr.cost import COST
from benchmarks.lr.prototypes import LOOPS
from benchmarks.lr.run import METHODS
from benchmarks.lr.tasks import HELD_OUT, TASKS

__all__ = ["bar_rows", "by_probe_size", "main", "markdown", "probe_ceiling", "resolution"]

# the tests that check the optimizer follows a scheduler's momentum / beta1 cycle as torch does
CYCLE_TESTS = {
    "Forks": "tests/test_forks.py::test_your_run_is_plain_training_bit_for_bit_when_it_is_kept, "
             "::test_a_winner_under_onecycle_is_plain_onecycle_training_at_its_multiple",
    "autolr": "tests/test_recipe.py::test_autolr_follows_the_schedulers_momentum_cycle_step_by_step",
}


def _cell(text: str, met: bool | None) -> str:
    return f"{text} ({'met' if met else 'not met'})" if met is not None else text


def _warmup_row(rows: list[dict[str, Any]]) -> str:
    """Recovery from 10x above on the set's OneCycleLR tasks, whose first cut falls inside the
    warm-up, where a slower lr has barely moved (issue 39)."""
    above = [r for r in rows if r["start"] == "10x" and r["task"] in TASKS
             and TASKS[r["task"]].sched == "onecycle"]
    if not above:
        return "no OneCycleLR task in this set"
    rec = sum(not math.isnan(r["vs_oracle"]) and r["vs_oracle"] <= 1.05 for r in above)
    return _cell(f"{rec} of {len(above)} cells ({rec / len(above):.0%})", rec / len(above) >= 0.75)


def _suite_rows(rows: list[dict[str, Any]]) -> list[str]:
    """The five rows read on the suite's runs of one set of tasks."""
    harm, n_at, rec, n_off, near, n = bar_counts(rows)
    at = [r["vs_plain"] for r in rows if r["start"] == "1x"]
    worst_at = max((x for x in at if not math.isnan(x)), default=math.nan)
    off = [r for r in rows if r["start"] != "1x"]
    worse = max((r["vs_plain"] for r in off if not math.isnan(r["vs_plain"])), default=math.nan)
    lost = sum(r["lost"] for r in rows)
    all_105 = all(not math.isnan(x) and x <= 1.05 for x in at)
    return [
        _cell(f"{harm} of {n_at} tasks ({harm / n_at:.0%}) <= 1.02; the largest {worst_at:.3f}",
              harm / n_at >= 0.9 and all_105),
        _cell(f"{rec} of {n_off} cells ({rec / n_off:.0%}); at most {worse:.3f}x plain at that start",
              rec / n_off >= 0.75 and not worse > 1.02),
        _warmup_row(rows),
        _cell(f"{near} of {n} cells ({near / n:.0%})", near / n >= 0.8),
        _cell(f"{lost}", lost == 0),
    ]


def _coexplore_row(held: bool) -> str:
    """The forks route on the co-exploration pairs of one set (``Forks`` only)."""
    store, grids = _load(COEXPLORE), _load(GRIDS)
    names = [n for n in PAIRS if (n in HELD_OUT) == held]
    if not store or not names:
        return "no runs: `python -m benchmarks.lr.coexplore`"
    at_best = bad = bad_ok = best_ok = 0
    for name in names:
        plain = {c: _mean(store, "plain", name, *c) for c in _cells(name, grids)}
        best = min((v, c) for c, v in plain.items() if not math.isnan(v))
        for k, start in enumerate(_starts(name, plain, best)):
            v = _mean(store, "forks", name, *start)
            if k == 0:
                at_best, best_ok = at_best + 1, best_ok + (v <= 1.05 * best[0])
            else:
                bad, bad_ok = bad + 1, bad_ok + (v < plain[start])
    return _cell(f"{len(names)} tasks: from the 2-D best within 5% on {best_ok} of {at_best}; from a bad "
                 f"knob value better than plain on {bad_ok} of {bad}", best_ok == at_best and bad_ok == bad)


TITLE = "The learning-rate search against its bar (`hpx.Forks`)"  # of its docs section
COST_BAR = 2.0  # the method's optimizer steps over plain training's, at its defaults


def _cost_row(method: str, held: bool) -> str:
    """The method's optimizer steps over plain training's on each task of the set, as
    ``python -m benchmarks.lr.cost`` stores them (``<method> steps``: hpx.Forks' ``fork_steps /
    step_count`` at its defaults), against :data:`COST_BAR`; its wall time over plain's beside them,
    not judged."""
    store = _load(COST)
    wanted = [n for n in TASKS if (n in HELD_OUT) == held]
    names = [n for n in wanted if n in store and method in store[n]]
    if not names:
        return "no runs: `python -m benchmarks.lr.cost`"
    walls = sorted(store[n][method] / store[n]["plain"] for n in names)
    wall = (f"wall time median {statistics.median(walls):.2f}x plain's, {walls[0]:.2f}-{walls[-1]:.2f} "
            "(not judged)")
    missing = len(wanted) - len(names)
    rest = f" ({missing} not measured: `python -m benchmarks.lr.cost`)" if missing else ""
    steps = sorted(store[n][f"{method} steps"] for n in names if f"{method} steps" in store[n])
    if len(steps) < len(names):
        return (f"optimizer steps not stored for {len(names) - len(steps)} of {len(names)} tasks: "
                "`python -m benchmarks.lr.cost` stores those of a method that counts them (hpx.Forks' "
                f"`fork_steps`){rest}; {wall}")
    low, high = f"{steps[0]:.2f}", f"{steps[-1]:.2f}"
    span = low if low == high else f"{low}-{high}"
    return (_cell(f"{span}x plain training's optimizer steps over {len(names)} tasks{rest}",
                  steps[-1] <= COST_BAR and not missing) + f"; {wall}")


BAR = [
    ("do no harm: hpx / plain at the grid's best lr, mean of 2 seeds",
     "<= 1.02 on 90% of tasks, <= 1.05 on all"),
    ("recover: from 10x below and 10x above",
     "<= 1.05x the oracle on 75% of cells; never > 1.02x plain there"),
    ("recover under a warm-up: from 10x above on the OneCycleLR tasks (torch's 30% warm-up)",
     "<= 1.05x the oracle on 75% of cells"),
    ("the fixed point: the lr it ends at", "within 3x of the grid's best on 80% of cells"),
    ("no lost run", "none"),
    ("co-exploration (lr + a second knob)",
     "from the 2-D best <= 1.05x it; from a bad value better than plain"),
    ("cost", f"at most {COST_BAR:.1f}x plain training's optimizer steps at the defaults"),
    ("momentum cycle", "OneCycleLR's momentum / beta1 followed exactly (tested against torch)"),
]


def bar_rows(method: str) -> list[tuple[str, str, str, str]]:
    """``(criterion, bar, design, held out)`` for each row of the bar."""
    grids, store = _load(GRIDS), _load(store_path(method))
    cols = []
    for held in (False, True):
        names = [t for t in TASKS if (t in HELD_OUT) == held]
        try:
            suite = _suite_rows(table(method, names, grids, store))
        except KeyError:
            suite = [f"no runs: `python -m benchmarks.lr eval --method {method}`"] * 5
        coexplore = _coexplore_row(held) if method == "Forks" else "not run (its route is the engine's)"
        cycle = f"tested: {CYCLE_TESTS[method]}" if method in CYCLE_TESTS else "not tested"
        cols.append([*suite, coexplore, _cost_row(method, held), cycle])
    return [(c, b, d, h) for (c, b), d, h in zip(BAR, *cols)]


def by_probe_size(method: str) -> list[str]:
    """The suite's four rows again, both sets together, split by the probe's size (markdown lines)."""
    try:
        rows = table(method, list(TASKS), _load(GRIDS), _load(store_path(method)))
    except KeyError:
        return []
    big = {t for t in TASKS if probe_size(t) > PROBE_SPLIT}
    parts = [[r for r in rows if (r["task"] in big) == b] for b in (True, False)]
    n = [len({r["task"] for r in part}) for part in parts]
    out = ["", "The same five rows by the probe's size (tokens for a language model), both sets together:",
           "",
           f"| criterion | probe of more than {PROBE_SPLIT} examples ({n[0]} tasks) | {PROBE_SPLIT} or fewer "
           f"({n[1]} tasks) |", "| --- | --- | --- |"]
    cols = [_suite_rows(part) for part in parts]
    out += [f"| {c} | {a} | {b} |" for (c, _), a, b in zip(BAR, *cols)]
    return out


def resolution() -> list[str]:
    """What a perfect search would read on the suite (``python -m benchmarks.lr.noise``): plain
    training at the grid's best lr by another rounding path, against the two thresholds the quality
    rows read a run that moved against (markdown lines; until the nudged runs exist, a line naming
    the command that makes them)."""
    from benchmarks.lr import noise

    store, grids = _load(noise.PATH), _load(GRIDS)
    try:
        table_ = noise.rows(list(TASKS), grids, store)
    except KeyError:
        return ["", "What a search landing exactly on the grid's best lr would read: no runs yet "
                "(`python -m benchmarks.lr.noise`)."]
    parts = []
    for held, words in ((False, "design"), (True, "held-out")):
        cells = [x for r in table_ if r["held_out"] == held for x in r["ratios"]]
        tasks = [r for r in table_ if r["held_out"] == held]
        in5, in2 = sum(x <= 1.05 for x in cells), sum(x <= 1.02 for x in cells)
        steady = sum(max(r["ratios"]) <= 1.05 for r in tasks)
        parts.append(f"{words}: {in5} of {len(cells)} nudged pairs within 5% of the oracle and {in2} within "
                     f"2%; {steady} of {len(tasks)} tasks within 5% at every nudge")
    return ["", "What a search landing exactly on the grid's best lr would read (`python -m "
            "benchmarks.lr.noise`: plain training there, the lr nudged by parts in a million, so only the "
            "rounding differs, 2 seeds, three nudges): " + "; ".join(parts) + ". A quality row that reads a "
            "run which moved (a winner, a recovered start) cannot be met more often than this."]


def probe_ceiling() -> list[str]:
    """What a search that picked the best finished grid run on the probe would read (the probe's
    pick, ``python -m benchmarks.lr.ceiling``) against the quality rows, design and held-out tasks
    apart (markdown lines; until every grid run carries its probe loss, a line naming the command)."""
    from benchmarks.lr import ceiling

    grids = _load(GRIDS)
    if any(probe_picks(t, grids) is None for t in TASKS):
        return ["", "What the probe's own pick would read: some grid runs carry no probe loss yet "
                "(`python -m benchmarks.lr.ceiling`)."]
    rows = ceiling.pick_rows(list(TASKS), grids)
    parts = []
    for held, words in ((False, "design"), (True, "held-out")):
        harm, rec, lr3, n = ceiling.pick_counts([r for r in rows if r["held_out"] == held])
        parts.append(f"{words}: within 2% of the grid's best on {harm} of {n} tasks, within 5% on {rec} "
                     f"of {n}, the lr within 3x in {lr3} of {2 * n} runs")
    return ["", "What the probe's own pick would read (`python -m benchmarks.lr.ceiling`: each seed's "
            "grid run that scores lowest on the probe at its end, the choice of a search that had every "
            "finished run of the grid in hand): " + "; ".join(parts) + ". A search that moves the lr "
            "toward what the probe prefers cannot do better than this, except where an error of its own "
            "cancels the probe's."]


def markdown(method: str) -> str:
    n_held = sum(t in HELD_OUT for t in TASKS)
    out = [f"Produced by `python -m benchmarks.lr.bar --method {method}` from the stored runs of the "
           f"suite (`python -m benchmarks.lr eval --method {method}`), of `python -m "
           "benchmarks.lr.coexplore` and of `python -m benchmarks.lr.cost`; the tables those write are "
           "below. "
           f"{len(TASKS) - n_held} design tasks and {n_held} held-out ones.", "",
           "| criterion | bar | design tasks | held-out tasks |", "| --- | --- | --- | --- |"]
    out += [f"| {c} | {b} | {d} | {h} |" for c, b, d, h in bar_rows(method)]
    out += by_probe_size(method)
    out += resolution()
    out += probe_ceiling()
    return "\n".join(out) + "\n"


def require_stores(method: str) -> None:
    """Exit, naming the command that makes it, unless every store the section reads holds what
    it reads: the method's suite runs on every task, co-exploration's runs (``Forks``), the cost
    measurements and the nudged runs."""
    from benchmarks.lr import noise

    suite_runs(method, list(TASKS), _load(GRIDS))
    stores = [(COST, "python -m benchmarks.lr.cost"), (noise.PATH, "python -m benchmarks.lr.noise")]
    if method == "Forks":
        stores.insert(0, (COEXPLORE, "python -m benchmarks.lr.coexplore"))
    for path, command in stores:
        _store.load(path, command, suite.DOC)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.lr.bar", description=__doc__.split("\n")[0])
    p.add_argument("--method", default="Forks", choices=sorted([*METHODS, *LOOPS]))
    a = p.parse_args(argv)
    write = a.method == "Forks"  # the recommended search's bar is the one the docs show
    if write:
        require_stores(a.method)
    md = markdown(a.method)
    print(md)
    if write:
        write_section("lr-bar", TITLE, md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
