"""A batch cut among replicas: every tensor in it split along its first dimension. Used by the
engine's step (each replica its share of the batch) and by hpx.Forks' probe (the probe in chunks)."""

from __future__ import annotations

from typing import Any

import torch

from hpx.errors import ConfigError
from hpx.signals import _leaves


def _split(batch: Any, n: int) -> list[Any]:
    """``batch`` cut into ``n`` parts along the first dimension of every tensor in it."""
    if n == 1:
        return [batch]
    ConfigError.check(_split_problems(batch, n))
    return _cut(batch, n)


def _split_problems(batch: Any, n: int) -> list[str]:
    leaves = list(_leaves(batch, "batch"))
    if not leaves:
        return []
    flat = [(where, t) for where, t in leaves if t.dim() == 0]
    if flat:
        samples = isinstance(batch, list) and batch and all(isinstance(b, (tuple, list, dict)) for b in batch)
        if samples:
            return [f"batch is a list of {len(batch)} separate examples, not a collated batch: stack them "
                    "first (torch.utils.data.default_collate(batch), or a DataLoader), so that every "
                    "tensor has one row per example"]
        return [f"{flat[0][0]} is a 0-dim tensor: hpx splits every tensor of the batch among the {n} "
                "replicas along its first dimension; give tensors with one row per example (or pass "
                "batches=[...], one per replica)"]
    sizes = {where: t.shape[0] for where, t in leaves}
    if len(set(sizes.values())) > 1:
        shown = ", ".join(f"{w}: {k}" for w, k in list(sizes.items())[:4])
        return [f"the batch's tensors have different lengths along their first dimension ({shown}): hpx "
                f"splits each of them among the {n} replicas, so they must hold the same examples"]
    size = next(iter(sizes.values()))
    if size < n:
        return [f"a batch of size {size} cannot be split among {n} replicas: give at least one example "
                "per replica"]
    return []


def _cut(batch: Any, n: int) -> list[Any]:
    if torch.is_tensor(batch):
        return list(torch.tensor_split(batch, n))
    if isinstance(batch, (list, tuple)):
        cols = [_cut(b, n) for b in batch]
        return [type(batch)(c[i] for c in cols) if not hasattr(batch, "_fields")
                else type(batch)(*(c[i] for c in cols)) for i in range(n)]
    if isinstance(batch, dict):
        cols = {k: _cut(v, n) for k, v in batch.items()}
        return [{k: v[i] for k, v in cols.items()} for i in range(n)]
    return [batch] * n
