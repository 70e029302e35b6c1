"""hpx inside PyTorch Lightning: ``ForksCallback`` (:class:`hpx.Forks`, the recommended search),
and ``AutoLR`` (the one-run search, :func:`hpx.autolr`), the alternative.

::

    from hpx.integrations.lightning import ForksCallback

    def probe_loss(module, batch):                   # at a module's top level (see ddp_spawn below)
        return module.loss(batch)

    trainer = L.Trainer(max_steps=2000, callbacks=[ForksCallback(probe_loss, probe=val_batches)])
    trainer.fit(module, train_loader)                # module holds the winner afterwards

:class:`ForksCallback`: Lightning trains your run; hpx trains forks of it at other multiples of
the learning rate beside it and keeps yours unless one is better on the probe with confidence
(see its docstring). The rest of this docstring is about :class:`AutoLR`.

Each process Lightning runs (``devices=N``) is one replica; the callback builds an
:class:`~hpx.Engine` around Lightning's own DDP-wrapped model and optimizer when fitting starts,
reads each training step's loss, lets the search move the learning rate at its syncs, logs the
knob's base (``hpx/lr_base``) and the learning rate the last step used (``hpx/lr``, parameter group 0)
through the trainer's loggers and into ``trainer.callback_metrics``, and saves its state in
Lightning's checkpoints. The learning-rate schedule the module configures (one scheduler, stepped
every step) is taken over: hpx follows its shape and scales it, and Lightning no longer steps it.

Checkpoints: every process's hpx state goes into the one file Lightning writes (gathered from
every rank when it saves), and ``trainer.fit(..., ckpt_path=...)`` gives each process its own back,
so a run of N processes resumes with N processes (``devices=N``) and continues as if it had not
stopped. Resuming with another number of processes is refused (a :class:`~hpx.ConfigError` naming
the saved count). Lightning resumes its data exactly from a checkpoint saved after an optimizer
step (``ModelCheckpoint(every_n_train_steps=...)``, ``trainer.save_checkpoint``); from one saved in
``on_train_epoch_end`` it replays a batch, and so does the resumed run.

``strategy="ddp_spawn"`` works, with two consequences of Lightning pickling the callback into each
process it starts: ``loss_fn`` (and ``probe``) must be picklable (a function defined at a module's
top level, not a lambda: a lambda is refused with a :class:`~hpx.ConfigError` saying so), and the
callback in the calling process never trains (its :attr:`AutoLR.engine` stays ``None``): there,
read ``trainer.callback_metrics["hpx/lr_base"]`` (the last sync's base, handed back by Lightning),
the loggers, or ``history_file=``. ``strategy="ddp"`` has neither restriction.

In one process (``devices=1``, one GPU or a laptop's CPU) the one model is the only replica and
scores the search's points in turn at each sync: the search is the same as with several
processes, at the same cost (4 forward passes over the probe per sync).
"""

from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

try:
    import lightning.pytorch as pl
except ImportError as e:  # pragma: no cover - exercised only without lightning installed
    raise ImportError("hpx.integrations.lightning needs PyTorch Lightning: pip install lightning") from e

from hpx.errors import ConfigError
from hpx.integrations import (
    _FORKS_SETTINGS,
    _callback_problems,
    _fork_metrics,
    _forks_reached,
    _forks_settings,
    _forks_state,
    _load_forks_state,
    _lr,
)
from hpx.sync_record import SyncRecord

__all__ = ["AutoLR", "ForksCallback"]


