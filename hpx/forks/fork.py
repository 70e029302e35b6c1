"""The parts of :class:`hpx.Forks` that are not the search itself: one fork (a whole run), the
paired test, the common random draws, the probe's losses per example and the checks of the settings."""

from __future__ import annotations

import copy
import itertools
import math
import random
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence, Sized
from numbers import Integral, Real
from typing import Any

import torch
from torch.optim.lr_scheduler import LRScheduler, ReduceLROnPlateau

from hpx import _checks
from hpx._deepcopy import graph_tensors_detached
from hpx.errors import ConfigError
from hpx.forks.shard import is_dtensor, load_local, local, local_state
from hpx.knobs.base import Knob
from hpx.replica import Replica
from hpx.signals import LossFn, _one_batch_problems

_FORMAT = "hpx.forks/2"
_SETTINGS = ("total_steps", "multiples", "cuts", "cool", "confidence", "knob_start", "knob_design")
# what a state saved before a setting existed was built with
_SETTINGS_BEFORE = {"knob_start": 0.0, "knob_design": "each"}


class _Fork:
    """One whole run: a replica (model, optimizer), its scheduler, its lr multiple ``factor``, the
    values of the other knobs it trains with and, for an annealed copy, its ramp ``(first step,
    length)``."""

    __slots__ = ("_mark", "_watched", "factor", "late", "lost", "ramp", "replica", "scaled", "scaler",
                 "scheduler", "values")

    def __init__(self, factor: float, replica: Replica, scheduler: LRScheduler | None,
                 ramp: tuple[int, int] | None = None, values: dict[str, float] | None = None) -> None:
        self.factor, self.replica, self.scheduler, self.ramp = factor, replica, scheduler, ramp
        self.values: dict[str, float] = dict(values or {})
        self.lost = False  # non-finite at a cut: no longer trained (only your run is kept so)
        self.late = False  # a knob fork branched late from your run (knob_start): kept by every cut
        self.scaled = False  # the multiple is written into its optimizer and scheduler (your run, won)
        self.scaler: Any = None  # its GradScaler (bind_scalers), or a saved one's state until then
        self._watched: tuple[list[torch.Tensor], list[torch.nn.Module]] | None = None  # see watched()
        replica._values["lr"] = factor
        replica._values.update(self.values)

    @property
    def model(self) -> torch.nn.Module:
        return self.replica.model

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self.replica.optimizer

    @property
    def multiple(self) -> float:
        """What an optimizer step multiplies its learning rates by: the fork's multiple, unless
        that is written into its optimizer and scheduler already."""
        return 1.0 if self.scaled else self.factor

    def multiple_at(self, step: int) -> float:
        """The multiple an optimizer step at ``step`` applies: :attr:`multiple`, falling linearly to
        0 over an annealed copy's ramp."""
        if self.ramp is None:
            return self.multiple
        first, k = self.ramp
        return self.multiple * ((k - (step - first)) / (k + 1))  # in this order: runs repeat bit for bit

    def scale_lrs(self) -> None:
        """Write the multiple into the optimizer's and the scheduler's learning rates (every group's
        ``lr``, ``initial_lr`` and OneCycleLR's ``max_lr`` and ``min_lr``; each scheduler's
        ``base_lrs``, ``_last_lr``, CyclicLR's ``max_lrs`` and a cosine's ``eta_min``, those a
        SequentialLR or ChainedScheduler holds included): the state plain training at the multiple
        holds, so training goes on at it without hpx (the winner, loaded into your objects)."""
        m = self.factor
        if self.scaled or m == 1.0:
            self.scaled = True
            return
        for g in self.optimizer.param_groups:
            for key in ("lr", "initial_lr", "max_lr", "min_lr"):
                v = g.get(key)
                if torch.is_tensor(v):
                    v.mul_(m)
                elif isinstance(v, Real) and not isinstance(v, bool):
                    g[key] = v * m
        todo = [] if self.scheduler is None else [self.scheduler]
        while todo:
            s = todo.pop()
            todo += list(getattr(s, "_schedulers", ()))
            for attr in ("base_lrs", "_last_lr", "max_lrs"):
                v = getattr(s, attr, None)
                if isinstance(v, list):
                    setattr(s, attr, [x * m for x in v])
            if isinstance(getattr(s, "eta_min", None), Real):
                s.eta_min = s.eta_min * m
        self.scaled = True

    def setting(self) -> dict[str, float]:
        """``{"lr": the lr multiple, knob: value, ...}``."""
        return {"lr": self.factor, **self.values}

    def distance(self, bases: dict[str, float]) -> float:
        """How far from your run, for ties: ``|log m|``, plus 1 per knob away from its value."""
        return abs(math.log(self.factor)) + sum(v != bases[k] for k, v in self.values.items())

    def apply(self, knobs: Sequence[Knob]) -> None:
        """Write the knobs' values into this fork (a dropout rate, a group's weight decay; a value
        the loss reads is published as ``replica.value(name)``)."""
        self.replica._values["lr"] = self.factor
        for k in knobs:
            setter = k.bind(self.replica)
            if setter is not None:
                setter(self.values[k.name])
            self.replica._values[k.name] = self.values[k.name]

    def copied(self, index: int, ramp: tuple[int, int] | None = None,
               factor: float | None = None, values: dict[str, float] | None = None,
               shared: dict[int, Any] | None = None, sharder: Any = None) -> _Fork:
        """A deep copy of this fork's model, optimizer and scheduler (one copy: the optimizer holds
        the copied model's parameters and the scheduler the copied optimizer), at ``factor`` and
        ``values`` (default: this fork's; write them with :meth:`apply`); the tensors in ``shared``
        (a memo, :meth:`hpx.forks.share._Shared.memo`) are held by the copy as they are, not copied.
        With a ``sharder`` (:class:`hpx.forks.shard._Sharder`) the copy is sharded as this fork is."""
        memo = graph_tensors_detached(self.model)
        memo.update(shared or {})
        try:
            if sharder is not None:
                model, opt, sched = sharder.copied(self.model, self.optimizer, self.scheduler, shared or {})
            else:
                model, opt, sched = copy.deepcopy((self.model, self.optimizer, self.scheduler), memo)
        except (TypeError, copy.Error, RuntimeError) as e:
            raise ConfigError([f"Forks trains each fork on a deep copy of your model, optimizer and "
                               f"scheduler, and copy.deepcopy failed ({type(e).__name__}: {e}): keep what "
                               "cannot be copied (a lock, an open file, a process handle) off the model, "
                               "or give it a __deepcopy__"]) from e
        fork = _Fork(self.factor if factor is None else factor, Replica(index, model, opt), sched, ramp,
                     self.values if values is None else values)
        fork.scaler = copy.deepcopy(self.scaler)  # an annealed copy goes on at its fork's scale
        return fork

    def watched(self) -> tuple[list[torch.Tensor], list[torch.nn.Module]]:
        """Its parameters and dropout modules, listed once (walking the model at every step cost
        hundreds of microseconds on a 12-layer encoder): what :func:`_stepped_apart` compares."""
        if self._watched is None:
            dropout = torch.nn.modules.dropout._DropoutNd
            self._watched = (list(self.model.parameters()),
                             [m for m in self.model.modules() if isinstance(m, dropout)])
        return self._watched

    def take(self, winner: _Fork, knobs: Sequence[Knob]) -> None:
        """Become ``winner`` (your run, when a challenger wins): its weights, optimizer, scheduler
        and GradScaler states loaded into your objects, its values written, its multiple written
        into the learning rates so that training goes on at it without hpx."""
        self.model.load_state_dict(winner.model.state_dict())
        self.optimizer.load_state_dict(winner.optimizer.state_dict())
        if self.scheduler is not None:
            self.scheduler.load_state_dict(winner.scheduler.state_dict())
        if hasattr(self.scaler, "load_state_dict") and hasattr(winner.scaler, "state_dict"):
            self.scaler.load_state_dict(winner.scaler.state_dict())
        self.factor, self.values, self.lost = winner.factor, dict(winner.values), False
        self.apply(knobs)  # a dropout rate is no part of the model's state
        self.scale_lrs()

    def state(self, parent: int | None = None) -> dict[str, Any]:
        """Its model, optimizer, scheduler and settings (a sharded fork's: this rank's shards)."""
        model, opt = self.model.state_dict(), self.optimizer.state_dict()
        if any(is_dtensor(p) for p in self.model.parameters()):
            model, opt = local_state(model), local_state(opt)
        return {"factor": self.factor, "scaled": self.scaled, "values": dict(self.values), "lost": self.lost,
                "ramp": self.ramp, "late": self.late,
                "parent": parent, "model": model,
                "scaler": self.scaler.state_dict() if hasattr(self.scaler, "state_dict") else self.scaler,
                "optimizer": opt,
                "scheduler": None if self.scheduler is None else self.scheduler.state_dict()}

    def load(self, state: dict[str, Any], knobs: Sequence[Knob]) -> None:
        if any(is_dtensor(p) for p in self.model.parameters()):
            load_local(self.model, self.optimizer, state["model"], state["optimizer"])
        else:
            self.model.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
        if self.scheduler is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        self.factor, self.lost = float(state["factor"]), bool(state["lost"])
        self.late = bool(state.get("late", False))  # states saved before it was kept: none branched late
        self.scaled = bool(state.get("scaled", False))  # states saved before it was kept: not scaled
        self.scaler = state.get("scaler")  # a state, made a GradScaler again at the next step
        self.values = {k: float(v) for k, v in state["values"].items()}
        self.ramp = None if state["ramp"] is None else (int(state["ramp"][0]), int(state["ramp"][1]))
        self.apply(knobs)


