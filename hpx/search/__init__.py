"""Search strategies: how the bases move from the replicas' scores.

The engine calls one strategy at every sync through a small interface
(:class:`Search`: ``start``, ``decide``, ``acts_at``, ``state_dict``,
``load_state_dict``) and applies its :class:`Decision`. Two ship with hpx:

* :class:`HDET`: the paper's zero-order hypergradient controller at every sync
  (hpx's log-space variant by default; the paper's exact rule with a
  ``Controller(space="linear", temperature=0.1, debias=False)``);
* :class:`Bracket`: bracket each knob's best value in a window early in the run,
  then hold it (what :func:`hpx.autolr` uses).
"""

from hpx.search.base import Decision, Search, SyncView, worst_filled
from hpx.search.bracket import Bracket
from hpx.search.hdet import HDET

__all__ = ["HDET", "Bracket", "Decision", "Search", "SyncView", "worst_filled"]
