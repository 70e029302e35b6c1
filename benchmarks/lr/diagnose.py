"""Read candidate search signals off plain training, at each grid lr, without any search acting.

    python -m benchmarks.lr.diagnose [--tasks ...] [--jobs 2]   # read, then print the tables

A signal that a controller moves the lr by has its fixed point where the signal crosses zero.
Reading the signal off plain runs at fixed peak lrs (0.1x .. 10x the grid's best, half-decade
steps) shows where that crossing lies against the grid's best, task by task, before any
controller is built on it. Only design tasks are read by default (held-out tasks stay held out).

Signals, at checkpoints spread over the run (each a curve of the probe loss over a few
multipliers ``rho`` of the run's displacement from its initial parameters ``a``):

* ``iterate``: points ``a + rho (theta - a)``, ``theta`` the current weights (what Stretch scores);
* ``ema``: points ``a + rho (theta_bar - a)``, ``theta_bar`` an exponential average of the
  iterates over the last ``steps / 40`` steps (the valley's noise averaged away);
* ``anneal``: the probe loss after a fork of the run is annealed linearly to 0 over
  ``steps / 20`` steps from the current lr (what the run would score if it ended now).

Results go to ``runs/lr/diagnose.json``. Two tables are printed per signal, one column per
checkpoint (5% .. 90% of the run): where the fitted ``rho*`` crosses 1 (the peak lr over the
grid's best, interpolated; 0: below 1 at every lr read, inf: above 1 at every lr), and which lr's
run scores lowest on the probe (its weights at ``rho = 1``, or annealed).
"""

from __future__ import annotations

import argparse
import copy
import itertools
import json
import math
import sys
from concurrent.futures import ProcessPoolExecutor, as_completed
from typing import Any

import torch

from benchmarks.lr.__main__ import GRIDS, RUNS, _load, best_of_grid
from benchmarks.lr.prototypes import probe_at, probe_loss
from benchmarks.lr.tasks import HELD_OUT, TASKS, get_task
from hpx.search._util import parabola_min

RHOS = [1.5 ** (k / 3) for k in range(-3, 4)]  # 1/1.5 .. 1.5, 7 points
CHECKS = [0.05 * k for k in range(1, 19)]  # 5% .. 90% of the run
FACTORS = [0.1, 10 ** -0.5, 1.0, 10 ** 0.5, 10.0]


def _curve(task: Any, model: torch.nn.Module, a: list[torch.Tensor],
           theta: list[torch.Tensor]) -> list[float]:
    """The probe loss at ``a + rho (theta - a)`` for each ``rho`` in :data:`RHOS`."""
    return [probe_at(task, model, [a0 + rho * (t - a0) for a0, t in zip(a, theta)]) for rho in RHOS]


def _anneal(task: Any, model: torch.nn.Module, opt: torch.optim.Optimizer, batches: list[Any]) -> float:
    m, o = copy.deepcopy((model, opt))  # one memo: the copy's optimizer holds the copy's parameters
    lr0 = [g["lr"] for g in o.param_groups]
    n = len(batches)
    for i, b in enumerate(batches):
        for g, l0 in zip(o.param_groups, lr0):
            g["lr"] = l0 * (1 - i / n)
        loss = task.loss(m, b)
        o.zero_grad(set_to_none=True)
        loss.backward()
        o.step()
    return probe_loss(task, m)


