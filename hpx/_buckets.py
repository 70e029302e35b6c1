"""Flat buckets: which tensors travel together in one flat buffer."""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["dtype_groups", "plan_buckets"]


def dtype_groups(tensors: Sequence[torch.Tensor], *, skip_empty: bool = False
                 ) -> dict[tuple[torch.device, torch.dtype], list[int]]:
    """Indices of ``tensors`` by (device, dtype), the groups in first-appearance order: the one
    grouping of the flat gradient buffers and of every message shaped like them (every rank
    must form the same groups in the same order)."""
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, t in enumerate(tensors):
        if t.numel() or not skip_empty:
            groups.setdefault((t.device, t.dtype), []).append(i)
    return groups


def plan_buckets(tensors: Sequence[torch.Tensor], cap_bytes: int) -> list[list[int]]:
    """Indices of ``tensors`` grouped into buckets of one (device, dtype) each.

    Groups keep first-appearance order (not, say, sorted device names): under NCCL
    each rank's device is a different ``cuda:k``, but every rank sees its groups
    in the same order, which is what keeps collectives matched. Within a group,
    tensors fill a bucket in order until the next would exceed ``cap_bytes``, so a
    tensor bigger than the cap travels alone. Empty tensors are left out.
    """
    groups = dtype_groups(tensors, skip_empty=True)
    buckets: list[list[int]] = []
    for idx in groups.values():
        current: list[int] = []
        size = 0
        for i in idx:
            nbytes = tensors[i].numel() * tensors[i].element_size()
            if current and size + nbytes > cap_bytes:
                buckets.append(current)
                current, size = [], 0
            current.append(i)
            size += nbytes
        if current:
            buckets.append(current)
    return buckets
