"""Optuna as a side-by-side route: TPE + successive halving over separate trials, at hpx's budget.

hpx's search (``hpx.Forks``) is compared with the standard tool given the same optimizer steps:
Optuna's TPE sampler proposing values, each trial one full training run at them that reports the
probe loss at rungs, and Optuna's ``SuccessiveHalvingPruner`` stopping the trials that fall behind.
The configuration reproduces an outside audit's:

* ``TPESampler(seed=seed)``; ``SuccessiveHalvingPruner(min_resource=rung, reduction_factor=3)``
  with ``rung = max(1, round(0.1 * steps))``; the study minimises the probe loss at a trial's last
  reported step;
* the start's values are enqueued first, so the first trial is plain training at the start;
* a trial reports the probe loss every ``rung`` steps and at its last step (a non-finite loss
  prunes it, reported as ``inf``);
* the budget: trials run until their optimizer steps together reach ``budget * steps`` (2.9x, what
  ``hpx.Forks`` takes at its defaults); the trial that reaches it is stopped there and pruned (its
  steps count);
* the answer: the completed (full-length) trial with the lowest final probe loss, and the
  validation loss of that trial's own final model (kept in memory); none when no trial completed.

Optuna is a benchmark dependency only: ``pip install -e ".[bench]"``. It is imported when
:func:`search` runs, so the suites import without it.

The caller describes a trial with an *objective builder*: ``objective_builder(values)`` is called
once per trial, right before the trial's first step, with the trial's values (one per name in
``space``), and returns a :class:`Trial`, ``(model, step, probe, evaluate)``:

* ``model``: the trial's model, freshly built at ``values``;
* ``step(i)``: one optimizer step of the trial's run on batch ``i`` (0-based, in order);
* ``probe()``: the current model's probe loss (the held-out split the search scores on, never the
  validation split);
* ``evaluate(model)``: the validation loss of a final model (called once, on the winner's).

The steps of a trial run back to back, so a builder may seed the global RNG (dropout's draws) for
its trial; every trial should draw the same batches and dropout draws, so each is plain training
at its values.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

__all__ = ["LrEngine", "Trial", "knob_range", "lr_method", "search"]


class Trial(NamedTuple):
    """One trial's run, as the objective builder returns it (see the module's docstring)."""

    model: torch.nn.Module
    step: Callable[[int], None]
    probe: Callable[[], float]
    evaluate: Callable[[torch.nn.Module], float]


LR_RANGE = (0.1, 10.0, True)  # the lr, as a multiple of the start's: a decade each side, log scale
MULTIPLICATIVE = ("weight_decay", "temperature")  # searched on a log scale unless the grid holds 0


def knob_range(name: str, grid: tuple[float, ...]) -> tuple[float, float, bool]:
    """A knob's search range ``(low, high, log)`` from its grid of values: ``[0, high]`` linear when
    the grid holds 0, else the grid's range, log scale for a multiplicative knob (weight decay,
    attention temperature) and linear for an additive one (dropout, label smoothing)."""
    lo, hi = min(grid), max(grid)
    if lo <= 0.0:
        return 0.0, hi, False
    return lo, hi, name in MULTIPLICATIVE


def search(objective_builder: Callable[[dict[str, float]], Trial], *, steps: int, start: dict[str, float],
           space: dict[str, tuple[float, float, bool]], budget: float = 2.9, seed: int) -> dict[str, Any]:
    """Optuna's TPE + successive halving over trials of ``steps`` optimizer steps, at most
    ``budget * steps`` steps in all, from ``start`` (enqueued first; its keys are ``space``'s).

    Returns ``{"values", "val", "probe", "model", "steps", "steps_used", "trials", "trial",
    "study"}``: the winner's values, its final model's validation loss (``None`` when it is not
    finite or no trial completed), its final probe loss, its final model, the steps used over
    ``steps`` (the cost, in plain runs), the steps used, the number of trials, the winner's trial
    number, and the study (whose trials' values are each trial's probe loss at its last reported
    step). ``values``, ``probe``, ``model`` and ``trial`` are ``None`` when no trial completed."""
    import optuna

    if set(start) != set(space):
        raise ValueError(f"start's names {sorted(start)} differ from the space's {sorted(space)}")
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    rung = max(1, round(0.1 * steps))
    limit = math.floor(budget * steps + 1e-9)  # the steps of all trials together, counted exactly
    study = optuna.create_study(
        direction="minimize", sampler=optuna.samplers.TPESampler(seed=seed),
        pruner=optuna.pruners.SuccessiveHalvingPruner(min_resource=rung, reduction_factor=3))
    study.enqueue_trial(dict(start))
    used, trials = 0, 0
    best: tuple[float, int, dict[str, float], Trial] | None = None  # loss, number, values, its run
    while used < limit:
        trial = study.ask()
        trials += 1
        values = {name: trial.suggest_float(name, lo, hi, log=log) for name, (lo, hi, log) in space.items()}
        run = objective_builder(values)
        pruned, last, reported = False, math.inf, 0
        for i in range(steps):
            if used >= limit:  # the budget ends inside this trial: stopped at step i, pruned there
                if reported < i:
                    loss = run.probe()
                    trial.report(loss if math.isfinite(loss) else math.inf, i)
                pruned = True
                break
            run.step(i)
            used += 1
            at = i + 1
            if at % rung and at != steps:
                continue
            loss = run.probe()
            reported = at
            if not math.isfinite(loss):
                trial.report(math.inf, at)
                pruned = True
                break
            trial.report(loss, at)
            last = loss
            if at < steps and trial.should_prune():
                pruned = True
                break
        if pruned:
            study.tell(trial, state=optuna.trial.TrialState.PRUNED)
            continue
        study.tell(trial, last)
        if best is None or last < best[0]:
            best = (last, trial.number, values, run)
    out: dict[str, Any] = {"steps": used / steps, "steps_used": used, "trials": trials, "study": study,
                           "values": None, "val": None, "probe": None, "model": None, "trial": None}
    if best is not None:
        last, number, values, run = best
        val = float(run.evaluate(run.model))
        out.update(values=values, probe=last, model=run.model, trial=number,
                   val=val if math.isfinite(val) else None)
    return out


# ----------------------------------------------------------------------------- the lr suite's method


class _Record(NamedTuple):
    """A trial as the lr suite stores a decision (``benchmarks/lr/run.py``'s ``history``): the step
    it ended at, its lr factor, whether it completed or was pruned, its last reported probe loss."""

    step: int | None
    bases: dict[str, float]
    phase: str
    points: None
    scores: list[float]
    searched: bool


class LrEngine:
    """The learning-rate suite's ``"Optuna"`` method (``benchmarks/lr/run.py``'s ``METHODS``), shaped
    as the engine the suite steps: :meth:`step` keeps the run's batches, :meth:`converge` runs the
    search on them (the peak lr only, as a multiple of the start's, 0.1 to 10, log scale) and returns
    the winner's final model (``hpx.NonFiniteError`` when no trial completed, as a diverged run).
    Each trial rebuilds the model, optimizer and scheduler from the task at the run's seed and
    reseeds dropout's draws as the suite's plain run does; the objects handed in are not trained.
    After :meth:`converge`, ``bases["lr"]`` is the winner's factor (1 when none completed),
    ``fork_steps`` the optimizer steps of all trials and ``history`` one record per trial."""

    def __init__(self, task: Any, model: torch.nn.Module, opt: torch.optim.Optimizer, sched: Any, steps: int,
                 seed: int) -> None:
        self.task, self.steps, self.seed = task, steps, seed
        self.lr = float(opt.defaults["lr"])  # the run's peak lr (the optimizer was built at it)
        self.batches: list[Any] = []
        self.factor = 1.0
        self.fork_steps = 0
        self.trials = 0
        self.history: list[_Record] = []

    @property
    def bases(self) -> dict[str, float]:
        return {"lr": self.factor}

    def step(self, loss_fn: Any, batch: Any) -> None:
        """Keep ``batch`` (the trials train with the task's loss, as plain training does)."""
        self.batches.append(batch)

    def converge(self) -> torch.nn.Module:
        import hpx

        task, seed, batches = self.task, self.seed, self.batches
        if len(batches) != self.steps:
            raise ValueError(f"{len(batches)} batches for a run of {self.steps} steps")

        def build(values: dict[str, float]) -> Trial:
            m = task.model(seed)
            o = task.optimizer(m, self.lr * values["lr"])
            s = task.scheduler(o)
            torch.manual_seed(20_000 + seed)  # dropout's draws: as the suite's plain run at this seed
            m.train()

            def step(i: int) -> None:
                loss = task.loss(m, batches[i])
                o.zero_grad(set_to_none=True)
                loss.backward()
                o.step()
                s.step()

            return Trial(m, step, lambda: task.evaluate(m, task.probe()), task.evaluate)

        with torch.random.fork_rng(devices=[]):
            res = search(build, steps=self.steps, start={"lr": 1.0}, space={"lr": LR_RANGE}, seed=seed)
        self.fork_steps, self.trials = res["steps_used"], res["trials"]
        self.history = [_Record(t.last_step, {"lr": t.params["lr"]}, t.state.name.lower(), None,
                                [] if t.value is None else [t.value], True) for t in res["study"].trials]
        if res["model"] is None:
            raise hpx.NonFiniteError("no Optuna trial completed")
        self.factor = float(res["values"]["lr"])
        return res["model"]


def lr_method(task: Any, model: torch.nn.Module, opt: torch.optim.Optimizer, sched: Any, steps: int,
              seed: int) -> LrEngine:
    """``benchmarks/lr/run.py``'s method signature: ``(task, model, opt, sched, steps, seed)``."""
    return LrEngine(task, model, opt, sched, steps, seed)
