"""The engine: fan-out and converge over any Collective (HDET sections 3.2-3.5).

Each process holds ``L`` local replicas (model + optimizer); ``W`` processes give
``N = W * L`` replicas. The in-process default is ``W = 1, L = N``; under
torch.distributed it is usually ``L = 1`` per rank. The engine is the same
either way: it never imports a concrete distributed backend.

Per step (the hot path), the engine only writes knob values that changed,
accumulates each replica's loss on its device and, in shared-gradient mode,
averages gradients in a few flat buckets. It reads nothing back to the host.
At every sync (every ``T = sync_every`` steps, or when the search strategy asks)
it scores the replicas (one host read), lets the strategy decide, merges the
replicas' weights as it says, moves the bases, draws fresh permutations and
writes the new values. How the bases move is the strategy's business
(:mod:`hpx.search`); the engine has no branch for any particular one.

This module holds the facade: construction and the public methods. Each job lives in a room of
its own, mixed into :class:`Engine`: the knobs' values (``hpx/engine/values.py``), the training step
and the shared gradient (``hpx/engine/step.py``), the sync (``hpx/engine/sync.py``) and the run's state
(``hpx/engine/state.py``). See ``docs/architecture.md``.
"""

from __future__ import annotations

import copy
import logging
import math
import numbers
import os
import time
from collections.abc import Callable, Sequence
from typing import Any, Union

import torch

from hpx import _checks
from hpx._deepcopy import graph_tensors_detached
from hpx._health import _Health
from hpx._seed import derive_seed
from hpx.averaging import broadcast_, constant_buffers, float_state
from hpx.averaging import params as _params
from hpx.backends import default_backend
from hpx.backends.base import Collective
from hpx.config import EngineConfig
from hpx.controller import Controller
from hpx.engine.shared_state import _SharedState, unshareable
from hpx.engine.state import _RunState
from hpx.engine.step import _GradBuckets, _OneGradient, _trainable, _TrainingStep
from hpx.engine.sync import _Syncing
from hpx.engine.values import _KnobValues, _writes_optimizer
from hpx.errors import ConfigError
from hpx.knobs.base import Knob
from hpx.registry import Knobs
from hpx.replica import Replica
from hpx.search.base import Search
from hpx.search.hdet import HDET
from hpx.signals import IntervalLoss, LossFn, Signal
from hpx.sync_record import SyncRecord

__all__ = ["Engine", "OptimizerFactory", "SyncRecord"]

log = logging.getLogger("hpx")

# settings of hpx's own Controller, and those with which the engine builds its default HDET search
_CONTROLLER_SETTINGS = ("meta_lr", "momentum", "debias_momentum", "temperature", "temperature_scale", "space")
_HDET_SETTINGS = ("controller", "warmup", "decay", *_CONTROLLER_SETTINGS)

OptimizerFactory = Callable[[torch.nn.Module], torch.optim.Optimizer]
"""``factory(model) -> optimizer`` built over *that* model's parameters."""


