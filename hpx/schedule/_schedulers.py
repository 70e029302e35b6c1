"""The drop-in schedulers (OneCycleLR, ExploreLR) and who writes their values: the engine
(N > 1 replicas) or the scheduler itself (one replica)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Literal

import torch
from torch.optim.lr_scheduler import LRScheduler

from hpx._onecycle import OneCycleShape
from hpx.backends.base import Collective
from hpx.errors import ConfigError
from hpx.schedule._dropin import _epoch, _resolve, _Scheduler, _Solo
from hpx.schedule._plan import OneCyclePlan, Rule, _Factor, _hdet_problems
from hpx.schedule._shadow import _scheduler_problems, _Shadow, _shadow_knobs
from hpx.schedule._util import _is_int, _labels, _lrs, _plain, _tuple
from hpx.signals import Signal

# ------------------------------------------------------------------------------------------
# The schedulers


class OneCycleLR(_Scheduler):
    """torch's ``OneCycleLR``, exactly, with HDET exploration around it.

    The positional and keyword arguments up to ``last_epoch`` are torch's, with torch's meaning
    (``max_lr`` one per group or one for all; ``total_steps``, or ``epochs`` and
    ``steps_per_epoch``; ``cycle_momentum`` cycles SGD's ``momentum`` or Adam's ``beta1``). With
    ``spread=0`` or one replica the learning rates and momenta written are torch's own floats.

    Keyword-only, HDET's:

    Args:
        model: this process's model (may be wrapped in DistributedDataParallel), so replicas'
            parameters *and* floating buffers can be averaged. Required when there is more than
            one replica and a spread; without it (and spread 0) this is plain OneCycleLR.
        spread: ``alpha`` in ``[0, 1)``, one for all groups or one per group: replica ``r``'s lr
            is ``rho_r`` times the base, ``rho`` evenly spread over ``[1 - alpha, 1 + alpha]``.
        rule: ``"hpx"`` (learn a multiplicative correction of OneCycle, in log space) or
            ``"paper"`` (the paper's controller replaces the base after ``warmup``); see
            :class:`OneCyclePlan`.
        sync_every: ``T``, steps between syncs (weight averaging, controller, new permutations).
        warmup: steps before the controller acts (averaging and the spread start at once).
            ``None``: 0 for ``"hpx"``, OneCycle's peak for ``"paper"``.
        backend: the :class:`~hpx.backends.Collective`. ``None``: ``TorchDistributed()`` when
            a torch.distributed process group is initialised (one replica per process), else
            one replica.
        signal: what replicas are compared on (default: their training loss over the interval,
            as passed to :meth:`step`).
        **settings: other :class:`~hpx.EngineConfig` settings (``seed``, ``temperature``,
            ``meta_lr``, ``controller``, ``average``, ``mode``, ...). With ``rule="paper"``,
            ``space`` and ``decay`` are the rule's and cannot be given.

    Under torch.distributed with ``mode="shared"`` (the default) wrap the model in
    DistributedDataParallel: the scheduler is stepped after ``optimizer.step()``, too late to
    average gradients itself.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        max_lr: float | list[float],
        total_steps: int | None = None,
        epochs: int | None = None,
        steps_per_epoch: int | None = None,
        pct_start: float = 0.3,
        anneal_strategy: Literal["cos", "linear"] = "cos",
        cycle_momentum: bool = True,
        base_momentum: float | list[float] = 0.85,
        max_momentum: float | list[float] = 0.95,
        div_factor: float = 25.0,
        final_div_factor: float = 1e4,
        three_phase: bool = False,
        last_epoch: int = -1,
        *,
        model: torch.nn.Module | None = None,
        spread: float | Sequence[float] = 0.0,
        rule: Rule = "hpx",
        sync_every: int = 50,
        warmup: int | None = None,
        backend: Collective | None = None,
        signal: Signal | None = None,
        **settings: Any,
    ) -> None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"{type(optimizer).__name__} is not an Optimizer (as torch's OneCycleLR, hpx's "
                            "takes the optimizer it schedules: hpx.OneCycleLR(optimizer, max_lr=..., "
                            "total_steps=...))")
        self.optimizer = optimizer
        n_groups = len(optimizer.param_groups)
        # torch takes tensors here too and copies them (a later in-place change must not move
        # the schedule): read once as numbers
        max_lr, base_momentum, max_momentum = (_plain_each(v) for v in (max_lr, base_momentum, max_momentum))
        problems: list[str] = []
        shape = None
        try:
            shape = OneCycleShape.from_args(
                n_groups, max_lr, total_steps=total_steps, epochs=epochs, steps_per_epoch=steps_per_epoch,
                pct_start=pct_start, anneal_strategy=anneal_strategy, cycle_momentum=cycle_momentum,
                base_momentum=base_momentum, max_momentum=max_momentum, div_factor=div_factor,
                final_div_factor=final_div_factor, three_phase=three_phase)
        except ConfigError as e:
            problems += e.problems
        if not (_is_int(last_epoch) and last_epoch >= -1):
            problems.append(f"last_epoch must be an integer >= -1 (got {last_epoch!r})")
        defaults = optimizer.defaults
        if cycle_momentum is True and "momentum" not in defaults and "betas" not in defaults:
            problems.append(f"cycle_momentum=True needs an optimizer with momentum or betas "
                            f"({type(optimizer).__name__} has neither); pass cycle_momentum=False")
        problems += _hdet_problems(spread, rule, sync_every, warmup, n_groups)
        plan = None
        if not problems:
            assert shape is not None
            try:
                plan = OneCyclePlan(shape, spread=_tuple(spread), rule=rule, sync_every=sync_every,
                                    warmup=warmup, labels=_labels(optimizer))
            except ConfigError as e:
                problems += e.problems
        own = plan.settings() if plan is not None else {}
        config, backend, more = _resolve(self, settings, own, rule=rule, model=model, spread=spread,
                                         backend=backend)
        ConfigError.check(problems + more)
        assert plan is not None and shape is not None and config is not None and backend is not None
        start = last_epoch + 1
        plan.check_step(start)  # torch's "Tried to step ..." error, as its constructor raises it

        if last_epoch == -1:  # as torch: record the cycle's anchors in the groups
            for g, group in enumerate(optimizer.param_groups):
                group["initial_lr"] = shape.initial_lr(g)
                group["max_lr"] = shape.max_lrs[g]
                group["min_lr"] = shape.min_lr(g)
                bounds = shape.momentum_bounds(g)
                if bounds is not None:
                    group["base_momentum"], group["max_momentum"] = bounds
        self.plan = plan
        self.total_steps = shape.total_steps
        self.cycle_momentum = shape.cycle_momentum
        self.use_beta1 = "betas" in optimizer.defaults
        self.base_lrs = [g.get("initial_lr", shape.initial_lr(i))
                         for i, g in enumerate(optimizer.param_groups)]
        self.last_epoch = start
        self._anchors = self._anchors_of(shape)
        self._hdet = {"rule": rule, "sync_every": plan.sync_every, "warmup": plan.warmup,
                      "spread": plan.spread}
        self._start(optimizer, plan.knobs(), config, model=model, backend=backend, signal=signal,
                    spread=spread, start=start)
        if last_epoch != -1:  # resuming: torch reads the anchors the restored groups hold
            self._follow_groups()
            if isinstance(self._driver, _Solo):
                self._driver.write()
            self._last_lr = _lrs(optimizer)
            optimizer._hpx_wrote = self._last_lr  # type: ignore[attr-defined]

    @property
    def shape(self) -> OneCycleShape:
        """The OneCycle schedule (a value: ask it for any group's lr or momentum at any step)."""
        return self.plan.shape

    def _before_step(self, epoch: float | None) -> None:
        self._follow_groups()
        # torch's error, before anything has moved
        self.plan.check_step(self.last_epoch + 1 if epoch is None else epoch)
        if epoch is not None:
            self._driver.jump(epoch)

    def _refused_step(self, epoch: float | None) -> None:
        self.last_epoch = self.last_epoch + 1 if epoch is None else epoch

    def _after_step(self) -> None:
        self.last_epoch = self._driver.step_count

    def _follow_groups(self) -> None:
        """Read the cycle's anchors from the param groups, as torch's OneCycleLR does at every step:
        a group's ``max_lr`` edited by hand, a scheduler rebuilt with ``last_epoch`` on restored
        groups, or a state loaded into a scheduler built with other arguments all follow the
        groups. Groups without the entries (a fresh optimizer) keep the constructor's values."""
        groups = self.optimizer.param_groups
        try:
            lr = tuple((_plain(g["initial_lr"]), _plain(g["max_lr"]), _plain(g["min_lr"])) for g in groups)
            mom = (tuple((_plain(g["base_momentum"]), _plain(g["max_momentum"])) for g in groups)
                   if self.cycle_momentum else None)
        except KeyError:
            return
        if (lr, mom) == self._anchors:
            return
        shape = self.plan.shape
        shape = dataclasses.replace(
            shape, max_lrs=tuple(a[1] for a in lr), initial_lrs=tuple(a[0] for a in lr),
            min_lrs=tuple(a[2] for a in lr),
            base_momentum=tuple(m[0] for m in mom) if mom else shape.base_momentum,
            max_momentum=tuple(m[1] for m in mom) if mom else shape.max_momentum)
        self._use_shape(shape)

    def _anchors_of(self, shape: OneCycleShape) -> tuple[Any, Any]:
        n = shape.n_groups
        lr = tuple((shape.initial_lr(g), shape.max_lrs[g], shape.min_lr(g)) for g in range(n))
        mom = tuple(shape.momentum_bounds(g) for g in range(n)) if shape.cycle_momentum else None
        return lr, mom

    def _own_state(self) -> dict[str, Any]:
        s = self.plan.shape
        return {
            "total_steps": s.total_steps,
            "schedule": {
                "max_lrs": list(s.max_lrs), "total_steps": s.total_steps, "pct_start": s.pct_start,
                "anneal_strategy": s.anneal_strategy, "cycle_momentum": s.cycle_momentum,
                "base_momentum": s.base_momentum, "max_momentum": s.max_momentum,
                "div_factor": s.div_factor, "final_div_factor": s.final_div_factor,
                "three_phase": s.three_phase,
            },
        }

    def _adopt(self, state: dict[str, Any]) -> None:
        """Take a state_dict of torch's ``OneCycleLR``: the run continues at its step, on this
        scheduler's schedule (which must have the same length), exploring from there."""
        if "total_steps" not in state or "last_epoch" not in state:
            super()._adopt(state)
        if state["total_steps"] != self.total_steps:
            raise ConfigError([f"the torch OneCycleLR state has total_steps={state['total_steps']}, this "
                               f"scheduler {self.total_steps}: build it with the same schedule arguments"])
        self.plan.check_step(int(state["last_epoch"]))
        self._continue_at(int(state["last_epoch"]), state)

    def _load_own_state(self, state: dict[str, Any]) -> None:
        sch = dict(state["schedule"])
        sch["max_lrs"] = tuple(sch["max_lrs"])
        self._use_shape(OneCycleShape(**sch))
        self._follow_groups()  # as torch: the anchors are the groups' (this scheduler's constructor's)

    def _use_shape(self, shape: OneCycleShape) -> None:
        """Swap the schedule (the knobs hold the plan by reference)."""
        self._anchors = self._anchors_of(shape)
        if shape == self.plan.shape:
            return
        mine = self.plan.shape
        if shape.n_groups != mine.n_groups or shape.cycle_momentum != mine.cycle_momentum:
            raise ConfigError(
                [f"checkpoint's schedule has {shape.n_groups} param group(s) and cycle_momentum="
                 f"{shape.cycle_momentum}; this scheduler {self.plan.shape.n_groups} and "
                 f"{self.plan.shape.cycle_momentum}"])
        p = self.plan
        plan = OneCyclePlan(shape, spread=p.spread, rule=p.rule, sync_every=p.sync_every,
                            warmup=self._hdet["warmup"], labels=p.labels)
        for k in self._driver.knobs if isinstance(self._driver, _Solo) else self._driver.engine.knobs:
            sched = getattr(k, "schedule", None)
            if isinstance(sched, _Factor):
                sched.plan = plan
        if p.rule == "paper":
            own = plan.settings()
            self._driver.config = self._driver.config.model_copy(
                update={"decay": own["decay"], "warmup": own["warmup"]})
        self.plan = plan
        self.total_steps = shape.total_steps
        self.cycle_momentum = shape.cycle_momentum


