"""Small helpers the schedule modules share."""

from __future__ import annotations

import math
from numbers import Integral, Real
from typing import Any

import torch


def _lrs(optimizer: torch.optim.Optimizer) -> list[float | torch.Tensor]:
    return [g["lr"].clone() if torch.is_tensor(g["lr"]) else g["lr"] for g in optimizer.param_groups]


def _labels(optimizer: torch.optim.Optimizer) -> tuple[str, ...] | None:
    """Knob labels from the groups' ``"name"`` entries if every group has a distinct string name."""
    names = [g.get("name") for g in optimizer.param_groups]
    if all(isinstance(n, str) and n for n in names) and len(set(names)) == len(names):
        return tuple(names)  # type: ignore[arg-type]
    return None


def _per_group(value: Any, n: int) -> tuple[float, ...]:
    return tuple(float(v) for v in value) if isinstance(value, (list, tuple)) else (float(value),) * n


def _tuple(value: Any) -> Any:
    return tuple(value) if isinstance(value, (list, tuple)) else value


def _any_positive(spread: Any) -> bool:
    values = spread if isinstance(spread, (list, tuple)) else [spread]
    return any(_is_real(v) and v > 0 for v in values)


def _plain(value: Any) -> Any:
    """A tensor setting as a Python number (read once, when the shadow is built)."""
    return value.item() if torch.is_tensor(value) and value.numel() == 1 else value


def _is_int(value: Any) -> bool:
    return isinstance(value, Integral) and not isinstance(value, bool)


def _is_real(value: Any) -> bool:
    return isinstance(value, Real) and not isinstance(value, bool) and math.isfinite(value)
