"""Forks' gradients over the ranks (every rank holding every fork): each fork's gradient averaged
in buckets of bounded size, with how many ranks had each parameter's gradient, and the marker a
decision sends so that ranks that ran different numbers of steps raise instead of hanging."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from hpx._buckets import dtype_groups
from hpx.errors import ConsistencyError
from hpx.forks.fork import _device, _Fork

_APART = ("under torch.distributed some ranks' losses reached a parameter that others' did not (a branch "
          "or an expert chosen by the data), so its gradient was averaged over some ranks only and the "
          "ranks' forks drifted apart: make every rank's loss reach every trainable parameter (add 0 * "
          "head(x).sum() for a branch not taken), or freeze the parameters no loss reaches, as plain DDP "
          "(without find_unused_parameters) requires too")


@torch.no_grad()
def mean_over_ranks(trained: Sequence[_Fork],
                    collective: Any) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Every fork's gradient <- its mean over the ranks: one all-reduce per (device, dtype) group,
    holding every trainable parameter (zeros where this rank's loss did not reach it, so that every
    rank's buffers line up) and how many ranks had its gradient. Returns a device flag (no host
    read): some parameter's gradient on some ranks and not on others; and a rank that sent a
    decision's marker (:func:`check_steps_aligned`)."""
    world = collective.world_size
    params = [p for f in trained for p in f.model.parameters() if p.requires_grad]
    apart = met = None
    for idx in dtype_groups(params, skip_empty=True).values():
        for ps in _buckets([params[i] for i in idx]):
            odd, m = _reduce_bucket(ps, collective, world)
            apart = odd if apart is None else apart | odd
            met = m if met is None else met | m
    return apart, met


_MET = ("the ranks ran different numbers of optimizer steps: every step's gradient all-reduce must pair with "
        "the same step's on every rank. Give every rank as many batches (drop_last=True, one length per "
        "rank), skip a bad batch on every rank or on none, and call converge() and load_checkpoint on every "
        "rank")


def first_bucket(trained: Sequence[_Fork]) -> list[torch.Tensor]:
    """The parameters of a step's first all-reduce (:func:`mean_over_ranks`): the shape a decision's
    marker takes so that a rank still at a step pairs with it (:func:`check_steps_aligned`)."""
    params = [p for f in trained for p in f.model.parameters() if p.requires_grad]
    groups = list(dtype_groups(params, skip_empty=True).values())
    return _buckets([params[i] for i in groups[0]])[0] if groups else []


def check_steps_aligned(trained: Sequence[_Fork], collective: Any, step: int, when: str,
                        starting: bool = False) -> None:
    """Before a decision (or converge(), or a load) under torch.distributed: every rank sends one
    all-reduce shaped as a step's first, zeros where the gradients go and the marker ``-(W + 1)``
    where the counts of ranks go. Ranks at the same point see ``W`` markers; a rank still at a
    training step pairs its gradients with it instead, and both raise :class:`ConsistencyError`
    within that one collective, where they used to hang until the process group's timeout (the
    engine's marker, ``hpx/engine/aligned.py``, for Forks' buckets). Float gradients of 16 bits are not
    checked (the sum of markers is not exact there).

    ``starting``: the first step's marker, sent before the first probe pass (whose collectives are
    not a step's), twice the others': a rank that starts training while another loads a checkpoint
    (or decides, or saves) pairs its marker with the other's, the sum is neither rank's marker times
    ``W``, and both raise (with two markers any mix is caught: ``a n_a + 2 a n_b = a W`` only if
    ``n_b = 0``)."""
    ps = first_bucket(trained)
    if not ps or ps[0].dtype not in (torch.float32, torch.float64):
        return
    world = collective.world_size
    mark = -float(world + 1) * (2 if starting else 1)  # a step's counts are 0..W: a marker makes it negative
    flat = ps[0].new_zeros(sum(p.numel() for p in ps) + len(ps))
    flat[-len(ps):] = mark
    collective.all_reduce_sum_([flat])
    if not bool((flat[-len(ps):] == mark * world).all()):
        other = ("loading a checkpoint, deciding or saving while this one starts training" if starting
                 else "at a training step")
        raise ConsistencyError(f"{when} at step {step}, another rank was {other}: {_MET}")


def met_a_marker(count_sums: torch.Tensor) -> torch.Tensor:
    """After a step's all-reduce: a negative count means a rank sent a decision's marker (device
    flag; :class:`hpx.Forks` reads it at once on the CPU, at the next decision elsewhere)."""
    return (count_sums < 0).any()


