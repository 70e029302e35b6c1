"""The training step: each replica's forward and backward, the shared gradient (Eq. 2) with its
two implementations, clipping and the GradScaler, the optimizer step, and the count of steps
that triggers a sync. A part of :class:`hpx.Engine`; nothing here reads the device back.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from hpx import _checks
from hpx._batch import _split
from hpx._buckets import dtype_groups
from hpx._health import _Health, _norm
from hpx.backends.base import Collective
from hpx.engine.aligned import check_aligned, met_a_sync
from hpx.errors import ConfigError
from hpx.replica import Replica
from hpx.signals import LossFn, SyncContext, _leaves


class _TrainingStep:
    """The engine's step: backward, the shared mean, the optimizer step, advance."""

    def _backward(self, loss_fn: LossFn, batch: Any, batches: Sequence[Any] | None, scale: float,
                  scaler: Any) -> torch.Tensor:
        self._check_factors()
        _checks.check(_checks.loss_fn_problems(loss_fn, batch) + _checks.scale_problems(scale, scaler))
        parts, shared = self._parts(batch, batches)
        # a batch split unevenly, whose parts' gradients are averaged: each part weighted by its rows
        weights = _part_weights(parts) if batches is None and self._shared else None
        if self._fresh:  # the first micro-batch of an optimizer step
            # the interval's sums as the step found them: a loss_fn that raises on a later micro-batch
            # drops the whole step, and the losses of its earlier micro-batches leave the sums with it
            self._sums_before = (self._acc.clone(), self._bad.clone(), list(self._acc_n))
            prepare = getattr(self.signal, "prepare", None)
            # not when the sync places the replicas first: they must be scored where they are placed
            if (prepare is not None and self._placement is None and self.step_count + 1 >= self._next_sync
                    and self._controls_now(1)):
                prepare(SyncContext(self.replicas, self._acc, shared, loss_fn, self.collective,
                                    self.step_count))
            if self._one is not None or self._grads is not None or self._state is not None:
                ConfigError.check(_trainable_problems(self.replicas[0], *self._trainable))
            self._one_step = self._one is not None
            if self._one is not None:
                self._one.zero_()
            elif self._grads is not None:
                self._grads.zero_()
            else:
                for r in self.replicas:
                    r.optimizer.zero_grad(set_to_none=True)
            self._fresh, self._reduced = False, False
            self._last = (shared, loss_fn)
        losses = []
        try:
            for l, (rep, part) in enumerate(zip(self.replicas, parts)):
                loss = _called(loss_fn, rep, part)
                if not torch.is_tensor(loss) or loss.numel() != 1:
                    raise TypeError(f"loss_fn must return a scalar tensor (got {type(loss).__name__} "
                                    f"of shape {getattr(loss, 'shape', None)})")
                w = scale if weights is None else scale * weights[l]
                out = loss * w if w != 1 else loss
                if self._hook is not None:  # DDP: judged with this backward's gradient, in the hook
                    self._hook.loss, self._hook.scaled = loss.detach(), scaler is not None
                if not self._one_step:
                    _backward_of(scaler.scale(out) if scaler is not None else out, rep, loss)
                elif self._one.admit(loss, l):  # on the host: not into the one gradient if non-finite
                    _backward_of(scaler.scale(out) if scaler is not None else out, rep, loss)
                    self._one.ran(loss, l, self._grad_health, grads=scaler is None)
                losses.append(loss.detach().reshape(()))
        except BaseException:
            # some replicas ran their backward, others did not: the whole optimizer step is dropped,
            # and the next backward starts it again from zero gradients
            self._fresh, self._reduced = True, False
            self._step_loss.zero_()
            acc, bad, self._acc_n = self._sums_before
            self._acc.copy_(acc)
            self._bad.copy_(bad)
            self._step_n = [0] * self.n_local
            raise
        lt = torch.stack(losses).to(self._acc.dtype)
        self._accumulate(lt, range(self.n_local))
        self._step_loss.add_(lt)  # non-finite if any micro-batch's was: left out of the mean
        return lt

    def _parts(self, batch: Any, batches: Sequence[Any] | None) -> tuple[list[Any], Any]:
        """Each local replica's part of the batch, and what signals score every replica on."""
        _checks.check(_checks.batch_problems(batch, batches))
        if batches is not None:
            if batch is not None:
                raise ConfigError(["give batch or batches, not both"])
            if isinstance(batches, tuple) and all(torch.is_tensor(b) for b in batches) and len(
                    {(b.dtype, tuple(b.shape[1:])) for b in batches}) > 1:
                raise ConfigError([f"batches=({', '.join(type(b).__name__ for b in batches)}) holds tensors "
                                   "of different kinds, like one batch (x, y): pass it as batch=(x, y) "
                                   "to split it among the replicas, or give batches=[batch_0, ...], one "
                                   "batch per local replica"])
            if len(batches) != self.n_local:
                raise ConfigError([f"batches has {len(batches)} entries for {self.n_local} local replicas: "
                                   "give one batch per local replica, or one batch=... to split"])
            return list(batches), batches[0]
        return _split(batch, self.n_local), batch

    def _reduce(self, alias: bool, scaled: bool = False) -> None:
        # alias: every replica's gradient may be the one mean tensor (one shared optimizer
        # state reads it once; unscaling or clipping each replica's would repeat the work)
        if self._one_step and not self._reduced:
            if not self._one.intact():
                raise ConfigError(["a replica's gradient was replaced between engine.backward() and the "
                                   "optimizer step, while the replicas keep one gradient: modify gradients "
                                   "in place, or build the engine with shared_optimizer_state=False"])
            self._one.average_(self.collective, alias=alias)
            out = self._one.out
            self._left_out([not o for o in out] if isinstance(out, list) else ~out)
        elif self._grads is not None and not self._reduced:
            if self._fresh:  # no engine.backward this step: a loop of its own may have moved them
                self._grads.adopt_()
            self._left_out(self._grads.average_(self._step_loss, self.collective, self._grad_health,
                                                grads=not scaled))
        self._reduced = True

    def _left_out(self, ok: torch.Tensor | list[bool]) -> None:
        """Count the replicas whose finite loss was left out of this step's mean (a non-finite
        gradient, a blow-up) as non-finite for the interval: the sync then sees them as the worst,
        merges them with weight 0 and resets them. On the device, nothing read back."""
        if isinstance(ok, list):  # the host's verdict
            if all(ok):
                return
            ok = torch.tensor(ok)
        ok = ok.to(self._acc.device)
        out = ~ok & torch.isfinite(self._step_loss)  # a non-finite loss was counted already
        self._acc.sub_(torch.where(out, self._step_loss, 0.0))
        self._bad.add_(out * torch.tensor(self._step_n, dtype=self._bad.dtype).to(self._bad.device))

    def _optimizer_step(self, max_grad_norm: float | None, scaler: Any) -> torch.Tensor | None:
        if self._fresh:
            raise ConfigError(["optimizer_step() found no gradients: call engine.backward(loss_fn, batch) "
                               "first (once per micro-batch)"])
        problems = _checks.scaler_problems(scaler)
        if max_grad_norm is not None and not (isinstance(max_grad_norm, (int, float))
                                              and not isinstance(max_grad_norm, bool) and max_grad_norm > 0):
            problems.append(f"max_grad_norm must be a number > 0 or None (got {max_grad_norm!r})")
        ConfigError.check(problems)
        if self.step_count + 1 >= self._next_sync:  # once per interval: no host read on other steps
            self._check_written()
        clip, cap = torch.nn.utils.clip_grad_norm_, max_grad_norm
        norms = None
        if self._state is not None:  # one state, one mean gradient: unscale, clip and step once
            self._state.check()
            self._reduce(alias=True, scaled=scaler is not None)
            self._state.attach()
            if scaler is not None:
                scaler.unscale_(self._state)
            if cap is not None:
                norms = _whole(clip(self._state.parameters(), float(cap))).expand(self.n_local).clone()
            if scaler is not None:
                scaler.step(self._state)
            else:
                self._state.step()
        else:
            self._reduce(alias=False, scaled=scaler is not None)
            if scaler is not None:
                for r in self.replicas:
                    scaler.unscale_(r.optimizer)
            if cap is not None:
                norms = torch.stack([_whole(clip(r.model.parameters(), float(cap))) for r in self.replicas])
            for r in self.replicas:
                if scaler is not None:
                    scaler.step(r.optimizer)
                else:
                    r.optimizer.step()
        if scaler is not None:
            scaler.update()
        shared, loss_fn = self._last
        self.advance(batch=shared, loss_fn=loss_fn)
        return norms

    def _record(self, loss: torch.Tensor, replica: int) -> None:
        _checks.check(_checks.record_problems(loss, replica, self.n_local))
        lt = loss.detach().reshape(1).to(self._acc.dtype)
        self._accumulate(lt, [replica])
        self._step_loss[replica] += lt[0]  # a non-finite loss keeps the replica out of the mean

    def _accumulate(self, losses: torch.Tensor, which: Sequence[int]) -> None:
        """Add ``losses`` (of the local replicas ``which``) to the interval's sums, on device:
        a non-finite loss adds nothing to the sum and counts as a bad step."""
        ok = torch.isfinite(losses)
        if len(which) == self.n_local:
            self._acc.add_(torch.where(ok, losses, 0.0))
            self._bad.add_(~ok)
        else:
            idx = list(which)
            self._acc[idx] += torch.where(ok, losses, 0.0)
            self._bad[idx] += ~ok
        for l in which:
            self._acc_n[l] += 1
            self._step_n[l] += 1

    def _advance(self, batch: Any, loss_fn: LossFn | None) -> None:
        self._check_factors()
        if self._shared and not self._reduced:
            raise ConfigError(
                [f"the {self.n_replicas} replicas train in shared mode, but this step's gradients were "
                 "never averaged: call engine.reduce() after backward and before the optimizers step "
                 "(or use engine.optimizer_step(), or engine.step()); without it each replica would "
                 "follow its own gradient and the method would silently change"])
        if self._agreement_due:
            self._check_agreement(settle=True)
        if self._hook is not None:  # DDP: this rank was left out of a step's mean by the hook
            out = self._hook.take_left_out()
            if torch.is_tensor(out):
                self._left_out(~out.reshape(1))
            elif out:
                self._left_out([False])
        elif self._independent:  # each replica's own loss, by the same rule: flagged, then reset
            self._left_out(self._grad_health.judge(self._step_loss, self._no_norms, grads=False))
        self._fresh, self._reduced, self._one_step = True, False, False
        self._step_loss.zero_()
        self._step_n = [0] * self.n_local
        if self._shared or self._independent:
            self._grad_health.close()
        self.step_count += 1
        if self.step_count == self._past_end:
            self._warn_past_end()
        if self.step_count >= self._next_sync:
            self._sync(batch, loss_fn)
        else:
            self._write()

    def _check_aligned(self, when: str) -> None:
        """Shared mode over several processes: a :class:`ConsistencyError` on every rank if the
        ranks ran different numbers of steps (:func:`hpx.engine.aligned.check_aligned`)."""
        if not self._shared or self._framework_reduces or self.collective.world_size == 1:
            return
        check_aligned(self.collective, self.replicas[0].model, self.step_count, when,
                      [g.crossed for g in (self._grads, self._one) if g is not None])


