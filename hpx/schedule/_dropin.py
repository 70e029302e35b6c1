"""What every drop-in scheduler shares: the LRScheduler contract on top of hpx (step, state,
``last_epoch``), who writes the values (the engine when the replicas are several processes, the
scheduler itself for one replica), and the checks of the HDET settings a scheduler is given."""

from __future__ import annotations

import functools
import warnings
import weakref
from typing import Any

import torch
from torch.optim.lr_scheduler import EPOCH_DEPRECATION_WARNING, LRScheduler

from hpx.backends.base import Collective
from hpx.backends.local import InProcess
from hpx.config import EngineConfig
from hpx.engine import Engine
from hpx.errors import BackendError, ConfigError
from hpx.knobs.base import Knob
from hpx.registry import Knobs
from hpx.replica import Replica
from hpx.schedule._util import _any_positive, _is_real, _lrs
from hpx.signals import LossFn, Signal

# Engine settings a scheduler sets itself (from its own keyword arguments or its rule).
_OWN_SETTINGS = ("replicas", "sync_every", "warmup")

_PAPER_SETTINGS = ("space", "decay")


class _Solo:
    """One replica: nothing to compare or average.

    Writes each knob's ``b * f(t)`` (what the engine writes with ``N = 1``, where ``rho = 1``) and
    applies the controller's deterministic part at syncs (with one replica ``D = 0``, so a sync
    only multiplies the bases by ``1 - decay``).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, knobs: Knobs, config: EngineConfig, start: int):
        self.knobs, self.config = knobs, config
        self._rep = rep = Replica(0, torch.nn.Module(), optimizer)
        for k in knobs:
            k.resolve_base(rep)
        # what the engine refuses, refused with one process too (a multiplicative base of 0, a declared
        # spread past a bound)
        ConfigError.check([why for k in knobs for why in k.fan_out_problems(rep)])
        self._pairs = [(k, k.bind(rep)) for k in knobs]
        self.step_count = start
        if start:  # resuming torch-style (last_epoch): the decay of the syncs passed
            knobs.load_state_dict(_decayed(knobs, config, knobs.state_dict(), start))
        self.write()

    def __getstate__(self) -> dict[str, Any]:
        # the setters are closures over this optimizer: a copy binds its own (see Engine)
        return {**self.__dict__, "_pairs": None}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._pairs = [(k, k.bind(self._rep)) for k in self.knobs]

    def write(self) -> None:
        t = self.step_count
        for k, setter in self._pairs:
            setter(k.base * k.scale(t))

    def jump(self, step: float) -> None:
        """Land on ``step`` at the next :meth:`advance` (torch's ``step(epoch)``); bases stay."""
        self.step_count = step - 1

    def advance(self, loss: Any = None, batch: Any = None, loss_fn: LossFn | None = None) -> None:
        self.step_count += 1
        cfg = self.config
        if (cfg.decay and cfg.controller and self.step_count % cfg.sync_every == 0
                and self.step_count >= cfg.warmup):
            for k, _ in self._pairs:
                if k.explore and k.kind == "mul":
                    k.base = k.clamp(k.base * (1 - cfg.decay))
        self.write()

    def state_dict(self) -> dict[str, Any]:
        return {"format": 1, "n_replicas": 1, "step": self.step_count, "knobs": self.knobs.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # Any hpx state will do (an engine's too): one replica needs only the step and the bases.
        self.knobs.load_state_dict(state["knobs"])
        self.step_count = int(state["step"])
        self.write()


class _Driven:
    """An :class:`~hpx.Engine` with one local replica: the user's model and optimizer."""

    def __init__(self, engine: Engine, start: int) -> None:
        self.engine = engine
        if start:  # resuming torch-style (last_epoch): syncs stay on multiples of sync_every
            state = {**engine.state_dict(), "step": start}
            state["knobs"] = _decayed(engine.knobs, engine.config, state["knobs"], start)
            del state["next_sync"]
            self._load(state)

    @property
    def step_count(self) -> int:
        return self.engine.step_count

    @property
    def config(self) -> EngineConfig:
        return self.engine.config

    @config.setter
    def config(self, value: EngineConfig) -> None:
        self.engine.config = value

    def jump(self, step: float) -> None:
        if step != self.engine.step_count + 1:
            raise ValueError(
                f"step({step!r}) asks for epoch {step!r} at step {self.engine.step_count}: a number given "
                "to step() is torch's (deprecated) epoch, and with several replicas the schedule only moves "
                "one step at a time; pass the loss as a tensor, sched.step(loss), or as sched.step(loss=...)")

    def advance(self, loss: Any = None, batch: Any = None, loss_fn: LossFn | None = None) -> None:
        if loss is not None:
            self.engine.record(loss if torch.is_tensor(loss) else torch.tensor(float(loss)))
        self.engine.advance(batch=batch, loss_fn=loss_fn)

    def state_dict(self) -> dict[str, Any]:
        state = self.engine.state_dict()
        del state["replicas"]  # the model and optimizer are the user's to save (torch's contract)
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "slots" not in state:
            raise ConfigError([f"this checkpoint was saved with {state.get('n_replicas', 1)} replica(s) "
                               f"and no engine; this scheduler runs {self.engine.n_replicas} replicas"])
        state = dict(state)
        e = self.engine
        first = e.collective.rank * e.n_local
        if state.get("first") != first:
            # Saved on another rank: bases, controller and permutations are the same on every rank,
            # but the interval's loss sum is that rank's own, so this rank's interval restarts.
            state.update(first=first, acc=torch.zeros(e.n_local), acc_n=[0] * e.n_local)
        self._load(state)

    def _load(self, state: dict[str, Any]) -> None:
        state = dict(state)
        state.pop("replicas", None)  # hpx's own state only: the model and optimizer stay the user's
        self.engine.load_state_dict(state)


class _Scheduler(LRScheduler):
    """What :class:`OneCycleLR` and :class:`ExploreLR` share: the driver, ``step(loss)``,
    ``get_last_lr`` and checkpoints. Not constructed directly."""

    optimizer: torch.optim.Optimizer
    _driver: _Solo | _Driven
    _hpx_scheduler = True  # what hpx.schedule._shadow recognises without importing this module

    def _start(
        self,
        optimizer: torch.optim.Optimizer,
        knobs: list[Knob],
        config: EngineConfig,
        *,
        model: torch.nn.Module | None,
        backend: Collective,
        signal: Signal | None,
        spread: Any,
        start: int,
    ) -> None:
        n = backend.world_size
        if n > 1 and model is not None:
            if getattr(optimizer, "_hpx_driven", False):
                raise ConfigError([f"this optimizer already has an hpx scheduler with replicas to explore; "
                                   f"a second {type(self).__name__} on it would build a second search over "
                                   "the same model: wrap one torch ChainedScheduler of your schedulers "
                                   "instead, hpx.ExploreLR(ChainedScheduler([...]), model=...)"])
            engine = Engine(model, optimizer, Knobs(*knobs), backend=backend, signal=signal, config=config)
            self._driver = _Driven(engine, start)
            optimizer._hpx_driven = True  # type: ignore[attr-defined]
        else:
            if n == 1 and _any_positive(spread):
                warnings.warn(
                    f"{type(self).__name__}: one replica (no torch.distributed process group with more "
                    f"than one process), so spread={spread!r} has nothing to explore: the learning "
                    "rates are the schedule's own", UserWarning, stacklevel=3)
            self._driver = _Solo(optimizer, Knobs(*knobs, seed=config.seed), config, start)
        self._get_lr_called_within_step = False
        self._is_initial = False
        _track_optimizer_step(optimizer)
        self._step_count = 1
        self._last_lr = _lrs(self.optimizer)
        optimizer._hpx_wrote = self._last_lr  # type: ignore[attr-defined]

    # --- torch's scheduler interface ------------------------------------------------------

    def step(self, epoch: torch.Tensor | float | None = None, *,  # type: ignore[override]
             loss: torch.Tensor | float | None = None, batch: Any = None,
             loss_fn: LossFn | None = None) -> None:
        """Advance one optimizer step: record the loss, sync every ``sync_every`` steps, and write
        the next step's learning rates (and momenta) into the optimizer.

        How the argument is read: a **tensor** (``sched.step(loss)``, hpx's form) or ``loss=`` (a
        tensor or a number) is the step's training loss; a plain **number** given positionally is
        torch's deprecated ``epoch`` (``sched.step(5)`` jumps the schedule to epoch 5, with torch's
        deprecation warning), so loops written for torch keep torch's meaning. Pass a loss read back
        to the host as ``sched.step(loss=value)``.

        Args:
            epoch: the step's loss as a tensor, or torch's epoch as a number (see above).
            loss: this replica's training loss of the step just taken (a tensor stays on its
                device: no host read). Needed when replicas are compared on their training loss
                (the default signal) and the controller acts; otherwise ignored.
            batch, loss_fn: handed to a signal that scores replicas on a batch at the sync
                (:class:`~hpx.SharedBatch`); ``loss_fn(replica, batch)``.
        """
        if torch.is_tensor(epoch):
            if loss is not None:
                raise TypeError("step() got the loss twice (a tensor positionally and loss=); pass it once")
            epoch, loss = None, epoch
        elif epoch is not None and not _is_real(epoch):
            raise TypeError(f"step() takes the loss as a tensor or loss=..., or torch's epoch as a number "
                            f"(got {type(epoch).__name__}: {epoch!r})")
        if self._step_count == 1:
            _warn_like_torch(self.optimizer)
        ConfigError.check(_changed_problems(self))
        self._step_count += 1
        if epoch is not None:
            warnings.warn(EPOCH_DEPRECATION_WARNING, UserWarning, stacklevel=2)
        try:
            self._before_step(epoch)
        except Exception:
            self._refused_step(epoch)  # torch has counted the step before its get_lr raised
            raise
        self._driver.advance(loss, batch, loss_fn)
        self._after_step()
        self._last_lr = _lrs(self.optimizer)
        self.optimizer._hpx_wrote = self._last_lr  # type: ignore[attr-defined]  # what hpx last wrote into it

    def _initial_step(self) -> None:
        """What torch's ``SequentialLR`` calls on its first child (after rewinding every child's
        ``last_epoch``): refused, as the restart it calls at a milestone, since hpx's own step count
        and exploration do not follow them."""
        raise ConfigError([f"hpx.{type(self).__name__} cannot run inside torch's SequentialLR, which rewinds "
                           "and restarts its schedulers: put the SequentialLR inside hpx.ExploreLR instead, "
                           "hpx.ExploreLR(SequentialLR(optimizer, [...], milestones=[...]), ...)"])

    def _update_lr(self, epoch: int | None = None) -> None:
        self._initial_step()

    def get_last_lr(self) -> list[float | torch.Tensor]:
        """The learning rates last written into this process's optimizer, one per param group."""
        return self._last_lr

    def get_lr(self) -> list[float | torch.Tensor]:
        """The learning rates of the current step (this replica's, spread included). As in torch,
        calling it yourself warns: :meth:`get_last_lr` is the one to read."""
        if not self._get_lr_called_within_step:
            warnings.warn("To get the last learning rate computed by the scheduler, please use "
                          "`get_last_lr()`.", UserWarning, stacklevel=2)
        return _lrs(self.optimizer)

    # --- hpx --------------------------------------------------------------------------------

    @property
    def engine(self) -> Engine | None:
        """The engine running HDET, or None with one replica (nothing to average or compare)."""
        return self._driver.engine if isinstance(self._driver, _Driven) else None

    @property
    def n_replicas(self) -> int:
        """``N``, the number of replicas (processes) exploring together."""
        return self.engine.n_replicas if self.engine is not None else 1

    @property
    def bases(self) -> dict[str, float]:
        """Every knob's base ``b``: for ``rule="hpx"`` the learned correction of each group's
        schedule (1 = as scheduled); for ``rule="paper"`` after the handover, the base lr."""
        if isinstance(self._driver, _Driven):
            return self._driver.engine.bases
        return {k.name: k.base for k in self._driver.knobs}

    # --- checkpoints ------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Everything but the optimizer and model (save those yourself, as with any torch
        scheduler): step counters, last lrs, the schedule, and hpx's state (knob bases,
        controller velocity, permutation stream and the current interval's loss sums).

        Under torch.distributed every rank's hpx state is the same except for that interval's
        loss sum, so one rank's file can be loaded on every rank. Save at a sync step
        (``step % sync_every == 0``) for an exact resume: replicas' weights are equal there.
        """
        state = {
            "last_epoch": self.last_epoch,
            "_step_count": self._step_count,
            "base_lrs": list(self.base_lrs),
            "_last_lr": list(self._last_lr),
            "hdet": dict(self._hdet),
            "hpx": self._driver.state_dict(),
        }
        state.update(self._own_state())
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict`, also one from a scheduler built with other schedule
        arguments (the saved schedule replaces this one's, as with torch's schedulers).

        The rule, ``sync_every`` and ``warmup`` must match (they fix when the controller acts).
        Loading writes the restored step's values into the optimizer: load the optimizer's state
        first, then the scheduler's.
        """
        if "hpx" not in state_dict:  # a torch scheduler's state: switch a running job over
            self._adopt(state_dict)
            return
        saved = state_dict.get("hdet", {})
        problems = [f"checkpoint was saved with {k}={saved.get(k)!r}, this scheduler has {k}={v!r}"
                    for k, v in self._hdet.items() if k != "spread" and saved.get(k) != v]
        ConfigError.check(problems)
        self._load_own_state(state_dict)
        self._driver.load_state_dict(state_dict["hpx"])
        self.last_epoch = int(state_dict["last_epoch"])
        self._step_count = int(state_dict["_step_count"])
        self.base_lrs = list(state_dict["base_lrs"])
        self._last_lr = list(state_dict["_last_lr"])
        self.optimizer._hpx_wrote = None  # type: ignore[attr-defined]  # yours may load after: not checked

    def _adopt(self, state: dict[str, Any]) -> None:
        raise ConfigError([f"this state_dict has no hpx state (keys: {sorted(state)}): it was not saved by "
                           f"an hpx {type(self).__name__}"])

    def _continue_at(self, step: int, state: dict[str, Any]) -> None:
        """Continue a torch-scheduled run at ``step``: hpx's state starts there, bases at 1."""
        own = dict(self._driver.state_dict())
        own.pop("next_sync", None)  # recomputed from the step, on the sync grid
        own["step"] = step
        knobs = self._driver.engine.knobs if isinstance(self._driver, _Driven) else self._driver.knobs
        own["knobs"] = _decayed(knobs, self._driver.config, own["knobs"], step)
        self._driver.load_state_dict(own)
        self.last_epoch = step
        self._step_count = int(state.get("_step_count", step + 1))
        self._last_lr = _lrs(self.optimizer)
        self.optimizer._hpx_wrote = None  # type: ignore[attr-defined]  # yours may load after: not checked

    # --- what subclasses provide ------------------------------------------------------------

    _hdet: dict[str, Any]

    def _before_step(self, epoch: float | None) -> None:
        raise NotImplementedError

    def _refused_step(self, epoch: float | None) -> None:
        raise NotImplementedError

    def _after_step(self) -> None:
        raise NotImplementedError

    def _own_state(self) -> dict[str, Any]:
        raise NotImplementedError

    def _load_own_state(self, state: dict[str, Any]) -> None:
        raise NotImplementedError


def _changed_problems(sched: _Scheduler) -> list[str]:
    """The optimizer's learning rates changed since an hpx scheduler last wrote them: another
    scheduler steps the same optimizer, or an lr was set by hand (hpx would overwrite it). Float
    learning rates only (a tensor's is overwritten in place, as torch's schedulers do)."""
    wrote, now = getattr(sched.optimizer, "_hpx_wrote", None), _lrs(sched.optimizer)
    if wrote is None or len(wrote) != len(now) or all(
            a == b or type(a) is not float or type(b) is not float for a, b in zip(wrote, now)):
        return []
    return [f"the optimizer's learning rates are {_shown(now)} where hpx.{type(sched).__name__} wrote "
            f"{_shown(wrote)}: another scheduler steps this optimizer (or an lr was set by hand), and hpx "
            "would overwrite its change at this step. Let one scheduler drive the optimizer: put yours "
            "inside, hpx.ExploreLR(torch.optim.lr_scheduler.ChainedScheduler([...]))"]


def _shown(lrs: list[Any]) -> str:
    return "[" + ", ".join(f"{float(v):.6g}" for v in lrs) + "]"


def _decayed(knobs: Knobs, config: EngineConfig, state: dict[str, Any], start: int) -> dict[str, Any]:
    """``state`` (a :class:`Knobs` state at step 0) with the multiplicative bases decayed by every
    sync a run continued at ``start`` has passed (the paper rule's ``1 - gamma`` at each multiple of
    ``sync_every`` from the handover on; what its syncs do without a signal, one at a time)."""
    T = config.sync_every
    passed = 0 if not (config.decay and config.controller) else max(
        0, start // T - (-(-max(config.warmup, 1) // T)) + 1)
    if not passed:
        return state
    out = {**state, "knobs": [dict(s) for s in state["knobs"]]}
    for k, s in zip(knobs, out["knobs"]):
        if k.explore and k.kind == "mul":
            for _ in range(passed):
                s["base"] = k.clamp(s["base"] * (1 - config.decay))
    return out


def _track_optimizer_step(optimizer: torch.optim.Optimizer) -> None:
    """Mark ``optimizer.step`` as torch's schedulers do, so that :func:`_warn_like_torch` can tell
    whether it was called before the scheduler's first step (the wrapper sets ``_opt_called``)."""
    if hasattr(optimizer.step, "_wrapped_by_lr_sched"):
        return  # a torch scheduler (or an earlier hpx one) has wrapped it already
    opt_ref = weakref.ref(optimizer)
    func = optimizer.step.__func__  # type: ignore[attr-defined]

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        opt = opt_ref()
        opt._opt_called = True  # type: ignore[union-attr]
        return func.__get__(opt, opt.__class__)(*args, **kwargs)

    wrapper._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
    optimizer.step = wrapper  # type: ignore[method-assign]


def _warn_like_torch(optimizer: torch.optim.Optimizer) -> None:
    """torch's two warnings at a scheduler's first step, word for word (users search for them)."""
    if not hasattr(optimizer.step, "_wrapped_by_lr_sched"):
        warnings.warn(
            "Seems like `optimizer.step()` has been overridden after learning rate scheduler "
            "initialization. Please, make sure to call `optimizer.step()` before "
            "`lr_scheduler.step()`. See more details at "
            "https://pytorch.org/docs/stable/optim.html#how-to-adjust-learning-rate",
            UserWarning, stacklevel=3)
    elif not getattr(optimizer, "_opt_called", False):
        warnings.warn(
            "Detected call of `lr_scheduler.step()` before `optimizer.step()`. "
            "In PyTorch 1.1.0 and later, you should call them in the opposite order: "
            "`optimizer.step()` before `lr_scheduler.step()`.  Failure to do this "
            "will result in PyTorch skipping the first value of the learning rate schedule. "
            "See more details at "
            "https://pytorch.org/docs/stable/optim.html#how-to-adjust-learning-rate",
            UserWarning, stacklevel=3)


def _epoch(scheduler: Any) -> int:
    """A scheduler's ``last_epoch``; a ChainedScheduler has none of its own: its first child's."""
    epoch = getattr(scheduler, "last_epoch", None)
    if epoch is None:
        children = getattr(scheduler, "_schedulers", None) or ()
        return _epoch(children[0]) if children else 0
    return int(epoch)


def _resolve(
    sched: _Scheduler,
    settings: dict[str, Any],
    own: dict[str, Any],
    *,
    rule: Any,
    model: Any,
    spread: Any,
    backend: Collective | None,
) -> tuple[EngineConfig | None, Collective | None, list[str]]:
    """Validate the HDET settings together; return the engine config, the backend and problems."""
    problems: list[str] = []
    name = type(sched).__name__
    for key in _OWN_SETTINGS:
        if key in settings:
            if key == "replicas":
                problems.append(
                    f"replicas is not a setting of {name} (got {settings[key]!r}): it drives one "
                    "optimizer, so one replica per process; for N replicas run N processes under "
                    "torch.distributed, or use hpx.Engine with an optimizer factory")
    if rule == "paper":
        for key in _PAPER_SETTINGS:
            if key in settings:
                problems.append(f"{key} is set by rule='paper' (got {key}={settings[key]!r}); use "
                                "rule='hpx' to choose it")
    if model is not None and not isinstance(model, torch.nn.Module):
        problems.append(f"model must be a torch.nn.Module or None (got {type(model).__name__})")
    config = None
    passed = {k: v for k, v in settings.items()
              if k not in _OWN_SETTINGS + (_PAPER_SETTINGS if rule == "paper" else ())}
    try:
        EngineConfig.build(**passed)  # the user's settings alone, so their problems are listed too
    except ConfigError as e:
        problems += e.problems
    else:
        if own:
            config = EngineConfig.build(**{**own, **passed, "replicas": 1})
    if backend is None and (model is not None or _any_positive(spread)):
        backend = _default_backend()
    elif backend is None:
        backend = InProcess()
    if backend is not None and not isinstance(backend, Collective):
        problems.append(f"backend must implement hpx.backends.Collective (got {type(backend).__name__})")
        return config, None, problems
    n = backend.world_size
    if n > 1 and model is None and _any_positive(spread):
        problems.append(
            f"spread={spread!r} with {n} replicas needs model=...: the replicas' parameters and "
            "buffers are averaged every sync_every steps, which needs the model (pass the one you "
            "train, wrapped in DistributedDataParallel or not)")
    ddp = isinstance(model, torch.nn.parallel.DistributedDataParallel)
    mode = settings.get("mode", "shared")
    if n > 1 and model is not None and not ddp and mode == "shared":
        problems.append(
            f"mode='shared' with {n} processes needs the model wrapped in DistributedDataParallel "
            f"(got a bare {type(model).__name__}): {name} is stepped after optimizer.step(), too "
            "late to average gradients itself; wrap it, or pass mode='independent' for replicas "
            "that train on their own gradients between syncs")
    return config, backend, problems


def _default_backend() -> Collective:
    """``TorchDistributed()`` if a process group is initialised, else one replica in process."""
    from hpx.backends import TorchDistributed  # the module that imports torch.distributed

    try:
        return TorchDistributed()
    except BackendError:
        return InProcess()