def model_params(f: _Fork) -> Iterable[torch.Tensor]:
    """What ``max_grad_norm`` clips in a fork: its model's parameters, as in a plain loop."""
    return f.model.parameters()


def bind_scalers(start: _Fork, trained: Sequence[_Fork], scaler: Any) -> None:
    """Each fork's own ``torch.amp.GradScaler``: yours for your run (``start``); for every other
    fork a copy of yours made when it is first trained with one (a saved state loaded into it).
    An overflow halves only the scale of the fork that overflowed, as in plain training at its
    multiple: one scaler for all would let a challenger's overflows shrink your run's scale."""
    if scaler is None:
        return
    if start.scaler is not scaler and isinstance(start.scaler, dict):  # resumed: yours as it was saved
        scaler.load_state_dict(start.scaler)
    start.scaler = scaler
    for f in trained:
        if f is not start and not hasattr(f.scaler, "scale"):
            own = copy.deepcopy(scaler)
            if f.scaler is not None:
                own.load_state_dict(f.scaler)
            f.scaler = own


def type_name(obj: Any) -> str | None:
    """An optimizer's or scheduler's class, as a checkpoint records it (``None``: no scheduler)."""
    return None if obj is None else f"{type(obj).__module__}.{type(obj).__qualname__}"


def knob_values(knob: Knob) -> list[float]:
    """The values a knob's forks take: its base (your value) moved by its spread to each side
    (``base / span`` and ``base * span`` for a geometric spread, ``base * (1 -+ spread)`` for a
    multiplicative one, ``base -+ spread`` for an additive one), by one rule for every bound:

    * a side past a bound is left out, not moved onto the bound (dropout 0.8 with a spread of 0.2
      forks at 0.6 only, not at a chance-level 0.99);
    * a side equal to your value is left out;
    * so from a value at a bound a knob explores inward only (dropout or label smoothing from 0
      with a spread of 0.2 forks at 0.2 only; dropout from 0.99 at 0.79 only);
    * a multiplicative knob at 0 (weight decay off), which no ratio moves, explores upward to its
      ``from_zero`` (:meth:`~hpx.Knob.from_zero_value`; ``hpx.WeightDecay``: 0.01 for AdamW, 5e-4
      otherwise, unless given); nothing lies below 0 for it. Without one it has no side
      (:func:`knob_side_problems` asks for it)."""
    b, w = knob.base, knob.spread
    if knob.kind == "mul" and b == 0:
        up = knob.from_zero_value()
        raw = [] if up is None else [up]
    elif knob.spacing == "log":
        raw = [b * math.exp(-w), b * math.exp(w)]
    elif knob.kind == "mul":
        raw = [b * (1 - w), b * (1 + w)]
    else:
        raw = [b - w, b + w]
    out: list[float] = []
    for v in raw:
        inside = knob.low <= v <= knob.high and not (knob.kind == "mul" and v <= 0)
        if inside and v != b and v not in out:
            out.append(v)
    return out


