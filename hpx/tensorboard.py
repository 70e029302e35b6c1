"""Live knob trajectories in TensorBoard: ``hpx.Engine(..., on_sync=hpx.TensorBoard("runs/exp"))``."""

from __future__ import annotations

import math
import os
from typing import Any

from hpx.errors import ConfigError
from hpx.sync_record import SyncRecord

__all__ = ["TensorBoard"]


class TensorBoard:
    """Write every sync record to TensorBoard (an ``on_sync`` callback of :class:`~hpx.Engine`).

    Scalars, at the sync's step: ``hpx/base/<knob>`` (the base ``b``), ``hpx/applied/<knob>``
    (the value the optimizer used, mean over the replicas, with ``.../min`` and ``.../max``);
    for a knob that is a factor on the learning rates (:func:`~hpx.autolr`'s ``"lr"``,
    a :class:`~hpx.LearningRateScale`), ``hpx/base/lr_factor`` and ``hpx/applied/lr_factor``,
    and ``hpx/applied/lr`` is the learning rate the optimizer used (the record's ``lr``);
    ``hpx/score/best`` and ``hpx/score/mean`` (finite replicas), ``hpx/nonfinite`` (replicas
    left out) and ``metrics/<name>`` for what was given to :meth:`Engine.log <hpx.Engine.log>`.

    Args:
        writer: a ``torch.utils.tensorboard.SummaryWriter``, or a directory to create one
            in (needs the ``tensorboard`` package: ``pip install "hpx-hdet[tensorboard]"``;
            without it an ``ImportError`` says so).
        rank0_only: under torch.distributed, write on rank 0 only (every rank holds the
            same records).
    """

    def __init__(self, writer: Any, *, rank0_only: bool = True) -> None:
        if isinstance(writer, (str, os.PathLike)):
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as exc:
                raise ImportError(f"hpx.TensorBoard({str(writer)!r}) writes with the tensorboard package: "
                                  'pip install "hpx-hdet[tensorboard]" (or pip install tensorboard), '
                                  "or pass a SummaryWriter") from exc
            writer = SummaryWriter(str(writer))
        elif not callable(getattr(writer, "add_scalar", None)):
            raise ConfigError([f"TensorBoard takes a directory or a SummaryWriter (got {writer!r})"])
        self.writer = writer
        self.rank0_only = rank0_only

    def __call__(self, rec: SyncRecord) -> None:
        if self.rank0_only and _rank() != 0:
            return
        w, t = self.writer, rec.step
        for name, b in rec.bases.items():
            w.add_scalar(f"hpx/base/{_tag(rec, name)}", b, t)
        applied = {_tag(rec, name): vals for name, vals in (rec.applied or {}).items()}
        if rec.lr:  # the learning rate the optimizer used, where the knob is a factor on it
            applied["lr"] = rec.lr
        for name, vals in applied.items():  # the lr: the run's (for hpx.Forks yours, not the forks' mean)
            shown = rec.run_lr() if name == "lr" else None
            w.add_scalar(f"hpx/applied/{name}", sum(vals) / len(vals) if shown is None else shown, t)
            w.add_scalar(f"hpx/applied/{name}/min", min(vals), t)
            w.add_scalar(f"hpx/applied/{name}/max", max(vals), t)
        finite = [s for s in rec.scores if math.isfinite(s)]
        if finite and rec.searched is False:  # the training loss, recorded while the search does not act
            w.add_scalar("hpx/train_loss", sum(finite) / len(finite), t)
        elif finite:
            w.add_scalar("hpx/score/best", min(finite), t)
            w.add_scalar("hpx/score/mean", sum(finite) / len(finite), t)
        w.add_scalar("hpx/nonfinite", len(rec.nonfinite), t)
        for name, v in (rec.metrics or {}).items():
            w.add_scalar(f"metrics/{name}", v, t)
        w.flush()

    def close(self) -> None:
        self.writer.close()


def _tag(rec: SyncRecord, name: str) -> str:
    """Knob ``name``'s part of a tag: ``lr_factor`` for a factor on the learning rates."""
    return rec.label(name).replace(" ", "_")


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
