"""What the engine gives the checkpoint files (:mod:`hpx.checkpoint`) beyond its ``state_dict``:
whether a step may be saved (every replica finite), and, for replicas sharded over several processes
(:class:`hpx.backends.Mesh`, FSDP2), the shards that go through ``torch.distributed.checkpoint``.

Sharded replicas: the models' and optimizers' shards and the search's starting point go into
``step-.../sharded/``, written by every process together; each process's file then holds the rest
(knobs, search, history, random streams). Such a checkpoint resumes on another number of shard
processes per replica (the same number of replicas): ``torch.distributed.checkpoint`` reshards.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from hpx._files import _SHARDS
from hpx._identity import taken_over
from hpx._loading import _act, _load_extras, _processes, _saved_extra_problems, _set_rng_state, _together
from hpx.checkpoint import _newest_for_all
from hpx.errors import ConfigError, NonFiniteError


def unsaveable(engine: Any) -> str | None:
    """The warning when some replica's weights are non-finite (this step is not saved), else
    ``None``; the same on every rank (one pass over the weights and one gather)."""
    try:
        sound = engine._sound()
    except NonFiniteError:
        unsound = list(range(engine.n_replicas))
    else:
        unsound = (~sound).nonzero().reshape(-1).tolist()
    if not unsound:
        return None
    return (f"step {engine.step_count} not saved: the weights of replica(s) {unsound} are non-finite, and a "
            "checkpoint must not resume from them (the previous checkpoints are kept; the next sync resets "
            "such replicas from the others, save after it)")


class _MeshFiles:
    """The sharded replicas' part of a checkpoint (:class:`hpx._checkpointed._ShardFiles`)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    def save(self, folder: Path, state: dict[str, Any]) -> None:
        engine = self.engine
        _save_shards(engine, folder / _SHARDS)
        eng = state["engine"]
        del eng["replicas"]
        state["anchored"], eng["anchor"] = eng["anchor"] is not None, None
        state["replica"] = engine.collective.rank

    def load(self, root: Path, extra: Any, rng: bool, elastic: bool) -> int | None:
        return _load_sharded(root, self.engine, extra, rng, elastic=elastic)


def shard_files(engine: Any) -> _MeshFiles | None:
    """The engine's sharded part when its replicas span several processes (``hpx.backends.Mesh``)."""
    return _MeshFiles(engine) if _processes(engine) is not engine.collective else None


def _shard_state(engine: Any, anchored: bool, replica: int | None = None,
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


def _save_shards(engine: Any, where: Path) -> None:
    import torch.distributed.checkpoint as dcp

    dcp.save(_shard_state(engine, engine._anchor is not None)[1], checkpoint_id=str(where))


def _load_sharded(root: Path, engine: Any, extra: Mapping[str, Any] | None, rng: bool,
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


def _local_params(engine: Any) -> list[torch.Tensor]:
    from hpx.averaging import params

    return params(engine.replicas[0].model)
