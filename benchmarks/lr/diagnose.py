"""Read candidate search signals off plain training, at each grid lr, without any search acting.

    python -m benchmarks.lr.diagnose [--tasks ...] [--jobs 2] [--store diagnose-temp.json] [--light]

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
  ``steps / 20`` steps from the current lr (what the run would score if it ended now);
* ``tempfree``: the ``iterate`` points, each scored at its own best output scale: a classifier's
  cross-entropy of ``logits / tau`` at the best ``tau > 0``, a regression's squared error of
  ``s * out`` at the best ``s`` (stretching the displacement scales the logits like an inverse
  temperature, so the plain curve carries a calibration preference this takes out);
* ``body``: points where every parameter but the output layer's (the last ``nn.Linear`` in
  ``model.modules()``) is stretched, the output layer kept at ``theta``; plain probe loss;
* ``body_tempfree``: the ``body`` points scored at their best output scale;
* ``lag50``: points ``theta_h + rho (theta - theta_h)``, ``theta_h`` the run's weights at half the
  elapsed steps (the anchor moves with the run instead of staying at ``a``);
* ``lag5``: points ``theta_5 + rho (theta - theta_5)``, ``theta_5`` the weights at 5% of the run
  (after the first descent; at the 5% checkpoint itself ``a``);
* ``dir``: the ``iterate`` points with each parameter tensor rescaled to its norm in ``theta``
  (zero-norm tensors kept): the stretch turns the weights without scaling any tensor;
* ``mix`` (a table, not a curve): the mean of the fitted ``log rho*`` of ``iterate`` and ``dir``;
* ``dog_peak``, ``dog_mean`` (no probe, read off the trajectory at every step): DoG's step size
  (distance over gradients, Ivgi et al. 2023) for the optimizer's own direction. With ``x_i`` the
  weights before step ``i`` and ``lr_i`` the lr it used (param group 0's), ``u_i = (x_i - x_{i+1})
  / lr_i`` is the update per unit lr (momentum, preconditioning and weight decay in it; steps at
  ``lr_i = 0`` skipped), ``S_t = sum ||u_i||^2``, ``R_t = max ||x_i - x_0||`` and
  ``eta_dog = R_t / sqrt(S_t)``; ``dog_peak`` is ``eta_dog`` over the run's peak lr, ``dog_mean``
  over the mean ``lr_i`` so far (the signal is the log10 of each: it crosses where the ratio is 1).

The last three curves use only the parameters and the scalar probe loss (what a generic library
has); each is read from the RNG state the ``iterate`` curve starts from (the same dropout draws
as ``iterate`` at each ``rho``) and restores it. ``tempfree``, ``body`` and ``body_tempfree``
are read with the global RNG forked too, so ``iterate``, ``ema``, ``anneal`` and the trajectory are
those of a run without any of them.

``--light`` reads only ``iterate`` and the DoG ratios (the probe forwards of ``iterate`` read from a
forked RNG, so the trajectory is the plain run's, untouched by any probe: dropout tasks then differ
from the full read's, which draws the probes' dropout from the run's RNG); ``diagnose-dog.json``
holds a light read. Results go to ``runs/lr/diagnose-temp.json`` (``--store``; ``diagnose.json``
holds the first three signals only, read before the global RNG was seeded per run;
``diagnose-proxy.json`` all of them, the generic proxies included). Two tables are printed per
signal, one column per checkpoint (5% .. 90% of the run): where the fitted ``rho*`` (or the DoG
ratio) crosses 1 (the peak lr over the grid's best, interpolated; 0: below 1 at every lr read,
inf: above 1 at every lr), and which lr's run scores lowest on the probe (its weights at
``rho = 1``, or annealed). A last table counts, per signal and task, the checkpoints from 15% to
90% whose crossing lies in :data:`BAND`.

The screens quoted in docs/method.md read the 11 design tasks of the time (the default list has
15 since four first held-out tasks became design tasks): ``--tasks digits_mlp digits_cnn_bn
digits_cnn char_transformer char_gru cancer_dropout bert_tiny wine_short teacher_long digits_noisy
char_mlp``.
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
import torch.nn.functional as F

from benchmarks.lr.__main__ import GRIDS, RUNS, _load, best_of_grid
from benchmarks.lr.prototypes import probe_at, probe_loss
from benchmarks.lr.tasks import HELD_OUT, TASKS, get_task
from hpx.search._util import parabola_min

RHOS = [1.5 ** (k / 3) for k in range(-3, 4)]  # 1/1.5 .. 1.5, 7 points
CHECKS = [0.05 * k for k in range(1, 19)]  # 5% .. 90% of the run
FACTORS = [0.1, 10 ** -0.5, 1.0, 10 ** 0.5, 10.0]
BAND = (10 ** -0.5, 10 ** 0.5)  # a crossing within half a decade of the grid's best counts as found


def _curve(task: Any, model: torch.nn.Module, a: list[torch.Tensor],
           theta: list[torch.Tensor]) -> list[float]:
    """The probe loss at ``a + rho (theta - a)`` for each ``rho`` in :data:`RHOS`."""
    return [probe_at(task, model, [a0 + rho * (t - a0) for a0, t in zip(a, theta)]) for rho in RHOS]


def _lagged(task: Any, model: torch.nn.Module, anchor: list[torch.Tensor],
            theta: list[torch.Tensor]) -> list[float]:
    """:func:`_curve` from ``anchor`` (read from the current RNG state, which is then restored)."""
    with torch.random.fork_rng(devices=[]):
        return _curve(task, model, anchor, theta)


def _renorm(point: list[torch.Tensor], theta: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each tensor of ``point`` rescaled to the norm of its tensor in ``theta`` (zero norms kept)."""
    out = []
    for x, t in zip(point, theta):
        nx, nt = float(x.norm()), float(t.norm())
        out.append(x * (nt / nx) if nx > 0 and nt > 0 else x)
    return out


