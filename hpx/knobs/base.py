"""The Knob: one scalar hyperparameter explored across replicas.

A knob is a declaration. It holds no model: the engine binds it to each replica
(its model, optimizer and value table) and the knob returns a *setter* that
writes a value into that replica. Between syncs nothing about a knob changes
except an optional per-step *scale* (a learning-rate schedule), so the hot path
only writes values where they changed.

Symbols (see ``docs/method.md``): ``b`` is the knob's base (centre), ``alpha`` its
spread, ``s`` a slot and ``pi`` the permutation that gives replica ``r`` the
slot ``pi(r)``.

* multiplicative knobs (learning rate, weight decay, temperature) give slot ``s``
  the value ``b * rho_s`` with ``rho_s = 1 + alpha * u_s`` (the paper's linear
  spread), or, with a geometric spread (``span``), ``rho_s = span ** u_s``: values
  evenly spaced in log space from ``b / span`` to ``b * span``, which can look
  several times further away than a linear spread (``alpha < 1``) ever can;
* additive knobs (dropout, label smoothing) give ``b + alpha * u_s``, clamped to
  the knob's bounds (the engine refuses a declared spread that would reach past them:
  :meth:`Knob.fan_out_problems`);

where ``u_s = (s - (N-1)/2) / max((N-1)/2, 0.5)`` lies evenly in ``[-1, 1]`` with
mean exactly 0, so ``rho`` lies evenly in ``[1-alpha, 1+alpha]`` with mean 1.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal

import torch

from hpx.errors import ConfigError, NonFiniteError

if TYPE_CHECKING:
    from hpx.replica import Replica

__all__ = ["Custom", "Knob", "Setter", "Spacing", "slot_offsets"]

Setter = Callable[[float], None]
"""Writes one value into one bound replica."""

Kind = Literal["mul", "add"]
Spacing = Literal["linear", "log"]


def slot_offsets(n: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """``u_s`` for ``s = 0..n-1``: evenly spaced in ``[-1, 1]``, mean exactly 0.

    ``n = 1`` gives ``[0]``. For every ``n`` the offsets are antisymmetric
    (``u_s = -u_{n-1-s}``), which is what makes the spread's mean exact.
    """
    if n < 1:
        raise ConfigError([f"number of replicas must be >= 1 (got {n})"])
    half = (n - 1) / 2
    delta = max(half, 0.5)
    s = torch.arange(n, dtype=dtype)
    return (s - half) / delta


class Knob:
    """A scalar hyperparameter with a base value, a spread and bounds.

    Subclasses say where the value goes by overriding :meth:`bind` (return a
    setter for one replica) and, if the base may be read from the replica, by
    overriding :meth:`read`.

    Args:
        name: unique name, used to read the value (``replica.value(name)``), in
            logs and in checkpoints.
        base: the starting base value ``b``. ``None`` reads it from the first
            replica at bind time (for example a parameter group's ``lr``).
        spread: ``alpha``. For multiplicative knobs a ratio in ``[0, 1)``; for
            additive knobs an absolute amount in the knob's units.
        span: a geometric spread for a multiplicative knob instead of ``spread``:
            the replicas' values lie evenly in log space from ``b / span`` to
            ``b * span`` (``span=4``: a quarter to four times the base). ``>= 1``;
            1 is no spread. A search strategy may change it during the run.
        kind: ``"mul"`` (``b * rho_s``, for positive quantities) or ``"add"``
            (``b + alpha * u_s``, for bounded ones).
        bounds: ``(low, high)``; values and the base are kept inside. ``None``: ``(0, inf)``,
            for an additive knob too (give ``bounds=(-math.inf, math.inf)`` for a value that
            may go negative). A multiplicative knob's values are positive; its base may be 0
            (weight decay off), which :class:`hpx.Forks` explores upward from (``from_zero``) and
            the HDET :class:`hpx.Engine` refuses (every ratio of 0 is 0). A spread that would
            reach past a bound is accepted here: :class:`hpx.Forks` leaves that side out, and the
            engine, whose replicas sit on both sides of the base, refuses it
            (:meth:`fan_out_problems`).
        explore: ``False`` keeps the knob fixed at its base (no spread, no
            controller updates) while still applying it: useful for ablations.
        from_zero: the value your knob's upper fork takes when your value is 0 (a multiplicative
            knob cannot move from 0 by a ratio); used by :class:`hpx.Forks` only, and only for a
            multiplicative knob (an additive one moves from 0 by its spread). ``None``: the knob's
            own default where it has one (:class:`~hpx.WeightDecay`), else Forks refuses a
            multiplicative knob at 0 and asks for it. A number > 0 inside the bounds.
    """

    kind: Kind
    from_zero: float | None = None
    _base_given = False  # (class defaults: a knob pickled before these existed)

    def __init__(
        self,
        name: str,
        *,
        base: float | None = None,
        spread: float = 0.0,
        kind: Kind = "mul",
        bounds: tuple[float, float] | None = None,
        explore: bool = True,
        span: float | None = None,
        from_zero: float | None = None,
    ) -> None:
        problems: list[str] = []
        if not isinstance(name, str) or not name:
            problems.append(f"knob name must be a non-empty string (got {name!r})")
        label = f"knob {name!r}"
        if kind not in ("mul", "add"):
            problems.append(f"kind of {label} must be 'mul' or 'add' (got {kind!r})")
        if bounds is None:
            bounds = (0.0, math.inf)
        low, high = (float(bounds[0]), float(bounds[1]))
        if not low < high:
            problems.append(f"bounds of {label} must satisfy low < high (got {bounds})")
        if kind == "mul" and low < 0:
            problems.append(f"bounds of multiplicative {label} must be >= 0 (got low={low})")
        if not _is_real(spread) or spread < 0:
            problems.append(f"spread of {label} must be a number >= 0 (got {spread!r})")
        elif kind == "mul" and spread >= 1:
            problems.append(
                f"spread of multiplicative {label} must be in [0, 1) so every value stays "
                f"positive (got {spread}); for a wider search use a LearningRate base "
                "closer to the expected optimum"
            )
        if span is not None:
            if not _is_real(span) or span < 1:
                problems.append(f"span of {label} must be a number >= 1 (got {span!r}); the values "
                                "then lie from base / span to base * span")
            elif kind != "mul":
                problems.append(f"span (a geometric spread) needs a multiplicative knob; {label} is "
                                "additive: give spread=... in the knob's units")
            if _is_real(spread) and spread != 0:
                problems.append(f"give spread or span for {label}, not both (got spread={spread!r}, "
                                f"span={span!r})")
        if from_zero is not None:
            if kind != "mul":
                problems.append(f"from_zero of {label} is for a multiplicative knob, which cannot move "
                                "from 0 by a ratio; an additive knob moves from 0 by its spread: leave "
                                "from_zero out")
            elif not _is_real(from_zero) or not from_zero > 0 or not low <= from_zero <= high:
                problems.append(f"from_zero of {label} must be a number > 0 inside its bounds [{low:g}, "
                                f"{high:g}] (got {from_zero!r}): the value its upper fork takes when your "
                                "value is 0")
        if base is not None:
            # a spread past a bound is the engine's to refuse (fan_out_problems): Forks leaves that side out
            problems.extend(_base_problems(label, base, kind, low, high))
        ConfigError.check(problems)
        self.name = name
        self.kind = kind
        self.spacing: Spacing = "log" if span is not None else "linear"
        width = math.log(span) if span is not None else float(spread)
        self.spread = width if explore else 0.0
        """``alpha``: the half-width in the knob's spacing (``log(span)`` for a geometric spread)."""
        self.low, self.high = low, high
        self.explore = bool(explore)
        self.from_zero: float | None = None if from_zero is None else float(from_zero)
        """The value the upper fork takes (:class:`hpx.Forks`) when the base is 0, as given."""
        self._base_given = base is not None  # declared with its base, not read from the replica
        self._initial_base = None if base is None else float(base)
        self.base: float = math.nan if base is None else float(base)

    # --- what subclasses provide -------------------------------------------------

    def bind(self, replica: Replica) -> Setter | None:
        """Return a setter that writes a value into ``replica``, or ``None`` if the
        value is only read (``replica.value(name)``, as for label smoothing).

        Raise :class:`~hpx.errors.ConfigError` if the replica lacks what the
        knob needs (no such parameter group, no matching module).
        """
        return None

    def read(self, replica: Replica) -> float | None:
        """The replica's current value, used as the base when ``base=None``."""
        return None

    def targets(self, replica: Replica) -> list[str]:
        """What this knob writes in ``replica``, one description per setting (for
        instance ``"lr of parameter group 0"``). The engine refuses two knobs that write
        the same setting, since the second would overwrite the first at every step.
        Knobs that only publish a value (``replica.value(name)``) write nothing."""
        return []

    def scale(self, step: int) -> float:
        """A per-step factor applied on top of the replica's value (1 by default).

        :class:`~hpx.LearningRate` uses it to follow a schedule: the controller
        learns a multiplicative correction ``b`` and the schedule keeps its shape.
        """
        return 1.0

    @property
    def span(self) -> float | None:
        """The geometric spread factor (values from ``b / span`` to ``b * span``), or ``None``
        for a linear spread."""
        return math.exp(self.spread) if self.spacing == "log" else None

    def set_spread(self, width: float, spacing: Spacing | None = None) -> None:
        """Change the spread (``alpha`` in ``spacing``; ``log(span)`` for ``"log"``) for the
        values drawn at the next sync. Used by search strategies; a knob that does not
        explore keeps no spread."""
        spacing = self.spacing if spacing is None else spacing
        problems = []
        if spacing not in ("linear", "log"):
            problems.append(f"spacing of knob {self.name!r} must be 'linear' or 'log' (got {spacing!r})")
        elif spacing == "log" and self.kind != "mul":
            problems.append(f"knob {self.name!r} is additive: it has no geometric ('log') spread")
        if not _is_real(width) or width < 0:
            problems.append(f"spread of knob {self.name!r} must be a number >= 0 (got {width!r})")
        elif spacing == "linear" and self.kind == "mul" and width >= 1:
            problems.append(f"a linear spread of multiplicative knob {self.name!r} must be < 1 (got "
                            f"{width}); use spacing='log' for a wider one")
        ConfigError.check(problems)
        self.spacing = spacing
        self.spread = float(width) if self.explore else 0.0

    @property
    def scheduled(self) -> bool:
        """Whether :meth:`scale` changes with the step (values then are written every step). A
        subclass that overrides :meth:`scale` is taken as scheduled unless it says otherwise."""
        return type(self).scale is not Knob.scale

    # --- shared behaviour --------------------------------------------------------

    def resolve_base(self, replica: Replica) -> None:
        """Fill ``base`` from the replica if it was not given; check it."""
        if self._initial_base is not None:
            return
        value = self.read(replica)
        if value is None:
            raise ConfigError(
                [f"knob {self.name!r} has no base value: pass base=... when declaring it"]
            )
        ConfigError.check(_base_problems(f"knob {self.name!r}", value, self.kind, self.low, self.high))
        self._initial_base = float(value)
        self.base = float(value)

    def reach_problems(self) -> list[str]:
        """Whether the replicas' values, spread symmetrically around the base, stay inside the
        bounds (the engine's fan-out; :class:`hpx.Forks` instead drops a side that a bound cuts)."""
        if not self.explore or math.isnan(self.base):
            return []
        return _reach_problems(f"knob {self.name!r}", self.base, self.kind, self.low, self.high,
                               0.0 if self.spacing == "log" else self.spread, self.span)

    @property
    def base_given(self) -> bool:
        """Whether the base was declared (``base=...``) rather than read from the replica."""
        return self._base_given

    def fan_out_problems(self, replica: Replica | None = None) -> list[str]:
        """Why the HDET engine, whose replicas take values on both sides of the base (``b * rho_s``,
        ``b + alpha * u_s``), cannot take this knob (after :meth:`resolve_base`): a multiplicative
        knob that explores from a base of 0 (every ratio of 0 is 0), or a base you declared whose
        spread reaches past a bound. A base read from the replica past a bound is the engine's to
        warn about (:meth:`reach_problems`): it trains on with the outer replicas at the bound.
        :class:`hpx.Forks` takes both: it leaves a side past a bound out, and forks a knob at 0
        upward to its ``from_zero``."""
        if self.explore and self.kind == "mul" and self.base == 0:
            return [self._zero_base_problem(replica)]
        return self.reach_problems() if self._base_given else []

    def _zero_base_problem(self, replica: Replica | None) -> str:
        return (f"knob {self.name!r} has base 0, and the engine spreads a multiplicative knob's replicas "
                f"by ratios of its base (b * rho), so every replica would stay at 0: give a base > 0 "
                f"(base=...), or use hpx.Forks, which explores a knob at 0 upward (to from_zero=...)")

    def from_zero_value(self) -> float | None:
        """The value the upper fork of :class:`hpx.Forks` takes when the base is 0: ``from_zero``, or
        the knob's own default (``None``: none; Forks then refuses the knob at 0)."""
        return self.from_zero

    def values(self, slots: torch.Tensor, base: float | None = None) -> torch.Tensor:
        """Per-replica values for ``slots`` (replica ``r`` takes slot ``slots[r]``).

        Returns float64 values ``b * rho_s`` or ``clamp(b + alpha * u_s)``, before
        any per-step :meth:`scale`.
        """
        b = self.base if base is None else base
        u = slot_offsets(len(slots))[slots]
        if self.spacing == "log":
            v = b * torch.exp(self.spread * u)
        elif self.kind == "mul":
            v = b * (1.0 + self.spread * u)
        else:
            v = b + self.spread * u
        return v.clamp(self.low, self.high)

    def clamp(self, value: float) -> float:
        """Keep a base inside the knob's bounds (and positive for multiplicative knobs)."""
        if math.isnan(value):
            raise NonFiniteError(f"knob {self.name!r}: the new base is NaN; nothing to clamp")
        v = min(max(value, self.low), self.high)
        if self.kind == "mul" and v <= 0:
            v = math.ulp(0.0) if self.low == 0 else self.low
        return v

    def state_dict(self) -> dict[str, Any]:
        return {"name": self.name, "base": self.base, "initial_base": self._initial_base,
                "spread": self.spread, "spacing": self.spacing}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("name") != self.name:
            raise ConfigError(
                [f"checkpoint holds knob {state.get('name')!r} where {self.name!r} was declared"]
            )
        self.base = float(state["base"])
        if "spread" in state:  # a search strategy may have changed it during the run
            self.spacing = state.get("spacing", "linear")
            self.spread = float(state["spread"])
        ib = state.get("initial_base")
        self._initial_base = None if ib is None else float(ib)

    def _describe(self) -> str:
        base = "from replica" if self._initial_base is None else f"{self.base:.6g}"
        width = f"span={self.span:g}" if self.spacing == "log" else f"spread={self.spread:g}"
        zero = "" if self.from_zero is None else f", from_zero={self.from_zero:g}"
        return f"name={self.name!r}, base={base}, {width}{zero}"

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._describe()})"


