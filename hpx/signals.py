"""What the controller compares: one score per replica at each sync (lower is better).

The paper compares replicas on their mean training loss over the interval
(:class:`IntervalLoss`). Replicas then read different batches, so much of the
difference between them is batch noise (docs/method.md, "The signal").
:class:`SharedBatch` scores every replica on one batch at the sync
(a paired comparison: the data noise is common to all and cancels), and
:class:`ProbeStream` on held-out batches the user supplies, which also stops a
training-loss signal from favouring settings that overfit.

A signal is any object with ``measure(ctx) -> Tensor[L]``; write your own (for
example, scoring an average of each replica's recent weights) by implementing it.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence, Sized
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

from hpx.backends.base import Collective
from hpx.errors import ConfigError
from hpx.replica import Replica

__all__ = ["IntervalLoss", "LossFn", "ProbeStream", "SharedBatch", "Signal", "SyncContext"]

LossFn = Callable[[Replica, Any], torch.Tensor]
"""``loss_fn(replica, batch) -> scalar loss tensor``."""


@dataclass
class SyncContext:
    """What a signal may read at a sync.

    Attributes:
        replicas: this process's replicas (before averaging).
        interval_loss: ``[L]`` mean recorded training loss of each local replica
            since the last sync, on the replicas' device.
        batch: the training batch of the step that triggered the sync (the whole
            batch, before it was split among local replicas), or ``None``.
        loss_fn: the training loss function given to ``Engine.step``, or ``None``.
        collective: the backend, e.g. to broadcast a batch from rank 0.
        step: the number of optimizer steps taken so far.
        round: at a sync that scores more points than there are replicas, the replicas
            score them in rounds (``0, 1, ...``): every round of one sync must score on the
            same data, so that the points compare. ``0`` otherwise.
    """

    replicas: Sequence[Replica]
    interval_loss: torch.Tensor
    batch: Any
    loss_fn: LossFn | None
    collective: Collective
    step: int
    round: int = 0


@runtime_checkable
class Signal(Protocol):
    """Scores each local replica at a sync; lower is better.

    A signal may also define ``prepare(ctx)``: :meth:`Engine.step <hpx.Engine.step>`
    calls it at the start of the step that ends with a sync, before any replica
    trains on that step's batch (``ctx.interval_loss`` is then not yet complete).
    """

    def measure(self, ctx: SyncContext) -> torch.Tensor:
        """Return a ``[L]`` tensor, one score per local replica."""
        ...


class IntervalLoss:
    """Each replica's mean training loss over the last interval (the paper's signal)."""

    def measure(self, ctx: SyncContext) -> torch.Tensor:
        return ctx.interval_loss

    def __repr__(self) -> str:
        return "IntervalLoss()"


@torch.no_grad()
def _score(replicas: Sequence[Replica], batches: Sequence[Any], loss_fn: LossFn,
           eval_mode: bool) -> torch.Tensor:
    scores = []
    for rep in replicas:
        flags = [(m, m.training) for m in rep.model.modules()]
        if eval_mode:
            rep.model.eval()
        try:
            total = sum(loss_fn(rep, b).detach().float() for b in batches)
        finally:
            for m, was in flags:
                m.training = was
        scores.append(total / len(batches))
    return torch.stack(scores)


def _broadcast_batch(batch: Any, collective: Collective) -> Any:
    """Rank 0's batch on every rank (tensors broadcast in place on a copy)."""
    if collective.world_size == 1:
        return batch
    if torch.is_tensor(batch):
        out = batch.clone()
        collective.broadcast_(out, 0)
        return out
    if isinstance(batch, (list, tuple)):
        return type(batch)(_broadcast_batch(b, collective) for b in batch)
    if isinstance(batch, dict):
        return {k: _broadcast_batch(v, collective) for k, v in batch.items()}
    return collective.broadcast_object(batch, 0)


class SharedBatch:
    """Every replica scored at the sync on one shared batch: a paired comparison.

    With :meth:`Engine.step <hpx.Engine.step>` the batch is the sync step's, scored
    *before* the replicas train on it (a batch they have just trained on favours
    whichever replica took the largest step on it: the highest learning rate).
    With :meth:`Engine.advance <hpx.Engine.advance>` it is the ``batch`` passed
    there, which should be one not yet trained on. In a distributed run rank 0's
    batch is broadcast to all ranks; every rank's batch must have the same shapes.

    Args:
        loss_fn: scores a replica on a batch; defaults to the training loss
            function. Give one without regularisers the knobs change (label
            smoothing) so the comparison is about the model, not the penalty.
        eval_mode: score with the model in eval mode (no dropout noise).
    """

    def __init__(self, loss_fn: LossFn | None = None, *, eval_mode: bool = True) -> None:
        ConfigError.check(_loss_fn_problems("SharedBatch", loss_fn)
                          + _mode_problems("SharedBatch", eval_mode))
        self.loss_fn = loss_fn
        self.eval_mode = eval_mode
        self._held: Any = None  # this sync's batch, broadcast (rounds after the first reuse it)

    def prepare(self, ctx: SyncContext) -> None:
        """Score the replicas on the sync step's batch before they train on it."""
        self._scores = self.measure(ctx)

    def measure(self, ctx: SyncContext) -> torch.Tensor:
        cached = getattr(self, "_scores", None)
        if cached is not None:
            self._scores = None
            return cached
        fn = self.loss_fn or ctx.loss_fn
        if fn is None or ctx.batch is None:
            raise ConfigError(
                ["SharedBatch needs the step's batch and a loss function: use Engine.step(loss_fn, "
                 "batch), or give SharedBatch(loss_fn=...) and pass batch= to Engine.advance"]
            )
        if ctx.round == 0 or self._held is None:  # later rounds: the same batch
            self._held = _broadcast_batch(ctx.batch, ctx.collective)
        return _score(ctx.replicas, [self._held], fn, self.eval_mode)

    def __repr__(self) -> str:
        return f"SharedBatch(eval_mode={self.eval_mode})"


