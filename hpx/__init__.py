"""hpx: hyperparameter search from the data-parallel replicas of one training run.

An implementation of HDET (Hyperparameter-Divergent Ensemble Training): each of
``N`` replicas trains with its own values of some scalar knobs, spread
symmetrically around shared bases (fan-out); every ``T`` steps the replicas'
weights are averaged (converge) and a zero-order controller moves every base
toward the better-scoring side.
"""

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

__version__ = "0.1.0"

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
    "Replica",
    "SharedBatch",
    "Signal",
    "SyncContext",
    "SyncRecord",
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
