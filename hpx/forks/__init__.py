"""hpx.Forks, the recommended search: whole runs at several multiples of your learning rate beside
yours, cut by successive halving, and a confident end. The class is in :mod:`hpx.forks.search`; the
modules beside it are its rooms (docs/architecture.md lists them)."""

from hpx.forks.search import CONFIDENCE, COOL, CUTS, KNOB_DESIGN, KNOB_START, MULTIPLES, Forks

__all__ = ["CONFIDENCE", "COOL", "CUTS", "KNOB_DESIGN", "KNOB_START", "MULTIPLES", "Forks"]
