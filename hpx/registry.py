"""Knobs: the ordered registry of a run's knobs and its own permutation stream."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from hpx._seed import derive_seed
from hpx.errors import ConfigError
from hpx.knobs.base import Knob
from hpx.knobs.optim import LearningRateScale
from hpx.sync_record import SyncRecord

__all__ = ["Knobs"]


class Knobs:
    """An ordered set of knobs with unique names, and the random stream that
    assigns their slots.

    At every sync each knob draws its own permutation ``pi_k`` of the slots
    (HDET Eq. 9), so no replica is "high" on every knob at once and each knob's
    signal is not confounded by the others. The permutations come from a
    ``torch.Generator`` owned by the registry, seeded with ``seed``: the global
    torch/numpy/random state is never read or changed, and every rank that uses
    the same seed draws the same permutations.

    Args:
        *knobs: the knobs, in the order logs and checkpoints list them.
        seed: seed of the permutation stream; ``None`` takes the engine's ``seed``.
        independent: ``False`` makes all knobs share one permutation per sync
            (an ablation: it confounds the knobs' signals).
    """

    def __init__(self, *knobs: Knob, seed: int | None = None, independent: bool = True) -> None:
        problems = []
        for k in knobs:
            if not isinstance(k, Knob):
                problems.append(f"Knobs takes Knob objects (got {k!r} of type {type(k).__name__}): declare "
                                "each as an object, e.g. hpx.LearningRate('lr', spread=0.25)")
        names = [getattr(k, "name", None) for k in knobs]
        dupes = sorted({n for n in names if names.count(n) > 1 and n is not None})
        if dupes:
            problems.append(f"knob names must be unique (repeated: {dupes})")
        if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
            problems.append(f"seed must be an integer or None (got {seed!r})")
        ConfigError.check(problems)
        self._knobs: tuple[Knob, ...] = tuple(knobs)
        self.independent = bool(independent)
        self._gen = torch.Generator(device="cpu")
        self.seed: int | None = None
        if seed is not None:
            self.reseed(seed)

    def reseed(self, seed: int) -> None:
        """Restart the permutation stream from ``seed``."""
        self.seed = seed
        self._gen.manual_seed(derive_seed(seed, 0x6B6E6F62))  # the "knob" stream of this seed

    def __iter__(self) -> Iterator[Knob]:
        return iter(self._knobs)

    def __len__(self) -> int:
        return len(self._knobs)

    def __getitem__(self, name: str) -> Knob:
        for k in self._knobs:
            if k.name == name:
                return k
        raise KeyError(f"no knob named {name!r} (knobs: {self.names})")

    def __contains__(self, name: object) -> bool:
        return any(k.name == name for k in self._knobs)

    @property
    def names(self) -> list[str]:
        return [k.name for k in self._knobs]

    def label_lr(self, record: SyncRecord) -> None:
        """Fill ``record.lr`` (the learning rate each replica's optimizer used) and
        ``record.lr_factor`` from ``record.applied`` when a :class:`~hpx.LearningRateScale`
        knob sets the learning rates (its values are factors on them); leave them ``None``
        otherwise. The engine calls it on every record before it is kept or shown."""
        applied = record.applied or {}
        for k in self._knobs:
            if isinstance(k, LearningRateScale) and k.name in applied:
                lrs = [lr for f in applied[k.name] if (lr := k.learning_rate(f)) is not None]
                if len(lrs) == len(applied[k.name]):  # else not bound
                    record.lr, record.lr_factor = lrs, k.name
                return

    def draw_slots(self, n: int) -> torch.Tensor:
        """Draw the next permutations: an int64 tensor ``[K, n]`` whose row ``k``
        gives every replica's slot for knob ``k``."""
        if self.independent:
            rows = [torch.randperm(n, generator=self._gen) for _ in self._knobs]
        else:
            perm = torch.randperm(n, generator=self._gen)
            rows = [perm for _ in self._knobs]
        if not rows:
            return torch.empty(0, n, dtype=torch.int64)
        return torch.stack(rows)

    def state_dict(self) -> dict[str, Any]:
        return {
            "seed": self.seed,
            "rng": self._gen.get_state(),
            "knobs": [k.state_dict() for k in self._knobs],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved = [s["name"] for s in state["knobs"]]
        if saved != self.names:
            raise ConfigError(
                [f"checkpoint holds knobs {saved} but this run declares {self.names}"]
            )
        self.seed = state["seed"]
        self._gen.set_state(state["rng"])
        for k, s in zip(self._knobs, state["knobs"]):
            k.load_state_dict(s)

    def __repr__(self) -> str:
        inner = ", ".join(repr(k) for k in self._knobs)
        return f"Knobs({inner}, seed={self.seed})"
