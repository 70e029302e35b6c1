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


_FORKS_SETTINGS = ("multiples", "cuts", "cool", "confidence", "knobs", "knob_start", "knob_design", "on_sync",
                   "share")
"""The :class:`hpx.Forks` settings an integration passes on (the rest come from the framework)."""


def _forks_settings(settings: dict[str, Any], log: Any) -> dict[str, Any]:
    """``settings`` as :class:`hpx.Forks` keyword arguments, the integration's ``log`` called at
    every decision before the ``on_sync`` callbacks the user gave."""
    from hpx.errors import ConfigError
    from hpx.knobs.base import Knob

    only_read = [k.name for k in settings.get("knobs", ())
                 if isinstance(k, Knob) and type(k).bind is Knob.bind]
    ConfigError.check([f"knob {n!r} only publishes a value (replica.value({n!r})), which the framework's own "
                       "step cannot read: fork a setting the knob writes into your module or optimizer "
                       "(hpx.Dropout, hpx.WeightDecay, hpx.ModuleAttribute, hpx.Custom)" for n in only_read])
    on_sync = settings.get("on_sync", ())
    extra = list(on_sync) if isinstance(on_sync, (list, tuple)) else [on_sync]
    return {**{k: v for k, v in settings.items() if k != "on_sync"}, "on_sync": [log, *extra]}


def _fork_metrics(record: Any) -> dict[str, float]:
    """What an integration logs for a decision of :class:`hpx.Forks`: the multiple (and knob
    values) your run trains at after it, every fork's probe loss by name, the end's gain and bar."""
    from hpx.history import _fork_labels

    metrics = {f"hpx/{k}_multiple" if k == "lr" else f"hpx/{k}": float(v) for k, v in record.bases.items()}
    for name, score in zip(_fork_labels(record), record.scores):
        metrics[f"hpx/probe_loss/{name}"] = float(score)
    for name in ("gain", "bar"):  # the end's test: the challenger's lead, and what it had to clear
        if record.metrics and name in record.metrics:
            metrics[f"hpx/{name}"] = float(record.metrics[name])
    return metrics


def _forks_state(forks: Any) -> dict[str, Any]:
    """``forks.state_dict()`` without your run's model, optimizer and scheduler (the framework that
    trains your run saves them)."""
    saved = forks.state_dict()
    saved["forks"][0] = {**saved["forks"][0], "model": None, "optimizer": None, "scheduler": None}
    return saved


def _load_forks_state(forks: Any, saved: dict[str, Any]) -> None:
    """Load a :func:`_forks_state` into ``forks``, your run's part taken from your objects as the
    framework restored them."""
    start = forks._forks[0]
    sched = None if start.scheduler is None else start.scheduler.state_dict()
    saved["forks"][0].update(model=start.model.state_dict(), optimizer=start.optimizer.state_dict(),
                             scheduler=sched)
    forks.load_state_dict(saved)


_COMPILED = ("the framework's step ran your module, not the copy: a forward or training_step compiled in "
             "place (torch.compile(module) given to Lightning, model.forward = torch.compile(model.forward)) "
             "or wrapped by a function that closes over your module keeps calling it from every copy; "
             "train it uncompiled, or compile inside the module's own code")


def _forks_reached(forks: Any, trained: list[Any]) -> None:
    """At the first step, that each fork's step trained that fork (see :func:`hpx.forks.fork._unreached`)."""
    if forks.step_count == 0:
        from hpx.errors import ConfigError
        from hpx.forks.fork import _unreached

        ConfigError.check(_unreached(trained, forks._forks[0], _COMPILED))

