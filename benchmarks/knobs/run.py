"""One run of a co-exploration task: plain training at a grid cell, or a search from a start cell.

Plain training is the user's loop at the cell's peak lr and knob values. A search is handed the
same model, optimizer and scheduler, built at the start cell, and the knobs as a user declares
them (:func:`declared`). Both draw the same batches (a generator seeded from the run's seed) and
the same dropout draws (the global stream seeded from it, restored after), and report the
validation loss at the end (``None`` if the run diverged), the values they end at and the
optimizer steps they took.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

import torch

import hpx
from benchmarks import optuna_route
from benchmarks.knobs.lanes import Lanes
from benchmarks.knobs.tasks import CoTask, _Attention, get_task, set_knobs, train_loss

__all__ = ["METHODS", "declared", "key", "run"]


def declared(ct: CoTask, start: dict[str, float]) -> list[hpx.Knob]:
    """The task's knobs as the README tells a user to declare them for ``hpx.Forks``: a dropout
    rate 0.2 to each side, a weight decay a decade, a label smoothing 0.1, an attention temperature
    a factor of 2 (fixed before any search ran on the suite). The others read your value from the
    model or optimizer; the loss's label smoothing is given (``base=``), as a user gives it."""
    out: list[hpx.Knob] = []
    for name in ct.knob_names():
        if name == "dropout":
            out.append(hpx.Dropout(spread=0.2))
        elif name == "weight_decay":
            out.append(hpx.WeightDecay(group=0, span=10))
        elif name == "label_smoothing":
            out.append(hpx.LabelSmoothing(base=start["label_smoothing"], spread=0.1))
        elif name == "temperature":
            out.append(hpx.AttentionTemperature(modules=_Attention, span=2))
    return out


def _forks(options: dict[str, Any], cls: Any = None) -> Callable[..., Any]:
    def route(ct: CoTask, model: torch.nn.Module, opt: torch.optim.Optimizer, sched: Any,
              batches: list[Any], start: dict[str, float],
              seed: int = 0) -> tuple[torch.nn.Module | None, dict[str, Any]]:
        task = ct.task
        knobs = declared(ct, start)
        smooth = "label_smoothing" in ct.knob_names()

        def loss(rep: Any, b: Any) -> torch.Tensor:
            s = rep.value("label_smoothing") if smooth else 0.0
            return train_loss(task, rep.model, b, s)

        forks = (cls or hpx.Forks)(model, opt, total_steps=task.steps, schedule=sched, probe=task.probe(),
                          loss_fn=lambda rep, b: task.loss(rep.model, b), knobs=knobs, **options)
        try:
            for b in batches:
                forks.step(loss, b)
            final: torch.nn.Module | None = forks.converge()
        except hpx.NonFiniteError:
            final = None
        ends = {k.name: float(forks.values[k.name]) for k in knobs}
        steps = forks.fork_steps / task.steps
        end = forks.history[-1] if forks.history and forks.history[-1].phase == "end" else None
        told = None if end is None else {"scores": end.scores, "values": end.values,
                                         "gain": (end.metrics or {}).get("gain")}
        return final, {"lr_factor": float(forks.factor), "values": ends, "steps": steps, "end": told}
    return route


def _optuna(ct: CoTask, model: torch.nn.Module, opt: torch.optim.Optimizer, sched: Any, batches: list[Any],
            start: dict[str, float], seed: int = 0) -> tuple[torch.nn.Module | None, dict[str, Any]]:
    """Optuna (``benchmarks/optuna_route.py``): TPE + successive halving over separate trials of plain
    training at hpx.Forks' 2.9x budget, on the lr (a multiple of the start's, 0.1 to 10, log scale)
    and the task's knobs (:func:`benchmarks.optuna_route.knob_range` of each grid). Each trial
    rebuilds the model, optimizer and scheduler from the task at the run's seed and trains on the
    same ``batches`` with the same dropout draws; the objects handed in are not used."""
    task = ct.task
    lr = opt.defaults["lr"]  # the start cell's peak lr (the optimizer was built at it)
    space = {"lr": optuna_route.LR_RANGE, **{k: optuna_route.knob_range(k, grid) for k, grid in ct.axes}}

    def build(values: dict[str, float]) -> optuna_route.Trial:
        knobs = {k: values[k] for k in ct.knob_names()}
        m = task.model(seed)
        o = task.optimizer(m, lr * values["lr"])
        s = task.scheduler(o)
        set_knobs(m, o, knobs)
        smoothing = knobs.get("label_smoothing", 0.0)
        torch.manual_seed(20_000 + seed)  # dropout's draws: as plain training's at this seed (run())
        m.train()

        def step(i: int) -> None:
            loss = train_loss(task, m, batches[i], smoothing)
            o.zero_grad(set_to_none=True)
            loss.backward()
            o.step()
            s.step()

        return optuna_route.Trial(m, step, lambda: task.evaluate(m, task.probe()), task.evaluate)

    with torch.random.fork_rng(devices=[]):
        res = optuna_route.search(build, steps=task.steps, start={"lr": 1.0, **start}, space=space, seed=seed)
    ends = res["values"] if res["values"] is not None else {"lr": 1.0, **start}  # none completed: the start
    values = {k: float(ends[k]) for k in ct.knob_names()}
    return res["model"], {"lr_factor": float(ends["lr"]), "values": values, "steps": res["steps"],
                          "trials": res["trials"]}