def knob_side_problems(knobs: Sequence[Knob]) -> list[str]:
    """Knobs with no value to fork at: a spread that puts both sides of your value outside its
    bounds, or a multiplicative knob at 0 without a ``from_zero`` (or with one outside its bounds)."""
    problems = []
    for k in knobs:
        if knob_values(k):
            continue
        if k.kind == "mul" and k.base == 0:
            up = k.from_zero_value()
            if up is None:
                problems.append(f"{k.name}: your value is 0, and a multiplicative knob cannot move from 0 by "
                                "a ratio (its span or spread), so its only fork is upward, to a value the "
                                f"knob does not know: give from_zero=... (e.g. {type(k).__name__}(..., "
                                "from_zero=0.01)), the value its upper fork takes when your value is 0")
            else:
                problems.append(f"{k.name}: your value is 0 and its upper fork would take from_zero={up:g}, "
                                f"outside its bounds [{k.low:g}, {k.high:g}]: give from_zero=... inside "
                                "them")
            continue
        problems.append(f"{k.name}: a spread of {k.spread:g} from your value {k.base:g} puts both sides "
                        f"outside its bounds [{k.low:g}, {k.high:g}], so there is no value to fork at: give "
                        "a smaller spread (each side is your value moved by the spread; a side outside the "
                        "bounds is left out)")
    return problems