class ExploreLR(_Scheduler):
    """HDET exploration on top of any torch scheduler: its shape is kept, a correction is learned.

    Group ``g`` of replica ``r`` trains at ``b_g * rho_r * lr_g(t)``, where ``lr_g(t)`` is what
    ``scheduler`` would have written at step ``t`` and ``b_g`` (starting at 1) is the controller's
    multiplicative correction. With ``spread=0`` or one replica the lrs are the scheduler's own
    floats. Cosine, linear warm-up and decay, warmup-stable-decay (SequentialLR), LambdaLR,
    ChainedScheduler, CyclicLR and torch's own OneCycleLR all work; ReduceLROnPlateau does not (it
    follows a metric, not the step). A momentum the scheduler cycles is passed on unchanged.

    The scheduler is copied onto a shadow optimizer and stepped there, so chainable schedulers
    compute from their own previous lr, not from a replica's spread value. Step only the
    ExploreLR afterwards, not the scheduler you wrapped.

    Args:
        scheduler: the torch scheduler, built on the optimizer as usual.
        model, spread, sync_every, warmup, backend, signal, settings: as for :class:`OneCycleLR`
            (``warmup`` defaults to 0; the controller learns in log space by default).
    """

    def __init__(
        self,
        scheduler: LRScheduler,
        *,
        model: torch.nn.Module | None = None,
        spread: float | Sequence[float] = 0.0,
        sync_every: int = 50,
        warmup: int = 0,
        backend: Collective | None = None,
        signal: Signal | None = None,
        **settings: Any,
    ) -> None:
        problems = _scheduler_problems(scheduler)
        n_groups = len(scheduler.optimizer.param_groups) if not problems else None
        problems += _hdet_problems(spread, "hpx", sync_every, warmup, n_groups)
        own = {"sync_every": sync_every, "warmup": warmup} if not problems else {}
        config, backend, more = _resolve(self, settings, own, rule="hpx", model=model, spread=spread,
                                         backend=backend)
        ConfigError.check(problems + more)
        assert config is not None and backend is not None
        self.optimizer = scheduler.optimizer
        # one replica: share the shadow with other ExploreLRs on this optimizer, so they compose
        self._shadow = _Shadow(scheduler, share=not (backend.world_size > 1 and model is not None))
        self.base_lrs = list(getattr(scheduler, "base_lrs", None)  # SequentialLR has none
                             or [g.get("initial_lr", g["lr"]) for g in self.optimizer.param_groups])
        self.last_epoch = _epoch(scheduler)
        self._hdet = {"rule": "hpx", "sync_every": sync_every, "warmup": warmup, "spread": _tuple(spread)}
        knobs = _shadow_knobs(self._shadow, spread, _labels(self.optimizer))
        self._start(self.optimizer, knobs, config, model=model, backend=backend, signal=signal,
                    spread=spread, start=0)

    @property
    def scheduler(self) -> LRScheduler:
        """The copy of the wrapped scheduler that is being stepped (on a shadow optimizer)."""
        return self._shadow.scheduler

    def _before_step(self, epoch: float | None) -> None:
        # Step the wrapped scheduler first: if it refuses (past its end), nothing else has moved.
        if epoch is None:
            self._shadow.advance_to(self._driver.step_count + 1)
        else:
            self._shadow.step_epoch(epoch)

    def _refused_step(self, epoch: float | None) -> None:
        self.last_epoch = _epoch(self._shadow.scheduler)  # what the wrapped scheduler counted

    def _after_step(self) -> None:
        self.last_epoch = _epoch(self._shadow.scheduler)

    def _own_state(self) -> dict[str, Any]:
        return {"scheduler": self._shadow.state_dict()}

    def _load_own_state(self, state: dict[str, Any]) -> None:
        self._shadow.load_state_dict(state["scheduler"])


def _plain_each(value: Any) -> Any:
    """A one-element tensor, or a list of them, as Python numbers (other values unchanged)."""
    if isinstance(value, (list, tuple)):
        return type(value)(_plain(v) for v in value)
    return _plain(value)