def _loss_fn_problems(who: str, loss_fn: Any) -> list[str]:
    if loss_fn is not None and not callable(loss_fn):
        return [f"{who} loss_fn must be a function (replica, batch) -> scalar loss, or None for the "
                f"training loss (got {loss_fn!r})"]
    return []


def _mode_problems(who: str, eval_mode: Any) -> list[str]:
    if not isinstance(eval_mode, bool):
        return [f"{who} eval_mode must be True or False (got {eval_mode!r}): True scores the replicas in "
                "eval mode (no dropout noise)"]
    return []


def _one_batch_problems(data: Any, who: str, fix: str) -> list[str]:
    """A problem if ``data``, which should be an iterable of batches, is one batch: a dict, or
    a tuple or list of tensors with as many rows each but of different dtypes or dimensions
    (``(x, y)``), which iterated would give ``x`` and then ``y`` as batches and fail inside the
    loss with a shape or dtype error. ``fix`` shows the call that wraps it in a list, with
    ``{batch}`` where the batch goes."""
    if isinstance(data, Mapping):
        keys = ", ".join(repr(k) for k in list(data)[:4]) + (", ..." if len(data) > 4 else "")
        return [f"{who} is an iterable of batches, but it is a dict (keys {keys}), which iterated "
                f"gives its keys: if it is one batch, wrap it in a list: {fix.format(batch='val_batch')}"]
    if not isinstance(data, (tuple, list)) or len(data) < 2:
        return []
    if not all(torch.is_tensor(t) and t.dim() >= 1 for t in data) or len({t.shape[0] for t in data}) != 1:
        return []
    if len({t.dtype for t in data}) == 1 and len({t.dim() for t in data}) == 1:
        return []  # a list of batches that are plain tensors (token ids, say)
    kind = "tuple" if isinstance(data, tuple) else "list"
    shapes = ", ".join(f"{str(t.dtype).removeprefix('torch.')} {list(t.shape)}" for t in data)
    names = ", ".join(f"{v}_val" for v in "xyzw"[: len(data)]) if len(data) <= 4 else "x_val, ..."
    return [f"{who} is an iterable of batches, but it looks like one batch: a {kind} of {len(data)} tensors "
            f"with {data[0].shape[0]} rows each ({shapes}); iterated, it would give each tensor as a batch. "
            f"Wrap it in a list: {fix.format(batch=f'({names})')}"]


def _nonfinite_problems(batch: Any, what: str) -> list[str]:
    """A problem if a floating tensor in ``batch`` holds NaN or inf (a held-out batch with
    NaN would score every replica NaN, which looks like every replica blowing up)."""
    bad = [t for t in _tensors(batch) if t.is_floating_point() and not bool(torch.isfinite(t).all())]
    if bad:
        return [f"{what} holds NaN or inf values ({len(bad)} of its tensors): clean the held-out data "
                "(every replica would score NaN on it)"]
    return []


def _tensors(x: Any) -> list[torch.Tensor]:
    return [t for _, t in _leaves(x, "")]