def knobs_problems(knobs: Any, loss_fn: Any = None) -> list[str]:
    """Knobs Forks cannot fork: not knobs, the learning rate (forked by ``multiples``), no spread
    (nothing to fork at), a schedule, a name used twice; a knob your loss reads
    (``rep.value(name)``, label smoothing) without a probe ``loss_fn`` of its own, since each fork
    would then be scored by a loss of its own definition."""
    from hpx.knobs.optim import LearningRate, LearningRateScale

    if isinstance(knobs, Knob) or not isinstance(knobs, (list, tuple)):
        return [f"knobs must be a list of hpx knobs, e.g. [hpx.Dropout(spread=0.2)] (got "
                f"{_checks.shown(knobs)})"]
    problems, names = [], ["lr"]
    for k in knobs:
        if not isinstance(k, Knob):
            problems.append(f"knobs must be hpx knobs, e.g. hpx.Dropout(spread=0.2) (got {_checks.shown(k)})")
        elif isinstance(k, (LearningRate, LearningRateScale)):
            problems.append(f"knob {k.name!r} writes the learning rate, which Forks forks by multiples=...: "
                            "leave it out of knobs")
        elif k.spread <= 0:
            problems.append(f"knob {k.name!r} has no spread: give spread=... (or span=... for a "
                            "multiplicative knob), how far its forks sit from your value")
        elif k.scheduled:
            problems.append(f"knob {k.name!r} has a schedule; Forks holds each fork's value fixed: "
                            "leave the schedule out")
        elif k.name in names:
            problems.append(f"knob name {k.name!r} is used twice (or is 'lr', the forks' multiple): "
                            "name each knob once")
        elif type(k).bind is Knob.bind and loss_fn is None:
            problems.append(f"knob {k.name!r} is read by your loss (rep.value({k.name!r})), and the probe is "
                            "scored with the training loss unless you give loss_fn=: each fork would be "
                            "judged by a loss of its own definition. Give loss_fn= for the probe (without "
                            "the knob: plain cross-entropy)")
        else:
            names.append(k.name)
    return problems