class _OneGradient:
    """One gradient for all local replicas, when they share one optimizer state (which reads
    the mean once) and the engine runs their backward.

    Flat buffers per (device, dtype), kept from step to step (allocating a gradient each step
    page-faults it in anew: measured slower). On the CPU (``host``), where reading a loss
    is free, every replica's ``.grad`` is a view of the one gradient, each backward adds into
    it, and a replica whose loss is not finite skips its backward. Elsewhere nothing is read
    back: every backward writes into one scratch gradient, which is added into the one
    gradient unless the loss was non-finite (decided on the device), then zeroed. Either
    way no replica's own gradient is stored. The mean is over the (replica, micro-batch)
    pairs that ran, scaled as if all had: with one micro-batch per step, the mean over the
    replicas whose loss was finite, as the per-replica paths give.
    """

    def __init__(self, replicas: Sequence[Replica], host: bool) -> None:
        self.params = [[p for p in r.model.parameters() if p.requires_grad] for r in replicas]
        self.host = host
        first = self.params[0]
        groups = dtype_groups(first)
        self._buffers: list[tuple[torch.Tensor, torch.Tensor | None]] = []  # (one, scratch) per group
        self.one: list[torch.Tensor] = [torch.empty(0)] * len(first)  # per parameter: its view
        self._into: list[torch.Tensor] = [torch.empty(0)] * len(first)  # where backward writes
        for (device, dtype), idx in groups.items():
            sizes = [first[i].numel() for i in idx]
            one = torch.zeros(sum(sizes), device=device, dtype=dtype)
            scratch = None if host else torch.zeros_like(one)
            for i, chunk in zip(idx, one.split(sizes)):
                self.one[i] = chunk.view(first[i].shape)
            for i, chunk in zip(idx, (scratch if scratch is not None else one).split(sizes)):
                self._into[i] = chunk.view(first[i].shape)
            self._buffers.append((one, scratch))
        self.crossed: torch.Tensor | None = None  # on an accelerator: a step's all-reduce met a sync
        self._pairs = 0  # losses seen this step (host count)
        self._ran: int | torch.Tensor = 0  # ... of which let in (host int, or a device tensor)
        dev = self._buffers[0][0].device
        # the replicas left out this step (a list on the host)
        self.out: list[bool] | torch.Tensor = ([False] * len(replicas) if host
                                               else torch.zeros(len(replicas), dtype=torch.bool, device=dev))

    def zero_(self) -> None:
        for one, scratch in self._buffers:
            one.zero_()
            if scratch is not None:
                scratch.zero_()
        for ps in self.params:
            for p, t in zip(ps, self._into):
                p.grad = t
        self._pairs = 0
        self._ran = 0 if self.host else torch.zeros((), device=self._buffers[0][0].device)
        if isinstance(self.out, list):
            self.out = [False] * len(self.out)
        else:
            self.out.zero_()

    def admit(self, loss: torch.Tensor, l: int) -> bool:
        """Whether local replica ``l``'s backward runs (on the host: only if its loss is finite).
        On the host its backward then writes a gradient of its own, judged before it is added."""
        self._pairs += 1
        if not self.host:
            return True
        ok = math.isfinite(float(loss.detach()))  # a host tensor: reading it is free
        if not ok:
            self.out[l] = True
            return False
        for p in self.params[l]:
            p.grad = None  # autograd stores the gradient it computed, no copy
        return ok

    @torch.no_grad()
    def ran(self, loss: torch.Tensor, l: int, health: _Health, grads: bool = True) -> None:
        """After local replica ``l``'s backward: its gradient into the one, if ``health`` lets it in."""
        if self.host:
            own = [(p.grad, t) for p, t in zip(self.params[l], self._into) if p.grad is not None]
            ok = health.judge(loss, _norm([g for g, _ in own]), grads)[0]  # host: reading is free
            if ok:
                torch._foreach_add_([t for _, t in own], [g for g, _ in own])
                self._ran += 1
            else:
                self.out[l] = True
            for p, t in zip(self.params[l], self._into):
                p.grad = t
            return
        dev = self._buffers[0][0].device
        scratch = [s for _, s in self._buffers if s is not None]
        verdict = health.judge(loss, _norm(scratch), grads)  # a list if the health is judged on the host
        fine = (verdict if torch.is_tensor(verdict) else torch.tensor(verdict)).reshape(()).to(dev)
        self._ran = self._ran + fine
        self.out[l] |= ~fine
        for one, s in self._buffers:
            assert s is not None
            s.masked_fill_(~fine.to(s.device), 0)  # never multiplied: 0 * NaN is NaN
            one.add_(s)
            s.zero_()

    def intact(self) -> bool:
        """Whether every replica's gradient is still where backward was to write it."""
        return all(p.grad is t for ps in self.params for p, t in zip(ps, self._into))

    @torch.no_grad()
    def average_(self, collective: Collective, alias: bool) -> None:
        """The one gradient <- the mean of the passes that ran, over every rank; every
        replica's ``.grad`` is then the one (``alias``) or a copy of it."""
        ones = [one for one, _ in self._buffers]
        n = len(self.params) * collective.world_size
        if collective.world_size > 1:
            ran = torch.as_tensor(self._ran, dtype=torch.float64, device=ones[0].device).reshape(1)
            collective.all_reduce_sum_([*ones, ran])
            self.crossed = met_a_sync(ran, self.crossed)
            pairs = self._pairs * collective.world_size
            factor = (pairs / n) / ran.clamp_min(1)  # on the device: no host read
            for one in ones:
                one.mul_(factor.to(one.dtype))
        elif isinstance(self._ran, int):  # one process, counted on the host
            if self._ran and self._ran != self._pairs:  # some left out: as if all had run
                for one in ones:
                    one.mul_((self._pairs / n) / self._ran)
            elif n > 1:
                for one in ones:
                    one.mul_(1.0 / n)
        else:
            factor = (self._pairs / n) / self._ran.clamp_min(1)
            for one in ones:
                one.mul_(factor.to(one.dtype))
        for l, ps in enumerate(self.params):
            for p, o in zip(ps, self.one):
                p.grad = o if alias or l == 0 else o.clone()  # a loop of its own: each its own copy


