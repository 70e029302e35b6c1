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
"""

from __future__ import annotations

import copy
import logging
import math
import os
import time
import zlib
from collections.abc import Callable, Collection, Sequence
from dataclasses import asdict
from typing import Any, Union

import torch

from hpx._seed import derive_seed
from hpx._shared_state import _SharedState, unshareable
from hpx.averaging import average_, broadcast_, constant_buffers, float_state, optimizer_state_tensors
from hpx.averaging import params as _params
from hpx.backends import default_backend
from hpx.backends.base import Collective
from hpx.config import EngineConfig
from hpx.controller import Controller
from hpx.errors import ConfigError, ConsistencyError, NonFiniteError
from hpx.knobs.base import Knob
from hpx.knobs.optim import GroupKnob, LearningRateScale
from hpx.registry import Knobs
from hpx.replica import Replica
from hpx.search.base import Decision, Search, SyncView
from hpx.search.hdet import HDET
from hpx.signals import IntervalLoss, LossFn, Signal, SyncContext, _leaves
from hpx.sync_record import SyncRecord

__all__ = ["Engine", "OptimizerFactory", "SyncRecord"]

log = logging.getLogger("hpx")

OptimizerFactory = Callable[[torch.nn.Module], torch.optim.Optimizer]
"""``factory(model) -> optimizer`` built over *that* model's parameters."""


