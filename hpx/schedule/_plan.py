"""OneCycle as knobs: per-step factors, the cycled momentum, and the plan for either rule."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from hpx._onecycle import _ANNEAL, OneCycleShape, ScheduleStepError
from hpx.errors import ConfigError
from hpx.knobs.base import Knob, Setter
from hpx.knobs.optim import LearningRate
from hpx.replica import Replica
from hpx.schedule._util import _is_int, _is_real, _per_group

Rule = Literal["hpx", "paper"]
_RULES = ("hpx", "paper")

# The paper's controller constants (docs/method.md): sigma, lambda, beta.
PAPER_TEMPERATURE = 0.1
PAPER_META_LR = 0.5
PAPER_MOMENTUM = 0.9



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
