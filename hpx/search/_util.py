"""Helpers the search strategies share: setting checks and the fitted parabola's minimum."""

from __future__ import annotations

import math
from numbers import Integral, Real

import torch

_GRID = 201  # points on which the fitted parabola's minimum is looked up


def is_int(x: object) -> bool:
    return isinstance(x, Integral) and not isinstance(x, bool)


def is_real(x: object) -> bool:
    return isinstance(x, Real) and not isinstance(x, bool) and math.isfinite(x)


def parabola_min(zn: torch.Tensor, y: torch.Tensor, quadratic: bool) -> float:
    """Where in ``[-1, 1]`` the least-squares parabola (a line unless ``quadratic``) through
    ``(zn, y)`` is lowest, looked up on a grid."""
    cols = [torch.ones_like(zn), zn] + ([zn * zn] if quadratic else [])
    coef = torch.linalg.lstsq(torch.stack(cols, 1), y[:, None]).solution.reshape(-1)
    grid = torch.linspace(-1.0, 1.0, _GRID, dtype=torch.float64)
    pred = coef[0] + coef[1] * grid + (coef[2] * grid * grid if quadratic else 0.0)
    return float(grid[int(pred.argmin())])
