"""Co-exploration: the learning rate and a second knob explored in one run, against a 2-D grid.

    python -m benchmarks.lr.coexplore [--jobs 2]   # grids, then both routes; prints the tables
    python -m benchmarks.lr.coexplore --route forks  # one route only

For each pair (a suite task, a second knob that matters there), plain training is run on a 2-D
grid (the task's peak lr at 0.1x .. 10x its 1-D grid's best, half-decade steps, times four
values of the knob, 2 seeds). Two routes are then run. ``engine``: ``hpx.Engine`` with a
``LearningRateScale`` on the task's own schedule and the second knob, 4 replicas in one process,
``sync_every=25``, a ``ProbeStream`` on the task's probe and the engine's default strategy (HDET).
``forks``: ``hpx.Forks`` with its defaults and the second knob forked (``hpx.Dropout(spread=0.2)``,
``hpx.WeightDecay(group=0, span=10)``: a fifth of the rate and a decade, fixed before any run).
Each starts from two cells:

* the 2-D grid's best (bar: within 5% of its loss);
* the best lr with the knob value whose plain run is worst, if it is at least 5% worse than the
  2-D best (bar: better than plain training there).

Results go to ``benchmarks/lr/stored/coexplore.json`` (committed). The command writes the table
of each route it ran (``--route``: both by default) into the ``coexplore`` section of
docs/benchmarks.md from that store, in place of that route's, the other's left as it is
(:func:`write_tables`; ``tests/test_stored_sections.py`` rebuilds them from the committed store);
the section's prose around them is written by hand. The first three pairs are
design tasks; two (moons_dropout, char_gru_adamw) were held-out tasks when the routes ran, added
after the design ones were read, with their values fixed before either route ran on them
(moons_dropout is a design task of the suite since: the table says "then"). The last two, whose
probes are large (char_transformer_adam, held out, and clusters_long), were added the same way
after the first five had been read.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from typing import Any

import torch

import hpx
from benchmarks.lr.__main__ import DOC, GRIDS, SEEDS, STORED, _load, _save, best_of_grid
from benchmarks.lr.run import plain_train
from benchmarks.lr.tasks import HELD_OUT, Task, get_task
from hpx.schedule._shadow import read_schedule

# task -> (knob, the values of its 2-D grid). moons_dropout and char_gru_adamw were held-out tasks,
# added with their values before either route ran on them (the forks route's spreads were fixed
# before as well).
PAIRS: dict[str, tuple[str, tuple[float, ...]]] = {
    "cancer_dropout": ("dropout", (0.0, 0.2, 0.5, 0.7)),
    "digits_mlp": ("weight_decay", (5e-5, 5e-4, 5e-3, 5e-2)),
    "char_transformer": ("weight_decay", (0.01, 0.1, 0.3, 1.0)),
    "moons_dropout": ("dropout", (0.0, 0.3, 0.5, 0.7)),
    "char_gru_adamw": ("weight_decay", (0.001, 0.01, 0.1, 1.0)),
    # two pairs whose probe is large (4,096 tokens; 400 examples), added with their values after the
    # five above had been read and before either route ran on them: where the two small-data dropout
    # pairs missed, was the probe's size the limit? (char_transformer_adam is a held-out suite task)
    "char_transformer_adam": ("dropout", (0.0, 0.1, 0.3, 0.5)),
    "clusters_long": ("weight_decay", (0.001, 0.01, 0.1, 1.0)),
}
_HELD_OUT_THEN = {"moons_dropout"}  # held out when the routes ran on it, a design task of the suite since
LR_FACTORS = (0.1, 10 ** -0.5, 1.0, 10 ** 0.5, 10.0)
PATH = STORED / "coexplore.json"


def _set_knob(model: torch.nn.Module, opt: torch.optim.Optimizer, knob: str, value: float) -> None:
    """The second knob at ``value``: every dropout module's rate, or the decayed group's weight decay."""
    if knob == "dropout":
        for m in model.modules():
            if isinstance(m, torch.nn.Dropout):
                m.p = value
    else:
        opt.param_groups[0]["weight_decay"] = value  # group 0 holds the weights that decay


def _knob(name: str) -> hpx.Knob:
    if name == "dropout":
        return hpx.Dropout("dropout", spread=0.1)
    return hpx.WeightDecay("weight_decay", group=0, span=2.0)


def _fork_knob(name: str) -> hpx.Knob:
    """The second knob as hpx.Forks forks it: a dropout rate 0.2 to each side, a weight decay a
    decade to each side."""
    if name == "dropout":
        return hpx.Dropout("dropout", spread=0.2)
    return hpx.WeightDecay("weight_decay", group=0, span=10.0)


def run(args: tuple[str, str, float, float, int]) -> tuple[str, dict[str, Any]]:
    """One run: ``(method, task, lr, knob value, seed)`` -> (key, {"val", "lr", "knob"})."""
    method, name, lr, value, seed = args
    torch.set_num_threads(1)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(20_000 + seed)  # dropout's draws: the same whichever runs the process did before
        return _run(method, name, lr, value, seed)


def _run(method: str, name: str, lr: float, value: float, seed: int) -> tuple[str, dict[str, Any]]:
    task = get_task(name)
    knob = PAIRS[name][0]
    model = task.model(seed)
    opt = task.optimizer(model, lr)
    sched = task.scheduler(opt)
    _set_knob(model, opt, knob, value)
    gen = torch.Generator().manual_seed(10_000 + seed)
    batches = [task.sample(gen) for _ in range(task.steps)]
    out: dict[str, Any] = {"lr": lr, "knob": value}
    if method == "plain":
        final: torch.nn.Module | None = plain_train(task, model, opt, sched, batches)
    elif method == "forks":
        final, out = _forks_route(task, model, opt, sched, batches, knob, lr)
    else:
        final, out = _general_route(task, model, opt, sched, batches, knob, value, lr, seed)
    val = task.evaluate(final) if final is not None else math.nan
    out["val"] = val if math.isfinite(val) else None
    return f"{method}|{name}|{lr:.6g}|{value:g}|{seed}", out


def _general_route(task: Task, model: torch.nn.Module, opt: torch.optim.Optimizer, sched: Any,
                   batches: list[Any], knob: str, value: float, lr: float,
                   seed: int) -> tuple[torch.nn.Module | None, dict[str, Any]]:
    shape, lrs, followed = read_schedule(sched, task.steps)
    knobs = [hpx.LearningRateScale("lr", span=2.0, schedule=shape, lrs=lrs), *followed, _knob(knob)]

    def make(m: torch.nn.Module) -> torch.optim.Optimizer:
        o = task.optimizer(m, lr)
        _set_knob(m, o, knob, value)
        return o

    engine = hpx.Engine(model, make, knobs, replicas=4, sync_every=25, seed=seed,
                        signal=hpx.ProbeStream(task.probe(), loss_fn=lambda rep, b: task.loss(rep.model, b)))
    try:
        for b in batches:
            engine.step(lambda rep, bb: task.loss(rep.model, bb), b)
        final: torch.nn.Module | None = engine.converge()
    except hpx.NonFiniteError:
        final = None
    return final, {"lr": lr * engine.bases["lr"], "knob": engine.bases[knob]}


def _forks_route(task: Task, model: torch.nn.Module, opt: torch.optim.Optimizer, sched: Any,
                 batches: list[Any], knob: str, lr: float) -> tuple[torch.nn.Module | None, dict[str, Any]]:
    forks = hpx.Forks(model, opt, total_steps=task.steps, schedule=sched, probe=task.probe(),
                      loss_fn=lambda rep, b: task.loss(rep.model, b), knobs=[_fork_knob(knob)],
                      knob_start=0.0, knob_design="each")  # the defaults when its store was made
    try:
        for b in batches:
            forks.step(lambda rep, bb: task.loss(rep.model, bb), b)
        final: torch.nn.Module | None = forks.converge()
    except hpx.NonFiniteError:
        final = None
    return final, {"lr": lr * forks.bases["lr"], "knob": forks.bases[_fork_knob(knob).name]}


def _cells(name: str, grids: dict[str, Any]) -> list[tuple[float, float]]:
    i, lrs, _ = best_of_grid(name, grids)
    return [(lrs[i] * f, v) for f in LR_FACTORS for v in PAIRS[name][1]]


def _mean(store: dict[str, Any], method: str, name: str, lr: float, v: float) -> float:
    vals = [store[f"{method}|{name}|{lr:.6g}|{v:g}|{s}"]["val"] for s in SEEDS]
    return math.nan if any(x is None for x in vals) else statistics.fmean(vals)


def table(store: dict[str, Any], grids: dict[str, Any], method: str = "hpx") -> list[str]:
    """The route's rows (``method``: ``"hpx"``, the engine's, or ``"forks"``)."""
    out = ["| task | held out | knob | start (lr, knob) | plain | hpx | hpx / plain | hpx / 2-D best "
           "| ends at (lr, knob) |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, (knob, _) in PAIRS.items():
        cells = _cells(name, grids)
        plain = {c: _mean(store, "plain", name, *c) for c in cells}
        best = min((p, c) for c, p in plain.items() if not math.isnan(p))
        for start in _starts(name, plain, best):
            hpx_val = _mean(store, method, name, *start)
            ends = [store[f"{method}|{name}|{start[0]:.6g}|{start[1]:g}|{s}"] for s in SEEDS]
            end_lr = math.exp(statistics.fmean(math.log(e["lr"]) for e in ends))
            end_k = statistics.fmean(e["knob"] for e in ends)
            held = "yes" if name in HELD_OUT else "then" if name in _HELD_OUT_THEN else ""
            out.append(f"| {name} | {held} | {knob} | {start[0]:.3g}, {start[1]:g} | {plain[start]:.4f} | "
                       f"{hpx_val:.4f} | {hpx_val / plain[start]:.3f} | {hpx_val / best[0]:.3f} | "
                       f"{end_lr:.3g}, {end_k:.3g} |")
    return out


def _starts(name: str, plain: dict[tuple[float, float], float],
            best: tuple[float, tuple[float, float]]) -> list[tuple[float, float]]:
    """The 2-D best cell, and the best lr with the knob value whose plain run is worst (if it is
    at least 5% worse than the best)."""
    lr_best = best[1][0]
    row = [(p, c) for c, p in plain.items() if c[0] == lr_best and not math.isnan(p)]
    worst = max(row)
    return [best[1]] + ([worst[1]] if worst[0] >= 1.05 * best[0] else [])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.lr.coexplore", description=__doc__.split("\n")[0])
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--route", nargs="+", choices=("engine", "forks"), default=["forks", "engine"])
    a = p.parse_args(argv)
    methods = [{"engine": "hpx", "forks": "forks"}[r] for r in a.route]
    grids = _load(GRIDS)
    store = _load(PATH)
    todo = [("plain", n, lr, v, s) for n in PAIRS for lr, v in _cells(n, grids) for s in SEEDS]
    _execute(todo, store, a.jobs)
    starts = []
    for n in PAIRS:
        plain = {c: _mean(store, "plain", n, *c) for c in _cells(n, grids)}
        best = min((v, c) for c, v in plain.items() if not math.isnan(v))
        starts += [(m, n, lr, v, s) for m in methods for lr, v in _starts(n, plain, best) for s in SEEDS]
    _execute(starts, store, a.jobs)
    for route, m in zip(a.route, methods):
        print(f"\n{route}:\n" + "\n".join(table(store, grids, m)))
    write_tables(store, grids, a.route)  # the routes run now: each one's table, the other's left as it is
    return 0


ROUTES = {"forks": "forks", "engine": "hpx"}  # the section's heading of a route -> its runs' method


def tables_in(section: str) -> dict[str, str]:
    """The table under each route's heading (``### forks``, ``### engine``) of the section's text."""
    out = {}
    for route in ROUTES:
        head = f"\n### {route}\n\n"
        start = section.index(head) + len(head)
        end = section.index("\n\n", start)
        out[route] = section[start:end]
    return out


def write_tables(store: dict[str, Any], grids: dict[str, Any], routes: Sequence[str] = tuple(ROUTES)) -> None:
    """Each of ``routes``' table into the ``coexplore`` section of docs/benchmarks.md, in place of the
    one there (the other route's table and the prose around them are left as they are)."""
    text = DOC.read_text()
    start, end = text.index("<!-- coexplore -->"), text.index("<!-- /coexplore -->")
    section = text[start:end]
    for route, old in tables_in(section).items():
        if route not in routes:
            continue
        new = "\n".join(table(store, grids, ROUTES[route]))
        section = section.replace(f"\n### {route}\n\n{old}\n\n", f"\n### {route}\n\n{new}\n\n")
    DOC.write_text(text[:start] + section + text[end:])


def _execute(runs: list[tuple[str, str, float, float, int]], store: dict[str, Any], jobs: int) -> None:
    todo = [r for r in runs if f"{r[0]}|{r[1]}|{r[2]:.6g}|{r[3]:g}|{r[4]}" not in store]
    if not todo:
        return
    print(f"{len(todo)} runs on {jobs} processes", file=sys.stderr)
    with ProcessPoolExecutor(jobs) as pool:
        for i, f in enumerate(as_completed([pool.submit(run, r) for r in todo]), 1):
            key, res = f.result()
            store[key] = res
            if i % 20 == 0:
                _save(PATH, store)
    _save(PATH, store)


if __name__ == "__main__":
    raise SystemExit(main())
