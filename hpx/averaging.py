"""The converge step (HDET Eq. 3): weighted averages of replicas' tensors, in flat buckets.

Replicas are averaged with per-replica weights known on the host at a sync
(1 for a healthy replica, 0 for one whose loss or weights went non-finite), so a
poisoned replica is left out by skipping it, never by multiplying NaN by zero.
The result can be written to every replica (the converge step) or only to some
(resetting poisoned replicas from the consensus without averaging the rest).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence

import torch

from hpx._buckets import plan_buckets
from hpx.backends.base import Collective

__all__ = ["average_", "broadcast_", "constant_buffers", "float_state", "local", "optimizer_state_tensors",
           "params"]

_LOW_PRECISION = (torch.float16, torch.bfloat16)


def _flat(ts: Iterable[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1).to(dtype) for t in ts])


def average_(
    replicas: Sequence[Sequence[torch.Tensor]],
    weights: Sequence[float],
    total_weight: float,
    collective: Collective,
    *,
    write: Sequence[bool] | None = None,
    bucket_cap_mb: float = 25.0,
    check_finite: bool = False,
) -> bool:
    """Set tensors to the weighted mean over every replica of every rank; return whether
    it was written.

    Args:
        replicas: ``replicas[l]`` is local replica ``l``'s list of tensors; the
            lists match in length, shapes and dtypes.
        weights: local replica weights (host floats); weight 0 leaves a replica
            out of the mean.
        total_weight: the sum of the weights over *all* ranks' replicas.
        collective: sums the partial means across ranks (identity in process).
        write: which local replicas receive the mean (default: all).
        bucket_cap_mb: largest flat bucket, in MB of the tensors' own dtype.
        check_finite: write nothing and return False if the mean holds a NaN or inf (one pass
            over the mean instead of one over every replica: a finite mean of replicas with
            positive weights means they are all finite, barring an overflow of the sum, which
            the caller then sorts out replica by replica). Every rank reaches the same verdict.

    Low-precision tensors (fp16/bf16) are summed in float32, one bucket at a time; the mean
    is held in their own dtype until it is written (transient memory: one flat copy of a
    replica's tensors in their own dtype, plus a bucket).
    """
    if not replicas or not replicas[0]:
        return True
    if total_weight <= 0:
        raise ValueError(f"total_weight must be > 0 (got {total_weight})")
    write = [True] * len(replicas) if write is None else list(write)
    first = replicas[0]
    if collective.world_size == 1 and len(replicas) == 1 and weights[0] != 0:
        # one replica in all: the mean is the replica itself; only its finiteness is in question
        return not check_finite or _agreed(_all_finite(first), collective, first[0].device)
    if collective.world_size == 1 and not any(t.dtype in _LOW_PRECISION for t in first):
        return _average_local_(replicas, weights, total_weight, write, collective, check_finite)
    cap = int(bucket_cap_mb * 2**20)
    # a float32 sum of a low-precision bucket takes twice its bytes: half the cap keeps it within
    plan = plan_buckets(first, cap // 2 if any(t.dtype in _LOW_PRECISION for t in first) else cap)
    means = []  # one flat copy in the tensors' own dtype, held until the verdict
    for idx in plan:
        dtype = first[idx[0]].dtype
        acc_dtype = torch.float32 if dtype in _LOW_PRECISION else dtype
        s = torch.zeros(sum(first[i].numel() for i in idx), dtype=acc_dtype, device=first[idx[0]].device)
        views = list(s.split([first[i].numel() for i in idx]))
        with torch.no_grad():
            for rep, w in zip(replicas, weights):
                if w != 0:  # added in place: no flat copy of the replica
                    _add_(views, [rep[i].detach().reshape(-1) for i in idx], w)
        # reduced bucket by bucket (as a backend does anyway), so that a float32 sum of
        # low-precision tensors lives one bucket at a time
        collective.all_reduce_sum_([s])
        s.div_(total_weight)
        means.append(s if acc_dtype == dtype else s.to(dtype))
    if check_finite and not _agreed(_all_finite(means), collective, means[0].device):
        return False
    for idx, s in zip(plan, means):
        parts = s.split([first[i].numel() for i in idx])
        for rep, do in zip(replicas, write):
            if do:
                targets = [rep[i] for i in idx]
                sources = [p.view(t.shape).to(t.dtype) for p, t in zip(parts, targets)]
                with torch.no_grad():
                    torch._foreach_copy_(targets, sources)
    return True


_CHUNK = 2**20  # elements: a low-precision tensor is widened this much at a time


def _add_(sums: list[torch.Tensor], ts: list[torch.Tensor], w: float) -> None:
    """``sums += w * ts``. A low-precision tensor added to a float32 sum is first cast whole by
    torch (a float32 temporary of its size: 800 MB for a 200 M-element embedding), so it is
    added in chunks instead."""
    if all(s.dtype == t.dtype for s, t in zip(sums, ts)):
        torch._foreach_add_(sums, ts, alpha=w)
        return
    for s, t in zip(sums, ts):
        for a, b in zip(s.split(_CHUNK), t.split(_CHUNK)):
            a.add_(b, alpha=w)


@torch.no_grad()
def _all_finite(ts: Sequence[torch.Tensor]) -> bool:
    """Whether every element of ``ts`` is finite: one pass, one host read. (The 2-norm, the
    fastest foreach reduction, is non-finite iff an element is, or, for values near the
    dtype's range, when its sum of squares overflows: a false alarm the caller sorts out.)"""
    if not ts:
        return True
    norms = torch._foreach_norm([t if t.is_floating_point() else t.float() for t in ts])
    return bool(torch.isfinite(torch.stack(norms)).all())


def _agreed(ok: bool, collective: Collective, device: torch.device) -> bool:
    """``ok`` on every process. Processes that reduced the same sums reach the same verdict; a
    backend whose replicas span several processes (each holding other shards: it says so by
    giving ``processes``, as ``hpx.backends.Mesh`` does) gives each its own, and all must act
    alike: one small gather settles it."""
    if getattr(collective, "processes", None) is None:
        return ok
    flags = collective.all_gather(torch.tensor(1.0 if ok else 0.0, device=device))
    return bool((flags >= 1.0).all())  # Mesh averages a flag within a replica: < 1 if a shard failed


@torch.no_grad()
def _average_local_(replicas: Sequence[Sequence[torch.Tensor]], weights: Sequence[float],
                    total_weight: float, write: Sequence[bool], collective: Collective,
                    check_finite: bool = False) -> bool:
    """One process: the same sum, in the same order, with foreach ops on the tensors
    themselves (one extra copy of a replica's tensors; no flat buffers to build and split)."""
    live = [(rep, w) for rep, w in zip(replicas, weights) if w != 0]
    if not live:
        return True
    (rep0, w0), rest = live[0], live[1:]
    x0 = [t.detach() for t in rep0]
    if w0 == 1.0 and rest:  # x0 + w1 x1 in one pass: the same bits as 0 + 1 * x0, then + w1 x1
        (rep1, w1), rest = rest[0], rest[1:]
        acc = torch._foreach_add(x0, [t.detach() for t in rep1], alpha=w1)
    else:
        acc = torch._foreach_mul(x0, w0)  # 0 + w0 * x0, as the flat path
    for rep, w in rest:
        torch._foreach_add_(acc, [t.detach() for t in rep], alpha=w)
    if check_finite and not _agreed(_all_finite(acc), collective, acc[0].device):
        return False
    torch._foreach_div_(acc, total_weight)
    for rep, do in zip(replicas, write):
        if do:
            torch._foreach_copy_(list(rep), acc)
    return True


def broadcast_(tensors: Sequence[torch.Tensor], collective: Collective, src: int = 0,
               bucket_cap_mb: float = 25.0) -> None:
    """Overwrite ``tensors`` on every rank with rank ``src``'s, in flat buckets."""
    if collective.world_size == 1 or not tensors:
        return
    for idx in plan_buckets(tensors, int(bucket_cap_mb * 2**20)):
        flat = _flat((tensors[i] for i in idx), tensors[idx[0]].dtype)
        collective.broadcast_(flat, src)
        with torch.no_grad():
            for i, p in zip(idx, flat.split([tensors[i].numel() for i in idx])):
                tensors[i].copy_(p.view(tensors[i].shape))


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a sharded tensor (a ``DTensor``, as FSDP2 makes parameters and
    their optimizer state), sharing its storage; any other tensor as it is."""
    if type(t).__name__ == "DTensor":  # no torch.distributed import: hpx runs without it
        with torch.no_grad():
            return t.to_local()
    return t


def params(module: torch.nn.Module) -> list[torch.Tensor]:
    """A model's parameters as this rank holds them (shards for a sharded model)."""
    _reshard(module)
    return [local(p) for p in module.parameters()]


def _reshard(module: torch.nn.Module) -> None:
    """Put an FSDP2 model's parameters back in their sharded form (after a forward the root
    keeps them gathered, and what is written to the gathered copies would be lost)."""
    for m in module.modules():
        reshard = getattr(m, "reshard", None)
        if reshard is not None and type(m).__name__.startswith("FSDP"):
            reshard()


def float_state(module: torch.nn.Module, constants: Collection[str] = ()) -> list[torch.Tensor]:
    """A model's parameters and floating-point buffers, in a fixed order (this rank's
    shards of sharded ones).

    Integer buffers (``num_batches_tracked``) are left out: they are equal on
    every replica anyway, and averaging integers is not defined. So are the buffers named in
    ``constants`` (see :func:`constant_buffers`).
    """
    out = params(module)
    out += [local(b) for name, b in module.named_buffers()  # FSDP2 keeps buffers whole
            if b.is_floating_point() and name not in constants]
    return out


@torch.no_grad()
def constant_buffers(module: torch.nn.Module) -> frozenset[str]:
    """Names of the floating buffers that hold a non-finite value before training: constants
    such as a causal mask of ``-inf`` above the diagonal
    (``nn.Transformer.generate_square_subsequent_mask``), not statistics that training
    updates. They are equal on every replica; averaging them would turn ``-inf`` into NaN
    when the replicas' masks mix signs, and a health check would read them as blown-up weights,
    so they are neither averaged nor checked. Read once, when the engine is built."""
    return frozenset(name for name, b in module.named_buffers()
                     if b.is_floating_point() and b.numel() and not bool(torch.isfinite(local(b)).all()))


def optimizer_state_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The optimizer's floating-point state tensors (momenta, Adam moments) in a fixed order
    (this rank's shards of sharded ones).

    Scalar step counters are left out: they are equal across replicas.
    """
    out = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            for _, v in sorted(optimizer.state.get(p, {}).items()):
                if torch.is_tensor(v) and v.is_floating_point() and v.dim() > 0:
                    out.append(local(v))
    return out
