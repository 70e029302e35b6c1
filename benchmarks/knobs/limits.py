"""What limits the co-exploration suite's bad-start row, measured from the committed stores.

    python -m benchmarks.knobs limits

Two readings, neither of which runs anything:

* **The end's bar, swept.** ``Forks`` and ``Forks-z0`` (the default with ``confidence=0``) take the
  same path to the end, which records the best challenger's lead over your run in standard errors
  (``gain``) and how many challengers stood. A run at another ``confidence`` ``c`` ends as the
  default where its best challenger cleared the default's bar or fell short of ``c``'s (both keep the
  same end), and as ``Forks-z0`` in between: the whole row at any ``c`` without a run. The read sets
  only (``Forks-z0`` ran on them alone).
* **A perfect search's reach.** For each bad start, the best plain run of the grid that moves each
  knob by at most ``k`` grid steps from the start (the grids' steps are about one spread of the knobs
  as declared), the lr held at the start's or free over the grid: what a search that always picked
  the right neighbour would reach, beside ``hpx.Forks``, ``finished-each`` (a fork per knob and side
  from the run's first step to its end, uncut: the most evidence a one-spread search can buy) and
  Optuna.
* **Leads the end's test held back.** Of the runs from bad starts that ended at the start's values,
  those where a finished challenger led your run on the probe, and by how many standard errors.
"""

from __future__ import annotations

import math
import statistics
from typing import Any

from benchmarks.knobs.run import key
from benchmarks.knobs.tasks import TASKS, CoTask
from hpx.forks.late import corrected

__all__ = ["grid_steps", "reach_counts", "short_leads", "swept", "swept_counts"]

SWEEP = (0.0, 0.5, 1.0, 1.5, 2.0)
"""The confidences the bar is swept over (``2.0``: the default; ``0``: the best scorer wins)."""


def swept(default: dict[str, Any], without: dict[str, Any], confidence: float,
          knobs_only: bool = False) -> float | None:
    """The validation loss a run would end at with ``confidence`` instead of the default's ``2.0``,
    from the default's run ``default`` and the same run at ``confidence=0`` ``without`` (the stored
    results of one start and seed); ``knobs_only``: ``confidence`` for a knob fork (the best challenger
    at your lr multiple), the default's bar for an lr fork. Raises ``ValueError`` when the two did not
    reach the same end."""
    end = default.get("end")
    if end is None:
        return default["val"]
    scores = end["scores"]
    if without.get("end") is None or without["end"]["scores"] != scores:
        raise ValueError("the two runs reached different ends (scores "
                         f"{scores} and {None if without.get('end') is None else without['end']['scores']}): "
                         "rerun both on one machine")
    gain = end.get("gain")
    if gain is None or not math.isfinite(gain):  # your run led, or lost outright: every bar ends alike
        return default["val"]
    rivals = sum(math.isfinite(x) for x in scores[1:])
    best = min(range(1, len(scores)), key=lambda i: scores[i])
    if knobs_only and end["values"]["lr"][best] != 1.0:
        confidence = 2.0
    if gain >= corrected(2.0, rivals) or gain < corrected(confidence, rivals):
        return default["val"]
    return without["val"]


def grid_steps(ct: CoTask, cell: tuple[float, ...]) -> list[int]:
    """Each knob's index on its grid axis (sorted), for ``cell = (lr, knob values...)``."""
    return [sorted(values).index(v) for (_, values), v in zip(ct.axes, cell[1:])]


def _swept_mean(default: dict[str, Any], without: dict[str, Any], name: str, cell: tuple[float, ...],
                seeds: tuple[int, ...], confidence: float, knobs_only: bool) -> float:
    """The seeds' mean of :func:`swept` at one start (``nan`` when a run is missing or diverged)."""
    vals = []
    for s in seeds:
        run = default.get(key("Forks", name, cell, s))
        other = without.get(key("Forks-z0", name, cell, s))
        v = None if run is None or other is None else swept(run, other, confidence, knobs_only)
        vals.append(math.nan if v is None else v)
    return statistics.fmean(vals)


def swept_counts(default: dict[str, Any], without: dict[str, Any], grid: dict[str, Any], names: list[str],
                 confidence: float, knobs_only: bool = False) -> dict[str, float]:
    """The bar's counts on ``names`` (the tasks' starts) at ``confidence``: best cells within 2% of
    plain training (``best`` of ``best_n``, the ``largest`` ratio), bad starts 2% better than plain
    (``better`` of ``bad_n``) and within 5% of the grid's best (``near``)."""
    from benchmarks.knobs.__main__ import SEEDS, best_cell, mean_val, starts

    out = {"best": 0, "best_n": 0, "largest": 0.0, "better": 0, "bad_n": 0, "near": 0}
    for name in names:
        ct = TASKS[name]
        top, _ = best_cell(ct, grid)
        for kind, cell in starts(ct, grid):
            plain = mean_val(grid, "plain", name, cell)
            got = _swept_mean(default, without, name, cell, SEEDS, confidence, knobs_only)
            if kind == "best":
                out["best"] += got <= 1.02 * plain
                out["best_n"] += 1
                out["largest"] = max(out["largest"], got / plain)
            else:
                out["better"] += got <= 0.98 * plain
                out["near"] += got <= 1.05 * top
                out["bad_n"] += 1
    return out


