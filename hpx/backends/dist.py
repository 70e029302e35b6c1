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

A model wrapped in DistributedDataParallel gets its gradients all-reduced by DDP,
which would average one rank's NaN gradient into every rank. :meth:`TorchDistributed.prepare_model`
replaces DDP's all-reduce with one that leaves non-finite ranks out (see
:func:`finite_mean_hook`), so a rank whose loss goes NaN is outvoted at the next
sync and reset from the others, as in the in-process backend.
"""

from __future__ import annotations

import logging
import zlib

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from hpx._buckets import plan_buckets
from hpx._health import _Health
from hpx.errors import BackendError, ConfigError, ConsistencyError

__all__ = ["TorchDistributed", "finite_mean_hook"]

log = logging.getLogger("hpx")

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

    ``nan_guard`` (default on) makes :meth:`prepare_model` give a
    DistributedDataParallel model :func:`finite_mean_hook`, so a rank whose loss
    goes NaN is left out of the gradient mean and reset at the next sync, as in
    the in-process backend. Off, DDP keeps its own (C++) reduction, a little
    faster on CPU, and one rank's NaN reaches every rank: the engine then stops
    with :class:`~hpx.errors.NonFiniteError` at the next sync.
    """

    default_replicas = 1  # one replica per process when the engine is given no count

    def __init__(
        self, group: dist.ProcessGroup | None = None, *, bucket_cap_mb: float = 25.0,
        nan_guard: bool = True,
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
        self._nan_guard = bool(nan_guard)

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

    def __repr__(self) -> str:
        return (f"TorchDistributed(rank={self._rank}, world_size={self._world_size}, "
                f"backend={dist.get_backend(self._group)!r}, nan_guard={self._nan_guard})")

    def all_reduce_sum_(self, tensors: list[torch.Tensor]) -> None:
        """Sum each tensor over all ranks, in place, with one collective per bucket.

        Every rank must pass tensors of the same shapes, dtypes and order, so every
        rank forms the same buckets. Tensors keep their identity and storage, which
        lets callers reduce parameters' ``.grad`` or views into larger buffers.
        """
        with torch.no_grad():
            for idx in plan_buckets(tensors, self._bucket_cap_bytes):
                self._all_reduce_bucket([tensors[i] for i in idx])

    def all_reduce_sum_async_(self, tensor: torch.Tensor) -> dist.Work:
        """Start summing one dense tensor over all ranks, in place, as one collective; returns its
        work, whose ``wait()`` comes before ``tensor`` is read (under NCCL it makes the current stream
        wait, with no host sync). Work between the two overlaps the transfer: :class:`hpx.Forks`
        sends a fork's gradients while the next fork's backward runs. Every rank starts the same
        collectives in the same order, as for :meth:`all_reduce_sum_`."""
        if not tensor.is_contiguous():
            raise ValueError("all_reduce_sum_async_ takes a contiguous tensor (it is summed in place)")
        with torch.no_grad():
            work = dist.all_reduce(tensor, group=self._group, async_op=True)
        assert work is not None
        return work

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

    def prepare_model(self, model: torch.nn.Module) -> torch.nn.Module:
        """Make a DistributedDataParallel model's gradient mean skip non-finite ranks.

        Registers :func:`finite_mean_hook` as the model's DDP communication hook:
        each step's gradient is averaged over the ranks whose gradient is finite,
        so one rank's NaN or inf gradient no longer reaches the others. The engine calls
        this at construction; calling it yourself first is harmless (it is
        idempotent). Returns ``model`` itself.

        A model that is not DDP, a world of one rank, and any model when the backend
        was built with ``nan_guard=False`` are returned unchanged. A DDP model that
        already has a communication hook keeps it (DDP allows only one); hpx then
        logs a warning that a non-finite gradient on any rank will reach all of them.
        """
        if not (self._nan_guard and isinstance(model, DistributedDataParallel)) or self._world_size == 1:
            return model
        if getattr(model, "_hpx_finite_mean", False):
            return model
        group = model.process_group
        world = dist.get_world_size(group)
        if world != self._world_size:
            raise ConfigError(
                [f"the DistributedDataParallel model reduces over {world} ranks but TorchDistributed "
                 f"over {self._world_size}: build both on the same process group"]
            )
        state = _HookState(group, world)
        try:
            model.register_comm_hook(state, finite_mean_hook)
        except RuntimeError as exc:
            if "once" not in str(exc):
                raise
            log.warning(
                "the DistributedDataParallel model already has a communication hook, so hpx keeps "
                "it: a NaN or inf gradient on one rank will reach every rank (the in-process "
                "backend leaves such replicas out). Register hpx's finite_mean_hook instead, or "
                "none, to have it handled."
            )
            return model
        model._hpx_finite_mean = True
        model._hpx_hook_state = state  # the engine hands it each loss and reads which steps were left out
        return model

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


class _HookState:
    """:func:`finite_mean_hook`'s state: the DDP model's group, this rank's gradient health, and
    this step's verdict.

    ``ok`` (this rank's verdict: a 0-dim bool on the gradients' device, or a Python bool when read
    on the host) and ``count`` (the future of the number of ranks let in) are set by the step's
    first bucket and read by the others. ``health`` is this rank's recent range of losses and
    gradient norms (:class:`hpx._health._Health`, built at the first bucket, on its device).
    ``loss``: the loss about to be backpropagated, when the engine runs the backward (judged with
    the gradient; ``None``: the gradient alone). ``left_out``: whether this rank was left out of
    any mean since the engine last looked (the engine reads and clears it once per step).
    """

    __slots__ = ("count", "group", "health", "left_out", "loss", "ok", "read_host", "scaled", "world_size")

    def __init__(self, group: dist.ProcessGroup | None, world_size: int,
                 read_host: bool | None = None) -> None:
        self.group = group
        self.world_size = world_size
        # None: read the verdict on the host only for CPU tensors (free there).
        # False forces the on-device path (tests exercise it on CPU).
        self.read_host = read_host
        self.ok: torch.Tensor | bool | None = None
        self.count: torch.futures.Future | None = None
        self.health: _Health | None = None
        self.loss: torch.Tensor | None = None
        self.scaled = False  # a GradScaler's backward: an inf gradient is its overflow to see
        self.left_out: torch.Tensor | bool = False

    def judge(self, buf: torch.Tensor, host: bool) -> torch.Tensor | bool:
        """This rank's verdict on the step whose bucket 0 is ``buf``: may its gradient enter the
        mean (finite, and no blow-up of its loss or of bucket 0's norm; hpx/_health.py)."""
        if self.health is None:
            self.health = _Health(buf.device, host=host)
        norm = (torch.linalg.vector_norm(buf, dtype=torch.float32) if buf.is_floating_point()
                else torch.linalg.vector_norm(buf).float())  # NaN or inf if any element is
        loss = self.loss if self.loss is not None else torch.zeros((), device=buf.device)
        scaled = self.scaled
        self.loss, self.scaled = None, False
        verdict = self.health.judge(loss, norm, grads=not scaled)
        self.health.close()
        if isinstance(verdict, list):  # read on the host
            ok: torch.Tensor | bool = verdict[0]
            self.left_out = self.left_out or not ok
        else:
            ok = verdict.reshape(())
            self.left_out = self.left_out | ~ok
        return ok

    def take_left_out(self) -> torch.Tensor | bool:
        """Whether this rank was left out of a mean since the last call; clears it, and lets go
        of the step's count all-reduce (its work is done once the optimizer has stepped; a gloo
        work object still referenced when the process exits can abort it at teardown)."""
        out, self.left_out = self.left_out, False
        self.count = None
        return out


def finite_mean_hook(state: _HookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: the gradient mean over the ranks whose gradient is healthy.

    Each rank judges its own step by bucket 0, the parameters nearest the loss, which DDP
    reduces first: a rank whose loss is NaN or inf, or whose gradient blows up, shows it there
    first of all. The rule is the in-process one (``hpx/_health.py``, docs/method.md,
    "Non-finite replicas"): the rank is left out when its loss (when the engine runs the
    backward and hands it over in ``state.loss``) or bucket 0's gradient is non-finite (not
    judged under a GradScaler, whose overflow it is to see: ``state.scaled``), or
    when either is more than 100 times this rank's recent maximum. A rank left out sends zeros
    in every bucket and a 0 where the others send a 1, and every bucket's sum is divided by the
    number of ranks let in instead of the world size ``W``. The flags travel in one 1-element
    all-reduce per step, issued with bucket 0. The engine reads ``state.left_out`` once per
    step and counts such a rank as non-finite for the interval: at the next sync it is the
    worst and is reset from the others (a rank whose weights blew up stays out until then).

    When every rank is let in the result is DDP's own, bit for bit: each bucket is
    multiplied by ``1/W`` before the sum, as DDP does. If no rank is let in the
    gradient is zero, and the engine stops at the sync with
    :class:`~hpx.errors.NonFiniteError` if the weights are non-finite, as in process. A NaN
    that appears only in a later bucket (inside backward, with a finite loss and finite last
    layers) is not caught here; it then reaches every rank, as it would in process.

    Nothing is read back from an accelerator: the verdict, the recent maximum and the masking
    stay on the gradients' device (on CPU, where reading is free, the verdict is read and a
    bucket let in skips the masking pass). Cost over DDP's own all-reduce: the ``1/W`` scaling
    DDP would otherwise fuse into its gradient copy (a hook receives the bucket unscaled), the
    Python call per bucket, one norm pass over bucket 0 (about 1 MiB with DDP's defaults; a
    NaN or inf anywhere makes it non-finite, so it is the finiteness check too), the verdict's
    few scalar operations and one tiny all-reduce. On a CPU the scaling pass is most of it, a
    few percent of a step (``docs/benchmarks.md``); on GPUs these passes are small beside the
    all-reduce.
    """
    buf = bucket.buffer()
    world = state.world_size
    cpu = buf.device.type == "cpu" if state.read_host is None else state.read_host
    if bucket.index() == 0:
        state.ok = state.judge(buf, cpu)
        flag = (torch.tensor([float(state.ok)], device=buf.device) if isinstance(state.ok, bool)
                else state.ok.to(torch.float32).reshape(1))
        state.count = dist.all_reduce(flag, group=state.group, async_op=True).get_future()
    ok, count = state.ok, state.count
    if ok is None or count is None:  # cannot happen with DDP's in-order buckets
        raise RuntimeError("finite_mean_hook: bucket 0 of the step was not seen first")
    # DDP's own reduction multiplies by 1/W while copying gradients into the bucket
    # (before the sum: no fp16 overflow); a hook gets the bucket unscaled.
    buf.mul_(1.0 / world)
    if isinstance(ok, bool):
        if not ok:
            buf.zero_()
    else:
        torch.where(ok, buf, torch.zeros((), dtype=buf.dtype, device=buf.device), out=buf)
    summed = dist.all_reduce(buf, group=state.group, async_op=True).get_future()

    def rescale(f: torch.futures.Future) -> torch.Tensor:
        n_ok = f.value()[1].value()[0][0]  # [the bucket's future, the count's future]
        if isinstance(ok, bool):
            c = float(n_ok)
            if c != world:
                buf.mul_(world / max(c, 1.0))
            return buf
        # W / W is exactly 1: with every rank finite the bucket is left bit for bit.
        return buf.mul_(world / n_ok.clamp_min(1))

    return torch.futures.collect_all([summed, count]).then(rescale)


# DDP checks a hook's annotations against the real types, and this module's
# annotations are strings (``from __future__ import annotations``).
finite_mean_hook.__annotations__ = {
    "state": _HookState, "bucket": dist.GradBucket, "return": torch.futures.Future[torch.Tensor],
}


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