class Engine:
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

    The recommended way to build an engine that finds the learning rate is
    :func:`hpx.autolr`, which picks the strategy, spread, sync schedule and
    signal from the run's length.

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
        if not isinstance(model, torch.nn.Module):
            raise ConfigError([f"model must be a torch.nn.Module (got {type(model).__name__})"])
        self.collective: Collective = backend if backend is not None else default_backend()
        self.knobs = knobs if isinstance(knobs, Knobs) else Knobs(*knobs)
        if self.knobs.seed is None:
            self.knobs.reseed(cfg.seed)
        self.signal: Signal = signal if signal is not None else IntervalLoss()
        if not hasattr(self.signal, "measure"):
            raise ConfigError([f"signal must have a measure(ctx) method (got {self.signal!r})"])
        if search is not None:
            if custom is not None:
                raise ConfigError(["give search=... or controller=obj, not both (a custom controller "
                                   "runs inside hpx.search.HDET(controller=obj))"])
            missing = [m for m in ("start", "decide", "acts_at", "state_dict", "load_state_dict")
                       if not callable(getattr(search, m, None))]
            if missing:
                raise ConfigError([f"search must implement hpx.search.Search; {search!r} lacks "
                                   f"{', '.join(missing)}"])
            self.search: Search = search
        else:
            controller = custom if custom is not None else Controller(
                meta_lr=cfg.meta_lr, momentum=cfg.momentum, temperature=cfg.temperature,
                temperature_scale=cfg.temperature_scale, space=cfg.space, debias=cfg.debias_momentum,
            )
            self.search = HDET(controller, warmup=cfg.warmup, decay=cfg.decay, active=cfg.controller)

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
        if self._ddp and (local > 1 or cfg.mode == "independent"):
            raise ConfigError(
                ["a DistributedDataParallel model needs one replica per rank and mode='shared' "
                 "(DDP all-reduces gradients every step); for independent replicas pass the bare model"]
            )
        if sharded and (local > 1 or cfg.warm_init):
            raise ConfigError(
                [f"a sharded (FSDP2) model is one replica per group of its shard ranks: give replicas=1 "
                 f"(got {local}) and no warm_init (got {cfg.warm_init}); hpx.backends.Mesh places the "
                 "replicas along the mesh's replicate dim"]
            )
        self._framework_reduces = self._ddp or sharded
        prepare = getattr(self.collective, "prepare_model", None)
        if prepare is not None:  # e.g. keep one rank's NaN gradient out of DDP's mean
            model = prepare(model)
        self.replicas = self._build_replicas(model, optimizer, local)

        self._bind_knobs()
        self.step_count = 0
        self._bad_factor: tuple[str, float, int] | None = None  # a schedule's factor < 0 or non-finite
        if world > 1:
            self._check_agreement(settle=False)
            # Every rank starts from rank 0's bases and permutation stream, whatever seed it was given.
            self.knobs.load_state_dict(self.collective.broadcast_object(self.knobs.state_dict(), 0))
        dev = next((p.device for p in self.replicas[0].model.parameters()), torch.device("cpu"))
        shared = cfg.mode == "shared" and (local > 1 or (world > 1 and not self._framework_reduces))
        # Shared mode: the replicas' optimizer states are equal; keep one where that is provable.
        self._state: _SharedState | None = None
        self.unshared_reason: str | None = "not shared mode, or one replica per process"
        if shared and local > 1:
            self.unshared_reason = ("shared_optimizer_state=False" if not cfg.shared_optimizer_state else
                                    unshareable(self.replicas, [getattr(k, "key", "lr") for k in self.knobs
                                                                if _writes_optimizer(k)]))
            if self.unshared_reason is None:
                self._state = _SharedState(self.replicas)
        # One process on the CPU: autograd's own gradients and a foreach mean (reading which
        # losses are finite costs nothing there). Elsewhere: flat buckets, a masked reduction on
        # the device and one collective per bucket.
        self._shared = shared
        self._grads: _GradBuckets | _ForeachMean | None = (
            None if not shared else _ForeachMean(self.replicas) if world == 1 and dev.type == "cpu"
            else _GradBuckets(self.replicas))
        # ... and with one optimizer state, one gradient while the engine runs the backward
        self._one = None if self._state is None else _OneGradient(self.replicas, host=dev.type == "cpu")
        self._one_step = False  # this step's backward passes write into it
        self._acc = torch.zeros(local, device=dev)  # per local replica: sum of the interval's finite losses
        self._bad = torch.zeros(local, device=dev)  # ... and how many of its losses were non-finite
        self._acc_n = [0] * local  # ... and how many losses were recorded (host-side count)
        self._step_loss = torch.zeros(local, device=dev)  # this optimizer step's losses, summed
        self._fresh, self._reduced = True, False  # no backward yet in this step; mean not applied
        self._last: tuple[Any, LossFn | None] = (None, None)  # (batch, loss_fn) signals score on
        self.history: list[SyncRecord] = []
        if cfg.history_file is not None and self._writes_files:
            os.makedirs(os.path.dirname(os.path.abspath(cfg.history_file)), exist_ok=True)
        self._agreement_due = False  # after a load: check that the ranks resumed alike
        self._next_sync = cfg.sync_every
        # A strategy that scores replicas placed along the run's displacement (Decision.placement)
        # needs the parameters the run started from: the anchor, taken below once they are set.
        self._placement: torch.Tensor | None = None
        self._anchor: list[torch.Tensor] | None = None
        empty = torch.empty(0, dtype=torch.float64)
        self._apply(self.search.start(self._view(torch.empty(0, self.n_replicas, dtype=torch.float64),
                                                 empty)), starting=True)
        self._draw()
        self._write(force=True)

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

    # --- construction --------------------------------------------------------------

    def _build_replicas(self, model, optimizer, local: int) -> list[Replica]:
        is_opt = isinstance(optimizer, torch.optim.Optimizer)
        if not is_opt and not callable(optimizer):
            raise ConfigError([f"optimizer must be a factory model -> Optimizer (got {optimizer!r})"])
        if is_opt and local > 1:
            raise ConfigError(
                [f"{local} replicas in one process need one optimizer each: pass a factory, e.g. "
                 "optimizer=lambda m: torch.optim.SGD(m.parameters(), lr=0.1)"]
            )
        models = [model] + [copy.deepcopy(model) for _ in range(local - 1)]
        reps = []
        for i, m in enumerate(models):
            opt = optimizer if is_opt else optimizer(m)
            if not isinstance(opt, torch.optim.Optimizer):
                raise ConfigError([f"the optimizer factory returned {type(opt).__name__}, not an Optimizer"])
            own = {id(p) for p in m.parameters()}
            foreign = sum(id(p) not in own for g in opt.param_groups for p in g["params"])
            if foreign:
                raise ConfigError(
                    [f"replica {i}'s optimizer holds {foreign} parameter(s) that are not its model's: "
                     "build the optimizer from the model the factory receives (lambda m: "
                     "SGD(m.parameters(), ...)), not from a model captured outside it"]
                )
            reps.append(Replica(self._first + i, m, opt))
        return reps

    def __getstate__(self) -> dict[str, Any]:
        # The setters are closures over this engine's replicas: a copy (deepcopy, pickle) binds
        # its own, so that it drives its own optimizers and never the original's.
        state = self.__dict__.copy()
        state["_setters"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._setters = [[k.bind(r) for r in self.replicas] for k in self.knobs]

    def _bind_knobs(self) -> None:
        problems: list[str] = []
        self._setters: list[list[Callable[[float], None] | None]] = []
        for k in self.knobs:
            try:
                k.resolve_base(self.replicas[0])
                self._setters.append([k.bind(r) for r in self.replicas])
            except ConfigError as e:
                problems.extend(e.problems)
        ConfigError.check(problems)
        writers: dict[str, list[str]] = {}
        for k in self.knobs:
            for t in dict.fromkeys(k.targets(self.replicas[0])):
                writers.setdefault(t, []).append(k.name)
        clashes = {t: names for t, names in writers.items() if len(names) > 1}
        if clashes:
            t, names = next(iter(clashes.items()))
            more = f" (and {len(clashes) - 1} more settings)" if len(clashes) > 1 else ""
            raise ConfigError([f"knobs {names} all write the {t}{more}: each would overwrite the other "
                               "at every step; declare one knob per setting"])
        if self.n_replicas == 1 and any(k.explore and k.spread > 0 for k in self.knobs):
            log.warning("one replica in all: every knob stays at its base and nothing is explored "
                        "(replicas=%s per process, %d process(es)); use replicas >= 2, or more processes",
                        self.n_local, self.collective.world_size)
        self._scheduled = [i for i, k in enumerate(self.knobs) if k.scheduled]
        self._scales = [1.0] * len(self.knobs)  # each knob's schedule factor at its last write
        self._written: list[list[float | None]] = [[None] * self.n_local for _ in self.knobs]

    # --- values ----------------------------------------------------------------------

    def _draw(self) -> None:
        """New permutations (Eq. 9) and the values they give, ``[K, N]`` float64."""
        self._slots = self.knobs.draw_slots(self.n_replicas)
        rows = [k.values(self._slots[i]) for i, k in enumerate(self.knobs)]
        self._values = torch.stack(rows) if rows else torch.empty(0, self.n_replicas, dtype=torch.float64)
        local = self._values[:, self._first : self._first + self.n_local]
        self._local_values: list[list[float]] = local.tolist()

    def _check_written(self) -> None:
        """Raise if something other than the knobs changed a setting they write (a torch
        scheduler stepped beside the engine would silently replace the explored values)."""
        for setters, row in zip(self._setters, self._written):
            for setter, written in zip(setters, row):
                drift = getattr(setter, "drift", None)
                why = drift(written) if drift is not None and written is not None else None
                if why is not None:
                    raise ConfigError(
                        [f"at step {self.step_count}, {why}: something else set it since (a torch "
                         "scheduler stepped beside the engine?). The engine writes the knobs' values "
                         "at every step and follows the schedule you gave it (schedule=...): remove "
                         "the scheduler.step() call, or declare the knob on another setting"])

    def _check_factors(self) -> None:
        if self._bad_factor is not None:
            name, scale, step = self._bad_factor
            raise ConfigError([f"knob {name!r}: its schedule gave the factor {scale!r} at step {step}; a "
                               "schedule's factors must be finite and >= 0 (a negative learning rate "
                               "trains uphill); is total_steps shorter than the run?"])

    def _write(self, force: bool = False) -> None:
        """Write each knob's value into each local replica where it changed."""
        which = range(len(self.knobs)) if force else self._scheduled
        knobs = self.knobs._knobs
        for i in which:
            k = knobs[i]
            scale = k.scale(self.step_count)
            self._scales[i] = scale
            if not 0.0 <= scale < math.inf and self._bad_factor is None:  # also catches NaN
                # raised when a step would train with it: torch's own OneCycleLR (linear) goes
                # below 0 at total_steps, after the last step, and hpx writes what torch writes
                self._bad_factor = (k.name, scale, self.step_count)
            written, setters, vals = self._written[i], self._setters[i], self._local_values[i]
            for l, rep in enumerate(self.replicas):
                v = vals[l] * scale
                if v != written[l]:
                    written[l] = v
                    rep._values[k.name] = v
                    if setters[l] is not None:
                        setters[l](v)

    # --- the training step ------------------------------------------------------------

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

        Returns the ``[L]`` detached, unscaled losses, on device.

        Run it under ``torch.autocast(...)`` for mixed precision, as you would the forward.
        """
        self._check_factors()
        parts, shared = self._parts(batch, batches)
        if self._fresh:  # the first micro-batch of an optimizer step
            prepare = getattr(self.signal, "prepare", None)
            # not when the sync places the replicas first: they must be scored where they are placed
            if (prepare is not None and self._placement is None and self.step_count + 1 >= self._next_sync
                    and self._controls_now(1)):
                prepare(SyncContext(self.replicas, self._acc, shared, loss_fn, self.collective,
                                    self.step_count))
            self._one_step = self._one is not None
            if self._one is not None:
                self._one.zero_()
            elif self._grads is not None:
                self._grads.zero_()
            else:
                for r in self.replicas:
                    r.optimizer.zero_grad(set_to_none=True)
            self._fresh, self._reduced = False, False
            self._last = (shared, loss_fn)
        problems = []
        if not isinstance(scale, (int, float)) or isinstance(scale, bool) or not 0 < scale < math.inf:
            problems.append(f"scale must be a number > 0 (got {scale!r}): 1 / k when accumulating k "
                            "micro-batches")
        if scaler is not None and not callable(getattr(scaler, "scale", None)):
            problems.append(f"scaler must be a torch.amp.GradScaler or None (got {scaler!r})")
        ConfigError.check(problems)
        losses = []
        for rep, part in zip(self.replicas, parts):
            loss = loss_fn(rep, part)
            if not torch.is_tensor(loss) or loss.numel() != 1:
                raise TypeError(f"loss_fn must return a scalar tensor (got {type(loss).__name__} "
                                f"of shape {getattr(loss, 'shape', None)})")
            out = loss * scale if scale != 1 else loss
            if not self._one_step:
                (scaler.scale(out) if scaler is not None else out).backward()
            elif self._one.admit(loss):  # on the host: not into the one gradient if non-finite
                (scaler.scale(out) if scaler is not None else out).backward()
                self._one.ran(loss)
            losses.append(loss.detach().reshape(()))
        lt = torch.stack(losses).to(self._acc.dtype)
        self._accumulate(lt, range(self.n_local))
        self._step_loss.add_(lt)  # non-finite if any micro-batch's was: left out of the mean
        return lt

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

    def _reduce(self, alias: bool) -> None:
        # alias: every replica's gradient may be the one mean tensor (one shared optimizer
        # state reads it once; unscaling or clipping each replica's would repeat the work)
        if self._one_step and not self._reduced:
            if not self._one.intact():
                raise ConfigError(["a replica's gradient was replaced between engine.backward() and the "
                                   "optimizer step, while the replicas keep one gradient: modify gradients "
                                   "in place, or build the engine with shared_optimizer_state=False"])
            self._one.average_(self.collective, alias=alias)
        elif self._grads is not None and not self._reduced:
            if self._fresh:  # no engine.backward this step: a loop of its own may have moved them
                self._grads.adopt_()
            self._grads.average_(self._step_loss, self.collective)
        self._reduced = True

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
        if self._fresh:
            raise ConfigError(["optimizer_step() found no gradients: call engine.backward(loss_fn, batch) "
                               "first (once per micro-batch)"])
        if max_grad_norm is not None and not (isinstance(max_grad_norm, (int, float))
                                              and not isinstance(max_grad_norm, bool) and max_grad_norm > 0):
            raise ConfigError([f"max_grad_norm must be a number > 0 or None (got {max_grad_norm!r})"])
        if self.step_count + 1 >= self._next_sync:  # once per interval: no host read on other steps
            self._check_written()
        clip, cap = torch.nn.utils.clip_grad_norm_, max_grad_norm
        norms = None
        if self._state is not None:  # one state, one mean gradient: unscale, clip and step once
            self._state.check()
            self._reduce(alias=True)
            self._state.attach()
            if scaler is not None:
                scaler.unscale_(self._state)
            if cap is not None:
                norms = _whole(clip(self._state.parameters(), float(cap))).expand(self.n_local).clone()
            if scaler is not None:
                scaler.step(self._state)
            else:
                self._state.step()
        else:
            self.reduce()
            if scaler is not None:
                for r in self.replicas:
                    scaler.unscale_(r.optimizer)
            if cap is not None:
                norms = torch.stack([_whole(clip(r.model.parameters(), float(cap))) for r in self.replicas])
            for r in self.replicas:
                if scaler is not None:
                    scaler.step(r.optimizer)
                else:
                    r.optimizer.step()
        if scaler is not None:
            scaler.update()
        shared, loss_fn = self._last
        self.advance(batch=shared, loss_fn=loss_fn)
        return norms

    def _parts(self, batch: Any, batches: Sequence[Any] | None) -> tuple[list[Any], Any]:
        """Each local replica's part of the batch, and what signals score every replica on."""
        if batches is not None:
            if batch is not None:
                raise ConfigError(["give batch or batches, not both"])
            if isinstance(batches, tuple) and all(torch.is_tensor(b) for b in batches) and len(
                    {(b.dtype, tuple(b.shape[1:])) for b in batches}) > 1:
                raise ConfigError([f"batches=({', '.join(type(b).__name__ for b in batches)}) holds tensors "
                                   "of different kinds, like one batch (x, y): pass it as batch=(x, y) "
                                   "to split it among the replicas, or give batches=[batch_0, ...], one "
                                   "batch per local replica"])
            if len(batches) != self.n_local:
                raise ConfigError([f"batches has {len(batches)} entries for {self.n_local} local replicas: "
                                   "give one batch per local replica, or one batch=... to split"])
            return list(batches), batches[0]
        return _split(batch, self.n_local), batch

    def log(self, metrics: dict[str, Any]) -> None:
        """Attach metrics to the next sync record (:attr:`SyncRecord.metrics`): numbers or
        one-element tensors, kept as they are (no host read) until the sync reads them."""
        if not isinstance(metrics, dict) or not all(isinstance(k, str) for k in metrics):
            raise ConfigError([f"log takes a dict of name -> number (got {metrics!r})"])
        self._metrics.update({k: v.detach() if torch.is_tensor(v) else v for k, v in metrics.items()})

    def record(self, loss: torch.Tensor, replica: int = 0) -> None:
        """Add a local replica's loss to its interval mean (stays on device).

        For training loops that do their own backward and optimizer step: record each
        replica's loss, call :meth:`reduce` after backward (replicas in shared mode share
        the mean gradient) and :meth:`advance` after the optimizer step. :meth:`backward`
        and :meth:`optimizer_step` do all of this, with room for clipping, a GradScaler and
        accumulation.
        """
        lt = loss.detach().reshape(1).to(self._acc.dtype)
        self._accumulate(lt, [replica])
        self._step_loss[replica] += lt[0]  # a non-finite loss keeps the replica out of the mean

    def _accumulate(self, losses: torch.Tensor, which: Sequence[int]) -> None:
        """Add ``losses`` (of the local replicas ``which``) to the interval's sums, on device:
        a non-finite loss adds nothing to the sum and counts as a bad step."""
        ok = torch.isfinite(losses)
        if len(which) == self.n_local:
            self._acc.add_(torch.where(ok, losses, 0.0))
            self._bad.add_(~ok)
        else:
            idx = list(which)
            self._acc[idx] += torch.where(ok, losses, 0.0)
            self._bad[idx] += ~ok
        for l in which:
            self._acc_n[l] += 1

    def advance(self, *, batch: Any = None, loss_fn: LossFn | None = None) -> None:
        """Count one optimizer step; sync if ``T`` steps have passed; write the next values.

        Call it after every optimizer step when not using :meth:`step`. ``batch``
        and ``loss_fn`` are handed to signals that score replicas on a batch.
        """
        self._check_factors()
        if self._shared and not self._reduced:
            raise ConfigError(
                [f"the {self.n_replicas} replicas train in shared mode, but this step's gradients were "
                 "never averaged: call engine.reduce() after backward and before the optimizers step "
                 "(or use engine.optimizer_step(), or engine.step()); without it each replica would "
                 "follow its own gradient and the method would silently change"])
        if self._agreement_due:
            self._check_agreement(settle=True)
        self._fresh, self._reduced, self._one_step = True, False, False
        self._step_loss.zero_()
        self.step_count += 1
        if self.step_count >= self._next_sync:
            self._sync(batch, loss_fn)
        else:
            self._write()

    # --- the sync ----------------------------------------------------------------------

    def _gather_scores(self, batch: Any, loss_fn: LossFn | None, placed: torch.Tensor | None = None,
                       health: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``[N]`` scores, weight health (finite iff the weights are) and non-finite loss
        counts of every replica, in one gather. With ``placed`` (``[P]`` multipliers, ``P`` a
        multiple of ``N``), the scores are the ``P`` points' instead, scored in ``P / N`` rounds
        (point ``p`` by replica ``p % N`` in round ``p // N``)."""
        counts = torch.tensor(self._acc_n, dtype=self._acc.dtype, device=self._acc.device) - self._bad
        # the mean over the interval's finite losses; nan for a replica that had none
        interval = torch.where(counts > 0, self._acc / counts.clamp_min(1), math.nan)
        if isinstance(self.signal, IntervalLoss) and 0 in self._acc_n and self._controls_now():
            raise ConfigError(
                [f"no loss recorded for local replica {self._acc_n.index(0)} since the last sync, and "
                 "replicas are compared on their training loss: use Engine.step, or call "
                 "Engine.record(loss) every step (or pass the loss to the scheduler's step(loss)); "
                 "where a framework calls scheduler.step() with no loss, compare replicas on held-out "
                 "data instead: signal=hpx.ProbeStream(val_batches, loss_fn=...)"]
            )
        rounds = 1 if placed is None else placed.numel() // self.n_replicas
        measured = []
        for j in range(rounds):
            if placed is not None:
                self._move_to(placed[j * self.n_replicas:(j + 1) * self.n_replicas],
                              None if j == 0 else placed[(j - 1) * self.n_replicas:j * self.n_replicas])
            if self._controls_now():
                ctx = SyncContext(self.replicas, interval, batch, loss_fn, self.collective,
                                  self.step_count, round=j)
                scores = self.signal.measure(ctx).detach().reshape(-1).to(self._acc.device, torch.float32)
            else:  # the search will not read them: the interval's loss (free) stands in, for the record
                scores = interval.to(torch.float32)
            if scores.numel() != self.n_local:
                raise ValueError(f"signal returned {scores.numel()} scores for {self.n_local} local replicas")
            measured.append(scores)
        fine = self._health().to(scores) if health else torch.zeros_like(scores)  # else checked later
        rows = torch.stack([*measured, fine, self._bad.to(scores)])
        rows = self.collective.all_gather(rows).to("cpu", torch.float64)  # [W, R + 2, L]: the host read
        # point p = j N + g sits at [rank of g, round j, local index of g]
        scores = rows[:, :rounds, :].transpose(0, 1).reshape(-1)
        return scores, rows[:, rounds, :].reshape(-1), rows[:, rounds + 1, :].reshape(-1)

    def _converge(self, weights: torch.Tensor, *, average: bool, check: bool = False) -> bool:
        """Set replicas to the ``weights``-weighted mean of all replicas (``[N]``, >= 0; a
        replica with weight 0 is left out and always reset). ``average=False`` resets only
        those. ``check``: change nothing and return False if the mean is not finite (a
        replica's weights went NaN or inf: the caller finds which, replica by replica)."""
        cfg = self.config
        finite = weights > 0
        local_w = weights[self._first : self._first + self.n_local].tolist()
        bad_local = [w == 0 for w in local_w]
        write = [True] * self.n_local if average else bad_local
        if not any(write) and not (~finite).any():
            return True
        w = [float(x) for x in local_w]
        total = float(weights.sum())
        states = [float_state(r.model, self._constants) for r in self.replicas]
        if not average_(states, w, total, self.collective,
                        write=write, bucket_cap_mb=cfg.bucket_cap_mb, check_finite=check):
            return False
        opt_states = [optimizer_state_tensors(r.optimizer) for r in self.replicas]
        if opt_states[0] and (cfg.average_optimizer_state or (~finite).any()):
            write_opt = [True] * self.n_local if cfg.average_optimizer_state else bad_local
            average_(opt_states, w, total, self.collective, write=write_opt,
                     bucket_cap_mb=cfg.bucket_cap_mb)
        return True

    def _sound(self) -> torch.Tensor:
        """``[N]`` bool: replicas whose weights and buffers are all finite (one pass over every
        replica and a gather; only when a mean turned out non-finite, or to reset replicas
        without averaging). Raises :class:`NonFiniteError` when none is."""
        health = self.collective.all_gather(self._health()).to("cpu", torch.float64).reshape(-1)
        sound = torch.isfinite(health)
        if not sound.any():
            raise NonFiniteError(
                f"at step {self.step_count} the weights of all {self.n_replicas} replicas are non-finite; "
                "nothing is left to reset them from. Lower the learning rate or its spread, or check "
                "the data for NaN/inf"
            )
        return sound

    def _sync(self, batch: Any, loss_fn: LossFn | None) -> None:
        cfg = self.config
        # a placement: score points on the run's displacement (the replicas are first averaged)
        placed = self._placement if self._placement is not None and self._controls_now() else None
        reset: list[int] = []
        if placed is not None:
            reset = self._consensus()
        # Weight health: when the replicas are averaged, a finite mean shows they are all finite
        # (checked after the merge, one pass over the mean); otherwise replica by replica now.
        eager = placed is None and not cfg.average
        scores, health, bad_steps = self._gather_scores(batch, loss_fn, placed, health=eager)
        sound = torch.isfinite(health)  # all True unless checked eagerly
        if not sound.any():
            self._sound()  # raises NonFiniteError
        if placed is None:
            # A replica with more non-finite losses than the best one, or a non-finite score, is
            # evidence against its values: the search sees it as the worst, the merge leaves it
            # out. Steps at which every replica's loss was non-finite blame no one (bad data).
            finite = sound & torch.isfinite(scores) & (bad_steps <= bad_steps.min())
        else:  # every point is a sound consensus moved along a line: each score counts as it is
            finite = torch.isfinite(scores)
        if not finite.any():  # weights fine, no comparison possible: merge the sound ones, move nothing
            log.warning("step %d: no replica has a finite score (scores %s); check the signal's data "
                        "(the training batches or the probe) for NaN/inf. The replicas are averaged "
                        "and the search sees no preference", self.step_count, scores.tolist())
            finite = sound if placed is None else finite
            scores = torch.full_like(scores, math.nan)
        bad = reset if placed is not None else (~finite).nonzero().reshape(-1).tolist()
        if bad:
            log.warning("step %d: replica(s) %s non-finite; left out and reset from the mean of the rest",
                        self.step_count, bad)
        scores = torch.where(finite, scores, math.nan)
        names = self.knobs.names
        rec = SyncRecord(
            step=self.step_count, bases={}, values={n: self._values[i].tolist() for i, n in enumerate(names)},
            scores=scores.tolist(), nonfinite=bad, spreads={k.name: k.spread for k in self.knobs},
            points=None if placed is None else placed.tolist(), searched=self._controls_now(),
            applied={k.name: [v * self._scales[i] for v in self._values[i].tolist()]  # the last step's
                     for i, k in enumerate(self.knobs)},
            wall=time.perf_counter() - self._t0,
            metrics={k: float(v) for k, v in self._metrics.items()} or None,  # read here, at the sync
        )
        self._metrics = {}
        decision = self.search.decide(self._view(self._values, scores, placed))
        if placed is None:
            if decision.land is not None:
                raise ValueError(f"the search gave land={decision.land!r} at a sync that scored no placed "
                                 "points (land picks a point on the displacement a placement scored)")
            if not self._converge(self._merge_weights(decision, finite), average=cfg.average,
                                  check=not eager):
                # a replica's weights went non-finite though its score and losses did not show it
                sound = self._sound()
                finite &= sound
                if not finite.any():
                    finite = sound
                unsound = (~sound).nonzero().reshape(-1).tolist()
                log.warning("step %d: replica(s) %s have non-finite weights; left out and reset from "
                            "the mean of the rest", self.step_count, unsound)
                rec.nonfinite = sorted(set(rec.nonfinite) | set(unsound))
                rec.scores = [math.nan if i in unsound else v for i, v in enumerate(rec.scores)]
                self._converge(self._merge_weights(decision, finite), average=cfg.average)
        else:
            self._land(decision, placed)
        self._apply(decision)
        info = decision.info
        rec.weights, rec.sigma, rec.direction = info.get("weights"), info.get("sigma"), info.get("direction")
        rec.phase = info.get("phase")
        rec.bases = {k.name: k.base for k in self.knobs}
        self._keep(rec)
        if log.isEnabledFor(logging.INFO):
            log.info("sync at step %d: %s", self.step_count,
                     ", ".join(f"{n}={b:.4g}" for n, b in rec.bases.items()))
        for callback in self._on_sync:
            callback(rec)

        self._acc.zero_()
        self._bad.zero_()
        self._acc_n = [0] * self.n_local
        self._draw()
        self._write(force=True)
        if cfg.check_consistency and self.collective.world_size > 1:
            state = torch.cat([torch.tensor([k.base for k in self.knobs], dtype=torch.float64),
                               self._slots.reshape(-1).to(torch.float64)])
            self.collective.check_same(
                state, f"knob bases and permutations after the sync at step {self.step_count}")

    def _consensus(self) -> list[int]:
        """Average the replicas whose weights are finite into every replica (before points
        are placed); the global indices of those left out."""
        if self._converge(torch.ones(self.n_replicas, dtype=torch.float64), average=True, check=True):
            return []
        sound = self._sound()
        self._converge(sound.to(torch.float64), average=True)
        return (~sound).nonzero().reshape(-1).tolist()

    @torch.no_grad()
    def _move_to(self, rho: torch.Tensor, were: torch.Tensor | None) -> None:
        """Move local replica ``i``'s parameters from ``anchor + were[g] (theta - anchor)`` (the
        consensus ``theta`` when ``were`` is None) to ``anchor + rho[g] (theta - anchor)``,
        ``g`` its global index (``rho``, ``were``: ``[N]``). Buffers stay where they are."""
        assert self._anchor is not None
        for i, rep in enumerate(self.replicas):
            g = self._first + i
            f = float(rho[g]) / (1.0 if were is None else float(were[g]))
            if f != 1.0:  # p <- anchor + f (p - anchor) = lerp(p, anchor, 1 - f)
                torch._foreach_lerp_(_params(rep.model), self._anchor, 1.0 - f)

    def _land(self, decision: Decision, placed: torch.Tensor) -> None:
        """After a placed sync: every replica to ``anchor + land (theta - anchor)``, identical."""
        if decision.merge is not None:
            raise ValueError("the search gave merge weights at a sync that scored placed points: give "
                             "land=, the multiplier of the displacement the consensus moves to")
        land = 1.0 if decision.land is None else decision.land
        if not (isinstance(land, (int, float)) and not isinstance(land, bool) and 0 < land < math.inf):
            raise ValueError(f"the search's land must be a finite number > 0 (got {land!r})")
        n = self.n_replicas
        self._move_to(torch.full((n,), float(land), dtype=torch.float64), placed[-n:])
        if n > 1:  # one lerp per replica from its own point: average so that they agree to the bit
            self._converge(torch.ones(n, dtype=torch.float64), average=True)

    def _keep(self, rec: SyncRecord) -> None:
        """Append ``rec`` to the history (the newest ``history_limit`` stay in memory) and to
        the history file."""
        self.history.append(rec)
        limit = self.config.history_limit
        if limit is not None and len(self.history) > limit:
            del self.history[: len(self.history) - limit]
        path = self.config.history_file
        if path is not None and self._writes_files:
            from hpx.history import _record_line

            with open(path, "a") as f:
                f.write(_record_line(rec) + "\n")

    def _controls_now(self, ahead: int = 0) -> bool:
        """Whether the search reads the scores at a sync ``ahead`` steps from now (the signal
        is only asked for scores then)."""
        return self.search.acts_at(self.step_count + ahead) and any(k.explore for k in self.knobs)

    def _view(self, values: torch.Tensor, scores: torch.Tensor,
              placed: torch.Tensor | None = None) -> SyncView:
        knobs = list(self.knobs)
        f64 = torch.float64
        return SyncView(
            step=self.step_count, n_replicas=self.n_replicas, names=tuple(self.knobs.names),
            kinds=tuple(k.kind for k in knobs),
            explore=torch.tensor([k.explore for k in knobs], dtype=torch.bool),
            spacing=tuple(k.spacing for k in knobs),
            spreads=torch.tensor([k.spread for k in knobs], dtype=f64),
            bases=torch.tensor([k.base for k in knobs], dtype=f64),
            bounds=torch.tensor([[k.low, k.high] for k in knobs], dtype=f64).reshape(len(knobs), 2),
            values=values, scores=scores, placement=placed,
        )

    def _merge_weights(self, decision: Decision, finite: torch.Tensor) -> torch.Tensor:
        """``[N]`` float64 weights of the consensus: the strategy's, never on a non-finite replica."""
        w = finite.to(torch.float64)
        if decision.merge is not None:
            m = torch.as_tensor(decision.merge, dtype=torch.float64).reshape(-1)
            if m.numel() != self.n_replicas or not torch.isfinite(m).all() or (m < 0).any():
                raise ValueError(f"the search's merge weights must be {self.n_replicas} finite numbers "
                                 f">= 0 (got {m.tolist()})")
            w = torch.where(finite, m, 0.0)
            if not (w > 0).any():  # the strategy kept only non-finite replicas: fall back to the rest
                w = finite.to(torch.float64)
        return w

    def _apply(self, decision: Decision, starting: bool = False) -> None:
        """Write a decision's bases, spreads, placement and next sync into the knobs and the
        schedule."""
        knobs = list(self.knobs)
        placement = decision.placement
        if placement is not None:
            rho = torch.as_tensor(placement, dtype=torch.float64).reshape(-1)
            n = self.n_replicas
            if (rho.numel() < n or rho.numel() % n or not torch.isfinite(rho).all()
                    or (rho <= 0).any()):
                raise ValueError(f"the search's placement must be finite numbers > 0, as many as the "
                                 f"{n} replicas or a multiple (got {rho.tolist()})")
            if not starting and self._anchor is None:
                raise ValueError("the search asked for a placement, but its start decision (or a later "
                                 "one) did not: the engine no longer holds the run's starting parameters")
            placement = rho
        elif not starting:
            self._anchor = None  # no strategy asks again: free the copy
        if decision.bases is not None:
            for k, b in zip(knobs, torch.as_tensor(decision.bases, dtype=torch.float64).tolist()):
                if k.explore:
                    k.base = k.clamp(b)
        if decision.spreads is not None or decision.spacing is not None:
            spreads = ([k.spread for k in knobs] if decision.spreads is None
                       else torch.as_tensor(decision.spreads, dtype=torch.float64).tolist())
            spacing = decision.spacing or tuple(k.spacing for k in knobs)
            for k, a, sp in zip(knobs, spreads, spacing):
                if k.explore:
                    k.set_spread(a, sp)
        nxt = decision.next_sync if decision.next_sync is not None else self.config.sync_every
        if not (isinstance(nxt, int) and not isinstance(nxt, bool) and nxt >= 1):
            raise ValueError(f"the search's next_sync must be an integer >= 1 (got {nxt!r})")
        self._next_sync = self.step_count + nxt
        self._placement = placement

    def converge(self) -> torch.nn.Module:
        """Average every replica's weights now, leaving out non-finite ones, and
        return local replica 0's model (the consensus). Use it at the end of
        training; under torch.distributed every rank must call it."""
        if not self._converge(torch.ones(self.n_replicas, dtype=torch.float64), average=True, check=True):
            self._converge(self._sound().to(torch.float64), average=True)  # leave the non-finite out
        return self.replicas[0].model

    def _optimizer_state(self, r: Replica) -> dict[str, Any]:
        """The replica's ``optimizer.state_dict()``, with the shared state when there is one
        (checkpoints look the same either way)."""
        return r.optimizer.state_dict() if self._state is None else self._state.replica_state(r.optimizer)

    def _health(self) -> torch.Tensor:
        """``[L]``: finite iff the local replica's weights and buffers all are."""
        return torch.stack([_weights_norm(r.model, self._constants) for r in self.replicas]).to(self._acc)

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

    # --- checkpoints ----------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue the same trajectory: the local replicas'
        models and optimizers, knobs, permutation stream, controller, step count,
        loss accumulators and history."""
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
            "replicas": [{"model": r.model.state_dict(), "optimizer": self._optimizer_state(r)}
                         for r in self.replicas],
        }

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
        ConfigError.check(self._load_problems(state))
        for r, s in zip(self.replicas, state.get("replicas", ())):  # absent: hpx state only
            r.model.load_state_dict(s["model"])
            r.optimizer.load_state_dict(_own_state(s["optimizer"]))
        if self._state is not None and state.get("replicas"):
            self._state.engaged = False  # the next step takes the loaded state over
        self.knobs.load_state_dict(state["knobs"])
        if state.get("signal") is not None and callable(getattr(self.signal, "load_state_dict", None)):
            self.signal.load_state_dict(state["signal"])
        if "search" in state:
            self.search.load_state_dict(state["search"])
        else:  # format 1: the controller's state alone
            self.search.load_state_dict({"controller": state["controller"]})
        self.step_count = int(state["step"])
        T = self.config.sync_every
        self._next_sync = int(state.get("next_sync", (self.step_count // T + 1) * T))
        self._acc.copy_(state["acc"].to(self._acc))
        self._bad.copy_(state["bad"].to(self._bad) if "bad" in state else torch.zeros_like(self._bad))
        self._acc_n = list(state["acc_n"])
        self.history = [SyncRecord(**r) for r in state["history"]]
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

    def _load_anchor(self, state: dict[str, Any]) -> None:
        """The placement and the run's starting parameters, as saved (absent: none)."""
        placement, anchor = state.get("placement"), state.get("anchor")
        self._placement = None if placement is None else torch.as_tensor(placement, dtype=torch.float64)
        self._anchor = None if anchor is None else [
            a.to(p.device, p.dtype).clone() for a, p in zip(anchor, _params(self.replicas[0].model))]

    def _check_agreement(self, *, settle: bool) -> None:
        """Raise :class:`ConsistencyError` on every rank if the ranks were built or resumed
        differently (settings, knobs, search, signal, model, or, once ``settle``, the step and
        next sync). One gather, at construction and at the first step after a load: ranks that
        disagree would otherwise pair their collectives across different steps and hang."""
        self._agreement_due = False
        names, values, exact = [], [], []
        base = self.replicas[0].model
        base = base.module if isinstance(base, torch.nn.parallel.DistributedDataParallel) else base
        items: list[tuple[str, Any]] = [("replicas per process", self.n_local)]
        if settle:
            items += [("step", self.step_count), ("next sync step", self._next_sync)]
        items += [(k, getattr(self.config, k)) for k in _TRAJECTORY]
        items += [("knobs", [(k.name, type(k).__name__, k.kind) for k in self.knobs]),
                  ("search", repr(self.search)),
                  ("signal", type(self.signal).__name__),
                  ("model parameters",
                   [(n, tuple(p.shape), str(p.dtype)) for n, p in base.named_parameters()])]
        for name, v in items:
            direct = isinstance(v, int) and not isinstance(v, bool)
            names.append(name)
            exact.append(direct)
            values.append(v if direct else zlib.crc32(repr(v).encode()))
        dev = self._acc.device if hasattr(self, "_acc") else next(
            (p.device for p in base.parameters()), torch.device("cpu"))
        rows = self.collective.all_gather(torch.tensor(values, dtype=torch.int64, device=dev)).cpu()
        problems = []
        for j, name in enumerate(names):
            col = rows[:, j].tolist()
            odd = [r for r, v in enumerate(col) if v != col[0]]
            if not odd:
                continue
            if exact[j]:
                have = ", ".join(f"rank {r} has {col[r]}" for r in [0, *odd])
                problems.append(f"{name}: {have}")
            else:
                problems.append(f"{name}: rank(s) {odd} differ from rank 0 (this rank's: "
                                f"{_short(dict(items)[name])})")
        if problems:
            when = "resuming" if settle else "building the engine"
            raise ConsistencyError(
                f"the ranks disagree when {when}, so their collectives would pair up across different "
                f"steps: {'; '.join(problems)}. Build every rank with the same settings, knobs and "
                "model, and load every rank from the same checkpoint step (hpx.load_checkpoint agrees "
                "on one)")

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
        keys = list(self.replicas[0].model.state_dict())
        states = [_unwrapped(st, keys) for st in states]  # saved under DDP, loaded into a bare model
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
        ConfigError.check(problems)
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
        # The saved placement was for the saved replica count: the next sync scores the (identical)
        # replicas where they are, and the strategy's next decision places the new count.
        self._load_anchor({**first, "placement": None})
        self._draw()  # permutations for this many replicas, from the restored stream
        self._written = [[None] * self.n_local for _ in self.knobs]
        self._bad_factor = None
        self._fresh, self._reduced, self._one_step = True, False, False
        self._write(force=True)
        self._agreement_due = self.collective.world_size > 1

    def _settings(self) -> dict[str, Any]:
        """The settings a checkpoint records and a resumed engine must share."""
        return {"replicas": self.n_replicas, **{k: getattr(self.config, k) for k in _TRAJECTORY},
                "search": type(self.search).__name__,
                "knobs": [[k.name, type(k).__name__, k.kind] for k in self.knobs]}

    def _load_problems(self, state: Any, elastic: bool = False) -> list[str]:
        """Every reason to refuse ``state``, found without changing anything (``elastic``: the
        replica count and layout may differ)."""
        if not isinstance(state, dict):
            return [f"a checkpoint is the dict Engine.state_dict() returns (got {type(state).__name__})"]
        problems = []
        if state.get("format") not in (1, 2):
            problems.append(f"unknown checkpoint format {state.get('format')!r} (expected 1 or 2)")
            return problems
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
            problems += _optimizer_problems(f"{who}'s optimizer", r.optimizer.state_dict(),
                                            s.get("optimizer", {}))
        return problems

    def __repr__(self) -> str:
        return (f"Engine(replicas={self.n_replicas} ({self.n_local} local), step={self.step_count}, "
                f"{self.knobs!r}, search={self.search!r}, signal={self.signal!r}, "
                f"backend={self.collective!r})")


class _ForeachMean:
    """The shared-gradient mean of local replicas in one CPU process, on autograd's own
    gradients: no flat buffer to zero and accumulate into every step (that memset and the
    read-modify-write cost about 10% of a step at 2.4M parameters)."""

    def __init__(self, replicas: Sequence[Replica]) -> None:
        self.params = [[p for p in r.model.parameters() if p.requires_grad] for r in replicas]
        self._mean: list[torch.Tensor] | None = None  # reused from step to step

    def zero_(self) -> None:
        for ps in self.params:
            for p in ps:
                p.grad = None

    def adopt_(self) -> None:  # gradients are wherever autograd (or the user) put them
        return None

    @torch.no_grad()
    def average_(self, losses: torch.Tensor, collective: Collective) -> None:
        ok = [math.isfinite(v) for v in losses.tolist()]  # host tensors: reading them is free
        if not any(ok):
            for ps in self.params:  # no replica to take a gradient from: a zero step, as DDP's mask
                for p in ps:
                    p.grad = torch.zeros_like(p)
            return
        n = len(self.params[0])
        grads = [[p.grad if p.grad is not None else torch.zeros_like(p) for p in ps] for ps in self.params]
        good = [g for g, f in zip(grads, ok) if f]
        if self._mean is None or any(m.shape != g.shape or m.dtype != g.dtype
                                     for m, g in zip(self._mean, good[0])) or len(self._mean) != n:
            self._mean = [torch.empty_like(g) for g in good[0]]
        mean = self._mean
        torch._foreach_copy_(mean, good[0])
        for g in good[1:]:
            torch._foreach_add_(mean, g)
        if len(good) > 1:
            torch._foreach_mul_(mean, 1.0 / len(good))
        for ps, gs in zip(self.params, grads):
            for p, g in zip(ps, gs):
                if p.grad is None:
                    p.grad = g
            torch._foreach_copy_([p.grad for p in ps], mean)


class _OneGradient:
    """One gradient for all local replicas, when they share one optimizer state (which reads
    the mean once) and the engine runs their backward.

    Flat buffers per (device, dtype), kept from step to step (allocating a gradient each step
    page-faults it in anew: measured slower). On the CPU (``host``), where reading a loss
    is free, every replica's ``.grad`` is a view of the one gradient, each backward adds into
    it, and a replica whose loss is not finite skips its backward. Elsewhere nothing is read
    back: every backward writes into one scratch gradient, which is added into the one
    gradient unless the loss was non-finite (decided on the device), then zeroed. Either
    way no replica's own gradient is stored. The mean is over the (replica, micro-batch)
    pairs that ran, scaled as if all had: with one micro-batch per step, the mean over the
    replicas whose loss was finite, as the per-replica paths give.
    """

    def __init__(self, replicas: Sequence[Replica], host: bool) -> None:
        self.params = [[p for p in r.model.parameters() if p.requires_grad] for r in replicas]
        self.host = host
        first = self.params[0]
        groups: dict[tuple, list[int]] = {}
        for i, p in enumerate(first):
            groups.setdefault((p.device, p.dtype), []).append(i)
        self._buffers: list[tuple[torch.Tensor, torch.Tensor | None]] = []  # (one, scratch) per group
        self.one: list[torch.Tensor] = [torch.empty(0)] * len(first)  # per parameter: its view
        self._into: list[torch.Tensor] = [torch.empty(0)] * len(first)  # where backward writes
        for (device, dtype), idx in groups.items():
            sizes = [first[i].numel() for i in idx]
            one = torch.zeros(sum(sizes), device=device, dtype=dtype)
            scratch = None if host else torch.zeros_like(one)
            for i, chunk in zip(idx, one.split(sizes)):
                self.one[i] = chunk.view(first[i].shape)
            for i, chunk in zip(idx, (scratch if scratch is not None else one).split(sizes)):
                self._into[i] = chunk.view(first[i].shape)
            self._buffers.append((one, scratch))
        self._pairs = 0  # losses seen this step (host count)
        self._ran: int | torch.Tensor = 0  # ... of which finite (host int, or a device tensor)

    def zero_(self) -> None:
        for one, scratch in self._buffers:
            one.zero_()
            if scratch is not None:
                scratch.zero_()
        for ps in self.params:
            for p, t in zip(ps, self._into):
                p.grad = t
        self._pairs = 0
        self._ran = 0 if self.host else torch.zeros((), device=self._buffers[0][0].device)

    def admit(self, loss: torch.Tensor) -> bool:
        """Whether this replica's backward runs (on the host: only if its loss is finite)."""
        self._pairs += 1
        if not self.host:
            return True
        ok = math.isfinite(float(loss.detach()))  # a host tensor: reading it is free
        self._ran += ok
        return ok

    @torch.no_grad()
    def ran(self, loss: torch.Tensor) -> None:
        """After a replica's backward (off the host): its gradient into the one, if its loss is finite."""
        if self.host:
            return
        ok = torch.isfinite(loss.detach()).reshape(())
        self._ran = self._ran + ok.to(self._buffers[0][0].device)
        for one, scratch in self._buffers:
            assert scratch is not None
            scratch.masked_fill_(~ok.to(scratch.device), 0)  # never multiplied: 0 * NaN is NaN
            one.add_(scratch)
            scratch.zero_()

    def intact(self) -> bool:
        """Whether every replica's gradient is still where backward was to write it."""
        return all(p.grad is t for ps in self.params for p, t in zip(ps, self._into))

    @torch.no_grad()
    def average_(self, collective: Collective, alias: bool) -> None:
        """The one gradient <- the mean of the passes that ran, over every rank; every
        replica's ``.grad`` is then the one (``alias``) or a copy of it."""
        ones = [one for one, _ in self._buffers]
        n = len(self.params) * collective.world_size
        if collective.world_size > 1:
            ran = torch.as_tensor(self._ran, dtype=torch.float64, device=ones[0].device).reshape(1)
            collective.all_reduce_sum_([*ones, ran])
            pairs = self._pairs * collective.world_size
            factor = (pairs / n) / ran.clamp_min(1)  # on the device: no host read
            for one in ones:
                one.mul_(factor.to(one.dtype))
        elif isinstance(self._ran, int):  # one process, counted on the host
            if self._ran and self._ran != self._pairs:  # some left out: as if all had run
                for one in ones:
                    one.mul_((self._pairs / n) / self._ran)
            elif n > 1:
                for one in ones:
                    one.mul_(1.0 / n)
        else:
            factor = (self._pairs / n) / self._ran.clamp_min(1)
            for one in ones:
                one.mul_(factor.to(one.dtype))
        for l, ps in enumerate(self.params):
            for p, o in zip(ps, self.one):
                p.grad = o if alias or l == 0 else o.clone()  # a loop of its own: each its own copy


class _GradBuckets:
    """Local replicas' gradients as views of one ``[L, P]`` flat buffer per (device, dtype).

    Autograd accumulates into an existing ``.grad`` in place, so after backward the
    buffer holds every replica's gradient and the shared-gradient mean is one
    masked reduction per bucket, with no per-tensor copies. Built at first use (an engine whose
    replicas keep one gradient uses it only for a loop that runs its own backward).
    """

    def __init__(self, replicas: Sequence[Replica]) -> None:
        self._replicas = list(replicas)
        self.buffers: list[torch.Tensor] = []
        self._views: list[tuple[torch.Tensor, torch.Tensor]] = []  # (param, its grad view)

    def _build(self) -> None:
        replicas = self._replicas
        params = [[p for p in r.model.parameters() if p.requires_grad] for r in replicas]
        groups: dict[tuple, list[int]] = {}
        for i, p in enumerate(params[0]):
            groups.setdefault((p.device, p.dtype), []).append(i)
        for (device, dtype), idx in groups.items():
            sizes = [params[0][i].numel() for i in idx]
            buf = torch.zeros(len(replicas), sum(sizes), device=device, dtype=dtype)
            self.buffers.append(buf)
            for l, ps in enumerate(params):
                for i, chunk in zip(idx, buf[l].split(sizes)):
                    self._views.append((ps[i], chunk.view(ps[i].shape)))  # .grad set by zero_/adopt_

    def adopt_(self) -> None:
        """Bring gradients that a loop of its own left outside the buffer back into it."""
        if not self.buffers:
            self._build()
        for p, v in self._views:
            if p.grad is not v:
                if p.grad is None:
                    v.zero_()
                else:
                    v.copy_(p.grad)
                p.grad = v

    def zero_(self) -> None:
        if not self.buffers:
            self._build()
        for buf in self.buffers:
            buf.zero_()
        for p, v in self._views:
            p.grad = v  # a new step starts from zero, in the buffer

    def average_(self, losses: torch.Tensor, collective: Collective) -> None:
        """Every replica's gradient <- mean over replicas with finite loss (on all ranks).

        Relies on :meth:`zero_` having put the views back before backward.
        """
        if collective.world_size == 1 and losses.device.type == "cpu" and math.isfinite(float(losses.sum())):
            # One process with losses on the host (reading them waits for no device) and all
            # finite: the plain mean, two ops per bucket instead of the masked reduction.
            for buf in self.buffers:
                buf.copy_(buf.mean(0, keepdim=True))
            return
        ok = torch.isfinite(losses)
        sums = []
        for buf in self.buffers:
            buf.masked_fill_(~ok.to(buf.device)[:, None], 0)
            sums.append(buf.sum(0))
        count = ok.sum().to(torch.float64).reshape(1)
        if collective.world_size > 1:
            collective.all_reduce_sum_([*sums, count])
        for buf, s in zip(self.buffers, sums):
            s.div_(count.to(s).clamp_min(1))
            buf.copy_(s.expand_as(buf))


# EngineConfig fields that change what a run computes: a resumed engine must share them
_TRAJECTORY = ("sync_every", "mode", "average", "average_optimizer_state", "controller", "warmup",
               "meta_lr", "momentum", "debias_momentum", "temperature", "temperature_scale", "space",
               "decay")


def _short(v: Any, n: int = 120) -> str:
    text = repr(v)
    return text if len(text) <= n else text[: n - 3] + "..."


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


def _optimizer_problems(what: str, current: dict[str, Any], saved: Any) -> list[str]:
    if not isinstance(saved, dict) or "param_groups" not in saved:
        return [f"{what}: the checkpoint holds no optimizer state dict"]
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


def _writes_optimizer(knob: Knob) -> bool:
    """Whether the knob writes an optimizer parameter-group setting (its ``key``, or lr)."""
    return isinstance(knob, (GroupKnob, LearningRateScale))


def _split(batch: Any, n: int) -> list[Any]:
    """``batch`` cut into ``n`` parts along the first dimension of every tensor in it."""
    if n == 1:
        return [batch]
    ConfigError.check(_split_problems(batch, n))
    return _cut(batch, n)


def _split_problems(batch: Any, n: int) -> list[str]:
    leaves = list(_leaves(batch, "batch"))
    if not leaves:
        return []
    flat = [(where, t) for where, t in leaves if t.dim() == 0]
    if flat:
        samples = isinstance(batch, list) and batch and all(isinstance(b, (tuple, list, dict)) for b in batch)
        if samples:
            return [f"batch is a list of {len(batch)} separate examples, not a collated batch: stack them "
                    "first (torch.utils.data.default_collate(batch), or a DataLoader), so that every "
                    "tensor has one row per example"]
        return [f"{flat[0][0]} is a 0-dim tensor: hpx splits every tensor of the batch among the {n} "
                "replicas along its first dimension; give tensors with one row per example (or pass "
                "batches=[...], one per replica)"]
    sizes = {where: t.shape[0] for where, t in leaves}
    if len(set(sizes.values())) > 1:
        shown = ", ".join(f"{w}: {k}" for w, k in list(sizes.items())[:4])
        return [f"the batch's tensors have different lengths along their first dimension ({shown}): hpx "
                f"splits each of them among the {n} replicas, so they must hold the same examples"]
    size = next(iter(sizes.values()))
    if size < n:
        return [f"a batch of size {size} cannot be split among {n} replicas: give at least one example "
                "per replica"]
    return []


def _cut(batch: Any, n: int) -> list[Any]:
    if torch.is_tensor(batch):
        return list(torch.tensor_split(batch, n))
    if isinstance(batch, (list, tuple)):
        cols = [_cut(b, n) for b in batch]
        return [type(batch)(c[i] for c in cols) if not hasattr(batch, "_fields")
                else type(batch)(*(c[i] for c in cols)) for i in range(n)]
    if isinstance(batch, dict):
        cols = {k: _cut(v, n) for k, v in batch.items()}
        return [{k: v[i] for k, v in cols.items()} for i in range(n)]
    return [batch] * n


def _weights_norm(model: torch.nn.Module, constants: Collection[str] = ()) -> torch.Tensor:
    """A scalar that is finite iff every floating weight and buffer is, the ``constants``
    aside (stays on device)."""
    ts = [t.detach() for t in float_state(model, constants)]
    if not ts:
        return torch.zeros(())
    return torch.stack([n.float() for n in torch._foreach_norm(ts)]).sum()


def _whole(t: torch.Tensor) -> torch.Tensor:
    """A sharded model's gradient norm (a replicated DTensor) as a plain tensor; else ``t``."""
    return t.full_tensor() if type(t).__name__ == "DTensor" else t


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