def _leaves(x: Any, where: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor in a nested batch (tuples, lists, dicts), with where it sits."""
    return ((w, v) for w, v in _all_leaves(x, where) if torch.is_tensor(v))


def _all_leaves(x: Any, where: str) -> Iterator[tuple[str, Any]]:
    """Every leaf of a nested batch (tuples, lists, dicts), a tensor or not, with where it sits."""
    if isinstance(x, (list, tuple)):
        for i, v in enumerate(x):
            yield from _all_leaves(v, f"{where}[{i}]")
    elif isinstance(x, dict):
        for k, v in x.items():
            yield from _all_leaves(v, f"{where}[{k!r}]")
    else:
        yield where, x


def _crc(batches: Any) -> int:
    """A CRC-32 of the host tensors in ``batches`` (their shapes, dtypes and bytes); tensors on
    a device are left out (reading them back would cost a copy)."""
    crc = 0
    for where, t in _leaves(batches, ""):
        crc = zlib.crc32(f"{where}{tuple(t.shape)}{t.dtype}".encode(), crc)
        if t.device.type == "cpu" and t.numel():
            crc = zlib.crc32(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes(), crc)
    return crc


class ProbeStream:
    """Every replica scored at the sync on held-out batches the user supplies.

    Args:
        data: an iterable of batches (a DataLoader over a validation split, a list
            of tensors...). It is cycled: when exhausted it is iterated again. In a
            distributed run every rank must yield the same batches.
        loss_fn: scores a replica on a batch; defaults to the training loss function.
        batches: how many batches to score per sync.
        eval_mode: score with the model in eval mode.

    The stream's position is part of the engine's checkpoint: a resumed run scores on the
    batches the uninterrupted one would have (the data is iterated again from its start and
    the consumed batches are skipped, so it must yield the same sequence).
    """

    def __init__(self, data: Iterable[Any], loss_fn: LossFn | None = None, *, batches: int = 1,
                 eval_mode: bool = True) -> None:
        problems = []
        if not isinstance(data, Iterable):
            problems.append(f"ProbeStream data must be iterable (got {type(data).__name__})")
        elif isinstance(data, Sized) and len(data) == 0:
            problems.append("ProbeStream data is empty: give it at least one batch of held-out data")
        else:
            problems += _one_batch_problems(data, "ProbeStream data", "ProbeStream([{batch}])")
        if not isinstance(batches, int) or isinstance(batches, bool) or batches < 1:
            problems.append(f"ProbeStream batches must be an integer >= 1 (got {batches!r})")
        problems += _loss_fn_problems("ProbeStream", loss_fn) + _mode_problems("ProbeStream", eval_mode)
        if not problems and isinstance(data, (list, tuple)):  # cheap to check all now, once
            for i, b in enumerate(data):
                problems += _nonfinite_problems(b, f"probe batch {i}")
        ConfigError.check(problems)
        self.data, self.loss_fn, self.batches, self.eval_mode = data, loss_fn, batches, eval_mode
        self._it: Iterator[Any] | None = None
        self._pos = 0  # batches consumed since the start of the run
        self._held: list[Any] | None = None  # this sync's batches (rounds after the first reuse them)
        self._checked = isinstance(data, (list, tuple))
        self._content: int | None = None  # a digest of list data (see _spec)

    def _next(self) -> Any:
        rng = torch.random.get_rng_state()  # a DataLoader's iterator draws its seeds from the global
        try:                                 # stream: reading the probe must not move your run's
            return self._next_batch()
        finally:
            torch.random.set_rng_state(rng)

    def _next_batch(self) -> Any:
        for _ in range(2):
            if self._it is None:
                self._it = iter(self.data)
            try:
                batch = next(self._it)
            except StopIteration:
                self._it = None
                continue
            if not self._checked:
                ConfigError.check(_nonfinite_problems(batch, f"probe batch {self._pos}"))
            self._pos += 1
            return batch
        raise ConfigError(["ProbeStream data yielded no batches: give it at least one batch of "
                           "held-out data (an exhausted generator cannot be cycled: pass a list "
                           "or a DataLoader)"])

    def measure(self, ctx: SyncContext) -> torch.Tensor:
        fn = self.loss_fn or ctx.loss_fn
        if fn is None:
            raise ConfigError(["ProbeStream needs loss_fn=... when Engine.step is not used"])
        if ctx.round == 0 or self._held is None:  # later rounds of a sync: the same batches
            self._held = [self._next() for _ in range(self.batches)]
        return _score(ctx.replicas, self._held, fn, self.eval_mode)

    def _spec(self) -> tuple[Any, ...]:
        """What every rank's stream must share, for the ranks' agreement at construction: the
        data's length, the batches per sync, the mode, and a digest of the data when it is a
        list or tuple (computed once)."""
        if self._content is None and isinstance(self.data, (list, tuple)):
            self._content = _crc(self.data)
        return (len(self.data) if isinstance(self.data, Sized) else None, self.batches, self.eval_mode,
                self._content)

    def _sync_digest(self) -> int:
        """A digest of the batches this sync scored on (host tensors; 0 for data on a device,
        which is not read back), for the ranks' agreement at every sync."""
        return 0 if self._held is None else _crc(self._held)

    def state_dict(self) -> dict[str, Any]:
        return {"position": self._pos}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue after ``state["position"]`` consumed batches (the data cycled as the run
        cycled it, whether or not it has a length)."""
        pos = int(state["position"])
        rng = torch.random.get_rng_state()  # iterating a DataLoader draws from the global stream
        try:
            self._it = iter(self.data)
            skip, length = pos, 0
            while skip > 0:
                try:
                    next(self._it)
                except StopIteration:
                    if length == 0:
                        raise ConfigError(["ProbeStream data yielded no batches on resume: give the "
                                           "resumed run the probe data the saved run had"]) from None
                    self._it = iter(self.data)
                    skip %= length  # whole passes more are the same stream
                    continue
                length += 1
                skip -= 1
        finally:
            torch.random.set_rng_state(rng)
        self._pos = pos

    def __repr__(self) -> str:
        return f"ProbeStream(batches={self.batches}, eval_mode={self.eval_mode})"
