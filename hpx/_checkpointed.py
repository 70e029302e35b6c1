"""What a route gives the checkpoint files and takes back: the one protocol between
:mod:`hpx.checkpoint` (atomic files, digests, pruning, the ranks' common step, identity, random
streams) and the routes that save through it (:class:`hpx.Forks`, :class:`hpx.Engine`).

torch's ``Stateful`` idea: the file layer calls ``state_dict()`` / ``load_state_dict()`` and the
hooks below, and never asks which route it holds. A route subclasses :class:`_Checkpointed` and
keeps its own checks (what built the run, which of its models are finite) in its own package.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol


class _ShardFiles(Protocol):
    """A route's state that spans several processes and goes through
    ``torch.distributed.checkpoint`` (the engine's sharded replicas): written and read by every
    process together, beside each process's own file."""

    def save(self, folder: Path, state: dict[str, Any]) -> None:
        """Write the shards into ``folder``; take out of ``state`` (this process's file) what they hold."""

    def load(self, root: Path, extra: Any, rng: bool, elastic: bool) -> int | None:
        """Resume from the newest step in ``root`` that every saved process completed; the step, or
        ``None`` when there is none."""


class _Checkpointed:
    """The hooks :func:`hpx.save_checkpoint` and :func:`hpx.load_checkpoint` call on a route.

    Besides these, a route has ``collective`` (its backend; ``collective.processes`` when its
    replicas span several processes), ``step_count``, ``state_dict()``, ``load_state_dict(state)``,
    ``_load_problems(state)`` (what a load would refuse, before anything changes) and
    ``_check_aligned(when)`` (ranks at different steps raise instead of hanging: called before a save
    and before a load).
    """

    #: Why ``load_checkpoint(..., elastic=True)`` is refused for this route (``None``: it resumes
    #: with another number of replicas or processes through ``_elastic_problems`` and ``load_elastic``).
    _elastic_refusal: str | None = None

    def _unsaveable(self) -> str | None:
        """Why this step must not be saved (the warning logged; nothing is written), or ``None`` to
        save it. The same answer on every rank."""
        return None

    def _shard_files(self) -> _ShardFiles | None:
        """The route's sharded state (``None``: each process's file holds all of its state)."""
        return None

    def _elastic_problems(self, states: list[Any]) -> list[str]:
        """What an elastic load of the saved processes' ``states`` would refuse."""
        return [self._elastic_refusal or "this run cannot resume elastically"]

    def load_elastic(self, states: list[dict[str, Any]]) -> None:
        """Resume from every saved process's state, saved with another number of replicas or processes."""
        raise NotImplementedError(self._elastic_refusal or "this run cannot resume elastically")
