"""hpx.Engine, the HDET engine: replicas with their own knob values around shared bases (fan-out),
averaged every T steps (converge), the bases moved by a search. The facade is in
:mod:`hpx.engine.facade`; the modules beside it are its rooms (docs/architecture.md lists them)."""

from hpx.engine.facade import Engine, OptimizerFactory
from hpx.sync_record import SyncRecord

__all__ = ["Engine", "OptimizerFactory", "SyncRecord"]