class Engine(_KnobValues, _TrainingStep, _Syncing, _RunState):
    """HDET over ``N`` replicas: fan-out, converge every ``T`` steps, auto-update knobs.

    Args:
        model: the model. In one process it becomes replica 0 and is deep-copied
            for the others; under torch.distributed it is this rank's replica
            (it may be wrapped in DistributedDataParallel in shared mode).
        optimizer: ``factory(model) -> Optimizer``, called once per local
            replica with that replica's model. With one local replica an
            optimizer instance is accepted too.
        knobs: a :class:`~hpx.Knobs` registry or a sequence of knobs.
        backend: the :class:`~hpx.backends.Collective`; default in-process.
        signal: what replicas are compared on (default :class:`~hpx.IntervalLoss`).
        search: the search strategy (:mod:`hpx.search`). ``None``: an
            :class:`~hpx.search.HDET` built from the config's controller settings
            (``warmup``, ``decay``, ``meta_lr``, ``momentum``, ...).
        on_sync: a function (or a list of them) called with each :class:`~hpx.SyncRecord`
            right after its sync, on every rank: live logging, e.g.
            ``on_sync=hpx.TensorBoard("runs/exp1")``.
        config: an :class:`~hpx.EngineConfig`, or give its fields as keywords.
            ``controller=False`` switches the auto-update off; ``controller=obj``
            replaces hpx's :class:`~hpx.Controller` by any object with its
            ``update``, ``log_mask``, ``state_dict`` and ``load_state_dict``
            (its own settings then apply, not ``meta_lr``, ``momentum``, ...).

    Attributes:
        unshared_reason: why the local replicas keep an optimizer state each, or ``None``
            when, in shared mode, they keep one between them (the config's
            ``shared_optimizer_state``): the state is then updated once per step and
            each replica applies the direction with its own learning rate and weight decay.

    An engine that finds the learning rate within one run's steps is built by
    :func:`hpx.autolr`, which picks the strategy, spread, sync schedule and
    signal from the run's length (the recommended search is :class:`hpx.Forks`, which
    trains whole runs beside yours instead).

    Example::

        engine = hpx.Engine(model, lambda m: torch.optim.SGD(m.parameters(), lr=0.1),
                            [hpx.LearningRate(spread=0.25)], replicas=4, sync_every=20)
        for x, y in loader:
            engine.step(lambda rep, b: F.cross_entropy(rep.model(b[0]), b[1]), (x, y))
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: Union[OptimizerFactory, torch.optim.Optimizer],
        knobs: Union[Knobs, Sequence[Knob]] = (),
        *,
        backend: Collective | None = None,
        signal: Signal | None = None,
        search: Search | None = None,
        config: EngineConfig | None = None,
        on_sync: Callable[[SyncRecord], Any] | Sequence[Callable[[SyncRecord], Any]] = (),
        **settings: Any,
    ) -> None:
        self._t0 = time.perf_counter()
        callbacks = list(on_sync) if isinstance(on_sync, Sequence) else [on_sync]
        if not all(callable(c) for c in callbacks):
            raise ConfigError([f"on_sync must be a function record -> None, or a list of them "
                               f"(got {on_sync!r})"])
        self._on_sync = callbacks
        self._metrics: dict[str, Any] = {}
        custom = settings.pop("controller", None)
        if isinstance(custom, bool) or custom is None:
            if custom is not None:
                settings["controller"] = custom
            custom = None
        elif not all(hasattr(custom, m) for m in ("update", "log_mask", "state_dict", "load_state_dict")):
            raise ConfigError([f"controller must be True, False or an object with update, log_mask, "
                               f"state_dict and load_state_dict (got {custom!r})"])
        if config is not None and settings:
            raise ConfigError(["give either config=EngineConfig(...) or settings as keywords, not both"])
        self.config = config if config is not None else EngineConfig.build(**settings)
        cfg = self.config
        if cfg.history_file is not None and os.path.isdir(cfg.history_file):
            raise ConfigError([f"history_file={cfg.history_file!r} is a directory: give a file's path in it, "
                               f"e.g. {os.path.join(cfg.history_file, 'history.jsonl')!r}"])
        if not isinstance(model, torch.nn.Module):
            raise ConfigError([f"model must be a torch.nn.Module (got {type(model).__name__}): pass the "
                               "model first, then the optimizer factory: hpx.Engine(model, lambda m: ..., "
                               "knobs)"])
        ConfigError.check(_checks.backend_problems(backend) + _checks.knobs_problems(knobs))
        self.collective: Collective = backend if backend is not None else default_backend()
        self.knobs = knobs if isinstance(knobs, Knobs) else Knobs(*knobs)
        ConfigError.check(_taken_problems(self.knobs))
        before = self.knobs.state_dict()
        try:
            self._build(model, optimizer, signal, search, custom)
        except BaseException:  # a constructor that raises leaves the knobs as they were declared
            self.knobs.load_state_dict(before)
            raise
        for k in self.knobs:
            k._engine_bound = True  # an engine moves its knobs' bases: no other engine takes them

    def _build(self, model: torch.nn.Module, optimizer: Union[OptimizerFactory, torch.optim.Optimizer],
               signal: Signal | None, search: Search | None, custom: Any) -> None:
        """The constructor past its argument checks: replicas, knobs bound, search started,
        weights made equal."""
        cfg = self.config
        if self.knobs.seed is None:
            self.knobs.reseed(cfg.seed)
        self.signal: Signal = signal if signal is not None else IntervalLoss()
        if not hasattr(self.signal, "measure"):
            raise ConfigError([f"signal must have a measure(ctx) method (got {self.signal!r})"])
        self.search: Search = _search_of(cfg, search, custom)

        world, rank = self.collective.world_size, self.collective.rank
        local = (cfg.replicas if cfg.replicas is not None  # else the backend's choice (1 if it has none)
                 else int(getattr(self.collective, "default_replicas", 1)))
        self.n_local, self.n_replicas = local, local * world
        self._first = rank * local  # global index of local replica 0
        # the one process that writes shared files (a backend of sharded replicas has several
        # processes per replica: its process_rank names the process)
        self._writes_files = getattr(self.collective, "process_rank", self.collective.rank) == 0
        self._ddp = isinstance(model, torch.nn.parallel.DistributedDataParallel)
        sharded = _is_sharded(model)  # FSDP2: each rank holds shards; FSDP reduces the gradients
        self._framework_reduces = self._ddp or sharded
        shared = cfg.mode == "shared" and (local > 1 or (world > 1 and not self._framework_reduces))
        ConfigError.check(_layout_problems(model, cfg, local, self._ddp, sharded, shared)
                          + _sharded_problems(sharded, self.collective))
        prepare = getattr(self.collective, "prepare_model", None)
        if prepare is not None:  # e.g. keep one rank's NaN gradient out of DDP's mean
            model = prepare(model)
        # DDP's gradient health, judged in hpx's comm hook: it gets each loss, the engine its verdicts
        self._hook = getattr(model, "_hpx_hook_state", None) if self._ddp else None
        self.replicas = _build_replicas(model, optimizer, local, self._first)

        self._bind_knobs()
        self.step_count = 0
        self._floored: set[str] = set()  # knobs a strategy moved to 0 or below (warned once)
        self._bad_factor: tuple[str, float, int] | None = None  # a schedule's factor < 0 or non-finite
        if world > 1:
            self._check_agreement(settle=False)
            # Every rank starts from rank 0's bases and permutation stream, whatever seed it was given.
            self.knobs.load_state_dict(self.collective.broadcast_object(self.knobs.state_dict(), 0))
        dev = next((p.device for p in self.replicas[0].model.parameters()), torch.device("cpu"))
        # Shared mode: the replicas' optimizer states are equal; keep one where that is provable.
        self._state: _SharedState | None = None
        self.unshared_reason: str | None = "not shared mode, or one replica per process"
        if shared and local > 1:
            self.unshared_reason = ("shared_optimizer_state=False" if not cfg.shared_optimizer_state else
                                    unshareable(self.replicas, [getattr(k, "key", "lr") for k in self.knobs
                                                                if _writes_optimizer(k)]))
            if self.unshared_reason is None:
                self._state = _SharedState(self.replicas)
        # A gradient per replica: flat buckets, the mean (a masked one when a replica is left out)
        # a few ops per bucket, and over several processes one collective per bucket.
        self._shared = shared
        self._grads: _GradBuckets | None = None if not shared else _GradBuckets(self.replicas)
        params = list(self.replicas[0].model.parameters())  # listed once: checked at every shared step
        self._trainable = (params, _trainable(self.replicas[0], params))  # what the buffers are built over
        # ... and with one optimizer state, one gradient while the engine runs the backward
        self._one = None if self._state is None else _OneGradient(self.replicas, host=dev.type == "cpu")
        self._one_step = False  # this step's backward passes write into it
        self._acc = torch.zeros(local, device=dev)  # per local replica: sum of the interval's finite losses
        self._bad = torch.zeros(local, device=dev)  # ... and how many of its losses were non-finite
        self._acc_n = [0] * local  # ... and how many losses were recorded (host-side count)
        self._step_loss = torch.zeros(local, device=dev)  # this optimizer step's losses, summed
        self._step_n = [0] * local  # ... and how many (host-side count)
        self._grad_health = _Health(dev)  # shared mode: which gradients enter the mean (hpx/_health.py)
        # independent mode: the same rule on each replica's loss alone (docs/method.md)
        self._independent = cfg.mode == "independent"
        self._no_norms = torch.zeros(local, device=dev)
        self._fresh, self._reduced = True, False  # no backward yet in this step; mean not applied
        self._last: tuple[Any, LossFn | None] = (None, None)  # (batch, loss_fn) signals score on
        self.history: list[SyncRecord] = []
        if cfg.history_file is not None and self._writes_files:
            os.makedirs(os.path.dirname(os.path.abspath(cfg.history_file)), exist_ok=True)
        self._history_appends = False  # a fresh run's first sync starts the file anew
        self._agreement_due = False  # after a load: check that the ranks resumed alike
        ends = getattr(self.search, "total_steps", None)  # a search planned over the run's length
        self._past_end = ends + 1 if isinstance(ends, int) else -1  # the first step past it: warned
        self._next_sync = cfg.sync_every
        # A strategy that scores replicas placed along the run's displacement (Decision.placement)
        # needs the parameters the run started from: the anchor, taken below once they are set.
        self._placement: torch.Tensor | None = None
        self._anchor: list[torch.Tensor] | None = None
        empty = torch.empty(0, dtype=torch.float64)
        start = self.search.start(self._view(torch.empty(0, self.n_replicas, dtype=torch.float64), empty))
        self._apply(self._checked(start, "start"), starting=True)
        self._draw()
        self._write(force=True, strict=True)  # a schedule that returns no number: named before any write

        # Only now that every check has passed are the weights touched: every replica starts
        # from rank 0's weights, then (optionally) warm noise. A constructor that raises leaves
        # the model as it was.
        states = [float_state(r.model) for r in self.replicas]
        broadcast_(states[0], self.collective, 0, cfg.bucket_cap_mb)
        for s in states[1:]:
            with torch.no_grad():
                torch._foreach_copy_(s, states[0])
        # floating buffers that are constants (a causal mask's -inf), not weights: never averaged
        # or checked (read after the broadcast, so every rank names the same ones)
        self._constants = constant_buffers(self.replicas[0].model)
        if self._placement is not None:  # rank 0's start, before any warm noise: equal on every rank
            self._anchor = [p.detach().clone() for p in _params(self.replicas[0].model)]
        if cfg.warm_init:
            for r in self.replicas:
                _warm_noise_(r.model, cfg.warm_init, derive_seed(cfg.seed, 0x7761726D, r.index))

    # --- the training step (hpx/engine/step.py) -----------------------------------------------

    def step(
        self, loss_fn: LossFn, batch: Any = None, *, batches: Sequence[Any] | None = None
    ) -> torch.Tensor:
        """One optimizer step of every local replica: :meth:`backward` then :meth:`optimizer_step`.

        ``loss_fn(replica, batch)`` returns the replica's scalar loss. ``batch`` is
        split along its first dimension among the local replicas (tensors inside
        tuples, lists and dicts are split alike; other leaves are shared), or give
        ``batches``, one per local replica.

        Returns the ``[L]`` detached losses, on device (reading them is a sync:
        do it only when you log).
        """
        losses = self.backward(loss_fn, batch, batches=batches)
        self.optimizer_step()
        return losses

    def backward(self, loss_fn: LossFn, batch: Any = None, *, batches: Sequence[Any] | None = None,
                 scale: float = 1.0, scaler: Any = None) -> torch.Tensor:
        """Forward and backward of every local replica; gradients add up until the next
        :meth:`optimizer_step` (call it once per micro-batch to accumulate).

        Args:
            loss_fn, batch, batches: as for :meth:`step`.
            scale: what the loss is multiplied by for backward: ``1 / k`` when accumulating
                ``k`` micro-batches of a mean loss. The losses recorded for the search are
                unscaled.
            scaler: a ``torch.amp.GradScaler`` for mixed precision: backward runs on
                ``scaler.scale(loss * scale)``; give the same scaler to :meth:`optimizer_step`.

        Returns the ``[L]`` detached, unscaled losses, on device. When ``loss_fn`` raises, the
        optimizer step is dropped: the next call starts it again from zero gradients.

        Run it under ``torch.autocast(...)`` for mixed precision, as you would the forward.
        """
        return self._backward(loss_fn, batch, batches, scale, scaler)

    def reduce(self) -> None:
        """Apply the shared-gradient mean (Eq. 2) to the accumulated gradients: every local
        replica's gradient becomes the mean over all replicas whose losses were finite.

        :meth:`optimizer_step` and :meth:`step` call it. A loop that steps the optimizers
        itself calls it after the last backward and before unscaling, clipping or stepping;
        without it :meth:`advance` raises, since the replicas would silently stop sharing
        the gradient. Nothing to do (and nothing done) in independent mode, with one replica
        per process under DDP (which reduces during backward), or twice in one step.
        """
        self._reduce(alias=False)

    def optimizer_step(self, *, max_grad_norm: float | None = None,
                       scaler: Any = None) -> torch.Tensor | None:
        """Step every local replica's optimizer on the accumulated gradients, then :meth:`advance`.

        Applies the shared-gradient mean (:meth:`reduce`), then, with ``scaler`` (a
        ``torch.amp.GradScaler``), unscales each optimizer's gradients, clips the gradient
        norm to ``max_grad_norm`` if given (per replica, over all its parameters, as
        ``torch.nn.utils.clip_grad_norm_``), steps each optimizer (through the scaler,
        which skips a step whose gradients are not finite) and updates the scaler.

        When the replicas keep one optimizer state (:attr:`unshared_reason` is ``None``), the
        mean gradient is one tensor: it is unscaled, clipped and stepped once, and each replica
        applies the update with its own values.

        Returns the ``[L]`` gradient norms before clipping (on device) when clipping, else ``None``.
        """
        return self._optimizer_step(max_grad_norm, scaler)

    def log(self, metrics: dict[str, Any]) -> None:
        """Attach metrics to the next sync record (:attr:`SyncRecord.metrics`): numbers or
        one-element tensors, kept as they are (no host read) until the sync reads them."""
        if not isinstance(metrics, dict) or not all(isinstance(k, str) for k in metrics):
            raise ConfigError([f"log takes a dict of name -> number (got {metrics!r})"])
        ConfigError.check(
            f"log's metric {k!r} is {_checks.shown(v)}: give a number or a one-element tensor (the sync "
            "reads it with float())" for k, v in metrics.items()
            if not (isinstance(v, numbers.Real) or (torch.is_tensor(v) and v.numel() == 1
                                                    and not v.is_complex())))
        self._metrics.update({k: v.detach() if torch.is_tensor(v) else v for k, v in metrics.items()})

    def record(self, loss: torch.Tensor, replica: int = 0) -> None:
        """Add a local replica's loss to its interval mean (stays on device).

        For training loops that do their own backward and optimizer step: record each
        replica's loss, call :meth:`reduce` after backward (replicas in shared mode share
        the mean gradient) and :meth:`advance` after the optimizer step. :meth:`backward`
        and :meth:`optimizer_step` do all of this, with room for clipping, a GradScaler and
        accumulation.
        """
        self._record(loss, replica)

    def advance(self, *, batch: Any = None, loss_fn: LossFn | None = None) -> None:
        """Count one optimizer step; sync if ``T`` steps have passed; write the next values.

        Call it after every optimizer step when not using :meth:`step`. ``batch``
        and ``loss_fn`` are handed to signals that score replicas on a batch.
        """
        self._advance(batch, loss_fn)

    # --- the sync (hpx/engine/sync.py) ---------------------------------------------------------

    def converge(self) -> torch.nn.Module:
        """Average every replica's weights now, leaving out non-finite ones, and
        return local replica 0's model (the consensus). Use it at the end of
        training; under torch.distributed every rank must call it, at the same step (checked:
        :class:`~hpx.ConsistencyError` on every rank otherwise)."""
        if self.collective.world_size > 1:
            self._check_aligned("converging at the end of training")
            self._check_agreement(settle=True, when="converging at the end of training")
        if not self._converge(torch.ones(self.n_replicas, dtype=torch.float64), average=True, check=True):
            self._converge(self._sound().to(torch.float64), average=True)  # leave the non-finite out
        return self.replicas[0].model


    # --- inspection ----------------------------------------------------------------------

    @property
    def model(self) -> torch.nn.Module:
        """Local replica 0's model (right after a sync, the consensus of all replicas)."""
        return self.replicas[0].model

    @property
    def controller(self) -> Any:
        """The search strategy's controller (for :class:`~hpx.search.HDET`), or ``None``."""
        return getattr(self.search, "controller", None)

    @property
    def next_sync(self) -> int:
        """The step count at which the next sync runs."""
        return self._next_sync

    @property
    def bases(self) -> dict[str, float]:
        """Every knob's current base ``b``."""
        return {k.name: k.base for k in self.knobs}

    def values(self, name: str) -> list[float]:
        """Knob ``name``'s current value on each local replica (schedule applied)."""
        return [r.value(name) for r in self.replicas]

    # --- the run's state (hpx/engine/state.py) ---------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue the same trajectory: the local replicas'
        models and optimizers, knobs, permutation stream, controller, step count,
        loss accumulators and history."""
        return self._state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict` into an engine built with the same settings.

        Everything is checked before anything is changed (format, replica layout, the
        settings that shape the trajectory, the search strategy, the knobs, every model's
        parameter names and shapes, every optimizer's groups): a checkpoint that is refused
        leaves the engine, its models and its optimizers as they were.

        A state without ``"replicas"`` restores only hpx's own state (knobs,
        permutations, controller, step, accumulators), leaving the models and
        optimizers as they are: what a scheduler's checkpoint holds.
        """
        self._load_state_dict(state)

    def load_elastic(self, states: Sequence[dict[str, Any]]) -> None:
        """Resume a run saved with another number of replicas or processes.

        ``states``: the saved run's checkpoints, one per process it had (in rank order; a
        run of one process has one). What carries over: every knob's base and spread, the
        search strategy's and the signal's state, the step, the next sync and the history.
        Every replica here starts from the *consensus* of the saved replicas (the mean of
        their weights and floating buffers, and of their optimizers' floating state, which
        are equal in shared mode right after a sync), and the replicas draw new
        permutations for their number. What cannot carry over: each saved replica's own
        weights between syncs (resume right after a sync to lose nothing) and the losses
        recorded since the last sync (the next interval starts empty). Checked before
        anything changes, as :meth:`load_state_dict`, except the replica count.
        """
        self._load_elastic(states)

    def __repr__(self) -> str:
        return (f"Engine(replicas={self.n_replicas} ({self.n_local} local), step={self.step_count}, "
                f"{self.knobs!r}, search={self.search!r}, signal={self.signal!r}, "
                f"backend={self.collective!r})")