# method -> the route (a function of the task, its objects and the run's seed). "Forks": hpx.Forks at
# its defaults.
METHODS: dict[str, Callable[..., Any]] = {
    "Forks": _forks({}),  # knob_design="split": the lower sides raced from the start, the upper joint at 70%
    # one lower fork per knob from the start, the upper joint at 70% (the split design, named)
    "split": _forks({"knob_design": "split"}),
    # two lower forks per knob from the start (one and two spreads down), the upper joint at 70%
    "ladder": _forks({"knob_design": "ladder"}),
    # the end without its test (confidence 0: the best scorer wins): what the test holds back, and its harm
    "Forks-z0": _forks({"confidence": 0.0}),
    # each knob's lower fork in a lane of its own, judged against your run, with a second rung
    # (benchmarks/knobs/lanes.py: a prototype)
    "lanes": _forks({}, cls=Lanes),
    # ... lanes at the first cut only, then one race for the places, as under split
    "lanes1": _forks({"lane_cuts": 1}, cls=Lanes),
    # the evidence a one-spread search can buy: a fork per knob and side from the run's first step to its
    # end, uncut (branched at step 1), beside the lr's race; the end's test as the default's
    "finished-each": _forks({"knob_start": 1e-3, "knob_design": "each"}),
    # the defaults before issue 49: two forks per knob from the start, cut with the lr's forks
    "Forks-start": _forks({"knob_start": 0.0, "knob_design": "each"}),
    # knob forks branched from your run at a share of the run, each knob to each side or jointly
    **{f"late{round(b * 100)}-{d}": _forks({"knob_start": b, "knob_design": d})
       for b in (0.1, 0.3, 0.5, 0.7, 0.85) for d in ("each", "joint")},
    # the standard tool at the same budget: Optuna's TPE + successive halving over separate trials
    "Optuna": _optuna,
}


def key(method: str, name: str, cell: tuple[float, ...], seed: int) -> str:
    return f"{method}|{name}|" + "|".join(f"{v:.6g}" for v in cell) + f"|{seed}"


def run(args: tuple[str, str, tuple[float, ...], int]) -> tuple[str, dict[str, Any]]:
    """One run: ``(method, task, cell, seed)`` -> (its key, its result). ``method`` is ``"plain"``
    or a name in :data:`METHODS`; the cell is ``(lr, knob values...)`` in the task's axes' order."""
    method, name, cell, seed = args
    torch.set_num_threads(1)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(20_000 + seed)  # dropout's draws: the same whichever runs the process did before
        return key(method, name, cell, seed), _run(method, get_task(name), cell, seed)


def _run(method: str, ct: CoTask, cell: tuple[float, ...], seed: int) -> dict[str, Any]:
    task = ct.task
    lr, values = cell[0], dict(zip(ct.knob_names(), cell[1:]))
    model = task.model(seed)
    opt = task.optimizer(model, lr)
    sched = task.scheduler(opt)
    set_knobs(model, opt, values)
    gen = torch.Generator().manual_seed(10_000 + seed)
    batches = [task.sample(gen) for _ in range(task.steps)]
    t0 = time.perf_counter()
    out: dict[str, Any] = {}
    if method == "plain":
        final: torch.nn.Module | None = _plain(ct, model, opt, sched, batches,
                                               values.get("label_smoothing", 0.0))
        out = {"lr_factor": 1.0, "values": values, "steps": 1.0}
    else:
        final, out = METHODS[method](ct, model, opt, sched, batches, values, seed=seed)
    out["seconds"] = time.perf_counter() - t0
    val = task.evaluate(final) if final is not None else math.nan
    out["val"] = val if math.isfinite(val) else None
    return out


def _plain(ct: CoTask, model: torch.nn.Module, opt: torch.optim.Optimizer, sched: Any,
           batches: list[Any], smoothing: float) -> torch.nn.Module:
    """The user's loop: backward, optimizer step, scheduler step (the training loss smoothed by
    ``smoothing``: the lr suite's ``plain_train`` when it is 0)."""
    model.train()
    for b in batches:
        loss = train_loss(ct.task, model, b, smoothing)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
    return model
