"""The run's state: what a checkpoint holds (:meth:`hpx.Engine.state_dict`), every check
before a load changes anything, the load itself, the elastic resume from another replica count,
and the agreement of the ranks after either. A part of :class:`hpx.Engine`; the files and their
layout are :mod:`hpx.checkpoint`'s.
"""

from __future__ import annotations

import logging
import zlib
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

import torch

from hpx._checkpointed import _Checkpointed, _ShardFiles
from hpx.averaging import params as _params
from hpx.backends._agree import agree
from hpx.engine.checkpoint import shard_files, unsaveable
from hpx.errors import ConfigError
from hpx.replica import Replica
from hpx.sync_record import SyncRecord

log = logging.getLogger("hpx")


class _RunState(_Checkpointed):
    """The engine's state: save, check, load, resume elastically, agree across ranks; and what the
    checkpoint files ask of an engine (:class:`hpx._checkpointed._Checkpointed`)."""

    def _unsaveable(self) -> str | None:
        return unsaveable(self)

    def _shard_files(self) -> _ShardFiles | None:
        return shard_files(self)

    def _state_dict(self) -> dict[str, Any]:
        told = getattr(self, "_stateless_told", False)
        if (not callable(getattr(self.signal, "state_dict", None)) and not told
                and not type(self.signal).__module__.startswith("hpx.")):
            self._stateless_told = True
            log.warning("the signal %s has no state_dict(): a resumed run starts it afresh (a probe's "
                        "position, a running mean), so the resume is not exact; give it state_dict() and "
                        "load_state_dict()", type(self.signal).__name__)
        return {
            "format": 2,
            "settings": self._settings(),
            "n_replicas": self.n_replicas,
            "first": self._first,
            "step": self.step_count,
            "next_sync": self._next_sync,
            "knobs": self.knobs.state_dict(),
            "search": self.search.state_dict(),
            "signal": (self.signal.state_dict() if callable(getattr(self.signal, "state_dict", None))
                       else None),
            "slots": self._slots.clone(),
            "acc": self._acc.detach().cpu().clone(),
            "bad": self._bad.detach().cpu().clone(),
            "acc_n": list(self._acc_n),
            "history": [asdict(r) for r in self.history],
            "placement": None if self._placement is None else self._placement.clone(),
            "anchor": None if self._anchor is None else [a.detach().cpu().clone() for a in self._anchor],
            "replicas": [{"model": r.model.state_dict(), "optimizer": self._optimizer_state(r),
                          "optimizer_type": type(r.optimizer).__name__} for r in self.replicas],
        }

    def _optimizer_state(self, r: Replica) -> dict[str, Any]:
        """The replica's ``optimizer.state_dict()``, with the shared state when there is one
        (checkpoints look the same either way)."""
        return r.optimizer.state_dict() if self._state is None else self._state.replica_state(r.optimizer)

    def _load_state_dict(self, state: dict[str, Any]) -> None:
        ConfigError.check(self._load_problems(state))
        # the user's own objects first (their states cannot be checked beforehand): one that
        # refuses its state leaves the weights, knobs and step as they were
        if state.get("signal") is not None and callable(getattr(self.signal, "load_state_dict", None)):
            self.signal.load_state_dict(state["signal"])
        if "search" in state:
            self.search.load_state_dict(state["search"])
        else:  # format 1: the controller's state alone
            self.search.load_state_dict({"controller": state["controller"]})
        for r, s in zip(self.replicas, state.get("replicas", ())):  # absent: hpx state only
            r.model.load_state_dict(s["model"])
            r.optimizer.load_state_dict(_own_state(s["optimizer"]))
        if self._state is not None and state.get("replicas"):
            self._state.engaged = False  # the next step takes the loaded state over
        self.knobs.load_state_dict(state["knobs"])
        self.step_count = int(state["step"])
        T = self.config.sync_every
        self._next_sync = int(state.get("next_sync", (self.step_count // T + 1) * T))
        self._acc.copy_(state["acc"].to(self._acc))
        self._bad.copy_(state["bad"].to(self._bad) if "bad" in state else torch.zeros_like(self._bad))
        self._acc_n = list(state["acc_n"])
        self.history = [SyncRecord(**r) for r in state["history"]]
        self._history_appends = True  # the file is the resumed run's: later syncs add to it
        path = self.config.history_file
        if path is not None and self._writes_files:
            from hpx.history import _truncate_file

            _truncate_file(path, self.step_count)  # the resumed run redoes what came after
        self._slots = state["slots"].clone()
        self._load_anchor(state)
        rows = [k.values(self._slots[i]) for i, k in enumerate(self.knobs)]
        self._values = torch.stack(rows) if rows else torch.empty(0, self.n_replicas, dtype=torch.float64)
        self._local_values = self._values[:, self._first : self._first + self.n_local].tolist()
        self._written = [[None] * self.n_local for _ in self.knobs]
        self._bad_factor = None
        self._write(force=True)
        self._agreement_due = self.collective.world_size > 1

    def _load_elastic(self, states: Sequence[dict[str, Any]]) -> None:
        keys = list(self.replicas[0].model.state_dict())
        states = [_unwrapped(st, keys) for st in states]  # saved under DDP, loaded into a bare model
        ConfigError.check(self._elastic_problems(states))
        saved = [rep for st in states for rep in st["replicas"]]
        model = _mean_states([rep["model"] for rep in saved])
        opt = saved[0]["optimizer"]
        opt = {**opt, "state": {i: _mean_states([rep["optimizer"]["state"][i] for rep in saved])
                                for i in opt["state"]}}
        for r in self.replicas:
            r.model.load_state_dict(model)
            r.optimizer.load_state_dict(_own_state(opt))
        if self._state is not None:
            self._state.engaged = False  # the next step takes the loaded state over
        self._resume_elastic(states[0])

    def _elastic_problems(self, states: Sequence[Any]) -> list[str]:
        """Every reason to refuse an elastic resume from ``states``, found without changing anything."""
        keys = list(self.replicas[0].model.state_dict())
        states = [_unwrapped(st, keys) for st in states]
        problems = []
        if not states:
            problems.append("load_elastic needs the saved run's checkpoints (one per process it had)")
        for i, st in enumerate(states):
            if not isinstance(st, dict) or not st.get("replicas"):
                problems.append(f"checkpoint {i} holds no replicas (a scheduler's state): an elastic resume "
                                "needs the models and optimizers")
                continue
            for p in self._load_problems(st, elastic=True):
                problems.append(f"checkpoint {i}: {p}" if len(states) > 1 else p)
        if not problems:
            firsts = [st["first"] for st in states]
            total = sum(len(st["replicas"]) for st in states)
            if firsts != sorted(firsts) or total != states[0]["n_replicas"]:
                problems.append(f"the checkpoints hold {total} replicas starting at {firsts}, but the run "
                                f"had {states[0]['n_replicas']}: give every process's file, in rank order")
        return problems

    def _resume_elastic(self, first: dict[str, Any]) -> None:
        """hpx's own state from a run of another replica count, the weights being loaded
        (``first``: the saved rank 0's state, checked)."""
        self.knobs.load_state_dict(first["knobs"])
        if first.get("signal") is not None and callable(getattr(self.signal, "load_state_dict", None)):
            self.signal.load_state_dict(first["signal"])
        self.search.load_state_dict(first["search"])
        self.step_count = int(first["step"])
        self._next_sync = int(first["next_sync"])
        self._acc.zero_()
        self._bad.zero_()
        self._acc_n = [0] * self.n_local
        self.history = [SyncRecord(**r) for r in first["history"]]
        self._history_appends = True
        if self.config.history_file is not None and self._writes_files:
            from hpx.history import _truncate_file

            _truncate_file(self.config.history_file, self.step_count)
        # The saved placement was for the saved replica count: the next sync scores the (identical)
        # replicas where they are, and the strategy's next decision places the new count.
        self._load_anchor({**first, "placement": None})
        self._draw()  # permutations for this many replicas, from the restored stream
        self._written = [[None] * self.n_local for _ in self.knobs]
        self._bad_factor = None
        self._fresh, self._reduced, self._one_step = True, False, False
        self._write(force=True)
        self._agreement_due = self.collective.world_size > 1

    def _load_anchor(self, state: dict[str, Any]) -> None:
        """The placement and the run's starting parameters, as saved (absent: none)."""
        placement, anchor = state.get("placement"), state.get("anchor")
        self._placement = None if placement is None else torch.as_tensor(placement, dtype=torch.float64)
        self._anchor = None if anchor is None else [
            a.to(p.device, p.dtype).clone() for a, p in zip(anchor, _params(self.replicas[0].model))]

    def _settings(self) -> dict[str, Any]:
        """The settings a checkpoint records and a resumed engine must share."""
        settings = getattr(self.search, "settings", None)  # the search's own (autolr's total_steps, span)
        return {"replicas": self.n_replicas, **{k: getattr(self.config, k) for k in _TRAJECTORY},
                "search": type(self.search).__name__,
                **{f"search.{k}": v for k, v in (settings() if callable(settings) else {}).items()},
                "knobs": [[k.name, type(k).__name__, k.kind, k.targets(self.replicas[0])]
                          for k in self.knobs]}

    def _load_problems(self, state: Any, elastic: bool = False) -> list[str]:
        """Every reason to refuse ``state``, found without changing anything (``elastic``: the
        replica count and layout may differ)."""
        if not isinstance(state, dict):
            return [f"a checkpoint is the dict Engine.state_dict() returns (got {type(state).__name__})"]
        problems = []
        if state.get("format") not in (1, 2):
            problems.append(f"unknown checkpoint format {state.get('format')!r} (expected 1 or 2)")
            return problems
        needed = ("step", "knobs", "slots", "acc", "acc_n", "history",
                  "search" if state.get("format") == 2 else "controller",
                  *(("next_sync",) if elastic else ()))
        missing = [k for k in needed if k not in state]
        if missing:
            return [f"the checkpoint lacks {missing}: it is damaged or was not written by "
                    "Engine.state_dict(); resume from an intact checkpoint (delete the damaged step folder)"]
        reps = state.get("replicas", [])
        if elastic:
            pass
        elif state.get("n_replicas") != self.n_replicas:
            problems.append(f"checkpoint has {state.get('n_replicas')} replicas, this engine "
                            f"{self.n_replicas}: build the engine with replicas={state.get('n_replicas')} "
                            "(per process) as the saved run had, or resume elastically "
                            "(Engine.load_elastic, hpx.load_checkpoint(..., elastic=True))")
        elif state.get("first") != self._first or len(reps) not in (0, self.n_local):
            problems.append("checkpoint was saved by a different rank layout: load each rank's own file")
        saved = state.get("settings")
        if saved is not None:
            mine = self._settings()
            for key in [k for k in saved if k not in ("replicas", "knobs")]:
                if key in mine and saved[key] != mine[key]:
                    problems.append(f"checkpoint was saved with {key}={saved[key]!r}, this engine has "
                                    f"{key}={mine[key]!r}: build it with the saved run's settings")
        names = [k.get("name") for k in state.get("knobs", {}).get("knobs", [])]
        if names != self.knobs.names:
            problems.append(f"checkpoint holds knobs {names} but this run declares {self.knobs.names}")
        elif saved is not None and "knobs" in saved:  # same names: the same kind of knob on the same setting
            for was, now in zip(saved["knobs"], self._settings()["knobs"]):
                if list(was) != list(now)[:len(was)]:
                    where = lambda k: f" on {', '.join(k[3])}" if len(k) > 3 and k[3] else ""  # noqa: E731
                    problems.append(f"checkpoint's knob {was[0]!r} is a {was[1]} ({was[2]}){where(was)}, "
                                    f"this run's a {now[1]} ({now[2]}){where(now)}: its base means another "
                                    "thing here; declare the knob as the saved run did")
        anchor = state.get("anchor")
        if anchor is not None:
            shapes = [tuple(p.shape) for p in _params(self.replicas[0].model)]
            if (not isinstance(anchor, (list, tuple)) or len(anchor) != len(shapes)
                    or [tuple(getattr(a, "shape", ())) for a in anchor] != shapes):
                problems.append(f"checkpoint's starting parameters (the anchor of the search's placement) "
                                f"do not match this model's {len(shapes)} parameters: it was saved by "
                                "another model")
        placement = state.get("placement")
        if placement is not None and anchor is None:
            problems.append("checkpoint has a placement but no anchor: it is damaged")
        elif placement is not None and not elastic and len(placement) % self.n_replicas:
            problems.append(f"checkpoint's placement has {len(placement)} multipliers for "
                            f"{self.n_replicas} replicas (a multiple is needed)")
        pairs = [(self.replicas[0], s) for s in reps] if elastic else list(zip(self.replicas, reps))
        for i, (r, s) in enumerate(pairs):
            who = f"saved replica {state.get('first', 0) + i}" if elastic else f"replica {self._first + i}"
            problems += _module_problems(f"{who}'s model", r.model.state_dict(), s.get("model", {}))
            problems += _optimizer_problems(f"{who}'s optimizer", r.optimizer, s.get("optimizer", {}),
                                            s.get("optimizer_type"))
        return problems

    def _check_agreement(self, *, settle: bool, when: str | None = None) -> None:
        """Raise :class:`ConsistencyError` on every rank if the ranks were built or resumed
        differently (settings, knobs, search, signal, model, or, once ``settle``, the step and
        next sync). One gather, at construction and at the first step after a load: ranks that
        disagree would otherwise pair their collectives across different steps and hang."""
        self._agreement_due = False
        base = self.replicas[0].model
        base = base.module if isinstance(base, torch.nn.parallel.DistributedDataParallel) else base
        items: list[tuple[str, Any]] = [("replicas per process", self.n_local)]
        if settle:
            items += [("step", self.step_count), ("next sync step", self._next_sync)]
        items += [(k, getattr(self.config, k)) for k in _TRAJECTORY]
        items += [("knobs", [(k.name, type(k).__name__, k.kind) for k in self.knobs]),
                  ("search", repr(self.search)),
                  ("signal", type(self.signal).__name__),
                  ("the signal's data (length, batches per sync, eval mode, digest)",
                   getattr(self.signal, "_spec", lambda: None)()),
                  ("optimizer settings (other than what knobs write)", self._optimizer_settings()),
                  ("the settings knobs scale (each group's lr under LearningRateScale)",
                   [getattr(s, "groups", None) for s in (row[0] for row in self._setters)]),
                  ("model parameters",
                   [(n, tuple(p.shape), str(p.dtype)) for n, p in base.named_parameters()])]
        dev = self._acc.device if hasattr(self, "_acc") else next(
            (p.device for p in base.parameters()), torch.device("cpu"))
        agree(self.collective, items, when or ("resuming" if settle else "building the engine"), dev)

    def _optimizer_settings(self) -> list[dict[str, Any]]:
        """Local replica 0's optimizer: every parameter group's settings but its parameters and
        what the knobs write (which differs from replica to replica)."""
        written = {(i, s.key) for row in self._setters for s in row[:1] if s is not None
                   for i, _ in getattr(s, "groups", ())}
        groups = self.replicas[0].optimizer.param_groups
        return [{k: v for k, v in sorted(g.items()) if k != "params" and (i, k) not in written}
                for i, g in enumerate(groups)]

    def _optimizer_digest(self) -> int:
        """A CRC-32 of :meth:`_optimizer_settings` (host work only: a few dicts)."""
        return zlib.crc32(repr(self._optimizer_settings()).encode())


# EngineConfig fields that change what a run computes: a resumed engine must share them
_TRAJECTORY = ("sync_every", "mode", "average", "average_optimizer_state", "controller", "warmup",
               "meta_lr", "momentum", "debias_momentum", "temperature", "temperature_scale", "space",
               "decay")


def _unwrapped(state: Any, keys: list[str]) -> Any:
    """``state`` (a saved engine state) with its replicas' model entries renamed to ``keys`` when
    the two differ only by DistributedDataParallel's ``module.`` prefix (a run saved under DDP
    resumed into a bare model, or the other way round); otherwise ``state`` as it is."""
    if not isinstance(state, dict) or not isinstance(state.get("replicas"), list):
        return state
    pre = "module."
    out = []
    for rep in state["replicas"]:
        model = rep.get("model") if isinstance(rep, dict) else None
        if not isinstance(model, dict) or list(model) == keys:
            out.append(rep)
            continue
        if all(k.startswith(pre) for k in model) and [k[len(pre):] for k in model] == keys:
            model = {k[len(pre):]: v for k, v in model.items()}
        elif all(k.startswith(pre) for k in keys) and [pre + k for k in model] == keys:
            model = {pre + k: v for k, v in model.items()}
        out.append({**rep, "model": model})
    return {**state, "replicas": out}


def _mean_states(states: list[dict[str, Any]]) -> dict[str, Any]:
    """Entry by entry: the mean of floating tensors (in float64, cast back), else the first's."""
    out = {}
    for k, v in states[0].items():
        if torch.is_tensor(v) and v.is_floating_point() and all(torch.equal(v, st[k]) for st in states[1:]):
            out[k] = v  # equal everywhere (a constant such as a causal mask of -inf): kept as it is
        elif torch.is_tensor(v) and v.is_floating_point():
            acc = torch.zeros_like(v, dtype=torch.float64)
            for st in states:
                acc += st[k].to(torch.float64)
            out[k] = (acc / len(states)).to(v.dtype)
        else:
            out[k] = v
    return out


def _module_problems(what: str, current: dict[str, Any], saved: Any, show: int = 4) -> list[str]:
    """Why ``saved`` cannot load into a module whose state dict is ``current``."""
    if not isinstance(saved, dict):
        return [f"{what}: the checkpoint holds {type(saved).__name__}, not a state dict"]
    missing = [k for k in current if k not in saved]
    extra = [k for k in saved if k not in current]
    shapes = [f"{k} {tuple(saved[k].shape)} vs {tuple(v.shape)}" for k, v in current.items()
              if k in saved and torch.is_tensor(v) and torch.is_tensor(saved[k])
              and saved[k].shape != v.shape]
    out = []
    for label, items in (("missing from the checkpoint", missing), ("not in this model", extra),
                         ("with another shape (saved vs this model)", shapes)):
        if items:
            more = f" and {len(items) - show} more" if len(items) > show else ""
            out.append(f"{what}: {len(items)} entr{'y' if len(items) == 1 else 'ies'} {label}: "
                       f"{', '.join(items[:show])}{more}; was it saved from another architecture?")
    return out


def _optimizer_problems(what: str, optimizer: torch.optim.Optimizer, saved: Any,
                        saved_type: str | None = None) -> list[str]:
    """Why ``saved`` cannot load into ``optimizer``: another kind of optimizer (its class, saved
    with the checkpoint, or the keys of its per-parameter state), or other parameter groups."""
    if not isinstance(saved, dict) or "param_groups" not in saved:
        return [f"{what}: the checkpoint holds no optimizer state dict"]
    current = optimizer.state_dict()
    kind = type(optimizer).__name__
    if saved_type is not None and saved_type != kind:
        return [f"{what}: the checkpoint was saved from a {saved_type}, this engine's optimizer is a "
                f"{kind}: build the engine with a {saved_type}, as the saved run had (its state cannot "
                f"drive a {kind})"]
    mine_keys = {k for st in current["state"].values() for k in st}
    theirs_keys = {k for st in saved.get("state", {}).values() if isinstance(st, dict) for k in st}
    if mine_keys and theirs_keys and mine_keys != theirs_keys:
        return [f"{what}: the checkpoint's optimizer state holds {sorted(theirs_keys)} per parameter, this "
                f"{kind}'s holds {sorted(mine_keys)}: it was saved from another kind of optimizer; build "
                "the engine with the saved run's optimizer"]
    mine = [len(g["params"]) for g in current["param_groups"]]
    theirs = [len(g["params"]) for g in saved["param_groups"]]
    if mine != theirs:
        return [f"{what}: parameters per group {theirs} in the checkpoint, {mine} here: build the "
                "optimizer with the saved run's parameter groups"]
    return []


def _own_state(saved: dict[str, Any]) -> dict[str, Any]:
    """An optimizer state dict whose tensors are its own: ``Optimizer.load_state_dict`` keeps
    the tensors it is given, so replicas loaded from one dict (or from a checkpoint that
    stores a shared state once) would otherwise step the same buffers, each in turn."""
    state = {i: {k: v.clone() if torch.is_tensor(v) else v for k, v in st.items()}
             for i, st in saved.get("state", {}).items()}
    return {**saved, "state": state}