_LOST = object()  # a fork that had no annealed copy (it was lost before the cut)


def paired_gain(a: torch.Tensor, b: torch.Tensor) -> float:
    """How many standard errors the losses ``a`` lie below ``b`` (``[U]`` each, paired unit by
    unit): the mean of ``b - a`` over its standard error; ``inf`` when only ``a`` is finite
    everywhere, ``-inf`` the other way round, 0 when they are equal everywhere, and 0 for a single
    unit (one difference says nothing about its noise)."""
    fa, fb = bool(torch.isfinite(a).all()), bool(torch.isfinite(b).all())
    if not (fa and fb):
        return math.inf if fa else -math.inf
    d = (b - a).double()
    if len(d) < 2:
        return 0.0
    se = float(d.std()) / math.sqrt(len(d))
    mean = float(d.mean())
    if se == 0.0:
        return 0.0 if mean == 0.0 else math.copysign(math.inf, mean)
    return mean / se


def _ranked(scores: list[float], distances: list[float]) -> list[int]:
    """Indices best first; ties go to the fork nearer to your run (:meth:`_Fork.distance`)."""
    return sorted(range(len(scores)), key=lambda i: (scores[i], distances[i]))


def _forward_backward(f: _Fork, loss_fn: LossFn, batch: Any, scale: float, scaler: Any) -> torch.Tensor:
    loss = loss_fn(f.replica, batch)
    if not torch.is_tensor(loss) or loss.numel() != 1:
        raise TypeError(f"loss_fn must return a scalar tensor (got {_checks.shown(loss)})")
    out = loss * scale if scale != 1 else loss
    if not out.requires_grad:
        raise ConfigError([_checks.no_grad_problem(f.model, loss, f"the fork at {f.factor:g}x")])
    (scaler.scale(out) if scaler is not None else out).backward()
    return loss.detach().reshape(())


def _unreached(trained: list[_Fork], start: _Fork, how: str = "") -> list[str]:
    """Forks other than your run whose backward gave none of their parameters a gradient: a loss_fn
    that computes the loss with your model object instead of the model it is given (``rep.model``)
    trains your run once per fork and the copies never (checked at the first step)."""
    bad = [f for f in trained if f is not start and any(p.requires_grad for p in f.model.parameters())
           and all(p.grad is None for p in f.model.parameters())]
    if not bad:
        return []
    for f in trained:  # nothing is stepped: the gradients your model took for the others go
        f.optimizer.zero_grad(set_to_none=True)
    start.optimizer.zero_grad(set_to_none=True)
    how = how or ("loss_fn must compute the loss with the model it is given (lambda rep, batch: "
                  "loss(rep.model(batch[0]), batch[1])), not with your model object")
    return [f"the loss of the fork at {bad[0].factor:g}x reached none of its parameters: {how}; every fork "
            "is a copy of your model"]