def _dir_curve(task: Any, model: torch.nn.Module, a: list[torch.Tensor],
               theta: list[torch.Tensor]) -> list[float]:
    """The probe loss at the ``iterate`` points, each tensor at its norm in ``theta`` (RNG restored)."""
    with torch.random.fork_rng(devices=[]):
        return [probe_at(task, model, _renorm([a0 + rho * (t - a0) for a0, t in zip(a, theta)], theta))
                for rho in RHOS]


def _outputs(task: Any, model: torch.nn.Module, weights: list[torch.Tensor]) -> list[tuple[Any, Any]]:
    """The model's outputs (float64) and targets on each probe batch at ``weights`` (then put back)."""
    params = list(model.parameters())
    keep = [p.detach().clone() for p in params]
    with torch.no_grad():
        for p, w in zip(params, weights):
            p.copy_(w)
        outs = []
        for x, y in task.probe():
            out = model(x).double()
            if task.kind == "reg":
                outs.append((out.squeeze(-1), y.double()))
            else:
                outs.append((out.reshape(-1, out.shape[-1]), y.reshape(-1)))
        for p, k in zip(params, keep):
            p.copy_(k)
    return outs


def _plain(task: Any, outs: list[tuple[Any, Any]], scale: float = 1.0) -> float:
    """The probe loss (mean over batches, as :func:`probe_loss`) of the outputs times ``scale``."""
    f = F.mse_loss if task.kind == "reg" else F.cross_entropy
    loss = sum(float(f(o * scale, y)) for o, y in outs) / len(outs)
    return loss if math.isfinite(loss) else math.inf


def _scale_free(task: Any, outs: list[tuple[Any, Any]]) -> float:
    """The probe loss at the best output scale: squared error of ``s * out`` at the least-squares
    ``s``; cross-entropy of ``logits / tau`` at the best ``tau`` (convex in ``1 / tau``:
    golden-section search over ``log tau`` in ``[-6, 6]``)."""
    if not all(torch.isfinite(o).all() for o, _ in outs):
        return math.inf
    if task.kind == "reg":
        oy = sum(float((o * y).mean()) for o, y in outs)
        oo = sum(float((o * o).mean()) for o, _ in outs)
        return _plain(task, outs, oy / oo if oo > 0 else 0.0)
    lo, hi = -6.0, 6.0
    g = (math.sqrt(5) - 1) / 2
    c, d = hi - g * (hi - lo), lo + g * (hi - lo)
    fc, fd = _plain(task, outs, math.exp(-c)), _plain(task, outs, math.exp(-d))
    for _ in range(70):
        if fc <= fd:
            hi, d, fd = d, c, fc
            c = hi - g * (hi - lo)
            fc = _plain(task, outs, math.exp(-c))
        else:
            lo, c, fc = c, d, fd
            d = lo + g * (hi - lo)
            fd = _plain(task, outs, math.exp(-d))
    return min(fc, fd, _plain(task, outs))


def _head(model: torch.nn.Module) -> list[bool]:
    """For each of ``model.parameters()``: is it one of the last ``nn.Linear``'s (the output layer)?"""
    last = [m for m in model.modules() if isinstance(m, torch.nn.Linear)][-1]
    ids = {id(p) for p in last.parameters()}
    return [id(p) in ids for p in model.parameters()]


