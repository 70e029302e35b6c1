"""Gradient health in shared mode: which replicas' gradients enter this step's shared mean.

A replica's gradient is left out of the mean when its loss or its gradient is non-finite, or
when its loss or gradient norm is more than :data:`BLOWUP` times the run's recent maximum (a
blow-up: a finite loss of 1e4 where the run's were about 1 spreads through the mean as surely
as a NaN). The recent maximum is per process, over the values that were let in, and decays by
:data:`DECAY` per step, so it follows the run's range as the loss falls; the rule applies once
:data:`WARMUP` steps have set it. Everything is decided on the device (no host read); see
docs/method.md, "Non-finite replicas".
"""

from __future__ import annotations

import torch

BLOWUP = 100.0  # a loss or gradient norm over 100x the recent maximum is a blow-up
DECAY = 0.99  # the recent maximum decays by 1% per step (half-life about 70 steps)
WARMUP = 5  # steps of let-in values before the rule applies


class _Health:
    """The run's recent range of losses and gradient norms (on ``device``), and the verdict."""

    def __init__(self, device: torch.device) -> None:
        self._ref = torch.zeros(2, device=device)  # recent maximum of |loss|, gradient norm
        self._seen = torch.zeros((), device=device)  # steps that let some value in
        self._pending = torch.zeros(2, device=device)  # this step's maxima of the let-in values
        self._any = torch.zeros((), dtype=torch.bool, device=device)

    def judge(self, losses: torch.Tensor, norms: torch.Tensor, grads: bool = True) -> torch.Tensor:
        """``[n]`` bool: which (loss, gradient norm) pairs may enter the mean, on the device.
        ``grads=False``: the gradient's finiteness is not judged (a GradScaler's overflow is its
        own to handle), only the loss's and the blow-up rule."""
        x = torch.stack([losses.detach().reshape(-1).float(), norms.detach().reshape(-1).float()], 1)
        fin = torch.isfinite(x)
        finite = fin.all(1) if grads else fin[:, 0]
        over = ((self._ref > 0) & (x > BLOWUP * self._ref) & fin).any(1) & (self._seen >= WARMUP)
        ok = finite & ~over
        kept = torch.where(ok[:, None] & fin, x.abs(), 0.0).amax(0)
        self._pending = torch.maximum(self._pending, kept)
        self._any = self._any | ok.any()
        return ok

    def close(self) -> None:
        """End the step: fold its let-in values into the recent maximum."""
        self._ref = torch.where(self._any, torch.maximum(self._ref * DECAY, self._pending), self._ref)
        self._seen = self._seen + self._any
        self._pending = torch.zeros_like(self._pending)
        self._any = torch.zeros_like(self._any)


def _norm(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The 2-norm of all ``tensors`` together (float32, on their device; 0 for none)."""
    if not tensors:
        return torch.zeros(())
    return torch.stack([n.float() for n in torch._foreach_norm(tensors)]).norm()
