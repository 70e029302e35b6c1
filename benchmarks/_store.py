"""Stored results that a report command reads, refused when they are not there.

A report command writes a section of the docs from results another command stored: under
``runs/`` (gitignored: a fresh clone has none), or committed, where a store is missing until its
command has run: in ``benchmarks/lr/stored/`` for the learning-rate suite's sections, in
``benchmarks/stored/`` (:data:`STORED`, written by :func:`save`) for the engine study's
measurements whose section is a function of their store alone. Written
from a store that is missing, or that lacks what the section reads, the section's figures would
become "no runs". So a report command loads its stores through :func:`load` (or calls
:func:`refuse` on what is lacking) before it writes anything: the command exits non-zero, names
the store and the command that produces it, and leaves the docs as they are.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

__all__ = ["DOC", "STORED", "load", "publish", "refuse", "save", "shown"]

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "benchmarks.md"
STORED = ROOT / "benchmarks" / "stored"  # the engine study's committed stores (one JSON file per section)


def shown(path: Path) -> str:
    """``path`` relative to the repository when it is inside it."""
    try:
        return str(Path(path).resolve().relative_to(ROOT))
    except ValueError:
        return str(path)


def refuse(path: Path, command: str, doc: Path = DOC, lacks: str | None = None, note: str = "") -> NoReturn:
    """Exit (status 1) naming the store at ``path``, what it lacks, and the ``command`` that
    produces it (``note``: how long it takes, say); nothing is written to ``doc``."""
    if lacks is not None:
        problem = f"holds no results for {lacks}"
    else:
        problem = "holds no results" if Path(path).exists() else "is missing"
    note = f" ({note})" if note else ""
    raise SystemExit(f"{shown(path)} {problem}: run `{command}` first{note}; {shown(doc)} was left as it is")


def _read_json(path: Path) -> Any:
    return json.loads(path.read_text())


def load(path: Path, command: str, doc: Path = DOC, note: str = "",
         read: Callable[[Path], Any] = _read_json) -> Any:
    """The results stored at ``path`` (read by ``read``); :func:`refuse` when the file is missing
    or holds nothing."""
    data = read(path) if Path(path).exists() else None
    if not data:
        refuse(path, command, doc, note=note)
    return data


def save(path: Path, data: Any) -> None:
    """``data`` at ``path`` as compact JSON (one line; keys in their order, which a section may read
    its rows in), written whole or not at all."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, separators=(",", ":"), allow_nan=False) + "\n")
    tmp.replace(path)


def publish(text: str, marker: str, write: bool, doc: Path = DOC) -> None:
    """Print a section's ``text`` and, with ``write``, put it between its ``marker`` in ``doc``."""
    print(text)
    if write:
        from benchmarks.report import write_section

        write_section(doc, marker, text)
