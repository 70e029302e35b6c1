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
carries its run's identity (:mod:`hpx._identity`): another run's steps are refused.

Sharded replicas (:class:`hpx.backends.Mesh`, FSDP2): the models' and optimizers' shards and
the search's starting point go through ``torch.distributed.checkpoint`` into
``step-.../sharded/``, written by every process together; each process's file then holds the
rest (knobs, search, history, random streams). Such a checkpoint resumes on another number of
shard processes per replica (the same number of replicas): ``torch.distributed.checkpoint``
reshards.

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

from hpx._files import (
    _SHARDS,
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
from hpx._save_checks import _unsound_forks
from hpx.engine import Engine
from hpx.errors import ConfigError, NonFiniteError
from hpx.forks import Forks

__all__ = ["load_checkpoint", "save_checkpoint"]

log = logging.getLogger("hpx")

_FORMAT = 1
_CANDIDATES = 32  # newest complete steps each rank offers when the ranks agree on one


def save_checkpoint(directory: str | os.PathLike[str], engine: Engine | Forks, *,
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
    rank = _processes(engine).rank  # another run's steps there: refused on every rank before a write
    _together(engine, save_problems(Path(directory), rank, engine, engine.step_count),
              f"saving step {engine.step_count}", ending="nothing was saved on any rank")
    if isinstance(engine, Forks):
        blown = _unsound_forks(engine)
        if blown:
            log.warning("step %d not saved: the trainable weights or optimizer state of %s are non-finite, "
                        "and a checkpoint must not resume from them (nothing was written, so the previous "
                        "checkpoints stay): resume from the newest with load_checkpoint, at a lower "
                        "learning rate or with the batches since it checked for NaN/inf",
                        engine.step_count, ", ".join(blown))
            return None
    unsound = _unsound(engine)
    if unsound:
        log.warning("step %d not saved: the weights of replica(s) %s are non-finite, and a checkpoint "
                    "must not resume from them (the previous checkpoints are kept; the next sync resets "
                    "such replicas from the others, save after it)", engine.step_count, unsound)
        return None
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
    if _sharded(engine):  # the shards through torch.distributed.checkpoint, by every process
        _save_shards(engine, folder / _SHARDS)
        eng = state["engine"]
        del eng["replicas"]
        state["anchored"], eng["anchor"] = eng["anchor"] is not None, None
        state["replica"] = engine.collective.rank
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
    return path


def _unsound(engine: Engine | Forks) -> list[int]:
    """The replicas (global indices) whose weights or floating buffers are non-finite, the same
    list on every rank (one pass over the weights and one gather). None for hpx.Forks: see
    :func:`_unsound_forks`."""
    if isinstance(engine, Forks):
        return []
    try:
        sound = engine._sound()
    except NonFiniteError:
        return list(range(engine.n_replicas))
    return (~sound).nonzero().reshape(-1).tolist()


def load_checkpoint(directory: str | os.PathLike[str], engine: Engine | Forks, *,
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
    """
    ConfigError.check(_call_problems("load_checkpoint", directory, engine))
    root = Path(directory)
    problems = _extra_problems(extra) + _directory_problems(root)
    if not isinstance(required, bool):
        problems.append(f"required must be True or False (got {required!r})")
    if elastic and isinstance(engine, Forks):
        problems.append("hpx.Forks resumes with the saved run's process count: load_checkpoint(..., "
                        "elastic=False)")
    ConfigError.check(problems)
    # shared mode over processes: a rank that trains instead of loading meets this, not a hang
    engine._check_aligned("loading a checkpoint")
    _clean_stale(root, _processes(engine).rank, loading=True)
    load = _load_elastic if elastic else _load_sharded if _sharded(engine) else _load_own
    step = load(root, engine, extra, rng)
    if step is None:
        _fresh_start(root, engine, required)
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


def _fresh_start(root: Path, engine: Engine, required: bool) -> None:
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


def _load_own(root: Path, engine: Engine, extra: Mapping[str, Any] | None, rng: bool) -> int | None:
    """This rank's file of the newest step that every rank has complete and intact."""
    rank = _processes(engine).rank
    excluded: set[int] = set()
    while True:
        step = _agree(engine, [s for s in _complete_steps(root, rank) if s not in excluded])
        if step is None:  # not a fresh start when the steps are another process count's: say so
            hint = "" if isinstance(engine, Forks) else ", or with load_checkpoint(..., elastic=True)"
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
            how = "" if isinstance(engine, Forks) else ", or with load_checkpoint(..., elastic=True)"
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


def _load_elastic(root: Path, engine: Engine, extra: Mapping[str, Any] | None, rng: bool) -> int | None:
    """Every saved rank's file of the newest step complete for all of them, into ``engine``."""
    if _sharded(engine):
        return _load_sharded(root, engine, extra, rng, elastic=True)
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


def _sharded(engine: Engine) -> bool:
    """Whether the engine's replicas span several processes (``hpx.backends.Mesh``)."""
    return _processes(engine) is not engine.collective


def _shard_state(engine: Engine, anchored: bool, replica: int | None = None,
                 ) -> tuple[dict[str, Any], dict[str, Any]]:
    """What goes through torch.distributed.checkpoint: the model's and optimizer's state and the
    search's starting point; returned as (the state as torch gives it, the same tensors as this
    replica's own entries). torch.distributed.checkpoint takes a tensor replicated over the
    mesh's replicate dim to be the same on every replica, and hpx's replicas differ: each
    replica's tensors are re-viewed on its shard group alone (the same storage) under a key of
    its own, ``replica<r>`` (``replica``: another replica's key, to load that one's tensors)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.tensor import DTensor

    from hpx.averaging import params

    rep = engine.replicas[0]
    params(rep.model)  # FSDP2: back to the sharded parameters before they are read
    model_sd, optim_sd = get_state_dict(rep.model, rep.optimizer)
    state: dict[str, Any] = {"model": model_sd, "optim": optim_sd}
    if anchored:
        shards = engine._anchor if engine._anchor is not None else [
            torch.zeros_like(t) for t in params(rep.model)]
        state["anchor"] = {
            name: DTensor.from_local(a, p.device_mesh, p.placements, run_check=False, shape=p.shape,
                                     stride=p.stride()) if isinstance(p, DTensor) else a
            for (name, p), a in zip(rep.model.named_parameters(), shards)}
    shard_dim = engine.collective.shard_dim

    def own(x: Any) -> Any:
        if isinstance(x, DTensor) and x.device_mesh.ndim == 2:
            return DTensor.from_local(x.to_local(), x.device_mesh[shard_dim], x.placements[1:],
                                      run_check=False, shape=x.shape, stride=x.stride())
        if isinstance(x, dict):
            return {k: own(v) for k, v in x.items()}
        if isinstance(x, list):
            return [own(v) for v in x]
        return x

    key = engine.collective.rank if replica is None else replica
    return state, {f"replica{key}": own(state)}


def _save_shards(engine: Engine, where: Path) -> None:
    import torch.distributed.checkpoint as dcp

    dcp.save(_shard_state(engine, engine._anchor is not None)[1], checkpoint_id=str(where))


def _load_sharded(root: Path, engine: Engine, extra: Mapping[str, Any] | None, rng: bool,
                  elastic: bool = False) -> int | None:
    """The newest step every saved process completed, into sharded replicas (any number of
    shard processes per replica: torch.distributed.checkpoint reshards). ``elastic``: another
    replica count (or layout): every replica starts from the mean of the saved replicas'
    weights and optimizer state, each read into this rank's shards in turn."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    from hpx.averaging import local

    procs = _processes(engine)
    found = _newest_for_all(root, engine, lambda folder: (folder / _SHARDS / ".metadata").is_file())
    if found is None:
        return None
    step, folder, paths = found
    states = [torch.load(p, map_location="cpu", weights_only=False) for p in paths]
    if any("replica" not in st for st in states):
        raise ConfigError([f"{folder} was not saved from sharded replicas: resume it with the backend it "
                           "was saved with"])
    problems = []
    saved = sorted({st["replica"] for st in states})
    same = states[procs.rank] if procs.rank < len(states) else None
    if elastic:  # hpx's state from the saved process 0; this process's own streams if it had one
        first = min(states, key=lambda st: st["rank"])
        own, eng = same if same is not None else first, dict(first.get("engine") or {})
        keys = saved
    else:
        mine = [st for st in states if st["replica"] == engine.collective.rank]
        if not mine:
            problems.append(f"{folder} holds no process of replica {engine.collective.rank} (its replicas: "
                            f"{saved}): resume with as many replicas, or with load_checkpoint(..., "
                            "elastic=True)")
        # the same process's file when the layout is the same (its random streams and data
        # position), else the first of its replica's
        own = same if same is not None and same["replica"] == engine.collective.rank else (
            mine[0] if mine else states[0])
        eng, keys = dict(own.get("engine") or {}), [engine.collective.rank]
    anchored = bool(own.get("anchored"))
    if anchored:  # shaped like this run's shards, for the checks; loaded below
        eng["anchor"] = [torch.zeros_like(t) for t in _local_params(engine)]
    problems += [f"{folder}: {p}" for p in engine._load_problems(eng, elastic=elastic)]
    if elastic and eng.get("n_replicas") != len(saved):
        problems.append(f"{folder} holds the files of replicas {saved} of a run of {eng.get('n_replicas')}: "
                        "it is incomplete")
    problems += _saved_extra_problems(folder, own, extra)
    _together(engine, problems, f"step {step}")
    sums: list[torch.Tensor] = []
    for r in keys:  # a replica's tensors into this rank's shards' own storage, and the rest
        shards, view = _shard_state(engine, anchored, replica=r)  # (param groups' settings) adopted
        dcp.load(view, checkpoint_id=str(folder / _SHARDS))
        _adopt(shards, view[f"replica{r}"])
        if len(keys) > 1:  # elastic: their floating tensors summed, replica by replica
            tensors = [local(t).detach() for t in _floating(shards)]
            if sums:
                torch._foreach_add_(sums, tensors)
            else:
                sums = [t.clone() for t in tensors]
    if sums:
        with torch.no_grad():
            torch._foreach_div_(sums, float(len(keys)))
            torch._foreach_copy_([local(t) for t in _floating(shards)], sums)  # the anchor: equal on all
    rep = engine.replicas[0]
    set_state_dict(rep.model, rep.optimizer, model_state_dict=shards["model"],
                   optim_state_dict=shards["optim"])
    if anchored:
        eng["anchor"] = [local(t).clone() for t in shards["anchor"].values()]
    _act(engine, f"step {step}", lambda: _load_extras(own, extra),
         lambda: engine._resume_elastic(eng) if elastic else engine.load_state_dict(eng),
         lambda: _set_rng_state(own["rng"]) if rng else None,
         lambda: taken_over(engine, paths[min(procs.rank, len(paths) - 1)]))
    return step


def _floating(state: Any) -> list[torch.Tensor]:
    """The floating-point tensors of a nested state, in a fixed order."""
    if isinstance(state, dict):
        return [t for k in state for t in _floating(state[k])]
    if isinstance(state, (list, tuple)):
        return [t for v in state for t in _floating(v)]
    return [state] if torch.is_tensor(state) and state.is_floating_point() else []


def _adopt(into: Any, loaded: Any) -> None:
    """Copy the non-tensor values of ``loaded`` into the same places of ``into`` (tensors were
    loaded in place, into storage the two share)."""
    keys = into.keys() if isinstance(into, dict) else range(len(into))
    for k in keys:
        a, b = into[k], loaded[k]
        if isinstance(a, (dict, list)):
            _adopt(a, b)
        elif not torch.is_tensor(a):
            into[k] = b


def _local_params(engine: Engine) -> list[torch.Tensor]:
    from hpx.averaging import params

    return params(engine.replicas[0].model)


# --- helpers ------------------------------------------------------------------------------


def _newest_for_all(root: Path, engine: Engine, also: Callable[[Path], bool] | None = None,
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


def _call_problems(who: str, directory: Any, engine: Any) -> list[str]:
    """Arguments of another kind than a directory and an engine (swapped, or not given)."""
    problems = []
    if not isinstance(directory, (str, os.PathLike)):
        problems.append(f"{who}'s directory must be a path, a str or pathlib.Path (got "
                        f"{type(directory).__name__}): call {who}(directory, engine)")
    if not isinstance(engine, (Engine, Forks)):
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


def _agree(engine: Engine, steps: list[int]) -> int | None:
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