class _GradBuckets:
    """Local replicas' gradients as views of one ``[L, P]`` flat buffer per (device, dtype).

    Autograd accumulates into an existing ``.grad`` in place, so after backward the
    buffer holds every replica's gradient and the shared-gradient mean is one
    masked reduction per bucket, with no per-tensor copies. Built at first use (an engine whose
    replicas keep one gradient uses it only for a loop that runs its own backward).
    """

    def __init__(self, replicas: Sequence[Replica]) -> None:
        self._replicas = list(replicas)
        self.buffers: list[torch.Tensor] = []
        self._views: list[tuple[torch.Tensor, torch.Tensor]] = []  # (param, its grad view)
        self.crossed: torch.Tensor | None = None  # on an accelerator: a step's all-reduce met a sync

    def _build(self) -> None:
        replicas = self._replicas
        params = [[p for p in r.model.parameters() if p.requires_grad] for r in replicas]
        for (device, dtype), idx in dtype_groups(params[0]).items():
            sizes = [params[0][i].numel() for i in idx]
            buf = torch.zeros(len(replicas), sum(sizes), device=device, dtype=dtype)
            self.buffers.append(buf)
            for l, ps in enumerate(params):
                for i, chunk in zip(idx, buf[l].split(sizes)):
                    self._views.append((ps[i], chunk.view(ps[i].shape)))  # .grad set by zero_/adopt_

    def adopt_(self) -> None:
        """Bring gradients that a loop of its own left outside the buffer back into it."""
        if not self.buffers:
            self._build()
        for p, v in self._views:
            if p.grad is not v:
                if p.grad is None:
                    v.zero_()
                else:
                    v.copy_(p.grad)
                p.grad = v

    def zero_(self) -> None:
        if not self.buffers:
            self._build()
        for buf in self.buffers:
            buf.zero_()
        for p, v in self._views:
            p.grad = v  # a new step starts from zero, in the buffer

    def average_(self, losses: torch.Tensor, collective: Collective, health: _Health,
                 grads: bool = True) -> torch.Tensor | list[bool]:
        """Every replica's gradient <- mean over the replicas ``health`` lets in (on all ranks);
        returns which (``[L]`` bool on the device, or a list on the host).

        Relies on :meth:`zero_` having put the views back before backward.
        """
        norms = [torch.linalg.vector_norm(b, dim=1, dtype=None if b.dtype == torch.float64 else torch.float32)
                 .float() for b in self.buffers]  # float64 norms in float64 (torch will not narrow them)
        verdict = health.judge(losses, norms[0] if len(norms) == 1 else torch.stack(norms).norm(dim=0), grads)
        if isinstance(verdict, list):  # on the host
            if collective.world_size == 1 and all(verdict):
                # One process with losses on the host (reading them waits for no device) and all
                # let in: the plain mean, two ops per bucket instead of the masked reduction.
                for buf in self.buffers:
                    buf.copy_(buf.mean(0, keepdim=True))
                return verdict
            ok = torch.tensor(verdict, device=losses.device)
        else:
            ok = verdict
        sums = []
        for buf in self.buffers:
            buf.masked_fill_(~ok.to(buf.device)[:, None], 0)
            sums.append(buf.sum(0))
        count = ok.sum().to(torch.float64).reshape(1)
        if collective.world_size > 1:
            collective.all_reduce_sum_([*sums, count])
            self.crossed = met_a_sync(count, self.crossed)
        for buf, s in zip(self.buffers, sums):
            s.div_(count.to(s).clamp_min(1))
            buf.copy_(s.expand_as(buf))
        return verdict


