"""An opt-in progress bar (tqdm), updated at every sync: ``Engine(..., on_sync=hpx.ProgressBar(total))``."""

from __future__ import annotations

import math
import sys
from typing import IO, Any

from hpx.errors import ConfigError
from hpx.sync_record import SyncRecord

__all__ = ["ProgressBar"]


class ProgressBar:
    """A `tqdm <https://tqdm.github.io>`_ bar advanced at every sync, its postfix showing the
    learning rate the optimizer used (under :func:`~hpx.autolr`, whose ``"lr"`` knob is a factor
    on it, shown as ``lr factor``), each knob's base, the best replica's score and the search's
    phase. It runs only at syncs, so it costs nothing per step. Needs ``tqdm``
    (``pip install "hpx-hdet[progress]"``).

    Args:
        total_steps: the run's length (the bar's 100%); ``None``: a counter.
        stream: where to write (tqdm's default: ``sys.stderr``).
        **tqdm_args: passed to ``tqdm`` (``desc``, ``ncols``, ``leave``, ...).

    Under torch.distributed only rank 0 draws. The bar closes when a record reaches
    ``total_steps`` (or call :meth:`close`).
    """

    def __init__(self, total_steps: int | None = None, *, stream: IO[str] | None = None,
                 **tqdm_args: Any) -> None:
        if total_steps is not None and (not isinstance(total_steps, int) or isinstance(total_steps, bool)
                                        or total_steps < 1):
            raise ConfigError([f"total_steps must be an integer >= 1 or None (got {total_steps!r})"])
        try:
            import tqdm  # noqa: F401
        except ImportError as e:
            raise ImportError('hpx.ProgressBar draws with tqdm: pip install "hpx-hdet[progress]" '
                              "(or pip install tqdm)") from e
        self.total_steps, self.stream, self.tqdm_args = total_steps, stream, tqdm_args
        self._bar: Any = None

    def __call__(self, record: SyncRecord) -> None:
        if not _rank_zero():
            return
        if self._bar is None:
            from tqdm.auto import tqdm

            self._bar = tqdm(total=self.total_steps, file=self.stream, unit="step",
                             **{"desc": "hpx", **self.tqdm_args})
        bar = self._bar
        bar.update(max(record.step - bar.n, 0))
        bar.set_postfix_str(self.postfix(record), refresh=True)
        if self.total_steps is not None and record.step >= self.total_steps:
            self.close()

    @staticmethod
    def postfix(record: SyncRecord) -> str:
        """The text shown after the bar for ``record``: ``"lr 0.00175, lr factor 17.51, best
        0.3124, stretch"`` under autolr."""
        parts = [summary] if (summary := record.summary()) else []
        finite = [s for s in record.scores if math.isfinite(s)]
        if finite and record.searched is False:  # the training loss: the search is not acting
            parts.append(f"train loss {sum(finite) / len(finite):.4g}")
        elif finite:
            parts.append(f"best {min(finite):.4g}")
        if record.phase:
            parts.append(str(record.phase))
        return ", ".join(parts)

    def close(self) -> None:
        """Close the bar (once)."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None


def _rank_zero() -> bool:
    dist = sys.modules.get("torch.distributed")
    return dist is None or not dist.is_available() or not dist.is_initialized() or dist.get_rank() == 0
