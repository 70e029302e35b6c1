"""Ranks that ran different numbers of steps, in shared mode over several processes.

There every optimizer step all-reduces the gradient (``[*per-dtype flat gradients, count]``,
the count being how many local replicas' gradients were let in, >= 0). Before a sync's first
collective, at ``converge()`` and at ``load_checkpoint``, every rank sends one all-reduce of
exactly that shape: zeros, and a marker ``-(2^40 + step)`` where a step sends its count. Ranks
at the same step all send the marker and see ``W`` of them. A rank still at a training step
pairs its gradient with it instead: it sees a negative count, and the rank at the sync a sum that
is not ``W`` markers. Each raises a :class:`~hpx.errors.ConsistencyError` that says what
happened, where ranks whose collectives no longer pair up would otherwise abort in gloo (a size
mismatch) or hang. The price, per sync: one gradient-sized all-reduce, and a zero buffer of one
gradient's size while it runs (a step of the flat-bucket path allocates as much for its sums).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hpx._buckets import dtype_groups
from hpx.backends.base import Collective
from hpx.errors import ConsistencyError

_FIX = ("the ranks ran different numbers of optimizer steps since the last sync, and in shared mode "
        "every step's gradient all-reduce must pair with the same step's on every rank. Give every "
        "rank as many batches (drop_last=True, one length per rank), skip a bad batch on every rank "
        "or on none, and call load_checkpoint on every rank")


def check_aligned(collective: Collective, model: torch.nn.Module, step: int, when: str,
                  crossed: Sequence[torch.Tensor | None]) -> None:
    """The marker all-reduce; ``crossed``: the step paths' device flags (a step met a sync)."""
    if any(c is not None and bool(c) for c in crossed):  # the host read, once per sync
        raise ConsistencyError(f"a training step of this rank met another rank's sync, converge() or "
                               f"load_checkpoint (found at the sync of step {step}): {_FIX}")
    marker = -(2.0 ** 40 + step)  # any sum with one in it is < 0, since counts are >= 0
    params = [p for p in model.parameters() if p.requires_grad]
    zeros = [torch.zeros(sum(params[i].numel() for i in idx), device=d, dtype=t)  # the step's groups
             for (d, t), idx in dtype_groups(params).items()]
    dev = params[0].device if params else torch.device("cpu")
    flag = torch.full((1,), marker, dtype=torch.float64, device=dev)
    collective.all_reduce_sum_([*zeros, flag])
    if float(flag) != marker * collective.world_size:
        raise ConsistencyError(f"{when} at step {step}, another rank was at a training step (or at another "
                               f"step's sync): {_FIX}")


def met_a_sync(count: torch.Tensor, crossed: torch.Tensor | None,
               host: bool | None = None) -> torch.Tensor | None:
    """After a step's gradient all-reduce: a negative ``count`` means a rank sent the marker.
    Raised at once on the CPU (reading is free); elsewhere remembered on the device (returned,
    or-ed into ``crossed``) and raised at the next sync. ``host=False`` takes the device path on
    the CPU too (tests)."""
    if (count.device.type == "cpu") if host is None else host:
        if float(count.reshape(-1)[0]) < 0:
            raise ConsistencyError("a training step of this rank met another rank's sync, converge() or "
                                   f"load_checkpoint: {_FIX}")
        return crossed
    neg = count.reshape(-1)[0] < 0
    return neg if crossed is None else crossed | neg