def _taken_problems(knobs: Knobs) -> list[str]:
    taken = [k.name for k in knobs if getattr(k, "_engine_bound", False)]
    return [f"knob(s) {taken} already belong to another hpx.Engine, which moves their bases: a second "
            "engine would start from that run's values, and both would move together. Declare the knobs "
            "anew for each engine"] if taken else []


def _search_of(cfg: EngineConfig, search: Search | None, custom: Any) -> Search:
    """The search strategy: ``search``, or HDET around ``custom`` or hpx's own controller; the
    settings the chosen one would ignore refused."""
    owned = _HDET_SETTINGS if search is not None else _CONTROLLER_SETTINGS if custom is not None else ()
    unused = [f for f in owned if f in cfg.model_fields_set]
    if unused:
        what = ("a search strategy decides the bases itself" if search is not None
                else "a custom controller has its own settings")
        raise ConfigError([f"{', '.join(unused)} would be ignored: {what} (they set hpx's own controller); "
                           "drop them, or give them to the strategy or controller you build"])
    if search is None:
        controller = custom if custom is not None else Controller(
            meta_lr=cfg.meta_lr, momentum=cfg.momentum, temperature=cfg.temperature,
            temperature_scale=cfg.temperature_scale, space=cfg.space, debias=cfg.debias_momentum,
        )
        return HDET(controller, warmup=cfg.warmup, decay=cfg.decay, active=cfg.controller)
    if custom is not None:
        raise ConfigError(["give search=... or controller=obj, not both (a custom controller "
                           "runs inside hpx.search.HDET(controller=obj))"])
    missing = [m for m in ("start", "decide", "acts_at", "state_dict", "load_state_dict")
               if not callable(getattr(search, m, None))]
    if missing:
        raise ConfigError([f"search must implement hpx.search.Search; {search!r} lacks {', '.join(missing)}"])
    return search


