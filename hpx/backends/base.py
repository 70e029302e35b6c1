"""The one interface through which hpx communicates between processes.

The engine sees the world as ``W`` processes (``world_size``), each holding ``L``
local replicas, for ``N = W * L`` replicas in all. The in-process backend is the
case ``W = 1, L = N``; the torch.distributed backend is ``W = N, L = 1``. Global
replica index of local replica ``l`` on rank ``k`` is ``k * L + l``.

A backend only moves tensors; it knows nothing of knobs, models or optimizers.
Two optional members let a backend shape what the engine does without the engine
knowing which backend it has: ``default_replicas`` (replicas per process when the user
gives no count; 1 if absent) and ``prepare_model(model) -> model`` (called once on the
user's model, e.g. to register a gradient hook). A backend whose replicas span several
processes (each holding shards of the model, :class:`hpx.backends.Mesh`) also gives
``process_rank`` (the process itself) and ``processes`` (a collective over every process).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

__all__ = ["Collective"]


@runtime_checkable
class Collective(Protocol):
    """Collective operations over the processes of a run.

    Every method is called by every rank in the same order with tensors of the
    same shapes and dtypes (the usual collective contract). Implementations must
    accept tensors on any device the backend supports and leave results on the
    input's device.
    """

    @property
    def rank(self) -> int:
        """This process's rank, ``0 <= rank < world_size``."""
        ...

    @property
    def world_size(self) -> int:
        """Number of processes ``W``."""
        ...

    def all_reduce_sum_(self, tensors: list[torch.Tensor]) -> None:
        """Replace each tensor, in place, by its sum over all ranks.

        Implementations coalesce the list into a few flat buffers per
        (device, dtype) rather than one call per tensor.
        """
        ...

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Stack every rank's ``tensor`` along a new leading dim: shape ``[W, *tensor.shape]``."""
        ...

    def broadcast_(self, tensor: torch.Tensor, src: int = 0) -> None:
        """Overwrite ``tensor`` in place, on every rank, with rank ``src``'s copy."""
        ...

    def broadcast_object(self, obj: object, src: int = 0) -> object:
        """Return rank ``src``'s picklable ``obj`` on every rank (for rare, small, host-side data)."""
        ...

    def check_same(self, tensor: torch.Tensor, what: str) -> None:
        """Raise :class:`~hpx.errors.ConsistencyError` on every rank if ranks' ``tensor`` differ.

        ``what`` is a plural noun phrase naming the tensor ("knob bases"); the
        message names the disagreeing ranks.
        """
        ...

    # Optional: ``prepare_model(model) -> model``, called by the engine on the user's
    # model before replicas are built (TorchDistributed gives a DDP model its NaN guard);
    # ``all_reduce_sum_async_(tensor) -> work`` (``work.wait()`` before reading ``tensor``),
    # which hpx.Forks uses to overlap a fork's gradient reduction with the next fork's
    # backward (without it, ``all_reduce_sum_`` is called at once).
