"""An opt-in progress line, updated at every sync: ``Engine(..., on_sync=hpx.ProgressBar(total))``."""

from __future__ import annotations

import math
import sys
from typing import IO

from hpx.errors import ConfigError
from hpx.sync_record import SyncRecord

__all__ = ["ProgressBar"]


class ProgressBar:
    """Rewrites one line on a terminal at every sync: how far the run is, each knob's base,
    the best replica's score and the wall time. No dependency; a sync is the only time it
    runs, so it costs nothing per step.

    Args:
        total_steps: the run's length (the bar's 100%); ``None``: the step count alone.
        stream: where to write (default ``sys.stderr``).
        width: characters of the bar.

    Under torch.distributed only rank 0 writes. The line ends when a record reaches
    ``total_steps`` (or call :meth:`close`).
    """

    def __init__(self, total_steps: int | None = None, *, stream: IO[str] | None = None,
                 width: int = 24) -> None:
        problems = []
        if total_steps is not None and (not isinstance(total_steps, int) or isinstance(total_steps, bool)
                                        or total_steps < 1):
            problems.append(f"total_steps must be an integer >= 1 or None (got {total_steps!r})")
        if not isinstance(width, int) or isinstance(width, bool) or width < 1:
            problems.append(f"width must be an integer >= 1 (got {width!r})")
        ConfigError.check(problems)
        self.total_steps, self.width = total_steps, width
        self.stream = stream
        self._open = False

    def __call__(self, record: SyncRecord) -> None:
        if not _rank_zero():
            return
        out = self.stream or sys.stderr
        out.write("\r" + self.line(record))
        out.flush()
        self._open = True
        if self.total_steps is not None and record.step >= self.total_steps:
            self.close()

    def line(self, record: SyncRecord) -> str:
        """The text written for ``record``."""
        parts = []
        if self.total_steps is not None:
            done = min(record.step / self.total_steps, 1.0)
            filled = round(done * self.width)
            parts.append(f"[{'#' * filled}{'.' * (self.width - filled)}] {record.step}/{self.total_steps}")
        else:
            parts.append(f"step {record.step}")
        parts += [f"{name} {base:.4g}" for name, base in record.bases.items()]
        finite = [s for s in record.scores if math.isfinite(s)]
        if finite:
            parts.append(f"best score {min(finite):.4g}")
        if record.phase:
            parts.append(str(record.phase))
        if record.wall is not None:
            parts.append(f"{record.wall:.0f} s")
        return "  ".join(parts)

    def close(self) -> None:
        """End the line (once)."""
        if self._open:
            (self.stream or sys.stderr).write("\n")
            self._open = False


def _rank_zero() -> bool:
    dist = sys.modules.get("torch.distributed")  # imported by torch; never initialised here
    return dist is None or not dist.is_available() or not dist.is_initialized() or dist.get_rank() == 0
