"""Knobs that live in an optimizer's parameter groups: learning rate and weight decay."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from hpx.errors import ConfigError
from hpx.knobs.base import Knob, Setter

if TYPE_CHECKING:
    from hpx.replica import Replica

__all__ = ["GroupKnob", "LearningRate", "LearningRateScale", "WeightDecay"]


class GroupKnob(Knob):
    """A multiplicative knob stored under ``key`` in one optimizer parameter group.

    ``group`` picks the group by index, or by the ``"name"`` entry you give the
    group when building the optimizer (torch keeps extra keys in param groups)::

        torch.optim.AdamW([{"params": body, "name": "body"},
                           {"params": embed, "name": "embed"}], lr=1e-3)

    ``base``, ``spread``, ``span``, ``bounds``, ``explore`` and ``from_zero`` (the value the
    upper fork of :class:`hpx.Forks` takes when the group's value is 0) are as for
    :class:`~hpx.Knob`.
    """

    key: str = ""

    def __init__(
        self,
        name: str,
        *,
        group: int | str = 0,
        base: float | None = None,
        spread: float = 0.0,
        bounds: tuple[float, float] | None = None,
        explore: bool = True,
        span: float | None = None,
        from_zero: float | None = None,
    ) -> None:
        if not isinstance(group, (int, str)) or isinstance(group, bool):
            raise ConfigError([f"group of knob {name!r} must be an index or a name (got {group!r})"])
        super().__init__(name, base=base, spread=spread, kind="mul", bounds=bounds, explore=explore,
                         span=span, from_zero=from_zero)
        self.group = group

    def _index(self, replica: Replica) -> int:
        """The position of this knob's group in the replica's optimizer."""
        groups = replica.optimizer.param_groups
        if isinstance(self.group, int):
            if not -len(groups) <= self.group < len(groups):
                raise ConfigError(
                    [f"knob {self.name!r} asks for parameter group {self.group}, but the "
                     f"optimizer has {len(groups)} group(s)"]
                )
            i = self.group % len(groups)
        else:
            found = [i for i, g in enumerate(groups) if g.get("name") == self.group]
            if len(found) != 1:
                names = [g.get("name") for g in groups]
                how = "no" if not found else f"{len(found)}"
                raise ConfigError(
                    [f"knob {self.name!r} asks for parameter group named {self.group!r}, but "
                     f"{how} group has that name (group names: {names}); name groups with "
                     "{'params': ..., 'name': ...} when building the optimizer"]
                )
            i = found[0]
        if self.key not in groups[i]:
            raise ConfigError(
                [f"knob {self.name!r}: parameter group {self.group!r} of "
                 f"{type(replica.optimizer).__name__} has no {self.key!r} setting"]
            )
        return i

    def bind(self, replica: Replica) -> Setter:
        i = self._index(replica)
        return _GroupSetter(replica.optimizer, [(i, 1.0)], self.key, self.name)

    def targets(self, replica: Replica) -> list[str]:
        return [f"{self.key} of parameter group {self._index(replica)}"]

    def _zero_base_problem(self, replica: Replica | None) -> str:
        """A base of 0 read from the group (weight decay off on it): the groups that have a value."""
        if replica is None or self._base_given:
            return super()._zero_base_problem(replica)
        i, groups = self._index(replica), replica.optimizer.param_groups
        have = [j for j, g in enumerate(groups)
                if isinstance(g.get(self.key), (int, float)) and g[self.key] > 0]
        pick = (f"group={groups[have[0]].get('name', have[0])!r}" if have
                else f"a group whose {self.key} is > 0")
        return (f"knob {self.name!r} reads {self.key}={groups[i][self.key]} from parameter group {i} "
                f"(group={self.group!r}), and the engine spreads a multiplicative knob's replicas by ratios "
                f"of its base, which needs a value > 0 to spread around: give {pick}, or base=... > 0; or "
                f"use hpx.Forks, which explores a knob at 0 upward (to from_zero=...)")

    def read(self, replica: Replica) -> float:
        value = replica.optimizer.param_groups[self._index(replica)][self.key]
        if hasattr(value, "item"):  # a tensor lr (capturable optimizers)
            value = value.item()
        return float(value)

    def _describe(self) -> str:
        return f"{super()._describe()}, group={self.group!r}"


def _checked_schedule(name: str, schedule: Callable[[int], float] | None) -> Callable[[int], float] | None:
    if schedule is not None and not callable(schedule):
        if hasattr(schedule, "get_last_lr"):  # a torch LRScheduler: the knobs that follow one are built
            raise ConfigError([f"schedule of knob {name!r} is a torch scheduler ({type(schedule).__name__}); "
                               "a knob's schedule is a function step -> factor. To explore on top of a "
                               "torch scheduler: knobs=hpx.schedule.explore_knobs(scheduler, spread=...)"])
        raise ConfigError([f"schedule of knob {name!r} must be a function step -> factor (got {schedule!r})"])
    return schedule


def _scheduled_scale(self, step: int) -> float:
    """The schedule's factor at ``step`` (1 without a schedule)."""
    if self.schedule is None:
        return 1.0
    value = self.schedule(step)
    return value if isinstance(value, float) else _factor(value)


def _factor(value: object) -> Any:
    """``float(value)``, or ``value`` itself when it is no number (the engine names it)."""
    try:
        return float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError, RuntimeError):
        return value


