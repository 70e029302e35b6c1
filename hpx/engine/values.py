"""The knobs' values in the replicas (HDET's fan-out, Eq. 1 and 9): each knob bound to each
local replica, the permutations drawn at every sync, and the per-step write of the values that
changed (the only work of the hot path besides the gradient's). A part of :class:`hpx.Engine`.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import Any

import torch

from hpx.errors import ConfigError
from hpx.knobs.base import Knob
from hpx.knobs.optim import GroupKnob, LearningRateScale

log = logging.getLogger("hpx")


class _KnobValues:
    """The engine's knob values: bound, drawn, checked and written."""

    def __getstate__(self) -> dict[str, Any]:
        # The setters are closures over this engine's replicas: a copy (deepcopy, pickle) binds
        # its own, so that it drives its own optimizers and never the original's.
        state = self.__dict__.copy()
        state["_setters"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._setters = [[k.bind(r) for r in self.replicas] for k in self.knobs]

    def _bind_knobs(self) -> None:
        problems: list[str] = []
        self._setters: list[list[Callable[[float], None] | None]] = []
        for k in self.knobs:
            try:
                k.resolve_base(self.replicas[0])
                # refused: a multiplicative base of 0, a declared base whose spread reaches past a bound
                # (hpx.Forks takes both: it forks upward from 0 and leaves a side past a bound out)
                refused = k.fan_out_problems(self.replicas[0])
                problems.extend(refused)
                if not refused and not k.base_given:  # a base read from the replica: trained on, named
                    for why in k.reach_problems():
                        log.warning("%s (a dropout rate of 0 read from your model, say: half the replicas "
                                    "train at the bound)", why)
                self._setters.append([k.bind(r) for r in self.replicas])
            except ConfigError as e:
                problems.extend(e.problems)
        ConfigError.check(problems)
        writers: dict[str, list[str]] = {}
        for k in self.knobs:
            for t in dict.fromkeys(k.targets(self.replicas[0])):
                writers.setdefault(t, []).append(k.name)
        clashes = {t: names for t, names in writers.items() if len(names) > 1}
        if clashes:
            t, names = next(iter(clashes.items()))
            more = f" (and {len(clashes) - 1} more settings)" if len(clashes) > 1 else ""
            raise ConfigError([f"knobs {names} all write the {t}{more}: each would overwrite the other "
                               "at every step; declare one knob per setting"])
        if self.n_replicas == 1 and any(k.explore and k.spread > 0 for k in self.knobs):
            log.warning("one replica in all: every knob stays at its base and nothing is explored "
                        "(replicas=%s per process, %d process(es)); use replicas >= 2, or more processes",
                        self.n_local, self.collective.world_size)
        self._scheduled = [i for i, k in enumerate(self.knobs) if k.scheduled]
        self._scales = [1.0] * len(self.knobs)  # each knob's schedule factor at its last write
        self._written: list[list[float | None]] = [[None] * self.n_local for _ in self.knobs]

    def _draw(self) -> None:
        """New permutations (Eq. 9) and the values they give, ``[K, N]`` float64."""
        self._slots = self.knobs.draw_slots(self.n_replicas)
        rows = [k.values(self._slots[i]) for i, k in enumerate(self.knobs)]
        self._values = torch.stack(rows) if rows else torch.empty(0, self.n_replicas, dtype=torch.float64)
        local = self._values[:, self._first : self._first + self.n_local]
        self._local_values: list[list[float]] = local.tolist()

    def _check_written(self) -> None:
        """Raise if something other than the knobs changed a setting they write (a torch
        scheduler stepped beside the engine would silently replace the explored values)."""
        for setters, row in zip(self._setters, self._written):
            for setter, written in zip(setters, row):
                drift = getattr(setter, "drift", None)
                why = drift(written) if drift is not None and written is not None else None
                if why is not None:
                    raise ConfigError(
                        [f"at step {self.step_count}, {why}: something else set it since (a torch "
                         "scheduler stepped beside the engine?). The engine writes the knobs' values "
                         "at every step and follows the schedule you gave it (schedule=...): remove "
                         "the scheduler.step() call, or declare the knob on another setting"])

    def _check_factors(self) -> None:
        if self._bad_factor is not None:
            name, scale, step = self._bad_factor
            if not isinstance(scale, float):  # not a number at all
                raise ConfigError([f"knob {name!r}: its schedule returned {scale!r} at step {step}; a "
                                   "schedule must return a number, the factor on the base (1 at the peak): "
                                   "does it lack a return statement?"])
            raise ConfigError([f"knob {name!r}: its schedule gave the factor {scale!r} at step {step}; a "
                               "schedule's factors must be finite and >= 0 (a negative learning rate "
                               "trains uphill); is total_steps shorter than the run?"])

    def _write(self, force: bool = False, strict: bool = False) -> None:
        """Write each knob's value into each local replica where it changed (``strict``: raise
        on a schedule that returns no number before anything is written)."""
        which = range(len(self.knobs)) if force else self._scheduled
        knobs = self.knobs._knobs
        scales = []
        for i in which:
            k = knobs[i]
            raw = k.scale(self.step_count)
            scale = _number(raw)
            if not 0.0 <= scale < math.inf and self._bad_factor is None:  # also catches NaN
                # raised when a step would train with it: torch's own OneCycleLR (linear) goes
                # below 0 at total_steps, after the last step, and hpx writes what torch writes
                self._bad_factor = (k.name, raw if math.isnan(scale) else scale, self.step_count)
            scales.append((i, k, scale))
        if strict and self._bad_factor is not None and not isinstance(self._bad_factor[1], float):
            self._check_factors()
        for i, k, scale in scales:
            self._scales[i] = scale
            written, setters, vals = self._written[i], self._setters[i], self._local_values[i]
            for l, rep in enumerate(self.replicas):
                v = vals[l] * scale
                if v != written[l]:
                    written[l] = v
                    rep._values[k.name] = v
                    if setters[l] is not None:
                        setters[l](v)


def _number(factor: object) -> float:
    """A schedule's factor as a float; NaN when it is not a number (``None``: a missing return)."""
    try:
        return float(factor)  # type: ignore[arg-type]
    except (TypeError, ValueError, RuntimeError):
        return math.nan


def _writes_optimizer(knob: Knob) -> bool:
    """Whether the knob writes an optimizer parameter-group setting (its ``key``, or lr)."""
    return isinstance(knob, (GroupKnob, LearningRateScale))
