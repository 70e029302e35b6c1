"""A tiny model, its loss and batches of the digits, shared by the search and recipe tests."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))


def ce(rep, batch) -> torch.Tensor:
    return F.cross_entropy(rep.model(batch[0]), batch[1])


def data(digits, n: int, seed: int = 0, size: int = 32) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``n`` batches of ``size`` examples drawn (with a seeded generator) from the first 1400 digits."""
    x, y = digits
    g = torch.Generator().manual_seed(seed)
    return [(x[i], y[i]) for i in (torch.randint(0, 1400, (size,), generator=g) for _ in range(n))]
