"""hpx inside the Hugging Face ``Trainer``: a callback that turns the Trainer's data-parallel
processes into replicas that find the learning rate (:func:`hpx.autolr`'s search).

::

    from hpx.integrations.transformers import AutoLR

    trainer = Trainer(model=model, args=args, train_dataset=train,
                      callbacks=[AutoLR(loss_fn=lambda model, batch: model(**batch).loss,
                                        probe=val_batches)])
    trainer.train()                                   # torchrun --nproc_per_node=4 train.py

Each process the Trainer runs (under ``torchrun``, or just the one) is one replica. When
training begins (after the Trainer has built and wrapped the model, the optimizer and its
scheduler, and loaded a checkpoint it resumes from), the callback builds an
:class:`~hpx.Engine` on the Trainer's model and optimizer, following the shape of the
Trainer's learning-rate schedule and scaling it; after every optimizer step it advances the
engine, which writes the learning rate the next step uses. The Trainer's DDP averages the
gradients; hpx only moves the learning rate and, at its syncs, places and averages the
weights.

The training loss: a forward hook on the model records the loss of every training forward pass
(``output["loss"]``, or the output when it is one number), on the device, with no host read; it is
what the syncs of the run's last 10% report as the score. A model that returns no loss (no labels
in the batch, or a Trainer that computes the loss itself: label smoothing, ``compute_loss_func``)
gets one warning saying so, and those syncs have no score.

Logging: at each sync the knob's base (``hpx/lr_base``) and the learning rate the last step used
(``hpx/lr``, parameter group 0) are logged as the Trainer logs: appended to ``state.log_history``
and handed to every callback's ``on_log`` (so ``report_to`` integrations, TensorBoard, W&B, ...,
write them, as ``train/hpx/lr_base`` in TensorBoard).

Checkpoints: hpx's state is saved beside every checkpoint the Trainer writes
(``checkpoint-N/hpx_rank{r}.pt``, one file per process) and restored from the checkpoint
``trainer.train(resume_from_checkpoint=...)`` names, wherever it is (another ``output_dir``
included; ``True``: the last one in ``output_dir``); the resumed run continues as if it had not
stopped. The callback reads the handler that calls it and the checkpoint path off the calling
frames, as transformers hands its callbacks neither.

The Trainer's own ``learning_rate`` log shows its scheduler's value, not the scaled one hpx
writes; ``hpx/lr`` is the one used. In one process (one GPU, or the CPU) the one model is the
only replica and scores the search's points in turn at each sync: the same search as with
several processes, at the same cost.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable, Iterable
from typing import Any

import torch

try:
    from transformers import TrainerCallback
except ImportError as e:  # pragma: no cover - exercised only without transformers installed
    raise ImportError("hpx.integrations.transformers needs transformers: pip install transformers") from e

from hpx.errors import ConfigError
from hpx.integrations import _callback_problems, _lr
from hpx.sync_record import SyncRecord

__all__ = ["AutoLR"]

_STATE_FILE = "hpx_rank{rank}.pt"

log = logging.getLogger("hpx")


class AutoLR(TrainerCallback):
    """Find the learning rate while the Hugging Face ``Trainer`` trains (:func:`hpx.autolr`).

    Args:
        loss_fn: ``loss_fn(model, batch) -> loss``: how a replica is scored on a held-out batch
            (the plain objective). ``model`` is the Trainer's model (not its DDP wrapper).
        probe: held-out batches to score replicas on (a few batches of a validation split,
            already collated and on the model's device; every process must see the same ones).
        **settings: other :func:`hpx.autolr` settings (``span``, ``seed``, ``history_file``,
            ``on_sync``, ...).

    The engine is :attr:`engine` once training has begun.
    """

    def __init__(self, loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor], *, probe: Iterable[Any],
                 **settings: Any) -> None:
        reserved = ("backend", "replicas", "schedule", "loss_fn", "total_steps", "mode")
        problems = _callback_problems(loss_fn, probe, settings, reserved, "model")
        ConfigError.check(problems)
        self.loss_fn, self.probe, self.settings = loss_fn, probe, settings
        self.engine: Any = None
        self._model: torch.nn.Module | None = None
        self._state: Any = None
        self._optimizer: Any = None
        self._args: Any = None
        self._control: Any = None
        self._handler: Any = None
        self._resumed_from: str | None = None
        self._hook: Any = None
        self._warned = False

    def on_train_begin(self, args: Any, state: Any, control: Any, model: torch.nn.Module | None = None,
                       optimizer: Any = None, lr_scheduler: Any = None, **kwargs: Any) -> None:
        import hpx

        if model is None or optimizer is None:
            raise ConfigError(["AutoLR needs the Trainer's model and optimizer (transformers passes "
                               "them to callbacks when training begins)"])
        lambdas = getattr(lr_scheduler, "lr_lambdas", None)
        if lr_scheduler is not None and not lambdas:
            raise ConfigError([f"AutoLR follows a LambdaLR schedule (the Trainer's own lr_scheduler_type "
                               f"schedules are); got {type(lr_scheduler).__name__}"])
        backend, world = None, int(getattr(args, "world_size", 1))
        if world > 1:
            from hpx.backends import TorchDistributed

            backend = TorchDistributed()
        self._model, self._state, self._args, self._control = model, state, args, control
        self._handler, self._resumed_from = _callers()
        self._optimizer = getattr(optimizer, "optimizer", optimizer)
        on_sync = self.settings.pop("on_sync", ())
        extra = list(on_sync) if isinstance(on_sync, (list, tuple)) else [on_sync]
        inner = getattr(optimizer, "optimizer", optimizer)  # accelerate wraps the optimizer
        if lr_scheduler is not None:  # the groups' peaks, which the engine scales (a warm-up may be at 0)
            for g, lr in zip(inner.param_groups, lr_scheduler.base_lrs):
                g["lr"] = lr
        schedule = (lambda t: float(lambdas[0](t))) if lambdas else None
        # independent: the Trainer's DDP already averages the gradients; hpx leaves them alone
        self.engine = hpx.autolr(model, inner, total_steps=int(state.max_steps), schedule=schedule,
                                 probe=self.probe, loss_fn=self._score, replicas=1, backend=backend,
                                 mode="independent", on_sync=[self._log, *extra], **self.settings)
        if state.global_step > 0:  # resumed: the Trainer has loaded model, optimizer and scheduler
            folder = self._resumed_from or os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
            path = os.path.join(folder, _STATE_FILE.format(rank=self.engine.collective.rank))
            if not os.path.exists(path):
                raise ConfigError([f"resuming at step {state.global_step}, but hpx's state is not in "
                                   f"{path}: was the checkpoint saved with AutoLR?"])
            self.engine.load_state_dict(torch.load(path, weights_only=False))
        self._hook = model.register_forward_hook(self._record)
        self._warned = False

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.engine.advance()

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        folder = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
        os.makedirs(folder, exist_ok=True)
        engine_state = self.engine.state_dict()
        del engine_state["replicas"]  # the model and optimizer are in the Trainer's checkpoint
        torch.save(engine_state, os.path.join(folder, _STATE_FILE.format(rank=self.engine.collective.rank)))

    def _record(self, module: torch.nn.Module, inputs: Any, output: Any) -> None:
        """The model's training loss of every training forward pass, kept on the device (a
        forward hook: the Trainer hands its callbacks no loss)."""
        if not (module.training and torch.is_grad_enabled()):  # evaluation, or hpx's own probe
            return
        loss = _loss_of(output)
        if loss is not None:
            self.engine.record(loss.detach())
        elif not self._warned:
            self._warned = True
            log.warning("AutoLR: the model's output holds no loss (the batch has no labels, or the "
                        "Trainer computes the loss itself: label smoothing, compute_loss_func), so hpx "
                        "records no training loss and the syncs of the run's last 10%% have no score; "
                        "give the model its labels so that it returns the loss")

    def _score(self, replica: Any, batch: Any) -> torch.Tensor:
        assert self._model is not None
        return self.loss_fn(self._model, batch)

    def _log(self, record: SyncRecord) -> None:
        logs: dict[str, Any] = {f"hpx/{name}_base": float(base) for name, base in record.bases.items()}
        logs["hpx/lr"] = _lr(self._optimizer)  # what the last step before the sync used
        state = self._state
        state.log_history.append({**logs, "step": state.global_step})  # as Trainer.log does
        if self._handler is not None:  # every callback's on_log: the reporting integrations
            self._handler.on_log(self._args, state, self._control, logs)


def _loss_of(output: Any) -> torch.Tensor | None:
    """The loss in a model's output: ``output["loss"]`` (a dict or a ``ModelOutput``), the output
    itself when it is one number, else ``None``."""
    loss = output.get("loss") if isinstance(output, dict) else output
    return loss if torch.is_tensor(loss) and loss.numel() == 1 else None


def _callers() -> tuple[Any, str | None]:
    """The Trainer's ``CallbackHandler`` that is calling ``on_train_begin``, and the checkpoint the
    ``Trainer.train`` call resumes from (``None``: not found, or not resuming). transformers hands
    its callbacks neither, so they are read off the calling frames."""
    from transformers import Trainer
    from transformers.trainer_callback import CallbackHandler

    handler, resumed, frame = None, None, sys._getframe(2)
    while frame is not None:
        owner = frame.f_locals.get("self")
        if handler is None and isinstance(owner, CallbackHandler):
            handler = owner
        if isinstance(owner, Trainer) and "resume_from_checkpoint" in frame.f_locals:
            path = frame.f_locals["resume_from_checkpoint"]
            resumed = path if isinstance(path, (str, os.PathLike)) else None
            break
        frame = frame.f_back
    return handler, None if resumed is None else os.fspath(resumed)