class AutoLR(pl.Callback):
    """Find the learning rate while Lightning trains (:func:`hpx.autolr`, the one-run search).

    Args:
        loss_fn: ``loss_fn(module, batch) -> loss``: how a replica is scored on a held-out batch
            (the plain objective, without regularisers). ``module`` is your LightningModule.
        probe: held-out batches to score replicas on (a few batches of a validation split;
            every process must see the same ones).
        total_steps: the run's length in optimizer steps (default: the trainer's
            ``estimated_stepping_batches``).
        **settings: other :func:`hpx.autolr` settings (``span``, ``seed``, ``history_file``, ...).

    The engine is :attr:`engine` once fitting has started (in the process that fits: under
    ``strategy="ddp_spawn"`` the started processes, not the caller's).
    """

    def __init__(self, loss_fn: Callable[[pl.LightningModule, Any], torch.Tensor], *,
                 probe: Iterable[Any], total_steps: int | None = None,
                 **settings: Any) -> None:
        reserved = ("backend", "replicas", "schedule", "loss_fn", "on_sync")
        problems = _callback_problems(loss_fn, probe, settings, reserved, "module")
        if total_steps is not None and (not isinstance(total_steps, int) or isinstance(total_steps, bool)
                                        or total_steps < 1):
            problems.append(f"total_steps must be an integer >= 1, or None for the trainer's estimate "
                            f"(got {total_steps!r})")
        ConfigError.check(problems)
        self.loss_fn, self.probe, self.total_steps, self.settings = loss_fn, probe, total_steps, settings
        self.engine: Any = None
        self._pending: dict[str, Any] | None = None  # hpx state from a checkpoint, until fit starts
        self._module: pl.LightningModule | None = None
        self._trainer: pl.Trainer | None = None
        self._last_step = 0

    # --- Lightning hooks ---------------------------------------------------------------

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        import hpx

        if not pl_module.automatic_optimization:
            raise ConfigError(["AutoLR drives Lightning's automatic optimization; with manual "
                               "optimization build hpx.autolr yourself and call engine.step"])
        if len(trainer.optimizers) != 1:
            raise ConfigError([f"AutoLR needs exactly one optimizer (the module configures "
                               f"{len(trainer.optimizers)})"])
        configs = trainer.strategy.lr_scheduler_configs
        if len(configs) > 1 or (configs and (configs[0].interval != "step" or configs[0].frequency != 1)):
            raise ConfigError(["AutoLR takes over one scheduler stepped every step ('interval': "
                               "'step', frequency 1); the module configures "
                               f"{[(type(c.scheduler).__name__, c.interval, c.frequency) for c in configs]}"])
        schedule = configs[0].scheduler if configs else None
        backend = None
        world = trainer.world_size
        if world > 1:
            from hpx.backends import TorchDistributed

            backend = TorchDistributed()
        total = self.total_steps if self.total_steps is not None else trainer.estimated_stepping_batches
        if not math.isfinite(float(total)):
            raise ConfigError(["the fit's length is unknown (max_epochs=-1, or an infinite DataLoader): "
                               "AutoLR plans its search over the run; give max_steps (or total_steps=...)"])
        total = int(total)
        self._module, self._trainer = pl_module, trainer
        model = trainer.strategy.model if world > 1 else pl_module
        self.engine = hpx.autolr(model, trainer.optimizers[0], total_steps=total, schedule=schedule,
                                 probe=self.probe, loss_fn=self._score, replicas=1, backend=backend,
                                 on_sync=self._log, **self.settings)
        if configs:
            trainer.strategy.lr_scheduler_configs = []  # hpx writes the schedule's lrs from now on
        if self._pending is not None:
            self._load_pending()
        self._last_step = trainer.global_step

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any,
                           batch: Any, batch_idx: int) -> None:
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if isinstance(loss, torch.Tensor):
            self.engine.record(loss.detach())
        if trainer.global_step > self._last_step:  # the optimizer stepped (not accumulating)
            self._last_step = trainer.global_step
            self.engine.advance(batch=batch)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """In a process Lightning spawned (``ddp_spawn``), let the engine go when the fit ends: the
        process exits next and its engine is never seen again (the parent's is ``None``), and
        gloo's teardown at exit can abort while the engine's collectives are still referenced."""
        import gc
        import multiprocessing

        if stage == "fit" and trainer.world_size > 1 and multiprocessing.parent_process() is not None:
            self.engine = None
            gc.collect()

    def state_dict(self) -> dict[str, Any]:
        """hpx's state of every process, for Lightning's checkpoint (which rank 0 writes alone).

        Under several processes every rank calls this when Lightning saves (``trainer.save_checkpoint``
        and ``ModelCheckpoint`` run on every rank): each rank's state is gathered, so the one file
        holds them all, and :meth:`load_state_dict` gives each rank its own. The model and the
        optimizer are Lightning's to save; the run's starting parameters (the search's anchor,
        equal on every rank) are kept once.
        """
        if self.engine is None:
            return {}
        state = self.engine.state_dict()
        del state["replicas"]  # the model and the optimizer are in Lightning's checkpoint
        anchor = state.pop("anchor")
        c = self.engine.collective
        ranks = [state] if c.world_size == 1 else [
            c.broadcast_object(state if c.rank == r else None, src=r) for r in range(c.world_size)]
        return {"ranks": ranks, "anchor": anchor}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._pending = state_dict or None
        if self.engine is not None and self._pending is not None:  # a strategy restoring after setup
            self._load_pending()

    def __getstate__(self) -> dict[str, Any]:
        """What ``strategy="ddp_spawn"`` pickles into each process: refused, with the fix, when
        ``loss_fn`` or ``probe`` cannot be pickled (a lambda, a local function)."""
        return _picklable(self, "AutoLR")

    # --- helpers ---------------------------------------------------------------------------

    def _load_pending(self) -> None:
        """Load this rank's hpx state from the checkpoint Lightning restored."""
        saved, self._pending = self._pending, None
        assert saved is not None
        c = self.engine.collective
        if "ranks" not in saved:  # saved before every rank's state was kept: rank 0's alone
            if c.world_size > 1:
                raise ConfigError([f"the checkpoint holds the hpx state of rank 0 alone (saved by an older "
                                   f"hpx), and this fit runs {c.world_size} processes: resume it with "
                                   "devices=1, or restart the search"])
            self.engine.load_state_dict(saved["engine"])
            return
        ranks = saved["ranks"]
        if len(ranks) != c.world_size:
            raise ConfigError([f"the checkpoint holds the hpx state of {len(ranks)} process(es) and this "
                               f"fit runs {c.world_size}: resume with devices={len(ranks)} (and the same "
                               "number of nodes)"])
        self.engine.load_state_dict({**ranks[c.rank], "anchor": saved["anchor"]})

    def _score(self, replica: Any, batch: Any) -> torch.Tensor:
        assert self._module is not None  # one replica per process: this process's module
        return self.loss_fn(self._module, batch)

    def _log(self, record: SyncRecord) -> None:
        trainer = self._trainer
        if trainer is None:
            return
        metrics = {f"hpx/{name}_base": float(base) for name, base in record.bases.items()}
        metrics["hpx/lr"] = _lr(trainer.optimizers[0])  # what the last step before the sync used
        # callback_metrics: what ddp_spawn hands back to the parent process (and what callbacks such
        # as ModelCheckpoint and EarlyStopping can monitor)
        trainer.callback_metrics.update({k: torch.tensor(v) for k, v in metrics.items()})
        for lg in trainer.loggers:
            lg.log_metrics(metrics, step=trainer.global_step)


