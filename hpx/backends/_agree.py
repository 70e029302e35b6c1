"""The ranks' agreement: one gather of digests that shows, on every rank, whether the ranks were
built or resumed alike, before a difference can pair their collectives across steps and hang."""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from typing import Any

import torch

from hpx.backends.base import Collective
from hpx.errors import ConsistencyError


def agree(collective: Collective, items: Sequence[tuple[str, Any]], when: str, device: torch.device) -> None:
    """Raise :class:`~hpx.ConsistencyError` on every rank unless every rank holds the same
    ``items`` (name, value): integers are compared as they are (the message shows each rank's),
    anything else by a digest of its ``repr``. One all_gather; ``when`` says what was being done."""
    names, values, exact = [], [], []
    for name, v in items:
        direct = isinstance(v, int) and not isinstance(v, bool)
        names.append(name)
        exact.append(direct)
        values.append(v if direct else zlib.crc32(repr(v).encode()))
    rows = collective.all_gather(torch.tensor(values, dtype=torch.int64, device=device)).cpu()
    problems = []
    for j, name in enumerate(names):
        col = rows[:, j].tolist()
        odd = [r for r, v in enumerate(col) if v != col[0]]
        if not odd:
            continue
        if exact[j]:
            have = ", ".join(f"rank {r} has {col[r]}" for r in [0, *odd])
            problems.append(f"{name}: {have}")
        else:
            problems.append(f"{name}: rank(s) {odd} differ from rank 0 (this rank's: "
                            f"{_short(dict(items)[name])})")
    if problems:
        raise ConsistencyError(
            f"the ranks disagree when {when}, so their collectives would pair up across different "
            f"steps: {'; '.join(problems)}. Build every rank with the same settings, knobs and "
            "model, and load every rank from the same checkpoint step (hpx.load_checkpoint agrees "
            "on one)")


def _short(v: Any, n: int = 120) -> str:
    text = repr(v)
    return text if len(text) <= n else text[: n - 3] + "..."
