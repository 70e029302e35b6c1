"""The in-process backend: one process (``W = 1``) holding all ``N`` replicas.

Across processes there is nothing to communicate, so every collective is the
identity; the engine averages the local replicas itself. This is the default:
it runs on a laptop CPU or one GPU with no launcher.
"""

from __future__ import annotations

import torch

__all__ = ["InProcess"]


class InProcess:
    """The identity collective of a single process (implements :class:`~hpx.backends.base.Collective`)."""

    rank = 0
    world_size = 1
    default_replicas = 4  # replicas per process when the engine is given no count

    def all_reduce_sum_(self, tensors: list[torch.Tensor]) -> None:
        return None

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.unsqueeze(0)

    def broadcast_(self, tensor: torch.Tensor, src: int = 0) -> None:
        return None

    def broadcast_object(self, obj: object, src: int = 0) -> object:
        return obj

    def check_same(self, tensor: torch.Tensor, what: str) -> None:
        return None

    def __repr__(self) -> str:
        return "InProcess()"