def common_draws(device: torch.device, calls: Sequence[Callable[[], Any]],
                 others: list[bool | None] | None = None) -> list[Any]:
    """Every call's result, each call made from the global random streams as they were before the
    first (torch's on the CPU and ``device``, Python's, NumPy's), the streams then left as the first
    call left them. So at every step
    each fork draws the random numbers your run draws (its dropout masks), which are those plain
    training at the fork's multiple would draw, whatever else takes from the stream between steps
    (a DataLoader's shuffle): common random numbers, which also pair the forks' comparison.

    ``others``: ``[None]`` decides at this call whether Python's and NumPy's streams are replayed
    from now on (whether the first call drew from them; reading and writing NumPy's costs some 30
    microseconds each, several times a step), and holds the answer for the next calls."""
    if len(calls) < 2:
        return [c() for c in calls]
    full = others is None or others[0] is not False
    before = _rng_get(device, full)
    out = [calls[0]()]
    after = _rng_get(device, full)
    if others is not None and others[0] is None:  # the first step: does the model draw from them?
        others[0] = _moved(before, after)
        if not others[0]:
            before = {k: v for k, v in before.items() if k in ("cpu", "cuda")}
            after = {k: v for k, v in after.items() if k in ("cpu", "cuda")}
    try:
        for c in calls[1:]:
            _rng_set(before, device)
            out.append(c())
    finally:
        _rng_set(after, device)
    return out


def _unstepped(scheduler: Any) -> bool:
    """Whether ``scheduler`` (or one that a SequentialLR or ChainedScheduler holds, which keep no
    step count of their own) has not stepped since it was built."""
    n = getattr(scheduler, "_step_count", None)
    if n is not None:
        return n == 1
    return any(_unstepped(s) for s in getattr(scheduler, "_schedulers", ()))


def _device(model: torch.nn.Module) -> torch.device:
    return next((p.device for p in model.parameters()), torch.device("cpu"))


