"""Built-in knobs. Each is a declaration the engine binds to every replica."""

from hpx.knobs.base import Custom, Knob, Setter, slot_offsets
from hpx.knobs.loss import LabelSmoothing
from hpx.knobs.module import AttentionTemperature, Dropout, ModuleAttribute, ModuleSelector
from hpx.knobs.optim import GroupKnob, LearningRate, LearningRateScale, WeightDecay

__all__ = [
    "AttentionTemperature",
    "Custom",
    "Dropout",
    "GroupKnob",
    "Knob",
    "LabelSmoothing",
    "LearningRate",
    "LearningRateScale",
    "ModuleAttribute",
    "ModuleSelector",
    "Setter",
    "WeightDecay",
    "slot_offsets",
]
