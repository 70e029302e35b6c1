"""hpx configurations the benchmarks compare, and the experimental signals/controllers they need.

Everything experimental lives here, outside the library, built on hpx's public
extension points: a signal is any object with ``measure(ctx)``; the controller is
any object with hpx's ``Controller`` interface (``update``, ``log_mask``, ``state_dict``,
``load_state_dict``), given to ``hpx.Engine(..., controller=obj)``.

The directions tried against the two biases listed in ``docs/method.md``:

* ``EmaProbe``: compare replicas on what their weights would score after annealing,
  approximated by an exponential moving average of each replica's weights over the
  interval (scored on the held-out probe). A high-lr replica's raw weights bounce
  across the valley; their average sits nearer its floor, which is what the rest of
  the run (the schedule's decay) would reach.
* ``SignificanceController``: moves each base by a step sized to how significant the
  replicas' loss-vs-value slope is, pooled over recent syncs (acts from the first sync).
* ``spread_decay``: a spread that narrows as the signal grows clear.
* ``stop_at``: the controller stops moving bases after a fraction of the run, before
  the short-horizon bias of the decaying schedule dominates.
"""

from __future__ import annotations

import math
from typing import Any

import torch

import hpx
from hpx.averaging import float_state
from hpx.controller import ControllerStep, softmax_weights

__all__ = ["VARIANTS", "EmaProbe", "SignificanceController", "build_signal", "make_controller",
           "signal_cost"]

# name -> settings. signal: interval | shared | probe | ema-probe. controller: True (hpx's),
# False (none), or a dict for the experimental controllers below.
VARIANTS: dict[str, dict[str, Any]] = {
    "autolr": {"recipe": "autolr"},
    "default": {"signal": "probe"},
    "interval": {"signal": "interval"},
    "shared-batch": {"signal": "shared"},
    "no-average": {"signal": "probe", "average": False},
    "no-controller": {"signal": "probe", "controller": False},
    "one-permutation": {"signal": "probe", "independent": False},
    "paper": {"signal": "interval", "paper": True},
    "lib-default": {"signal": "interval"},
    "independent": {"signal": "probe", "mode": "independent"},
    "independent-no-controller": {"signal": "probe", "mode": "independent", "controller": False},
    "ema-probe": {"signal": "ema-probe"},
    "paper-momentum": {"signal": "probe", "engine": {"debias_momentum": False}},
    "fast": {"signal": "probe", "engine": {"momentum": 0.0, "meta_lr": 1.0}},
    "fast-stop-half": {"signal": "probe", "engine": {"momentum": 0.0, "meta_lr": 1.0},
                       "controller": {"kind": "hpx", "stop_at": 0.5}},
    "fast-short-t": {"signal": "probe", "engine": {"momentum": 0.0, "meta_lr": 1.0}, "sync_div": 4},
    "warmup-only": {"signal": "probe", "engine": {"momentum": 0.0, "meta_lr": 1.0}, "sync_div": 4,
                    "controller": {"kind": "hpx", "stop_at": 0.1}},
    "warmup-only-20": {"signal": "probe", "engine": {"momentum": 0.0, "meta_lr": 1.0}, "sync_div": 4,
                       "controller": {"kind": "hpx", "stop_at": 0.2}},
    "anneal-probe": {"signal": "anneal-probe"},
    "anneal-significance": {"signal": "anneal-probe", "controller": {"kind": "significance"}},
    "significance": {"signal": "probe", "controller": {"kind": "significance"}},
    "narrowing": {"signal": "probe", "controller": {"kind": "hpx", "spread_decay": True}},
    "stop-half": {"signal": "probe", "controller": {"kind": "hpx", "stop_at": 0.5}},
    "ema-significance": {"signal": "ema-probe", "controller": {"kind": "significance"}},
    "ema-stop-half": {"signal": "ema-probe", "controller": {"kind": "hpx", "stop_at": 0.5}},
}


def _probe_fn(task):
    return lambda rep, batch: task.probe_loss(rep.model, batch)