def _layout_problems(model: torch.nn.Module, cfg: EngineConfig, local: int, ddp: bool, sharded: bool,
                     shared: bool) -> list[str]:
    """What the replicas' layout cannot take: DDP or FSDP2 with several replicas per process, and
    sparse gradients in the shared mode's dense buckets."""
    problems = []
    if ddp and (local > 1 or cfg.mode == "independent"):
        problems.append("a DistributedDataParallel model needs one replica per rank and mode='shared' "
                        "(DDP all-reduces gradients every step); for independent replicas pass the bare "
                        "model")
    if sharded and (local > 1 or cfg.warm_init):
        problems.append(f"a sharded (FSDP2) model is one replica per group of its shard ranks: give "
                        f"replicas=1 (got {local}) and no warm_init (got {cfg.warm_init}); hpx.backends.Mesh "
                        "places the replicas along the mesh's replicate dim")
    sparse = [n for n, m in model.named_modules() if getattr(m, "sparse", False) is True]
    if shared and sparse:
        problems.append(f"module {sparse[0]!r} gives sparse gradients (sparse=True), which the shared mode's "
                        "gradient mean (dense buckets) does not take: build the engine with "
                        "mode='independent', or the module with sparse=False")
    return problems


def _sharded_problems(sharded: bool, collective: Collective) -> list[str]:
    """A sharded (FSDP2) model on a backend that takes each process for a whole replica: the
    broadcast at construction would copy rank 0's shards over the others' (another part of the
    model), and every average would mix different slices."""
    if not sharded or collective.world_size == 1 or hasattr(collective, "process_rank"):  # Mesh: shard groups
        return []
    return [f"the model is sharded (FSDP2: each process holds a slice of it), and the backend "
            f"{type(collective).__name__} takes each process for a whole replica: give "
            "backend=hpx.backends.Mesh(mesh) with the device mesh the model was sharded on (replicas along "
            "its replicate dim; examples/torchrun_fsdp.py)"]


