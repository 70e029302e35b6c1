"""The searches' cost on the learning-rate suite: hpx.Forks' and autolr's training loops against
plain training's, side by side in one process.

    python -m benchmarks.lr.cost [--tasks ...] [--repeats 2]   # prints the table; writes docs
    python -m benchmarks.lr.cost --method halving-end ...    # suite methods or prototypes instead

With the default methods it keeps each task's seconds in ``benchmarks/lr/stored/cost.json``
(committed; a task measured again replaces its row), where ``python -m benchmarks.lr.bar`` reads
them, and once that store holds every task of the suite it writes the section of docs/benchmarks.md from it.
The section's rows share its "Produced by" line (``--repeats``, the machine): some tasks are measured
again only with the same, on that machine (else refused before anything runs), and ``--tasks`` naming
none rewrites the section from the store under that line.

For every task, plain training and each method (exactly as the suite runs them, at the grid's
best lr, seed 0) train on the same batches, taking turns, ``repeats`` times each, on one thread;
the ratio is of the fastest run of each. hpx.Forks also leaves its optimizer steps over plain
training's (``fork_steps / step_count``) in the store: the bar's cost row (``python -m
benchmarks.lr.bar``) reads those against at most 2.0x at the defaults; the seconds are beside it.
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from benchmarks import _store
from benchmarks.lr.__main__ import GRIDS, STORED, _load, _save, best_of_grid
from benchmarks.lr.prototypes import LOOPS
from benchmarks.lr.run import METHODS, plain_train
from benchmarks.lr.tasks import HELD_OUT, TASKS, get_task

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "benchmarks.md"
COST = STORED / "cost.json"  # the whole suite's seconds per task (and Forks' steps), for benchmarks.lr.bar
SECTION_METHODS = ["Forks", "autolr"]  # the methods whose cost the section shows


_STEPS: dict[tuple[str, str], float] = {}  # (task, method) -> optimizer steps over plain training's


def _seconds(name: str, lr: float, method: str) -> float:
    """The training loop's wall time; a method that counts its optimizer steps (hpx.Forks'
    ``fork_steps``) leaves their multiple of plain training's in ``_STEPS``."""
    task = get_task(name)
    model = task.model(0)
    opt = task.optimizer(model, lr)
    sched = task.scheduler(opt)
    gen = torch.Generator().manual_seed(10_000)
    batches = [task.sample(gen) for _ in range(task.steps)]
    t0 = time.perf_counter()
    if method == "plain":
        plain_train(task, model, opt, sched, batches)
    elif method in LOOPS:
        LOOPS[method](task, model, opt, sched, batches)
    else:
        engine = METHODS[method](task, model, opt, sched, task.steps, 0)
        for b in batches:
            engine.step(lambda rep, bb: task.loss(rep.model, bb), b)
        engine.converge()
        if hasattr(engine, "fork_steps"):
            _STEPS[(name, method)] = engine.fork_steps / task.steps
    return time.perf_counter() - t0


def measure(names: list[str], repeats: int, methods: Sequence[str] = ("autolr",)
            ) -> list[tuple[str, float, list[float]]]:
    """``(task, plain seconds, each method's seconds)``: the fastest of ``repeats`` runs of each,
    plain training and the methods taking turns."""
    torch.set_num_threads(1)
    _STEPS.clear()  # only this measurement's steps
    grids = _load(GRIDS)
    out = []
    for name in names:
        i, lrs, _ = best_of_grid(name, grids)
        times: dict[str, list[float]] = {m: [] for m in ("plain", *methods)}
        for _ in range(repeats):
            for m in times:
                times[m].append(_seconds(name, lrs[i], m))
        out.append((name, min(times["plain"]), [min(times[m]) for m in methods]))
    return out


def _shown(method: str) -> str:
    return {"autolr": "hpx.autolr", "Forks": "hpx.Forks"}.get(method, method)


def markdown(rows: list[tuple[str, float, list[float]]], repeats: int,
             methods: Sequence[str] = ("autolr",),
             steps: dict[tuple[str, str], float] | None = None, on: str | None = None) -> str:
    """The section's markdown; ``steps``: each (task, method)'s optimizer steps over plain
    training's (default: those of the last measurement); ``on``: the machine it was measured on
    (default: this one)."""
    steps = _STEPS if steps is None else steps
    names = ", ".join(f"`{_shown(m)}`" for m in methods)
    lines = ["<!-- lr-cost -->", "## The search's cost on the learning-rate suite", "",
             f"Produced by `python -m benchmarks.lr.cost --repeats {repeats} --method {' '.join(methods)}` "
             f"on {on or machine()}, one thread.",
             f"Plain training and {names}, at the grid's best lr and on the same batches, run "
             + ("once each, one after the other," if repeats == 1
                else f"{repeats} times each, taking turns,"),
             "per task in one process; the ratio is of the fastest run of each.",
             "The bar (`python -m benchmarks.lr.bar`) is on optimizer steps: at most 2.0x plain "
             "training's at the defaults; the seconds are beside it.", "",
             "| task | held out | steps | plain (s) | "
             + " | ".join(f"{m} (s) | {m} / plain" for m in methods) + " |",
             "| --- | --- | --- | --- | " + " | ".join("--- | ---" for _ in methods) + " |"]
    for name, p, hs in rows:
        lines.append(f"| {name} | {'yes' if name in HELD_OUT else ''} | {TASKS[name].steps} | {p:.2f} | "
                     + " | ".join(f"{h:.2f} | {h / p:.2f}" for h in hs) + " |")
    lines.append("")
    for j, m in enumerate(methods):
        ratios = sorted(hs[j] / p for _, p, hs in rows)
        lines.append(f"`{_shown(m)}`: median ratio {ratios[len(ratios) // 2]:.2f}, range "
                     f"{ratios[0]:.2f}-{ratios[-1]:.2f}.")
        taken = sorted(steps[(name, m)] for name, _, _ in rows if (name, m) in steps)
        if len(taken) == len(rows):  # its optimizer steps, and the wall time beyond them
            beyond = sorted(hs[j] / p / steps[(name, m)] for name, p, hs in rows)
            lines.append(f"Its forks and copies take {taken[0]:.2f}-{taken[-1]:.2f}x plain training's "
                         f"optimizer steps; its wall time over that multiple of plain's is "
                         f"{beyond[0]:.2f}-{beyond[-1]:.2f} (median {beyond[len(beyond) // 2]:.2f}): the "
                         "probe passes, copies and the end's test on top of the steps.")
    lines.append("<!-- /lr-cost -->")
    return "\n".join(lines)


