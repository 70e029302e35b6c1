"""Search strategies: how the bases move from the replicas' scores.

The engine calls one strategy at every sync through a small interface
(:class:`Search`: ``start``, ``decide``, ``acts_at``, ``state_dict``,
``load_state_dict``) and applies its :class:`Decision`. Three ship with hpx:

* :class:`Stretch`: score the run's whole displacement shrunk and stretched, and
  move the learning rate toward the scale it says is best, early in the run, then
  hold (what :func:`hpx.autolr`, the one-run search, uses);
* :class:`HDET`: the paper's zero-order hypergradient controller at every sync
  (hpx's log-space variant by default; the paper's exact rule with a
  ``Controller(space="linear", temperature=0.1, debias=False)``);
* :class:`Bracket`: compare replicas that trained one interval at different values,
  bracket each knob's best value in a window early in the run, then hold it (any
  knob, additive ones too).
"""

from hpx.search.base import Decision, Search, SyncView, worst_filled
from hpx.search.bracket import Bracket
from hpx.search.hdet import HDET
from hpx.search.stretch import Stretch

__all__ = ["HDET", "Bracket", "Decision", "Search", "Stretch", "SyncView", "worst_filled"]
