"""The state of a :class:`hpx.Forks` run: its records (a :class:`~hpx.SyncRecord` per decision,
logged and handed to the callbacks) and its ``state_dict``, with the checks a resume makes before it
changes anything (the layout over the ranks, the settings, what built the run). A mixin of
``Forks``: it reads and writes the search's own attributes."""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from typing import Any

from hpx._checkpointed import _Checkpointed
from hpx.errors import ConfigError
from hpx.forks.checkpoint import unsaveable
from hpx.forks.fork import _FORMAT, _SETTINGS, state_problems, type_name
from hpx.forks.record import differences, probe_loss_now, probe_loss_saved, probe_record
from hpx.history import _fork_label
from hpx.sync_record import SyncRecord

log = logging.getLogger("hpx")


class _State(_Checkpointed):
    """Records and ``state_dict`` (see the module's docstring), and what the checkpoint files ask of
    a Forks run (:class:`hpx._checkpointed._Checkpointed`)."""

    _elastic_refusal = ("hpx.Forks resumes with the saved run's process count: load_checkpoint(..., "
                        "elastic=False)")

    _forks: Any
    _clones: Any
    _parents: Any
    _shared: Any
    _sharder: Any
    _built: Any
    _probe: Any
    collective: Any

    def _unsaveable(self) -> str | None:
        return unsaveable(self)

    def _record(self, phase: str, scores: list[float], kept: list[int],
                gain: float = math.nan, bar: float = math.nan) -> SyncRecord:
        """The decision's record, logged; ``gain`` and ``bar``: the end's test (the best challenger's
        lead in standard errors, and what it had to clear, raised for the number of challengers)."""
        factors = [f.factor for f in self._forks]
        lrs = [[g["lr"] * f.factor for g in f.optimizer.param_groups] for f in self._forks]
        bases = self._forks[kept[0]].setting() if phase == "end" else {"lr": 1.0, **self._bases}
        values = {"lr": factors, **{k.name: [f.values[k.name] for f in self._forks] for k in self.knobs}}
        rec = SyncRecord(step=self.step_count, bases=bases,
                         values=values, scores=[s if math.isfinite(s) else math.nan for s in scores],
                         phase=phase, searched=True, wall=time.perf_counter() - self._t0,
                         lr=[next((v for v in row if v), row[0]) for row in lrs], lr_factor="lr",
                         metrics=None if math.isnan(gain) else {"gain": gain, "bar": bar})
        self.history.append(rec)
        kept_m = ", ".join(_fork_label(self._forks[i].setting(), self._bases) for i in kept)
        why = "" if math.isnan(gain) else (f" (the challenger's gain: {gain:.2f} standard errors over "
                                           f"{self._probe_units} probe examples)")
        if 0 < gain < bar < math.inf:  # the test kept your run: how much more probe would have told
            why += (f"; short of the bar of {bar:.2f}: a probe about {(bar / gain) ** 2:.3g}x as large "
                    "would tell a difference this size")
        names = [_fork_label(f.setting(), self._bases) for f in self._forks]
        if self.collective.rank == 0:  # one line per decision, not one per rank
            log.info("forks at step %d (%s): %s scored %s; kept %s%s", self.step_count, phase, names,
                     ["kept" if math.isnan(s) else round(s, 4) for s in scores], kept_m, why)
        return rec

    def _notify(self, rec: SyncRecord) -> None:
        for callback in self._on_sync:
            callback(rec)

    def state_dict(self) -> dict[str, Any]:
        """Every fork's model, optimizer and scheduler, the annealed copies in
        flight, and the search's own state (it holds references to live tensors, as
        ``Module.state_dict``: save it with ``torch.save``). The global random stream is not in
        it: save it beside it to resume bit for bit."""
        start = self._forks[0]
        return {"format": _FORMAT, **{k: getattr(self, k) for k in _SETTINGS},
                "optimizer_type": type_name(start.optimizer), "scheduler_type": type_name(start.scheduler),
                "step": self.step_count, "fork_steps": self.fork_steps, "factor": self.factor,
                "values": dict(self.values),
                "knobs": [k.name for k in self.knobs], "decided": self.decided,
                "initial": self._initial, "decide_at": self._decide_at,
                "built": {**self._built, "probe_loss": probe_loss_saved(self)},
                "shared_buffers": [n for n, _, _ in self._shared.buffers],
                "layout": self._layout(),
                "forks": [f.state() for f in self._forks],
                "clones": [c.state(p) for c, p in zip(self._clones, self._parents)],
                "history": [dataclasses.asdict(r) for r in self.history]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict` into a ``Forks`` built with the same settings on the same
        model, optimizer and schedule (checked first: a refused state changes nothing)."""
        ConfigError.check(self._load_problems(state))
        for kept in ("_applied", "_first_bad"):  # what the steps before the load applied and met
            self.__dict__.pop(kept, None)
        start = self._forks[0]
        start.load(state["forks"][0], self.knobs)
        if state.get("decided"):
            self._shared.params = []
        memo: dict[int, Any] = {id(p): p for _, p in self._shared.params}  # frozen: held once
        forks = [start] + [start.copied(i, shared=memo, sharder=self._sharder)
                           for i in range(1, len(state["forks"]))]
        for f, s in zip(forks[1:], state["forks"][1:]):
            f.load(s, self.knobs)
        clones = [start.copied(len(forks) + i, shared=memo, sharder=self._sharder)
                  for i in range(len(state["clones"]))]
        for c, s in zip(clones, state["clones"]):
            c.load(s, self.knobs)
        mine = {n: b for n, b in start.model.named_buffers()}
        self._shared.buffers = [(n, mine[n], 0) for n in state.get("shared_buffers", []) if n in mine]
        for f in [*forks[1:], *clones]:  # the buffers the saved run held once are held once again
            self._shared.adopt(f.model)
        self._shared.refresh()
        self._forks, self._clones = forks, clones
        self._parents = [int(s["parent"]) for s in state["clones"]]
        self.step_count, self.factor = int(state["step"]), float(state["factor"])
        self.fork_steps = int(state["fork_steps"])
        self.values = {k: float(v) for k, v in state["values"].items()}
        self.decided = bool(state["decided"])
        self._initial = state["initial"]
        self._decide_at = None if state["decide_at"] is None else (int(state["decide_at"][0]),
                                                                   int(state["decide_at"][1]))
        self.history = [SyncRecord(**r) for r in state["history"]]
        saved = state.get("built")
        if isinstance(saved, dict) and saved.get("probe") is not None and self._built["probe"] is None:
            self._built["probe"] = saved["probe"]  # the probe was read and found the same (_load_problems)
        # the saved weights' probe loss, saved again while no loss is bound to take it anew (probe_loss_saved)
        self._built["probe_loss"] = saved.get("probe_loss") if isinstance(saved, dict) else None
        self._fresh = True
        self._outside_steps, self._half = 0, None  # a misuse before the load is undone by it

    def _layout(self) -> dict[str, Any]:
        """How the forks are laid over the ranks: a checkpoint holds one rank's part of that layout."""
        return {"processes": self.collective.world_size, "sharded": self._sharder is not None}

    def _load_problems(self, state: Any) -> list[str]:
        """Why :meth:`load_state_dict` would refuse ``state`` (``hpx.load_checkpoint`` asks every
        rank before any loads)."""
        start = self._forks[0]
        saved = state.get("layout") if isinstance(state, dict) else None
        if saved is not None and saved != self._layout():
            def shown(lay: dict[str, Any]) -> str:
                how = ("each fork sharded over them (shard=...)" if lay.get("sharded")
                       else "each holding every fork")
                return f"{lay.get('processes')} process(es), {how}"
            return [f"the saved run's forks were laid out over {shown(saved)}; this one's over "
                    f"{shown(self._layout())}: resume with the layout the run was saved with (the same "
                    "number of processes and the same shard= setting)"]
        settings = {k: getattr(self, k) for k in _SETTINGS}
        problems = state_problems(state, settings, [k.name for k in self.knobs], start.model, start.optimizer,
                                  start.scheduler)
        built = state.get("built")
        if problems or not isinstance(built, dict) or state.get("decided"):  # states saved before: unchecked
            return problems
        mine = dict(self._built)
        if built.get("probe") is not None and mine["probe"] is None:  # not read yet: read it (kept at _open)
            mine["probe"] = probe_record(self._probe)
        if built.get("probe_loss") is not None:  # this run's probe loss on the saved weights, as it scores
            try:
                mine["probe_loss"] = probe_loss_now(self, built["probe_loss"], state)
            except Exception as e:
                return [f"the probe's loss_fn fails on the first probe batch at the saved run's weights "
                        f"({type(e).__name__}: {e}): give the probe the saved run's loss_fn= to resume it; "
                        "nothing was loaded"]
        odd = differences(built, mine)
        return [f"the saved run was built otherwise: {'; '.join(odd)}. Build hpx.Forks as the saved run was "
                "to resume it (to change a setting on purpose, resume first, then change it in every fork "
                "with forks.each(...))"] if odd else []
