"""Integrations with training frameworks. Each module imports its framework only when used:
``hpx.integrations.lightning`` (PyTorch Lightning: the ``ForksCallback`` and ``AutoLR`` callbacks) and
``hpx.integrations.transformers`` (the Hugging Face ``Trainer``: ``ForksTrainer``, and the
``AutoLR`` callback)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from hpx.signals import _one_batch_problems


def _callback_problems(loss_fn: Any, probe: Any, settings: dict[str, Any], reserved: tuple[str, ...],
                       model: str) -> list[str]:
    """What is wrong with an AutoLR callback's arguments (shared by the integrations)."""
    problems = []
    if probe is None or not isinstance(probe, Iterable):
        problems.append(f"probe must be held-out batches (a list of a few validation batches; "
                        f"got {type(probe).__name__})")
    else:
        problems += _one_batch_problems(probe, "probe", "probe=[{batch}]")
    if not callable(loss_fn):
        problems.append(f"loss_fn must be a function ({model}, batch) -> loss (got {type(loss_fn).__name__})")
    problems += [f"{key} is set by the callback from the trainer; remove {key}=..."
                 for key in reserved if key in settings]
    from hpx.config import EngineConfig
    from hpx.recipe import _CONTROLLER_SETTINGS

    known = {*EngineConfig.model_fields, "on_sync", "knobs", "span", "total_steps"} - {*_CONTROLLER_SETTINGS}
    problems += [f"unknown setting {key!r}: the callback takes hpx.autolr's settings "
                 f"({', '.join(sorted(known))})"
                 for key in settings if key not in known and key not in reserved]
    return problems


def _lr(optimizer: Any) -> float:
    """Parameter group 0's learning rate (a float or a tensor in the group)."""
    lr = optimizer.param_groups[0]["lr"]
    return float(lr.item() if torch.is_tensor(lr) else lr)