class Custom(Knob):
    """A knob defined by a getter/setter pair on a replica.

    ``set(replica, value)`` writes the value; ``get(replica)`` (optional) reads the
    starting base when ``base`` is not given. Example: a temperature stored on a
    loss object the replica owns::

        hpx.Custom("temp", get=lambda r: r.model.temp, set=lambda r, v: setattr(r.model, "temp", v),
                   spread=0.2)

    The other arguments (``base``, ``spread``, ``kind``, ``bounds``, ``explore``, ``span``,
    ``from_zero``) are as for :class:`Knob`.
    """

    def __init__(
        self,
        name: str,
        *,
        set: Callable[[Replica, float], None],  # noqa: A002 - mirrors property(fget, fset)
        get: Callable[[Replica], float] | None = None,
        base: float | None = None,
        spread: float = 0.0,
        kind: Kind = "mul",
        bounds: tuple[float, float] | None = None,
        explore: bool = True,
        span: float | None = None,
        from_zero: float | None = None,
    ) -> None:
        problems = []
        if not callable(set):
            problems.append(f"set of knob {name!r} must be callable (got {set!r})")
        if get is not None and not callable(get):
            problems.append(f"get of knob {name!r} must be callable or None (got {get!r})")
        if base is None and get is None:
            problems.append(f"knob {name!r} needs base=... or a get= function to read it")
        ConfigError.check(problems)
        super().__init__(name, base=base, spread=spread, kind=kind, bounds=bounds, explore=explore,
                         span=span, from_zero=from_zero)
        self._set, self._get = set, get

    def bind(self, replica: Replica) -> Setter:
        setter = self._set
        return lambda value: setter(replica, value)

    def read(self, replica: Replica) -> float | None:
        if self._get is None:
            return None
        got = self._get(replica)
        if not _is_real(got) and not (isinstance(got, torch.Tensor) and got.numel() == 1):
            raise ConfigError([f"get of knob {self.name!r} returned {got!r}; it must return the setting's "
                               "current value, a number (or give base=... and no get)"])
        return float(got)


