"""The ninth held-out set: warm-ups with probes of 400 examples or more, hpx.Forks beside Optuna.

    python -m benchmarks.lr.ninth [--jobs 2] [--report-only]

The eighth held-out set (``python -m benchmarks.lr.staged``) became design data when a warm-up
design was chosen from its reading (``docs/method.md``), so the warm-up row is read again here, on
five fresh tasks committed with their grids before anything ran on them (``benchmarks.lr.tasks.NINTH``):
a row transformer on digits and an LSTM LM under a 25% linear warm-up + cosine, a LayerNorm MLP on
digits under SGD, a teacher regression under AdamW and a dropout MLP on Gaussian clusters under
Adam with OneCycleLR. Every cell is held out. Two methods run from 0.1x, 1x and 10x each task's
grid's best, 2 seeds, on the committed grid (``benchmarks/lr/grids.json``; the command checks that
this machine repeats it before anything runs):

* ``Forks``: ``hpx.Forks`` at its defaults;
* ``Optuna``: the standard tool at the same budget of optimizer steps (TPE + successive halving over
  separate trials, the start enqueued first: ``benchmarks/optuna_route.py``; ``pip install -e
  ".[bench]"``).

Both store into ``benchmarks/lr/stored/ninth.json`` (committed), and the section is written from it
alone (``--report-only`` runs nothing), so a clone rebuilds it (``tests/test_stored_sections.py``).
"""

from __future__ import annotations

from typing import Any

from benchmarks import _store
from benchmarks.lr.__main__ import STORED
from benchmarks.lr.staged import _harmless, _within, beside, rows, study_set
from benchmarks.lr.tasks import NINTH

__all__ = ["COMMAND", "MARKER", "METHODS", "STORE", "TITLE", "counts", "main", "section"]

STORE = STORED / "ninth.json"
COMMAND = "python -m benchmarks.lr.ninth"
MARKER = "lr-ninth"
TITLE = "The ninth held-out set: warm-ups with probes of 400 examples or more, hpx.Forks beside Optuna"
METHODS = ("Forks", "Optuna")


def counts(method: str, grids: dict[str, Any], store: dict[str, Any]) -> dict[str, tuple[int, int]]:
    """``method``'s bar on the set: no harm from the grid's best (``harm``), within 1.05x of the grid's
    best from 0.1x (``low``) and from 10x above (``high``), each as (cells, of)."""
    found = rows(method, list(NINTH), grids, store)
    return {"harm": _harmless(found), "low": _within(found, "0.1x"), "high": _within(found, "10x")}


def section(grids: dict[str, Any], store: dict[str, Any]) -> str:
    """The section's body from the committed grid and the store."""
    tasks = list(NINTH)
    found = {m: rows(m, tasks, grids, store) for m in METHODS}
    lines = [f"Produced by `{COMMAND}` (which writes this section) from its store "
             f"(`{_store.shown(STORE)}`) and the committed grid: {len(tasks)} tasks committed with their "
             "grids before anything ran on them, every one held out; each method from 0.1x, 1x and 10x "
             "the grid's best, 2 seeds. `Optuna` is TPE + successive halving over separate trials at "
             "hpx.Forks' budget of optimizer steps, the start enqueued first "
             "(`benchmarks/optuna_route.py`).", ""]
    lines += beside(found, store, tasks, grids)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    return study_set(argv, __doc__, COMMAND, "every task of the ninth held-out set", list(NINTH), STORE,
                     section, MARKER, TITLE, "lr-staged", 6)


if __name__ == "__main__":
    raise SystemExit(main())
