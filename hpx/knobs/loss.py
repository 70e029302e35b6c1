"""Knobs whose value the user's loss reads: label smoothing."""

from __future__ import annotations

from hpx.knobs.base import Knob

__all__ = ["LabelSmoothing"]


class LabelSmoothing(Knob):
    """A label-smoothing coefficient the loss reads (additive spread, kept in ``bounds``).

    hpx writes nothing; the loss reads the replica's value::

        F.cross_entropy(logits, y, label_smoothing=replica.value("smoothing"))

    Compare replicas on a loss without smoothing (a probe signal with its own
    ``loss_fn``): the smoothed training loss is higher for higher smoothing by
    construction, so on it the controller would always push smoothing down.
    """

    def __init__(
        self,
        name: str = "label_smoothing",
        *,
        base: float = 0.0,
        spread: float = 0.0,
        bounds: tuple[float, float] = (0.0, 0.99),
        explore: bool = True,
    ) -> None:
        super().__init__(name, base=base, spread=spread, kind="add", bounds=bounds, explore=explore)
