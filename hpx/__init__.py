"""hpx: hyperparameter search from the data-parallel replicas of one training run.

An implementation of HDET (Hyperparameter-Divergent Ensemble Training): each of
``N`` replicas trains with its own values of some scalar knobs, spread
symmetrically around shared bases (fan-out); every ``T`` steps the replicas'
weights are averaged (converge) and a zero-order controller moves every base
toward the better-scoring side.
"""

# Names load on first use (PEP 562), so that ``import hpx`` and the ``hpx`` command do not
# import torch until something needs it (``hpx report`` prints a table in well under a second).
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_LAZY = {
    "AttentionTemperature": "hpx.knobs",
    "BackendError": "hpx.errors",
    "Collective": "hpx.backends",
    "ConfigError": "hpx.errors",
    "ConsistencyError": "hpx.errors",
    "Controller": "hpx.controller",
    "ControllerStep": "hpx.controller",
    "Custom": "hpx.knobs",
    "Dropout": "hpx.knobs",
    "Engine": "hpx.engine",
    "EngineConfig": "hpx.config",
    "ExploreLR": "hpx.schedule",
    "HpxError": "hpx.errors",
    "InProcess": "hpx.backends",
    "IntervalLoss": "hpx.signals",
    "Knob": "hpx.knobs",
    "Knobs": "hpx.registry",
    "LabelSmoothing": "hpx.knobs",
    "LearningRate": "hpx.knobs",
    "LearningRateScale": "hpx.knobs",
    "ModuleAttribute": "hpx.knobs",
    "NonFiniteError": "hpx.errors",
    "OneCycleLR": "hpx.schedule",
    "OneCyclePlan": "hpx.schedule",
    "ProbeStream": "hpx.signals",
    "ProgressBar": "hpx.progress",
    "Replica": "hpx.replica",
    "SharedBatch": "hpx.signals",
    "Signal": "hpx.signals",
    "SyncContext": "hpx.signals",
    "SyncRecord": "hpx.sync_record",
    "TensorBoard": "hpx.tensorboard",
    "WeightDecay": "hpx.knobs",
    "autolr": "hpx.recipe",
    "explore_knobs": "hpx.schedule",
    "format_history": "hpx.history",
    "load_checkpoint": "hpx.checkpoint",
    "load_history": "hpx.history",
    "plot_history": "hpx.history",
    "save_checkpoint": "hpx.checkpoint",
    "save_history": "hpx.history",
    "search": "hpx.search",
    "slot_offsets": "hpx.knobs",
    "softmax_weights": "hpx.controller",
}

__all__ = [
    "AttentionTemperature",
    "BackendError",
    "Collective",
    "ConfigError",
    "ConsistencyError",
    "Controller",
    "ControllerStep",
    "Custom",
    "Dropout",
    "Engine",
    "EngineConfig",
    "ExploreLR",
    "HpxError",
    "InProcess",
    "IntervalLoss",
    "Knob",
    "Knobs",
    "LabelSmoothing",
    "LearningRate",
    "LearningRateScale",
    "ModuleAttribute",
    "NonFiniteError",
    "OneCycleLR",
    "OneCyclePlan",
    "ProbeStream",
    "ProgressBar",
    "Replica",
    "SharedBatch",
    "Signal",
    "SyncContext",
    "SyncRecord",
    "TensorBoard",
    "WeightDecay",
    "__version__",
    "autolr",
    "explore_knobs",
    "format_history",
    "load_checkpoint",
    "load_history",
    "plot_history",
    "save_checkpoint",
    "save_history",
    "search",
    "slot_offsets",
    "softmax_weights",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'hpx' has no attribute {name!r}")
    loaded = importlib.import_module(module)
    value = loaded if module == f"hpx.{name}" else getattr(loaded, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(__all__) | {k for k in globals() if k.startswith("__")})


if TYPE_CHECKING:  # what static tools see: the same names, imported eagerly
    from hpx import search
    from hpx.backends import Collective, InProcess
    from hpx.checkpoint import load_checkpoint, save_checkpoint
    from hpx.config import EngineConfig
    from hpx.controller import Controller, ControllerStep, softmax_weights
    from hpx.engine import Engine, SyncRecord
    from hpx.errors import BackendError, ConfigError, ConsistencyError, HpxError, NonFiniteError
    from hpx.history import format_history, load_history, plot_history, save_history
    from hpx.knobs import (
        AttentionTemperature,
        Custom,
        Dropout,
        Knob,
        LabelSmoothing,
        LearningRate,
        LearningRateScale,
        ModuleAttribute,
        WeightDecay,
        slot_offsets,
    )
    from hpx.recipe import autolr
    from hpx.registry import Knobs
    from hpx.replica import Replica
    from hpx.schedule import ExploreLR, OneCycleLR, OneCyclePlan, explore_knobs
    from hpx.signals import IntervalLoss, ProbeStream, SharedBatch, Signal, SyncContext
    from hpx.tensorboard import TensorBoard