def reach_counts(grid: dict[str, Any], names: list[str], steps: int, lr_free: bool) -> dict[str, int]:
    """A perfect search from every bad start of ``names``: the best plain cell of the grid with each
    knob at most ``steps`` grid steps from the start's, at the start's lr (``lr_free=False``) or any
    of the grid's; counted as the bar counts (``better``, ``near`` of ``bad_n``)."""
    from benchmarks.knobs.__main__ import best_cell, cells_of, mean_val, starts

    out = {"better": 0, "near": 0, "bad_n": 0}
    for name in names:
        ct = TASKS[name]
        top, _ = best_cell(ct, grid)
        for kind, cell in starts(ct, grid):
            if kind != "bad":
                continue
            at = grid_steps(ct, cell)
            reached = [mean_val(grid, "plain", name, c) for c in cells_of(ct, grid)
                       if (lr_free or c[0] == cell[0])
                       and all(abs(a - b) <= steps for a, b in zip(grid_steps(ct, c), at))]
            got = min(v for v in reached if not math.isnan(v))
            out["better"] += got <= 0.98 * mean_val(grid, "plain", name, cell)
            out["near"] += got <= 1.05 * top
            out["bad_n"] += 1
    return out


def short_leads(store: dict[str, Any], method: str, grid: dict[str, Any],
                names: list[str]) -> dict[str, float]:
    """Over the runs of ``method`` from the bad starts of ``names``: how many ended at the start's values
    (``kept`` of ``runs``), in how many of those the best challenger led your run on the probe and fell
    short of the end's bar (``short``), and the median lead of those in standard errors (``median``)."""
    from benchmarks.knobs.__main__ import SEEDS, starts

    out: dict[str, float] = {"runs": 0, "kept": 0, "short": 0, "median": math.nan}
    leads = []
    for name in names:
        ct = TASKS[name]
        for kind, cell in starts(ct, grid):
            for s in SEEDS if kind == "bad" else ():
                run = store.get(key(method, name, cell, s))
                if run is None:
                    continue
                out["runs"] += 1
                moved = run["lr_factor"] != 1.0 or any(not math.isclose(run["values"][k], v, abs_tol=1e-12)
                                                       for k, v in zip(ct.knob_names(), cell[1:]))
                if moved:
                    continue
                out["kept"] += 1
                gain = (run.get("end") or {}).get("gain")
                if gain is not None and math.isfinite(gain) and gain > 0:
                    leads.append(gain)
    out["short"] = len(leads)
    if leads:
        out["median"] = statistics.median(leads)
    return out


def tables(grid: dict[str, Any], stores: dict[str, dict[str, Any]]) -> list[str]:
    """Both readings as markdown tables (``stores``: ``Forks``, ``Forks-z0`` and ``Optuna``'s runs)."""
    from benchmarks.knobs.__main__ import GROUPS, counts, gridded, in_group

    read = [n for n, ct in TASKS.items()
            if (in_group(n, "design") or in_group(n, "first")) and gridded(ct, grid)]
    out = ["The end's bar, swept (the read sets, from the stores of `Forks` and `Forks-z0`):", "",
           "| confidence | for | from the best: within 2% of plain | the largest "
           "| from a bad value: 2%+ better than plain | ... within 5% of the grid's best |",
           "| ---: | --- | ---: | ---: | ---: | ---: |"]
    for knobs_only in (False, True):
        for c in SWEEP[:-1] if knobs_only else SWEEP:
            r = swept_counts(stores["Forks"], stores["Forks-z0"], grid, read, c, knobs_only)
            label = f"{c:g}" + (" (the default)" if c == 2.0 else " (the best scorer wins)" if c == 0 else "")
            whom = "a knob fork (an lr fork: 2)" if knobs_only else "every challenger"
            out.append(f"| {label} | {whom} | {r['best']} of {r['best_n']} | {r['largest']:.3f} | "
                       f"{r['better']} of {r['bad_n']} | {r['near']} of {r['bad_n']} |")
    out += ["", "A perfect search's reach from the bad starts (the grid's best plain run within k grid steps "
            "of the start's knob values), beside hpx.Forks, finished-each and Optuna:", "",
            "| tasks | route | 2%+ better than plain | within 5% of the grid's best |",
            "| --- | --- | ---: | ---: |"]
    sets = {"read": ("design", "first"), "second": ("second",), "third": ("third",)}
    for label, groups in sets.items():
        names = [n for n, ct in TASKS.items() if any(in_group(n, g) for g in groups) and gridded(ct, grid)]
        for steps in (1, 2):
            for free in (False, True):
                r = reach_counts(grid, names, steps, free)
                route = f"perfect, knobs within {steps} step{'s' * (steps > 1)}, the lr " + \
                    ("anywhere on the grid" if free else "held")
                out.append(f"| {label} | {route} | {r['better']} of {r['bad_n']} | "
                           f"{r['near']} of {r['bad_n']} |")
        for method in ("Forks", "finished-each", "Optuna"):
            got = [counts(method, stores.get(method, {}), grid, g) for g in groups]
            better, near, n = (sum(c[k] for c in got) for k in ("better", "near", "bad_n"))
            if n:
                out.append(f"| {label} | {method} | {better} of {n} | {near} of {n} |")
    assert set(GROUPS) == {g for gs in sets.values() for g in gs}
    out += ["", "The runs from the read sets' bad starts that ended at the start's values, and those among "
            "them where a finished challenger led your run on the probe and fell short of the end's bar:", "",
            "| route | runs | ended at the start | ... a challenger led, short of the bar "
            "| its lead (median) |",
            "| --- | ---: | ---: | ---: | ---: |"]
    for method in ("Forks", "finished-each"):
        if method in stores:
            r = short_leads(stores[method], method, grid, read)
            out.append(f"| {method} | {r['runs']} | {r['kept']} | {r['short']} | {r['median']:.2f} |")
    return out