def _is_scheduled(self) -> bool:
    """Whether the value follows a schedule (and is written every step)."""
    return self.schedule is not None


class LearningRate(GroupKnob):
    """The learning rate of one parameter group (``group["lr"]``).

    The controller moves ``b``; ``schedule`` (optional) gives the shape. Replica
    ``r`` trains at ``lr_r(t) = b * rho_pi(r) * schedule(t)``, so the schedule's
    shape is kept and the controller learns a multiplicative correction on top of
    it. With ``schedule=None`` the value is ``b * rho`` (constant between syncs).

    Args:
        schedule: ``f(step) -> factor``, for example ``lambda t: min(1, t / 100)``
            for a warm-up. ``step`` counts optimizer steps from 0.
    """

    key = "lr"

    def __init__(
        self,
        name: str = "lr",
        *,
        group: int | str = 0,
        base: float | None = None,
        spread: float = 0.0,
        schedule: Callable[[int], float] | None = None,
        bounds: tuple[float, float] | None = None,
        explore: bool = True,
        span: float | None = None,
    ) -> None:
        super().__init__(name, group=group, base=base, spread=spread, bounds=bounds, explore=explore,
                         span=span)
        self.schedule = _checked_schedule(name, schedule)

    scale = _scheduled_scale
    scheduled = property(_is_scheduled)


class WeightDecay(GroupKnob):
    """The weight decay of one parameter group (``group["weight_decay"]``).

    A group without decay (``weight_decay=0``, the usual setting for biases and norms, and
    SGD's and Adam's default) is explored upward by :class:`hpx.Forks`: the upper fork takes
    ``from_zero``, and no fork goes below 0. ``from_zero=None`` picks, when the knob is bound:
    ``0.01`` for ``torch.optim.AdamW`` (or Adam with ``decoupled_weight_decay=True``): decoupled
    decay, torch's own default for AdamW; ``5e-4`` for any other optimizer: coupled L2 decay,
    the common default of SGD and Adam recipes. A win writes that value into the group, and a
    later run from it forks at ``value / span`` and ``value * span`` as usual. The HDET
    :class:`hpx.Engine` refuses a weight decay of 0 (its replicas spread by ratios of the base).

    Args:
        from_zero: the value the upper fork takes when the group's weight decay is 0 (a number
            > 0), or ``None`` for the default above.
        group, base, spread, span, bounds, explore: as for :class:`GroupKnob`.
    """

    key = "weight_decay"
    _from_zero_default: float | None = None

    def __init__(self, name: str = "weight_decay", **kwargs) -> None:
        super().__init__(name, **kwargs)
        self._from_zero_default: float | None = None  # from the optimizer (resolve_base)

    def resolve_base(self, replica: Replica) -> None:
        """Fill ``base`` from the group if it was not given, and pick the default ``from_zero``
        for this optimizer (decoupled decay or coupled L2)."""
        group = replica.optimizer.param_groups[self._index(replica)]
        decoupled = (isinstance(replica.optimizer, torch.optim.AdamW)
                     or group.get("decoupled_weight_decay") is True)
        self._from_zero_default = 0.01 if decoupled else 5e-4
        super().resolve_base(replica)

    def from_zero_value(self) -> float | None:
        """``from_zero`` as given, else the optimizer's default (``None`` before the knob is bound)."""
        return self.from_zero if self.from_zero is not None else self._from_zero_default