class ForksCallback(pl.Callback):
    """:class:`hpx.Forks`, the recommended learning-rate search, while Lightning trains your module
    (automatic optimization): Lightning trains your run exactly as it would without the callback,
    and hpx trains the other forks (copies of the module at other multiples of the learning rate,
    with copies of its optimizer and schedule) on the same batches beside it, cuts them, and at
    the end of the run keeps yours unless a challenger is better on the probe with confidence; the
    winner is then loaded into your module, optimizer and scheduler.

    Args:
        loss_fn: ``loss_fn(module, batch) -> loss`` on a probe batch (the loss of every example, or
            one number; the plain objective, without regularisers).
        probe: held-out batches the forks are scored on (every process must hold the same ones).
        **settings: other :class:`hpx.Forks` settings (``multiples``, ``cuts``, ``cool``,
            ``confidence``, ``knobs``, ``knob_start``, ``knob_design``, ``on_sync``, ``share``).

    Each fork takes its step through your module's own ``training_step`` (on a copy of the
    module, under the same precision context), with Lightning's gradient accumulation and its
    ``gradient_clip_val`` (norm) clipping, and draws the random numbers your run drew at that step
    (its dropout masks). A copy has no trainer: what its ``training_step`` logs with ``self.log`` is
    dropped (your run's is logged as always), and it must not read ``self.trainer``. Under DDP
    (``strategy="ddp"`` or ``"ddp_spawn"``) each fork's gradients are averaged over the processes
    by hpx. Each decision is logged through the trainer's loggers and into
    ``trainer.callback_metrics`` (``hpx/lr_multiple``: the multiple your run trains at after it;
    ``hpx/probe_loss/<fork>``; ``hpx/gain`` and ``hpx/bar`` at the end). hpx's state is saved in Lightning's
    checkpoints, without a second copy of your module (Lightning saves it), so
    ``trainer.fit(..., ckpt_path=...)`` continues the search; Lightning writes rank 0's state,
    which every process resumes from (the forks' buffers, such as BatchNorm's statistics,
    included). The module's scheduler must be stepped every optimizer step (``"interval":
    "step"``); 16-bit precision with a gradient scaler (``precision="16-mixed"``), FSDP and
    DeepSpeed are refused; ``"bf16-mixed"`` works.
    :attr:`forks` is the :class:`hpx.Forks` once training has begun.
    """

    def __init__(self, loss_fn: Callable[[pl.LightningModule, Any], torch.Tensor], *,
                 probe: Iterable[Any], **settings: Any) -> None:
        problems = []
        if probe is None or not isinstance(probe, Iterable):
            problems.append(f"probe must be held-out batches (a list of a few validation batches; "
                            f"got {type(probe).__name__})")
        if not callable(loss_fn):
            problems.append(f"loss_fn must be a function (module, batch) -> loss (got "
                            f"{type(loss_fn).__name__})")
        problems += [f"unknown setting {key!r}: ForksCallback takes {', '.join(_FORKS_SETTINGS)} (the "
                     "model, optimizer, schedule, total_steps and backend come from the trainer)"
                     for key in settings if key not in _FORKS_SETTINGS]
        ConfigError.check(problems)
        self.loss_fn, self.probe, self.settings = loss_fn, probe, settings
        self.forks: Any = None
        self._pending: dict[str, Any] | None = None  # hpx state from a checkpoint, until training starts
        self._trainer: pl.Trainer | None = None
        self._last_step = 0
        self._batch: tuple[Any, int] | None = None
        self._before: Any = None  # the random streams as your run's training_step found them
        self._layout: Any = None  # the first batch's layout, to tell that training_step changed it

    # --- Lightning hooks ---------------------------------------------------------------

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Build the forks once Lightning has set up (and, resuming, restored) your module, optimizer
        and scheduler."""
        import hpx

        problems = _forks_problems(trainer, pl_module)
        if problems:  # the run's length may be among them: nothing below can be built
            raise ConfigError(problems)
        if self.forks is not None:
            raise ConfigError([f"this ForksCallback searched a fit already (to step {self.forks.step_count}, "
                               f"its multiple {self.forks.factor:g}x): another fit would start a new search "
                               "mid-run on a schedule built for the whole of it. Train on without the "
                               "callback (your module holds the winner), or fit a fresh Trainer with a "
                               "fresh ForksCallback"])
        if trainer.global_step > 0 and self._pending is None and self.forks is None:
            problems.append(f"resuming at step {trainer.global_step} from a checkpoint that holds no hpx "
                            "state (saved without ForksCallback?): the forks would start mid-run on a "
                            "schedule built for the whole of it; fit from the start, or resume from a "
                            "checkpoint saved with ForksCallback")
        ConfigError.check(problems)
        backend = None
        if trainer.world_size > 1:
            from hpx.backends import TorchDistributed

            backend = TorchDistributed()
        configs = trainer.strategy.lr_scheduler_configs
        fn, convert = self.loss_fn, trainer.precision_plugin.convert_input  # a "bf16-true" module's dtype
        self._trainer = trainer
        with _detached(pl_module):  # the forks are copies of your module, not of the trainer it holds
            self.forks = hpx.Forks(pl_module, trainer.optimizers[0],
                                   total_steps=int(trainer.estimated_stepping_batches),
                                   schedule=configs[0].scheduler if configs else None, probe=self.probe,
                                   loss_fn=lambda rep, b: fn(rep.model, convert(b)), backend=backend,
                                   **_forks_settings(self.settings, self._log))
            self.forks._outside = True  # Lightning trains your run; hpx the others
            self.forks._clip_params = _optimizer_params  # Lightning clips the optimizer's, in its order
            if self._pending is not None:
                saved, self._pending = self._pending, None
                _load_forks_state(self.forks, saved)
        self._last_step = trainer.global_step
        _snapshot_at_training_step(self, trainer, pl_module)

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        from hpx.forks.probe import _layout

        first = self.forks is not None and self.forks.step_count == 0
        self._batch, self._layout = (batch, batch_idx), _layout(batch) if first else None

    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Your run has taken this micro-batch's forward and backward: every other fork (and a cut's
        annealed copies) takes its own on the same batch, drawing the random numbers your run drew."""
        from hpx.forks.fork import _device, _rng_get, _rng_set
        from hpx.forks.probe import batch_changed

        if self.forks is None or self._batch is None:
            return
        batch, batch_idx = self._batch
        ConfigError.check(batch_changed(self._layout, batch, "training_step"))  # at the first step
        device = _device(pl_module)
        after = _rng_get(device)
        trained = self.forks._open()
        try:
            for f in trained:
                if f.model is not pl_module:
                    _clocked(f.model, trainer)
                _rng_set(self._before, device)
                with trainer.precision_plugin.train_step_context(), warnings.catch_warnings():
                    warnings.filterwarnings("ignore", message=".*self.log.*")  # a copy has no trainer
                    out = f.model.training_step(batch, batch_idx)
                loss = out.get("loss") if isinstance(out, dict) else out
                if not isinstance(loss, torch.Tensor):
                    raise ConfigError([f"training_step returned {type(out).__name__} for a fork: "
                                       "ForksCallback needs the loss (a tensor, or a dict with 'loss') at "
                                       "every step"])
                (loss / trainer.accumulate_grad_batches).backward()
        finally:
            _rng_set(after, device)
        _forks_reached(self.forks, trained)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any,
                           batch: Any, batch_idx: int) -> None:
        self._batch = None
        if self.forks is not None and trainer.global_step > self._last_step:  # the optimizer stepped
            self._last_step = trainer.global_step
            if self.forks._fresh:  # no backward since the last step: training_step gave no loss
                raise ConfigError([f"training_step returned None at batch {batch_idx}: Lightning took "
                                   "the optimizer step (and the schedule's) without a loss, which the other "
                                   "forks cannot follow; return a loss at every step (leave unwanted batches "
                                   "out of the DataLoader)"])
            clip = trainer.gradient_clip_val
            with _detached(pl_module):
                self.forks.optimizer_step(max_grad_norm=float(clip) if clip else None)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """A fit that stops before its last step (``EarlyStopping``, ``max_time``) decides now."""
        trainer.strategy.__dict__.pop("training_step", None)  # the strategy's own again
        if self.forks is not None and not self.forks.decided:
            with _detached(pl_module):
                self.forks.converge()

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """In a process Lightning spawned (``ddp_spawn``), let the forks go when the fit ends (see
        :meth:`AutoLR.teardown`)."""
        import gc
        import multiprocessing

        trainer.strategy.__dict__.pop("training_step", None)
        if stage == "fit" and trainer.world_size > 1 and multiprocessing.parent_process() is not None:
            self.forks = None
            gc.collect()

    def state_dict(self) -> dict[str, Any]:
        """hpx's state for Lightning's checkpoint: every fork but your run (whose module, optimizer
        and scheduler Lightning saves itself), the annealed copies in flight, the decisions."""
        return {} if self.forks is None else _forks_state(self.forks)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._pending = state_dict or None

    def __getstate__(self) -> dict[str, Any]:
        """What ``strategy="ddp_spawn"`` pickles into each process (refused, with the fix, when
        ``loss_fn`` or ``probe`` cannot be pickled)."""
        return _picklable(self, "ForksCallback")

    # --- helpers ---------------------------------------------------------------------------

    def _log(self, record: SyncRecord) -> None:
        trainer = self._trainer
        if trainer is None:
            return
        metrics = _fork_metrics(record)
        trainer.callback_metrics.update({k: torch.tensor(v) for k, v in metrics.items()})
        for lg in trainer.loggers:
            lg.log_metrics(metrics, step=trainer.global_step)


