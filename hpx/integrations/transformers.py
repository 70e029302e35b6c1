"""hpx inside the Hugging Face ``Trainer``.

The recommended way is :class:`ForksTrainer`, the ``Trainer`` with :class:`hpx.Forks`: whole runs
at several multiples of your learning rate trained beside yours, and yours kept unless another is
better on the probe with confidence::

    from hpx.integrations.transformers import ForksTrainer

    trainer = ForksTrainer(model=model, args=args, train_dataset=train, probe=val_batches)
    trainer.train()                                   # the model holds the winner afterwards

The alternative, :class:`AutoLR`, is a callback that turns the Trainer's data-parallel processes
into replicas that find the learning rate within one run (:func:`hpx.autolr`'s search)::

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
    from transformers import Trainer, TrainerCallback
except ImportError as e:  # pragma: no cover - exercised only without transformers installed
    raise ImportError("hpx.integrations.transformers needs transformers: pip install transformers") from e

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

__all__ = ["AutoLR", "ForksTrainer"]

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
        # what this process's replica used at the last step before the sync (the record has it: the
        # Trainer's scheduler has written its own, unscaled, next lr into the optimizer since)
        logs["hpx/lr"] = float(record.lr[self.engine._first]) if record.lr else _lr(self._optimizer)
        state = self._state
        state.log_history.append({**logs, "step": state.global_step})  # as Trainer.log does
        if self._handler is not None:  # every callback's on_log: the reporting integrations
            self._handler.on_log(self._args, state, self._control, logs)


def _loss_of(output: Any) -> torch.Tensor | None:
    """The loss in a model's output: ``output["loss"]`` (a dict or a ``ModelOutput``), the first of a
    tuple (``(loss, logits)``, as the Trainer reads it), the output itself when it is one number,
    else ``None``."""
    loss = (output.get("loss") if isinstance(output, dict)
            else output[0] if isinstance(output, (tuple, list)) and output else output)
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


_FORKS_FILE = "hpx_forks_rank{rank}.pt"


class ForksTrainer(Trainer):
    """The Hugging Face ``Trainer`` with :class:`hpx.Forks`, the recommended learning-rate search:
    the Trainer trains your run as it always does, and hpx trains the other forks (copies of the
    model at other multiples of the learning rate) on the same batches beside it, cuts them, and
    at the end of the run keeps yours unless a challenger is better on the probe with confidence;
    the winner is then loaded into the Trainer's model, optimizer and scheduler.

    Args:
        *args, **kwargs: the ``Trainer``'s own (``model``, ``args``, ``train_dataset``, ...).
        probe: held-out batches the forks are scored on (a few collated validation batches, with
            labels; every process must hold the same ones).
        probe_loss: ``probe_loss(model, batch) -> loss`` on a probe batch (the loss of every
            example, or one number); default: the loss the model returns, ``model(**batch)["loss"]``.
        forks: other :class:`hpx.Forks` settings (``multiples``, ``cuts``, ``cool``,
            ``confidence``, ``knobs``, ``knob_start``, ``knob_design``, ``on_sync``, ``share``).

    :attr:`forks` is the :class:`hpx.Forks` once training has begun. The forks train through the
    Trainer's own ``training_step`` and ``compute_loss`` (a ``compute_loss`` you override, label
    smoothing and ``compute_loss_func`` included), with its gradient accumulation and its
    ``max_grad_norm`` clipping; under ``torchrun`` each fork is data-parallel over the processes as
    your run is under the Trainer's DDP. Each decision is logged as the Trainer logs
    (``hpx/lr_multiple``, the multiple your run trains at after it, and ``hpx/probe_loss/<fork>``),
    and hpx's state is saved beside every checkpoint (``checkpoint-N/hpx_forks_rank{r}.pt``) and
    restored from the one ``train(resume_from_checkpoint=...)`` names. ``fp16`` (a gradient
    scaler shared between the forks), DeepSpeed and FSDP are refused with a message; ``bf16`` works.
    """

    def __init__(self, *args: Any, probe: Iterable[Any],
                 probe_loss: Callable[[torch.nn.Module, Any], torch.Tensor] | None = None,
                 forks: dict[str, Any] | None = None, **kwargs: Any) -> None:
        settings = dict(forks or {}) if isinstance(forks, (dict, type(None))) else None
        problems = [f"forks must be a dict of hpx.Forks settings ({', '.join(_FORKS_SETTINGS)}; got "
                    f"{type(forks).__name__})" for _ in [0] if settings is None]
        problems += [f"unknown forks setting {key!r}: ForksTrainer takes {', '.join(_FORKS_SETTINGS)} (the "
                     "model, optimizer, schedule, total_steps and backend come from the Trainer)"
                     for key in (settings or {}) if key not in _FORKS_SETTINGS]
        if probe_loss is not None and not callable(probe_loss):
            problems.append(f"probe_loss must be a function (model, batch) -> loss, or None (got "
                            f"{type(probe_loss).__name__})")
        if probe is None or not isinstance(probe, Iterable):
            problems.append(f"probe must be held-out batches (a list of a few collated validation batches; "
                            f"got {type(probe).__name__})")
        ConfigError.check(problems)
        super().__init__(*args, **kwargs)
        self.probe, self.probe_loss, self.forks_settings = probe, probe_loss, settings or {}
        self.forks: Any = None
        self._resume: Any = None
        self.add_callback(_ForksEvents(self))

    def train(self, resume_from_checkpoint: Any = None, *args: Any, **kwargs: Any) -> Any:
        self._resume = resume_from_checkpoint  # where hpx's state is read back from
        return super().train(resume_from_checkpoint, *args, **kwargs)

    def create_scheduler(self, num_training_steps: int, optimizer: Any = None) -> Any:
        """The Trainer's schedule, built on the torch optimizer itself (not accelerate's wrapper of
        it), so that every fork's copy of the schedule drives that fork's copy of the optimizer."""
        optimizer = self.optimizer if optimizer is None else optimizer
        inner = getattr(optimizer, "optimizer", optimizer)
        return super().create_scheduler(num_training_steps, optimizer=inner)

    def training_step(self, model: torch.nn.Module, inputs: Any,
                      num_items_in_batch: Any = None) -> torch.Tensor:
        """Your run's step as the Trainer takes it, then the same step of every other fork (and of
        a cut's annealed copies) on the same inputs, each drawing the random numbers your run drew."""
        from hpx.forks.fork import _device, common_draws
        from hpx.forks.probe import _layout, batch_changed

        more = () if num_items_in_batch is None else (num_items_in_batch,)  # transformers < 4.46: none
        step, forks = super().training_step, self.forks
        if forks is None:  # not training: the Trainer's own step
            return step(model, inputs, *more)
        trained = forks._open()
        before = _layout(inputs) if forks.step_count == 0 else None
        calls = [lambda m=f.model: step(m, inputs, *more) for f in trained]
        try:
            loss = common_draws(_device(self.model), [lambda: step(model, inputs, *more), *calls],
                                forks._streams)[0]
        except Exception:  # a later fork's KeyError after your compute_loss popped an entry
            ConfigError.check(batch_changed(before, inputs, "compute_loss (or training_step)"))
            raise
        ConfigError.check(batch_changed(before, inputs, "compute_loss (or training_step)"))
        _forks_reached(forks, trained)
        return loss

    def _begin_forks(self, state: Any) -> None:
        import hpx

        problems = []
        if getattr(self.accelerator, "scaler", None) is not None:
            problems.append("ForksTrainer does not run with fp16=True: its gradient scaler steps your run's "
                            "optimizer alone and would unscale the other forks with another scale; use "
                            "bf16=True (no scaler), or fp32")
        if self.is_deepspeed_enabled or self.is_fsdp_enabled:
            problems.append("ForksTrainer keeps a whole copy of the model per fork on every process; it does "
                            "not run under DeepSpeed or FSDP (use DDP: torchrun with the default strategy)")
        if self.args.load_best_model_at_end:
            problems.append("load_best_model_at_end=True would replace the forks' winner with your run's "
                            "best checkpoint after training: leave it False (the winner is in trainer.model "
                            "at the end; evaluate it there)")
        if getattr(self.args, "torch_compile", False) and any(
                isinstance(m, torch.nn.Dropout) and m.p > 0 for m in self.model.modules()):
            problems.append("torch_compile=True with dropout: the Trainer runs your run compiled and hpx the "
                            "forks' copies eagerly, and compiled dropout draws other masks than eager, so "
                            "the forks would not see your run's random numbers: set torch_compile=False")
        if self.args.n_gpu > 1:
            problems.append(f"ForksTrainer does not run under torch.nn.DataParallel ({self.args.n_gpu} GPUs "
                            "in one process): launch one process per GPU with torchrun")
        optimizer = getattr(self.optimizer, "optimizer", self.optimizer)
        schedule = getattr(self.lr_scheduler, "scheduler", self.lr_scheduler)
        if isinstance(schedule, torch.optim.lr_scheduler.ReduceLROnPlateau):
            problems.append("lr_scheduler_type='reduce_lr_on_plateau' steps on an evaluation metric, which "
                            "hpx cannot give each fork: choose another lr_scheduler_type (linear, "
                            "cosine, ...)")
        elif schedule is not None and getattr(schedule, "optimizer", None) is not optimizer:
            problems.append("the learning-rate scheduler is not built on the Trainer's optimizer: build the "
                            "scheduler you pass in optimizers=(optimizer, scheduler) on that optimizer")
        ConfigError.check(problems)
        backend = None
        if int(getattr(self.args, "world_size", 1)) > 1:
            from hpx.backends import TorchDistributed

            backend = TorchDistributed()
        fn = self.probe_loss
        self.forks = hpx.Forks(self.model, optimizer, total_steps=int(state.max_steps), schedule=schedule,
                               probe=self.probe, backend=backend,
                               loss_fn=lambda rep, b: (fn or _model_loss)(rep.model, b),
                               **_forks_settings(self.forks_settings, self._log_forks))
        self.forks._outside = True  # the Trainer trains your run; hpx the others
        self.forks._zero_model = True  # the Trainer zeroes the model's gradients, not only the optimizer's
        if state.global_step > 0:  # resumed: the Trainer has loaded your model, optimizer and scheduler
            path = os.path.join(self._checkpoint(state), _FORKS_FILE.format(rank=self.forks.collective.rank))
            if not os.path.exists(path):
                raise ConfigError([f"resuming at step {state.global_step}, but hpx's state is not in {path}: "
                                   "was the checkpoint saved by a ForksTrainer?"])
            _load_forks_state(self.forks, torch.load(path, weights_only=False))

    def _checkpoint(self, state: Any) -> str:
        """The checkpoint folder this ``train`` call resumes from."""
        if isinstance(self._resume, (str, os.PathLike)):
            return os.fspath(self._resume)
        if self._resume is True:
            from transformers.trainer_utils import get_last_checkpoint

            found = get_last_checkpoint(self.args.output_dir)
            if found is not None:
                return found
        return os.path.join(self.args.output_dir, f"checkpoint-{state.global_step}")

    def _save_forks(self, state: Any) -> None:
        folder = os.path.join(self.args.output_dir, f"checkpoint-{state.global_step}")
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, _FORKS_FILE.format(rank=self.forks.collective.rank))
        torch.save(_forks_state(self.forks), path)

    def _log_forks(self, record: SyncRecord) -> None:
        self.log(dict(_fork_metrics(record)))


class _ForksEvents(TrainerCallback):
    """The Trainer's events a :class:`ForksTrainer` acts on."""

    def __init__(self, trainer: ForksTrainer) -> None:
        self.trainer = trainer

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.trainer._begin_forks(state)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        # the Trainer has stepped your run; now every other fork, then a cut or the end when due
        norm = float(args.max_grad_norm) if args.max_grad_norm and args.max_grad_norm > 0 else None
        self.trainer.forks.optimizer_step(max_grad_norm=norm)

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.trainer._save_forks(state)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Training that stops before ``max_steps`` (a callback's ``should_training_stop``, early
        stopping) decides where it stops, as the run's end would."""
        forks = self.trainer.forks
        if forks is not None and not forks.decided:
            forks.converge()


def _model_loss(model: torch.nn.Module, batch: Any) -> torch.Tensor:
    """The loss a Hugging Face model returns for a batch with labels."""
    loss = _loss_of(model(**batch))
    if loss is None:
        raise ConfigError(["the model returned no loss on a probe batch: give probe batches with labels, or "
                           "probe_loss=lambda model, batch: ..."])
    return loss
