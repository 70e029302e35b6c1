"""The short-horizon bias, measured directly (no hpx involved).

Plain training at the oracle's max lr is branched at step ``t0``: from there to the end
of the run the lr is multiplied by ``m`` in {1/1.5, 1, 1.5} (what one controller move
does), with the same batches in every branch (common random numbers), so the branches
differ only in ``m``. Two answers to "should the lr go up or down at t0?":

* short horizon: the probe loss ``T`` steps after ``t0`` (what a sync compares);
* long horizon: the validation loss at the end of the run (what the oracle is chosen on).

Reported per ``t0``: each answer's preferred branch and the loss differences
``L(up: m = 1.5) - L(down: m = 1/1.5)`` (negative: a higher lr is better).
"""

from __future__ import annotations

import copy
import statistics
from typing import Any

import torch

from benchmarks.tasks import get_task

MULTS = {"down": 1 / 1.5, "same": 1.0, "up": 1.5}


@torch.no_grad()
def _probe(task, model) -> float:
    was = model.training
    model.eval()
    v = statistics.fmean(float(task.probe_loss(model, b)) for b in task.probe_batches())
    model.train(was)
    return v


def branch_curve(task_name: str, lr: float, seed: int, t0s: list[int],
                 overrides: dict | None = None) -> list[dict]:
    torch.set_num_threads(1)
    # dropout masks come from the global RNG: seed it (as benchmarks.runs does), so a series
    # does not depend on what ran before it in the same worker process
    torch.manual_seed(1_000_003 * (seed + 1))
    task = get_task(task_name, **(overrides or {}))
    f = task.schedule()
    model = task.model(seed)
    opt = task.optimizer(model)
    fixed = task.set_fixed(model, opt)
    gen = torch.Generator().manual_seed(10_000 + seed)
    T = task.sync_every

    def train(m, o, g, start, stop, mult):
        for t in range(start, stop):
            for grp in o.param_groups:
                grp["lr"] = lr * mult * f(t)
            batch = task.sample(g, task.batch)
            o.zero_grad(set_to_none=True)
            loss = task.loss(m, batch, fixed)
            if not torch.isfinite(loss):
                return False
            loss.backward()
            o.step()
        return True

    rows, t = [], 0
    for t0 in sorted(t0s):
        train(model, opt, gen, t, t0, 1.0)
        t = t0
        snap = (copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict()), gen.get_state())
        rng = torch.get_rng_state()  # every branch (and the trunk after) gets the same dropout masks
        row: dict[str, Any] = {"t0": t0, "short": {}, "long": {}}
        for label, mult in MULTS.items():
            torch.set_rng_state(rng)
            m = copy.deepcopy(model)
            o = task.optimizer(m)
            o.load_state_dict(snap[1])
            g = torch.Generator()
            g.set_state(snap[2])
            ok = train(m, o, g, t0, min(task.steps, t0 + T), mult)
            row["short"][label] = _probe(task, m) if ok else float("inf")
            ok = ok and train(m, o, g, min(task.steps, t0 + T), task.steps, mult)
            row["long"][label] = task.evaluate(m)["loss"] if ok else float("inf")
        rows.append(row)
        torch.set_rng_state(rng)
    return rows


def horizon_job(args: tuple) -> tuple[tuple, list[dict]]:
    """One (task, start, lr, seed) branch series; picklable for the process pool."""
    task_name, start, lr, seed, t0s, overrides = args
    return (task_name, start, seed), branch_curve(task_name, lr, seed, list(t0s), dict(overrides))


def t0_points(task_name: str, overrides: dict | None = None,
              fracs: tuple[float, ...] = (0.1, 0.2, 0.35, 0.5, 0.7, 0.85)) -> list[int]:
    """The first sync, the schedule's peak and points after it."""
    task = get_task(task_name, **(overrides or {}))
    return sorted({task.sync_every} | {max(1, round(fr * task.steps)) for fr in fracs})


def summarize_horizon(per_seed: list[list[dict]]) -> list[dict]:
    rows = []
    for i in range(len(per_seed[0])):
        rs = [ps[i] for ps in per_seed]
        short = {m: statistics.fmean(r["short"][m] for r in rs) for m in MULTS}
        long = {m: statistics.fmean(r["long"][m] for r in rs) for m in MULTS}
        rows.append({"t0": rs[0]["t0"], "short": short, "long": long,
                     "short_best": min(short, key=short.get), "long_best": min(long, key=long.get),
                     "short_diff": short["up"] - short["down"],
                     "long_diff": long["up"] - long["down"],
                     "agree": sum((r["short"]["up"] < r["short"]["down"])
                                  == (r["long"]["up"] < r["long"]["down"]) for r in rs),
                     "n": len(rs)})
    return rows


def collinearity(task_name: str, lr: float, seed: int = 0, syncs: int = 3,
                 overrides: dict | None = None) -> dict[str, float]:
    """How much of the replicas' spread is one line (hpx, shared gradients, no controller).

    ``syncs`` intervals are trained; one step before the next sync, the replicas'
    deviations from their mean (all parameters and float buffers, as one vector) are
    compared pairwise. ``|cos| = 1`` for every pair means each replica sits on one line
    through the mean: replica ``r`` is ``theta_0 + rho_r U`` for a common update ``U``.
    """
    import hpx
    from hpx.averaging import float_state

    torch.set_num_threads(1)
    torch.manual_seed(1_000_003 * (seed + 1))
    task = get_task(task_name, **(overrides or {}))
    T = task.sync_every
    engine = hpx.Engine(task.model(seed), task.optimizer, task.knobs(lr, 0.5, task.schedule()), replicas=4,
                        sync_every=T, seed=seed, signal=hpx.IntervalLoss(), controller=False)
    gen = torch.Generator().manual_seed(10_000 + seed)
    for _ in range(syncs * T + T - 1):
        engine.step(lambda rep, b: task.loss(rep.model, b, rep._values), task.sample(gen, task.batch))
    vecs = [torch.cat([t.detach().reshape(-1).double() for t in float_state(r.model)])
            for r in engine.replicas]
    mean = sum(vecs) / len(vecs)
    dev = [v - mean for v in vecs]
    cos = [abs(float(torch.nn.functional.cosine_similarity(a, b, dim=0)))
           for i, a in enumerate(dev) for b in dev[i + 1:]]
    return {"min_abs_cos": min(cos), "mean_abs_cos": statistics.fmean(cos), "step": engine.step_count,
            "knobs": len(engine.knobs)}
