"""One training run: plain (the grid's) or hpx (one of the variants), described by a picklable spec.

Plain training uses the task's global batch ``B`` and ``lr(t) = max_lr * schedule(t)``.
hpx uses 4 replicas in one process, shared-gradient mode, the same global batch
split among them (``B / 4`` each, so one hpx run costs one plain run's
forward-backward samples plus the signal's forward passes), the same schedule
shape, and starts its lr bases at ``max_lr``.
"""

from __future__ import annotations

import copy
import math
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch

import hpx
from benchmarks.tasks import Task, get_task, warmup_flat
from benchmarks.variants import VARIANTS, build_signal, make_controller, signal_cost
from hpx.averaging import float_state
from hpx.engine.facade import _CONTROLLER_SETTINGS

__all__ = ["RunSpec", "consensus_copy", "run"]

REPLICAS = 4
LR_SPREAD = 0.5  # lr multipliers in [0.5, 1.5]


@dataclass(frozen=True)
class RunSpec:
    """What to run. ``overrides`` change the task's settings (quick mode: fewer steps)."""

    task: str
    kind: str                 # "plain" or "hpx"
    lr: float                 # plain: max lr; hpx: starting lr base
    seed: int = 0
    variant: str = "default"  # hpx variants, see benchmarks.variants
    overrides: tuple = ()     # ((key, value), ...) for get_task
    tag: str = ""             # which experiment asked for it



def _finite(x: float) -> bool:
    return isinstance(x, float) and math.isfinite(x)


def run(spec: RunSpec) -> dict[str, Any]:
    torch.set_num_threads(1)
    # dropout masks come from the global RNG: seed it per run so a run does not depend on
    # what ran before it in the same process (hpx itself never reads the global RNG)
    torch.manual_seed(1_000_003 * (spec.seed + 1))
    task = get_task(spec.task, **dict(spec.overrides))
    task.data()  # load outside the timed region
    start = time.perf_counter()
    out = _run_plain(task, spec) if spec.kind == "plain" else _run_hpx(task, spec)
    out["wall"] = time.perf_counter() - start
    out.update(asdict(spec))
    out["overrides"] = dict(spec.overrides)
    out["final"] = out["curve"][-1] if out["curve"] else {"loss": math.nan, "acc": math.nan}
    return out


def _eval_points(task: Task) -> set[int]:
    return {round(task.steps * (i + 1) / task.evals) for i in range(task.evals)}


# ----------------------------------------------------------------------------- plain


def _run_plain(task: Task, spec: RunSpec) -> dict[str, Any]:
    if task.plain_replicas > 1:  # plain data parallelism: hpx's layout, nothing explored
        model = task.model(spec.seed)
        knobs = [hpx.LearningRateScale("lr", schedule=task.schedule())]
        engine = hpx.Engine(model, _factory_at(task, spec.lr), knobs, replicas=task.plain_replicas,
                            controller=False, sync_every=task.sync_every, seed=spec.seed)
        out = _drive(task, spec, engine, None, "interval", scale=spec.lr)
        out["history"] = []
        return out
    model = task.model(spec.seed)
    opt = task.optimizer(model)
    values = task.set_fixed(model, opt)
    f = task.schedule()
    gen = torch.Generator().manual_seed(10_000 + spec.seed)
    curve, train = [], []
    points = _eval_points(task)
    diverged, acc_loss, acc_n = False, 0.0, 0
    for t in range(task.steps):
        for g in opt.param_groups:
            g["lr"] = spec.lr * f(t)
        batch = task.sample(gen, task.batch)
        opt.zero_grad(set_to_none=True)
        loss = task.loss(model, batch, values)
        if not torch.isfinite(loss):
            diverged = True
            break
        loss.backward()
        opt.step()
        acc_loss += float(loss.detach())
        acc_n += 1
        if (t + 1) % task.sync_every == 0:
            train.append((t + 1, acc_loss / acc_n))
            acc_loss, acc_n = 0.0, 0
        if t + 1 in points:
            ev = task.evaluate(model)
            curve.append({"step": t + 1, **ev})
    if diverged or (curve and not _finite(curve[-1]["loss"])):
        diverged = True
        curve.append({"step": task.steps, "loss": math.nan, "acc": math.nan})
    return {"curve": curve, "train": train, "diverged": diverged, "history": [],
            "end_lr": {"lr": spec.lr}, "train_samples": task.steps * task.batch, "signal_samples": 0}


# ----------------------------------------------------------------------------- hpx


@torch.no_grad()
def consensus_copy(engine: hpx.Engine) -> torch.nn.Module:
    """A copy of replica 0's model holding the mean of every replica's floating state."""
    model = copy.deepcopy(engine.replicas[0].model)
    states = [float_state(r.model) for r in engine.replicas]
    for i, t in enumerate(float_state(model)):
        t.copy_(torch.stack([s[i] for s in states]).mean(0))
    return model