def _trainable(rep: Replica, params: Sequence[torch.Tensor]) -> tuple[int, tuple[bool, ...]]:
    """What the shared mode's gradient buffers and one optimizer state were built on: the number of
    parameter groups and which of ``params`` (the model's, listed once) train."""
    return len(rep.optimizer.param_groups), tuple(p.requires_grad for p in params)


def _trainable_problems(rep: Replica, params: Sequence[torch.Tensor],
                        built: tuple[int, tuple[bool, ...]]) -> list[str]:
    if _trainable(rep, params) == built:
        return []
    return ["the parameters that train changed since the engine was built (a layer unfrozen or frozen, a "
            "parameter group added): in shared mode the replicas' gradients and optimizer state live in "
            "buffers built over the parameters that trained then, so the change would train wrongly. "
            "Make it before building the engine, or save a checkpoint and build a new engine after it"]


def _part_weights(parts: list[Any]) -> list[float] | None:
    """For a batch that does not split evenly (10 examples over 4 replicas: 3, 3, 2, 2), each part's
    weight ``L * rows / total`` on its mean loss, so that the replicas' mean gradient is the whole
    batch's; ``None`` when the parts are even."""
    rows = [next((int(t.shape[0]) for _, t in _leaves(p, "batch") if t.dim()), 0) for p in parts]
    if len(set(rows)) <= 1 or not all(rows):
        return None
    total = sum(rows)
    return [len(rows) * r / total for r in rows]


def _called(loss_fn: LossFn, rep: Replica, part: Any) -> Any:
    """``loss_fn(rep, part)``; given no batch (``None``), a failure in it is named as that mistake."""
    if part is not None:
        return loss_fn(rep, part)
    try:
        return loss_fn(rep, part)
    except (TypeError, AttributeError, IndexError, KeyError) as e:
        raise ConfigError([f"loss_fn failed on batch None ({type(e).__name__}: {e}): the step was given no "
                           "batch; pass it, engine.step(loss_fn, (x, y)), or batches=[...], one per "
                           "local replica"]) from e


def _backward_of(out: torch.Tensor, rep: Replica, loss: torch.Tensor) -> None:
    """``out.backward()``, with a loss that has no gradient named as the mistake it is."""
    if not out.requires_grad:
        raise ConfigError([_checks.no_grad_problem(rep.model, loss, f"replica {rep.index}")])
    out.backward()


def _whole(t: torch.Tensor) -> torch.Tensor:
    """A sharded model's gradient norm (a replicated DTensor) as a plain tensor; else ``t``."""
    return t.full_tensor() if type(t).__name__ == "DTensor" else t