def build_signal(kind: str, task) -> Any:
    if kind == "interval":
        return hpx.IntervalLoss()
    if kind == "shared":
        return hpx.SharedBatch(loss_fn=_probe_fn(task))
    if kind == "probe":
        return hpx.ProbeStream(task.probe_batches(), loss_fn=_probe_fn(task), batches=1)
    if kind == "ema-probe":
        return EmaProbe(hpx.ProbeStream(task.probe_batches(), loss_fn=_probe_fn(task), batches=1),
                        sync_every=task.sync_every)
    if kind == "anneal-probe":
        return AnnealProbe(hpx.ProbeStream(task.probe_batches(), loss_fn=_probe_fn(task), batches=1),
                           task, k=max(2, task.sync_every // 4))
    raise ValueError(f"unknown signal {kind!r}")


def signal_cost(kind: str, task, replicas: int) -> int:
    """Forward-only samples the signal spends per sync (all replicas)."""
    if kind == "interval":
        return 0
    if kind == "shared":
        return replicas * task.batch
    if kind == "anneal-probe":  # forward-backward samples, counted as 3 forwards each
        extra = 3 * max(2, task.sync_every // 4) * task.batch
        return extra + replicas * int(task.probe_batches()[0][1].shape[0])
    probe = task.probe_batches()[0]
    return replicas * int(probe[1].shape[0])


class EmaProbe:
    """Score each replica's interval-EMA of weights (an annealed proxy) on the probe.

    Call :meth:`observe` after every ``Engine.step``. The EMA restarts from the
    consensus after every sync; its time constant is a quarter of the interval.
    """

    def __init__(self, inner: Any, sync_every: int, tau_frac: float = 0.25) -> None:
        self.inner = inner
        self.T = sync_every
        self.beta = 1.0 - 1.0 / max(1.0, tau_frac * sync_every)
        self._ema: list[list[torch.Tensor]] | None = None

    @torch.no_grad()
    def observe(self, engine: hpx.Engine) -> None:
        states = [float_state(r.model) for r in engine.replicas]
        if self._ema is None or engine.step_count % self.T == 0:
            self._ema = [[t.detach().clone() for t in s] for s in states]
        else:
            self._fold(states)

    @torch.no_grad()
    def _fold(self, states) -> None:
        for e, s in zip(self._ema, states):
            torch._foreach_lerp_(e, [t.detach() for t in s], 1.0 - self.beta)

    def state_dict(self) -> dict[str, Any]:
        """The inner signal's state and the running averages: a resumed run scores as the
        uninterrupted one."""
        inner = getattr(self.inner, "state_dict", None)
        return {"inner": inner() if callable(inner) else None,
                "ema": None if self._ema is None else [[t.clone() for t in e] for e in self._ema]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("inner") is not None:
            self.inner.load_state_dict(state["inner"])
        self._ema = None if state["ema"] is None else [[t.clone() for t in e] for e in state["ema"]]

    @torch.no_grad()
    def measure(self, ctx: hpx.SyncContext) -> torch.Tensor:
        states = [float_state(r.model) for r in ctx.replicas]
        if self._ema is None:
            return self.inner.measure(ctx)
        self._fold(states)  # the sync step's weights
        saved = [[t.detach().clone() for t in s] for s in states]
        try:
            for s, e in zip(states, self._ema):
                torch._foreach_copy_(s, e)
            return self.inner.measure(ctx)
        finally:
            for s, v in zip(states, saved):
                torch._foreach_copy_(s, v)

    def __repr__(self) -> str:
        return f"EmaProbe({self.inner!r}, beta={self.beta:.3f})"


class AnnealProbe:
    """Score each replica on the probe after a short anneal of its own weights.

    At the sync, each replica (weights and optimizer state saved first) takes ``k``
    more steps on the same training batches (common random numbers) with its own
    learning rates decayed linearly to 0, with its own (unshared) gradients; it is
    scored on the probe and then restored. This asks "where would this replica end
    after a cool-down", the quantity the rest of the run cares about, instead of
    "which step size along this interval's update looks best now" (in shared-gradient
    mode a replica's weights are the consensus plus its multiplier times the
    interval's common update, so a raw comparison is a line search along that
    update, which favours small steps). Costs ``k`` forward-backward steps of
    ``B / N`` samples per replica per sync.
    """

    def __init__(self, inner: Any, task, k: int, seed: int = 0) -> None:
        self.inner, self.task, self.k = inner, task, k
        self.gen = torch.Generator().manual_seed(777 + seed)

    def measure(self, ctx: hpx.SyncContext) -> torch.Tensor:
        import copy

        n = len(ctx.replicas)
        batches = [self.task.sample(self.gen, max(1, self.task.batch // n)) for _ in range(self.k)]
        saved = []
        for rep in ctx.replicas:
            saved.append((copy.deepcopy(rep.model.state_dict()), copy.deepcopy(rep.optimizer.state_dict())))
        try:
            for rep in ctx.replicas:
                lrs = [g["lr"] for g in rep.optimizer.param_groups]
                grads = [p.grad for p in rep.model.parameters()]
                for p in rep.model.parameters():
                    p.grad = None
                for j, b in enumerate(batches):
                    for g, lr in zip(rep.optimizer.param_groups, lrs):
                        g["lr"] = lr * (1.0 - j / self.k)
                    rep.optimizer.zero_grad(set_to_none=True)
                    self.task.loss(rep.model, b, rep._values).backward()
                    rep.optimizer.step()
                for p, gr in zip(rep.model.parameters(), grads):
                    p.grad = gr
                for g, lr in zip(rep.optimizer.param_groups, lrs):
                    g["lr"] = lr
            return self.inner.measure(ctx)
        finally:
            with torch.no_grad():
                for rep, (ms, os_) in zip(ctx.replicas, saved):
                    rep.model.load_state_dict(ms)  # copies in place: grad views stay bound
                    rep.optimizer.load_state_dict(os_)


class _Wrapped:
    """hpx's controller with a stop step and/or a spread that narrows as the signal clears.

    Built before the engine (it is passed as ``hpx.Engine(..., controller=...)``); it needs
    the knobs (to narrow their spreads) and the run's length (for the stop step), and counts
    its own syncs: it is called once per sync, every ``sync_every`` steps.
    """

    def __init__(self, inner, knobs, *, sync_every: int, warmup: int = 0, stop_at: float | None,
                 total_steps: int, spread_decay: bool) -> None:
        self.inner, self.knobs = inner, list(knobs)
        self.sync_every = sync_every
        self.first = sync_every * max(1, math.ceil(warmup / sync_every))  # the first sync it acts at
        self.stop_step = None if stop_at is None else stop_at * total_steps
        self.spread_decay = spread_decay
        self._spread0 = [k.spread for k in self.knobs]
        self._agree = [0.0 for _ in self.knobs]
        self.syncs = 0

    def log_mask(self, kinds):
        return self.inner.log_mask(kinds)

    def update(self, values, losses, bases, log_space, decay=None) -> ControllerStep:
        self.syncs += 1
        step = self.first + (self.syncs - 1) * self.sync_every  # the engine's step count at this sync
        out = self.inner.update(values, losses, bases, log_space, decay)
        if self.spread_decay:
            # consistency of the direction's sign over recent syncs narrows the spread,
            # down to a quarter of its start: clear signal -> less exploration cost.
            for i, k in enumerate(self.knobs):
                d = float(out.direction[i])
                self._agree[i] = 0.8 * self._agree[i] + 0.2 * (1.0 if d > 0 else -1.0 if d < 0 else 0.0)
                # a sign flipping around a value means we are near the optimum: narrow
                k.spread = self._spread0[i] * (0.25 + 0.75 * abs(self._agree[i]))
        if self.stop_step is not None and step >= self.stop_step:
            return ControllerStep(bases.detach().to("cpu", torch.float64).clone(), out.weights,
                                  out.direction, out.velocity, out.sigma)
        return out

    def state_dict(self):
        return {"inner": self.inner.state_dict(), "syncs": self.syncs}

    def load_state_dict(self, s):
        self.inner.load_state_dict(s["inner"])
        self.syncs = int(s.get("syncs", 0))


class SignificanceController:
    """Moves each knob's base by a step sized to the significance of its loss slope.

    At every sync, for knob ``k``, regress the replicas' scores on their (centred)
    coordinates ``z_kr`` (log for multiplicative knobs): slope ``b_k``. Slopes are
    pooled over recent syncs with exponential forgetting (``memory``), and their
    significance is ``t_k = mean(b) / se(b)`` from the pooled spread of the per-sync
    slopes (a sign test across syncs, so one noisy sync cannot dominate). The base
    moves by ``-gain * reach_k * clip(t_k / t_ref, -1, 1)``: the full explored reach
    when the evidence is strong, nothing when it is noise. It acts from the first sync.
    """

    def __init__(self, *, gain: float = 0.5, t_ref: float = 3.0, memory: float = 0.7) -> None:
        self.gain, self.t_ref, self.memory = gain, t_ref, memory
        self.velocity: torch.Tensor | None = None
        self._s = self._s2 = self._n = None

    def log_mask(self, kinds):
        """Log space for multiplicative knobs, linear for additive (hpx's ``space="auto"``)."""
        return torch.tensor([k == "mul" for k in kinds], dtype=torch.bool)

    def update(self, values, losses, bases, log_space, decay=None) -> ControllerStep:
        values = values.detach().to("cpu", torch.float64)
        bases = bases.detach().to("cpu", torch.float64)
        losses = losses.detach().to("cpu", torch.float64).reshape(-1)
        k = values.shape[0]
        finite = torch.isfinite(losses)
        w, sigma = softmax_weights(losses)
        z = torch.where(log_space[:, None], values.clamp_min(1e-300).log(), values)[:, finite]
        L = losses[finite]
        zc = z - z.mean(1, keepdim=True)
        ss = (zc * zc).sum(1)
        slope = torch.where(ss > 0, (zc * (L - L.mean())).sum(1) / ss.clamp_min(1e-300),
                            torch.zeros(k, dtype=torch.float64))
        if self._s is None:
            self._s = torch.zeros(k, dtype=torch.float64)
            self._s2 = torch.zeros(k, dtype=torch.float64)
            self._n = 0.0
        m = self.memory
        self._s = m * self._s + slope
        self._s2 = m * self._s2 + slope * slope
        self._n = m * self._n + 1.0
        mean = self._s / self._n
        var = (self._s2 / self._n - mean * mean).clamp_min(0)
        n_eff = self._n
        if n_eff < 1.5:
            t = torch.zeros(k, dtype=torch.float64)  # one slope: no spread estimate yet
        else:
            t = mean / (var.sqrt() / math.sqrt(n_eff - 1.0)).clamp_min(1e-12)
        reach = zc.abs().amax(1)
        step = -self.gain * reach * (t / self.t_ref).clamp(-1, 1)
        gamma = torch.zeros(k, dtype=torch.float64) if decay is None else decay.to(torch.float64)
        zb = torch.where(log_space, bases.log(), bases)
        zb = torch.where(log_space, zb + torch.log1p(-gamma), zb * (1 - gamma)) + step
        new = torch.where(log_space, zb.exp(), zb)
        self.velocity = step
        direction = z @ w[finite] - z.mean(1)
        return ControllerStep(new, w, direction, step.clone(), sigma)

    def state_dict(self):
        return {}

    def load_state_dict(self, s):
        pass


def make_controller(setting: Any, knobs, settings: dict[str, Any], total_steps: int) -> Any:
    """The ``controller=`` argument of ``hpx.Engine`` for a variant's setting.

    ``setting`` is True/False (hpx's own controller, or none: returned as is) or a dict
    for the experimental controllers; ``settings`` are the engine's keyword settings
    (hpx's controller is built from the same ones the engine would use).
    """
    if not isinstance(setting, dict):
        return setting is not False
    kind = setting.get("kind", "hpx")
    cfg = hpx.EngineConfig.build(**settings)
    if kind == "significance":
        inner = SignificanceController()
    elif kind == "hpx":
        inner = hpx.Controller(meta_lr=cfg.meta_lr, momentum=cfg.momentum, temperature=cfg.temperature,
                               temperature_scale=cfg.temperature_scale, space=cfg.space,
                               debias=cfg.debias_momentum)
    else:
        raise ValueError(f"unknown controller kind {kind!r}")
    if setting.get("stop_at") is None and not setting.get("spread_decay"):
        return inner
    return _Wrapped(inner, knobs, sync_every=cfg.sync_every, warmup=cfg.warmup,
                    stop_at=setting.get("stop_at"), total_steps=setting.get("total_steps") or total_steps,
                    spread_decay=bool(setting.get("spread_decay")))
