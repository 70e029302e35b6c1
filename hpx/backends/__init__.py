"""Backends: the Collective protocol and its implementations.

``TorchDistributed`` lives in :mod:`hpx.backends.dist` and ``Mesh`` (sharded replicas, FSDP2)
in :mod:`hpx.backends.mesh`, the modules that import torch.distributed; they are imported only
when asked for.
"""

from hpx.backends.base import Collective
from hpx.backends.local import InProcess

__all__ = ["Collective", "InProcess", "Mesh", "TorchDistributed", "default_backend"]


def default_backend() -> Collective:
    """The backend an engine uses when none is given: every replica in this process
    (:class:`InProcess`). Under torch.distributed pass ``TorchDistributed()`` explicitly."""
    return InProcess()


def __getattr__(name: str):
    if name == "TorchDistributed":
        from hpx.backends.dist import TorchDistributed

        return TorchDistributed
    if name == "Mesh":
        from hpx.backends.mesh import Mesh

        return Mesh
    raise AttributeError(f"module 'hpx.backends' has no attribute {name!r}")
