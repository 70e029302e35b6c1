"""``python -m benchmarks.knobs limits`` (``benchmarks/knobs/limits.py``): the end's bar swept from the
stores of two real bars, and a perfect search's reach on a grid."""

from __future__ import annotations

import math

import pytest

from benchmarks.knobs import __main__ as suite
from benchmarks.knobs.limits import grid_steps, reach_counts, short_leads, swept, swept_counts, tables
from benchmarks.knobs.run import key

pytestmark = pytest.mark.quick

TASK = "k_moons_wd"  # one knob, weight decay (0.0, 0.03, 0.3, 3.0)


def _end(gain: float | None, scores: list[float], val: float) -> dict:
    return {"val": val, "end": {"gain": gain, "scores": scores, "values": {}}}


@pytest.mark.parametrize("gain, confidence, expected", [
    (2.5, 0.0, 0.1),   # cleared the default's bar (2.28 with two challengers): the default's end at any c
    (1.5, 0.5, 0.2),   # between c's bar (1.02 with two challengers) and the default's: untested
    (1.0, 1.5, 0.1),   # short of c's bar (1.83 with two challengers): the default's end
    (None, 0.0, 0.1),  # your run led: every bar keeps it
    (math.nan, 0.0, 0.1),
])
def test_swept_reads_the_default_or_the_untested_end_by_the_corrected_bar(gain, confidence, expected):
    scores = [1.0, 0.9, 0.95]
    assert swept(_end(gain, scores, 0.1), _end(gain, scores, 0.2), confidence) == expected


@pytest.mark.parametrize("factors, expected", [([1.0, 1.0, 10.0], 0.2), ([1.0, 10.0, 1.0], 0.1)])
def test_a_knobs_only_bar_lowers_it_for_a_knob_fork_and_keeps_the_default_for_an_lr_fork(factors, expected):
    scores = [1.0, 0.9, 0.95]  # the best challenger is the first: a knob fork at your lr, or the lr's at 10x
    default, without = _end(1.5, scores, 0.1), _end(1.5, scores, 0.2)
    for run in (default, without):
        run["end"]["values"] = {"lr": factors}
    assert swept(default, without, 0.5, knobs_only=True) == expected
    assert swept(default, without, 0.5) == 0.2


def test_swept_refuses_two_runs_that_reached_different_ends():
    with pytest.raises(ValueError, match="different ends"):
        swept(_end(1.0, [1.0, 0.9], 0.1), _end(1.0, [1.0, 0.8], 0.2), 0.0)


def test_the_sweep_at_0_and_2_is_the_two_committed_runs_themselves():
    """Every committed run of the default, swept to ``confidence=0``, ends where the run made at 0 ended,
    and at 2 where the default did: the sweep stands for runs it did not make."""
    default = suite._load(suite.STORED / "Forks.json")
    without = suite._load(suite.STORED / "Forks-z0.json")
    assert len(without) >= 98
    for k, run in without.items():
        mine = default[k.replace("Forks-z0|", "Forks|", 1)]
        assert swept(mine, run, 0.0) == run["val"], k
        assert swept(mine, run, 2.0) == mine["val"], k


def _grid(values: dict[tuple[int, float], float]) -> dict:
    """A grid of ``TASK`` with every cell's 2 seeds at 1.0, but ``(lr index, weight decay) -> loss``."""
    ct = suite.TASKS[TASK]
    grid: dict = {}
    lrs = suite.lrs_of(ct, grid)
    for cell in suite.cells_of(ct, grid):
        v = values.get((lrs.index(cell[0]), cell[1]), 1.0)
        for s in suite.SEEDS:
            grid[key("plain", TASK, cell, s)] = {"val": v}
    return grid


def test_a_perfect_search_reaches_what_its_steps_allow():
    # the best cell (lr 2, 3.0) at 0.5; bad starts at its lr: 0.03 (0.8) and 0 (1.0); 0.3 (0.52) is not bad
    grid = _grid({(2, 3.0): 0.5, (2, 0.3): 0.52, (2, 0.03): 0.8, (4, 0.0): 0.52})
    assert grid_steps(suite.TASKS[TASK], (1e-3, 0.3)) == [2]
    # one step, lr held: from 0.03 to 0.3 (better, within 5%), from 0 to 0.03 (better only)
    assert reach_counts(grid, [TASK], 1, lr_free=False) == {"better": 2, "near": 1, "bad_n": 2}
    # two steps: 0 reaches 0.3 too
    assert reach_counts(grid, [TASK], 2, lr_free=False) == {"better": 2, "near": 2, "bad_n": 2}
    # one step, the lr free: 0 reaches (lr 4, 0) at 0.52
    assert reach_counts(grid, [TASK], 1, lr_free=True) == {"better": 2, "near": 2, "bad_n": 2}


