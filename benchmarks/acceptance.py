"""Acceptance benchmark of the one-run search (``hpx.autolr``) against plain training and a grid.

    python -m benchmarks.acceptance            # the real thing; writes its section of docs/benchmarks.md
    python -m benchmarks.acceptance --quick    # CI smoke test: tiny runs, checks the plumbing only
    python -m benchmarks.acceptance --report-only

On each task: a 9-point grid of plain runs (2 seeds) picks the oracle lr (best mean validation
loss). Then, started at the oracle's lr, 10x below and 10x above it, two seeds each: plain
training at that lr, and one ``hpx.autolr`` run (one model in one process, the task's schedule,
its probe split, no per-task settings). The criteria:

1. do no harm: hpx's mean final validation loss <= 1.02x plain's at the same start in at least
   8 of the 9 cells of the three suite tasks, <= 1.05x in all (cells where plain diverges or
   collapses are not counted against hpx);
2. recover: in the off-start cells, <= 1.05x the oracle's loss in at least 4 of 6 and <= 1.02x in
   at least 2; the final lr within 2x of the oracle's in at least 4;
3. at the oracle's lr: <= 1.02x the oracle's loss on every task;
4. no run lost: no divergence or collapse where plain training at a tenth of the start trains.

Raw results go to runs/benchmarks/acceptance[-quick].json; a rerun resumes from it
(``--rerun-hpx`` keeps the plain runs and reruns hpx's, after a change to the search).
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks import report
from benchmarks.__main__ import load_results, save_results
from benchmarks.runs import RunSpec
from benchmarks.suite import STARTS, SuiteConfig, _key, default_jobs, execute, failed, oracle, plan_grid
from benchmarks.tasks import get_task

ROOT = Path(__file__).resolve().parent.parent
TASKS = ("mlp", "charlm", "cnn", "gru", "tabular")
SUITE_TASKS = ("mlp", "charlm", "cnn")  # criteria 1-3 count these 9 cells; the others are reported alike
VARIANT = "autolr"
QUICK_OVERRIDES = {"mlp": {"steps": 60, "evals": 2, "sync_every": 10},
                   "charlm": {"steps": 20, "evals": 1, "sync_every": 5, "batch": 8},
                   "cnn": {"steps": 30, "evals": 1, "sync_every": 6, "batch": 32},
                   "gru": {"steps": 30, "evals": 1, "sync_every": 10, "batch": 8},
                   "tabular": {"steps": 40, "evals": 1, "sync_every": 10}}


# Plain training of the BatchNorm CNN runs in hpx's layout (4 replicas of 16 examples), as plain
# DDP on 4 devices would: its batch statistics depend on the per-replica batch, and one process
# with the whole batch of 64 trains a different model (measured: hpx with no spread at all ends
# 28% above it at the oracle's lr). The other tasks' forward does not read the batch.
LAYOUT = {"cnn": {"plain_replicas": 4}}


def config(quick: bool, tasks: tuple[str, ...], jobs: int) -> SuiteConfig:
    if quick:
        return SuiteConfig(mode="acceptance-quick", tasks=tasks, grid_n=3, seeds=(0,),
                           overrides={t: {**QUICK_OVERRIDES[t], **LAYOUT.get(t, {})} for t in tasks},
                           jobs=jobs)
    return SuiteConfig(mode="acceptance", tasks=tasks, jobs=jobs,
                       overrides={t: LAYOUT[t] for t in tasks if t in LAYOUT})


def plan_cells(cfg: SuiteConfig, results: dict) -> list[RunSpec]:
    out = []
    for t in cfg.tasks:
        o = oracle(cfg, results, t)["lr"]
        for f in STARTS.values():
            for s in cfg.seeds:
                out.append(RunSpec(t, "plain", o * f, seed=s, overrides=cfg.ov(t), tag="start"))
                out.append(RunSpec(t, "hpx", o * f, seed=s, variant=VARIANT, overrides=cfg.ov(t),
                                   tag="autolr"))
            if f > 1:  # criterion 4 asks whether training at a tenth of the start trains
                for s in cfg.seeds:
                    out.append(RunSpec(t, "plain", o * f / 10, seed=s, overrides=cfg.ov(t), tag="tenth"))
    return out


def _runs(cfg: SuiteConfig, results: dict, t: str, kind: str, lr: float) -> list[dict]:
    variant = VARIANT if kind == "hpx" else "default"
    return [results[_key(RunSpec(t, kind, lr, seed=s, variant=variant, overrides=cfg.ov(t)))]
            for s in cfg.seeds]


def _loss(r: dict) -> float:
    v = r["final"]["loss"]
    return v if (not r["diverged"] and math.isfinite(v)) else math.inf


def analyse(cfg: SuiteConfig, results: dict) -> dict[str, Any]:
    cells = []
    for t in cfg.tasks:
        orc = oracle(cfg, results, t)
        for start, f in STARTS.items():
            lr = orc["lr"] * f
            plain, hpx = _runs(cfg, results, t, "plain", lr), _runs(cfg, results, t, "hpx", lr)
            tenth = _runs(cfg, results, t, "plain", lr / 10) if f > 1 else None
            p_loss = statistics.fmean(_loss(r) for r in plain)
            h_loss = statistics.fmean(_loss(r) for r in hpx)
            ends = [r["end_lr"]["lr"] / orc["lr"] for r in hpx]
            hpx_cost = statistics.fmean(r["train_samples"] + r["signal_samples"] / 3 for r in hpx)
            cells.append({
                "task": t, "start": start, "lr": lr, "oracle_lr": orc["lr"], "oracle_loss": orc["loss"],
                "plain": p_loss, "plain_failed": any(failed(r) for r in plain),
                "hpx": h_loss, "hpx_losses": [_loss(r) for r in hpx],
                "hpx_failed": sum(failed(r) for r in hpx),
                "tenth_trains": None if tenth is None else not any(failed(r) for r in tenth),
                "vs_plain": h_loss / p_loss, "vs_oracle": h_loss / orc["loss"], "end_lr": ends,
                "compute": hpx_cost / orc["grid_samples"],
                "wall": statistics.fmean(r["wall"] for r in hpx),
            })
    return {"cells": cells, "criteria": criteria(cells)}


def criteria(cells: list[dict]) -> dict[str, Any]:
    suite = [c for c in cells if c["task"] in SUITE_TASKS]
    judged = [c for c in suite if not c["plain_failed"]]
    off = [c for c in suite if c["start"] != "oracle"]
    at = [c for c in suite if c["start"] == "oracle"]
    lost = [c for c in cells if c["hpx_failed"] and c["tenth_trains"] is not False]
    out = {
        "harm_102": sum(c["vs_plain"] <= 1.02 for c in judged) + len(suite) - len(judged),
        "harm_105": sum(c["vs_plain"] <= 1.05 for c in judged) + len(suite) - len(judged),
        "cells": len(suite),
        "recover_105": sum(c["vs_oracle"] <= 1.05 for c in off),
        "recover_102": sum(c["vs_oracle"] <= 1.02 for c in off),
        "lr_2x": sum(all(0.5 <= e <= 2 for e in c["end_lr"]) for c in off),
        "off": len(off),
        "oracle_102": sum(c["vs_oracle"] <= 1.02 for c in at),
        "tasks": len(at),
        "lost": [f"{c['task']} {c['start']}" for c in lost],
    }
    out["met"] = {
        "1. do no harm": out["harm_102"] >= out["cells"] - 1 and out["harm_105"] == out["cells"],
        "2. recover": out["recover_105"] >= 4 and out["recover_102"] >= 2 and out["lr_2x"] >= 4,
        "3. at the oracle": out["oracle_102"] == out["tasks"],
        "4. no run lost": not out["lost"],
    }
    return out


def section(cfg: SuiteConfig, a: dict, command: str, wall: float) -> str:
    c = a["criteria"]
    mark = lambda ok: "**met**" if ok else "not met"  # noqa: E731
    lines = [
        "## Acceptance: the one-run search (`hpx.autolr`) against plain training and the grid",
        "",
        f"Produced by `{command}` (its runs took {wall / 60:.1f} min in all; a resumed run adds up) "
        f"on {report.machine()}.",
        "",
        "Each task: a grid of plain runs over 10x below to 10x above a centre (2 seeds) picks the",
        "oracle (best mean validation loss). From the oracle's lr, 10x below and 10x above it, two",
        "seeds each: plain training at that lr, and one `hpx.autolr` run with the task's schedule",
        "and probe split, one model in one process (autolr's default: it scores its 4 points in",
        "turn) and nothing set per task. Tasks: "
        + "; ".join(f"**{t}**: {get_task(t).title}, {get_task(t, **dict(cfg.ov(t))).steps} steps"
                    for t in cfg.tasks) + ".",
        "",
        "| criterion | measured | target | |",
        "| --- | --- | --- | --- |",
        f"| 1. do no harm: hpx / plain at the same start | <= 1.02 in {c['harm_102']} of {c['cells']}, "
        f"<= 1.05 in {c['harm_105']} of {c['cells']} | 8 of 9 and 9 of 9 | "
        f"{mark(c['met']['1. do no harm'])} |",
        f"| 2. recover: off-start cells vs the oracle's loss | <= 1.05 in {c['recover_105']} of {c['off']}, "
        f"<= 1.02 in {c['recover_102']}; lr within 2x in {c['lr_2x']} | 4, 2 and 4 of 6 | "
        f"{mark(c['met']['2. recover'])} |",
        f"| 3. at the oracle's lr | <= 1.02 in {c['oracle_102']} of {c['tasks']} | all | "
        f"{mark(c['met']['3. at the oracle'])} |",
        f"| 4. no run lost | {', '.join(c['lost']) or 'none'} | none | {mark(c['met']['4. no run lost'])} |",
        "",
        "Criteria 1-3 count the three suite tasks (mlp, charlm, cnn); the gru and tabular tasks are",
        "reported alike: the one-run search was not designed on the gru; the tabular task (a few",
        "hundred rows trained for 156 epochs) was added to test it where a fast start overfits by the",
        "end, and it is where the setup is weakest. The cnn (plain, its grid and hpx) runs as 4",
        "replicas of 16 examples in one process, as plain DDP on 4 devices would: its BatchNorm",
        "statistics depend on the per-replica batch (4 x 16 with nothing explored ends 28% above",
        "one process with the whole batch of 64 at the oracle's lr).",
        "",
        "| task | start | plain at start | oracle (lr) | hpx per seed | hpx / plain | hpx / oracle "
        "| ended lr (x oracle) | compute (x grid) |",
        "| --- | --- | ---: | ---: | --- | ---: | ---: | --- | ---: |",
    ]
    for x in a["cells"]:
        plain = f"{x['plain']:.4f}" + (" (failed)" if x["plain_failed"] else "")
        seeds = ", ".join(f"{v:.4f}" for v in x["hpx_losses"]) + (" (failed)" if x["hpx_failed"] else "")
        lines.append(
            f"| {x['task']} | {x['start']} ({x['lr']:.4g}) | {plain} | {x['oracle_loss']:.4f} "
            f"({x['oracle_lr']:.4g}) | {seeds} | {x['vs_plain']:.3f} | {x['vs_oracle']:.3f} | "
            f"{', '.join(f'{e:.3g}' for e in x['end_lr'])} | {x['compute']:.3f} |")
    lines += ["", "\"compute\": hpx's forward-backward samples plus a third of its probe forward samples,",
              "over the whole grid's forward-backward samples. \"failed\": diverged, or a final loss",
              "within 2% of predicting the uniform distribution (collapse)."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.acceptance",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="CI smoke test: tiny runs")
    ap.add_argument("--tasks", default=",".join(TASKS))
    ap.add_argument("--jobs", type=int, default=None)
    ap.add_argument("--results", default=None)
    ap.add_argument("--out", default=None, help="where benchmarks.md goes (default docs/, quick: runs/)")
    ap.add_argument("--report-only", action="store_true")
    ap.add_argument("--fresh", action="store_true", help="ignore every saved result")
    ap.add_argument("--rerun-hpx", action="store_true",
                    help="keep the saved plain runs (grid and starts), rerun the hpx ones: after a "
                         "change to the search")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    cfg = config(args.quick, tuple(args.tasks.split(",")), args.jobs or (1 if args.quick else default_jobs()))
    res_path = Path(args.results) if args.results else ROOT / "runs" / "benchmarks" / f"{cfg.mode}.json"
    default_out = ROOT / ("runs/benchmarks/acceptance-quick" if args.quick else "docs")
    doc = (Path(args.out) if args.out else default_out) / "benchmarks.md"
    results = {} if args.fresh else load_results(res_path)
    if args.rerun_hpx:
        results = {k: v for k, v in results.items() if "|hpx|" not in k}
    meta = results.pop("__meta__", {"wall": 0.0})
    if not args.report_only:
        start = time.perf_counter()
        execute(plan_grid(cfg), results, cfg.jobs)
        execute(plan_cells(cfg, results), results, cfg.jobs)
        meta["wall"] = meta.get("wall", 0.0) + time.perf_counter() - start
        save_results(res_path, {**results, "__meta__": meta})
    a = analyse(cfg, results)
    command = "python -m benchmarks.acceptance" + (" --quick" if args.quick else "")
    report.write_section(doc, "acceptance", section(cfg, a, command, meta["wall"]))
    for name, ok in a["criteria"]["met"].items():
        print(f"{name}: {'met' if ok else 'not met'}")
    print(f"wrote {doc}; results in {res_path}; {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
