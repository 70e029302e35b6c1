"""Loading a checkpoint as one act of every rank: what a rank file holds and whether the engine and
the extra objects can take it, checked before anything changes, and the ranks' agreement on the
outcome (every rank learns that one refused, and why, before any acts: a rank never resumes
alone while another starts fresh, which would pair their collectives across steps and hang).
:mod:`hpx.checkpoint` uses it."""

from __future__ import annotations

import contextlib
import copy
import random
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from hpx.errors import ConfigError


def _read(path: Path) -> tuple[Any, list[str]]:
    """A rank file's content, or why it cannot be read (a file that matches its digest yet is not
    a checkpoint: written by something else)."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as e:
        return None, [f"{path} cannot be read as a checkpoint ({type(e).__name__}: {e}): delete its step "
                      "folder to resume from an older step"]
    if not isinstance(state, dict):
        return None, [f"{path} holds a {type(state).__name__}, not a checkpoint (written by something else): "
                      "delete its step folder to resume from an older step"]
    return state, []


def _step_problems(path: Path, step: int, state: dict[str, Any]) -> list[str]:
    """A step folder whose files hold another step's state (a folder copied over another)."""
    inner = state.get("step")
    eng = state.get("engine")
    held = {inner, eng.get("step") if isinstance(eng, dict) else inner} - {None}
    if held and held != {step}:
        held_text = ", ".join(map(str, sorted(held)))
        held_text = ", ".join(map(str, sorted(held)))
        return [f"{path} is in the folder of step {step} but holds the state of step {held_text}: the "
                "folder was copied or renamed; delete it (or name it after the step it holds) to resume "
                "from the right step"]
    return []


def _saved_extra_problems(where: Path, state: dict[str, Any], extra: Mapping[str, Any] | None) -> list[str]:
    """Extra objects the checkpoint holds no state for, or of another type than was saved."""
    saved = state.get("extra", {})
    missing = [name for name in (extra or {}) if name not in saved]
    problems = []
    if missing:
        problems.append(f"{where} holds no state for {missing} (it holds {sorted(saved)}): give "
                        "load_checkpoint the extra objects that were saved")
    types = state.get("extra_types", {})
    for name, obj in (extra or {}).items():
        if name in types and types[name] != type(obj).__name__:
            problems.append(f"{where}: extra[{name!r}] was saved from a {types[name]}, and is given a "
                            f"{type(obj).__name__}: give the object saved under that name (a {types[name]})")
    return problems


def _load_extras(state: dict[str, Any], extra: Mapping[str, Any] | None) -> None:
    """Load the extra objects first, each from its saved state; when one refuses, the ones loaded
    are put back as they were and nothing else is changed (the engine is loaded after them)."""
    before: list[tuple[Any, Any]] = []
    for name, obj in (extra or {}).items():
        old = copy.deepcopy(obj.state_dict())
        try:
            obj.load_state_dict(state["extra"][name])
        except Exception as e:
            for o, s in before:
                o.load_state_dict(s)
            with contextlib.suppress(Exception):  # what it may have changed before raising
                obj.load_state_dict(old)
            raise ConfigError([f"extra[{name!r}] ({type(obj).__name__}) cannot take the state saved under "
                               f"{name!r} ({type(e).__name__}: {e}): give load_checkpoint the object that "
                               "was saved; nothing was loaded"]) from e
        before.append((obj, old))


def _act(engine: Any, what: str, *actions: Callable[[], Any]) -> None:
    """Run ``actions`` in turn (the load, once every rank accepted it); when one fails on any
    rank, raise on every rank (this rank's own exception as the cause)."""
    err: Exception | None = None
    try:
        for action in actions:
            action()
    except Exception as e:
        err = e
    if err is not None and _processes(engine).world_size == 1:
        raise err
    problems = ([] if err is None else list(err.problems) if isinstance(err, ConfigError)
                else [f"{type(err).__name__}: {err}"])
    try:
        _together(engine, problems, what, acted=True)
    except ConfigError as e:
        raise e from err


def _together(engine: Any, problems: list[str], what: str, acted: bool = False,
              ending: str | None = None) -> None:
    """Raise :class:`~hpx.ConfigError` on every rank when any rank has ``problems`` (each rank's
    shown, by rank): a rank never goes on with a load that another refused. One gather when all
    is well; a broadcast per refusing rank otherwise. ``acted``: the problems arose while loading,
    after every rank had accepted the checkpoint; ``ending``: what the refusal left undone, said
    instead of "nothing was loaded on any rank"."""
    procs = _processes(engine)
    if procs.world_size == 1:
        ConfigError.check(problems)
        return
    flags = procs.all_gather(torch.tensor([float(len(problems))], device=_device(engine)))
    bad = [r for r, n in enumerate(flags.reshape(-1).tolist()) if n > 0]
    if not bad:
        return
    out = []
    for r in bad:
        theirs = procs.broadcast_object(problems if procs.rank == r else None, r)
        out += [f"rank {r}: {p}" for p in theirs or ()]
    if ending is not None:
        out.append(f"{what} failed on rank(s) {bad}, so it raises on all {procs.world_size} ranks, that none "
                   f"goes on alone; {ending}")
    else:
        out.append(f"{'loading' if acted else 'the checkpoint of'} {what} failed on rank(s) {bad}, so it "
                   f"raises on all {procs.world_size} ranks, that none resumes alone"
                   + (" (ranks that had loaded it hold its state: load again, or rebuild the engine)" if acted
                      else "; nothing was loaded on any rank"))
    raise ConfigError(out)


def _processes(engine: Any) -> Any:
    """The collective over every process: files are per process. A backend whose replicas span
    several processes (``hpx.backends.Mesh``) gives it as ``processes``; otherwise a process is a
    rank of the backend."""
    return getattr(engine.collective, "processes", engine.collective)


def _device(engine: Any) -> torch.device:
    """Where the engine's collectives run (NCCL gathers CUDA tensors only): an engine's loss
    accumulators' device, or hpx.Forks' model's."""
    acc = getattr(engine, "_acc", None)
    if acc is not None:
        return acc.device
    return next((p.device for p in engine.model.parameters()), torch.device("cpu"))


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.random.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    np = sys.modules.get("numpy")
    if np is not None:
        state["numpy"] = np.random.get_state()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.random.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    np = sys.modules.get("numpy")
    if np is not None and "numpy" in state:
        np.random.set_state(state["numpy"])
