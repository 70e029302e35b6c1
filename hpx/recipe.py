"""The one-run learning-rate search: :func:`autolr` turns a run's model, optimizer and schedule
into an engine whose replicas find the learning rate within the run's own steps (the recommended
search, :class:`hpx.Forks`, trains whole runs beside yours instead: about 3x the steps, and
measured to do less harm; see docs/method.md).

Nothing has to be tuned:

* one :class:`~hpx.LearningRateScale` knob, a factor on every parameter group's learning rate
  (base 1: the lr the optimizer was built with, times your schedule);
* the :class:`~hpx.search.Stretch` strategy: the model trains at the base value; at 40 syncs
  in the first 40% of the run it is scored at 4 points of the run's whole displacement (from the
  parameters it started from) shrunk and stretched by ``1/span .. span`` (one after the other,
  or spread over the processes under torch.distributed), and the base moves toward
  the best-scoring scale (a shrink only by what it exceeds a dead zone of 0.2 in ``log rho``: the
  reading drifts down as a run goes on, at any learning rate; in the first 10% of the run only
  down); until 90% of the run the
  syncs go on and act only on shrinks (a learning rate that became too high, or overfitting);
  then the run continues as plain data-parallel training at the value found;
* points scored on held-out batches you give (``probe``), or else on the sync step's own
  training batch (:class:`~hpx.SharedBatch`; one batch among the thousands the displacement
  was made of, so the bias toward the stretched side is small, but its noise is larger:
  give a probe).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence, Sized
from numbers import Integral
from typing import Any, Union

import torch
from torch.optim.lr_scheduler import LRScheduler

from hpx import _checks
from hpx.backends.base import Collective
from hpx.engine import Engine, OptimizerFactory
from hpx.errors import ConfigError
from hpx.knobs.base import Knob
from hpx.knobs.optim import LearningRateScale
from hpx.registry import Knobs
from hpx.schedule._shadow import read_schedule
from hpx.search.stretch import Stretch
from hpx.signals import LossFn, ProbeStream, SharedBatch, _one_batch_problems

__all__ = ["autolr"]

# Settings that belong to the HDET controller; autolr's strategy has its own.
_PROBE_BATCHES = 4  # held-out batches scored per sync, at most

_CONTROLLER_SETTINGS = ("controller", "warmup", "meta_lr", "momentum", "debias_momentum", "temperature",
                        "temperature_scale", "space", "decay", "sync_every")


def autolr(
    model: torch.nn.Module,
    optimizer: Union[OptimizerFactory, torch.optim.Optimizer],
    *,
    total_steps: int,
    schedule: Callable[[int], float] | LRScheduler | None = None,
    probe: Iterable[Any] | None = None,
    loss_fn: LossFn | None = None,
    knobs: Sequence[Knob] = (),
    replicas: int | None = None,
    backend: Collective | None = None,
    span: float = 1.5,
    **settings: Any,
) -> Engine:
    """An :class:`~hpx.Engine` that finds the learning rate while it trains.

    Build the optimizer with the learning rate you would have used; the search moves it in the
    first 40% of the run and the rest of the run trains at the value found::

        engine = hpx.autolr(model, torch.optim.AdamW(model.parameters(), lr=3e-4),
                            total_steps=10_000, schedule=warmup_cosine, probe=val_batches)
        for x, y in loader:
            engine.step(lambda rep, b: F.cross_entropy(rep.model(b[0]), b[1]), (x, y))

    Args:
        model: the model (replica 0 in one process; this rank's replica under torch.distributed,
            wrapped in DistributedDataParallel or not).
        optimizer: the optimizer, built with your learning rates on ``model``'s parameters (a
            ``factory(model) -> Optimizer`` when ``replicas > 1``).
        total_steps: the run's length in optimizer steps. A checkpoint records it (and
            ``span``): resuming with another value is refused. Stepping past it logs one
            warning; the run goes on at the schedule's last value and the learning rate found.
        schedule: the lr's shape over the run: ``f(step) -> factor`` for every group (1 at the
            peak), or a torch ``LRScheduler`` built on an optimizer with the same param groups
            (stepped once on a copy and divided by its peak; every group must follow the same
            shape; its peak learning rates are the ones explored around; a momentum or beta1
            cycle, as OneCycleLR and CyclicLR write one, is followed exactly, not explored;
            a run over 100,000 steps reads it lazily, see ``hpx.schedule._shadow.read_schedule``).
            ``None``: constant.
            Build ``optimizer`` with the *peak* learning rates.
        probe: held-out batches to score replicas on (cycled, up to 4 per sync; a list of a few
            batches of a validation split is enough): an iterable of batches, so one batch is
            given as ``probe=[(x_val, y_val)]``. ``None``: each sync step's training batch.
        loss_fn: ``loss_fn(replica, batch)`` for scoring; default: the loss given to
            :meth:`Engine.step <hpx.Engine.step>`. Give one without regularisers.
        knobs: more knobs, applied at their base: autolr's search moves the learning rate only (to
            search them, give them to :class:`hpx.Forks` or to :class:`hpx.Engine` with a strategy).
        replicas: replicas per process (default 1). Between syncs the replicas are identical
            (they train at the base value), so more of them in one process only split the
            batch: the search scores its 4 points in turn on fewer replicas, at the same cost.
            Give more only for a layout you want (per-replica batch statistics, as plain DDP on
            that many devices would have).
        backend: the :class:`~hpx.backends.Collective` (default: in process).
        span: the search's width: points scored from ``1/span`` to ``span`` times the run's
            displacement; one sync moves the learning rate by at most ``span``.
        **settings: other :class:`~hpx.EngineConfig` settings (``seed``, ``mode``,
            ``history_file``, ``history_limit``, ``bucket_cap_mb``, ``check_consistency``,
            ``warm_init``) and ``on_sync`` (see :class:`~hpx.Engine`).
    """
    problems = []
    if not isinstance(total_steps, Integral) or isinstance(total_steps, bool) or total_steps < 1:
        problems.append(f"total_steps must be an integer >= 1 (got {total_steps!r})")
    taken = [k for k in settings if k in _CONTROLLER_SETTINGS]
    if taken:
        problems.append(f"autolr sets its own search and sync schedule, so it takes no {', '.join(taken)} "
                        "(those are HDET's: use hpx.Engine(..., search=hpx.search.HDET(...)) for that "
                        "controller)")
    if probe is not None and not isinstance(probe, Iterable):
        problems.append(f"probe must be an iterable of batches or None (got {type(probe).__name__})")
    elif probe is not None:
        problems += _one_batch_problems(probe, "probe", "probe=[{batch}]")
    if schedule is not None and not callable(schedule) and not isinstance(schedule, LRScheduler):
        problems.append(f"schedule must be a function step -> factor, a torch LRScheduler or None "
                        f"(got {type(schedule).__name__})")
    knob_problems = _checks.knobs_problems(knobs)
    problems += knob_problems
    if not knob_problems and any(getattr(k, "name", None) == "lr" for k in knobs):
        problems.append("knob name 'lr' is autolr's own learning-rate knob: name yours differently")
    ConfigError.check(problems)
    lrs, followed = None, []
    if isinstance(schedule, LRScheduler):
        other = schedule.optimizer if schedule.optimizer is not optimizer else None
        schedule, lrs, followed = read_schedule(schedule, int(total_steps))
        given = isinstance(optimizer, torch.optim.Optimizer)
        mine = [float(g["lr"]) for g in optimizer.param_groups] if given else None
        if other is not None and mine is not None and lrs is not None and not all(
                math.isclose(a, float(b), rel_tol=1e-6) for a, b in zip(mine, lrs)):
            raise ConfigError([f"schedule is built on another optimizer, whose peak learning rates {lrs} are "
                               f"not optimizer's {mine}: autolr explores around the schedule's; build the "
                               "scheduler on the optimizer you pass"])
    search = Stretch(int(total_steps), span=span)
    if probe is not None:  # a few held-out batches per sync (the whole probe when it is that small)
        n = min(len(probe), _PROBE_BATCHES) if isinstance(probe, Sized) and len(probe) else 1
        signal: Any = ProbeStream(probe, loss_fn=loss_fn, batches=n)
    else:
        signal = SharedBatch(loss_fn=loss_fn)
    registry = Knobs(LearningRateScale("lr", schedule=schedule, lrs=lrs), *followed, *knobs)
    return Engine(model, optimizer, registry, backend=backend, signal=signal, search=search,
                  replicas=1 if replicas is None else replicas, **settings)