def paper_knobs(task: Task, lr: float, knobs: list) -> tuple[list, dict[str, Any]]:
    """The paper-faithful controller: hpx.schedule.OneCyclePlan(rule="paper") when the library
    has it (OneCycle with a 10% warm-up like the other runs, momentum not cycled so the optimizer
    matches them; the controller takes over at the peak with the linear rule, sigma 0.1,
    lambda 0.5, beta 0.9, and gamma decaying the base to OneCycle's floor). Otherwise the same
    rule by engine settings: warm-up then flat schedule, decay gamma to 1% of the peak."""
    lr_names = [k.name for k in knobs if isinstance(k, hpx.LearningRate)]
    others = [k for k in knobs if not isinstance(k, hpx.LearningRate)]
    steps, T = task.steps, task.sync_every
    try:
        from hpx.schedule import OneCyclePlan, OneCycleShape
    except ImportError:  # pragma: no cover - older hpx
        OneCyclePlan = None
    if OneCyclePlan is not None:
        shape = OneCycleShape.from_args(n_groups=len(lr_names), max_lr=lr, total_steps=steps, pct_start=0.1,
                                        cycle_momentum=False)
        labels = tuple(n.split("/", 1)[1] if "/" in n else n for n in lr_names)
        plan = OneCyclePlan(shape, spread=LR_SPREAD, rule="paper", sync_every=T, labels=labels)
        pk = plan.knobs()
        names = {k.name for k in pk}
        if names != {f"lr/{s}" for s in labels}:
            raise RuntimeError(f"unexpected OneCyclePlan knobs {sorted(names)}")
        # OneCyclePlan names group g's knob lr/<label>; keep the task's own names
        for k, n in zip(pk, lr_names):
            k.name = n
        return pk + others, plan.settings()
    warm = round(0.1 * steps)
    flat = warmup_flat(steps)
    for k in knobs:
        if isinstance(k, hpx.LearningRate):
            k.schedule = flat
    syncs_after = max(1, (steps - warm) // T)
    return knobs, dict(space="linear", temperature=0.1, warmup=warm, decay=1 - 0.01 ** (1 / syncs_after))


def _factory_at(task: Task, lr: float):
    """The task's optimizer built with ``lr`` as every group's (peak) learning rate."""
    def factory(model):
        opt = task.optimizer(model)
        for g in opt.param_groups:
            g["lr"] = lr
        return opt
    return factory


def _build_autolr(task: Task, spec: RunSpec, model) -> hpx.Engine:
    """The one-run search, as a user would write it: hpx.autolr with the task's schedule and
    probe split, nothing set per task: one model in one process (autolr's default; it scores its
    4 points in turn), or plain training's layout where the task has one (the BatchNorm CNN)."""
    def probe_fn(rep, batch):
        return task.probe_loss(rep.model, batch)

    layout = {"replicas": task.plain_replicas} if task.plain_replicas > 1 else {}
    return hpx.autolr(model, _factory_at(task, spec.lr), total_steps=task.steps, schedule=task.schedule(),
                      probe=task.probe_batches(), loss_fn=probe_fn, seed=spec.seed, **layout)


def _run_hpx(task: Task, spec: RunSpec) -> dict[str, Any]:
    v = VARIANTS[spec.variant]
    model = task.model(spec.seed)
    if v.get("recipe") == "autolr":
        return _drive(task, spec, _build_autolr(task, spec, model), None, "probe", scale=spec.lr)
    paper = v.get("paper", False)
    steps = task.steps
    knobs = task.knobs(spec.lr, LR_SPREAD * v.get("spread", 1.0), task.schedule(), scale=v.get("spread", 1.0))
    signal = build_signal(v.get("signal", "probe"), task)
    settings: dict[str, Any] = dict(replicas=REPLICAS, sync_every=task.sync_every, seed=spec.seed,
                                    average=v.get("average", True), mode=v.get("mode", "shared"))
    if paper:
        knobs, paper_settings = paper_knobs(task, spec.lr, knobs)
        settings.update(paper_settings)
    registry = hpx.Knobs(*knobs, independent=v.get("independent", True))
    settings.update(v.get("engine", {}))
    if "sync_div" in v:
        settings["sync_every"] = max(1, task.sync_every // v["sync_div"])
    # True/False (hpx's controller or none), or an experimental controller object
    settings["controller"] = make_controller(v.get("controller", True), registry, settings, steps)
    if not isinstance(settings["controller"], bool):  # built from hpx's controller settings: the engine
        for key in _CONTROLLER_SETTINGS:                # refuses them beside a controller of one's own
            settings.pop(key, None)
    engine = hpx.Engine(model, task.optimizer, registry, signal=signal, **settings)
    return _drive(task, spec, engine, signal, v.get("signal", "probe"))


def _drive(task: Task, spec: RunSpec, engine: hpx.Engine, signal: Any, signal_kind: str,
           scale: float = 1.0) -> dict[str, Any]:
    """Train ``engine`` for the task's steps; the validation curve, history and costs.
    ``scale`` turns the lr knobs' bases into learning rates (autolr's base is a factor)."""
    steps = task.steps

    def loss_fn(rep, batch):
        return task.loss(rep.model, batch, rep._values)

    gen = torch.Generator().manual_seed(10_000 + spec.seed)
    curve, train = [], []
    points = _eval_points(task)
    observe = getattr(signal, "observe", None)
    diverged = False
    acc = torch.zeros(engine.n_local)
    try:
        for t in range(steps):
            batch = task.sample(gen, task.batch)
            lt = engine.step(loss_fn, batch)
            acc += lt
            if observe is not None:
                observe(engine)
            if engine.step_count % task.sync_every == 0:  # the training-loss curve's points
                train.append((engine.step_count, float(acc.mean()) / task.sync_every))
                acc.zero_()
            if t + 1 in points:
                ev = task.evaluate(consensus_copy(engine))
                curve.append({"step": t + 1, **ev})
        final = engine.converge()
        curve[-1] = {"step": steps, **task.evaluate(final)}
    except hpx.NonFiniteError:
        diverged = True
    if not curve or not _finite(curve[-1]["loss"]):
        diverged = True
        curve.append({"step": steps, "loss": math.nan, "acc": math.nan})
    syncs = len(engine.history)
    return {
        "curve": curve, "train": train, "diverged": diverged,
        "history": [asdict(r) for r in engine.history],
        "end_lr": {k: b * scale if k.startswith("lr") else b for k, b in engine.bases.items()},
        "train_samples": steps * task.batch,
        "signal_samples": syncs * signal_cost(signal_kind, task, REPLICAS),  # autolr: 4 points too
    }