def _is_real(x: object) -> bool:
    """A finite real number: Python's, NumPy's (``np.float32(0.1)``) or any ``numbers.Real``."""
    return isinstance(x, numbers.Real) and not isinstance(x, bool) and math.isfinite(float(x))


def _reach_problems(label: str, base: float, kind: str, low: float, high: float, spread: float,
                    span: float | None) -> list[str]:
    """The engine's fan-out: the declared spread must keep the replicas' values inside the bounds:
    past a bound, several replicas would share the clamped value and the spread would explore less
    than it says. (:class:`hpx.Forks` leaves a side past a bound out instead.)"""
    if span is not None:
        lo, hi = base / span, base * span
    elif kind == "mul":
        lo, hi = base * (1 - spread), base * (1 + spread)
    else:
        lo, hi = base - spread, base + spread
    if lo >= low and hi <= high:
        return []
    room = min(base - low, high - base) if kind == "add" else None
    fix = (f"use a spread <= {room:g}, move the base or widen the bounds" if room is not None
           else "narrow the spread, move the base or widen the bounds")
    return [f"the values of {label} would span [{lo:g}, {hi:g}], past its bounds [{low:g}, {high:g}]: "
            f"replicas beyond a bound would all get the bound's value; {fix}"]


def _base_problems(label: str, base: object, kind: str, low: float, high: float) -> list[str]:
    if not _is_real(base):
        return [f"base of {label} must be a finite number (got {base!r})"]
    if kind == "mul" and base < 0:  # type: ignore[operator]
        return [f"base of multiplicative {label} must be > 0, or 0 for hpx.Forks to explore upward from "
                f"(got {base})"]
    if not low <= base <= high:  # type: ignore[operator]
        return [f"base of {label} must lie in [{low:g}, {high:g}] (got {base})"]
    return []