def machine() -> str:
    """This machine, as the section names the one it was measured on."""
    return (f"{platform.machine()}, {os.cpu_count()} logical cores; Python {platform.python_version()}, "
            f"torch {torch.__version__}")


def recorded(text: str) -> tuple[int, str] | None:
    """The ``--repeats`` and the machine docs/benchmarks.md's section (``text``: the whole page)
    names its rows as measured with (None: no section)."""
    m = re.search(r"<!-- lr-cost -->.*?`python -m benchmarks\.lr\.cost --repeats (\d+) --method [^`]+` "
                  r"on (.+?), one thread\.", text, re.S)
    return (int(m.group(1)), m.group(2)) if m else None


def section(store: dict[str, Any], repeats: int, methods: Sequence[str] = ("Forks", "autolr"),
            on: str | None = None) -> str:
    """The docs section (markers included) from the stored rows of every task of the suite."""
    stored_steps = {(name, m): store[name][f"{m} steps"] for name in TASKS for m in methods
                    if f"{m} steps" in store[name]}
    return markdown([(name, store[name]["plain"], [store[name][m] for m in methods]) for name in TASKS],
                    repeats, methods, stored_steps, on)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.lr.cost", description=__doc__.split("\n")[0])
    p.add_argument("--tasks", nargs="*", default=list(TASKS))
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--method", nargs="+", default=["Forks", "autolr"], choices=sorted([*METHODS, *LOOPS]))
    p.add_argument("--flush-denormal", action="store_true",
                   help="torch.set_flush_denormal(True) first: subnormal floats count as 0 (a fork at an lr "
                        "that drives an LSTM's gradients toward 0 then runs at the speed of the others)")
    a = p.parse_args(argv)
    write = a.method == SECTION_METHODS and not a.flush_denormal
    # the section's rows share one line: the --repeats and the machine they were measured with. Rows
    # measured now with others would sit under it: refused before anything runs. The store alone
    # (`--tasks` naming none) is written under that line as it is.
    shared = recorded(DOC.read_text()) if write and set(a.tasks) != set(TASKS) and DOC.exists() else None
    if shared is not None and a.tasks and shared != (a.repeats, machine()):
        _store.refuse_narrower(
            "lr-cost", f"every other task's row, measured with --repeats {shared[0]} on {shared[1]}",
            f"python -m benchmarks.lr.cost --repeats {a.repeats} --method {' '.join(SECTION_METHODS)}", DOC,
            f"or these tasks with --repeats {shared[0]} on that machine")
    if a.flush_denormal:
        torch.set_flush_denormal(True)
    try:
        rows = measure(a.tasks, a.repeats, a.method)
    finally:
        if a.flush_denormal:
            torch.set_flush_denormal(False)  # torch's default
    if rows:  # `--tasks` with none: the section rewritten from the store alone, nothing measured
        print(markdown(rows, a.repeats, a.method))
    # the section is hpx's two searches', measured as the user's default numerics run them; tasks
    # measured now replace their stored rows (each row is side by side in itself), and the section
    # is written once the store holds every task
    if write:
        store = {k: v for k, v in _load(COST).items() if k in TASKS}
        store.update({name: {"plain": p, **{m: h for m, h in zip(a.method, hs)},
                             **{f"{m} steps": _STEPS[(name, m)] for m in a.method if (name, m) in _STEPS}}
                      for name, p, hs in rows})
        _save(COST, store)
        missing = [t for t in TASKS if t not in store]
        if missing:
            print(f"docs/benchmarks.md not written: no cost measured yet for {', '.join(missing)}")
            return 0
        repeats, on = shared if shared is not None else (a.repeats, None)  # None: this machine
        md = section(store, repeats, a.method, on)
        text = DOC.read_text()
        start, end = "<!-- lr-cost -->", "<!-- /lr-cost -->"
        if start in text:
            text = text[:text.index(start)] + md + text[text.index(end) + len(end):]
        else:
            anchor = "<!-- coexplore -->"
            text = text.replace(anchor, md + "\n\n" + anchor, 1)
        DOC.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
