"""Bracket the best value early in the run, then hold it.

Why not follow the replicas' comparison all run long (what :class:`~hpx.search.HDET`
does)? In shared-gradient mode the replicas differ only by how far each went along
the interval's common update, so a sync compares points on one line: a line search.
Once the fast directions of the loss have settled at the current learning rate,
that comparison prefers a shorter step *whatever the learning rate is* (a shorter
step averages out the noise of the path; measured on every benchmark task, from
10x too low as much as from the right value), and a controller that follows it
walks the lr down for the rest of the run. Early in the run, before the loss has
settled, the comparison does carry the information that matters: from too low a
value the longer steps win by a wide margin, from too high a value the longer
steps lose by a wide margin.

So :class:`Bracket` searches only in a window at the start of the run (8 syncs of
10 steps by default), with a wide geometric spread, and stops as soon as the
optimum is bracketed, the way a line search brackets a minimum:

1. *Burn-in*: at the first ``burn_in`` syncs a multiplicative knob may only move
   down (in the first steps every replica improves fast and the comparison favours
   the longest step at any value, so a preference for the larger value means
   little there, while a preference for the smaller one, against that bias, is
   the sign of a value far too high, whose damage is done within a few steps).
2. *Expand*: at each sync fit the ranks of the replicas' scores against their
   coordinate ``z`` (``log(value / base)`` for a geometric spread, ``value - base``
   for a linear one) with a parabola and move the base to the fit's minimum over
   the explored range ``[-alpha, alpha]``. Ranks, because a replica whose loss
   blew up would otherwise dominate a least-squares fit and pull its minimum
   toward the middle, slowing the retreat exactly when it is most urgent. While
   the minimum sits at the range's edge the base keeps moving, by up to ``span``
   per sync.
3. *Bracketed*: the first time the fitted minimum points back (a reversal), the
   optimum lies between the last two bases: the base goes to their midpoint (in
   ``z``) and the knob stops. A minimum well inside the range (``|z*| <
   interior * alpha``) also stops it, at ``z*``.
4. *Hold*: when every exploring knob has stopped, or the window has passed, the
   spreads drop to ``hold_span`` (1: none, so the run continues as plain training
   at the chosen values and costs nothing more) and syncs become rare.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from hpx.errors import ConfigError
from hpx.search._util import is_int, is_real, parabola_min
from hpx.search.base import Decision, SyncView, worst_filled

__all__ = ["Bracket"]

class Bracket:
    """Find each knob's value in a bracketing window early in the run, then hold it.

    Args:
        total_steps: the run's length in optimizer steps (the hold's syncs are
            spread over what follows the window).
        every: steps between the window's syncs. A fixed number of steps, not a
            fraction of the run: what a comparison measures depends on how many
            steps it spans (over a few steps, while the loss is still in its
            transient, the longer step wins at any learning rate; over many, once
            it has settled, the shorter one does), and that time scale belongs to
            the optimizer and the model, not to the run's length.
        span: the bracket's width: during the window multiplicative knobs spread
            geometrically from ``b / span`` to ``b * span`` (and move by up to
            ``span`` per sync). Additive knobs keep their own ``spread``.
        syncs: syncs in the window, which therefore spans ``every * syncs`` steps
            (at most the whole run).
        burn_in: syncs at the start at which multiplicative knobs may only move down.
        interior: a fitted minimum within ``interior * alpha`` of the base stops
            the knob there; 0 stops knobs only on a reversal.
        hold_span: the geometric spread of multiplicative knobs after the search
            (1: none). Additive knobs then keep ``hold_spread`` times their spread.
        hold_spread: see ``hold_span``.
        hold_syncs: syncs after the window (weights and buffers averaged, no
            search), spread evenly over the rest of the run.
        merge: ``"mean"`` (every finite replica, equally) or ``"best"`` (every
            replica takes the best-scoring one's weights) at the window's syncs.
        ranks: fit the replicas' score *ranks*, not the scores: a replica whose
            loss blew up then counts as the worst, no more, and cannot pull the
            fitted minimum toward the middle of the range.
    """

    def __init__(
        self,
        total_steps: int,
        *,
        every: int = 10,
        span: float = 2.0,
        syncs: int = 8,
        burn_in: int = 2,
        interior: float = 0.0,
        hold_span: float = 1.0,
        hold_spread: float = 0.0,
        hold_syncs: int = 10,
        merge: str = "mean",
        ranks: bool = True,
    ) -> None:
        problems = []
        if not is_int(total_steps) or total_steps < 1:
            problems.append(f"total_steps must be an integer >= 1 (got {total_steps!r})")
        if not is_int(every) or every < 1:
            problems.append(f"every must be an integer >= 1 (got {every!r}): steps between the syncs")
        if not is_real(span) or span <= 1:
            problems.append(f"span must be a number > 1 (got {span!r}): the bracket runs from "
                            "base / span to base * span")
        if not is_int(syncs) or syncs < 1:
            problems.append(f"syncs must be an integer >= 1 (got {syncs!r})")
        if not is_int(burn_in) or burn_in < 0:
            problems.append(f"burn_in must be an integer >= 0 (got {burn_in!r})")
        if not is_real(interior) or not 0 <= interior < 1:
            problems.append(f"interior must be a number in [0, 1) (got {interior!r})")
        if not is_real(hold_span) or hold_span < 1:
            problems.append(f"hold_span must be a number >= 1 (got {hold_span!r})")
        if not is_real(hold_spread) or hold_spread < 0:
            problems.append(f"hold_spread must be a number >= 0 (got {hold_spread!r})")
        if not is_int(hold_syncs) or hold_syncs < 1:
            problems.append(f"hold_syncs must be an integer >= 1 (got {hold_syncs!r})")
        if merge not in ("mean", "best"):
            problems.append(f"merge must be 'mean' or 'best' (got {merge!r})")
        ConfigError.check(problems)
        self.merge = merge
        self.ranks = bool(ranks)
        self.total_steps, self.span = int(total_steps), float(span)
        self.syncs, self.burn_in, self.interior = int(syncs), int(burn_in), float(interior)
        self.hold_span, self.hold_spread = float(hold_span), float(hold_spread)
        self.hold_syncs = int(hold_syncs)
        self.every = int(every)
        self.end = min(self.total_steps, self.every * self.syncs)  # the last step the window covers
        self.hold_every = max(self.every, (self.total_steps - self.end) // self.hold_syncs)
        # the search's state (what a checkpoint holds)
        self.n_syncs = 0
        self.moves: list[float] = []       # per knob, the last move in z (0: none yet)
        self.stopped: list[bool] = []      # per knob
        self.done = False
        self._spreads: torch.Tensor | None = None  # the knobs' spreads as declared (additive ones)

    # --- the Search interface -----------------------------------------------------------

    def start(self, view: SyncView) -> Decision:
        k = len(view.names)
        if not self.moves:
            self.moves, self.stopped = [0.0] * k, [not bool(e) for e in view.explore]
        self._spreads = view.spreads.clone()
        if self.done:  # resumed after the window
            return self._hold(view)
        spreads, spacing = self._bracket_spreads(view)
        return Decision(spreads=spreads, spacing=spacing, next_sync=self._next(view.step),
                        info={"phase": "bracket"})

    def acts_at(self, step: int) -> bool:
        return not self.done and step <= self.end

    def decide(self, view: SyncView) -> Decision:
        self.n_syncs += 1
        if self.done:
            return Decision(next_sync=self.hold_every, info={"phase": "hold"})
        burn = self.n_syncs <= self.burn_in
        if burn and view.step + self._next(view.step) > self.end:  # the window ends before the search began
            self.done = True
            return self._hold(view)
        bases = view.bases.clone()
        fitted: dict[str, float] = {}
        for i, name in enumerate(view.names):
            if self.stopped[i]:
                continue
            best = self._fit(view, i)
            if best is None:  # fewer than two distinct finite values: nothing to compare
                continue
            fitted[name] = best
            if burn and not (best < 0 and view.kinds[i] == "mul"):
                continue  # the first syncs favour the larger value at any value: only a fall counts
            prev = self.moves[i]
            if prev * best < 0:  # the fit points back: the optimum is between the last two bases
                move, self.stopped[i] = -prev / 2, True
            else:
                move = best
                if abs(best) < self.interior * float(view.spreads[i]):
                    self.stopped[i] = True
            self.moves[i] = move
            b = float(bases[i])
            bases[i] = b * math.exp(move) if view.spacing[i] == "log" else b + move
        info = {"phase": "burn-in" if burn else "bracket", "fitted": fitted}
        merge = None
        if self.merge == "best" and bool(view.finite.any()):
            merge = torch.zeros(view.n_replicas, dtype=torch.float64)
            merge[int(torch.where(view.finite, view.scores, math.inf).argmin())] = 1.0
        if all(self.stopped) or view.step + self._next(view.step) > self.end:
            self.done = True
            hold = self._hold(view)
            return Decision(bases=bases, spreads=hold.spreads, spacing=hold.spacing, merge=merge,
                            next_sync=hold.next_sync, info={**info, "phase": "bracketed"})
        return Decision(bases=bases, next_sync=self._next(view.step), merge=merge, info=info)

    def state_dict(self) -> dict[str, Any]:
        return {"n_syncs": self.n_syncs, "moves": list(self.moves), "stopped": list(self.stopped),
                "done": self.done}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.n_syncs = int(state["n_syncs"])
        self.moves = [float(m) for m in state["moves"]]
        self.stopped = [bool(s) for s in state["stopped"]]
        self.done = bool(state["done"])

    def __repr__(self) -> str:
        return (f"Bracket(total_steps={self.total_steps}, every={self.every}, span={self.span:g}, "
                f"syncs={self.syncs}, burn_in={self.burn_in}, hold_span={self.hold_span:g})")

    # --- helpers ---------------------------------------------------------------------------

    def _next(self, step: int) -> int:
        """Steps to the next sync in the window (the last one lands on its end)."""
        return max(1, min(self.every, self.end - step)) if step < self.end else self.hold_every

    def _bracket_spreads(self, view: SyncView) -> tuple[torch.Tensor, tuple[str, ...]]:
        spreads = view.spreads.clone()
        spacing = list(view.spacing)
        for i, kind in enumerate(view.kinds):
            if kind == "mul" and bool(view.explore[i]):
                spreads[i], spacing[i] = math.log(self.span), "log"
        return spreads, tuple(spacing)

    def _hold(self, view: SyncView) -> Decision:
        assert self._spreads is not None
        spreads = self._spreads * self.hold_spread
        spacing = list(view.spacing)
        for i, kind in enumerate(view.kinds):
            if kind == "mul":
                spreads[i], spacing[i] = math.log(self.hold_span), "log"
        return Decision(spreads=spreads, spacing=tuple(spacing), next_sync=self.hold_every,
                        info={"phase": "hold"})

    def _fit(self, view: SyncView, i: int) -> float | None:
        """The minimum over ``[-alpha, alpha]`` of a parabola fitted to score (or its rank)
        against ``z``, as a move of the base."""
        s = worst_filled(view.scores)  # a replica that blew up counts as the worst, not as absent
        if s is None:
            return None
        v = view.values[i]
        b = float(view.bases[i])
        z = (v / b).log() if view.spacing[i] == "log" else v - b
        w = float(view.spreads[i])
        distinct = torch.unique(z).numel()
        if distinct < 2 or w <= 0:
            return None
        if not float(s.max() - s.min()) > 0:
            return 0.0  # every replica scored the same: no preference
        if self.ranks:  # a replica that blew up must not drag the fit's minimum toward the middle
            s = s.argsort().argsort().to(torch.float64)
        y = (s - s.mean()) / s.std()
        zn = z / w  # in [-1, 1]: keeps the fit well conditioned at any scale
        return parabola_min(zn, y, distinct >= 3) * w

