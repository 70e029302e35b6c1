"""Any torch scheduler, stepped on a shadow optimizer: its learning rates and momenta read step by
step, for the knobs that explore on top of it (``ExploreLR``, ``explore_knobs``) and for the
schedule ``hpx.autolr`` scales (:func:`read_schedule`), in one place."""

from __future__ import annotations

import copy
import math
import warnings
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch.optim.lr_scheduler import LRScheduler, ReduceLROnPlateau

from hpx.errors import ConfigError
from hpx.knobs.base import Knob
from hpx.knobs.optim import LearningRate
from hpx.schedule._plan import _CycledMomentum, _hdet_problems
from hpx.schedule._util import _per_group, _plain

# ------------------------------------------------------------------------------------------
# Any torch scheduler, stepped on a shadow optimizer


class _ShadowOptimizer(torch.optim.Optimizer):
    """Stands in for the user's optimizer under a copy of their scheduler.

    Same ``defaults`` and param-group settings (so schedulers that read ``initial_lr``, ``betas``
    or the current ``lr`` see what they would see), one empty tensor per group instead of the
    parameters, and a ``step`` that does nothing. The schedulers write into its groups; hpx reads
    them. Values on a device are kept as Python floats, so reading them never waits on it; CPU
    tensors stay tensors (copies), so the schedule computes in their precision, as torch would.
    """

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        groups = []
        for g in optimizer.param_groups:
            group = {k: _shadow_value(v) for k, v in g.items() if k != "params"}
            group["params"] = [torch.empty(0)]
            groups.append(group)
        super().__init__(groups, {k: _plain(v) for k, v in optimizer.defaults.items()})
        # What LRScheduler.step checks to warn about calling order: this optimizer is "stepped".
        self._opt_called = True

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self._opt_called = True  # torch's Optimizer pickles without it

    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        return None

    step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]


# One shadow optimizer per user optimizer for the one-replica ExploreLRs on it, so that two of them
# compose as torch's schedulers do on one optimizer (each computes from the lr the other wrote).
_SHARED: weakref.WeakKeyDictionary[torch.optim.Optimizer, weakref.ref[_ShadowOptimizer]] = (
    weakref.WeakKeyDictionary())


def _shadow_optimizer(optimizer: torch.optim.Optimizer) -> _ShadowOptimizer:
    """The shadow optimizer the live ExploreLRs on ``optimizer`` share, or a new one."""
    found = _SHARED.get(optimizer)
    shadow = found() if found is not None else None
    if shadow is None or len(shadow.param_groups) != len(optimizer.param_groups):
        shadow = _ShadowOptimizer(optimizer)
        _SHARED[optimizer] = weakref.ref(shadow)
        return shadow
    wrote = getattr(optimizer, "_hpx_wrote", None)  # the lrs the live ExploreLRs last wrote
    for i, (mine, theirs) in enumerate(zip(shadow.param_groups, optimizer.param_groups)):
        for k, v in theirs.items():  # entries a scheduler built since has added (base_momentum, ...)
            if k not in mine:
                mine[k] = _shadow_value(v)
        if wrote is not None and i < len(wrote) and wrote[i] != theirs["lr"]:
            mine["lr"] = _shadow_value(theirs["lr"])  # set by hand since: the new scheduler starts from it
    return shadow


def _shadow_value(value: Any) -> Any:
    if torch.is_tensor(value) and value.device.type == "cpu":
        return value.detach().clone()
    return _plain(value)


