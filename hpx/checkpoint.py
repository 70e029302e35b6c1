"""Save a run and resume it: atomic per-rank files, the newest step every rank has, RNG streams.

A run's checkpoint lives in one directory, one sub-directory per saved step::

    run/ckpt/step-000001200/rank-00000.pt          # torch.save of this rank's state
    run/ckpt/step-000001200/rank-00000.pt.sha256   # its digest and the run's process count:
                                                   # written last, marks it complete

Each rank writes only its own files, each to a temporary name first, flushed to disk and
then renamed (``os.replace``), so a rank killed during a save leaves the previous
checkpoints intact and never a half-written file under a final name. The payload is a
plain ``torch.save`` file (``torch.load`` reads it); the digest beside it is what makes
it count as complete, and what catches a file damaged later.

:func:`load_checkpoint` picks the newest step that *every* rank has complete and intact
(a rank killed during a save may lack the newest one), checks that the engine can take
it before changing anything, and restores the engine, your extra objects (LR schedulers,
a ``GradScaler``, ...) and the random streams the trajectory depends on (torch's global
generator, which draws dropout masks, CUDA's, Python's ``random`` and NumPy's), so that
the resumed run continues as the uninterrupted one would have, bit for bit on CPU. Every digest
carries its run's identity (:mod:`hpx._identity`): another run's steps are refused. Each rank's
process holds a lock on the directory from its first save or load (:mod:`hpx._lock`): another live
process saving or loading there is refused; a killed process's lock is taken over.

This module knows no route: it saves what the object's ``state_dict()`` gives and loads it back
through the hooks of :class:`hpx._checkpointed._Checkpointed`. Each route keeps its own checks in
its own package (:mod:`hpx.forks.checkpoint`, :mod:`hpx.engine.checkpoint`); sharded replicas
(:class:`hpx.backends.Mesh`, FSDP2) add their shards through ``torch.distributed.checkpoint``
(``step-.../sharded/``), and resume on another number of shard processes per replica.

Under ``torchrun --max-restarts``, restarted gloo workers re-initialise reliably only with
``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` in the environment (torch 2.13; pytorch#135712).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from hpx._checkpointed import _Checkpointed
from hpx._files import (
    _STEP_DIR,
    _clean_stale,
    _complete_for_all,
    _complete_steps,
    _digest,
    _fsync_dir,
    _intact,
    _other_world_problems,
    _prune,
    _sidecar,
    _write_atomic,
)
from hpx._identity import claim, load_problems, save_problems, taken_over
from hpx._loading import (
    _act,
    _device,
    _load_extras,
    _processes,
    _read,
    _rng_state,
    _saved_extra_problems,
    _set_rng_state,
    _step_problems,
    _together,
)
from hpx._lock import acquire
from hpx.errors import ConfigError

__all__ = ["load_checkpoint", "save_checkpoint"]

log = logging.getLogger("hpx")

_FORMAT = 1
_CANDIDATES = 32  # newest complete steps each rank offers when the ranks agree on one


def save_checkpoint(directory: str | os.PathLike[str], engine: _Checkpointed, *,
                    extra: Mapping[str, Any] | None = None, keep: int = 2) -> Path | None:
    """Save this rank's part of the run at ``engine.step_count``; return the file written, or
    ``None`` when a replica's weights are non-finite (nothing is written).

    Args:
        directory: the run's checkpoint directory (created if needed; shared by the ranks
            or not, each rank writes only its own files).
        engine: the :class:`~hpx.Engine` (its replicas' models and optimizers, knobs,
            search state, step, history), or the :class:`~hpx.Forks` (every fork's model,
            optimizer, scheduler and random stream, the annealed copies in flight, the
            decisions; a challenger that blew up is saved as it is, the search drops it).
        extra: more objects with ``state_dict()`` / ``load_state_dict()`` to save with it,
            by name: an LR scheduler, a ``GradScaler``, your data sampler.
        keep: complete checkpoints of this rank to keep (older ones are deleted once
            this one is complete). At least 2 under torch.distributed (1 is refused), so
            that the ranks still share a step when one was killed while saving the newest.

    Temporary files that a process killed while saving left in the directory (their PID no
    longer runs on this host) are deleted here and by :func:`load_checkpoint` (which leaves them,
    logged at debug level, where they cannot be deleted: a read-only directory loads).

    Every rank must call it at the same step. Saves are atomic per file: a process
    killed during a save leaves the previous checkpoints as they were.

    The first save or load of a run object on ``directory`` takes this rank's lock of it (a small
    file beside it, ``.NAME.hpx-lock-rank-00000``, or inside it; :mod:`hpx._lock`), kept until the
    object is collected or the process exits. While another live process holds it (the same rank of
    another run), this save raises :class:`~hpx.ConfigError` naming that process, on every rank, and
    writes nothing. A lock whose process no longer runs (killed) is taken over.

    A step at which some replica's weights are NaN or inf (on any rank) is not saved: a resumed
    run would start from them. Every rank skips it alike, with a warning, and the previous
    checkpoints stay; the next sync resets such a replica from the others, so a save after it
    goes through. For :class:`~hpx.Forks` the same holds when your run's trainable weights or
    optimizer state are non-finite (or, once your run is lost at a cut, every other fork's): the
    warning names the forks and the step, and the last finite checkpoint stays.

    Pruning counts only steps whose file matches its digest: a damaged step never costs an intact
    one, and the newest intact step is never deleted (a save reads the previous step's file back
    to check it). What a save or prune killed part way left of this rank's (a payload without its
    digest, an emptied step folder) is deleted here.
    """
    ConfigError.check(_call_problems("save_checkpoint", directory, engine))
    problems = []
    if not isinstance(keep, int) or isinstance(keep, bool) or keep < 1:
        problems.append(f"keep must be an integer >= 1 (got {keep!r}): complete checkpoints to keep")
    elif keep < 2 and _processes(engine).world_size > 1:
        problems.append(f"keep=1 under torch.distributed ({_processes(engine).world_size} processes) can "
                        "leave the ranks no common step: a rank killed while saving keeps only the step "
                        "before, the others only the new one. Give keep=2 or more")
    problems += _extra_problems(extra) + _directory_problems(Path(directory), "save_checkpoint")
    ConfigError.check(problems)
    # a rank still training meets this, not a hang: every rank raises alike (ConsistencyError)
    engine._check_aligned(f"saving step {engine.step_count}")
    rank = _processes(engine).rank  # another live process, or another run's steps there: refused on
    lock = acquire(Path(directory), rank, engine, saving=True)  # every rank before a write
    try:
        _together(engine, lock.problems or save_problems(Path(directory), rank, engine, engine.step_count),
                  f"saving step {engine.step_count}", ending="nothing was saved on any rank")
    except ConfigError:
        lock.undo()
        raise
    withheld = engine._unsaveable()  # the route's own check: a non-finite run is never saved
    if withheld is not None:
        log.warning("%s", withheld)
        lock.undo()  # nothing written: not the lock either, where this call wrote it
        return None
    lock.keep(engine)
    state = {
        "format": _FORMAT,
        "step": engine.step_count,
        "rank": rank,
        "world_size": _processes(engine).world_size,
        "engine": engine.state_dict(),
        "extra": {name: obj.state_dict() for name, obj in (extra or {}).items()},
        "extra_types": {name: type(obj).__name__ for name, obj in (extra or {}).items()},
        "rng": _rng_state(),
    }
    folder = Path(directory) / f"step-{engine.step_count:09d}"
    folder.mkdir(parents=True, exist_ok=True)
    _clean_stale(Path(directory), rank)
    shards = engine._shard_files()
    if shards is not None:  # the shards through torch.distributed.checkpoint, by every process
        shards.save(folder, state)
    path = folder / f"rank-{rank:05d}.pt"
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        digest = _digest(tmp)
        os.replace(tmp, path)
        info = {"sha256": digest, "world_size": state["world_size"], "run": claim(engine)}
        _write_atomic(_sidecar(path), json.dumps(info) + "\n")
        _fsync_dir(folder)
    finally:
        if tmp.exists():
            tmp.unlink()
    _prune(Path(directory), rank, keep, engine.step_count)
    lock.keep(engine)  # the lock names the run (its identity given at its first save)
    return path


def load_checkpoint(directory: str | os.PathLike[str], engine: _Checkpointed, *,
                    extra: Mapping[str, Any] | None = None, rng: bool = True,
                    elastic: bool = False, required: bool = False) -> int | None:
    """Resume from the newest step that every rank saved completely; return it, or ``None``
    when there is none (a fresh start: nothing is changed).

    Args:
        directory: what :func:`save_checkpoint` wrote to.
        engine: an engine built with the saved run's settings (checked first).
        extra: the objects given to :func:`save_checkpoint`, by the same names.
        rng: also restore the random streams saved with it (torch's global generator,
            CUDA's, ``random``'s and NumPy's), which exact resume needs when the
            training draws from them (dropout masks, data shuffling).
        elastic: resume a run saved with another number of replicas or processes
            (:meth:`Engine.load_elastic <hpx.Engine.load_elastic>`: every replica starts
            from the saved replicas' consensus; bases, search state, step and history
            carry over). Every rank reads every saved rank's file, so the directory must
            be shared. A rank the saved run did not have takes rank 0's random streams
            and extra states.
        required: a run that must resume: when no step can be loaded, raise
            :class:`~hpx.ConfigError` instead of starting fresh.

    A directory that does not exist yet, or is empty, is a first run (``None``). A path to a
    file, to one ``step-...`` folder, or to a directory that holds other things but no
    checkpoint is a mistake (:class:`~hpx.ConfigError`). When step folders exist but none can
    be loaded on every rank, the fresh start is logged as a warning that says why.

    A file whose digest does not match (damaged after it was written) is skipped with a
    warning, as is a step that some rank lacks; the newest step left is loaded. When the
    engine or an extra object cannot take the checkpoint, :class:`~hpx.ConfigError` is
    raised and nothing is changed. Under torch.distributed every rank must call it.

    A directory another live process holds (it saves or loads there: :func:`save_checkpoint`'s lock)
    is refused with :class:`~hpx.ConfigError` naming that process, before anything is loaded; a
    killed process's lock is taken over, so a resume after a crash is never blocked. Where no lock
    can be written (a read-only directory) the load goes on without one.
    """
    ConfigError.check(_call_problems("load_checkpoint", directory, engine))
    root = Path(directory)
    problems = _extra_problems(extra) + _directory_problems(root)
    if not isinstance(required, bool):
        problems.append(f"required must be True or False (got {required!r})")
    if elastic and engine._elastic_refusal is not None:
        problems.append(engine._elastic_refusal)
    ConfigError.check(problems)
    # shared mode over processes: a rank that trains instead of loading meets this, not a hang
    engine._check_aligned("loading a checkpoint")
    lock = acquire(root, _processes(engine).rank, engine, saving=False)  # another live process's: refused
    try:
        _together(engine, lock.problems, f"loading from {root}", ending="nothing was loaded on any rank")
    except ConfigError:
        lock.undo()
        raise
    lock.keep(engine)
    _clean_stale(root, _processes(engine).rank, loading=True)
    shards = engine._shard_files()
    if shards is not None:
        step = shards.load(root, extra, rng, elastic)
    else:
        step = (_load_elastic if elastic else _load_own)(root, engine, extra, rng)
    if step is None:
        _fresh_start(root, engine, required)
    lock.keep(engine)  # the lock names the run resumed
    return step


def _directory_problems(root: Path, who: str = "load_checkpoint") -> list[str]:
    """What is wrong with ``root`` as a run's checkpoint directory for ``who`` (nothing when it
    does not exist yet: a first run)."""
    if root.is_file():
        up = root.parent.parent if root.parent.name and _STEP_DIR.match(root.parent.name) else root.parent
        return [f"{root} is a file: give {who} the run's checkpoint directory, the one that holds "
                f"the step-... folders ({up}?)"]
    if not root.is_dir():
        return []
    if _STEP_DIR.match(root.name):
        return [f"{root} is one step's folder: give {who} the run's checkpoint directory, the one "
                f"that holds the step-... folders ({root.parent}); load_checkpoint resumes from the newest "
                "complete step"]
    if who == "save_checkpoint":
        return []
    entries = [e.name for e in root.iterdir() if not e.name.startswith(".")]
    if entries and not any(_STEP_DIR.match(e) for e in entries):
        shown = ", ".join(sorted(entries)[:4]) + (" ..." if len(entries) > 4 else "")
        return [f"{root} holds {shown} but no checkpoint (step-... folders): give load_checkpoint the "
                "directory save_checkpoint wrote to, or an empty or new one for a first run"]
    return []


def _missing(root: Path, rank: int) -> str:
    """What this rank's newest step folders lack, for the message that nothing could be loaded."""
    if not root.is_dir():
        return ""
    lacks = []
    for d in sorted((d for d in root.iterdir() if _STEP_DIR.match(d.name)), reverse=True)[:3]:
        names = [f"rank-{rank:05d}.pt", f"rank-{rank:05d}.pt.sha256"]
        gone = [n for n in names if not (d / n).is_file()]
        lacks.append(f"{d.name} lacks {' and '.join(gone)}" if gone else f"{d.name} has this rank's files")
    return f"; on rank {rank}: {', '.join(lacks)}" if lacks else ""


def _fresh_start(root: Path, engine: _Checkpointed, required: bool) -> None:
    """Say why nothing was loaded when step folders exist on some rank (every rank says the
    same, so no rank goes on alone), or raise when ``required``."""
    here = root.is_dir() and any(_STEP_DIR.match(e.name) for e in root.iterdir())
    procs = _processes(engine)
    flags = procs.all_gather(torch.tensor([1.0 if here else 0.0], device=_device(engine)))
    if not bool((flags > 0).any()):
        if required:
            raise ConfigError([f"no checkpoint in {root} (load_checkpoint(..., required=True)): "
                               "save_checkpoint has not written there yet"])
        return
    why = (f"{root} holds step folders, but no step is complete and intact on every rank (files "
           f"damaged, deleted, or saves interrupted on different steps{_missing(root, procs.rank)})")
    if required:
        raise ConfigError([f"{why}: nothing was loaded (load_checkpoint(..., required=True))"])
    log.warning("%s: starting fresh from step 0", why)


def _load_own(root: Path, engine: _Checkpointed, extra: Mapping[str, Any] | None, rng: bool) -> int | None:
    """This rank's file of the newest step that every rank has complete and intact."""
    rank = _processes(engine).rank
    excluded: set[int] = set()
    while True:
        step = _agree(engine, [s for s in _complete_steps(root, rank) if s not in excluded])
        if step is None:  # not a fresh start when the steps are another process count's: say so
            hint = _elastic_hint(engine)
            world = _processes(engine).world_size
            _together(engine, _other_world_problems(root, world, hint), "the checkpoint")
            return None
        path = root / f"step-{step:09d}" / f"rank-{rank:05d}.pt"
        intact = _intact(path, step)
        oks = _processes(engine).all_gather(torch.tensor([1.0 if intact else 0.0], device=_device(engine)))
        if bool((oks > 0).all()):
            break
        excluded.add(step)
    newer = [d.name for d in root.iterdir() if (m := _STEP_DIR.match(d.name)) and int(m.group(1)) > step]
    if newer and rank == 0:  # a save interrupted, or a file lost: say which step is resumed instead
        log.warning("%s: %s not complete and intact on every rank; resuming from step %d", root,
                    ", ".join(sorted(newer)), step)
    state, problems = _read(path)
    if state is not None:
        if state.get("format") != _FORMAT:
            problems.append(f"{path}: unknown checkpoint file format {state.get('format')!r}")
        if state.get("world_size") != _processes(engine).world_size:
            how = _elastic_hint(engine)
            saved, now = state.get("world_size"), _processes(engine).world_size
            problems.append(f"{path} was saved by a run of {saved} processes, this one has {now}: resume "
                            f"with the saved run's process count{how}")
        problems += _step_problems(path, step, state)
        problems += [f"{path}: {p}" for p in engine._load_problems(state.get("engine"))]
        problems += _saved_extra_problems(path, state, extra) + _rng_problems(path, state, rng)
        problems += load_problems(root, rank, engine, step)  # another run's step, or beside another's
    _together(engine, problems, f"step {step}")  # every rank learns a refusal before any acts
    _act(engine, f"step {step}", lambda: _load_extras(state, extra),
         lambda: engine.load_state_dict(state["engine"]),
         lambda: _set_rng_state(state["rng"]) if rng else None)
    taken_over(engine, path)  # its saves go on under the run's identity
    return step


def _load_elastic(root: Path, engine: _Checkpointed, extra: Mapping[str, Any] | None, rng: bool,
                  ) -> int | None:
    """Every saved rank's file of the newest step complete for all of them, into ``engine``."""
    rank = engine.collective.rank
    found = _newest_for_all(root, engine)
    if found is None:
        return None
    step, folder, paths = found
    read = [_read(p) for p in paths]
    states = [st for st, _ in read]
    problems = [p for _, ps in read for p in ps]
    if not problems:
        worlds = {st.get("world_size") for st in states}
        if worlds != {len(states)}:
            problems.append(f"{folder} holds {len(states)} rank files saved by runs of {sorted(worlds)} "
                            "processes: it mixes runs")
        for p, st in zip(paths, states):
            problems += _step_problems(p, step, st)
        problems += [f"{folder}: {p}" for p in engine._elastic_problems([st.get("engine") for st in states])]
        own = states[rank] if rank < len(states) else states[0]
        problems += _saved_extra_problems(folder, own, extra) + _rng_problems(folder, own, rng)
    _together(engine, problems, f"step {step}")
    _act(engine, f"step {step}", lambda: _load_extras(own, extra),
         lambda: engine.load_elastic([st["engine"] for st in states]),
         lambda: _set_rng_state(own["rng"]) if rng else None,
         lambda: taken_over(engine, paths[min(rank, len(paths) - 1)]))
    return step


# --- helpers ------------------------------------------------------------------------------


def _newest_for_all(root: Path, engine: _Checkpointed, also: Callable[[Path], bool] | None = None,
                    ) -> tuple[int, Path, list[Path]] | None:
    """The newest step whose every saved process's file is complete and intact (and ``also``
    holds for its folder) on every process: (step, folder, the files), or None."""
    excluded: set[int] = set()
    while True:
        step = _agree(engine, [s for s in _complete_for_all(root) if s not in excluded])
        if step is None:
            return None
        folder = root / f"step-{step:09d}"
        paths = sorted(folder.glob("rank-*.pt"))
        intact = (also is None or also(folder)) and all(_intact(p, step) for p in paths)
        oks = _processes(engine).all_gather(torch.tensor([1.0 if intact else 0.0], device=_device(engine)))
        if bool((oks > 0).all()):
            return step, folder, paths
        excluded.add(step)


def _elastic_hint(engine: _Checkpointed) -> str:
    """The other way to resume a run saved with another process count, where the route has one."""
    return "" if engine._elastic_refusal is not None else ", or with load_checkpoint(..., elastic=True)"


def _call_problems(who: str, directory: Any, engine: Any) -> list[str]:
    """Arguments of another kind than a directory and an engine (swapped, or not given)."""
    problems = []
    if not isinstance(directory, (str, os.PathLike)):
        problems.append(f"{who}'s directory must be a path, a str or pathlib.Path (got "
                        f"{type(directory).__name__}): call {who}(directory, engine)")
    if not isinstance(engine, _Checkpointed):
        problems.append(f"{who}'s engine must be an hpx.Engine or hpx.Forks (got {type(engine).__name__}): "
                        f"call {who}(directory, engine) with the engine or forks you train")
    return problems


def _rng_problems(path: Path, state: dict[str, Any], rng: bool) -> list[str]:
    """Random streams a load would restore that are not there (a damaged file)."""
    saved = state.get("rng")
    if rng and not (isinstance(saved, dict) and torch.is_tensor(saved.get("torch"))
                    and saved["torch"].dtype == torch.uint8 and "python" in saved):
        return [f"{path} holds no usable random streams ('rng': {type(saved).__name__}): it is damaged; "
                "delete its step folder to resume from an older step, or load with rng=False"]
    return []


def _extra_problems(extra: Any) -> list[str]:
    if extra is None:
        return []
    if not isinstance(extra, Mapping):
        return [f"extra must be a mapping name -> object with state_dict/load_state_dict "
                f"(got {type(extra).__name__})"]
    return [f"extra[{name!r}] ({type(obj).__name__}) has no state_dict/load_state_dict to save it with"
            for name, obj in extra.items() if not _stateful(obj)]


def _stateful(obj: object) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


def _agree(engine: _Checkpointed, steps: list[int]) -> int | None:
    """The newest step in every rank's ``steps`` (each rank offers its newest few)."""
    offer = torch.full((_CANDIDATES,), -1.0, dtype=torch.float64)
    mine = steps[:_CANDIDATES]
    offer[: len(mine)] = torch.tensor(mine, dtype=torch.float64)
    rows = _processes(engine).all_gather(offer.to(_device(engine))).to("cpu").reshape(-1, _CANDIDATES)
    common = set(mine)
    for row in rows.tolist():
        common &= {int(s) for s in row if s >= 0}
    newest_anywhere = int(rows.max())
    if common and max(common) < newest_anywhere:
        log.warning("step %d is not complete on every rank (a save was interrupted): resuming from "
                    "step %d, the newest that all ranks have", newest_anywhere, max(common))
    return max(common) if common else None