def _rng_get(device: torch.device, others: bool = True) -> dict[str, Any]:
    """The global random streams a model on ``device`` may draw from: torch's on the CPU and on the
    device, and (``others``) Python's ``random`` and NumPy's (a LayerDrop, a SpecAugment mask)."""
    state: dict[str, Any] = {"cpu": torch.random.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    if others:
        state["python"] = random.getstate()
        numpy = sys.modules.get("numpy")  # imported by the user or a library: else nothing draws from it
        if numpy is not None:
            state["numpy"] = numpy.random.get_state()
    return state


def _moved(before: dict[str, Any], after: dict[str, Any]) -> bool:
    """Whether Python's or NumPy's stream moved between two :func:`_rng_get` states."""
    if before.get("python") != after.get("python"):
        return True
    a, b = before.get("numpy"), after.get("numpy")
    return a is not None and b is not None and (a[2] != b[2] or not (a[1] == b[1]).all())


def _rng_set(state: dict[str, Any], device: torch.device) -> None:
    torch.random.set_rng_state(state["cpu"])
    if "python" in state:
        random.setstate(state["python"])
    if "cuda" in state and device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda"], device)
    if "numpy" in state:
        sys.modules["numpy"].random.set_state(state["numpy"])


def _plain(v: Any) -> Any:
    """Settings compared across a checkpoint: tuples and lists alike."""
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    return v


def _settings_problems(model: torch.nn.Module, optimizer: Any, total_steps: Any, schedule: Any, probe: Any,
                       loss_fn: Any, multiples: Any, cuts: Any, cool: Any, confidence: Any) -> list[str]:
    problems = []
    if not isinstance(optimizer, torch.optim.Optimizer):
        problems.append(f"optimizer must be a torch.optim.Optimizer built on the model's parameters, or a "
                        f"factory model -> Optimizer (got {_checks.shown(optimizer)})")
    else:
        own = {id(p) for p in model.parameters()}
        foreign = sum(id(p) not in own for g in optimizer.param_groups for p in g["params"])
        if foreign:
            problems.append(f"the optimizer holds {foreign} parameter(s) that are not the model's: every "
                            "fork copies the model, so a parameter outside it would be trained by every fork "
                            "at once; register it on the model (or wrap the model and the loss module in one "
                            "nn.Module) and build the optimizer on model.parameters()")
        problems += _checks.closure_problems(optimizer)
        problems += [f"parameter group {i}'s lr is {g['lr']!r}: give a finite learning rate > 0 (each fork "
                     "trains at a multiple of it)" for i, g in enumerate(optimizer.param_groups)
                     if isinstance(g.get("lr"), float) and not (math.isfinite(g["lr"]) and g["lr"] >= 0)]
    if isinstance(model, torch.nn.parallel.DistributedDataParallel) or any(
            type(p).__name__ == "DTensor" for p in model.parameters()):
        problems.append("Forks averages each fork's gradients over the ranks itself: pass the bare model, "
                        "not one wrapped in DistributedDataParallel or sharded with FSDP")
    if not isinstance(total_steps, Integral) or isinstance(total_steps, bool) or total_steps < 2:
        problems.append(f"total_steps must be an integer >= 2, the run's length in optimizer steps "
                        f"(got {total_steps!r})")
    if isinstance(schedule, ReduceLROnPlateau):
        problems.append("schedule=ReduceLROnPlateau steps on a metric your loop measures, which Forks cannot "
                        "give each fork: pass a step-driven scheduler (OneCycleLR, CosineAnnealingLR, a "
                        "LambdaLR, ...) or no schedule")
    elif isinstance(schedule, LRScheduler):
        if schedule.optimizer is not optimizer:
            problems.append("the schedule is built on another optimizer than the one given: build it on "
                            "the optimizer you pass")
    elif schedule is not None and not callable(schedule):
        problems.append(f"schedule must be a torch LRScheduler, a function step -> factor, or None (got "
                        f"{_checks.shown(schedule)})")
    if not isinstance(probe, Iterable) or isinstance(probe, (str, bytes)):
        problems.append(f"probe must be a list of held-out batches, e.g. probe=[(x_val, y_val)] (got "
                        f"{_checks.shown(probe)})")
    elif isinstance(probe, Sized) and len(probe) == 0:
        problems.append("probe is empty: give at least one batch of held-out data")
    elif not isinstance(probe, Sized) or isinstance(probe, Iterator):
        problems.append(f"probe is a {type(probe).__name__}, which may not iterate twice: give a list of "
                        "batches, or the DataLoader itself rather than iter(loader) (it is read at every "
                        "cut)")
    else:
        problems += _one_batch_problems(probe, "probe", "probe=[{batch}]")
    if loss_fn is not None and not callable(loss_fn):
        problems.append(f"loss_fn must be a function (replica, batch) -> loss, or None (got "
                        f"{_checks.shown(loss_fn)})")
    ms = list(multiples) if isinstance(multiples, (list, tuple)) else None
    if not ms or not all(isinstance(m, Real) and not isinstance(m, bool) and 0 < m < math.inf for m in ms) \
            or 1.0 not in ms or len(set(ms)) != len(ms):
        kind = "" if ms is not None else "a tuple or list of "
        problems.append(f"multiples must be {kind}distinct numbers > 0, one of them 1 (your run), e.g. "
                        f"(0.1, 1, 10) (got {multiples!r})")
    cs = list(cuts) if isinstance(cuts, (list, tuple)) else None
    ok = cs is not None and all(isinstance(c, (list, tuple)) and len(c) == 2 and isinstance(c[0], Real)
                                and isinstance(c[1], Integral) and not isinstance(c[1], bool) for c in cs)
    if not ok or any(not 0 < c[0] < 1 or c[1] < 1 for c in cs) or any(c[1] < 2 for c in cs[:-1]) or any(
            a[0] >= b[0] or a[1] <= b[1] for a, b in itertools.pairwise(cs)):
        problems.append(f"cuts must be (share of the run, forks kept) pairs, shares rising in (0, 1) and "
                        f"counts falling, each at least 2 but the last, which may be 1 (the final decision "
                        f"before the run's end), e.g. ((0.05, 2), (0.5, 1)) (got {cuts!r})")
    if not isinstance(cool, Real) or isinstance(cool, bool) or not 0 <= cool < 1:
        problems.append(f"cool must be a share of the run in [0, 1) (got {cool!r})")
    elif ok and cs and any(a[0] + cool >= b[0] for a, b in itertools.pairwise(
            [*cs, (1.0, 0)])):  # every cut's copies, the last one's too, are scored before the run's end
        problems.append(f"cool={cool} overlaps the cuts {cuts!r}: a cut's annealed copies must be scored "
                        "before the next cut starts (the last cut's before the run's end); give cuts "
                        "further apart or a smaller cool")
    if not isinstance(confidence, Real) or isinstance(confidence, bool) or not 0 <= confidence < math.inf:
        problems.append(f"confidence must be a number >= 0 (got {confidence!r})")
    return problems


def state_problems(state: Any, settings: dict[str, Any], knobs: list[str], model: torch.nn.Module,
                   optimizer: torch.optim.Optimizer, scheduler: Any = None) -> list[str]:
    """Why a ``Forks`` with these ``settings`` and ``knobs`` on ``model``, ``optimizer`` and
    ``scheduler`` cannot take ``state`` (checked before anything changes)."""
    if not isinstance(state, dict) or state.get("format") != _FORMAT:
        got = state.get("format") if isinstance(state, dict) else type(state).__name__
        return [f"not a Forks state (format {got!r}, expected {_FORMAT!r}): give what Forks.state_dict() "
                "returned"]
    forks, clones = state.get("forks"), state.get("clones")
    keys = {"model", "optimizer", "factor"}
    if not (isinstance(forks, list) and isinstance(clones, list) and forks
            and all(isinstance(f, dict) and keys <= f.keys() for f in forks + clones)):
        return ["the state has no forks, or forks without a model, optimizer or multiple ('forks' and "
                "'clones' lists of Forks.state_dict()): give what Forks.state_dict() returned, unchanged"]
    most = len(settings["multiples"]) + 3 * len(knobs)  # "ladder": two lower rungs and an upper side
    if len(forks) > most or any(not isinstance(c.get("parent"), int) or not 0 <= c["parent"] < len(forks)
                                for c in clones):
        return [f"the state holds {len(forks)} forks (at most {most} here) or an annealed copy whose parent "
                "is not one of them: give what Forks.state_dict() returned, unchanged"]
    odd = [f"{k}={state.get(k, _SETTINGS_BEFORE.get(k))!r} (this run has {v!r})" for k, v in settings.items()
           if _plain(state.get(k, _SETTINGS_BEFORE.get(k))) != _plain(v)]
    if odd:
        done = (f" (it ended at step {state.get('step')}, decided: to train on past its end, load the saved "
                "model, optimizer and scheduler without hpx; they hold the winner at its learning rate)"
                if state.get("decided") else "")
        return [f"the saved run was built with other settings: {'; '.join(odd)}; build Forks with the saved "
                f"run's settings to resume it{done}"]
    for what, obj in (("optimizer", optimizer), ("scheduler", scheduler)):
        saved = state.get(f"{what}_type", type_name(obj))  # states saved before it was kept: not checked
        if saved != type_name(obj):
            return [f"the saved run's {what} is {saved or 'none'}, this one's {type_name(obj) or 'none'}: "
                    f"build Forks with the saved run's {what} to resume it"]
    if list(state.get("knobs", [])) != knobs:
        return [f"the saved run forked the knobs {list(state.get('knobs', []))}, this one {knobs}: build "
                "Forks with the saved run's knobs to resume it"]
    want = {k: tuple(local(v).shape) for k, v in model.state_dict().items()}  # a sharded fork: this rank's
    groups = [len(g["params"]) for g in optimizer.param_groups]
    for i, f in enumerate([*state["forks"], *state["clones"]]):
        have = {k: tuple(v.shape) for k, v in f["model"].items()}
        if have != want:
            diff = sorted(set(have.items()) ^ set(want.items()))[:3]
            return [f"fork {i} of the saved run has another model (first differences: {diff}): build Forks "
                    "on the saved run's architecture"]
        if [len(g["params"]) for g in f["optimizer"]["param_groups"]] != groups:
            return [f"fork {i} of the saved run has other optimizer parameter groups: build the optimizer "
                    "as the saved run did"]
    return []
