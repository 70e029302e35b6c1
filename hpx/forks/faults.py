"""What :class:`hpx.Forks` does when something goes wrong while it trains: a non-finite loss
(read a step late, without waiting on the device), a probe loss that is non-finite for a finite
run, every fork lost, and ranks that ran different numbers of steps. A mixin of ``Forks``: it
reads and writes the search's own attributes."""

from __future__ import annotations

import logging
import math
from typing import Any

import torch

from hpx.averaging import local
from hpx.errors import ConsistencyError, NonFiniteError
from hpx.forks.fork import _device
from hpx.forks.probe import group_numbers
from hpx.forks.ranks import _MET, check_steps_aligned

log = logging.getLogger("hpx")


class _Faults:
    """Non-finite losses and ranks out of step (see the module's docstring)."""

    _forks: Any
    _clones: Any
    _parents: Any
    _losses_bad: Any
    _pending: Any
    _crossed: Any
    _sharder: Any
    collective: Any
    step_count: int

    def _stash_losses(self) -> None:
        """The step's non-finite flags, one per fork trained, put where the next step reads them: on
        a GPU copied to pinned host memory without waiting (an event says when they have landed)."""
        held, self._losses_bad = self._losses_bad, None
        if held is None:
            return
        forks, flags = held
        event = None
        if flags.device.type == "cuda":  # pinned buffers kept by size: no page-locked allocation per step
            kept: dict[int, torch.Tensor] = self.__dict__.setdefault("_pinned", {})
            host = kept.get(flags.numel())
            if host is None:
                host = kept[flags.numel()] = torch.empty(flags.shape, dtype=flags.dtype, pin_memory=True)
            host.copy_(flags, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            flags = host
        self._pending = (self.step_count + 1, forks, flags, event)

    def _read_losses(self) -> None:
        """At the next step's start, the last step's flags, once they have landed (no wait): a fork
        whose loss was non-finite is dropped as lost (no longer trained, never kept by a cut or the
        end); your run too, kept for the end's comparison as a run lost at a cut is. Every fork at
        once is the batch's or the loss's fault: :class:`~hpx.errors.NonFiniteError`, naming the step."""
        if self._pending is None:
            return
        step, forks, flags, event = self._pending
        if event is not None and not event.query():
            return  # still on its way: the next step reads it
        self._pending = None
        bad = [f for f, b in zip(forks, flags.tolist()) if b and not f.lost]
        if not bad:
            return
        if len(bad) == len(forks) and not any(f.lost for f in self._forks):
            raise NonFiniteError(f"at step {step} every fork's loss was non-finite "
                                 f"({[f.setting() for f in forks]}): every fork saw that step's batch, so "
                                 "the batch or the loss holds a NaN or inf; the forks' weights since are not "
                                 "finite, and hpx.save_checkpoint skips a non-finite run, so your last "
                                 "checkpoint is before it: resume from it, skip or mend that batch")
        for f in bad:
            f.lost = True
            who = "your run" if f is self._forks[0] else (
                f"the annealed copy of {f.factor:g}x" if f.ramp is not None else f"the fork at {f.factor:g}x")
            kept = "; kept for the end's comparison" if f is self._forks[0] else ""
            log.warning("hpx.Forks: %s had a non-finite loss at step %d: dropped as lost (no longer "
                        "trained%s)", who, step, kept)
        for i, c in zip(self._parents, self._clones):  # a lost fork's annealed copy says nothing
            c.lost = c.lost or self._forks[i].lost
        if all(f.lost for f in self._forks):  # one after the other: nothing is left to train
            raise NonFiniteError(f"at step {step} every fork's weights or loss are non-finite "
                                 f"({[f.setting() for f in self._forks]}): lower the learning rate, or check "
                                 "the data and the loss for NaN/inf")

    def _check_probe_loss(self, mine: float) -> None:
        """Your run's probe loss is non-finite while its trainable weights are finite: an error in the
        probe's loss (a log of 0, a division by zero), not a lost run, which would hand the run to a
        challenger; raised on every rank before the decision (a host read at a decision)."""
        if self._agreed(math.isfinite(mine)) or self._forks[0].lost:  # rank 0's reading: one path for all
            return
        params = [local(p) for p in self._forks[0].model.parameters() if p.requires_grad]
        dev = _device(self._forks[0].model)
        bad = torch.stack([~torch.isfinite(p).all() for p in params]).sum().double().reshape(1) if params \
            else torch.zeros(1, dtype=torch.float64, device=dev)
        if self.collective.world_size > 1:  # a sharded run: every rank's part
            self.collective.all_reduce_sum_([bad])
        if float(bad) == 0:
            raise NonFiniteError(f"at step {self.step_count} the probe's loss_fn gave your run a non-finite "
                                 "loss while its weights are finite: the probe's loss is at fault, not your "
                                 "run (a log of 0, a division by zero, a NaN in the probe batches); fix "
                                 "loss_fn or the probe and resume from your last checkpoint. Nothing was "
                                 "decided")

    def _raise_if_all_lost(self, scores: list[float]) -> None:
        if self._agreed(not any(math.isfinite(s) for s in scores)):
            raise NonFiniteError(f"at step {self.step_count} every fork's weights or probe loss are "
                                 f"non-finite ({[f.setting() for f in self._forks]}): lower the "
                                 "learning rate, or check the data and the probe for NaN/inf")

    def _check_aligned(self, when: str) -> None:
        """Under torch.distributed, before a decision, ``converge()`` or a load: every rank is at the
        same step, or every rank raises :class:`ConsistencyError` within one collective instead of
        hanging (:func:`hpx.forks.ranks.check_steps_aligned`; sharded forks' collectives are FSDP's and
        are not checked)."""
        if self.collective.world_size == 1:
            return
        if self._sharder is None:
            if self._crossed is not None and bool(self._crossed):  # a host read, at a decision
                raise ConsistencyError(f"a training step of this rank met another rank's decision, "
                                       f"converge() or load_checkpoint (found at step {self.step_count}): "
                                       f"{_MET}")
            check_steps_aligned(self._trained(), self.collective, self.step_count, when)
        self._check_settings(when)

    def _check_settings(self, when: str) -> None:
        """Every rank's forks are set alike (a change made on one rank alone, ``each()`` in a branch
        taken by one rank, trained the ranks apart while only rank 0's decisions were applied): each
        fork's multiple and knob values, its optimizer's groups' numbers, its scheduler's step; one
        gather of them, at a decision (a host-side list, sent once)."""
        numbers = [float(self.step_count)]
        for f in [*self._forks, *self._clones]:
            numbers += [f.factor, *(float(f.values[k]) for k in sorted(f.values))]
            numbers += group_numbers(f.optimizer)
            numbers.append(float(getattr(f.scheduler, "last_epoch", -1)) if f.scheduler is not None else -1.0)
        self.collective.check_same(torch.tensor(numbers, dtype=torch.float64),
                                   f"{when}, the forks' settings (each fork's multiple and knob values, "
                                   "its optimizer's lr, weight decay, betas, ..., its scheduler's step: "
                                   "change them on every rank alike, with forks.each(...) on every rank)")
