"""Stretch the run: find the learning rate by asking how far the run *so far* should have gone.

Comparing replicas that trained one interval at different learning rates is a line search
along that interval's update, and its answer depends on how many steps the interval spans
more than on the learning rate (short intervals favour the longer step at any value, long
ones the shorter step). :class:`Stretch` asks a question tied to the whole run instead.

Let ``a`` be the parameters the run started from and ``theta`` the consensus now. Replica
``r`` is scored at ``a + rho_r (theta - a)``: the run's whole displacement, shrunk
(``rho < 1``) or stretched (``rho > 1``). To first order, that point is where the run would
be had every step so far been taken with the learning rate times ``rho_r`` (the view of
learning-rate tuners that rescale an optimizer's accumulated update, such as Mechanic):

* a run whose learning rate is too low is behind: continuing its displacement further
  lowers the held-out loss, and the fitted best ``rho`` is above 1;
* a run whose learning rate is too high carries noise (and, at worst, damage) in its
  displacement: shrinking it toward the start lowers the loss, and the best ``rho`` is
  below 1;
* at a good learning rate the two balance near ``rho = 1``.

At each sync of its window (the first ``until`` of the run, ``syncs`` syncs) :class:`Stretch`
fits a parabola to the held-out scores against ``log rho`` and multiplies the learning-rate
knob's base by the fitted ``rho*`` (within ``[1/span, span]``). When ``rho* < 1`` the
consensus also moves to the shrunk point (it scored better, and shrinking undoes part of
what a too-high value did); a stretch is not applied to the weights, only to the learning
rate (applying it would use up the very evidence, the run lagging behind, that lets the
learning rate keep rising). During the first ``burn_in`` of the run only shrinks count:
every run is behind at its start, at any learning rate. After the window, until
``guard_until`` of the run, the syncs go on and act on shrinks only: late in a run a
longer path looks better whatever the learning rate (the schedule anneals), but a run
that does better shrunk is one whose learning rate became too high or that started to
overfit, and both are seen only late.

Between syncs every replica trains at the base value (the knob's spread is 0): the
exploration happens at the syncs, on held-out data, and costs no training quality.
After ``guard_until`` the run is plain data-parallel training at the value found.

Since the replicas are identical between syncs, the search needs no more of them than
the data parallelism has: ``points`` multipliers are scored at each sync, by the replicas
in turn when there are fewer replicas than points (one model in one process scores all of
them, one after the other). The cost is the same either way: ``points`` forward passes
over the probe per sync.

It wants held-out data to score on (:class:`~hpx.ProbeStream`): a batch the replicas just
trained on slightly rewards the stretched points, and one batch is noisier than a probe.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from hpx.errors import ConfigError
from hpx.search._util import is_int, is_real, parabola_min
from hpx.search.base import Decision, SyncView, worst_filled

__all__ = ["Stretch"]

class Stretch:
    """Move the learning rate toward the scale the whole run so far says is best, early in
    the run, then hold it.

    Args:
        total_steps: the run's length in optimizer steps.
        until: the share of the run in which the search acts (its window).
        syncs: syncs in the window, evenly spaced (at least one step apart).
        span: points are scored from ``1/span`` to ``span`` times the run's displacement
            (geometrically spaced), and one sync moves the base by at most ``span``.
        burn_in: the share of the run at the start in which only a shrink (``rho* < 1``)
            moves the base.
        guard_until: the share of the run until which syncs go on after the window, at the
            same spacing, acting on shrinks only (a run whose learning rate has become too
            high, or that has started to overfit, does better shrunk; a longer path looks
            better late in any annealed run, so stretches no longer count). ``until``: none.
        hold_syncs: syncs after the window (the replicas are identical then; they only
            keep floating buffers averaged), spread evenly over the rest of the run.
        knob: the name of the multiplicative knob searched (default: the first
            multiplicative knob that explores). Other knobs keep their spreads and bases.
        points: multipliers scored per sync (at least 2): the smallest multiple of the
            replica count ``N`` that is ``>= points`` (``N`` itself when ``N >= points``).
        dead_zone: a fitted shrink with ``log rho*`` down to ``-dead_zone`` moves nothing, and a
            larger one moves the base by the excess only; a stretch moves it by the whole
            reading. The reading drifts down as a run goes on, at any learning rate (the
            short-horizon bias; on the learning-rate suite's design tasks its median at a good
            learning rate is 0.83-1.08), and a run of small shrinks is how a good start used to
            be lost. ``0``: every reading moves the base.

    Symbols: ``rho_p`` is point ``p``'s multiplier of the displacement (``Decision.placement``),
    ``a`` the run's starting parameters, ``theta`` the consensus.
    """

    def __init__(
        self,
        total_steps: int,
        *,
        until: float = 0.4,
        syncs: int = 40,
        span: float = 1.5,
        burn_in: float = 0.1,
        guard_until: float = 0.9,
        hold_syncs: int = 10,
        knob: str | None = None,
        points: int = 4,
        dead_zone: float = 0.2,
    ) -> None:
        problems = []
        if not is_int(total_steps) or total_steps < 1:
            problems.append(f"total_steps must be an integer >= 1 (got {total_steps!r})")
        if not is_real(until) or not 0 < until <= 1:
            problems.append(f"until must be a share of the run in (0, 1] (got {until!r})")
        if not is_int(syncs) or syncs < 1:
            problems.append(f"syncs must be an integer >= 1 (got {syncs!r})")
        if not is_real(span) or span <= 1:
            problems.append(f"span must be a number > 1 (got {span!r}): replicas are scored from "
                            "1/span to span times the run's displacement")
        if not is_real(burn_in) or not 0 <= burn_in < 1:
            problems.append(f"burn_in must be a share of the run in [0, 1) (got {burn_in!r})")
        if not is_real(guard_until) or not (is_real(until) and until <= guard_until <= 1):
            problems.append(f"guard_until must be a share of the run in [until, 1] (got {guard_until!r} "
                            f"with until={until!r}): where the shrink-only phase ends")
        if not is_int(hold_syncs) or hold_syncs < 1:
            problems.append(f"hold_syncs must be an integer >= 1 (got {hold_syncs!r})")
        if knob is not None and not isinstance(knob, str):
            problems.append(f"knob must be a knob's name or None (got {knob!r})")
        if not is_real(dead_zone) or not 0 <= dead_zone < math.inf:
            problems.append(f"dead_zone must be a number >= 0 (got {dead_zone!r}): the |log rho*| that "
                            "moves nothing")
        if not is_int(points) or points < 2:
            problems.append(f"points must be an integer >= 2 (got {points!r}): the multipliers scored "
                            "per sync (a parabola needs 3; 2 give a line)")
        ConfigError.check(problems)
        self.total_steps, self.until, self.syncs = int(total_steps), float(until), int(syncs)
        self.span, self.burn_in = float(span), float(burn_in)
        self.hold_syncs, self.knob, self.points = int(hold_syncs), knob, int(points)
        self.dead_zone = float(dead_zone)
        self.end = max(1, round(self.until * self.total_steps))  # the window's last step
        self.every = max(1, self.end // self.syncs)
        self.burn_steps = self.burn_in * self.total_steps
        self.guard_until = float(guard_until)
        self.guard_end = max(self.end, round(self.guard_until * self.total_steps))
        self.hold_every = max(1, (self.total_steps - self.guard_end) // self.hold_syncs)
        # the search's state (what a checkpoint holds)
        self.n_syncs = 0
        self.done = False
        self.moves: list[float] = []  # log rho* applied at each sync of the window

    # --- the Search interface -----------------------------------------------------------

    def start(self, view: SyncView) -> Decision:
        i = self._index(view)
        if self.done:  # resumed after the window
            return Decision(next_sync=self.hold_every, info={"phase": "hold"})
        spreads = view.spreads.clone()
        spreads[i] = 0.0  # every replica trains at the base value
        return Decision(spreads=spreads, placement=self._rho(view.n_replicas),
                        next_sync=self._next(view.step), info={"phase": "stretch"})

    def acts_at(self, step: int) -> bool:
        return not self.done and step <= self.guard_end

    def decide(self, view: SyncView) -> Decision:
        self.n_syncs += 1
        if self.done:
            return Decision(next_sync=self.hold_every, info={"phase": "hold"})
        i = self._index(view)
        rho = self._rho(view.n_replicas)
        # the points scored (None: the replicas were scored unplaced, e.g. after an elastic resume)
        best = None if view.placement is None else self._fit(view.placement.log(), view.scores)
        burn = view.step <= self.burn_steps
        guard = view.step > self.end
        # a stretch moves by the whole reading; a shrink only by what it exceeds the dead zone
        zoned = None if best is None else (best if best > 0 else min(best + self.dead_zone, 0.0))
        move = 0.0 if zoned is None else (min(zoned, 0.0) if burn or guard else zoned)
        self.moves.append(move)
        bases = view.bases.clone()
        bases[i] = float(bases[i]) * math.exp(move)
        # a shrink also moves the weights; a stretch does not; a sync that scored no placed points
        # (after an elastic resume) has nothing to land on
        land = None if view.placement is None else math.exp(min(move, 0.0))
        info: dict[str, Any] = {"phase": "burn-in" if burn else "guard" if guard else "stretch",
                                "rho": math.exp(best) if best is not None else None}
        if view.step + self._next(view.step) > self.guard_end:
            self.done = True
            return Decision(bases=bases, land=land, next_sync=self.hold_every, info=info)
        return Decision(bases=bases, land=land, placement=rho, next_sync=self._next(view.step),
                        info=info)

    def state_dict(self) -> dict[str, Any]:
        return {"n_syncs": self.n_syncs, "done": self.done, "moves": list(self.moves)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.n_syncs = int(state["n_syncs"])
        self.done = bool(state["done"])
        self.moves = [float(m) for m in state["moves"]]

    def settings(self) -> dict[str, Any]:
        """What a checkpoint records and a resumed run must share (the engine refuses a resume
        with other values: the search's schedule of syncs and its reach depend on them)."""
        return {"total_steps": self.total_steps, "span": self.span, "until": self.until, "syncs": self.syncs,
                "burn_in": self.burn_in, "guard_until": self.guard_until, "points": self.points}

    def __repr__(self) -> str:
        return (f"Stretch(total_steps={self.total_steps}, until={self.until:g}, syncs={self.syncs}, "
                f"span={self.span:g}, burn_in={self.burn_in:g}, guard_until={self.guard_until:g}, "
                f"points={self.points}, dead_zone={self.dead_zone:g})")

    # --- helpers ---------------------------------------------------------------------------

    def _index(self, view: SyncView) -> int:
        """The searched knob's position in the view."""
        if self.knob is not None:
            if self.knob not in view.names:
                raise ConfigError([f"Stretch searches knob {self.knob!r}, but the run declares "
                                   f"{list(view.names)}"])
            i = view.names.index(self.knob)
            if view.kinds[i] != "mul":
                raise ConfigError([f"Stretch searches a multiplicative knob (a learning rate); "
                                   f"{self.knob!r} is additive"])
            return i
        for i, (kind, explore) in enumerate(zip(view.kinds, view.explore.tolist())):
            if kind == "mul" and explore:
                return i
        raise ConfigError([f"Stretch needs a multiplicative knob that explores (a learning rate); the "
                           f"run declares {list(view.names)} with kinds {list(view.kinds)}"])

    def _rho(self, n: int) -> torch.Tensor:
        """``[P]`` multipliers for ``n`` replicas, geometric from ``1/span`` to ``span``,
        ascending with the index (``P``: the smallest multiple of ``n`` that is ``>= points``)."""
        p = n * -(-self.points // n)
        u = torch.linspace(-1.0, 1.0, p, dtype=torch.float64)
        return torch.exp(u * math.log(self.span))

    def _next(self, step: int) -> int:
        """Steps to the next sync in the window (the last one lands on its end)."""
        end = self.guard_end
        return max(1, min(self.every, end - step)) if step < end else self.hold_every

    def _fit(self, z: torch.Tensor, scores: torch.Tensor) -> float | None:
        """``log rho*``: the minimum over the scored range of a parabola fitted to the scores
        against ``log rho`` (a line for two replicas); ``None`` when nothing can be compared."""
        s = worst_filled(scores)  # a point that blew up counts as the worst, not as absent
        if s is None or z.numel() < 2:
            return None
        if not float(s.max() - s.min()) > 0:
            return 0.0  # every point scored the same: no preference
        w = float(z.abs().max())
        y = (s - s.mean()) / s.std()
        zn = z / w
        return parabola_min(zn, y, z.numel() >= 3) * w

