"""Shared fixtures: small real data (scikit-learn's bundled digits, nothing downloaded)."""

from __future__ import annotations

import pytest
import torch

torch.set_num_threads(1)  # small models on a 2-core machine: threads cost more than they give

# The quick subset, ``pytest -m quick`` (under a minute on two cores): the recommended route in one
# process (hpx.Forks deciding, its winner as plain training, resume, refused mistakes; checkpoints;
# the drop-in schedulers; the README's snippet). Every test of these files but those marked
# ``procs`` (they start other processes: gloo ranks, torchrun). The full suite stays CI's.
QUICK = ("test_forks.py", "test_forks_setups.py", "test_forks_early_step.py", "test_forks_final.py",
         "test_checkpoint.py", "test_schedule.py", "test_readme_use.py", "test_public_names.py")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.path.name in QUICK and item.get_closest_marker("procs") is None:
            item.add_marker(pytest.mark.quick)


@pytest.fixture(scope="session")
def digits() -> tuple[torch.Tensor, torch.Tensor]:
    """The 1797 8x8 digit images as float features in [0, 1], and their labels."""
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    return torch.tensor(x / 16.0, dtype=torch.float32), torch.tensor(y, dtype=torch.long)
