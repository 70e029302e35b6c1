"""Which run a checkpoint is of: a run's identity, written beside every file it saves, so that a
resume never takes another run's step silently.

Every process's files carry its run's identity (``"run"`` in the digest file beside each payload):
a random name given at the run's first save (``uuid4``: not a random choice of training, and it
draws from no generator the run uses), and taken over by a run that resumes from a checkpoint.
Two runs' steps in one directory mean a step folder copied in from another run, or two runs saving
into one directory, and both are refused with the steps named:

- a save finds intact steps of another run (a run that did not resume from them, or two runs
  saving here): nothing is written;
- a load finds the step it would resume from beside intact steps of another run, or a step of
  another run than the one this object has saved or loaded: nothing is loaded.

A step whose payload does not match its digest is no run's evidence (it cannot be loaded): a run
restarted fresh over damaged steps saves and resumes beside them. Digests are computed only when
another run's identity turns up, so the usual save and load read nothing more than the small
digest files. Files saved before identities were written carry none and are not checked.
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

from hpx._files import _complete_steps, _matches, _sidecar_info

__all__: list[str] = []

_KEY = "run"


def run_of(engine: Any) -> str | None:
    """The identity of the run ``engine`` holds: given at its first save or taken over at a load,
    ``None`` before either."""
    return getattr(engine, "_run_id", None)


def claim(engine: Any) -> str:
    """``engine``'s identity, given now if it has none (at its first save)."""
    run = run_of(engine)
    if run is None:
        run = engine._run_id = uuid.uuid4().hex[:16]
    return run


def _others(root: Path, rank: int, run: str | None, but: int) -> list[int]:
    """This rank's intact steps in ``root`` other than ``but`` whose identity is not ``run``
    (steps without one, from before identities were written, are no other run's)."""
    name = f"rank-{rank:05d}.pt"
    found = []
    for step in _complete_steps(root, rank):
        folder = root / f"step-{step:09d}"
        saved = _sidecar_info(folder / name).get(_KEY)
        if step != but and saved is not None and saved != run and _matches(folder / name):
            found.append(step)
    return sorted(found)


def _shown(steps: list[int]) -> str:
    names = [f"step-{s:09d}" for s in steps]
    return ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")


def save_problems(root: Path, rank: int, engine: Any, step: int) -> list[str]:
    """Why this rank must not save ``step`` into ``root``: it holds intact steps of another run."""
    run = run_of(engine)
    others = _others(root, rank, run, step)
    if not others:
        return []
    if run is None:
        return [f"{root} holds checkpoints of another run ({_shown(others)}, rank {rank}'s files), which "
                "this run did not resume from: to resume that run, call hpx.load_checkpoint(directory, ...) "
                "before training; to start a new one, give it a directory of its own (or delete those step "
                "folders). Nothing was saved"]
    return [f"{root} holds checkpoints of another run ({_shown(others)}, rank {rank}'s files) beside this "
            f"run's (run {run}): two runs are saving into one directory, or a step folder was copied in from "
            "another run. Give each run a directory of its own (move those step folders out). Nothing was "
            "saved"]


def load_problems(root: Path, rank: int, engine: Any, step: int) -> list[str]:
    """Why this rank must not load ``step`` of ``root``: it is another run's than the one
    ``engine`` has saved or loaded, or intact steps of another run lie beside it."""
    path = root / f"step-{step:09d}" / f"rank-{rank:05d}.pt"
    saved, mine = _sidecar_info(path).get(_KEY), run_of(engine)
    if saved is None:
        return []
    if mine is not None and saved != mine:
        return [f"{path.parent} is a checkpoint of another run (run {saved}) than the one this object has "
                f"saved or loaded (run {mine}): build a new hpx.Forks or hpx.Engine to resume another run, "
                "or give load_checkpoint this run's directory. Nothing was loaded"]
    others = _others(root, rank, saved, step)
    if not others:
        return []
    return [f"{root} holds checkpoints of two runs (rank {rank}'s files): step-{step:09d}, the newest "
            f"complete one, of run {saved}, and {_shown(others)} of another: a step folder was copied in "
            "from another run, or two runs saved here. Move the other run's step folders out (each run needs "
            "a directory of its own) and load again. Nothing was loaded"]


def taken_over(engine: Any, path: Path) -> None:
    """After a load from ``path`` (this rank's file, or for a rank the saved run did not have, another
    rank's): ``engine`` is that run, and its saves carry its identity."""
    saved = _sidecar_info(path).get(_KEY)
    if saved is not None:
        engine._run_id = saved