def read(task_name: str, lr: float, seed: int = 0) -> dict[str, Any]:
    torch.set_num_threads(1)
    task = get_task(task_name)
    model = task.model(seed)
    opt = task.optimizer(model, lr)
    sched = task.scheduler(opt)
    gen = torch.Generator().manual_seed(10_000 + seed)
    batches = [task.sample(gen) for _ in range(task.steps)]
    a = [p.detach().clone() for p in model.parameters()]
    ema = [p.detach().clone() for p in model.parameters()]
    beta = 1 - 1 / max(1.0, task.steps / 40)
    marks = {max(1, round(c * task.steps)): c for c in CHECKS}
    m_anneal = max(2, task.steps // 20)
    out: dict[str, Any] = {"task": task_name, "lr": lr, "checks": []}
    model.train()
    for t, b in enumerate(batches, 1):
        loss = task.loss(model, b)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        with torch.no_grad():
            torch._foreach_lerp_(ema, list(model.parameters()), 1 - beta)
        if t in marks:
            theta = [p.detach().clone() for p in model.parameters()]
            ahead = batches[t:t + m_anneal] if t + m_anneal <= len(batches) else batches[:m_anneal]
            out["checks"].append({
                "at": marks[t], "lr_now": opt.param_groups[0]["lr"],
                "iterate": _curve(task, model, a, theta), "ema": _curve(task, model, a, ema),
                "anneal": _anneal(task, model, opt, ahead)})
    return out


def _log_rho_star(curve: list[float]) -> float:
    """The fitted parabola's minimum over ``log rho`` (as Stretch fits it); a blown-up curve: -1."""
    s = torch.tensor(curve, dtype=torch.float64)
    z = torch.tensor([math.log(r) for r in RHOS], dtype=torch.float64)
    if not torch.isfinite(s).all():
        return -1.0
    if not float(s.max() - s.min()) > 0:
        return 0.0
    w = float(z.abs().max())
    return parabola_min(z / w, (s - s.mean()) / s.std(), True) * w


def _crossing(values: list[float]) -> float:
    """The factor (of the grid's best) where ``values`` (one per factor) goes from > 0 to <= 0."""
    lf = [math.log10(f) for f in FACTORS]
    for i, (hi, lo) in enumerate(itertools.pairwise(values)):
        if hi > 0 >= lo:
            return 10 ** (lf[i] + (lf[i + 1] - lf[i]) * hi / (hi - lo))
    return 0.0 if all(v <= 0 for v in values) else math.inf


def tables(store: dict[str, Any], tasks: list[str]) -> str:
    out = []
    for title, cell in (
            ("rho* of the iterate crosses 1 at (x best)", lambda c: _log_rho_star(c["iterate"])),
            ("rho* of the averaged weights crosses 1 at (x best)", lambda c: _log_rho_star(c["ema"])),
            ("lowest probe loss: the run at (x best), its weights", lambda c: c["iterate"][len(RHOS) // 2]),
            ("lowest probe loss: the run at (x best), averaged", lambda c: c["ema"][len(RHOS) // 2]),
            ("lowest probe loss: the run at (x best), annealed", lambda c: c["anneal"])):
        out.append(f"{title}; checkpoints at " + " ".join(f"{c:.0%}" for c in CHECKS))
        for t in tasks:
            runs = [store.get(f"{t}|{f:.4g}") for f in FACTORS]
            if any(r is None for r in runs):
                continue
            row = []
            for k in range(len(CHECKS)):
                v = [cell(r["checks"][k]) for r in runs]
                if title.startswith("rho*"):
                    row.append(_crossing(v))
                else:
                    v = [x if math.isfinite(x) else math.inf for x in v]
                    row.append(FACTORS[min(range(len(v)), key=v.__getitem__)])
            out.append(f"  {t:18s} " + " ".join(f"{x:5.2g}" for x in row))
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.lr.diagnose")
    p.add_argument("--tasks", nargs="*", default=[t for t in TASKS if t not in HELD_OUT])
    p.add_argument("--jobs", type=int, default=2)
    a = p.parse_args(argv)
    grids = _load(GRIDS)
    path = RUNS / "diagnose.json"
    store = _load(path)
    todo = []
    for t in a.tasks:
        i, lrs, _ = best_of_grid(t, grids)
        for f in FACTORS:
            key = f"{t}|{f:.4g}"
            if key not in store:
                todo.append((key, t, lrs[i] * f))
    with ProcessPoolExecutor(a.jobs) as pool:
        futs = {pool.submit(read, t, lr): key for key, t, lr in todo}
        for f in as_completed(futs):
            store[futs[f]] = f.result()
            print(futs[f], file=sys.stderr)
            path.write_text(json.dumps(store))
    print(tables(store, a.tasks))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
