"""What :class:`hpx.Forks` does when something goes wrong while it trains: a non-finite loss
(read a step late, without waiting on the device; the step it first appeared at, and on which
rank, kept on the device), a probe loss that is non-finite for a finite run, every fork lost,
ranks that ran different numbers of steps, and ranks that trained apart (what each step applied
and the forks' weights, compared at every decision). A mixin of ``Forks``: it reads and writes the
search's own attributes."""

from __future__ import annotations

import copy
import hashlib
import logging
import math
from array import array
from typing import Any

import torch

from hpx.averaging import local
from hpx.errors import ConfigError, ConsistencyError, NonFiniteError
from hpx.forks.fork import _device, _rng_get, _rng_set
from hpx.forks.misuse import _label
from hpx.forks.probe import group_numbers
from hpx.forks.ranks import (
    _APART,
    _MET,
    check_steps_aligned,
    held_marker,
    marker_problem,
    point_of,
    send_marker,
    weights_digest,
)
from hpx.replica import Replica

log = logging.getLogger("hpx")


_APPLIED = ("lr", "momentum", "betas", "weight_decay", "eps")  # what a schedule (or a hand) sets per step


class _Faults:
    """Non-finite losses and ranks out of step (see the module's docstring)."""

    _forks: Any
    _clones: Any
    _parents: Any
    _losses_bad: Any
    _pending: Any
    _crossed: Any
    _marks: Any
    _sharder: Any
    _apart: Any
    _half: str | None
    _probe: Any
    _probe_fn: Any
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
        if float(bad) == 0 and not self._agreed(self._overflows()):
            raise NonFiniteError(f"at step {self.step_count} the probe's loss_fn gave your run a non-finite "
                                 "loss while its weights are finite: the probe's loss is at fault, not your "
                                 "run (a log of 0, a division by zero, a NaN in the probe batches); fix "
                                 "loss_fn or the probe and resume from your last checkpoint. Nothing was "
                                 "decided")

    def _overflows(self) -> bool:
        """Whether your run's probe loss, non-finite with finite weights, is finite in float64: its
        outputs overflowed their dtype (a run blowing up: lost, as a run with non-finite weights is),
        not a fault of the loss (a log of 0, a division by zero or a NaN in the probe stays
        non-finite in float64). Rescored once on a float64 copy of your model and the probe's
        floating tensors; a rescoring that cannot run (a sharded model, a loss that fixes its own
        dtype) answers False, and the probe's loss is named as before."""
        if self._sharder is not None:
            return False
        start = self._forks[0]
        dev = _device(start.model)
        keep = _rng_get(dev)
        try:
            model = copy.deepcopy(start.model).to(torch.float64).eval()
            replica = Replica(start.replica.index, model, start.optimizer)
            replica._values.update(start.replica._values)
            with torch.no_grad(), torch.autocast(dev.type, enabled=False):
                for batch in self._probe:
                    loss = self._probe_fn(replica, _as_float64(batch))
                    if not bool(torch.isfinite(torch.as_tensor(loss)).all()):
                        return False
        except Exception:
            return False
        finally:
            _rng_set(keep, dev)
        log.warning("hpx.Forks: at step %d your run's probe loss overflowed (finite in float64): its "
                    "outputs blew up; it is lost", self.step_count)
        return True

    def _raise_if_all_lost(self, scores: list[float]) -> None:
        if self._agreed(not any(math.isfinite(s) for s in scores)):  # every rank: one collective follows
            found, fix = self._first_bad_steps()
            raise NonFiniteError(f"at step {self.step_count} every fork's weights or probe loss are "
                                 f"non-finite ({[f.setting() for f in self._forks]}){found}: {fix}")

    def _note_bad(self, bad: torch.Tensor) -> None:
        """A backward's non-finite flags (one per fork trained, on the device): the first step at which
        some fork's loss, and the first at which every fork's loss, was non-finite on this rank, kept
        on the device (a masked fill, no host read) for the error that stops the run to name."""
        first = self.__dict__.get("_first_bad")
        if first is None or first.device != bad.device:
            first = self.__dict__["_first_bad"] = torch.full((2,), -1, dtype=torch.int64, device=bad.device)
        first.masked_fill_(torch.stack([bad.any(), bad.all()]) & (first < 0), self.step_count + 1)

    def _first_bad_steps(self) -> tuple[str, str]:
        """For :class:`~hpx.errors.NonFiniteError` at a decision (every rank calls it: one gather
        under torch.distributed): where the training losses first went non-finite, naming the step
        and the rank(s), and the fix."""
        first = self.__dict__.get("_first_bad")
        if first is None:
            first = torch.full((2,), -1, dtype=torch.int64, device=_device(self._forks[0].model))
        world = self.collective.world_size
        rows = (self.collective.all_gather(first) if world > 1 else first.reshape(1, 2)).cpu().tolist()
        fix = "lower the learning rate, or check the data and the probe for NaN/inf"
        for col in (1, 0):  # every fork's loss at once (a batch's fault) first, else some fork's
            steps = [r[col] for r in rows if r[col] > 0]
            if not steps:
                continue
            s = min(steps)
            who = [rank for rank, r in enumerate(rows) if r[col] == s]
            on = "" if world == 1 else f" on rank {who[0]}" if len(who) == 1 else f" on ranks {who}"
            if col == 0:
                return (f"; the training losses first went non-finite at step {s}{on} (some forks' "
                        f"only)", fix)
            spread = "" if world == 1 else (", and the gradients averaged over the ranks carried it to every "
                                            "rank's forks")
            return (f"; the training losses first went non-finite at step {s}{on}, every fork's at once: "
                    f"that step's batch{on.replace(' on', ' of')} or the loss holds a NaN or inf{spread}",
                    f"skip or mend that batch (or fix the loss) and resume from a checkpoint saved before "
                    f"step {s}")
        return "", fix

    def _note_applied(self, trained: list[Any]) -> None:
        """Under torch.distributed, before a step's optimizer steps: what the step applies (each fork's
        multiple at this step and its knob values, its optimizer's groups' lr, momentum or betas, weight
        decay and eps as the schedule left them), host numbers only (a tensor lr is not read: that would
        wait on its device), kept as one 64-bit hash per step until the next decision compares them over
        the ranks (:meth:`_check_apart`). Python's hash of numbers and tuples is the same in every
        process (``PYTHONHASHSEED`` salts strings only); about 2 us per fork."""
        if self.collective.world_size == 1:
            return
        step = self.step_count + 1
        held = self.__dict__.get("_applied")
        if held is None or held[0] + len(held[1]) != step:  # the first, or a resume moved the count
            held = self.__dict__["_applied"] = (step, array("q"))
        numbers: list[Any] = []
        for f in trained:
            numbers += (f.replica.index, f.multiple_at(self.step_count))
            numbers += [f.values[k] for k in sorted(f.values)]
            for g in f.optimizer.param_groups:
                numbers += [_number(g.get(k)) for k in _APPLIED]
        held[1].append(hash(tuple(numbers)))

    def _check_apart(self, when: str) -> None:
        """Under torch.distributed, at a decision and ``converge()``, after :meth:`_check_aligned`:
        ranks that trained apart raise :class:`ConsistencyError` on every rank, whatever set them
        alike since (a schedule rewrites an lr one rank set alone at the next step). One gather holds
        the hash of what every step since the last decision applied (:meth:`_note_applied`) and each
        fork's weights' digest (:func:`hpx.forks.ranks.weights_digest`, exact: ranks that train alike
        hold bit-identical forks, each fork's gradients all-reduced); a second, only when the steps'
        hashes differ, finds the first step that differed. Sharded forks' weights are not compared
        (each rank holds another shard); forks not finite on some rank are left to the non-finite
        checks."""
        if self.collective.world_size == 1:
            return
        if self._apart is not None and bool(self._apart):  # the cause named first (the same on every rank)
            raise ConsistencyError(_APART)
        forks = [*self._forks, *self._clones]
        start, steps = self.__dict__.pop("_applied", None) or (self.step_count + 1, array("q"))
        dev = _device(self._forks[0].model)
        whole = self._sharder is None  # a sharded fork's weights differ by design: each rank holds a shard
        digest = weights_digest(forks if whole else []).to(dev)
        head = torch.tensor([start, len(steps), _hash(steps.tobytes())], dtype=torch.int64)
        rows = self.collective.all_gather(torch.cat([head.to(dev), digest.reshape(-1)])).cpu()
        heads, digests = rows[:, :3], rows[:, 3:].reshape(rows.shape[0], digest.shape[0], 3)
        applied = (heads != heads[0]).any(1)
        finite = (digests[:, :, 2] == 0).all(0)  # [F]: finite on every rank
        off = (digests[:, :, :2] != digests[0, :, :2]).any(2) & finite  # [W, F]: unlike rank 0's
        ranks = (applied | off.any(1)).nonzero().reshape(-1).tolist()
        if not ranks:
            return
        said, first = [], None
        if applied.any() and bool((heads[:, :2] == heads[0, :2]).all()):
            every = self.collective.all_gather(torch.frombuffer(steps, dtype=torch.int64).to(dev)).cpu()
            j = int((every != every[0]).any(0).nonzero()[0])
            first = start + j
            at = [r for r in range(every.shape[0]) if every[r, j] != every[0, j]]
            said.append(f"the settings a step applied (each fork's lr, after its schedule and its multiple; "
                        f"its optimizer's other numbers; its knob values) first differed at step {first} "
                        f"(ranks {at}), though they agree now (a schedule rewrites an lr at its next step)")
        elif applied.any():
            said.append(f"the ranks took {heads[:, 1].tolist()} steps since the last decision (from steps "
                        f"{heads[:, 0].tolist()})")
        names = [_label(self, f) for f, w in zip(forks, off.any(0).tolist()) if w]
        if names:
            said.append(f"the weights of {', '.join(names)} differ" + ("" if first is not None else
                                                                     " while every step applied the same "
                                                                     "settings"))
        since = f"a checkpoint saved before step {first}" if first is not None else "your last checkpoint"
        raise ConsistencyError(
            f"{when}, ranks {ranks} trained apart from rank 0: {'; '.join(said)}. A change "
            "made on one rank alone (forks.each(...), an lr set by hand, a weight changed or loaded, in a "
            "branch only that rank takes) trains the ranks apart while only rank 0's decisions are applied: "
            f"make every change on every rank alike (forks.each(...) on every rank), and resume from {since}")

    def _check_ranks(self, when: str) -> None:
        """Before a decision or ``converge()``: every rank at the same step (:meth:`_check_aligned`),
        no rank trained apart (:meth:`_check_apart`), nothing the forks hold alike written on your
        model alone (:meth:`_check_held`); each raises on every rank alike. In one process, a run
        left part changed (``forks.step()`` or ``each()`` failing part way) is refused first."""
        if self._half is not None and self.collective.world_size == 1:
            raise ConfigError([self._half])
        self._check_aligned(when)
        self._check_apart(when)
        self._check_held(when)

    def _check_started(self) -> None:
        """Under torch.distributed, before the first probe pass: every rank is starting its first step
        (the starting marker of :func:`hpx.forks.ranks.check_steps_aligned`), so a rank that loads a
        checkpoint while another starts afresh raises on both instead of hanging."""
        if self.collective.world_size > 1 and self._sharder is None and self.step_count == 0:
            check_steps_aligned(self._trained(), self.collective, 0, "starting the first step", starting=True)

    def _check_aligned(self, when: str) -> None:
        """Under torch.distributed, before a decision, ``converge()`` or a load: every rank is at the
        same step, or every rank raises :class:`ConsistencyError` within one collective instead of
        hanging (:func:`hpx.forks.ranks.check_steps_aligned`; with ``shard=``, whose step collectives are
        FSDP's, the step marker of :meth:`_mark`)."""
        if self.collective.world_size == 1:
            return
        if self._sharder is not None:
            self._mark(when, point_of(when))
        else:
            if self._crossed is not None and bool(self._crossed):  # a host read, at a decision
                raise ConsistencyError(f"a training step of this rank met another rank's decision, "
                                       f"converge() or load_checkpoint (found at step {self.step_count}): "
                                       f"{_MET}")
            check_steps_aligned(self._trained(), self.collective, self.step_count, when)
        self._check_settings(when)

    def _mark(self, when: str, point: int) -> None:
        """Under ``shard=`` over several ranks, before a step's first collective (``point`` 0) and
        before a decision, ``converge()``, a save or a load: every rank's point and step compared
        (:func:`hpx.forks.ranks.send_marker`), each rank raising :class:`ConsistencyError` alike. Read
        at once where the process group has a CPU backend; else a step's table stays on the device
        and is read at the next decision (no host sync per step)."""
        try:
            rows = send_marker(self.collective, point, self.step_count, _device(self._forks[0].model))
        except RuntimeError as e:  # gloo's "Connection closed by peer": a rank's process ended
            raise ConsistencyError(
                f"{when}, the ranks' step marker could not be exchanged: another rank has left the run or "
                f"cannot be reached (its process ended, crashed or stopped calling hpx; see its own error). "
                f"Every rank must take every step and call converge(). The process group said: {e}") from e
        held = None
        if rows.device.type != "cpu":
            if point == 0:
                self._marks = held_marker(self._marks, rows)
                return
            held, self._marks = self._marks, None
        problem = marker_problem(rows, when)
        if problem is None and held is not None and bool(held[0]):  # a host read, at a decision
            problem = marker_problem(held[1], f"{when} (found there, at an earlier step)")
        if problem is not None:
            raise ConsistencyError(problem)

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


def _number(v: Any) -> Any:
    """``v`` if it is a plain number or a tuple of them (betas), else ``-1.0`` (a tensor or ``None``,
    whose hash is its identity: another in every process)."""
    t = type(v)
    if t is float or t is int or (t is tuple and all(type(x) is float or type(x) is int for x in v)):
        return v
    return -1.0


def _hash(data: bytes) -> int:
    """A 64-bit hash of ``data`` (the same in every process), as a signed integer."""
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little", signed=True)


def _as_float64(batch: Any) -> Any:
    """``batch`` with its floating tensors in float64 (in lists, tuples and dicts); the rest as it is."""
    if isinstance(batch, torch.Tensor):
        return batch.to(torch.float64) if batch.is_floating_point() else batch
    if isinstance(batch, dict):
        return {k: _as_float64(v) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)) and not hasattr(batch, "_fields"):
        return type(batch)(_as_float64(v) for v in batch)
    return batch
