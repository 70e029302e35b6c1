"""Where along the run's displacement is the held-out loss lowest? The measurement behind Stretch.

    python -m benchmarks.stretch_probe          # needs the acceptance grid (python -m benchmarks.acceptance)

Plain runs of each task at fixed learning rates (0.1x, 0.3x, 1x, 3x and 10x the acceptance grid's
best, seed 0, the task's schedule). At 20 evenly spaced points of each run, the probe loss is
measured at ``a + rho (theta - a)`` (``a``: the starting parameters, ``theta``: the current ones)
for five ``rho`` from 0.8 to 1.25, in eval mode, and a parabola in ``log rho`` gives the best
``rho``, as :class:`hpx.search.Stretch` fits it. The table gives the mean best ``rho`` over the
points between 15% and 40% of the run (where Stretch acts, after its burn-in) and over the last
quarter, and the run's final validation loss relative to the grid's best.
"""

from __future__ import annotations

import argparse
import math
import multiprocessing as mp
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks import report
from benchmarks.__main__ import load_results
from benchmarks.acceptance import config
from benchmarks.suite import oracle
from benchmarks.tasks import get_task

ROOT = Path(__file__).resolve().parent.parent
TASKS = ("mlp", "charlm", "cnn", "gru", "tabular")
MULTS = (0.1, 0.3, 1.0, 3.0, 10.0)
RHOS = (0.8, 0.9, 1.0, 1.1, 1.25)
POINTS = 20


def best_rho(losses: list[float]) -> float:
    """The minimum over ``[0.8, 1.25]`` of a parabola fitted to ``losses`` against ``log rho``."""
    z = torch.tensor(RHOS, dtype=torch.float64).log()
    y = torch.tensor(losses, dtype=torch.float64)
    if not torch.isfinite(y).all():
        return math.nan
    a = torch.stack([torch.ones_like(z), z, z * z], 1)
    c = torch.linalg.lstsq(a, y[:, None]).solution.reshape(-1)
    grid = torch.linspace(float(z.min()), float(z.max()), 201, dtype=torch.float64)
    return math.exp(float(grid[int((c[0] + c[1] * grid + c[2] * grid * grid).argmin())]))


def one(job: tuple[str, float, int]) -> dict[str, Any]:
    name, lr, seed = job
    torch.set_num_threads(1)
    task = get_task(name)
    model = task.model(seed)
    opt = task.optimizer(model)
    values = task.set_fixed(model, opt)
    f = task.schedule()
    gen = torch.Generator().manual_seed(10_000 + seed)
    params = list(model.parameters())
    start = [p.detach().clone() for p in params]
    probe = task.probe_batches()[:4]
    marks = {round(task.steps * k / POINTS) for k in range(1, POINTS + 1)}
    points = []
    for t in range(task.steps):
        for g in opt.param_groups:
            g["lr"] = lr * f(t)
        opt.zero_grad(set_to_none=True)
        loss = task.loss(model, task.sample(gen, task.batch), values)
        if not torch.isfinite(loss):
            break
        loss.backward()
        opt.step()
        if t + 1 in marks:
            now = [p.detach().clone() for p in params]
            model.eval()
            losses = []
            with torch.no_grad():
                for rho in RHOS:
                    for p, a, c in zip(params, start, now):
                        p.copy_(a + rho * (c - a))
                    losses.append(sum(float(task.probe_loss(model, b)) for b in probe) / len(probe))
                for p, c in zip(params, now):
                    p.copy_(c)
            model.train()
            points.append(((t + 1) / task.steps, best_rho(losses)))
    final = task.evaluate(model)["loss"] if len(points) == POINTS else math.nan
    return {"task": name, "lr": lr, "points": points, "final": final}


def _mean(points: list[tuple[float, float]], lo: float, hi: float) -> float:
    vals = [r for f, r in points if lo <= f <= hi and math.isfinite(r)]
    return statistics.fmean(vals) if vals else math.nan


def section(rows: list[dict], oracles: dict[str, dict], command: str, wall: float) -> str:
    lines = [
        "## The run's displacement, shrunk and stretched: the measurement behind `Stretch`",
        "",
        f"Produced by `{command}` ({wall / 60:.1f} min) on {report.machine()}.",
        "",
        "Plain runs (seed 0, the task's schedule) at fixed multiples of the acceptance grid's best lr.",
        "At 20 points of each run the probe loss is measured at the starting parameters plus `rho`",
        "times the displacement since, for `rho` from 0.8 to 1.25, and a parabola in `log rho` gives",
        "the best `rho`. Above 1: the run is behind (a longer path would do better); below 1: a shorter",
        "path would. \"15-40%\" averages the points where `Stretch` acts after its burn-in; \"last",
        "quarter\" those after 75% of the run. Final: the run's validation loss over the grid's best",
        "(\"failed\": diverged or collapsed). The CNN trains here in one process with the whole batch",
        "(the acceptance grid trains it as 4 replicas of 16).",
        "",
        "| task | lr (x grid's best) | best rho, 15-40% | best rho, last quarter | final / grid's best |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        o = oracles[r["task"]]
        fin = r["final"] / o["loss"]
        failed = not math.isfinite(fin) or r["final"] >= 0.98 * get_task(r["task"]).chance_loss()
        lines.append(f"| {r['task']} | {r['lr'] / o['lr']:g} | {_mean(r['points'], 0.15, 0.4):.2f} | "
                     f"{_mean(r['points'], 0.75, 1.0):.2f} | "
                     f"{'failed' if failed else f'{fin:.3f}'} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.stretch_probe",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--tasks", default=",".join(TASKS))
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--out", default=str(ROOT / "docs"))
    args = ap.parse_args(argv)
    tasks = tuple(args.tasks.split(","))
    cfg = config(False, tasks, args.jobs)
    results = load_results(ROOT / "runs" / "benchmarks" / "acceptance.json")
    results.pop("__meta__", None)
    try:
        oracles = {t: oracle(cfg, results, t) for t in tasks}
    except (KeyError, ValueError):
        print("no acceptance grid found: run python -m benchmarks.acceptance first", file=sys.stderr)
        return 1
    t0 = time.perf_counter()
    jobs = [(t, oracles[t]["lr"] * m, 0) for t in tasks for m in MULTS]
    with mp.get_context("spawn").Pool(args.jobs) as pool:
        rows = pool.map(one, jobs, chunksize=1)
    doc = Path(args.out) / "benchmarks.md"
    report.write_section(doc, "stretch_probe", section(rows, oracles, "python -m benchmarks.stretch_probe",
                                                      time.perf_counter() - t0))
    print(f"wrote {doc}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
