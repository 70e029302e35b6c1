"""The zero-order hypergradient controller (HDET section 3.4), as pure tensor math.

Nothing here knows about models, optimizers or processes: values and losses go in,
new bases come out. Every rank runs it on the same inputs and gets the same
outputs, so decisions agree without further communication.

For knob ``k`` with replica values ``x_kr`` and replica losses ``L_r``, the
update works in a coordinate ``z = log x`` (``space="log"``, the default for
multiplicative knobs: scale-free, keeps the base positive) or ``z = x``
(``space="linear"``, the paper's rule and the default for additive knobs)::

    w_r  = softmax_r((Lbar - L_r) / sigma)        # Eq. 4; non-finite L_r get w_r = 0
    D_k  = sum_r w_r z_kr - mean_r z_kr            # Eqs. 5-6: zero when losses are equal
    v_k  = beta v_k + (1 - beta) D_k               # Eq. 7, momentum
    z_k <- decay(z_k, gamma) + clip(lambda v_k / c, +-(max_r z_kr - min_r z_kr) / 2)

``c = 1 - beta^k`` after ``k`` updates (``debias=True``, the default) corrects the
velocity's start from zero, as Adam does: without it the first update moves a
tenth of a full step (``beta = 0.9``), and a controller that has only a few syncs
of a warm-up to act in barely moves. ``debias=False`` (``c = 1``) is the paper's
Eq. 7 exactly.

``decay`` is ``z (1 - gamma)`` in linear space and ``z + log(1 - gamma)`` in
log space; both multiply the base by ``1 - gamma`` (the paper's decay, positive
``gamma`` only, see docs/method.md on the sign error of its Eq. 8). The clip keeps one
sync's move within half the range the replicas explored (the distance from the
centre to the extreme values of a symmetric spread), so an update is bounded by
the spread even when momentum carries an old, larger velocity.

``sigma`` is the loss temperature. A fixed value (the paper's 0.1, its code's
0.002) does not transfer across losses or run lengths: if replicas' losses
differ by much more than sigma, the softmax puts all weight on one replica and
the controller follows batch noise. The default ``temperature="auto"`` sets
``sigma = temperature_scale * std_r(L_r)``, which makes the weights invariant to
the loss's shift and scale: they depend only on how replicas rank and how far
apart they are relative to their spread.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

from hpx.errors import ConfigError, NonFiniteError

__all__ = ["Controller", "ControllerStep", "softmax_weights"]

Space = Literal["auto", "log", "linear"]

_LOGIT_CAP = 1e300  # keeps softmax finite when a loss gap over sigma overflows


def softmax_weights(
    losses: torch.Tensor, temperature: float | Literal["auto"] = "auto", scale: float = 1.0
) -> tuple[torch.Tensor, float]:
    """Eq. 4: ``w_r = softmax((Lbar - L_r) / sigma)`` over the finite losses.

    Non-finite losses get weight 0 and take no part in ``Lbar`` or ``sigma``.
    Returns ``(w, sigma)``; ``w`` is float64, sums to 1. When every finite loss
    is equal (or ``sigma`` is 0) the weights are uniform over finite replicas.
    Raises :class:`NonFiniteError` if no loss is finite.
    """
    losses = losses.detach().to("cpu", torch.float64).reshape(-1)
    finite = torch.isfinite(losses)
    n_ok = int(finite.sum())
    if n_ok == 0:
        raise NonFiniteError(
            f"all {losses.numel()} replicas have non-finite losses ({losses.tolist()}); "
            "nothing is left to average or compare. Lower the learning rate or its spread, "
            "or check the data for NaN/inf"
        )
    ok = losses[finite]
    w = torch.zeros_like(losses)
    # Work on u = (L - min L) / range, in [0, 1]: its std can neither overflow nor
    # underflow, whatever the scale of the losses (1e300 or 1e-300 apart).
    d = ok - ok.min()
    spread = float(d.max())
    u = d / spread if spread > 0 and math.isfinite(spread) else torch.zeros_like(d)
    if temperature == "auto":
        su = float(u.std(unbiased=False)) if n_ok > 1 else 0.0
        sigma = scale * su * spread if su > 0 else 0.0
        logits = (u.mean() - u) / (scale * su) if su > 0 else None
    else:
        sigma = float(temperature)
        logits = (u.mean() - u) * (spread / sigma) if spread > 0 else None
    if logits is not None:
        w[finite] = torch.softmax(torch.nan_to_num(logits).clamp(-_LOGIT_CAP, _LOGIT_CAP), dim=0)
    else:
        w[finite] = 1.0 / n_ok
    return w, sigma


@dataclass(frozen=True)
class ControllerStep:
    """What one controller update saw and did (all float64, on CPU).

    Attributes:
        bases: the new bases ``b_k``, shape ``[K]``.
        weights: ``w_r``, shape ``[N]``.
        direction: ``D_k``, shape ``[K]`` (in each knob's controller space).
        velocity: ``v_k`` after the update, shape ``[K]``.
        sigma: the temperature used.
    """

    bases: torch.Tensor
    weights: torch.Tensor
    direction: torch.Tensor
    velocity: torch.Tensor
    sigma: float


class Controller:
    """HDET's auto-update of every knob's base from the replicas' losses.

    Args:
        meta_lr: ``lambda``, the meta step (paper 0.5).
        momentum: ``beta`` (paper 0.9).
        temperature: ``sigma``, a positive float (the paper's fixed rule) or
            ``"auto"`` (``temperature_scale`` times the std of the losses).
        temperature_scale: multiplies the automatic sigma; smaller is greedier.
        space: ``"auto"`` (log for multiplicative knobs, linear for additive),
            ``"log"`` or ``"linear"`` for all knobs (``"linear"`` is the paper's).
        debias: divide the velocity by ``1 - beta^k`` after ``k`` updates, so the
            first syncs take full steps (``False``: the paper's Eq. 7).
    """

    def __init__(
        self,
        *,
        meta_lr: float = 0.5,
        momentum: float = 0.9,
        temperature: float | Literal["auto"] = "auto",
        temperature_scale: float = 1.0,
        space: Space = "auto",
        debias: bool = True,
    ) -> None:
        problems = []
        if not _finite(meta_lr) or meta_lr < 0:
            problems.append(f"meta_lr must be a finite number >= 0 (got {meta_lr!r})")
        if not _finite(momentum) or not 0 <= momentum < 1:
            problems.append(f"momentum must be in [0, 1) (got {momentum!r})")
        if temperature != "auto" and (not _finite(temperature) or temperature <= 0):
            problems.append(f"temperature must be 'auto' or a number > 0 (got {temperature!r})")
        if not _finite(temperature_scale) or temperature_scale <= 0:
            problems.append(f"temperature_scale must be a number > 0 (got {temperature_scale!r})")
        if space not in ("auto", "log", "linear"):
            problems.append(f"space must be 'auto', 'log' or 'linear' (got {space!r})")
        ConfigError.check(problems)
        self.meta_lr = float(meta_lr)
        self.momentum = float(momentum)
        self.temperature = temperature
        self.temperature_scale = float(temperature_scale)
        self.space = space
        self.debias = bool(debias)
        self.velocity: torch.Tensor | None = None
        self.updates = 0  # k, for the bias correction

    def log_mask(self, kinds: Sequence[str]) -> torch.Tensor:
        """Which knobs this controller moves in log space, given their kinds."""
        if self.space == "log":
            bad = [i for i, k in enumerate(kinds) if k != "mul"]
            if bad:
                raise ConfigError(
                    [f"space='log' needs multiplicative knobs; knob(s) at {bad} are additive"]
                )
        return torch.tensor(
            [self.space == "log" or (self.space == "auto" and k == "mul") for k in kinds],
            dtype=torch.bool,
        )

    def update(
        self,
        values: torch.Tensor,
        losses: torch.Tensor,
        bases: torch.Tensor,
        log_space: torch.Tensor,
        decay: torch.Tensor | None = None,
    ) -> ControllerStep:
        """One sync's update (Eqs. 4-7).

        Args:
            values: ``[K, N]``, knob ``k``'s value on replica ``r`` (before any
                schedule factor common to all replicas).
            losses: ``[N]``, lower is better; non-finite entries get zero weight.
            bases: ``[K]``, the current bases.
            log_space: ``[K]`` bool, from :meth:`log_mask`.
            decay: ``[K]`` ``gamma`` per knob in ``[0, 1)``; default 0.

        Mutates only the velocity. Returns the new bases and diagnostics.
        """
        values = values.detach().to("cpu", torch.float64)
        bases = bases.detach().to("cpu", torch.float64)
        k, n = values.shape
        if losses.numel() != n or bases.numel() != k or log_space.numel() != k:
            raise ValueError(
                f"shapes disagree: values {tuple(values.shape)}, losses {tuple(losses.shape)}, "
                f"bases {tuple(bases.shape)}, log_space {tuple(log_space.shape)}"
            )
        if log_space.any() and ((values[log_space] <= 0).any() or (bases[log_space] <= 0).any()):
            raise ValueError("log-space knobs need positive values and bases")
        gamma = torch.zeros(k, dtype=torch.float64) if decay is None else decay.to(torch.float64)

        w, sigma = softmax_weights(losses, self.temperature, self.temperature_scale)
        finite = torch.isfinite(losses.detach().to("cpu", torch.float64).reshape(-1))
        z = torch.where(log_space[:, None], values.clamp_min(1e-300).log(), values)
        z_ok = z[:, finite]
        # D = sum w z - mean z, written as sum (w - 1/n) z so that equal losses
        # (w exactly 1/n each) give D = 0 exactly, not rounding noise.
        direction = z_ok @ (w[finite] - 1.0 / z_ok.shape[1])
        if self.velocity is None or self.velocity.numel() != k:
            self.velocity = torch.zeros(k, dtype=torch.float64)
            self.updates = 0
        self.velocity = self.momentum * self.velocity + (1 - self.momentum) * direction
        self.updates += 1
        velocity = self.velocity / (1 - self.momentum**self.updates) if self.debias else self.velocity
        # Half the explored range: the move allowed per sync; exactly 0 when all
        # replicas hold one value (alpha = 0), so the base then never moves.
        reach = (z_ok.amax(dim=1) - z_ok.amin(dim=1)) / 2
        step = (self.meta_lr * velocity).clamp(-reach, reach)

        # Applied multiplicatively in log space (b * e^step * (1 - gamma)) so that a
        # zero step and no decay leave the base bit for bit, with no exp(log b) round trip.
        new = torch.where(log_space, bases * step.exp() * (1 - gamma), bases * (1 - gamma) + step)
        return ControllerStep(new, w, direction, self.velocity.clone(), sigma)

    def state_dict(self) -> dict[str, Any]:
        return {"velocity": None if self.velocity is None else self.velocity.clone(),
                "updates": self.updates}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        v = state.get("velocity")
        self.velocity = None if v is None else v.detach().to("cpu", torch.float64).clone()
        self.updates = int(state.get("updates", 0))

    def __repr__(self) -> str:
        return (
            f"Controller(meta_lr={self.meta_lr}, momentum={self.momentum}, "
            f"temperature={self.temperature!r}, temperature_scale={self.temperature_scale}, "
            f"space={self.space!r}, debias={self.debias})"
        )


def _finite(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
