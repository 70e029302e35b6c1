"""Shared fixtures: small real data (scikit-learn's bundled digits, nothing downloaded)."""

from __future__ import annotations

import pytest
import torch

torch.set_num_threads(1)  # small models on a 2-core machine: threads cost more than they give


@pytest.fixture(scope="session")
def digits() -> tuple[torch.Tensor, torch.Tensor]:
    """The 1797 8x8 digit images as float features in [0, 1], and their labels."""
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    return torch.tensor(x / 16.0, dtype=torch.float32), torch.tensor(y, dtype=torch.long)