def _optimizer_params(f: Any) -> list[torch.Tensor]:
    """What Lightning clips: the optimizer's parameters, group by group (``main_params``)."""
    return [p for g in f.optimizer.param_groups for p in g["params"]]


def _snapshot_at_training_step(callback: ForksCallback, trainer: pl.Trainer,
                               pl_module: pl.LightningModule) -> None:
    """Take the random streams at the moment your run's ``training_step`` starts (the strategy calls
    it), after every ``on_train_batch_start`` hook (the module's own, and callbacks' listed after
    this one) has drawn what it draws: each fork's step then draws what your run's drew."""
    from hpx.forks.fork import _device, _rng_get

    strategy = trainer.strategy
    own = type(strategy).training_step

    def training_step(*args: Any, **kwargs: Any) -> Any:
        callback._before = _rng_get(_device(pl_module))
        return own(strategy, *args, **kwargs)

    strategy.training_step = training_step  # type: ignore[method-assign]


def _picklable(callback: pl.Callback, kind: str) -> dict[str, Any]:
    """``callback``'s state for pickling into the processes ``strategy="ddp_spawn"`` starts,
    refused with the fix when its ``loss_fn`` or ``probe`` cannot be pickled."""
    import pickle

    for name in ("loss_fn", "probe"):
        try:
            pickle.dumps(getattr(callback, name))
        except Exception as e:
            raise ConfigError([f"{kind}'s {name} cannot be pickled ({type(e).__name__}: {e}), and "
                               "strategy='ddp_spawn' pickles the callbacks into every process it "
                               "starts: define loss_fn with def at a module's top level (not a "
                               "lambda or a local function), or use strategy='ddp'"]) from e
    return callback.__dict__.copy()