_BUCKET = 1 << 24  # elements in one all-reduce (64 MiB of float32): the flat copy's memory stays bounded


def _buckets(ps: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """``ps`` in consecutive runs of at most :data:`_BUCKET` elements (a larger tensor alone)."""
    out: list[list[torch.Tensor]] = [[]]
    size = 0
    for p in ps:
        if out[-1] and size + p.numel() > _BUCKET:
            out.append([])
            size = 0
        out[-1].append(p)
        size += p.numel()
    return out


def _reduce_bucket(ps: list[torch.Tensor], collective: Any, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One all-reduce of ``ps``' gradients (zeros where there is none) and of how many ranks had
    each; the gradients <- their mean. Returns the device flags of a gradient some ranks lacked and
    of a rank that sent a decision's marker instead, which is raised as :class:`ConsistencyError`
    at once on the CPU (a host read of a CPU tensor: free) and at the next decision elsewhere."""
    has = ps[0].new_ones(len(ps))
    for j, p in enumerate(ps):
        if p.grad is None:
            has[j] = 0
    flat = torch.cat([p.grad.reshape(-1) if p.grad is not None else p.new_zeros(p.numel()) for p in ps]
                     + [has])
    collective.all_reduce_sum_([flat])
    counts, grads = flat[-len(ps):], flat[:-len(ps)].div_(world)
    met = met_a_marker(counts)
    if met.device.type == "cpu" and bool(met):
        raise ConsistencyError(f"a training step of this rank met another rank's decision, converge() or "
                               f"load_checkpoint: {_MET}")
    for p, part in zip(ps, grads.split([p.numel() for p in ps])):
        if p.grad is not None:
            p.grad.copy_(part.view_as(p.grad))
    return ((counts > 0) & (counts < world)).any(), met


_DIGEST_RUN = 1 << 20  # elements digested at once: a decision's transient memory stays bounded (~25 MiB)
_BITS = {1: torch.int8, 2: torch.int16}  # a float's bits as integers; 4 bytes and more: as int32 words


@torch.no_grad()
def weights_digest(forks: Sequence[_Fork]) -> torch.Tensor:
    """Each fork's trainable weights in three integers (``[F, 3]`` int64, on their device; no host
    read): the sum of their bits read as integers, the sum of those weighted by position (1 to 251,
    so a swap or two changes that cancel in the first are caught too), and how many are not finite.
    Integer sums are exact and do not depend on the order a device adds in, so ranks that hold the
    same weights bit for bit give the same digest on any hardware, and a one-bit difference gives
    another. For a decision's agreement check (:meth:`hpx.forks.faults._Faults._check_apart`)."""
    rows = []
    weight: torch.Tensor | None = None
    for f in forks:
        params = [p for p in f.model.parameters() if p.requires_grad and p.numel()]
        dev = _device(f.model)
        sums = torch.zeros(3, dtype=torch.int64, device=dev)
        for idx in dtype_groups(params, skip_empty=True).values():
            for run in _digest_runs([params[i] for i in idx]):
                flat = torch.cat(run) if len(run) > 1 else run[0]
                if flat.is_complex():
                    flat = torch.view_as_real(flat).reshape(-1)
                bits = flat.view(_BITS.get(flat.element_size(), torch.int32)).to(torch.int64)
                if weight is None or weight.device != bits.device or weight.numel() < bits.numel():
                    weight = torch.arange(bits.numel(), device=bits.device).remainder_(251).add_(1)
                sums[0] += bits.sum()
                sums[1] += bits.mul_(weight[:bits.numel()]).sum()
                sums[2] += (~torch.isfinite(flat)).sum()
        rows.append(sums)
    return torch.stack(rows) if rows else torch.zeros(0, 3, dtype=torch.int64)


def _digest_runs(ps: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """``ps``' elements (flat) in consecutive runs of at most :data:`_DIGEST_RUN` (a larger tensor split)."""
    out: list[list[torch.Tensor]] = [[]]
    size = 0
    for p in ps:
        for part in p.detach().reshape(-1).split(_DIGEST_RUN):
            if out[-1] and size + part.numel() > _DIGEST_RUN:
                out.append([])
                size = 0
            out[-1].append(part)
            size += part.numel()
    return [r for r in out if r]