def _build_replicas(model: torch.nn.Module, optimizer: Union[OptimizerFactory, torch.optim.Optimizer],
                    local: int, first: int) -> list[Replica]:
    """The local replicas: ``model`` and ``local - 1`` copies, each with its own optimizer."""
    is_opt = isinstance(optimizer, torch.optim.Optimizer)
    if not is_opt and not callable(optimizer):
        raise ConfigError([f"optimizer must be a factory model -> Optimizer (got {optimizer!r})"])
    if is_opt and local > 1:
        raise ConfigError(
            [f"{local} replicas in one process need one optimizer each: pass a factory, e.g. "
             "optimizer=lambda m: torch.optim.SGD(m.parameters(), lr=0.1)"]
        )
    try:
        models = [model] + [copy.deepcopy(model, graph_tensors_detached(model)) for _ in range(local - 1)]
    except (TypeError, copy.Error, RuntimeError) as e:
        raise ConfigError([f"{local} replicas in one process train deep copies of your model, and "
                           f"copy.deepcopy failed ({type(e).__name__}: {e}): keep what cannot be copied "
                           "(a lock, an open file) off the model, or give it a __deepcopy__"]) from e
    reps = []
    for i, m in enumerate(models):
        opt = optimizer if is_opt else optimizer(m)
        if not isinstance(opt, torch.optim.Optimizer):
            raise ConfigError([f"the optimizer factory returned {type(opt).__name__}, not an Optimizer"])
        if problems := _checks.closure_problems(opt):
            raise ConfigError(problems)
        own = {id(p) for p in m.parameters()}
        foreign = sum(id(p) not in own for g in opt.param_groups for p in g["params"])
        if foreign:
            raise ConfigError(
                [f"replica {i}'s optimizer holds {foreign} parameter(s) that are not its model's: "
                 "build the optimizer from the model the factory receives (lambda m: "
                 "SGD(m.parameters(), ...)), not from a model captured outside it"]
            )
        reps.append(Replica(first + i, m, opt))
    return reps



def _is_sharded(model: torch.nn.Module) -> bool:
    """Whether ``model`` is sharded by FSDP2 (``fully_shard``): its parameters are DTensors."""
    return any(type(p).__name__ == "DTensor" for p in model.parameters())


@torch.no_grad()
def _warm_noise_(model: torch.nn.Module, nu: float, seed: int) -> None:
    """Paper 3.5: ``theta += eps``, ``eps ~ N(0, (nu ||theta|| / sqrt(P))^2)`` per tensor."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    for p in model.parameters():
        if not p.is_floating_point() or p.numel() == 0:
            continue
        std = nu * float(p.norm()) / math.sqrt(p.numel())
        dtype = p.dtype if p.dtype in (torch.float32, torch.float64) else torch.float32
        noise = torch.randn(p.shape, generator=gen, dtype=dtype)
        p.add_(noise.to(p.device, p.dtype), alpha=std)