def _scale_curves(task: Any, model: torch.nn.Module, a: list[torch.Tensor],
                  theta: list[torch.Tensor]) -> dict[str, list[float]]:
    """The ``tempfree``, ``body`` and ``body_tempfree`` curves over :data:`RHOS`."""
    head = _head(model)
    out: dict[str, list[float]] = {"tempfree": [], "body": [], "body_tempfree": []}
    for rho in RHOS:
        full = _outputs(task, model, [a0 + rho * (t - a0) for a0, t in zip(a, theta)])
        body = _outputs(task, model, [t if h else a0 + rho * (t - a0) for a0, t, h in zip(a, theta, head)])
        out["tempfree"].append(_scale_free(task, full))
        out["body"].append(_plain(task, body))
        out["body_tempfree"].append(_scale_free(task, body))
    return out


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


def _dog(lr_peak: float, r_max: float, s_sum: float, lr_sum: float, n: int) -> dict[str, float]:
    """The DoG ratios at a checkpoint: ``R / sqrt(S)`` over the peak lr and over the mean lr so far."""
    eta = r_max / math.sqrt(s_sum) if s_sum > 0 else math.inf
    mean = eta / (lr_sum / n) if lr_sum > 0 else math.inf
    return {"dog_eta": eta, "dog_peak": eta / lr_peak, "dog_mean": mean}


