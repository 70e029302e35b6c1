"""Drop-in learning-rate schedulers that run HDET: an exact OneCycleLR, and exploration on top
of any torch scheduler.

Two schedulers, both torch ``LRScheduler`` subclasses, stepped once per optimizer step with the
step's loss::

    sched = hpx.OneCycleLR(opt, max_lr=0.1, total_steps=10_000,            # torch's arguments
                           model=model, spread=0.2, sync_every=100)       # HDET's, keyword-only
    sched = hpx.ExploreLR(torch.optim.lr_scheduler.CosineAnnealingLR(opt, 10_000),
                          model=model, spread=0.2, sync_every=100)
    ...
    loss.backward(); opt.step(); sched.step(loss)

How the numbers come about (the paper's symbols, mapped in docs/method.md). Every parameter group ``g`` is one
:class:`~hpx.LearningRate` knob with base ``b_g`` and schedule ``f_g``; replica ``r`` trains at

    lr_r,g(t) = b_g * rho_pi(r) * f_g(t)

* ``rule="hpx"`` (the default): ``f_g(t)`` is the user's schedule itself (OneCycle's lr, or the
  wrapped scheduler's) and ``b_g`` starts at exactly 1: the controller learns a multiplicative
  *correction* of the schedule, in log space, so the schedule's shape is kept. With a zero
  spread (or one replica) ``b_g = rho = 1`` and the written lr is the schedule's own float, bit
  for bit.
* ``rule="paper"`` (OneCycleLR only): the paper's controller. Until the handover ``H`` (the
  first sync at or after ``warmup``) the lr follows OneCycle; from ``H`` on the controller's
  linear rule *replaces* the base, ``lr_base <- lr_m (1 - gamma) + lambda v`` at every sync, with
  ``gamma`` chosen so that the base decays from OneCycle's lr at ``H`` to OneCycle's floor
  ``min_lr`` by ``total_steps``. See :class:`OneCyclePlan` for how ``b`` and ``f`` are set so
  that nothing jumps at ``H`` and the lr decays smoothly between syncs.

OneCycle's momentum (SGD ``momentum`` or Adam ``beta1``) keeps cycling exactly as torch cycles
it, under either rule; it is written every step by a knob that does not explore.

Who runs the method. With more than one replica (one per process under torch.distributed) and
a ``model``, an :class:`~hpx.Engine` does: it writes the values, averages parameters and
floating buffers every ``sync_every`` steps and moves the bases. With one replica there is
nothing to compare or average, and the scheduler writes the same numbers itself, without the
engine (and without its collectives, host reads or NaN checks): it is then plain OneCycleLR.

For ``N`` replicas inside one process, use :class:`~hpx.Engine` directly with the knobs of
:class:`OneCyclePlan` or :func:`explore_knobs`: the schedulers drive one optimizer.
"""

from __future__ import annotations

import copy
import math
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from numbers import Integral, Real
from typing import Any, Literal

import torch
from torch.optim.lr_scheduler import LRScheduler, ReduceLROnPlateau

from hpx._onecycle import _ANNEAL, OneCycleShape, ScheduleStepError
from hpx.backends.base import Collective
from hpx.backends.local import InProcess
from hpx.config import EngineConfig
from hpx.engine import Engine
from hpx.errors import BackendError, ConfigError
from hpx.knobs.base import Knob, Setter
from hpx.knobs.optim import LearningRate
from hpx.registry import Knobs
from hpx.replica import Replica
from hpx.signals import LossFn, Signal

__all__ = ["ExploreLR", "OneCycleLR", "OneCyclePlan", "OneCycleShape", "Rule", "explore_knobs"]

Rule = Literal["hpx", "paper"]
_RULES = ("hpx", "paper")

# The paper's controller constants (docs/method.md): sigma, lambda, beta.
PAPER_TEMPERATURE = 0.1
PAPER_META_LR = 0.5
PAPER_MOMENTUM = 0.9

# Engine settings a scheduler sets itself (from its own keyword arguments or its rule).
_OWN_SETTINGS = ("replicas", "sync_every", "warmup")
_PAPER_SETTINGS = ("space", "decay")


# ------------------------------------------------------------------------------------------
# OneCycle as per-step factors


class _Curve:
    """One group's OneCycle lr or momentum at any step, for the hot path.

    The same floating-point operations as :meth:`OneCycleShape.lr` / ``.momentum`` (hence as
    torch), with the anchors and phase bounds looked up once instead of at every call. Steps
    outside the schedule, and zero-length phases, are handed to the shape, which raises the
    error torch would.
    """

    __slots__ = ("_anneal", "_group", "_last", "_phases", "_shape", "_what")

    def __init__(self, shape: OneCycleShape, group: int, what: Literal["lr", "momentum"]) -> None:
        if what == "lr":
            anchors = {"initial": shape.initial_lr(group), "max": shape.max_lrs[group],
                       "min": shape.min_lr(group)}
        else:
            bounds = shape.momentum_bounds(group)
            assert bounds is not None, "momentum curve of a shape that does not cycle momentum"
            anchors = {"base": bounds[0], "max": bounds[1]}
        phases, start = [], 0.0
        n = len(shape._phases)
        for i, ph in enumerate(shape._phases):
            frm, to = (ph.lr_from, ph.lr_to) if what == "lr" else (ph.momentum_from, ph.momentum_to)
            phases.append((start, ph.end_step, anchors[frm], anchors[to], i == n - 1))
            start = ph.end_step
        self._phases = tuple(phases)
        self._anneal = _ANNEAL[shape.anneal_strategy]
        self._last = shape.total_steps
        self._shape, self._group, self._what = shape, group, what

    def __call__(self, step: int) -> float:
        if 0 <= step <= self._last:
            for start, end, a, b, last in self._phases:
                if step <= end or last:
                    span = end - start
                    if span:
                        return self._anneal(a, b, (step - start) / span)
                    break
        # Out of range or a zero-length phase: the shape raises torch's error.
        value = getattr(self._shape, self._what)(self._group, step)
        return 0.0 if value is None else value


