"""A prototype knob design measured on the co-exploration suite: lanes (``--method lanes``).

Under ``knob_design="split"`` the lower knob forks race the lr's forks for the places a cut keeps:
a lower fork that would win is cut when two lr forks score better (k_cancer_sgd_wd from weight decay
0.05, k_digits300_wd from 3 on one seed), and a lower fork that scores well early takes an lr fork's
place (the ladder's k_char_tf_temp). Lanes separate the two races:

* the lr's forks are cut among themselves, to the counts a run without knobs keeps, so the lr's race
  is the one a run without knobs runs;
* each knob's lower fork runs in a lane of its own, judged against your run: at each cut your run
  has an annealed copy too, and the lane is kept while its best fork's copy scores better than
  yours (else it is dropped);
* a lane kept at the first cut gains a second rung, branched then from its fork with the knob one
  more spread down (:func:`hpx.forks.late.knob_rungs`); at every later cut a lane keeps one fork,
  its best;
* ``lane_cuts=1`` (``--method lanes1``): lanes at the first cut only; at the cuts after it the
  lanes' forks race the lr's for the places, as under ``"split"``;
* the upper joint fork branches at 70% as under ``"split"``; the end is ``hpx.Forks``' (the best of
  the challengers left must clear ``confidence`` raised for their number).

A subclass of :class:`hpx.Forks` for the measurement (no checkpoint, one process); the design and
its rule are in ``docs/method.md``.
"""

from __future__ import annotations

import math
from typing import Any

import hpx
from hpx.forks.fork import _LOST, _ranked
from hpx.forks.late import knob_rungs

__all__ = ["Lanes"]


class Lanes(hpx.Forks):
    """``hpx.Forks`` with each knob's lower fork in a lane of its own (the module's docstring)."""

    def __init__(self, *args: Any, lane_cuts: int | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._lane_cuts = lane_cuts  # lanes at this many first cuts (None: all); then one race
        self._lane: dict[int, tuple[str, int]] = {}  # replica index -> (knob, rung)
        for f in self._forks[1:]:
            moved = [k.name for k in self.knobs if f.values[k.name] != self._bases[k.name]]
            if f.factor == 1.0 and not f.late and len(moved) == 1:
                self._lane[f.replica.index] = (moved[0], 1)
        self._cuts_made = 0

    def _laned(self) -> bool:
        """Whether the next cut is made in lanes."""
        return self._lane_cuts is None or self._cuts_made < self._lane_cuts

    def _lanes_live(self) -> bool:
        return self._laned() and any(f.replica.index in self._lane for f in self._forks)

    def _cut_parents(self, keep: int) -> list[int]:  # your run copied too, at a cut made in lanes
        if not self._lanes_live():
            return super()._cut_parents(keep)
        return [i for i, f in enumerate(self._forks) if not f.lost and (keep == 1 or not f.late)]

    def _cut(self, keep: int, scored: list[Any]) -> None:
        live = [c for c in scored if c is not _LOST]
        found = iter(self._scores(live))
        scores = [math.inf if c is _LOST else next(found) for c in scored]
        yours = scores[0]
        dist = [f.distance(self._bases) for f in self._forks]
        lane = {i: self._lane[f.replica.index][0] for i, f in enumerate(self._forks)
                if f.replica.index in self._lane}
        if not self._laned():  # one race, as hpx.Forks': the lanes' forks and the lr's for the same places
            lane = {}
        lr = [i for i, f in enumerate(self._forks) if i > 0 and not f.late and i not in lane]
        ranked = _ranked([scores[i] for i in lr], [dist[i] for i in lr])
        order = [0, *[lr[j] for j in ranked if math.isfinite(scores[lr[j]])][: keep - 1]]
        deepen: list[int] = []
        for name in dict.fromkeys(v[0] for v in self._lane.values()):
            rungs = [i for i, n in lane.items() if n == name]
            if not rungs:
                continue
            best = min(rungs, key=lambda i: (scores[i], dist[i]))
            if math.isfinite(scores[best]) and scores[best] < yours:
                order.append(best)
                if self._cuts_made == 0 and self._lane[self._forks[best].replica.index][1] == 1:
                    deepen.append(best)
        order += [i for i, f in enumerate(self._forks) if f.late and i not in order]
        order = sorted(order)
        self._record("cut", scores, order)
        deeper = []
        for i in deepen:
            f = self._forks[i]
            name = self._lane[f.replica.index][0]
            knob = next(k for k in self.knobs if k.name == name)
            rungs = knob_rungs(knob, 2)
            if len(rungs) < 2:
                continue
            n = 1 + max(g.replica.index for g in [*self._forks, *deeper])
            g = f.copied(n, factor=1.0, values={**f.values, name: rungs[1]}, shared=self._shared.memo(),
                         sharder=self._sharder)
            g.apply(self.knobs)
            self._lane[g.replica.index] = (name, 2)
            deeper.append(g)
        self._forks = [self._forks[i] for i in order] + deeper
        self._lane = {f.replica.index: self._lane[f.replica.index] for f in self._forks  # the cut ones go:
                      if f.replica.index in self._lane}  # their indices may be given to later forks
        self._cuts_made += 1
