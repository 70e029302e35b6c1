"""A pure, stateless description of ``torch.optim.lr_scheduler.OneCycleLR``'s schedule.

hpx's drop-in OneCycle scheduler must write exactly the numbers torch would write, but it also
has to answer "what lr and momentum does group ``g`` get at step ``t``?" without an optimizer
(to resume, to look ahead, to check ranks agree).  :class:`OneCycleShape` is that answer: a
frozen value holding OneCycleLR's schedule arguments, with methods that evaluate the schedule
at any step using the same floating-point operations, in the same order, as torch.

Step convention (same as torch's ``last_epoch``): constructing ``OneCycleLR`` writes the
step-0 values, and the ``k``-th call to ``scheduler.step()`` writes the step-``k`` values.
Steps ``0 .. total_steps`` are defined (yes, ``total_steps + 1`` of them: torch only refuses
once the step count *exceeds* ``total_steps``); later steps raise :class:`ScheduleStepError`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from numbers import Integral, Real
from typing import Any, Literal, NamedTuple

from hpx.errors import ConfigError, HpxError

__all__ = ["OneCycleShape", "ScheduleStepError"]

AnnealStrategy = Literal["cos", "linear"]
_ANNEAL_STRATEGIES = ("cos", "linear")


class ScheduleStepError(HpxError, ValueError):
    """The schedule has no value at the requested step.

    A ValueError, like the one torch's OneCycleLR raises when stepped too often, so code that
    catches torch's error keeps working.
    """


# --------------------------------------------------------------------------------------------
# Annealing. The arithmetic is written operation-for-operation like torch's (float arithmetic is
# not associative, and we promise identical numbers, not merely close ones).


def _anneal_cos(start: float, end: float, frac: float) -> float:
    """Half a cosine wave from ``start`` (frac=0) to ``end`` (frac=1)."""
    weight = math.cos(math.pi * frac) + 1  # 2 at frac=0, 0 at frac=1
    return end + (start - end) / 2.0 * weight


def _anneal_linear(start: float, end: float, frac: float) -> float:
    """A straight line from ``start`` (frac=0) to ``end`` (frac=1)."""
    return (end - start) * frac + start


_ANNEAL: dict[str, Callable[[float, float, float], float]] = {
    "cos": _anneal_cos,
    "linear": _anneal_linear,
}


class _Phase(NamedTuple):
    """One leg of the cycle: it ends at ``end_step`` (a float, possibly not a whole step).

    ``lr_from``/``lr_to`` name one of "initial", "max", "min"; ``momentum_from``/``momentum_to``
    name one of "base", "max".
    """

    end_step: float
    lr_from: str
    lr_to: str
    momentum_from: str
    momentum_to: str


# --------------------------------------------------------------------------------------------
# Validation helpers. Each appends plain sentences to ``problems`` instead of raising, so that
# one ConfigError can report every problem at once.


def _is_int(value: Any) -> bool:
    return isinstance(value, Integral) and not isinstance(value, bool)


def _is_real(value: Any) -> bool:
    return isinstance(value, Real) and not isinstance(value, bool)


def _check_positive_int(problems: list[str], name: str, value: Any) -> None:
    if not (_is_int(value) and value > 0):
        problems.append(f"{name} must be a positive integer (got {value!r})")


def _check_bool(problems: list[str], name: str, value: Any) -> None:
    if not isinstance(value, bool):
        problems.append(f"{name} must be True or False (got {value!r})")


def _check_number(
    problems: list[str], name: str, value: Any, allowed: str, ok: Callable[[float], bool]
) -> None:
    """Require a finite real number (not a bool) for which ``ok`` holds; ``allowed`` says so."""
    if not (_is_real(value) and math.isfinite(value) and ok(value)):
        problems.append(f"{name} must be {allowed} (got {value!r})")


def _check_per_group(
    problems: list[str],
    name: str,
    value: Any,
    n_groups: int | None,
    allowed: str,
    ok: Callable[[float], bool],
) -> None:
    """Check a setting that is one number for all groups or a list/tuple with one per group.

    ``n_groups`` None means the group count is itself invalid, so the length is not checked.
    """
    if isinstance(value, (list, tuple)):
        if n_groups is not None and len(value) != n_groups:
            problems.append(
                f"{name} must be one number or a list of {n_groups}, one per param group "
                f"(got {len(value)} values: {list(value)!r})"
            )
        for i, item in enumerate(value):
            _check_number(problems, f"{name}[{i}]", item, allowed, ok)
    else:
        _check_number(problems, name, value, allowed, ok)


def _as_per_group(value: Any) -> Any:
    """Freeze a per-group list into a tuple of floats (hashable); leave a scalar as a float."""
    if isinstance(value, (list, tuple)):
        return tuple(float(v) for v in value)
    return float(value) if _is_real(value) else value


def _schedule_problems(
    *,
    max_lr_name: str,
    max_lr: Any,
    n_groups: int | None,
    total_steps: Any,
    pct_start: Any,
    anneal_strategy: Any,
    cycle_momentum: Any,
    base_momentum: Any,
    max_momentum: Any,
    div_factor: Any,
    final_div_factor: Any,
    three_phase: Any,
) -> list[str]:
    """Every problem with a set of schedule arguments (``total_steps`` None: already reported)."""
    problems: list[str] = []
    _check_per_group(
        problems, max_lr_name, max_lr, n_groups, "a finite number >= 0", lambda v: v >= 0
    )
    if total_steps is not None:
        _check_positive_int(problems, "total_steps", total_steps)
    _check_number(problems, "pct_start", pct_start, "in [0, 1]", lambda v: 0 <= v <= 1)
    if not (isinstance(anneal_strategy, str) and anneal_strategy in _ANNEAL_STRATEGIES):
        problems.append(f"anneal_strategy must be 'cos' or 'linear' (got {anneal_strategy!r})")
    _check_bool(problems, "cycle_momentum", cycle_momentum)
    # Like torch, the momentum bounds are ignored (not even checked) when momentum is not cycled,
    # and any finite numbers are accepted (torch's own tests cycle momentum from 1 to 22);
    # base_momentum > max_momentum is allowed, as in torch: the momentum cycle is then inverted.
    if cycle_momentum is True:
        for name, value in (("base_momentum", base_momentum), ("max_momentum", max_momentum)):
            _check_per_group(problems, name, value, n_groups, "a finite number", lambda v: True)
    _check_number(problems, "div_factor", div_factor, "a finite number > 0", lambda v: v > 0)
    _check_number(
        problems, "final_div_factor", final_div_factor, "a finite number > 0", lambda v: v > 0
    )
    _check_bool(problems, "three_phase", three_phase)

    # torch computes the first phase's length as pct_start * total_steps - 1 and divides by it
    # at step 0, so a product of exactly 1 makes OneCycleLR's constructor die with
    # ZeroDivisionError. Refuse it up front, with a sentence saying why.
    steps_ok = total_steps is not None and _is_int(total_steps) and total_steps > 0
    pct_ok = _is_real(pct_start) and 0 <= pct_start <= 1
    if steps_ok and pct_ok and float(pct_start * total_steps) == 1.0:
        problems.append(
            f"pct_start * total_steps must not be exactly 1 (got pct_start={pct_start!r}, "
            f"total_steps={total_steps!r}): the warm-up phase would have zero length, and "
            "torch's OneCycleLR divides by zero at step 0"
        )
    return problems


# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class OneCycleShape:
    """OneCycleLR's schedule as a value: ask it for any group's lr or momentum at any step.

    Fields are OneCycleLR's schedule arguments (see :meth:`from_args` for its exact constructor
    signature). ``max_lrs`` has one entry per param group; ``base_momentum`` and
    ``max_momentum`` are one float for all groups or a tuple with one per group. Every field
    is validated on construction, and all problems are reported in one :class:`ConfigError`.
    ``initial_lrs`` and ``min_lrs`` (None: derived as below) give the anchors explicitly, as torch
    reads them from the param groups when they were edited or built by another scheduler.

    Per group ``g``, three learning rates anchor the cycle::

        initial_lr = max_lrs[g] / div_factor       # where the cycle starts
        max_lr     = max_lrs[g]                    # the peak
        min_lr     = initial_lr / final_div_factor # where it ends

    With ``T = total_steps`` and ``p = pct_start``, the phases end at these (fractional) steps,
    each phase starting where the previous one ended and the first one at step 0::

        two phases (default):   end at p*T - 1        initial_lr -> max_lr,  max_m -> base_m
                                end at T - 1          max_lr -> min_lr,      base_m -> max_m
        three_phase=True:       end at p*T - 1        initial_lr -> max_lr,  max_m -> base_m
                                end at 2*p*T - 2      max_lr -> initial_lr,  base_m -> max_m
                                end at T - 1          initial_lr -> min_lr,  max_m (constant)

    Step ``t`` belongs to the first phase whose end is ``>= t``, or else to the last phase; it
    sits at fraction ``(t - start) / (end - start)`` of that phase, and the value is annealed
    between the phase's endpoints by a half cosine (``"cos"``) or a straight line
    (``"linear"``). Consequences that torch has and so this class has too:

    * ``p*T - 1`` is usually not a whole step, so the peak ``max_lr`` is generally never hit
      exactly, and when ``p*T < 1`` the warm-up is skipped: step 0 is already in phase 2.
    * Phase boundaries can be out of order (three-phase with ``p > 0.5``, or ``p*T < 1``);
      the same rule then gives fractions outside [0, 1], i.e. extrapolated values.
    * Step ``T`` exists and lies past the end of the last phase: with ``"linear"`` its lr
      undershoots ``min_lr`` (possibly below zero) and its momentum overshoots; with ``"cos"``
      the lr turns back up slightly. Step ``T + 1`` and later raise :class:`ScheduleStepError`.
    """

    max_lrs: tuple[float, ...]
    total_steps: int
    pct_start: float = 0.3
    anneal_strategy: AnnealStrategy = "cos"
    cycle_momentum: bool = True
    base_momentum: float | tuple[float, ...] = 0.85
    max_momentum: float | tuple[float, ...] = 0.95
    div_factor: float = 25.0
    final_div_factor: float = 1e4
    three_phase: bool = False
    initial_lrs: tuple[float, ...] | None = None
    min_lrs: tuple[float, ...] | None = None
    _phases: tuple[_Phase, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        problems: list[str] = []
        n_groups = None
        if isinstance(self.max_lrs, (list, tuple)) and len(self.max_lrs) > 0:
            n_groups = len(self.max_lrs)
        else:
            problems.append(
                "max_lrs must be a non-empty tuple with one max lr per param group "
                f"(got {self.max_lrs!r})"
            )
        problems += _schedule_problems(
            max_lr_name="max_lrs",
            max_lr=self.max_lrs if n_groups is not None else (),
            n_groups=n_groups,
            total_steps=self.total_steps,
            pct_start=self.pct_start,
            anneal_strategy=self.anneal_strategy,
            cycle_momentum=self.cycle_momentum,
            base_momentum=self.base_momentum,
            max_momentum=self.max_momentum,
            div_factor=self.div_factor,
            final_div_factor=self.final_div_factor,
            three_phase=self.three_phase,
        )
        for name in ("initial_lrs", "min_lrs"):
            value = getattr(self, name)
            if value is not None:
                if not (isinstance(value, (list, tuple)) and n_groups is not None and len(value) == n_groups):
                    problems.append(f"{name} must be None or one number per param group (got {value!r})")
                else:
                    for i, item in enumerate(value):
                        _check_number(problems, f"{name}[{i}]", item, "a finite number", lambda v: True)
        ConfigError.check(problems)

        # Normalise to plain Python numbers (and tuples, so the value stays hashable). Converting
        # an int pct_start or factor to float changes no result: torch's arithmetic with them
        # promotes to float at the same points.
        set_field = object.__setattr__  # the dataclass is frozen; this is its own constructor
        set_field(self, "max_lrs", tuple(float(v) for v in self.max_lrs))
        set_field(self, "total_steps", int(self.total_steps))
        set_field(self, "pct_start", float(self.pct_start))
        set_field(self, "base_momentum", _as_per_group(self.base_momentum))
        set_field(self, "max_momentum", _as_per_group(self.max_momentum))
        set_field(self, "div_factor", float(self.div_factor))
        set_field(self, "final_div_factor", float(self.final_div_factor))
        # Anchors equal to the derived ones are dropped, so such shapes compare equal to plain ones.
        initial = self.initial_lrs and tuple(float(v) for v in self.initial_lrs)
        derived = tuple(m / self.div_factor for m in self.max_lrs)
        set_field(self, "initial_lrs", initial if initial and initial != derived else None)
        minimum = self.min_lrs and tuple(float(v) for v in self.min_lrs)
        derived = tuple(self.initial_lr(g) / self.final_div_factor for g in range(self.n_groups))
        set_field(self, "min_lrs", minimum if minimum and minimum != derived else None)
        set_field(self, "_phases", self._build_phases())

    def _build_phases(self) -> tuple[_Phase, ...]:
        # Boundaries are computed exactly as torch does (same operations, same order).
        steps, pct = self.total_steps, self.pct_start
        warm_up_end = float(pct * steps) - 1
        last_end = float(steps - 1)
        if self.three_phase:
            return (
                _Phase(warm_up_end, "initial", "max", "max", "base"),
                _Phase(float(2 * pct * steps) - 2, "max", "initial", "base", "max"),
                _Phase(last_end, "initial", "min", "max", "max"),
            )
        return (
            _Phase(warm_up_end, "initial", "max", "max", "base"),
            _Phase(last_end, "max", "min", "base", "max"),
        )

    # ---------------------------------------------------------------- construction from torch args

    @classmethod
    def from_args(
        cls,
        n_groups: int,
        max_lr: float | Sequence[float],
        total_steps: int | None = None,
        epochs: int | None = None,
        steps_per_epoch: int | None = None,
        pct_start: float = 0.3,
        anneal_strategy: AnnealStrategy = "cos",
        cycle_momentum: bool = True,
        base_momentum: float | Sequence[float] = 0.85,
        max_momentum: float | Sequence[float] = 0.95,
        div_factor: float = 25.0,
        final_div_factor: float = 1e4,
        three_phase: bool = False,
    ) -> OneCycleShape:
        """Build the shape from OneCycleLR's constructor arguments, for ``n_groups`` groups.

        As in torch, ``total_steps`` wins when given (``epochs`` and ``steps_per_epoch`` are
        then ignored); otherwise both ``epochs`` and ``steps_per_epoch`` are required and
        ``total_steps = epochs * steps_per_epoch``. ``max_lr`` and the momentum bounds are one
        number for every group, or a list with one per group.

        Raises:
            ConfigError: listing every invalid argument, not only the first.
        """
        problems: list[str] = []
        groups_ok = _is_int(n_groups) and n_groups > 0
        if not groups_ok:
            problems.append(f"n_groups must be a positive integer (got {n_groups!r})")

        steps: Any = total_steps
        if total_steps is None:
            if epochs is not None and steps_per_epoch is not None:
                _check_positive_int(problems, "epochs", epochs)
                _check_positive_int(problems, "steps_per_epoch", steps_per_epoch)
                if all(_is_int(v) and v > 0 for v in (epochs, steps_per_epoch)):
                    steps = int(epochs) * int(steps_per_epoch)
            else:
                if epochs is not None:
                    got = f"epochs={epochs!r} but no steps_per_epoch"
                elif steps_per_epoch is not None:
                    got = f"steps_per_epoch={steps_per_epoch!r} but no epochs"
                else:
                    got = "neither"
                problems.append(f"give total_steps, or both epochs and steps_per_epoch (got {got})")

        problems += _schedule_problems(
            max_lr_name="max_lr",
            max_lr=max_lr,
            n_groups=n_groups if groups_ok else None,
            total_steps=steps,
            pct_start=pct_start,
            anneal_strategy=anneal_strategy,
            cycle_momentum=cycle_momentum,
            base_momentum=base_momentum,
            max_momentum=max_momentum,
            div_factor=div_factor,
            final_div_factor=final_div_factor,
            three_phase=three_phase,
        )
        ConfigError.check(problems)

        if isinstance(max_lr, (list, tuple)):
            max_lrs = tuple(max_lr)
        else:
            max_lrs = (max_lr,) * n_groups
        if not cycle_momentum:
            # torch ignores the momentum bounds then; dropping them makes shapes that differ only
            # in ignored arguments compare equal.
            base_momentum, max_momentum = 0.85, 0.95
        return cls(
            max_lrs=max_lrs,
            total_steps=steps,
            pct_start=pct_start,
            anneal_strategy=anneal_strategy,
            cycle_momentum=cycle_momentum,
            base_momentum=base_momentum,
            max_momentum=max_momentum,
            div_factor=div_factor,
            final_div_factor=final_div_factor,
            three_phase=three_phase,
        )

    # ---------------------------------------------------------------- per-group anchors

    @property
    def n_groups(self) -> int:
        """How many param groups the schedule describes."""
        return len(self.max_lrs)

    @property
    def phase_ends(self) -> tuple[float, ...]:
        """The (fractional) step at which each phase ends; see the class docstring."""
        return tuple(phase.end_step for phase in self._phases)

    def initial_lr(self, group: int) -> float:
        """Where the cycle starts: ``max_lr / div_factor`` (torch's ``group['initial_lr']``), or
        ``initial_lrs[group]`` when the anchors were given (read from the param groups)."""
        if self.initial_lrs is not None:
            return self.initial_lrs[self._group(group)]
        return self.max_lrs[self._group(group)] / self.div_factor

    def min_lr(self, group: int) -> float:
        """Where the cycle ends: ``initial_lr / final_div_factor`` (``group['min_lr']``), or
        ``min_lrs[group]`` when given."""
        if self.min_lrs is not None:
            return self.min_lrs[self._group(group)]
        return self.initial_lr(group) / self.final_div_factor

    def momentum_bounds(self, group: int) -> tuple[float, float] | None:
        """``(base_momentum, max_momentum)`` of ``group``, as torch stores them in the group.

        None when momentum is not cycled: torch then neither reads nor stores them.
        """
        g = self._group(group)
        if not self.cycle_momentum:
            return None
        base, top = self.base_momentum, self.max_momentum
        return (
            base[g] if isinstance(base, tuple) else base,
            top[g] if isinstance(top, tuple) else top,
        )

    # ---------------------------------------------------------------- the schedule

    def lr(self, group: int, step: int) -> float:
        """The learning rate OneCycleLR writes into ``group`` at ``step`` (0 .. total_steps)."""
        g = self._group(group)
        phase, frac = self._locate(step)
        anchors = {
            "initial": self.initial_lr(g),
            "max": self.max_lrs[g],
            "min": self.min_lr(g),
        }
        return _ANNEAL[self.anneal_strategy](anchors[phase.lr_from], anchors[phase.lr_to], frac)

    def momentum(self, group: int, step: int) -> float | None:
        """The momentum OneCycleLR writes into ``group`` at ``step``, or None if it writes none.

        torch writes it to ``group['betas'][0]`` for optimizers with ``betas`` (Adam family)
        and to ``group['momentum']`` otherwise. With ``cycle_momentum=False`` it leaves the
        optimizer's momentum alone, hence None.
        """
        g = self._group(group)
        phase, frac = self._locate(step)
        if not self.cycle_momentum:
            return None
        bounds = self.momentum_bounds(g)
        assert bounds is not None  # cycle_momentum is True
        anchors = {"base": bounds[0], "max": bounds[1]}
        return _ANNEAL[self.anneal_strategy](
            anchors[phase.momentum_from], anchors[phase.momentum_to], frac
        )

    def lrs(self, step: int) -> list[float]:
        """Every group's learning rate at ``step``, in group order."""
        return [self.lr(g, step) for g in range(self.n_groups)]

    def momentums(self, step: int) -> list[float | None]:
        """Every group's momentum at ``step`` (all None when momentum is not cycled)."""
        return [self.momentum(g, step) for g in range(self.n_groups)]

    # ---------------------------------------------------------------- internals

    def _group(self, group: int) -> int:
        if not (_is_int(group) and 0 <= group < self.n_groups):
            raise IndexError(
                f"group must be an integer in [0, {self.n_groups}) for this schedule "
                f"of {self.n_groups} param group(s) (got {group!r})"
            )
        return int(group)

    def _locate(self, step: int) -> tuple[_Phase, float]:
        """The phase ``step`` falls in, and how far into it (0 = start, 1 = end; may overshoot)."""
        if not _is_int(step) or step < 0:
            raise ScheduleStepError(f"step must be an integer >= 0 (got {step!r})")
        if step > self.total_steps:
            # torch's wording, so callers matching on it keep working.
            raise ScheduleStepError(
                f"Tried to step {step} times. The specified number of total steps is "
                f"{self.total_steps} (OneCycle defines steps 0..{self.total_steps} only)"
            )
        start = 0.0
        last = len(self._phases) - 1
        for i, phase in enumerate(self._phases):
            if step <= phase.end_step or i == last:
                span = phase.end_step - start
                if span == 0:
                    # Only reachable at step == total_steps (the step-0 case is refused at
                    # construction); torch raises ZeroDivisionError here.
                    raise ScheduleStepError(
                        f"step {step} falls in a phase of zero length (ending at step "
                        f"{phase.end_step}) with pct_start={self.pct_start!r}, total_steps="
                        f"{self.total_steps}; torch's OneCycleLR divides by zero here"
                    )
                return phase, (step - start) / span
            start = phase.end_step
        raise AssertionError("unreachable: the last phase always matches")