class _PaperFactor:
    """``f_g(t)`` of the paper's rule: OneCycle up to the handover, then a per-step geometric decay
    that restarts at every sync (the controller moves the base at syncs)."""

    __slots__ = ("b0", "curve", "handover", "q", "sync_every")

    def __init__(self, curve: _Curve, b0: float, handover: int, q: float, sync_every: int) -> None:
        self.curve, self.b0, self.handover, self.q, self.sync_every = curve, b0, handover, q, sync_every

    def __call__(self, step: int) -> float:
        if step < self.handover:
            return self.curve(step) / self.b0
        if step > self.curve._last:
            return self.curve(step)  # raises like torch
        return self.q ** ((step % self.sync_every) / self.sync_every)


class _Factor:
    """A knob's schedule that reads a plan held by reference, so a scheduler can swap the plan
    (``load_state_dict`` of a differently built scheduler) without rebinding the knob."""

    __slots__ = ("group", "momentum", "plan")

    def __init__(self, plan: OneCyclePlan, group: int, momentum: bool) -> None:
        self.plan, self.group, self.momentum = plan, group, momentum

    def __call__(self, step: int) -> float:
        p = self.plan
        return p._mom[self.group](step) if self.momentum else p._lr[self.group](step)


# ------------------------------------------------------------------------------------------
# Knobs


def _group_index(knob: Knob, replica: Replica) -> int:
    n = len(replica.optimizer.param_groups)
    i = knob.group  # type: ignore[attr-defined]
    if not -n <= i < n:
        raise ConfigError([f"knob {knob.name!r} asks for parameter group {i}, but the optimizer "
                           f"has {n} group(s)"])
    return i % n


class _CycledMomentum(Knob):
    """OneCycle's / CyclicLR's momentum for one group: written every step, never explored.

    Writes ``group["betas"][0]`` when the optimizer has ``betas`` (the Adam family) and
    ``group["momentum"]`` otherwise, as torch's schedulers decide. Its value is ``1 * f(t)``
    exactly (base 1, no spread), so the momentum written is the schedule's float.
    """

    def __init__(self, name: str, *, group: int, schedule: Callable[[int], float]) -> None:
        super().__init__(name, base=1.0, explore=False)
        self.group, self.schedule = group, schedule

    def scale(self, step: int) -> float:
        return float(self.schedule(step))

    @property
    def scheduled(self) -> bool:
        return True

    def bind(self, replica: Replica) -> Setter:
        opt, i = replica.optimizer, _group_index(self, replica)
        if "betas" in opt.defaults:

            def set_beta1(value: float) -> None:
                g = opt.param_groups[i]  # looked up each time: load_state_dict replaces the dicts
                g["betas"] = (value, *g["betas"][1:])

            return set_beta1
        if "momentum" in opt.defaults:

            def set_momentum(value: float) -> None:
                opt.param_groups[i]["momentum"] = value

            return set_momentum
        raise ConfigError(
            [f"cycle_momentum=True needs an optimizer with momentum or betas ({type(opt).__name__} "
             "has neither); pass cycle_momentum=False"]
        )


# ------------------------------------------------------------------------------------------
# The OneCycle plan: knobs and engine settings for either rule