def read(task_name: str, lr: float, seed: int = 0, light: bool = False) -> dict[str, Any]:
    torch.set_num_threads(1)
    torch.manual_seed(20_000 + seed)  # dropout draws: the same whichever runs the process did before
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
    halves = {t: round(t / 2) for t in marks}  # each checkpoint's lag50 anchor (step 0: a)
    snaps: dict[int, list[torch.Tensor]] = {0: a}
    first, anchor5 = min(marks), a  # lag5's anchor: a, then the weights at the 5% checkpoint
    m_anneal = max(2, task.steps // 20)
    out: dict[str, Any] = {"task": task_name, "lr": lr, "checks": []}
    params = list(model.parameters())
    r_max = s_sum = lr_sum = 0.0  # DoG: max distance from a, sum of squared unit-lr update norms, sum of lrs
    model.train()
    for t, b in enumerate(batches, 1):
        loss = task.loss(model, b)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        lr_i = opt.param_groups[0]["lr"]
        with torch.no_grad():
            before = torch._foreach_mul(params, 1.0)
        opt.step()
        sched.step()
        with torch.no_grad():
            lr_sum += lr_i
            if lr_i != 0:
                torch._foreach_sub_(before, params)
                s_sum += sum(float(n) ** 2 for n in torch._foreach_norm(before)) / lr_i ** 2
            r_max = max(r_max, math.sqrt(sum(float(n) ** 2 for n in torch._foreach_norm(
                torch._foreach_sub(params, a)))))
            if not light:
                torch._foreach_lerp_(ema, params, 1 - beta)
        if t in marks and light:
            theta = [p.detach().clone() for p in params]
            with torch.random.fork_rng(devices=[]):
                check = {"at": marks[t], "lr_now": opt.param_groups[0]["lr"],
                         "iterate": _curve(task, model, a, theta)}
            check.update(_dog(lr, r_max, s_sum, lr_sum, t))
            out["checks"].append(check)
            continue
        if t in halves.values():
            snaps[t] = [p.detach().clone() for p in model.parameters()]
        if t in marks:
            theta = [p.detach().clone() for p in model.parameters()]
            proxies = {"lag50": _lagged(task, model, snaps[halves[t]], theta),
                       "lag5": _lagged(task, model, anchor5, theta),
                       "dir": _dir_curve(task, model, a, theta)}
            ahead = batches[t:t + m_anneal] if t + m_anneal <= len(batches) else batches[:m_anneal]
            out["checks"].append({
                "at": marks[t], "lr_now": opt.param_groups[0]["lr"],
                "iterate": _curve(task, model, a, theta), "ema": _curve(task, model, a, ema),
                "anneal": _anneal(task, model, opt, ahead)})
            with torch.random.fork_rng(devices=[]):
                out["checks"][-1].update(_scale_curves(task, model, a, theta))
            out["checks"][-1].update(proxies)
            out["checks"][-1].update(_dog(lr, r_max, s_sum, lr_sum, t))
            if t == first:
                anchor5 = theta
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


def _star(key: str) -> Any:
    return lambda c: _log_rho_star(c[key])


def _log_ratio(key: str) -> Any:
    """log10 of a ratio (clamped to +-30, so a blown-up run's crossing stays interpolable)."""
    return lambda c: max(-30.0, min(30.0, math.log10(c[key]) if c[key] > 0 else -30.0))


# (its name in the counts, the curve it needs, title, the signed reading per checkpoint: > 0 says
# raise the lr)
CROSSINGS = (
    ("iterate", "iterate", "rho* of the iterate crosses 1 at (x best)", _star("iterate")),
    ("ema", "ema", "rho* of the averaged weights crosses 1 at (x best)", _star("ema")),
    ("tempfree", "tempfree", "rho* of the iterate at its best output scale crosses 1 at (x best)",
     _star("tempfree")),
    ("body", "body", "rho* of the iterate, output layer kept, crosses 1 at (x best)", _star("body")),
    ("body_tempfree", "body_tempfree",
     "rho* of the iterate, output layer kept, best scale, crosses 1 at (x best)", _star("body_tempfree")),
    ("lag50", "lag50", "rho* from the weights at half the steps crosses 1 at (x best)", _star("lag50")),
    ("lag5", "lag5", "rho* from the weights at 5% of the run crosses 1 at (x best)", _star("lag5")),
    ("dir", "dir", "rho* of the iterate, each tensor at its norm, crosses 1 at (x best)", _star("dir")),
    ("mix", "dir", "mean log rho* of iterate and dir crosses 1 at (x best)",
     lambda c: (_log_rho_star(c["iterate"]) + _log_rho_star(c["dir"])) / 2),
    ("dog_peak", "dog_peak", "DoG's R / sqrt(S) over the peak lr crosses 1 at (x best)",
     _log_ratio("dog_peak")),
    ("dog_mean", "dog_mean", "DoG's R / sqrt(S) over the mean lr so far crosses 1 at (x best)",
     _log_ratio("dog_mean")))
LOWEST = (
    ("iterate", "iterate", "lowest probe loss: the run at (x best), its weights",
     lambda c: c["iterate"][len(RHOS) // 2]),
    ("ema", "ema", "lowest probe loss: the run at (x best), averaged", lambda c: c["ema"][len(RHOS) // 2]),
    ("anneal", "anneal", "lowest probe loss: the run at (x best), annealed", lambda c: c["anneal"]))


def _rows(store: dict[str, Any], tasks: list[str], cell: Any, crossing: bool) -> dict[str, list[float]]:
    """Per task with all its runs read: one value per checkpoint (a crossing, or the lowest run)."""
    rows = {}
    for t in tasks:
        runs = [store.get(f"{t}|{f:.4g}") for f in FACTORS]
        if any(r is None for r in runs):
            continue
        row = []
        for k in range(len(CHECKS)):
            v = [cell(r["checks"][k]) for r in runs]
            if crossing:
                row.append(_crossing(v))
            else:
                v = [x if math.isfinite(x) else math.inf for x in v]
                row.append(FACTORS[min(range(len(v)), key=v.__getitem__)])
        rows[t] = row
    return rows


def tables(store: dict[str, Any], tasks: list[str]) -> str:
    out = []
    counts = []
    late = [k for k, c in enumerate(CHECKS) if c > 0.1 + 1e-9]  # 15% .. 90%
    for crossing, specs in ((True, CROSSINGS), (False, LOWEST)):
        for name, key, title, cell in specs:
            if not any(key in r["checks"][0] for r in store.values()):
                continue
            rows = _rows(store, tasks, cell, crossing)
            out.append(f"{name}: {title}; checkpoints at " + " ".join(f"{c:.0%}" for c in CHECKS))
            out.extend(f"  {t:18s} " + " ".join(f"{x:5.2g}" for x in row) for t, row in rows.items())
            if crossing:
                counts.append((name, {t: sum(BAND[0] <= row[k] <= BAND[1] for k in late)
                                      for t, row in rows.items()}))
    if counts:
        names = list(counts[0][1])
        out.append(f"checkpoints 15%..90% ({len(late)}) with the crossing in {BAND[0]:.3g}x..{BAND[1]:.3g}x")
        out.append("  " + " " * 14 + "".join(f"{t[:12]:>13s}" for t in names) + "        total")
        for name, c in counts:
            out.append(f"  {name:14s}" + "".join(f"{c.get(t, 0):13d}" for t in names)
                       + f"{sum(c.values()):13d}")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.lr.diagnose")
    p.add_argument("--tasks", nargs="*", default=[t for t in TASKS if t not in HELD_OUT])
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--store", default="diagnose-temp.json", help="the results file in runs/lr")
    p.add_argument("--light", action="store_true",
                   help="read only iterate and the DoG ratios (no other probe; the probe on a forked RNG)")
    a = p.parse_args(argv)
    grids = _load(GRIDS)
    path = RUNS / a.store
    store = _load(path)
    todo = []
    for t in a.tasks:
        i, lrs, _ = best_of_grid(t, grids)
        for f in FACTORS:
            key = f"{t}|{f:.4g}"
            if key not in store:
                todo.append((key, t, lrs[i] * f))
    with ProcessPoolExecutor(a.jobs) as pool:
        futs = {pool.submit(read, t, lr, light=a.light): key for key, t, lr in todo}
        for f in as_completed(futs):
            store[futs[f]] = f.result()
            print(futs[f], file=sys.stderr)
            path.write_text(json.dumps(store))
    print(tables(store, a.tasks))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
