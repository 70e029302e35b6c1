"""One run of a suite task: plain training, or a search method, at one peak learning rate and seed.

Plain training is the user's loop: ``loss.backward(); opt.step(); sched.step()``. A method is
built from the same model, optimizer and scheduler objects, as a user would hand them to hpx.
Both draw the same batches in the same order (a generator seeded from the run's seed) and report
the validation loss at the end, the wall time of the training loop, and, for a method, the lr it
ends at (its peak, the number the grid's best is compared with).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F

import hpx
from benchmarks.lr.prototypes import LOOPS, probe_loss, steps_taken
from benchmarks.lr.tasks import Task, get_task
from benchmarks.optuna_route import lr_method
from hpx.search import Stretch

__all__ = ["METHODS", "Run", "execute", "plain_train"]


@dataclass(frozen=True)
class Run:
    """What to run: ``method`` is ``"plain"`` or a name in :data:`METHODS`."""

    task: str
    method: str
    lr: float
    seed: int
    steps: int | None = None  # None: the task's own (a quick smoke run gives fewer)

    @property
    def key(self) -> str:
        s = "" if self.steps is None else f"|{self.steps}"
        return f"{self.task}|{self.method}|{self.lr:.6g}|{self.seed}{s}"


def _autolr(task: Task, model: torch.nn.Module, opt: torch.optim.Optimizer, sched: Any, steps: int,
            seed: int) -> hpx.Engine:
    """hpx.autolr exactly as the README recommends: the optimizer at the peak lr, the task's own
    torch scheduler as ``schedule=``, its probe split, nothing set per task."""
    return hpx.autolr(model, opt, total_steps=steps, schedule=sched, probe=task.probe(),
                      loss_fn=lambda rep, b: task.loss(rep.model, b), seed=seed)


class _TwoSidedZone(Stretch):
    """Experiment: the dead zone on stretches as well as shrinks (the default before it was
    one-sided): a reading moves the base only by what ``|log rho*|`` exceeds ``tau``."""

    def __init__(self, *a: Any, tau: float, **kw: Any) -> None:
        super().__init__(*a, dead_zone=0.0, **kw)
        self.tau = tau

    def _fit(self, z: torch.Tensor, scores: torch.Tensor) -> float | None:
        best = super()._fit(z, scores)
        return None if best is None else math.copysign(max(abs(best) - self.tau, 0.0), best)


def _dead_zone(tau: float) -> Callable[..., hpx.Engine]:
    def build(task: Task, model: torch.nn.Module, opt: torch.optim.Optimizer, sched: Any, steps: int,
              seed: int) -> hpx.Engine:
        engine = _autolr(task, model, opt, sched, steps, seed)
        engine.search = _TwoSidedZone(steps, tau=tau)  # the same settings as the one it replaces
        return engine
    return build


def _sparse(min_gap: int, probe_batches: int) -> Callable[..., hpx.Engine]:
    """Experiment: autolr with syncs at least ``min_gap`` steps apart and ``probe_batches`` probe
    batches scored per sync (the library's are 40 syncs in the window and up to 4 batches)."""
    import hpx.recipe as recipe

    def build(task: Task, model: torch.nn.Module, opt: torch.optim.Optimizer, sched: Any, steps: int,
              seed: int) -> hpx.Engine:
        syncs = max(1, min(40, round(0.4 * steps) // min_gap))
        keep = recipe.Stretch, recipe._PROBE_BATCHES
        recipe.Stretch = lambda n, span: Stretch(n, span=span, syncs=syncs)  # type: ignore[assignment]
        recipe._PROBE_BATCHES = probe_batches
        try:
            return _autolr(task, model, opt, sched, steps, seed)
        finally:
            recipe.Stretch, recipe._PROBE_BATCHES = keep
    return build


# A method: f(task, model, optimizer, scheduler, steps, seed) -> an hpx.Engine to step.
# "autolr" is the library's default (Stretch with a dead zone of 0.2 on shrinks); "deadzone-<tau>" a
# dead zone on both sides ("deadzone-0" is the search without one, as it was before)
def _forks(task: Task, model: torch.nn.Module, opt: torch.optim.Optimizer, sched: Any, steps: int,
           seed: int) -> hpx.Forks:
    """hpx.Forks with its defaults, given what autolr is given: the optimizer at the peak lr, the
    task's own torch scheduler, its probe split."""
    return hpx.Forks(model, opt, total_steps=steps, schedule=sched, probe=task.probe(),
                     loss_fn=lambda rep, b: task.loss(rep.model, b))


def _forks_2x(task: Task, model: torch.nn.Module, opt: torch.optim.Optimizer, sched: Any, steps: int,
              seed: int) -> hpx.Forks:
    """hpx.Forks within 2.0x plain training's steps (docs/method.md, "Half the extra steps"): one cut
    at 5% of the run to your run and the best challenger, the final decision at 54% on annealed
    copies (3% windows), then plain training."""
    return hpx.Forks(model, opt, total_steps=steps, schedule=sched, probe=task.probe(),
                     loss_fn=lambda rep, b: task.loss(rep.model, b), cuts=((0.05, 2), (0.54, 1)), cool=0.03)


METHODS: dict[str, Callable[..., Any]] = {"autolr": _autolr, "Forks": _forks, "Forks-2x": _forks_2x, **{
    f"deadzone-{tau:g}": _dead_zone(tau) for tau in (0.0, 0.1, 0.2, 0.3)},
    "sparse-5-1": _sparse(5, 1),
    # the standard tool at hpx.Forks' budget: Optuna's TPE + successive halving over separate trials
    # of plain training (benchmarks/optuna_route.py; pip install -e ".[bench]")
    "Optuna": lr_method}


def _with_steps(task: Task, steps: int | None) -> Task:
    if steps is None or steps == task.steps:
        return task
    return replace(task, steps=steps)


def plain_train(task: Task, model: torch.nn.Module, opt: torch.optim.Optimizer, sched: Any,
                batches: list[Any], losses: list[torch.Tensor] | None = None) -> torch.nn.Module:
    """The user's loop: backward, optimizer step, scheduler step, one batch at a time (each step's
    training loss appended to ``losses`` when given)."""
    model.train()
    for b in batches:
        loss = task.loss(model, b)
        if losses is not None:
            losses.append(loss.detach())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
    return model


@torch.no_grad()
def _probe(task: Task, model: torch.nn.Module) -> float | None:
    """The mean loss of ``model`` over the task's probe batches, in eval mode as validation is."""
    was = model.training
    model.eval()
    loss = probe_loss(task, model)
    model.train(was)
    return loss if math.isfinite(loss) else None


@torch.no_grad()
def _chunk_losses(task: Task, model: torch.nn.Module, size: int) -> list[float]:
    """``model``'s loss (eval mode) on each disjoint run of rows of the probe holding about
    ``size`` examples (a row of a language model's probe holds one window of tokens)."""
    x = torch.cat([b[0] for b in task.probe()])
    y = torch.cat([b[1] for b in task.probe()])
    per_row = y[0].numel()
    rows = max(1, round(size / per_row))
    was = model.training
    model.eval()
    losses = [float(task.loss(model, (x[i:i + rows], y[i:i + rows])))
              for i in range(0, len(y) - rows + 1, rows)]
    model.train(was)
    return losses


@torch.no_grad()
def _val_halves(task: Task, model: torch.nn.Module) -> list[float]:
    """The validation loss (as :meth:`Task.evaluate` computes it) on the first and the second half of
    the validation rows."""
    x = torch.cat([b[0] for b in task.data()["val"]])
    y = torch.cat([b[1] for b in task.data()["val"]])
    h = len(y) // 2
    return [task.evaluate(model, [(x[:h], y[:h])]), task.evaluate(model, [(x[h:], y[h:])])]


def execute(run: Run, probe_chunks: tuple[int, ...] = (), val_halves: bool = False,
            units: bool = False) -> dict[str, Any]:
    """Train once; ``{"val", "probe", "lost", "seconds", "end_lr", "history"}`` (val is NaN when
    the run diverged; probe, the final weights' loss on the probe split, is None then), and for a
    prototype loop or ``hpx.Forks`` ``"steps"``: its optimizer steps (forks and annealed copies)
    over the task's. For each
    ``k`` in ``probe_chunks``, ``out["chunks"][str(k)]`` holds the final weights' loss on each
    disjoint chunk of the probe of about ``k`` examples (tokens for a language model). With
    ``val_halves``, ``out["val_halves"]`` holds the validation loss on each half of its rows. With
    ``units``, ``out["units"]`` holds the final weights' losses per unit (an example; a sequence's
    mean for a language model), in eval mode, on the probe (``"probe"``) and on a fixed sample of at
    most 2,000 units of the training split (``"train"``), and a plain run's training loss at each step
    in ``out["step_losses"]``.

    The global RNG, which dropout draws from, is seeded from the run's seed (and put back after),
    so a run's result does not depend on the runs its process did before, and a method and plain
    training at the same lr start from the same dropout draws."""
    torch.set_num_threads(1)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(20_000 + run.seed)
        return _execute(run, probe_chunks, val_halves, units)


def _execute(run: Run, probe_chunks: tuple[int, ...], val_halves: bool, units: bool) -> dict[str, Any]:
    task = _with_steps(get_task(run.task), run.steps)
    model = task.model(run.seed)
    opt = task.optimizer(model, run.lr)
    sched = task.scheduler(opt)
    gen = torch.Generator().manual_seed(10_000 + run.seed)
    batches = [task.sample(gen) for _ in range(task.steps)]  # drawn before the clock starts
    out: dict[str, Any] = {"end_lr": run.lr, "history": []}
    t0 = time.perf_counter()
    if run.method == "plain":
        steps: list[torch.Tensor] | None = [] if units else None
        final = plain_train(task, model, opt, sched, batches, steps)
        if steps is not None:
            out["step_losses"] = [float(v) for v in steps]
        seconds = time.perf_counter() - t0
    elif run.method in LOOPS:
        steps_taken(reset=True)
        final, factor = LOOPS[run.method](task, model, opt, sched, batches)
        seconds = time.perf_counter() - t0
        out["end_lr"] = run.lr * factor
        out["steps"] = steps_taken(reset=True) / task.steps  # the run's optimizer steps, in runs
    else:
        engine = METHODS[run.method](task, model, opt, sched, task.steps, run.seed)
        try:
            for b in batches:
                engine.step(lambda rep, bb: task.loss(rep.model, bb), b)
            final = engine.converge()
        except hpx.NonFiniteError:
            final = None
        seconds = time.perf_counter() - t0
        factor = engine.bases.get("lr", 1.0)
        out["end_lr"] = run.lr * factor
        if hasattr(engine, "fork_steps"):  # hpx.Forks' optimizer steps (forks, copies), the Optuna trials'
            out["steps"] = engine.fork_steps / task.steps
        out["history"] = [{"step": r.step, "lr": r.bases.get("lr"), "phase": r.phase,
                           "points": None if r.points is None else list(r.points),
                           "scores": list(r.scores) if r.searched else None}
                          for r in engine.history]
    val = task.evaluate(final) if final is not None else math.nan
    if not math.isfinite(val):
        val = math.nan
    out["probe"] = _probe(task, final) if final is not None and not math.isnan(val) else None
    if val_halves:
        out["val_halves"] = _val_halves(task, final) if out["probe"] is not None else None
    if probe_chunks:
        out["chunks"] = {str(k): _chunk_losses(task, final, k) if out["probe"] is not None else None
                         for k in probe_chunks}
    if units:
        ok = out["probe"] is not None
        out["units"] = ({"probe": _units(task, final, task.probe()),
                         "train": _units(task, final, task.train_sample())} if ok else None)
    out.update(val=val, seconds=seconds,
               lost=not math.isfinite(val) or val >= 0.98 * task.constant_loss())
    return out


@torch.no_grad()
def _units(task: Task, model: torch.nn.Module, batches: Any) -> list[float]:
    """``model``'s loss per unit on ``batches`` (an example; a sequence's mean for a language
    model), in eval mode."""
    was = model.training
    model.eval()
    out: list[float] = []
    for x, y in batches:
        pred = model(x)
        if task.kind == "reg":
            per = (pred.squeeze(-1) - y) ** 2
        else:
            per = F.cross_entropy(pred.reshape(-1, pred.shape[-1]), y.reshape(-1), reduction="none")
            per = per.reshape(y.shape[0], -1).mean(1)
        out += [float(v) for v in per]
    model.train(was)
    return out
