"""What static tools see of ``hpx``: every public name, with the module it comes from.

This stub is the one list of hpx's public names: ``hpx/__init__.py`` reads it to load each name on
first use and to build ``__all__``. Add a public name here and nowhere else.
"""

__version__: str

from hpx import backends as backends
from hpx import schedule as schedule
from hpx import search as search
from hpx.backends import Collective as Collective
from hpx.backends import InProcess as InProcess
from hpx.checkpoint import load_checkpoint as load_checkpoint
from hpx.checkpoint import save_checkpoint as save_checkpoint
from hpx.config import EngineConfig as EngineConfig
from hpx.controller import Controller as Controller
from hpx.controller import ControllerStep as ControllerStep
from hpx.controller import softmax_weights as softmax_weights
from hpx.engine import Engine as Engine
from hpx.errors import BackendError as BackendError
from hpx.errors import ConfigError as ConfigError
from hpx.errors import ConsistencyError as ConsistencyError
from hpx.errors import HpxError as HpxError
from hpx.errors import NonFiniteError as NonFiniteError
from hpx.forks import Forks as Forks
from hpx.history import format_history as format_history
from hpx.history import load_history as load_history
from hpx.history import plot_history as plot_history
from hpx.history import save_history as save_history
from hpx.knobs import AttentionTemperature as AttentionTemperature
from hpx.knobs import Custom as Custom
from hpx.knobs import Dropout as Dropout
from hpx.knobs import Knob as Knob
from hpx.knobs import LabelSmoothing as LabelSmoothing
from hpx.knobs import LearningRate as LearningRate
from hpx.knobs import LearningRateScale as LearningRateScale
from hpx.knobs import ModuleAttribute as ModuleAttribute
from hpx.knobs import WeightDecay as WeightDecay
from hpx.knobs import slot_offsets as slot_offsets
from hpx.progress import ProgressBar as ProgressBar
from hpx.recipe import autolr as autolr
from hpx.registry import Knobs as Knobs
from hpx.replica import Replica as Replica
from hpx.schedule import ExploreLR as ExploreLR
from hpx.schedule import OneCycleLR as OneCycleLR
from hpx.signals import IntervalLoss as IntervalLoss
from hpx.signals import ProbeStream as ProbeStream
from hpx.signals import SharedBatch as SharedBatch
from hpx.signals import Signal as Signal
from hpx.signals import SyncContext as SyncContext
from hpx.sync_record import SyncRecord as SyncRecord
from hpx.tensorboard import TensorBoard as TensorBoard
