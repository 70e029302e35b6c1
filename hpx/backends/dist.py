"""The multi-process backend: one replica per process, talking through torch.distributed.

This is the only module in hpx that imports :mod:`torch.distributed`, so that hpx
imports and runs in-process on builds of torch without it.

Processes are started by the user, typically with::

    torchrun --nproc_per_node=4 your_script.py

and each calls ``torch.distributed.init_process_group(backend="nccl")`` (GPUs) or
``backend="gloo"`` (CPU) before building a :class:`TorchDistributed`.

Devices: tensors go to the process group exactly where they are; nothing is moved
to or from the host behind the caller's back, since a silent copy would hide a
device mismatch and cost a round trip per step. Under NCCL pass CUDA tensors, and
call ``torch.cuda.set_device(local_rank)`` first (``broadcast_object`` stages its
pickled payload on the current CUDA device). Under gloo pass CPU tensors: gloo
implements only some collectives for CUDA tensors, so CUDA with gloo is not
supported here; use NCCL for GPUs.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence

import torch
import torch.distributed as dist

from hpx.errors import BackendError, ConfigError, ConsistencyError

__all__ = ["TorchDistributed"]

_MB = 1024 * 1024

_LAUNCH_HINT = (
    "Launch one process per replica, e.g. `torchrun --nproc_per_node=4 your_script.py`, "
    'and call `torch.distributed.init_process_group(backend="gloo")` (CPU) or '
    '`backend="nccl"` (GPU) in each process before creating TorchDistributed; '
    "or, to run all replicas in one process, use the in-process default backend instead."
)

# check_same first compares this many leading dims of the shape (plus ndim and
# numel, which cover the rest well enough to make the data gather safe).
_META_DIMS = 8


class TorchDistributed:
    """:class:`~hpx.backends.base.Collective` over a torch.distributed process group.

    ``rank``, ``world_size`` and every ``src`` are ranks *within* ``group`` (the
    default group when ``group`` is None), so a sub-group behaves like a world of
    its own.

    ``bucket_cap_mb`` bounds the flat buffers :meth:`all_reduce_sum_` packs tensors
    into: large enough that a model's many small tensors cost a handful of
    collective calls instead of one each, small enough that the temporary copy
    stays a modest fraction of memory.
    """

    def __init__(
        self, group: dist.ProcessGroup | None = None, *, bucket_cap_mb: float = 25.0
    ) -> None:
        if not bucket_cap_mb > 0:  # also rejects NaN
            raise ConfigError(
                [f"bucket_cap_mb must be a positive number of megabytes, got {bucket_cap_mb!r}"]
            )
        if not dist.is_available():
            raise BackendError(
                "torch.distributed is not available in this build of torch. " + _LAUNCH_HINT
            )
        if not dist.is_initialized():
            raise BackendError(
                "TorchDistributed needs an initialised default process group, and there is "
                "none. " + _LAUNCH_HINT
            )
        rank = dist.get_rank(group)
        if rank < 0:
            raise BackendError(
                f"this process (global rank {dist.get_rank()}) is not a member of the given "
                "process group; create TorchDistributed only on the group's members"
            )
        self._group = group
        self._rank = rank
        self._world_size = dist.get_world_size(group)
        self._bucket_cap_bytes = int(bucket_cap_mb * _MB)

    @property
    def rank(self) -> int:
        """This process's rank within the group."""
        return self._rank

    @property
    def world_size(self) -> int:
        """Number of processes in the group."""
        return self._world_size

    @property
    def group(self) -> dist.ProcessGroup | None:
        """The process group given at construction (None: the default group)."""
        return self._group

    def all_reduce_sum_(self, tensors: list[torch.Tensor]) -> None:
        """Sum each tensor over all ranks, in place, with one collective per bucket.

        Every rank must pass tensors of the same shapes, dtypes and order, so every
        rank forms the same buckets. Tensors keep their identity and storage, which
        lets callers reduce parameters' ``.grad`` or views into larger buffers.
        """
        with torch.no_grad():
            for bucket in _buckets(tensors, self._bucket_cap_bytes):
                self._all_reduce_bucket(bucket)

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Return every rank's ``tensor`` stacked as ``[W, *tensor.shape]``, rank order."""
        # Gathering flat 1-D buffers is the one layout every backend accepts,
        # including for 0-dim inputs.
        out = torch.empty(
            self._world_size * tensor.numel(), dtype=tensor.dtype, device=tensor.device
        )
        # Recent torch renamed all_gather_into_tensor (now deprecated); use what exists.
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        with torch.no_grad():
            gather(out, tensor.detach().reshape(-1).contiguous(), group=self._group)
        return out.view(self._world_size, *tensor.shape)

    def broadcast_(self, tensor: torch.Tensor, src: int = 0) -> None:
        """Overwrite ``tensor`` in place on every rank with rank ``src``'s values."""
        self._check_src(src)
        with torch.no_grad():
            if tensor.is_contiguous():
                dist.broadcast(tensor, group=self._group, group_src=src)
            else:
                # Collectives need dense memory; go through a copy and write back.
                buf = tensor.contiguous()
                dist.broadcast(buf, group=self._group, group_src=src)
                tensor.copy_(buf)

    def broadcast_object(self, obj: object, src: int = 0) -> object:
        """Return rank ``src``'s picklable ``obj`` on every rank.

        Pickles, so keep it to rare, small, host-side data; the value other ranks
        pass is ignored.
        """
        self._check_src(src)
        box = [obj if self._rank == src else None]
        dist.broadcast_object_list(box, group=self._group, group_src=src)
        return box[0]

    def check_same(self, tensor: torch.Tensor, what: str) -> None:
        """Raise :class:`ConsistencyError` on every rank if ranks hold different ``tensor``.

        Equality is exact, except that NaN equals NaN (a NaN in the same place on
        every rank is agreement). Every rank reaches the same verdict from the same
        gathered data, so either all raise or none does, and no rank is left
        waiting in a later collective. Shape and dtype are compared first, so a
        disagreement there is reported too instead of breaking the gather.
        """
        meta = self.all_gather(_shape_signature(tensor))
        bad = _disagreeing_rows(meta)
        if bad:
            raise ConsistencyError(
                f"{what} differ across ranks: ranks {bad} disagree with rank 0 on shape or "
                f"dtype (rank 0: {_describe(meta[0])}; rank {bad[0]}: {_describe(meta[bad[0]])})"
            )
        if tensor.numel() == 0:
            return  # same shape and dtype, and no values to differ
        gathered = self.all_gather(tensor).reshape(self._world_size, -1)
        bad = _disagreeing_rows(gathered)
        if bad:
            n_diff = int((~_same_as_first(gathered)[bad[0]]).sum())
            raise ConsistencyError(
                f"{what} differ across ranks: ranks {bad} disagree with rank 0 "
                f"(rank {bad[0]} differs in {n_diff} of {gathered.shape[1]} elements)"
            )

    def _all_reduce_bucket(self, bucket: list[torch.Tensor]) -> None:
        if len(bucket) == 1 and bucket[0].is_contiguous():
            # Reduce in place: no packing copy, and the caller's storage is untouched.
            dist.all_reduce(bucket[0], group=self._group)
            return
        # cat makes a fresh dense buffer whatever the inputs' strides are.
        flat = torch.cat([t.reshape(-1) for t in bucket])
        dist.all_reduce(flat, group=self._group)
        for t, chunk in zip(bucket, flat.split([t.numel() for t in bucket])):
            t.copy_(chunk.view(t.shape))

    def _check_src(self, src: int) -> None:
        if not 0 <= src < self._world_size:
            raise ValueError(f"src must be a rank in [0, {self._world_size}), got {src}")


