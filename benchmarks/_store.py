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

A report of part of what a section shows (some of its methods, tasks, routes, sizes, replica counts
or variants) rewrites that part alone and leaves every other table and row byte for byte, or writes
nothing (:func:`leave` says so), or, where the section's parts share what the command would change,
exits before anything runs (:func:`refuse_narrower`), naming the command that writes it whole.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

__all__ = ["DOC", "STORED", "leave", "load", "measured", "publish", "refuse", "refuse_narrower", "save",
           "shown"]

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


def refuse_narrower(marker: str, holds: str, command: str, doc: Path = DOC, instead: str = "") -> NoReturn:
    """Exit (status 1) before anything is written: the ``marker`` section of ``doc`` ``holds`` what
    the command as given would not write (another method's table, a task's row), and it would take
    it away; ``command`` writes the section whole (``instead``: another way, as a clause)."""
    instead = f", {instead}" if instead else ""
    raise SystemExit(f"the {marker} section of {shown(doc)} holds {holds}, which this command as given "
                     f"would remove or change: run `{command}`, which writes the section whole{instead}; "
                     f"{shown(doc)} was left as it is")


def leave(marker: str, why: str, command: str, doc: Path = DOC) -> None:
    """Say (on stderr) that the ``marker`` section of ``doc`` was not written, ``why``, and which
    ``command`` writes it: a report of part of what the section holds prints, and leaves it alone."""
    import sys

    print(f"{shown(doc)} was left as it is: {why}; its {marker} section is written by `{command}`",
          file=sys.stderr)


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


def measured(argv: list[str] | None, description: str, measure: Callable[[], Any],
             section: Callable[[dict[str, Any]], str], path: Path, command: str, marker: str, about: str,
             machine: Callable[[], str], doc: Path = DOC) -> dict[str, Any]:
    """The command of a benchmark whose section is written from its store alone: measure (or, with
    ``--report-only``, read the committed store, ``about`` saying how long measuring takes), keep the
    store (not with ``--no-write``), and print and publish the section ``section`` makes of it."""
    import argparse
    import sys
    import time

    p = argparse.ArgumentParser(description=description)
    p.add_argument("--no-write", action="store_true",
                   help="print the table only: neither the store nor the docs")
    p.add_argument("--report-only", action="store_true",
                   help="measure nothing: the section from the committed store")
    a = p.parse_args(sys.argv[1:] if argv is None else argv)
    if a.report_only:
        store = load(path, command, doc, about)
    else:
        t0 = time.perf_counter()
        res = measure()
        store = {"res": res, "wall": time.perf_counter() - t0, "command": command, "on": machine()}
        if not a.no_write:
            save(path, store)
    publish(section(store), marker, not a.no_write, doc)
    return store
