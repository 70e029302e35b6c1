"""Sharded replicas: each replica is a group of ranks that shards the model with FSDP2.

A 2-D :class:`~torch.distributed.device_mesh.DeviceMesh` of shape ``(R, S)`` with dims
``("replicate", "shard")`` holds ``R`` replicas of ``S`` ranks each. Each replica shards the
model over its ``S`` ranks (``torch.distributed.fsdp.fully_shard``); the knobs differ across
the replicate dim. A 1-D mesh with only a ``"shard"`` dim is one replica (``R = 1``): what
:func:`hpx.autolr` needs, since its search scores its points in turn on one replica.

What each mode communicates:

* ``mode="shared"``: shard the model over the *whole* mesh (HSDP:
  ``fully_shard(model, mesh=mesh)``). FSDP reduces each step's gradient over the shard dim
  and all-reduces it over the replicate dim (its own reduction; hpx adds nothing per
  step), so every replica applies the mean gradient with its own knob values.
* ``mode="independent"``: shard over the shard dim only (``fully_shard(model,
  mesh=mesh["shard"])``): gradients are reduced within a replica, and replicas meet only
  at syncs.
* At a sync: the replicas' scores are averaged over each replica's ranks (so that all of
  them see the same numbers), gathered over the replicate dim, and each rank averages its
  own shards of the weights with the same shards of the other replicas (an all-reduce over
  its replicate group): ``1/S`` of the model's bytes per rank.

Everything the engine sees through this backend is about replicas: ``rank`` is this
process's replica (its replicate coordinate) and ``world_size`` the number of replicas
``R``; ``process_rank`` names the process itself (process 0 alone writes the history file)
and ``processes`` is a collective over every process (checkpoints are one file per process).

NaN safety: FSDP's own gradient reduction carries one replica's non-finite gradient to the
others (there is no communication hook to keep it out, as :class:`TorchDistributed` gives
DDP); the engine then stops at the next sync with :class:`~hpx.errors.NonFiniteError`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from hpx.backends.dist import TorchDistributed
from hpx.errors import BackendError, ConfigError

__all__ = ["Mesh"]


class Mesh:
    """:class:`~hpx.backends.base.Collective` over a device mesh of sharded replicas.

    Args:
        mesh: a 2-D mesh ``(replicate, shard)`` or a 1-D mesh with only the shard dim
            (one replica), covering every rank of the default process group.
        replicate: the name of the replicate dim.
        shard: the name of the shard dim.
        bucket_cap_mb: largest flat buffer of the weight average, in MB.
    """

    default_replicas = 1  # one replica per process group of the shard dim

    def __init__(self, mesh: DeviceMesh, *, replicate: str = "replicate", shard: str = "shard",
                 bucket_cap_mb: float = 25.0) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise BackendError("Mesh needs an initialised default process group (call "
                               "torch.distributed.init_process_group under torchrun first)")
        if not isinstance(mesh, DeviceMesh):
            raise ConfigError([f"mesh must be a torch.distributed DeviceMesh (got {type(mesh).__name__})"])
        names = tuple(mesh.mesh_dim_names or ())
        problems = []
        if mesh.ndim == 2 and names != (replicate, shard):
            problems.append(f"a 2-D mesh must have dims ({replicate!r}, {shard!r}) in this order "
                            f"(got {names}): build it with init_device_mesh(device, (R, S), "
                            f"mesh_dim_names=({replicate!r}, {shard!r}))")
        elif mesh.ndim == 1 and names != (shard,):
            problems.append(f"a 1-D mesh is one sharded replica: its dim must be named {shard!r} "
                            f"(got {names})")
        elif mesh.ndim not in (1, 2):
            problems.append(f"mesh must be 1-D (shard) or 2-D (replicate, shard), got {mesh.ndim} dims")
        if mesh.size() != dist.get_world_size():
            problems.append(f"mesh covers {mesh.size()} ranks but the process group has "
                            f"{dist.get_world_size()}: build the mesh over every rank")
        ConfigError.check(problems)
        self._mesh = mesh
        self.shard_dim = shard  # the mesh dim a replica shards over (checkpoints re-view tensors on it)
        self._shard_group = mesh.get_group(shard)
        self._n_shard = mesh.size(mesh_dim=names.index(shard))
        if mesh.ndim == 2:
            self._rank = mesh.get_local_rank(replicate)
            self._world = mesh.size(mesh_dim=0)
            self._replicas: TorchDistributed | None = TorchDistributed(
                mesh.get_group(replicate), bucket_cap_mb=bucket_cap_mb, nan_guard=False)
        else:
            self._rank, self._world, self._replicas = 0, 1, None
        self._all = TorchDistributed(bucket_cap_mb=bucket_cap_mb, nan_guard=False)  # the whole world

    @property
    def rank(self) -> int:
        """This process's replica: its coordinate along the replicate dim."""
        return self._rank

    @property
    def world_size(self) -> int:
        """The number of replicas ``R`` (the replicate dim's size; 1 for a 1-D mesh)."""
        return self._world

    @property
    def process_rank(self) -> int:
        """This process's global rank (process 0 writes the files shared by the run)."""
        return dist.get_rank()

    @property
    def processes(self) -> TorchDistributed:
        """A collective over every process (per-process checkpoint files agree through it)."""
        return self._all

    @property
    def mesh(self) -> DeviceMesh:
        """The mesh given at construction."""
        return self._mesh

    def __repr__(self) -> str:
        return f"Mesh(replicas={self._world}, shards={self._n_shard}, replica={self._rank})"

    def all_reduce_sum_(self, tensors: list[torch.Tensor]) -> None:
        """Sum each tensor (this rank's shard) over the replicas, in place."""
        if self._replicas is not None:
            self._replicas.all_reduce_sum_(tensors)

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every replica's ``tensor``, ``[R, *shape]``; within a replica, the mean of its ranks'
        values (its ranks score their own data; they agree on the result to the bit)."""
        t = tensor.detach().clone()
        if self._n_shard > 1:
            dist.all_reduce(t, group=self._shard_group)
            t = t / self._n_shard if t.is_floating_point() else t // self._n_shard
        if self._replicas is None:
            return t.unsqueeze(0)
        return self._replicas.all_gather(t)

    def broadcast_(self, tensor: torch.Tensor, src: int = 0) -> None:
        """Overwrite ``tensor`` (this rank's shard) with replica ``src``'s same shard."""
        if self._replicas is not None:
            self._replicas.broadcast_(tensor, src)

    def broadcast_object(self, obj: object, src: int = 0) -> object:
        """Replica ``src``'s first rank's ``obj`` on every process."""
        if not 0 <= src < self._world:
            raise ValueError(f"src must be a replica in [0, {self._world}), got {src}")
        coords = self._mesh.mesh.reshape(self._world, -1)
        return self._all.broadcast_object(obj, int(coords[src, 0]))

    def check_same(self, tensor: torch.Tensor, what: str) -> None:
        """Raise :class:`~hpx.errors.ConsistencyError` on every process if any two differ."""
        self._all.check_same(tensor, what)
