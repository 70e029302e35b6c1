"""Knob forks: which values they take, when they branch from your run, and the end's test among
several finished challengers.

What a knob such as dropout or weight decay buys often shows only late: more regularization trains
slower early and pays once the model would overfit, so a cut early in the run drops it. Knob forks
may therefore branch from your run later in the run (``knob_start``, a share of the run) and go
to the end uncut, where finished runs are compared: a fork that wins is a run that ended better.
Less regularization is the other way round: it pays from the first steps, where a cut sees it, and
a fork branched late has too little of the run left to show it. The default design, ``"split"``,
follows both: the lower sides start with the lr's forks and are raced and cut with them (one fork
per knob), the upper sides branch late as one joint fork. ``"ladder"`` races two lower forks per
knob instead, one and two spreads down (:func:`knob_rungs`), so a run can move a
knob two spreads where less regularization pays.

The end's test compares your run with the best of the challengers still running. With several of
them the best is the luckiest as well as the best (a winner's curse on the probe that chose it),
so the confidence it must clear is raised for the number of challengers compared (Bonferroni's
correction of the one-sided level ``confidence`` stands for).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from statistics import NormalDist

from hpx.knobs.base import Knob

__all__ = ["DESIGNS", "corrected", "knob_rungs", "knob_settings", "planned", "split_early"]

DESIGNS = ("each", "joint", "split", "ladder")


def knob_settings(knobs: Sequence[Knob], bases: dict[str, float], design: str,
                  sides: dict[str, list[float]]) -> list[dict[str, float]]:
    """The knob forks' values (every knob's value in each fork), your values ``bases`` moved:

    * ``"each"``: two forks per knob, each moving that knob alone to one side (``sides[name]``: the
      sides inside its bounds, lower first when both are);
    * ``"joint"``: two forks in all, one moving every knob to its lower side, one to its upper side
      (a knob with no side there stays at your value), so a winner may move several knobs at once;
    * ``"split"`` and ``"ladder"``: the joint upper fork alone (the lower sides start with the
      run: :func:`split_early`).
    """
    if design == "each":
        return [{**bases, k.name: v} for k in knobs for v in sides[k.name]]
    if design in ("split", "ladder"):  # the lower sides start with the lr's (split_early); the upper late
        return [v for v in knob_settings(knobs, bases, "joint", sides)
                if any(v[k.name] > bases[k.name] for k in knobs)]
    out: list[dict[str, float]] = []
    for up in (False, True):
        moved = dict(bases)
        for k in knobs:
            side = [v for v in sides[k.name] if (v > bases[k.name]) == up]
            if side:
                moved[k.name] = side[0]
        if moved != bases and moved not in out:
            out.append(moved)
    return out


def knob_rungs(knob: Knob, rungs: int = 2) -> list[float]:
    """The lower forks of ``knob_design="ladder"``: your value moved down by 1, 2, ... ``rungs``
    spreads (``base / span ** r`` for a geometric spread, ``base * (1 - spread) ** r`` for a
    multiplicative one, ``base - r * spread`` for an additive one). A rung past the lower bound moves
    onto it when that still moves your value by half a spread's move or more (a lower bound is a
    value the knob runs at: every built-in knob's is 0, the knob off), else it is left out; rungs
    that coincide are one fork (dropout 0.3 with a spread of 0.2: 0.1 and 0; dropout 0.1: 0 only;
    dropout 0.05: none)."""
    b, w, low = knob.base, knob.spread, knob.low
    if knob.kind == "mul" and b == 0:
        return []
    out: list[float] = []
    for r in range(1, rungs + 1):
        if knob.spacing == "log":
            v, step = b * math.exp(-r * w), b * (1 - math.exp(-w))
        elif knob.kind == "mul":
            v, step = b * (1 - w) ** r, b * w
        else:
            v, step = b - r * w, w
        if v < low < b and 2 * (b - low) >= step:
            v = low
        inside = low <= v < b and v <= knob.high and not (knob.kind == "mul" and v <= 0)
        if inside and v not in out:
            out.append(v)
    return out


def split_early(knobs: Sequence[Knob], bases: dict[str, float], sides: dict[str, list[float]],
                design: str = "split") -> list[dict[str, float]]:
    """``"split"``'s forks from the run's start, raced and cut with the lr's: one per knob with a
    lower side, that knob moved down (less regularization pays from the first steps, where a cut
    sees it); the upper sides branch late, jointly (:func:`knob_settings`). ``"ladder"``: that
    knob moved down by one and by two spreads (:func:`knob_rungs`)."""
    if design == "ladder":
        return [{**bases, k.name: v} for k in knobs for v in knob_rungs(k)]
    return [{**bases, k.name: v} for k in knobs for v in sides[k.name] if v < bases[k.name]]


def planned(knobs: Sequence[Knob], bases: dict[str, float], design: str, start: float,
            sides: dict[str, list[float]]) -> tuple[list[dict[str, float]], list[dict[str, float]]]:
    """The knob forks of a run: ``(those that start with the lr's forks, those that branch from your
    run at knob_start=start)``; with ``start == 0`` every one starts with the lr's."""
    early = split_early(knobs, bases, sides, design) if design in ("split", "ladder") else []
    late = knob_settings(knobs, bases, design, sides)
    return (early + late, []) if start == 0 else (early, late)


def corrected(confidence: float, challengers: int) -> float:
    """The standard errors the best of ``challengers`` must clear: ``confidence`` is the one-sided
    level for one challenger (``2``: 2.3%); for ``m`` the level is divided by ``m``."""
    if challengers <= 1 or confidence <= 0:
        return confidence
    p = 1.0 - NormalDist().cdf(confidence)
    return NormalDist().inv_cdf(1.0 - p / challengers) if p > 0 else math.inf