class LearningRateScale(Knob):
    """One factor on the learning rate of every parameter group, keeping their ratios.

    Replica ``r`` trains group ``g`` at ``lr_g * b * rho_pi(r) * schedule(t)``, where
    ``lr_g`` is the group's learning rate when the knob is bound (the one the
    optimizer was built with). The base ``b`` starts at 1: the search learns one
    correction for the whole optimizer, which is what "find the learning rate"
    means when the groups' ratios are part of the recipe (no decay on norms, a
    smaller lr for embeddings, ...). :func:`hpx.autolr` explores this knob.

    Args:
        schedule: ``f(step) -> factor`` shared by every group (a warm-up, a cosine),
            or ``None`` for a constant.
        lrs: the learning rates ``lr_g`` to scale, one per group (default: each
            group's lr when the knob is bound).
        base, spread, span, bounds, explore: as for :class:`~hpx.Knob` (``base``
            defaults to 1).
    """

    def __init__(
        self,
        name: str = "lr",
        *,
        schedule: Callable[[int], float] | None = None,
        base: float = 1.0,
        spread: float = 0.0,
        span: float | None = None,
        bounds: tuple[float, float] | None = None,
        explore: bool = True,
        lrs: Sequence[float] | None = None,
    ) -> None:
        super().__init__(name, base=base, spread=spread, kind="mul", bounds=bounds, explore=explore,
                         span=span)
        self.schedule = _checked_schedule(name, schedule)
        self.lrs = None if lrs is None else [float(x) for x in lrs]
        self._shown: float | None = None  # the lr the factor multiplies in the records (bind)

    scale = _scheduled_scale
    scheduled = property(_is_scheduled)

    def targets(self, replica: Replica) -> list[str]:
        return [f"lr of parameter group {i}" for i in range(len(replica.optimizer.param_groups))]

    def bind(self, replica: Replica) -> Setter:
        opt = replica.optimizer
        lrs = self.lrs
        if lrs is None:
            lrs = [float(g["lr"].item() if torch.is_tensor(g["lr"]) else g["lr"]) for g in opt.param_groups]
        if len(lrs) != len(opt.param_groups):
            raise ConfigError([f"knob {self.name!r} has {len(lrs)} learning rates for "
                               f"{len(opt.param_groups)} parameter groups"])
        for i, lr in enumerate(lrs):
            if not lr >= 0:
                raise ConfigError([f"knob {self.name!r}: parameter group {i} has lr {lr}; it must be >= 0"])
        if not any(lr > 0 for lr in lrs):
            raise ConfigError([f"knob {self.name!r} scales the optimizer's learning rates, but every "
                               f"group's lr is 0 ({lrs}): build the optimizer with the lr you would use"])
        self._shown = next(lr for lr in lrs if lr > 0)

        return _GroupSetter(opt, list(enumerate(lrs)), "lr", self.name)

    def learning_rate(self, factor: float) -> float | None:
        """The learning rate that ``factor`` (a value of this knob times its schedule factor)
        gives the first parameter group with a nonzero lr; ``None`` before the knob is bound."""
        return None if self._shown is None else self._shown * factor


class _GroupSetter:
    """Writes ``factor * value`` into ``key`` of each listed parameter group, and tells whether
    something else has written there since (:meth:`drift`).

    The groups are looked up at every write: ``optimizer.load_state_dict`` replaces the
    param-group dicts, so a dict captured here would go stale."""

    __slots__ = ("groups", "key", "name", "optimizer")

    def __init__(self, optimizer: torch.optim.Optimizer, groups: list[tuple[int, float]], key: str,
                 name: str) -> None:
        self.optimizer, self.groups, self.key, self.name = optimizer, groups, key, name

    def __call__(self, value: float) -> None:
        pgs, key = self.optimizer.param_groups, self.key
        for i, factor in self.groups:
            g = pgs[i]
            if torch.is_tensor(g[key]):  # capturable/compiled optimizers: keep the tensor, as torch does
                g[key].fill_(factor * value)
            else:
                g[key] = factor * value

    def drift(self, value: float) -> str | None:
        """``None`` if the groups hold what writing ``value`` put there; else what differs
        (a host read of a tensor setting: call it at a sync, not every step)."""
        for i, factor in self.groups:
            got, want = self.optimizer.param_groups[i][self.key], factor * value
            got = float(got.item()) if torch.is_tensor(got) else got
            if not math.isclose(got, want, rel_tol=1e-6, abs_tol=0.0):
                return (f"parameter group {i}'s {self.key} is {got:.6g} where knob {self.name!r} wrote "
                        f"{want:.6g}")
        return None
