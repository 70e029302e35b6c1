"""The interface between the engine and a search strategy.

At every sync the engine hands the strategy a :class:`SyncView` (what the replicas
were given and how they scored) and applies the :class:`Decision` it returns: new
bases, new spreads, when to sync next, and how to merge the replicas' weights. The
engine knows nothing else about how a strategy searches, and a strategy knows
nothing about models, optimizers or processes: every rank calls it with the same
view and gets the same decision, so ranks agree without further communication.

A strategy is any object with ``start``, ``decide``, ``acts_at``, ``state_dict``
and ``load_state_dict`` (:class:`Search`). hpx ships two: :class:`~hpx.search.HDET`
(the paper's zero-order controller and hpx's log-space variant of it) and
:class:`~hpx.search.Bracket` (bracket the optimum early, then hold).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch

__all__ = ["Decision", "Search", "SyncView", "worst_filled"]


@dataclass(frozen=True)
class SyncView:
    """What a strategy sees at a sync (all tensors float64 on the CPU).

    Attributes:
        step: optimizer steps taken so far (the sync happens after this step).
        n_replicas: ``N``.
        names: the knobs' names, in order (``K`` of them).
        kinds: each knob's kind, ``"mul"`` or ``"add"``.
        explore: ``[K]`` bool, which knobs may move.
        spacing: each knob's spread spacing, ``"linear"`` or ``"log"``.
        spreads: ``[K]`` each knob's ``alpha`` in its spacing.
        bases: ``[K]`` the current bases ``b_k``.
        bounds: ``[K, 2]`` each knob's ``(low, high)``.
        values: ``[K, N]`` knob ``k``'s value on replica ``r`` during the interval
            that ended (before any schedule factor).
        scores: ``[N]`` each replica's score, lower is better; ``nan`` where the
            replica's score or weights are non-finite, or it had more non-finite losses in
            the interval than the best replica (:func:`worst_filled` turns those into the
            worst scores, as a strategy should count them). At a sync that scored placed
            points (``placement`` is set): ``[P]``, each point's score.
        placement: ``[P]`` the multipliers ``rho_p`` of the run's displacement that were
            scored at this sync (the previous decision's :attr:`Decision.placement`), or
            ``None`` when the replicas were scored where they trained.
    """

    step: int
    n_replicas: int
    names: tuple[str, ...]
    kinds: tuple[str, ...]
    explore: torch.Tensor
    spacing: tuple[str, ...]
    spreads: torch.Tensor
    bases: torch.Tensor
    bounds: torch.Tensor
    values: torch.Tensor
    scores: torch.Tensor
    placement: torch.Tensor | None = None

    @property
    def finite(self) -> torch.Tensor:
        """``[N]`` bool (``[P]`` at a placed sync): replicas (points) whose score (and
        weights) are finite."""
        return torch.isfinite(self.scores)


@dataclass(frozen=True)
class Decision:
    """What the engine does after a sync. ``None`` everywhere leaves things as they are.

    Attributes:
        bases: ``[K]`` new bases (the engine keeps them inside each knob's bounds;
            knobs that do not explore are not moved).
        spreads: ``[K]`` new ``alpha`` per knob, in ``spacing``, for the values
            drawn now.
        spacing: new spacing per knob (``"log"`` only for multiplicative knobs).
        next_sync: steps until the next sync (``>= 1``); ``None``: the engine's
            ``sync_every``.
        merge: ``[N]`` non-negative weight of each replica in the consensus that
            every replica is set to (a replica with weight 0 is left out and reset
            from the others); ``None``: equal weights over finite replicas.
            Non-finite replicas always get weight 0.
        placement: ``[P]`` positive multipliers ``rho_p``, ``P`` the number of replicas
            ``N`` or a multiple of it: at the next sync, before anything is scored, the
            engine averages the replicas and scores the points ``anchor + rho_p *
            (consensus - anchor)``, where the anchor is the parameters the run started from
            (buffers stay at the consensus): point ``p`` on replica ``p % N``, in round
            ``p // N`` (with fewer replicas than points, each replica scores several in
            turn, on the same data). The scores then compare the run's whole displacement
            stretched or shrunk; that sync's decision gives ``land`` instead of ``merge``.
            Only a strategy whose :meth:`Search.start` decision asks for a placement may
            ask for one later (the engine keeps the anchor, one copy of the parameters, from
            the start on); the first decision without one frees the anchor for good.
        land: at a sync that scored placed points: every replica moves to ``anchor + land
            * (consensus - anchor)`` (``None``: back to the consensus, ``land = 1``).
        info: diagnostics for the history (``weights``, ``direction``, ``sigma``,
            ``phase``, ...).
    """

    bases: torch.Tensor | None = None
    spreads: torch.Tensor | None = None
    spacing: tuple[str, ...] | None = None
    next_sync: int | None = None
    merge: torch.Tensor | None = None
    placement: torch.Tensor | None = None
    land: float | None = None
    info: dict[str, Any] = field(default_factory=dict)


def worst_filled(scores: torch.Tensor) -> torch.Tensor | None:
    """``scores`` with every non-finite entry replaced by a score worse than the worst finite
    one (by the finite scores' range, or by ``max(|worst|, 1)`` when they are all equal).

    A replica that blew up or collapsed is evidence against its values: a strategy must
    count it as the worst, not leave it out (which would let a value that breaks training
    keep pulling the base). ``None`` when no score is finite (nothing to compare).
    """
    finite = torch.isfinite(scores)
    if not finite.any():
        return None
    if finite.all():
        return scores
    ok = scores[finite]
    hi, lo = float(ok.max()), float(ok.min())
    gap = hi - lo if hi > lo else max(abs(hi), 1.0)
    return torch.where(finite, scores, hi + gap)


@runtime_checkable
class Search(Protocol):
    """A search strategy: decides at each sync from the replicas' scores."""

    def start(self, view: SyncView) -> Decision:
        """Called once when the engine is built (``view.step`` is the start step and
        ``view.scores`` is empty): the initial spreads and the first sync."""
        ...

    def decide(self, view: SyncView) -> Decision:
        """Called at every sync, after the scores are gathered and before the merge."""
        ...

    def acts_at(self, step: int) -> bool:
        """Whether a sync at ``step`` reads the scores (the engine then insists that
        every replica recorded a loss when the signal is the training loss)."""
        ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...
