"""Write sync records through :class:`hpx.TensorBoard` and read back what TensorBoard stored."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import hpx


def written(records: list[hpx.SyncRecord], path: Path) -> Any:
    """The event accumulator of a board that received ``records`` (skips without tensorboard)."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    board = hpx.TensorBoard(path)
    for r in records:
        board(r)
    board.close()
    acc = EventAccumulator(str(path))
    acc.Reload()
    return acc