@contextlib.contextmanager
def _detached(module: pl.LightningModule) -> Iterator[None]:
    """``module`` without its trainer inside the block, so that a deep copy of it (a fork, a cut's
    annealed copy) copies the module alone."""
    trainer = module._trainer
    module.trainer = None
    try:
        yield
    finally:
        module.trainer = trainer


_CLOCKED: dict[type, type] = {}  # your module's class -> its class for the forks' copies


def _clocked(copy_: pl.LightningModule, trainer: pl.Trainer) -> None:
    """Give a fork's copy of your module (which has no trainer) your run's ``global_step`` and
    ``current_epoch`` for the ``training_step`` it is about to take (without a trainer Lightning
    reads them as 0, so a loss that depends on the step trained the forks on another), and make
    ``self.trainer`` there an error that says why, through a subclass of your module's class that
    only adds these three properties."""
    cls = type(copy_)
    if cls not in _CLOCKED.values():
        if cls not in _CLOCKED:
            _CLOCKED[cls] = type(cls.__name__, (cls,), {
                "__module__": cls.__module__, "__qualname__": cls.__qualname__,
                "global_step": property(lambda self: self._hpx_clock[0]),
                "current_epoch": property(lambda self: self._hpx_clock[1]),
                "trainer": property(_no_trainer, pl.LightningModule.trainer.fset),
                "logger": property(lambda self: _no_trainer(self).logger)})
        copy_.__class__ = _CLOCKED[cls]
    copy_._hpx_clock = (trainer.global_step, trainer.current_epoch)