@dataclass(frozen=True)
class OneCyclePlan:
    """HDET over OneCycle: the knobs and engine settings that give ``rule``'s learning rates.

    :class:`OneCycleLR` is built on it; use it directly to run the same schedule on an
    :class:`~hpx.Engine` with several replicas in one process::

        shape = OneCycleShape.from_args(n_groups=1, max_lr=0.1, total_steps=2000)
        plan = OneCyclePlan(shape, spread=0.2, sync_every=50)
        engine = hpx.Engine(model, factory, plan.knobs(), replicas=4, **plan.settings())

    Args:
        shape: the OneCycle schedule, e.g. ``OneCycleShape.from_args(n_groups, max_lr, ...)``
            (re-exported here from ``hpx._onecycle``).
        spread: ``alpha``, one for all groups or one per group, in ``[0, 1)``.
        rule: ``"hpx"`` or ``"paper"`` (see below).
        sync_every: ``T``.
        warmup: steps before the controller acts. ``None``: 0 for ``"hpx"``; for ``"paper"``
            ``int(pct_start * total_steps)``, OneCycle's peak.
        labels: one label per group for the knob names ``lr/<label>``, ``momentum/<label>``
            (default: the group index).

    ``rule="hpx"``: group ``g``'s knob has base ``b = 1`` and schedule ``f(t) =`` OneCycle's lr,
    so ``lr = b * rho * OneCycle(t)``: the controller (log space by default) learns a
    multiplicative correction ``b`` and the shape is kept.

    ``rule="paper"``: ``H = max(1, ceil(warmup / T)) * T`` is the first sync at which the
    controller acts. With ``K = (total_steps - H) / T`` syncs left, ``floor = min_lr / OneCycle(H)``
    and ``gamma = 1 - floor ** (1 / K)`` (a decay, ``0 < gamma < 1``)::

        b(0)  = OneCycle(H) / (1 - gamma)            constant until H (the controller is off)
        f(t)  = OneCycle(t) / b(0)                   t < H:  lr = rho * OneCycle(t)
        f(t)  = (1 - gamma) ** ((t mod T) / T)        t >= H: geometric, 1 at every sync

    At each sync from ``H`` on the engine applies the paper's linear rule, ``b <- b (1 - gamma) +
    lambda v`` (``b`` is then the base lr itself, in lr units), with ``sigma = 0.1``,
    ``lambda = 0.5``, ``beta = 0.9``. With no signal (``v = 0``) this gives
    ``lr(t) = OneCycle(H) (1 - gamma) ** ((t - H) / T)``: continuous at ``H`` (``b(0)`` already
    contains the first sync's decay), never flat between syncs, and equal to OneCycle's
    ``min_lr`` at ``total_steps``. If ``H >= total_steps`` the controller never acts and the plan
    is OneCycle with the spread. hpx keeps two safeguards the paper lacks: a sync moves the base
    by at most the spread, and the base stays positive.
    """

    shape: OneCycleShape
    spread: float | tuple[float, ...] = 0.0
    rule: Rule = "hpx"
    sync_every: int = 50
    warmup: int | None = None
    labels: tuple[str, ...] | None = None
    handover: int = field(init=False)
    """``H``: the step of the first sync at which the controller acts."""
    decay: float = field(init=False)
    """``gamma`` of the paper's rule (0 for ``"hpx"``)."""
    bases: tuple[float, ...] = field(init=False)
    """Each group's starting knob base ``b(0)``."""
    last_step: int = field(init=False)
    """The last step with a value: ``total_steps`` (torch allows one step more than it has
    values for), or one less when the last phase has zero length there."""
    _lr: tuple[Callable[[int], float], ...] = field(init=False, repr=False, compare=False)
    _mom: tuple[_Curve, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        problems = []
        if not isinstance(self.shape, OneCycleShape):
            problems.append(f"shape must be a OneCycleShape (got {type(self.shape).__name__})")
            ConfigError.check(problems)
        n = self.shape.n_groups
        problems += _hdet_problems(self.spread, self.rule, self.sync_every, self.warmup, n)
        if self.labels is not None and (len(self.labels) != n or len(set(self.labels)) != n):
            problems.append(f"labels must be {n} distinct names, one per group (got {self.labels!r})")
        ConfigError.check(problems)

        shape, T = self.shape, int(self.sync_every)
        spreads = _per_group(self.spread, n)
        warmup = self.warmup if self.warmup is not None else (
            int(shape.pct_start * shape.total_steps) if self.rule == "paper" else 0)
        handover = max(1, -(-warmup // T)) * T
        curves = tuple(_Curve(shape, g, "lr") for g in range(n))
        lr: tuple[Callable[[int], float], ...] = curves
        bases = (1.0,) * n
        gamma = 0.0
        live = [g for g in range(n) if shape.max_lrs[g] > 0]
        if self.rule == "paper" and handover < shape.total_steps and live:
            at_h = shape.lr(live[0], handover)
            floor = shape.min_lr(live[0]) / at_h if at_h > 0 else math.inf
            if not 0 < floor < 1:
                raise ConfigError(
                    [f"rule='paper' decays the lr from OneCycle's value at the handover (step "
                     f"{handover}: {at_h:.6g}) to OneCycle's floor min_lr ({shape.min_lr(live[0]):.6g}), "
                     "so it needs the first above the second: lower warmup, or raise div_factor or "
                     "final_div_factor"]
                )
            k = (shape.total_steps - handover) / T
            gamma = min(1.0 - floor ** (1.0 / k), math.nextafter(1.0, 0.0))
            q = 1.0 - gamma
            b0 = tuple(shape.lr(g, handover) / q if g in live else 1.0 for g in range(n))
            lr = tuple(_PaperFactor(curves[g], b0[g], handover, q, T) if g in live else curves[g]
                       for g in range(n))
            bases = b0
        set_field = object.__setattr__  # frozen dataclass: this is its own constructor
        set_field(self, "spread", spreads[0] if len(set(spreads)) == 1 else spreads)
        set_field(self, "sync_every", T)
        set_field(self, "warmup", warmup)
        set_field(self, "handover", handover)
        set_field(self, "decay", gamma)
        set_field(self, "bases", bases)
        try:
            shape.lr(0, shape.total_steps)
            set_field(self, "last_step", shape.total_steps)
        except ScheduleStepError:
            set_field(self, "last_step", shape.total_steps - 1)
        set_field(self, "_lr", lr)
        set_field(self, "_mom", tuple(_Curve(shape, g, "momentum") for g in range(n))
                  if shape.cycle_momentum else ())

    # --- what it gives ----------------------------------------------------------------------

    def lr_factor(self, group: int, step: int) -> float:
        """``f_g(step)``: the lr of ``group`` is ``b_g * rho * lr_factor(group, step)``."""
        return self._lr[group](step)

    def momentum(self, group: int, step: int) -> float | None:
        """OneCycle's momentum (or beta1) of ``group`` at ``step``; None when it is not cycled."""
        return self._mom[group](step) if self._mom else None

    def check_step(self, step: int) -> None:
        """Raise torch's error (a ValueError) if the schedule has no value at ``step``."""
        if step > self.last_step:
            self.shape.lr(0, step)

    def names(self) -> list[str]:
        """The knob names :meth:`knobs` uses, in order."""
        labels = self.labels or tuple(str(g) for g in range(self.shape.n_groups))
        return [f"lr/{s}" for s in labels] + ([f"momentum/{s}" for s in labels] if self._mom else [])

    def knobs(self) -> list[Knob]:
        """Fresh knobs: one :class:`~hpx.LearningRate` per group, then one cycled momentum per
        group if OneCycle cycles momentum. Groups are bound by index."""
        n = self.shape.n_groups
        spreads = _per_group(self.spread, n)
        names = self.names()
        out: list[Knob] = [
            LearningRate(names[g], group=g, base=self.bases[g], spread=spreads[g],
                     schedule=_Factor(self, g, momentum=False),
                     explore=self.shape.max_lrs[g] > 0)  # an lr of 0 has nothing to explore
            for g in range(n)
        ]
        if self._mom:
            out += [_CycledMomentum(names[n + g], group=g, schedule=_Factor(self, g, momentum=True))
                    for g in range(n)]
        return out

    def settings(self) -> dict[str, Any]:
        """Engine settings the rule needs (``sync_every``, ``warmup``; for ``"paper"`` also the
        linear space, the fixed temperature and the decay ``gamma``)."""
        out: dict[str, Any] = {"sync_every": self.sync_every}
        if self.rule == "hpx":
            out["warmup"] = self.warmup
            return out
        takes_over = self.handover < self.shape.total_steps
        out.update(
            warmup=self.handover if takes_over else self.shape.total_steps + 1,
            space="linear", temperature=PAPER_TEMPERATURE, meta_lr=PAPER_META_LR,
            momentum=PAPER_MOMENTUM, debias_momentum=False, decay=self.decay,
        )
        return out


def _hdet_problems(spread: Any, rule: Any, sync_every: Any, warmup: Any, n_groups: int | None) -> list[str]:
    problems = []
    if isinstance(spread, (list, tuple)):
        if n_groups is not None and len(spread) != n_groups:
            problems.append(f"spread must be one number or a list of {n_groups}, one per param group "
                            f"(got {len(spread)} values: {list(spread)!r})")
        for i, s in enumerate(spread):
            if not (_is_real(s) and 0 <= s < 1):
                problems.append(f"spread[{i}] must be a number in [0, 1) (got {s!r})")
    elif not (_is_real(spread) and 0 <= spread < 1):
        problems.append(f"spread must be a number in [0, 1), or a list with one per param group "
                        f"(got {spread!r}); the replicas' lrs lie in [lr (1 - spread), lr (1 + spread)]")
    if rule not in _RULES:
        problems.append(f"rule must be 'hpx' or 'paper' (got {rule!r})")
    if not (_is_int(sync_every) and sync_every >= 1):
        problems.append(f"sync_every must be an integer >= 1 (got {sync_every!r})")
    if warmup is not None and not (_is_int(warmup) and warmup >= 0):
        problems.append(f"warmup must be an integer >= 0 or None (got {warmup!r})")
    return problems


# ------------------------------------------------------------------------------------------
# Any torch scheduler, stepped on a shadow optimizer


class _ShadowOptimizer(torch.optim.Optimizer):
    """Stands in for the user's optimizer under a copy of their scheduler.

    Same ``defaults`` and param-group settings (so schedulers that read ``initial_lr``, ``betas``
    or the current ``lr`` see what they would see), one empty tensor per group instead of the
    parameters, and a ``step`` that does nothing. The schedulers write into its groups; hpx reads
    them. Learning rates are kept as Python floats, so reading them never waits on a device.
    """

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        groups = []
        for g in optimizer.param_groups:
            group = {k: _plain(v) for k, v in g.items() if k != "params"}
            group["params"] = [torch.empty(0)]
            groups.append(group)
        super().__init__(groups, {k: _plain(v) for k, v in optimizer.defaults.items()})
        # What LRScheduler.step checks to warn about calling order: this optimizer is "stepped".
        self._opt_called = True

    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        return None

    step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]


class _Shadow:
    """A copy of the user's scheduler, stepped lazily as the engine's step advances.

    Chainable schedulers (StepLR, ExponentialLR, SequentialLR, ChainedScheduler) compute each lr
    from the previous one, so they must be stepped in order and on an optimizer whose lr is the
    schedule's own, not the replica's spread value: hence the copy on a shadow optimizer.
    """

    def __init__(self, scheduler: LRScheduler) -> None:
        self.optimizer = _ShadowOptimizer(scheduler.optimizer)
        # Deep-copy the scheduler with the user's optimizer replaced by the shadow everywhere
        # (nested schedulers included); nothing of the model or optimizer state is copied.
        self.scheduler: LRScheduler = copy.deepcopy(scheduler, {id(scheduler.optimizer): self.optimizer})
        self.step = 0
        self.use_beta1 = "betas" in self.optimizer.defaults
        self.cycles_momentum = any(getattr(s, "cycle_momentum", False) for s in _walk(scheduler))

    def advance_to(self, step: int) -> None:
        while self.step < step:
            self.scheduler.step()
            self.step += 1
        if step < self.step:
            raise ValueError(f"a wrapped scheduler only moves forward: asked for step {step} at step "
                             f"{self.step}")

    def lr(self, group: int, step: int) -> float:
        self.advance_to(step)
        v = self.optimizer.param_groups[group]["lr"]
        return v if type(v) is float else float(v)

    def momentum(self, group: int, step: int) -> float:
        self.advance_to(step)
        g = self.optimizer.param_groups[group]
        return float(g["betas"][0] if self.use_beta1 else g["momentum"])

    def state_dict(self) -> dict[str, Any]:
        groups = [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups]
        return copy.deepcopy({"step": self.step, "scheduler": self.scheduler.state_dict(),
                              "groups": groups})

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if len(state["groups"]) != len(self.optimizer.param_groups):
            raise ConfigError([f"checkpoint's scheduler has {len(state['groups'])} param groups, this "
                               f"one {len(self.optimizer.param_groups)}"])
        self.scheduler.load_state_dict(copy.deepcopy(state["scheduler"]))
        for g, saved in zip(self.optimizer.param_groups, state["groups"]):
            g.update(copy.deepcopy(saved))
        self.step = int(state["step"])


class _ShadowLR:
    __slots__ = ("group", "shadow")

    def __init__(self, shadow: _Shadow, group: int) -> None:
        self.shadow, self.group = shadow, group

    def __call__(self, step: int) -> float:
        return self.shadow.lr(self.group, step)


class _ShadowMomentum(_ShadowLR):
    __slots__ = ()

    def __call__(self, step: int) -> float:
        return self.shadow.momentum(self.group, step)


def _walk(s: Any) -> Iterator[Any]:
    yield s
    for child in getattr(s, "_schedulers", ()) or ():
        yield from _walk(child)


def _shadow_knobs(shadow: _Shadow, spread: Any, labels: Sequence[str] | None) -> list[Knob]:
    n = len(shadow.optimizer.param_groups)
    labels = list(labels) if labels is not None else [str(g) for g in range(n)]
    spreads = _per_group(spread, n)
    out: list[Knob] = [
        LearningRate(f"lr/{labels[g]}", group=g, base=1.0, spread=spreads[g], schedule=_ShadowLR(shadow, g))
        for g in range(n)
    ]
    if shadow.cycles_momentum:
        out += [_CycledMomentum(f"momentum/{labels[g]}", group=g, schedule=_ShadowMomentum(shadow, g))
                for g in range(n)]
    return out


def explore_knobs(scheduler: LRScheduler, *, spread: float | Sequence[float] = 0.0) -> list[Knob]:
    """Knobs that explore on top of ``scheduler``, for an :class:`~hpx.Engine` of your own.

    One :class:`~hpx.LearningRate` per param group, ``lr = b * rho * scheduler's lr(t)`` with ``b``
    starting at 1 (plus a cycled momentum per group if the scheduler cycles momentum). The
    scheduler is copied onto a shadow optimizer and stepped there as the engine steps; the
    scheduler you pass and its optimizer are left as they are. Build it on an optimizer whose
    param groups match the replicas' (for example replica 0's, or a template)::

        template = torch.optim.SGD(model.parameters(), lr=0.1)
        knobs = hpx.explore_knobs(CosineAnnealingLR(template, T_max=2000), spread=0.2)
        engine = hpx.Engine(model, lambda m: torch.optim.SGD(m.parameters(), lr=0.1), knobs, replicas=4)
    """
    problems = _scheduler_problems(scheduler)
    n = len(scheduler.optimizer.param_groups) if not problems else None
    problems += _hdet_problems(spread, "hpx", 1, None, n)
    ConfigError.check(problems)
    return _shadow_knobs(_Shadow(scheduler), spread, None)


def _scheduler_problems(scheduler: Any) -> list[str]:
    if isinstance(scheduler, _Scheduler):
        return [f"scheduler is already an hpx scheduler ({type(scheduler).__name__}); wrap the torch "
                "scheduler it was built from instead"]
    if isinstance(scheduler, ReduceLROnPlateau):
        return ["scheduler must be a step-driven LRScheduler; ReduceLROnPlateau follows a metric, "
                "so it has no schedule to explore around"]
    if not isinstance(scheduler, LRScheduler):
        return [f"scheduler must be a torch.optim.lr_scheduler.LRScheduler (got {type(scheduler).__name__})"]
    return []


# ------------------------------------------------------------------------------------------
# Who writes the values: the engine (N > 1), or the scheduler itself (one replica)


class _Solo:
    """One replica: nothing to compare or average.

    Writes each knob's ``b * f(t)`` (what the engine writes with ``N = 1``, where ``rho = 1``) and
    applies the controller's deterministic part at syncs (with one replica ``D = 0``, so a sync
    only multiplies the bases by ``1 - decay``).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, knobs: Knobs, config: EngineConfig, start: int):
        self.knobs, self.config = knobs, config
        rep = Replica(0, torch.nn.Module(), optimizer)
        for k in knobs:
            k.resolve_base(rep)
        self._pairs = [(k, k.bind(rep)) for k in knobs]
        self.step_count = start
        self.write()

    def write(self) -> None:
        t = self.step_count
        for k, setter in self._pairs:
            setter(k.base * k.scale(t))

    def advance(self, loss: Any = None, batch: Any = None, loss_fn: LossFn | None = None) -> None:
        self.step_count += 1
        cfg = self.config
        if (cfg.decay and cfg.controller and self.step_count % cfg.sync_every == 0
                and self.step_count >= cfg.warmup):
            for k, _ in self._pairs:
                if k.explore and k.kind == "mul":
                    k.base = k.clamp(k.base * (1 - cfg.decay))
        self.write()

    def state_dict(self) -> dict[str, Any]:
        return {"format": 1, "n_replicas": 1, "step": self.step_count, "knobs": self.knobs.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # Any hpx state will do (an engine's too): one replica needs only the step and the bases.
        self.knobs.load_state_dict(state["knobs"])
        self.step_count = int(state["step"])
        self.write()


class _Driven:
    """An :class:`~hpx.Engine` with one local replica: the user's model and optimizer."""

    def __init__(self, engine: Engine, start: int) -> None:
        self.engine = engine
        if start:  # resuming torch-style (last_epoch): syncs stay on multiples of sync_every
            state = {**engine.state_dict(), "step": start}
            del state["next_sync"]
            self._load(state)

    @property
    def step_count(self) -> int:
        return self.engine.step_count

    @property
    def config(self) -> EngineConfig:
        return self.engine.config

    @config.setter
    def config(self, value: EngineConfig) -> None:
        self.engine.config = value

    def advance(self, loss: Any = None, batch: Any = None, loss_fn: LossFn | None = None) -> None:
        if loss is not None:
            self.engine.record(loss if torch.is_tensor(loss) else torch.tensor(float(loss)))
        self.engine.advance(batch=batch, loss_fn=loss_fn)

    def state_dict(self) -> dict[str, Any]:
        state = self.engine.state_dict()
        del state["replicas"]  # the model and optimizer are the user's to save (torch's contract)
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "slots" not in state:
            raise ConfigError([f"this checkpoint was saved with {state.get('n_replicas', 1)} replica(s) "
                               f"and no engine; this scheduler runs {self.engine.n_replicas} replicas"])
        state = dict(state)
        e = self.engine
        first = e.collective.rank * e.n_local
        if state.get("first") != first:
            # Saved on another rank: bases, controller and permutations are the same on every rank,
            # but the interval's loss sum is that rank's own, so this rank's interval restarts.
            state.update(first=first, acc=torch.zeros(e.n_local), acc_n=[0] * e.n_local)
        self._load(state)

    def _load(self, state: dict[str, Any]) -> None:
        state = dict(state)
        state.pop("replicas", None)  # hpx's own state only: the model and optimizer stay the user's
        self.engine.load_state_dict(state)


# ------------------------------------------------------------------------------------------
# The schedulers


class _Scheduler(LRScheduler):
    """What :class:`OneCycleLR` and :class:`ExploreLR` share: the driver, ``step(loss)``,
    ``get_last_lr`` and checkpoints. Not constructed directly."""

    optimizer: torch.optim.Optimizer
    _driver: _Solo | _Driven

    def _start(
        self,
        optimizer: torch.optim.Optimizer,
        knobs: list[Knob],
        config: EngineConfig,
        *,
        model: torch.nn.Module | None,
        backend: Collective,
        signal: Signal | None,
        spread: Any,
        start: int,
    ) -> None:
        n = backend.world_size
        if n > 1 and model is not None:
            engine = Engine(model, optimizer, Knobs(*knobs), backend=backend, signal=signal, config=config)
            self._driver = _Driven(engine, start)
        else:
            if n == 1 and _any_positive(spread):
                warnings.warn(
                    f"{type(self).__name__}: one replica (no torch.distributed process group with more "
                    f"than one process), so spread={spread!r} has nothing to explore: the learning "
                    "rates are the schedule's own", UserWarning, stacklevel=3)
            self._driver = _Solo(optimizer, Knobs(*knobs, seed=config.seed), config, start)
        self._get_lr_called_within_step = False
        self._is_initial = False
        self._step_count = 1
        self._last_lr = _lrs(self.optimizer)

    # --- torch's scheduler interface ------------------------------------------------------

    def step(self, loss: torch.Tensor | float | None = None, *, batch: Any = None,  # type: ignore[override]
             loss_fn: LossFn | None = None) -> None:
        """Advance one optimizer step: record ``loss``, sync every ``sync_every`` steps, and write
        the next step's learning rates (and momenta) into the optimizer.

        Args:
            loss: this replica's training loss of the step just taken (a tensor stays on its
                device: no host read). Needed when replicas are compared on their training loss
                (the default signal) and the controller acts; otherwise ignored.
            batch, loss_fn: handed to a signal that scores replicas on a batch at the sync
                (:class:`~hpx.SharedBatch`); ``loss_fn(replica, batch)``.
        """
        self._before_step()
        self._driver.advance(loss, batch, loss_fn)
        self._step_count += 1
        self._after_step()
        self._last_lr = _lrs(self.optimizer)

    def get_last_lr(self) -> list[float | torch.Tensor]:
        """The learning rates last written into this process's optimizer, one per param group."""
        return self._last_lr

    def get_lr(self) -> list[float | torch.Tensor]:
        """The learning rates of the current step (this replica's, spread included)."""
        return _lrs(self.optimizer)

    # --- hpx --------------------------------------------------------------------------------

    @property
    def engine(self) -> Engine | None:
        """The engine running HDET, or None with one replica (nothing to average or compare)."""
        return self._driver.engine if isinstance(self._driver, _Driven) else None

    @property
    def n_replicas(self) -> int:
        """``N``, the number of replicas (processes) exploring together."""
        return self.engine.n_replicas if self.engine is not None else 1

    @property
    def bases(self) -> dict[str, float]:
        """Every knob's base ``b``: for ``rule="hpx"`` the learned correction of each group's
        schedule (1 = as scheduled); for ``rule="paper"`` after the handover, the base lr."""
        if isinstance(self._driver, _Driven):
            return self._driver.engine.bases
        return {k.name: k.base for k in self._driver.knobs}

    # --- checkpoints ------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Everything but the optimizer and model (save those yourself, as with any torch
        scheduler): step counters, last lrs, the schedule, and hpx's state (knob bases,
        controller velocity, permutation stream and the current interval's loss sums).

        Under torch.distributed every rank's hpx state is the same except for that interval's
        loss sum, so one rank's file can be loaded on every rank. Save at a sync step
        (``step % sync_every == 0``) for an exact resume: replicas' weights are equal there.
        """
        state = {
            "last_epoch": self.last_epoch,
            "_step_count": self._step_count,
            "base_lrs": list(self.base_lrs),
            "_last_lr": list(self._last_lr),
            "hdet": dict(self._hdet),
            "hpx": self._driver.state_dict(),
        }
        state.update(self._own_state())
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict`, also one from a scheduler built with other schedule
        arguments (the saved schedule replaces this one's, as with torch's schedulers).

        The rule, ``sync_every`` and ``warmup`` must match (they fix when the controller acts).
        Loading writes the restored step's values into the optimizer: load the optimizer's state
        first, then the scheduler's.
        """
        saved = state_dict.get("hdet", {})
        problems = [f"checkpoint was saved with {k}={saved.get(k)!r}, this scheduler has {k}={v!r}"
                    for k, v in self._hdet.items() if k != "spread" and saved.get(k) != v]
        ConfigError.check(problems)
        self._load_own_state(state_dict)
        self._driver.load_state_dict(state_dict["hpx"])
        self.last_epoch = int(state_dict["last_epoch"])
        self._step_count = int(state_dict["_step_count"])
        self.base_lrs = list(state_dict["base_lrs"])
        self._last_lr = list(state_dict["_last_lr"])

    # --- what subclasses provide ------------------------------------------------------------

    _hdet: dict[str, Any]

    def _before_step(self) -> None:
        raise NotImplementedError

    def _after_step(self) -> None:
        raise NotImplementedError

    def _own_state(self) -> dict[str, Any]:
        raise NotImplementedError

    def _load_own_state(self, state: dict[str, Any]) -> None:
        raise NotImplementedError


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
            raise TypeError(f"{type(optimizer).__name__} is not an Optimizer")
        self.optimizer = optimizer
        n_groups = len(optimizer.param_groups)
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
        self._hdet = {"rule": rule, "sync_every": plan.sync_every, "warmup": plan.warmup,
                      "spread": plan.spread}
        self._start(optimizer, plan.knobs(), config, model=model, backend=backend, signal=signal,
                    spread=spread, start=start)

    @property
    def shape(self) -> OneCycleShape:
        """The OneCycle schedule (a value: ask it for any group's lr or momentum at any step)."""
        return self.plan.shape

    def _before_step(self) -> None:
        self.plan.check_step(self.last_epoch + 1)  # torch's error, before anything has moved

    def _after_step(self) -> None:
        self.last_epoch = self._driver.step_count

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

    def _load_own_state(self, state: dict[str, Any]) -> None:
        sch = dict(state["schedule"])
        sch["max_lrs"] = tuple(sch["max_lrs"])
        shape = OneCycleShape(**sch)
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
        self._shadow = _Shadow(scheduler)
        self.base_lrs = list(getattr(scheduler, "base_lrs", None)  # SequentialLR has none
                             or [g.get("initial_lr", g["lr"]) for g in self.optimizer.param_groups])
        self.last_epoch = scheduler.last_epoch
        self._hdet = {"rule": "hpx", "sync_every": sync_every, "warmup": warmup, "spread": _tuple(spread)}
        knobs = _shadow_knobs(self._shadow, spread, _labels(self.optimizer))
        self._start(self.optimizer, knobs, config, model=model, backend=backend, signal=signal,
                    spread=spread, start=0)

    @property
    def scheduler(self) -> LRScheduler:
        """The copy of the wrapped scheduler that is being stepped (on a shadow optimizer)."""
        return self._shadow.scheduler

    def _before_step(self) -> None:
        # Step the wrapped scheduler first: if it refuses (past its end), nothing else has moved.
        self._shadow.advance_to(self._driver.step_count + 1)

    def _after_step(self) -> None:
        self.last_epoch = self._shadow.scheduler.last_epoch

    def _own_state(self) -> dict[str, Any]:
        return {"scheduler": self._shadow.state_dict()}

    def _load_own_state(self, state: dict[str, Any]) -> None:
        self._shadow.load_state_dict(state["scheduler"])


# ------------------------------------------------------------------------------------------
# Helpers


def _resolve(
    sched: _Scheduler,
    settings: dict[str, Any],
    own: dict[str, Any],
    *,
    rule: Any,
    model: Any,
    spread: Any,
    backend: Collective | None,
) -> tuple[EngineConfig | None, Collective | None, list[str]]:
    """Validate the HDET settings together; return the engine config, the backend and problems."""
    problems: list[str] = []
    name = type(sched).__name__
    for key in _OWN_SETTINGS:
        if key in settings:
            if key == "replicas":
                problems.append(
                    f"replicas is not a setting of {name} (got {settings[key]!r}): it drives one "
                    "optimizer, so one replica per process; for N replicas run N processes under "
                    "torch.distributed, or use hpx.Engine with an optimizer factory")
    if rule == "paper":
        for key in _PAPER_SETTINGS:
            if key in settings:
                problems.append(f"{key} is set by rule='paper' (got {key}={settings[key]!r}); use "
                                "rule='hpx' to choose it")
    if model is not None and not isinstance(model, torch.nn.Module):
        problems.append(f"model must be a torch.nn.Module or None (got {type(model).__name__})")
    config = None
    passed = {k: v for k, v in settings.items()
              if k not in _OWN_SETTINGS + (_PAPER_SETTINGS if rule == "paper" else ())}
    try:
        EngineConfig.build(**passed)  # the user's settings alone, so their problems are listed too
    except ConfigError as e:
        problems += e.problems
    else:
        if own:
            config = EngineConfig.build(**{**own, **passed, "replicas": 1})
    if backend is None and (model is not None or _any_positive(spread)):
        backend = _default_backend()
    elif backend is None:
        backend = InProcess()
    if backend is not None and not isinstance(backend, Collective):
        problems.append(f"backend must implement hpx.backends.Collective (got {type(backend).__name__})")
        return config, None, problems
    n = backend.world_size
    if n > 1 and model is None and _any_positive(spread):
        problems.append(
            f"spread={spread!r} with {n} replicas needs model=...: the replicas' parameters and "
            "buffers are averaged every sync_every steps, which needs the model (pass the one you "
            "train, wrapped in DistributedDataParallel or not)")
    ddp = isinstance(model, torch.nn.parallel.DistributedDataParallel)
    mode = settings.get("mode", "shared")
    if n > 1 and model is not None and not ddp and mode == "shared":
        problems.append(
            f"mode='shared' with {n} processes needs the model wrapped in DistributedDataParallel "
            f"(got a bare {type(model).__name__}): {name} is stepped after optimizer.step(), too "
            "late to average gradients itself; wrap it, or pass mode='independent' for replicas "
            "that train on their own gradients between syncs")
    return config, backend, problems


def _default_backend() -> Collective:
    """``TorchDistributed()`` if a process group is initialised, else one replica in process."""
    from hpx.backends import TorchDistributed  # the module that imports torch.distributed

    try:
        return TorchDistributed()
    except BackendError:
        return InProcess()


def _lrs(optimizer: torch.optim.Optimizer) -> list[float | torch.Tensor]:
    return [g["lr"].clone() if torch.is_tensor(g["lr"]) else g["lr"] for g in optimizer.param_groups]


def _labels(optimizer: torch.optim.Optimizer) -> tuple[str, ...] | None:
    """Knob labels from the groups' ``"name"`` entries if every group has a distinct string name."""
    names = [g.get("name") for g in optimizer.param_groups]
    if all(isinstance(n, str) and n for n in names) and len(set(names)) == len(names):
        return tuple(names)  # type: ignore[arg-type]
    return None


def _per_group(value: Any, n: int) -> tuple[float, ...]:
    return tuple(float(v) for v in value) if isinstance(value, (list, tuple)) else (float(value),) * n


def _tuple(value: Any) -> Any:
    return tuple(value) if isinstance(value, (list, tuple)) else value


def _any_positive(spread: Any) -> bool:
    values = spread if isinstance(spread, (list, tuple)) else [spread]
    return any(_is_real(v) and v > 0 for v in values)


def _plain(value: Any) -> Any:
    """A tensor setting as a Python number (read once, when the shadow is built)."""
    return value.item() if torch.is_tensor(value) and value.numel() == 1 else value


def _is_int(value: Any) -> bool:
    return isinstance(value, Integral) and not isinstance(value, bool)


def _is_real(value: Any) -> bool:
    return isinstance(value, Real) and not isinstance(value, bool) and math.isfinite(value)
