"""The search's cost on the learning-rate suite: autolr's training loop against plain training's,
side by side in one process.

    python -m benchmarks.lr.cost [--tasks ...] [--repeats 2]   # prints the table; writes docs
    python -m benchmarks.lr.cost --method halving-end ...    # a suite method or prototype instead

For every task, plain training and ``hpx.autolr`` (exactly as the suite runs them, at the grid's
best lr, seed 0) train on the same batches, alternating, ``repeats`` times each, on one thread;
the ratio is of the fastest run of each. The issue's bar is an overhead of at most 10% (a ratio
of 1.10).
"""

from __future__ import annotations

import argparse
import os
import platform
import time
from pathlib import Path

import torch

from benchmarks.lr.__main__ import GRIDS, _load, best_of_grid
from benchmarks.lr.prototypes import LOOPS
from benchmarks.lr.run import METHODS, plain_train
from benchmarks.lr.tasks import HELD_OUT, TASKS, get_task

ROOT = Path(__file__).resolve().parents[2]


def _seconds(name: str, lr: float, method: str) -> float:
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
    return time.perf_counter() - t0


def measure(names: list[str], repeats: int, method: str = "autolr") -> list[tuple[str, float, float]]:
    """``(task, plain seconds, method seconds)``: the fastest of ``repeats`` alternating runs."""
    torch.set_num_threads(1)
    grids = _load(GRIDS)
    out = []
    for name in names:
        i, lrs, _ = best_of_grid(name, grids)
        plain, hpx_s = [], []
        for _ in range(repeats):
            plain.append(_seconds(name, lrs[i], "plain"))
            hpx_s.append(_seconds(name, lrs[i], method))
        out.append((name, min(plain), min(hpx_s)))
    return out


def markdown(rows: list[tuple[str, float, float]], repeats: int, method: str = "autolr") -> str:
    machine = (f"{platform.machine()}, {os.cpu_count()} logical cores; Python {platform.python_version()}, "
               f"torch {torch.__version__}")
    lines = ["<!-- lr-cost -->", "## The search's cost on the learning-rate suite", "",
             f"Produced by `python -m benchmarks.lr.cost --repeats {repeats}"
             + ("" if method == "autolr" else f" --method {method}") + f"` on {machine}, one thread.",
             f"Plain training and `{'hpx.autolr' if method == 'autolr' else method}`, at the grid's best lr "
             "and on the same batches, run "
             + ("once each, one after the other," if repeats == 1 else f"{repeats} times each, alternating,"),
             "per task in one process; the ratio is of the fastest run of each.",
             "The bar is a ratio of 1.10.", "",
             f"| task | held out | steps | plain (s) | {method} (s) | {method} / plain |",
             "| --- | --- | --- | --- | --- | --- |"]
    for name, p, h in rows:
        lines.append(f"| {name} | {'yes' if name in HELD_OUT else ''} | {TASKS[name].steps} | {p:.2f} | "
                     f"{h:.2f} | {h / p:.2f} |")
    ratios = sorted(h / p for _, p, h in rows)
    lines += ["", f"Median ratio {ratios[len(ratios) // 2]:.2f}, range {ratios[0]:.2f}-{ratios[-1]:.2f}.",
              "<!-- /lr-cost -->"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.lr.cost", description=__doc__.split("\n")[0])
    p.add_argument("--tasks", nargs="*", default=list(TASKS))
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--method", default="autolr", choices=sorted([*METHODS, *LOOPS]))
    a = p.parse_args(argv)
    md = markdown(measure(a.tasks, a.repeats, a.method), a.repeats, a.method)
    print(md)
    if a.tasks == list(TASKS) and a.method == "autolr":  # the section is autolr's
        doc = ROOT / "docs" / "benchmarks.md"
        text = doc.read_text()
        start, end = "<!-- lr-cost -->", "<!-- /lr-cost -->"
        if start in text:
            text = text[:text.index(start)] + md + text[text.index(end) + len(end):]
        else:
            anchor = "<!-- coexplore -->"
            text = text.replace(anchor, md + "\n\n" + anchor, 1)
        doc.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