def _no_trainer(module: pl.LightningModule) -> Any:
    if module._trainer is None:
        raise ConfigError(["training_step read self.trainer (or what reads it: self.lr_schedulers(), "
                           "self.optimizers(), self.print, self.logger) in a fork's copy of your module, "
                           "which has no trainer: ForksCallback runs your training_step for every fork. Read "
                           "self.global_step and self.current_epoch (your run's), and the lr in a callback "
                           "or with LearningRateMonitor"])
    return module._trainer


def _forks_problems(trainer: pl.Trainer, module: pl.LightningModule) -> list[str]:
    """What keeps :class:`ForksCallback` from running in this fit."""
    from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy
    from torch.optim.lr_scheduler import ReduceLROnPlateau

    problems = []
    if not module.automatic_optimization:
        problems.append("ForksCallback drives Lightning's automatic optimization; with manual "
                        "optimization build hpx.Forks on your network in on_fit_start and call "
                        "forks.step in training_step")
    if len(trainer.optimizers) != 1:
        problems.append(f"ForksCallback needs exactly one optimizer (the module configures "
                        f"{len(trainer.optimizers)})")
    configs = trainer.strategy.lr_scheduler_configs
    if any(isinstance(c.scheduler, ReduceLROnPlateau) for c in configs):
        problems.append("ForksCallback cannot follow ReduceLROnPlateau: it steps on a metric of your run's, "
                        "which no other fork has; configure a step-driven scheduler with 'interval': 'step' "
                        "(warm-up and cosine, OneCycleLR, ...)")
    elif len(configs) > 1 or (configs and (configs[0].interval != "step" or configs[0].frequency != 1)):
        problems.append("ForksCallback steps a copy of your schedule per fork at every optimizer step: "
                        "configure one scheduler with 'interval': 'step' (and frequency 1); the module "
                        "configures "
                        f"{[(type(c.scheduler).__name__, c.interval, c.frequency) for c in configs]}")
    if getattr(trainer.precision_plugin, "scaler", None) is not None:
        problems.append("ForksCallback does not run with a gradient scaler (precision='16-mixed'): it "
                        "steps your run's optimizer alone; use precision='bf16-mixed' (no scaler), or 32")
    if not isinstance(trainer.strategy, (DDPStrategy, SingleDeviceStrategy)):
        problems.append(f"ForksCallback keeps a whole copy of the module per fork on every process; it runs "
                        f"on one device or under DDP, not under {type(trainer.strategy).__name__}")
    from lightning.pytorch.callbacks import (
        BaseFinetuning,
        GradientAccumulationScheduler,
        StochasticWeightAveraging,
    )

    changed = [h for h in ("backward", "configure_gradient_clipping", "optimizer_step", "optimizer_zero_grad")
               if getattr(type(module), h) is not getattr(pl.LightningModule, h)]
    if changed:
        problems.append(f"the module overrides {', '.join(changed)}, which Lightning runs for your run only "
                        "(hpx steps the other forks itself): the forks would not train as your run does. "
                        "Leave the hook to Lightning (clip with gradient_clip_val)")
    callbacks = trainer.callbacks
    if any(isinstance(c, BaseFinetuning) for c in callbacks):
        problems.append("a BaseFinetuning callback (BackboneFinetuning) unfreezes layers and adds parameter "
                        "groups to your run's optimizer alone: leave it out, or unfreeze in every fork from "
                        "a callback of your own, with forks_callback.forks.each(lambda replica: ...)")
    if any(isinstance(c, StochasticWeightAveraging) for c in callbacks):
        problems.append("StochasticWeightAveraging writes your run's weight average over the forks' winner "
                        "at the fit's end (and swaps in its own schedule the forks do not follow): leave it "
                        "out, or average the winner yourself after the fit")
    if not math.isfinite(float(trainer.estimated_stepping_batches)):
        problems.append("the fit's length is unknown (max_epochs=-1, or an infinite DataLoader): "
                        "ForksCallback places its cuts on the run's length; give max_steps (or a finite "
                        "max_epochs)")
    elif any(isinstance(c, GradientAccumulationScheduler) for c in callbacks) and trainer.max_steps < 0:
        problems.append("GradientAccumulationScheduler changes the steps per epoch, so the fit's length in "
                        "optimizer steps is not known from max_epochs: give max_steps")
    if trainer.gradient_clip_val and trainer.gradient_clip_algorithm not in (None, "norm"):
        algorithm = getattr(trainer.gradient_clip_algorithm, "value", trainer.gradient_clip_algorithm)
        problems.append(f"ForksCallback clips the forks by norm; gradient_clip_algorithm={algorithm!r} is "
                        "not followed: use 'norm'")
    return problems
