"""Gradient health: which replicas' gradients enter this step's shared mean (shared mode, and
DDP's comm hook, :func:`hpx.backends.dist.finite_mean_hook`, each rank judging its own), and which
replicas' own steps blew up (independent mode, by the loss alone: flagged and reset at the sync).

A replica's gradient is left out of the mean when its loss or its gradient is non-finite, or
when its loss or gradient norm is more than :data:`BLOWUP` times the run's recent maximum (a
blow-up: a finite loss of 1e4 where the run's were about 1 spreads through the mean as surely
as a NaN). The recent maximum is per process, over the values that were let in, and decays by
:data:`DECAY` per step, so it follows the run's range as the loss falls; the rule applies once
:data:`WARMUP` steps have set it. Everything is decided on the device (no host read); see
docs/method.md, "Non-finite replicas".
"""

from __future__ import annotations

import math

import torch

BLOWUP = 100.0  # a loss or gradient norm over 100x the recent maximum is a blow-up
DECAY = 0.99  # the recent maximum decays by 1% per step (half-life about 70 steps)
WARMUP = 5  # steps of let-in values before the rule applies


class _Health:
    """The run's recent range of losses and gradient norms, and the verdict. On the CPU
    (``host``) in Python floats, since reading a host tensor is free and a dozen tiny tensor
    ops per replica would cost more than the check; elsewhere on the device, nothing read back."""

    def __init__(self, device: torch.device, host: bool | None = None) -> None:
        self.host = device.type == "cpu" if host is None else host
        if self.host:
            self._ref_h, self._pending_h = [0.0, 0.0], [0.0, 0.0]  # |loss|, gradient norm
            self._seen_h, self._any_h = 0, False
            return
        self._ref = torch.zeros(2, device=device)  # recent maximum of |loss|, gradient norm
        self._seen = torch.zeros((), device=device)  # steps that let some value in
        self._pending = torch.zeros(2, device=device)  # this step's maxima of the let-in values
        self._any = torch.zeros((), dtype=torch.bool, device=device)

    def judge(self, losses: torch.Tensor, norms: torch.Tensor,
              grads: bool = True) -> torch.Tensor | list[bool]:
        """Which (loss, gradient norm) pairs may enter the mean: ``[n]`` bool on the device, or
        a list of bools on the host. ``grads=False``: the gradient's finiteness is not judged (a
        GradScaler's overflow is its own to handle), only the loss's and the blow-up rule."""
        if self.host:
            return self._judge_host(losses.detach().reshape(-1).tolist(), norms.detach().reshape(-1).tolist(),
                                    grads)
        x = torch.stack([losses.detach().reshape(-1).float(), norms.detach().reshape(-1).float()], 1)
        fin = torch.isfinite(x)
        finite = fin.all(1) if grads else fin[:, 0]
        over = ((self._ref > 0) & (x.abs() > BLOWUP * self._ref) & fin).any(1) & (self._seen >= WARMUP)
        ok = finite & ~over
        kept = torch.where(ok[:, None] & fin, x.abs(), 0.0).amax(0)
        self._pending = torch.maximum(self._pending, kept)
        self._any = self._any | ok.any()
        return ok

    def _judge_host(self, losses: list[float], norms: list[float], grads: bool) -> list[bool]:
        ref, pending = self._ref_h, self._pending_h
        warm = self._seen_h >= WARMUP
        out = []
        for loss, norm in zip(losses, norms):
            fine_norm = math.isfinite(norm)
            ok = math.isfinite(loss) and (fine_norm or not grads)
            if ok and warm:
                ok = not ((ref[0] > 0 and abs(loss) > BLOWUP * ref[0])  # a loss may be negative (an NLL)
                          or (fine_norm and ref[1] > 0 and norm > BLOWUP * ref[1]))
            if ok:
                pending[0] = max(pending[0], abs(loss))
                if fine_norm:
                    pending[1] = max(pending[1], norm)
                self._any_h = True
            out.append(ok)
        return out

    def close(self) -> None:
        """End the step: fold its let-in values into the recent maximum."""
        if self.host:
            if self._any_h:
                self._ref_h = [max(r * DECAY, p) for r, p in zip(self._ref_h, self._pending_h)]
                self._seen_h += 1
            self._pending_h, self._any_h = [0.0, 0.0], False
            return
        self._ref = torch.where(self._any, torch.maximum(self._ref * DECAY, self._pending), self._ref)
        self._seen = self._seen + self._any
        self._pending = torch.zeros_like(self._pending)
        self._any = torch.zeros_like(self._any)


def _norm(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The 2-norm of all ``tensors`` together (float32, on their device; 0 for none)."""
    if not tensors:
        return torch.zeros(())
    return torch.stack([n.float() for n in torch._foreach_norm(tensors)]).norm()
