"""A replica: one copy of the model and its optimizer, with its current knob values."""

from __future__ import annotations

from collections.abc import Mapping

import torch

__all__ = ["Replica"]


class Replica:
    """One of the ``N`` replicas.

    Attributes:
        index: global replica index ``r`` in ``0..N-1`` (equal on every rank for
            the same replica).
        model: this replica's model (in the distributed backend, the model the
            user passed, possibly wrapped in DistributedDataParallel).
        optimizer: this replica's optimizer.
    """

    __slots__ = ("_values", "index", "model", "optimizer")

    def __init__(self, index: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer):
        self.index = index
        self.model = model
        self.optimizer = optimizer
        self._values: dict[str, float] = {}

    def value(self, name: str) -> float:
        """The value knob ``name`` has on this replica at the current step."""
        try:
            return self._values[name]
        except KeyError:
            known = ", ".join(repr(k) for k in self._values) or "none"
            raise KeyError(f"no knob named {name!r} (knobs: {known})") from None

    @property
    def values(self) -> Mapping[str, float]:
        """Every knob's current value on this replica (read-only view)."""
        return dict(self._values)

    def __repr__(self) -> str:
        vals = ", ".join(f"{k}={v:.4g}" for k, v in self._values.items())
        return f"Replica(index={self.index}, {vals})"
