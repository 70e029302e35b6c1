"""hpx inside PyTorch Lightning: a callback that turns Lightning's data-parallel processes into
replicas that find the learning rate (:func:`hpx.autolr`'s search).

::

    from hpx.integrations.lightning import AutoLR

    def probe_loss(module, batch):                   # at a module's top level (see ddp_spawn below)
        return module.loss(batch)

    trainer = L.Trainer(accelerator="cpu", devices=4, strategy="ddp", max_steps=2000,
                        callbacks=[AutoLR(probe_loss, probe=val_batches)])
    trainer.fit(module, train_loader)

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

from collections.abc import Callable, Iterable
from typing import Any

import torch

try:
    import lightning.pytorch as pl
except ImportError as e:  # pragma: no cover - exercised only without lightning installed
    raise ImportError("hpx.integrations.lightning needs PyTorch Lightning: pip install lightning") from e

from hpx.errors import ConfigError
from hpx.integrations import _callback_problems, _lr
from hpx.sync_record import SyncRecord

__all__ = ["AutoLR"]


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
        if len(configs) > 1 or (configs and configs[0].interval != "step"):
            raise ConfigError(["AutoLR takes over one scheduler stepped every step ('interval': "
                               "'step'); the module configures "
                               f"{[(type(c.scheduler).__name__, c.interval) for c in configs]}"])
        schedule = configs[0].scheduler if configs else None
        backend = None
        world = trainer.world_size
        if world > 1:
            from hpx.backends import TorchDistributed

            backend = TorchDistributed()
        total = self.total_steps if self.total_steps is not None else int(trainer.estimated_stepping_batches)
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
        import pickle

        for name in ("loss_fn", "probe"):
            try:
                pickle.dumps(getattr(self, name))
            except Exception as e:
                raise ConfigError([f"AutoLR's {name} cannot be pickled ({type(e).__name__}: {e}), and "
                                   "strategy='ddp_spawn' pickles the callbacks into every process it "
                                   "starts: define loss_fn with def at a module's top level (not a "
                                   "lambda or a local function), or use strategy='ddp'"]) from e
        return self.__dict__.copy()

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
