"""The decisions of a :class:`hpx.Forks` run: the knob forks branched late from your run, a cut to
the forks that score best on the probe, and the end's test between your run and the best
challenger, whose winner is loaded into your objects. A mixin of ``Forks``: it reads and writes
the search's own attributes."""

from __future__ import annotations

import logging
import math
from typing import Any

from hpx.forks.fork import _LOST, _ranked
from hpx.forks.late import corrected

log = logging.getLogger("hpx")


class _Decisions:
    """Branches, cuts and the end (see the module's docstring)."""

    _forks: Any
    _clones: Any
    _shared: Any
    _sharder: Any
    _late: Any
    _bases: Any
    _initial: Any
    knobs: Any
    collective: Any
    confidence: float
    step_count: int

    def _branch(self) -> None:
        """The knob forks branch from your run as it is now (``knob_start``), each a copy of it at
        its knob values, and go to the end uncut."""
        start = self._forks[0]
        if start.lost:  # a lost run has nothing to branch from
            return
        n = 1 + max(f.replica.index for f in [*self._forks, *self._clones])
        memo = self._shared.memo()
        for j, values in enumerate(self._late):
            fork = start.copied(n + j, factor=start.factor, values=dict(values), shared=memo,
                                sharder=self._sharder)
            fork.apply(self.knobs)
            fork.late = True
            self._forks.append(fork)
        log.info("hpx.Forks: step %d: %d knob fork(s) branched from your run", self.step_count,
                 len(self._late))

    # --- the decisions ----------------------------------------------------------------------

    def _cut_parents(self, keep: int) -> list[int]:
        """The forks a cut to ``keep`` anneals a copy of: every challenger still trained but those
        branched late (kept by every cut, uncut); your run only for the final decision (a cut to 2
        or more keeps it whatever its score, so it needs no copy, and the peak holds one fewer)."""
        return [i for i, f in enumerate(self._forks)
                if (i > 0 or keep == 1) and not f.lost and (keep == 1 or not f.late)]

    def _cut(self, keep: int, scored: list[Any]) -> None:
        """Keep the ``keep`` forks whose ``scored`` stand-ins (themselves or annealed copies) score
        best on the probe (ties: the nearer to your run), your run always among them."""
        scores, read = self._cut_scores(scored)  # yours only where a decision reads it (else nan)
        if self._agreed(not any(map(math.isfinite, scores))):  # no stand-in is finite: are the forks?
            self._raise_if_all_lost(self._scores(self._forks))  # then nothing is left to train: say so now
        ranked = scores if read else [-math.inf, *scores[1:]]  # the challengers kept do not depend on it
        order = _ranked(ranked, [f.distance(self._bases) for f in self._forks])[:keep]
        if 0 not in order:
            order = [*order[: keep - 1], 0]
        order = [i for i in order if i == 0 or math.isfinite(scores[i])]  # a blown-up challenger goes
        order += [i for i, f in enumerate(self._forks) if f.late and i not in order]  # to the end uncut
        if read:
            self._check_probe_loss(scores[0])
        order, lost = self._agreed((sorted(order), read and not math.isfinite(scores[0])))
        if lost:
            self._forks[0].lost = True  # kept for the final comparison, no longer trained
        rec = self._record("cut", scores, order)
        self._forks = [self._forks[i] for i in order]
        self._notify(rec)  # once the cut is made: a callback that raises leaves it made

    def _finish(self, scored: list[Any] | None = None) -> None:
        """The final decision: your run, or the best challenger if it wins with confidence (or your
        run was lost and it was not), judged on ``scored`` (the forks themselves at the run's end;
        before it, their annealed copies, ``_LOST`` for a lost one); the winner (the fork, not its
        copy) is loaded into your objects."""
        stand = list(self._forks) if scored is None else scored
        live = [c for c in stand if c is not _LOST]
        found, parts = self._scored(live) if live else ([], [])
        held = dict(zip(map(id, live), parts))  # the end's test reads this pass when it can
        scores = [math.inf if c is _LOST else found[live.index(c)] for c in stand]
        if scored is not None and self._agreed(not any(map(math.isfinite, scores))):
            scores, parts = self._scored(self._forks)  # no copy is finite: are the forks? (as they are)
            stand, held = list(self._forks), dict(zip(map(id, self._forks), parts))
        self._raise_if_all_lost(scores)
        if stand[0] is self._forks[0] and not self._forks[0].lost:  # a copy's blow-up is no probe error
            self._check_probe_loss(scores[0])
        best = _ranked(scores, [f.distance(self._bases) for f in self._forks])[0]
        gain = bar = math.nan
        if best != 0 and math.isfinite(scores[0]):
            initial = self._initial if self._initial is not None else math.nan
            lost = scores[0] >= initial > scores[best]  # False when the initial score is unknown
            if not lost and self.confidence > 0:
                gain = self._gain(stand[best], stand[0], (held.get(id(stand[best])), held.get(id(stand[0]))))
                rivals = sum(math.isfinite(x) for x in scores[1:])  # the best of several: a higher bar
                bar = corrected(self.confidence, rivals)
                if gain < bar:
                    best = 0
        best = self._agreed(best)
        rec = self._record("end", scores, [best], gain, bar)
        self._adopt(best)
        self._notify(rec)

    def _adopt(self, i: int) -> None:
        start = self._forks[0]
        if i != 0:
            start.take(self._forks[i], self.knobs)
        self._forks = [start]
        self._shared.params, self._shared.buffers = [], []  # one run left: nothing is shared any more
        self.factor, self.values, self.decided = start.factor, dict(start.values), True

    def _agreed(self, decision: Any) -> Any:
        """Rank 0's decision on every rank (they score the same weights, but a decision must be one)."""
        if self.collective.world_size == 1:
            return decision
        return self.collective.broadcast_object(decision, 0)