class _Shadow:
    """A copy of the user's scheduler, stepped lazily as the engine's step advances.

    Chainable schedulers (StepLR, ExponentialLR, SequentialLR, ChainedScheduler) compute each lr
    from the previous one, so they must be stepped in order and on an optimizer whose lr is the
    schedule's own, not the replica's spread value: hence the copy on a shadow optimizer.
    """

    def __init__(self, scheduler: LRScheduler, *, share: bool = False) -> None:
        real = scheduler.optimizer
        self.optimizer = _shadow_optimizer(real) if share else _ShadowOptimizer(real)
        # Deep-copy the scheduler with the user's optimizer replaced by the shadow everywhere
        # (nested schedulers included); nothing of the model or optimizer state is copied.
        self.scheduler: LRScheduler = copy.deepcopy(scheduler, {id(scheduler.optimizer): self.optimizer})
        self.step = 0
        self.use_beta1 = "betas" in self.optimizer.defaults
        self.cycles_momentum = any(getattr(s, "cycle_momentum", False) for s in _walk(scheduler))
        # where it started, to go back to (an engine loaded with an earlier checkpoint); a shadow
        # optimizer shared with other schedulers cannot go back alone
        self._start = None if share else self.state_dict()

    def advance_to(self, step: int) -> None:
        if step < self.step and self._start is not None:
            self.load_state_dict(self._start)
        while self.step < step:
            self.scheduler.step()
            self.step += 1
        if step < self.step:
            raise ValueError(f"a wrapped scheduler only moves forward: asked for step {step} at step "
                             f"{self.step}")

    def step_epoch(self, epoch: float) -> None:
        """torch's deprecated ``scheduler.step(epoch)`` on the copy, counted as one step (hpx's
        ``step(epoch)`` gives torch's warning itself)."""
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="The epoch parameter")
            self.scheduler.step(epoch)  # type: ignore[arg-type]  # SequentialLR raises TypeError, as in torch
        self.step += 1

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
        knobs = hpx.schedule.explore_knobs(CosineAnnealingLR(template, T_max=2000), spread=0.2)
        engine = hpx.Engine(model, lambda m: torch.optim.SGD(m.parameters(), lr=0.1), knobs, replicas=4)
    """
    problems = _scheduler_problems(scheduler)
    n = len(scheduler.optimizer.param_groups) if not problems else None
    problems += _hdet_problems(spread, "hpx", 1, None, n)
    ConfigError.check(problems)
    return _shadow_knobs(_Shadow(scheduler), spread, None)


def _scheduler_problems(scheduler: Any) -> list[str]:
    if getattr(type(scheduler), "_hpx_scheduler", False):  # OneCycleLR, ExploreLR
        return [f"scheduler is already an hpx scheduler ({type(scheduler).__name__}); wrap the torch "
                "scheduler it was built from instead"]
    if isinstance(scheduler, ReduceLROnPlateau):
        return ["scheduler must be a step-driven LRScheduler; ReduceLROnPlateau follows a metric, "
                "so it has no schedule to explore around"]
    if not isinstance(scheduler, LRScheduler):
        return [f"scheduler must be a torch.optim.lr_scheduler.LRScheduler (got {type(scheduler).__name__})"]
    return []


_EAGER_STEPS = 100_000  # read_schedule tabulates this many steps at most (about 0.6 s); later ones lazily


def read_schedule(scheduler: LRScheduler,
                  total_steps: int) -> tuple[Callable[[int], float], list[float], list[Knob]]:
    """The scheduler's lr over ``total_steps + 1`` steps as a factor of its peak, each group's
    peak lr, and, when the scheduler cycles momentum (OneCycleLR, CyclicLR), one knob per group
    that writes its momentum (or Adam's beta1) exactly as the scheduler would; read on a copy
    (the scheduler and its optimizer are left as they are).

    Up to ``_EAGER_STEPS`` (100,000) steps the schedule is read once, whole: the peaks are the
    run's, and every step is checked to follow one shape in every group. A longer run reads
    the first 100,000 steps so (the peaks are theirs) and steps a copy of the scheduler on as
    the engine's step advances (a step costs a few microseconds; nothing is stored), checking
    each step's shape as it is read: a group that departs from it raises
    :class:`~hpx.ConfigError` at that step, and a later learning rate above the first steps'
    peak is a factor above 1 (the learning rates written are the scheduler's either way)."""
    ConfigError.check(_scheduler_problems(scheduler))
    shadow = _Shadow(scheduler)
    n = len(shadow.optimizer.param_groups)
    lrs, momenta = [], []
    for t in range(min(total_steps, _EAGER_STEPS) + 1):
        try:
            lrs.append([shadow.lr(g, t) for g in range(n)])
        except ValueError as e:  # torch's OneCycleLR past its total_steps: "Tried to step ... times"
            raise ConfigError([f"the schedule {type(scheduler).__name__} ends before the run's total_steps="
                               f"{total_steps}: stepping it to step {t} raised ({e}); build it for the run's "
                               "length, or give total_steps the schedule's"]) from None
        if shadow.cycles_momentum:
            momenta.append([shadow.momentum(g, t) for g in range(n)])
    peaks = [max(row[g] for row in lrs) for g in range(n)]
    if not any(p > 0 for p in peaks):
        raise ConfigError(["the schedule's learning rates are 0 at every step: nothing to scale"])
    ref = next(g for g in range(n) if peaks[g] > 0)
    for t, row in enumerate(lrs):
        _check_shape(row, peaks, ref, t)
    factors = [row[ref] / peaks[ref] for row in lrs]
    if total_steps <= _EAGER_STEPS:
        followed: list[Knob] = [_CycledMomentum(f"momentum/{g}", group=g,
                                                schedule=_Table([row[g] for row in momenta]))
                                for g in range(n)] if momenta else []
        return _Table(factors), peaks, followed
    lazy = _LazySchedule(shadow, total_steps, peaks, ref, factors, momenta)
    followed = [_CycledMomentum(f"momentum/{g}", group=g, schedule=_LazyMomentum(lazy, g))
                for g in range(n)] if momenta else []
    return lazy, peaks, followed


def _check_shape(row: Sequence[float], peaks: Sequence[float], ref: int, t: int) -> None:
    """Raise unless every group's lr at step ``t`` is the same share of its peak as group ``ref``'s."""
    factor = row[ref] / peaks[ref]
    for g in range(len(row)):
        if peaks[g] <= 0 and row[g] == 0:  # a group at 0 throughout stays there
            continue
        share = row[g] / peaks[g] if peaks[g] > 0 else math.inf
        if g != ref and not math.isclose(share, factor, rel_tol=1e-9, abs_tol=1e-12):
            raise ConfigError(
                [f"param group {g} follows another shape than group {ref} at step {t} "
                 f"({share:.6g} against {factor:.6g} of their peaks): autolr scales "
                 "every group by one factor; declare hpx.LearningRate knobs per group instead"])


class _LazySchedule:
    """``f(step)`` of a long run: the first steps from a table, later ones from a copy of the
    scheduler stepped on as they are asked for (checked for one shape as they are read); past
    ``total_steps``, the last step's value. An earlier step than the copy has reached (a resume
    from an older checkpoint) restarts it from where the table ends."""

    def __init__(self, shadow: _Shadow, total_steps: int, peaks: list[float], ref: int,
                 factors: list[float], momenta: list[list[float]]) -> None:
        self.total_steps, self.peaks, self.ref = total_steps, peaks, ref
        self.factors, self.momenta = factors, momenta
        self._start = copy.deepcopy(shadow)  # at the table's last step
        self._shadow = shadow
        self._checked = len(factors) - 1  # steps up to this one follow the shape

    def _at(self, step: int) -> _Shadow:
        step = min(step, self.total_steps)
        if step < self._shadow.step:
            self._shadow = copy.deepcopy(self._start)
        shadow = self._shadow
        while shadow.step < step:
            shadow.advance_to(shadow.step + 1)
            if shadow.step > self._checked:
                row = [shadow.optimizer.param_groups[g]["lr"] for g in range(len(self.peaks))]
                _check_shape([float(v) for v in row], self.peaks, self.ref, shadow.step)
                self._checked = shadow.step
        return shadow

    def __call__(self, step: int) -> float:
        if 0 <= step < len(self.factors):
            return self.factors[step]
        return self._at(max(step, 0)).lr(self.ref, min(step, self.total_steps)) / self.peaks[self.ref]

    def momentum(self, group: int, step: int) -> float:
        if 0 <= step < len(self.momenta):
            return self.momenta[step][group]
        return self._at(max(step, 0)).momentum(group, min(step, self.total_steps))


class _LazyMomentum:
    __slots__ = ("group", "lazy")

    def __init__(self, lazy: _LazySchedule, group: int) -> None:
        self.lazy, self.group = lazy, group

    def __call__(self, step: int) -> float:
        return self.lazy.momentum(self.group, step)


class _Table:
    """``f(step)`` from a precomputed table; past its end, the last value."""

    __slots__ = ("values",)

    def __init__(self, values: list[float]) -> None:
        self.values = values

    def __call__(self, step: int) -> float:
        v = self.values
        return v[step] if 0 <= step < len(v) else v[-1]