def test_swept_counts_count_as_the_suites_bar_does():
    grid = _grid({(2, 3.0): 0.5, (2, 0.3): 0.52, (2, 0.03): 0.8})
    lr = suite.lrs_of(suite.TASKS[TASK], grid)[2]
    default, without = {}, {}
    ends = {3.0: (2.1, 0.5, 0.6), 0.03: (1.6, 0.8, 0.5), 0.0: (None, 1.0, 1.0)}  # gain, default, untested
    for wd, (gain, mine, theirs) in ends.items():
        for s in suite.SEEDS:
            default[key("Forks", TASK, (lr, wd), s)] = _end(gain, [1.0, 0.9, 0.8], mine)
            without[key("Forks-z0", TASK, (lr, wd), s)] = _end(gain, [1.0, 0.9, 0.8], theirs)
    at2 = swept_counts(default, without, grid, [TASK], 2.0)
    assert at2 == {"best": 1, "best_n": 1, "largest": 1.0, "better": 0, "bad_n": 2, "near": 0}
    at1 = swept_counts(default, without, grid, [TASK], 1.0)  # 1.41 with two: both challengers clear it
    assert at1 == {"best": 0, "best_n": 1, "largest": 1.2, "better": 1, "bad_n": 2, "near": 1}


def test_the_tables_rows_agree_with_the_reported_counts():
    grid = suite._load(suite.GRID)
    stores = {m: suite._load(suite.STORED / f"{m}.json") for m in ("Forks", "Forks-z0", "Optuna",
                                                                   "finished-each")}
    text = "\n".join(tables(grid, stores))
    third = suite.counts("Forks", stores["Forks"], grid, "third")
    n = third["bad_n"]
    assert f"| third | Forks | {third['better']} of {n} | {third['near']} of {n} |" in text
    read = [n for n in suite.TASKS if suite.in_group(n, "design") or suite.in_group(n, "first")]
    best = sum(suite.counts("Forks", stores["Forks"], grid, g)["best"] for g in ("design", "first"))
    assert f"| 2 (the default) | every challenger | {best} of {len(read)} |" in text


def test_short_leads_counts_the_runs_kept_with_a_leading_challenger():
    grid = _grid({(2, 3.0): 0.5, (2, 0.3): 0.52, (2, 0.03): 0.8})
    lr = suite.lrs_of(suite.TASKS[TASK], grid)[2]
    store = {}
    runs = {(0.03, 0): (1.0, 0.03, 1.5),   # kept, a challenger led by 1.5
            (0.03, 1): (1.0, 0.3, 3.0),    # moved to 0.3: not kept
            (0.0, 0): (1.0, 0.0, None),    # kept, your run led
            (0.0, 1): (1.0, 0.0, 0.5),     # kept, led by 0.5
            (3.0, 0): (1.0, 3.0, 1.0)}     # the best cell: not a bad start
    for (wd, s), (factor, end, gain) in runs.items():
        store[key("M", TASK, (lr, wd), s)] = {"lr_factor": factor, "values": {"weight_decay": end},
                                               "end": {"gain": gain}}
    assert short_leads(store, "M", grid, [TASK]) == {"runs": 4, "kept": 3, "short": 2, "median": 1.0}


def test_the_readmes_figures_of_what_holds_the_row_are_the_stores():
    """The README's sentence on the probe's limit is ``short_leads`` of the committed finished-each runs."""
    grid = suite._load(suite.GRID)
    store = suite._load(suite.STORED / "finished-each.json")
    read = [n for n in suite.TASKS if suite.in_group(n, "design") or suite.in_group(n, "first")]
    r = short_leads(store, "finished-each", grid, read)
    text = " ".join((suite.ROOT / "README.md").read_text().split())
    assert f"{r['kept']} of {r['runs']} runs from a bad knob value still kept it" in text
    assert f"in {r['short']} of those a fork one spread away led on the probe by a median of " \
           f"{r['median']:.1f} standard errors" in text
