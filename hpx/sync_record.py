"""One sync's record (a torch-free module: ``hpx report`` reads histories without torch)."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["SyncRecord"]


@dataclass
class SyncRecord:
    """What happened at one sync (one entry of :attr:`Engine.history`).

    Attributes:
        step: optimizer steps taken when the sync ran.
        bases: every knob's base after the sync.
        values: every knob's values on the ``N`` replicas during the interval
            that ended (before any schedule factor).
        scores: each replica's score (lower is better); ``nan`` where non-finite. The
            signal's scores when the search read them; otherwise (a warm-up, a hold) the
            replicas' mean training loss over the interval, which costs nothing. At a sync
            that scored points placed on the run's displacement: each point's score.
        nonfinite: global indices of replicas left out and reset.
        weights: the controller's ``w_r``, or ``None`` if it did not run.
        direction: the controller's ``D_k`` per knob, or ``None``.
        sigma: the temperature used, or ``None``.
        phase: the search strategy's phase (e.g. ``"stretch"``, ``"hold"``), or ``None``.
        spreads: every knob's spread during the interval that ended (``alpha``;
            ``log(span)`` for a geometric spread).
        applied: every knob's value as applied on each replica at the interval's last
            step (``values`` times the knob's schedule factor: for a
            :class:`~hpx.LearningRate` knob, the learning rate the optimizer used; for a
            :class:`~hpx.LearningRateScale`, still a factor: see ``lr``).
        wall: seconds since the engine was built.
        metrics: what was passed to :meth:`Engine.log <hpx.Engine.log>` since the last
            sync (the latest value of each name).
        points: the multipliers ``rho_p`` of the run's displacement at which ``scores``
            were taken (:class:`~hpx.search.Stretch`), or ``None``.
        searched: whether ``scores`` are the signal's, read by the search (``False``: the
            replicas' training loss over the interval, recorded while the search does not act,
            a different quantity; ``None`` in histories written before this field).
        lr: when a :class:`~hpx.LearningRateScale` knob sets the learning rates (autolr's
            ``"lr"``, whose base, values and applied values are factors on the lr the optimizer
            was built with): the learning rate the optimizer used on each replica at the
            interval's last step, in its first parameter group with a nonzero lr (like
            ``applied``, it is the interval's; ``bases`` are after the sync). ``None``
            without such a knob, and in histories written before this field.
        lr_factor: the name of that knob, shown as ``"<name> factor"`` (:meth:`label`), or
            ``None``.
    """

    step: int
    bases: dict[str, float]
    values: dict[str, list[float]]
    scores: list[float]
    nonfinite: list[int] = field(default_factory=list)
    weights: list[float] | None = None
    direction: dict[str, float] | None = None
    sigma: float | None = None
    phase: str | None = None
    spreads: dict[str, float] | None = None
    applied: dict[str, list[float]] | None = None
    wall: float | None = None
    metrics: dict[str, float] | None = None
    points: list[float] | None = None
    searched: bool | None = None
    lr: list[float] | None = None
    lr_factor: str | None = None

    def label(self, name: str) -> str:
        """How knob ``name`` is shown: ``"lr factor"`` for a factor on the learning rates
        (``lr_factor``), else its name."""
        return f"{name} factor" if name == self.lr_factor else name

    def kept(self) -> int | None:
        """For a decision of :class:`hpx.Forks` (``phase`` ``"cut"`` or ``"end"``): the index of the
        fork whose setting your run trains at after it (yours at a cut); ``None`` for an engine's
        sync."""
        if self.phase not in ("cut", "end"):
            return None
        return next((i for i in range(len(self.scores))
                     if all(self.values[k][i] == v for k, v in self.bases.items())), 0)

    def run_lr(self) -> float | None:
        """The learning rate the run trains at: for :class:`hpx.Forks` your run's after the
        decision, for an engine the mean over the replicas (``None`` when ``lr`` is not known)."""
        if not self.lr:
            return None
        k = self.kept()
        return self.lr[k] if k is not None and k < len(self.lr) else sum(self.lr) / len(self.lr)

    def summary(self) -> str:
        """The learning rate the run trains at (:meth:`run_lr`, when known) and every knob's base,
        as ``"lr 0.00175, lr factor 17.51"``: the text of the sync's INFO log line and the start of
        :class:`~hpx.ProgressBar`'s."""
        parts = [f"lr {self.run_lr():.4g}"] if self.lr else []
        parts += [f"{self.label(name)} {base:.4g}" for name, base in self.bases.items()]
        return ", ".join(parts)