def _buckets(tensors: Sequence[torch.Tensor], cap_bytes: int) -> list[list[torch.Tensor]]:
    """Split ``tensors`` into flat-packable buckets of one (device, dtype) each.

    Groups keep first-appearance order (not, say, sorted device names): under NCCL
    each rank's device is a different ``cuda:k``, but every rank sees its groups
    in the same order, which is what keeps the collectives matched. Within a
    group, tensors fill a bucket in order until the next would exceed the cap, so
    a tensor bigger than the cap travels alone. Empty tensors need no communication
    and are dropped.
    """
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for t in tensors:
        if t.numel():
            groups.setdefault((t.device, t.dtype), []).append(t)
    buckets: list[list[torch.Tensor]] = []
    for group in groups.values():
        current: list[torch.Tensor] = []
        current_bytes = 0
        for t in group:
            nbytes = t.numel() * t.element_size()
            if current and current_bytes + nbytes > cap_bytes:
                buckets.append(current)
                current, current_bytes = [], 0
            current.append(t)
            current_bytes += nbytes
        if current:
            buckets.append(current)
    return buckets


def _shape_signature(tensor: torch.Tensor) -> torch.Tensor:
    """A fixed-size int64 summary of dtype and shape, on the tensor's device.

    Fixed size so it can itself be gathered before anything is known to match;
    the dtype is named by a CRC of its string, which, unlike ``hash``, is the same
    in every process.
    """
    dims = list(tensor.shape[:_META_DIMS]) + [-1] * (_META_DIMS - min(tensor.dim(), _META_DIMS))
    values = [zlib.crc32(str(tensor.dtype).encode()), tensor.dim(), tensor.numel(), *dims]
    return torch.tensor(values, dtype=torch.int64, device=tensor.device)


def _describe(signature: torch.Tensor) -> str:
    dtype_crc, ndim, numel, *dims = signature.tolist()
    shape = str(tuple(dims[: min(ndim, _META_DIMS)]))
    if ndim > _META_DIMS:
        shape = f"{ndim}-dim, starting {shape}"
    names = {
        zlib.crc32(str(d).encode()): str(d)
        for d in vars(torch).values()
        if isinstance(d, torch.dtype)
    }
    return f"shape {shape} of {numel} elements, {names.get(dtype_crc, 'unknown dtype')}"


def _same_as_first(rows: torch.Tensor) -> torch.Tensor:
    """Elementwise agreement of each row of ``[W, n]`` with row 0, NaN equal to NaN."""
    first = rows[:1]
    same = rows == first
    if rows.is_floating_point() or rows.is_complex():
        same |= rows.isnan() & first.isnan()
    return same


def _disagreeing_rows(rows: torch.Tensor) -> list[int]:
    same = _same_as_first(rows.reshape(rows.shape[0], -1)).all(dim=1)
    return (~same).nonzero().flatten().tolist()
