"""The paper's search: a zero-order hypergradient step on every base at every sync.

:class:`HDET` runs a :class:`~hpx.Controller` (HDET Eqs. 4-7) from ``warmup`` on,
multiplying multiplicative bases by ``1 - gamma`` at each of its syncs (the paper's
decay), with the spreads, sync interval and merge fixed. It is the faithful mode
(``Controller(space="linear", temperature=0.1, debias=False)`` is the paper's rule)
and the engine's default when no other strategy is given.
"""

from __future__ import annotations

from typing import Any

import torch

from hpx.controller import Controller, ControllerStep
from hpx.errors import ConfigError
from hpx.search.base import Decision, SyncView, worst_filled

__all__ = ["HDET"]


class HDET:
    """Move every exploring knob's base by the controller's step at every sync.

    Args:
        controller: a :class:`~hpx.Controller`, or any object with its ``update``,
            ``log_mask``, ``state_dict`` and ``load_state_dict``.
        warmup: steps before the controller acts (syncs before then still merge
            the replicas and redraw the permutations).
        decay: ``gamma`` in ``[0, 1)``: each acting sync multiplies multiplicative
            bases by ``1 - gamma``.
        active: ``False`` never moves a base (fan-out and converge only).
    """

    def __init__(self, controller: Any = None, *, warmup: int = 0, decay: float = 0.0,
                 active: bool = True) -> None:
        controller = Controller() if controller is None else controller
        problems = []
        if not all(hasattr(controller, m) for m in ("update", "log_mask", "state_dict", "load_state_dict")):
            problems.append(f"controller must have update, log_mask, state_dict and load_state_dict "
                            f"(got {controller!r})")
        if not isinstance(warmup, int) or isinstance(warmup, bool) or warmup < 0:
            problems.append(f"warmup must be an integer >= 0 (got {warmup!r})")
        if not isinstance(decay, (int, float)) or isinstance(decay, bool) or not 0 <= decay < 1:
            problems.append(f"decay must be a number in [0, 1) (got {decay!r})")
        ConfigError.check(problems)
        self.controller = controller
        self.warmup, self.decay, self.active = warmup, float(decay), bool(active)
        self._log: torch.Tensor | None = None

    def start(self, view: SyncView) -> Decision:
        self._log = self.controller.log_mask(list(view.kinds))
        return Decision()

    def acts_at(self, step: int) -> bool:
        return self.active and step >= self.warmup

    def decide(self, view: SyncView) -> Decision:
        if not self.acts_at(view.step) or not bool(view.explore.any()):
            return Decision()
        if self._log is None:
            self._log = self.controller.log_mask(list(view.kinds))
        decay = torch.tensor([self.decay if k == "mul" else 0.0 for k in view.kinds], dtype=torch.float64)
        scores = worst_filled(view.scores)
        if scores is None:  # no replica has a finite score: nothing to compare
            return Decision()
        out = self.controller.update(view.values, scores, view.bases, self._log, decay)
        if not isinstance(out, ControllerStep):
            raise TypeError(f"the controller's update() ({type(self.controller).__name__}) must return a "
                            f"hpx.ControllerStep (got {type(out).__name__})")
        return Decision(bases=out.bases, info={
            "weights": out.weights.tolist(), "sigma": out.sigma,
            "direction": dict(zip(view.names, out.direction.tolist())),
        })

    def state_dict(self) -> dict[str, Any]:
        return {"controller": self.controller.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.controller.load_state_dict(state["controller"])

    def __repr__(self) -> str:
        extra = "" if self.active else ", active=False"
        decay = f", decay={self.decay:g}" if self.decay else ""
        warm = f", warmup={self.warmup}" if self.warmup else ""
        return f"HDET({self.controller!r}{warm}{decay}{extra})"
