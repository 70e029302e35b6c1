"""Forks: the learning rate chosen between whole runs, by successive halving with a confident end.

The run is forked at its start into whole runs at several multiples ``m`` of the learning rate
(default ``0.1, 0.32, 1, 3.2, 10``), each a plain run of your model, optimizer and schedule on the
same batches. The fork at ``m = 1`` is your run itself: your model, optimizer and scheduler, and
the global random stream (dropout draws) as plain training would use it. Every other fork starts
from copies of them, and at every step draws the random numbers your run draws (the stream is
rewound for it), so all forks see the same batches and the same draws: those plain training at the
fork's multiple would see.

At 10% of the run the forks are cut to 3, at 25% to 2 (your run and the best challenger), each
cut scored on held-out batches (``probe``) at a copy of every challenger annealed over the next 5%
of the run (the copies train alongside the forks on the same batches and are dropped once scored,
so a cut is decided 5% of the run after it starts; a copy's lr multiple is taken linearly to 0:
the fork as it would end if the run ended there). Your run survives every cut, so it needs no
copy; it is scored there only if a decision reads it (else ``nan``). At the end the challenger
replaces your run only if it scores better on the probe by ``confidence`` (2) standard errors of the
per-example difference of their losses, or if your run ended no better on the probe than the
initial weights did (a lost run) while the challenger did. The winner's model, optimizer and
scheduler state are then loaded into your objects: after the last step ``forks.model`` is your
model holding the winner. A last cut that keeps one (``cuts=((0.05, 2), (0.54, 1))``) makes that
decision before the run's end instead, on annealed copies of your run and the challenger; the
rest of the run is plain training at the winner's multiple.

Other knobs (``knobs=[hpx.Dropout(spread=0.2), ...]``, ``knob_design="split"``): one fork per
knob moved down by its spread is raced with the lr's forks from the start (less regularization pays
early, where a cut sees it); one fork with every knob moved up branches from your run at 70% of the
run (``knob_start``) and goes to the end uncut (more regularization pays late). The end compares
the finished challengers with your run, the bar raised for their number (``hpx.forks.late``).

It costs optimizer steps (5 forks to 10% of the run, 3 to 25%, 2 to the end, and the annealed
copies: about 3x plain training's). Memory: what a fork trains is its own (trainable parameters,
their gradients, its optimizer state); what no step writes is held once for all forks and copies
(frozen parameters, and the buffers the first step left unwritten: ``share=True``), so a frozen
base under a small head costs about one model. The peak is at the first cut's window: five forks
and four annealed copies, and one fork's gradients (two under torch.distributed: ``step`` frees
each fork's right after its optimizer step: ``hpx.forks.early``). Why this design: ``docs/method.md``
("``hpx.Forks``: the confident end in hpx"); the peak as measured: ``docs/benchmarks.md``
(``python -m benchmarks.forks_memory``).

Under torch.distributed every rank trains every fork on its part of the batch (data-parallel
training), each fork's gradients averaged over the ranks as its backward ends, while the next
fork's runs. With ``shard=`` every fork is sharded over the ranks by FSDP2 instead (1/W of
each fork per rank, gradients reduce-scattered during each backward: ``hpx.forks.shard``). Floating
buffers are averaged before a fork is scored; rank 0's decisions are broadcast.
"""

from __future__ import annotations

import logging
import math
import time
import warnings
from collections.abc import Callable, Iterable, Sequence
from numbers import Real
from typing import Any, Union

import torch
from torch.optim.lr_scheduler import LambdaLR, LRScheduler

from hpx import _checks
from hpx.backends import default_backend
from hpx.backends.base import Collective
from hpx.errors import ConfigError
from hpx.forks.batched import Batched, batched_problems
from hpx.forks.decide import _Decisions
from hpx.forks.early import early_path, train_each
from hpx.forks.faults import _Faults
from hpx.forks.fork import (
    _LOST,
    _device,
    _Fork,
    _forward_backward,
    _settings_problems,
    _unstepped,
    bind_scalers,
    common_draws,
    knob_side_problems,
    knob_values,
    knobs_problems,
    model_params,
)
from hpx.forks.late import DESIGNS, planned
from hpx.forks.misuse import _Guards, _stepped_apart, model_problems, reached
from hpx.forks.probe import _layout, _Scoring, first_checked, probes_alike, ranks_start_alike
from hpx.forks.ranks import mean_over_ranks
from hpx.forks.record import dropout_record, optimizer_record, probe_record, schedule_record
from hpx.forks.shard import _Sharder, is_dtensor
from hpx.forks.share import _Shared
from hpx.forks.state import _State
from hpx.knobs.base import Knob
from hpx.replica import Replica
from hpx.signals import LossFn
from hpx.sync_record import SyncRecord

__all__ = ["CONFIDENCE", "COOL", "CUTS", "KNOB_DESIGN", "KNOB_START", "MULTIPLES", "Forks"]

log = logging.getLogger("hpx")

MULTIPLES: tuple[float, ...] = tuple(10 ** (k / 2) for k in range(-2, 3))
"""The default lr multiples of the forks: half a decade apart, from 10x below to 10x above."""
CUTS: tuple[tuple[float, int], ...] = ((0.10, 3), (0.25, 2))
"""The default cuts: ``(share of the run, forks kept)``; the last cut, to one, is at the run's end."""
COOL = 0.05
"""The default share of the run over which a cut's annealed copies train before they are scored."""
CONFIDENCE = 2.0
"""The default ``z``: standard errors by which a challenger must beat your run at the end."""
KNOB_START = 0.7
"""The share of the run at which the knob forks branch from your run (``docs/method.md``, "Knobs that
pay late")."""
KNOB_DESIGN = "split"
"""The lower sides (one fork per knob) raced from the start with the lr's forks; the upper, one joint
fork, branched late (``docs/method.md``, "Knobs that pay late")."""


class Forks(_Decisions, _Scoring, _Faults, _State, _Guards):
    """A learning-rate search that trains whole runs at several multiples of your learning rate
    and keeps yours unless another is better with confidence (see the module's docstring).

    Args:
        model: your model (the fork at ``m = 1``; the others are copies of it).
        optimizer: your optimizer, built on ``model``'s parameters with the (peak) learning rates
            you would have used (or a ``factory(model) -> Optimizer``).
        total_steps: the run's length in optimizer steps (required): the cuts are placed on it and the
            final decision is made after its last step.
        schedule: the lr's shape: a torch ``LRScheduler`` built on ``optimizer`` (stepped by
            hpx, once per optimizer step of each fork: do not step it yourself), or ``f(step) ->
            factor`` (a ``LambdaLR``), or ``None`` (constant). Each fork trains at ``m`` times the
            scheduler's learning rates; a momentum or beta1 cycle the scheduler writes is
            followed as it is.
        probe: held-out batches the forks are scored on at every cut (all of them, in eval mode):
            a list, or anything that can be iterated again (a DataLoader), in the same order on
            every rank.
        loss_fn: ``loss_fn(replica, batch)`` for the probe; default: the loss given to
            :meth:`step`. It may return the loss of every example (``reduction="none"``): the
            final test pairs the two runs example by example, and otherwise evaluates each example
            alone (by ``torch.func.vmap``, or one at a time where vmap cannot run the loss).
        multiples: the forks' lr multiples; ``1`` must be one of them (your run).
        cuts: ``(share of the run, forks kept)`` pairs, shares rising in ``(0, 1)``, counts falling
            and at least 2, but the last, which may be 1: the final decision, made then on annealed
            copies of your run and the challengers left instead of at the run's end (the rest of
            the run is plain training; fewer steps, a decision on shorter runs).
        cool: the share of the run over which each cut's annealed copies train before they are
            scored (``0``: score the forks as they are, at the cut).
        confidence: ``z``: a challenger replaces your run only by a lead of ``z`` standard errors (0: any).
        knobs: other knobs to fork, each declared with a spread (``hpx.Dropout(spread=0.2)``,
            ``hpx.WeightDecay(span=10)``, ``hpx.LabelSmoothing(spread=0.1)``): forks at your lr
            with knobs moved by their spreads, down and up (``knob_design``; a side outside a knob's
            bounds is left out; a multiplicative knob at 0 forks upward to its ``from_zero``). A
            challenger changes the lr or the knobs, not both.
        knob_start: the share of the run at which the late knob forks (the upper one under
            ``"split"``) branch from your run, each a copy of it then at its knob values, going to
            the end uncut (default 0.7; ``0``: every knob fork starts with the lr's and is cut with
            them). What more regularization buys often shows only late, as a finished run.
        knob_design: ``"split"`` (default): one fork per knob moved down by its spread, raced from
            the start with the lr's forks, and one with every knob moved up, branched at
            ``knob_start``; ``"joint"``: both branched there, every knob moved down in one, up in
            the other; ``"each"``: two per knob there; ``"ladder"``: ``"split"`` with two lower forks
            per knob, one and two spreads down (``knob_rungs``). The best of several challengers at
            the end must clear ``confidence`` raised for their number (``hpx.forks.late``).
        backend: the :class:`~hpx.backends.Collective` (default: this process alone); with
            ``hpx.backends.TorchDistributed()`` each fork is data-parallel over the ranks.
        on_sync: a function (or a list of them) called with the :class:`~hpx.SyncRecord` of each
            decision, on every rank (e.g. ``hpx.TensorBoard(...)``).
        share: hold once for every fork what no step writes: frozen parameters
            (``requires_grad=False``) from the start, and the buffers the first step left unwritten
            (a BatchNorm's running statistics never are). A frozen parameter unfrozen later must be
            unfrozen through :meth:`each`; a shared buffer written at a later step stops the run
            with its name. ``False``: every fork copies everything.
        shard: under torch.distributed, a function that shards a model in place with FSDP2, as
            your FSDP2 script would (``fully_shard`` on each block, then on the whole model, on a
            mesh over every rank): applied to your model (in place; your optimizer's groups are
            pointed at its sharded parameters, so build Forks before the first step) and to every
            fork and annealed copy, so each rank holds 1/W of each. Pass the bare model. A
            checkpoint resumes only on the layout it was saved with.
        batched: past the first step of ``step`` in one process, train a small model's forks and copies
            as one ``torch.func.vmap`` computation (a step of four or more): equal within float tolerance,
            faster where a fork's step is overhead-bound; what it cannot take exactly falls back, with one
            warning (:mod:`hpx.forks.batched`). Not with ``shard=``, ``knobs=`` or torch.distributed.

    Attributes:
        history: a :class:`~hpx.SyncRecord` per decision (``phase`` ``"cut"`` or ``"end"``;
            ``values["lr"]`` the multiples scored, ``scores`` their probe losses (your run's ``nan``
            at a cut, which keeps it unscored), ``bases["lr"]`` the multiple the run trains at after it;
            at the end ``metrics["gain"]`` and ``metrics["bar"]``, the best challenger's lead in
            standard errors and what it had to clear, when the test ran).
        factor: the lr multiple your run trains at: 1 until the end, then the winner's (``m``).
        values: the other knobs' values your run trains at (``{name: value}``), the winner's after
            the end.
        bases: ``{"lr": factor, **values}``.
        factors: the lr multiples of the forks being trained, your run's first.
        multiples, cuts, cool, confidence, total_steps, knobs: the settings, as given.
        decided: whether the end's decision is made (the winner is in your objects).
        model: your model (your run; the winner once decided).
        step_count: optimizer steps taken (calls of :meth:`optimizer_step`).
        fork_steps: optimizer steps taken by all forks and annealed copies together: the
            search's cost in steps (``fork_steps / step_count``: the multiple of plain training's).

    Example::

        forks = hpx.Forks(model, torch.optim.AdamW(model.parameters(), lr=3e-4),
                          total_steps=len(loader), schedule=scheduler, probe=val_batches)
        for x, y in loader:
            forks.step(lambda rep, b: F.cross_entropy(rep.model(b[0]), b[1]), (x, y))
        model = forks.converge()  # your model, holding the winner
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: Union[torch.optim.Optimizer, Callable[[torch.nn.Module], torch.optim.Optimizer]],
        *,
        total_steps: int | None = None,  # required (None is refused, naming a misspelt one)
        probe: Iterable[Any],
        schedule: Callable[[int], float] | LRScheduler | None = None,
        loss_fn: LossFn | None = None,
        multiples: Sequence[float] = MULTIPLES,
        cuts: Sequence[tuple[float, int]] = CUTS,
        cool: float = COOL,
        confidence: float = CONFIDENCE,
        knobs: Sequence[Knob] = (),
        knob_start: float = KNOB_START,
        knob_design: str = KNOB_DESIGN,
        backend: Collective | None = None,
        on_sync: Callable[[SyncRecord], Any] | Sequence[Callable[[SyncRecord], Any]] = (),
        share: bool = True,
        shard: Callable[[torch.nn.Module], Any] | None = None,
        batched: bool = False,
        **unknown: Any,
    ) -> None:
        self._t0 = time.perf_counter()
        if not isinstance(model, torch.nn.Module):
            raise ConfigError([f"model must be a torch.nn.Module (got {_checks.shown(model)}): pass the "
                               "model first, then its optimizer"])
        if not isinstance(optimizer, torch.optim.Optimizer) and callable(optimizer):
            optimizer = optimizer(model)
        callbacks = list(on_sync) if isinstance(on_sync, Sequence) else [on_sync]
        problems = _settings_problems(model, optimizer, total_steps, schedule, probe, loss_fn, multiples,
                                      cuts, cool, confidence) + _checks.backend_problems(backend)
        problems += knobs_problems(knobs, loss_fn) + _checks.unknown_problems(unknown, Forks.__init__)
        problems += model_problems(model)  # meta tensors, a forward every copy would share, another Forks's
        problems += [f"on_sync must be a function record -> None, or a list of them (got {on_sync!r})"
                     for _ in callbacks[:1] if not all(callable(c) for c in callbacks)]
        problems += [f"share must be True or False (got {_checks.shown(share)})" for _ in [0]
                     if not isinstance(share, bool)]
        problems += [f"shard must be a function that shards a model in place, e.g. shard=lambda m: "
                     f"fully_shard(m, mesh=mesh), or None (got {_checks.shown(shard)})" for _ in [0]
                     if shard is not None and not callable(shard)]
        problems += [f"knob_start must be a share of the run in [0, 1) (got {_checks.shown(knob_start)})"
                     for _ in [0] if not (isinstance(knob_start, Real) and 0 <= knob_start < 1)]
        problems += [f"knob_design must be one of {', '.join(map(repr, DESIGNS))} (got "
                     f"{_checks.shown(knob_design)})" for _ in [0] if knob_design not in DESIGNS]
        problems += batched_problems(batched, shard, knobs, backend)
        ConfigError.check(problems)
        assert isinstance(optimizer, torch.optim.Optimizer)
        self.collective: Collective = backend if backend is not None else default_backend()
        self.total_steps = int(total_steps)
        self.multiples = tuple(float(m) for m in multiples)
        self.cuts = tuple((float(s), int(k)) for s, k in cuts)
        self.cool, self.confidence = float(cool), float(confidence)
        self._probe = probe
        self._probe_fn = loss_fn
        self._probe_given = loss_fn is not None
        self._on_sync = callbacks
        self.knobs: tuple[Knob, ...] = tuple(knobs)
        for k in self.knobs:  # your value (read from the model or the optimizer, or given)
            k.resolve_base(Replica(0, model, optimizer))
        ConfigError.check(knob_side_problems(self.knobs))
        bases = {k.name: k.base for k in self.knobs}
        settings = [(m, bases) for m in self.multiples if m != 1.0]
        self.knob_start, self.knob_design = float(knob_start), str(knob_design)
        sides = {k.name: knob_values(k) for k in self.knobs}
        early, self._late = planned(self.knobs, bases, self.knob_design, self.knob_start, sides)
        settings += [(1.0, v) for v in early]  # raced and cut with the lr's; the late ones branch (_branch)
        self._late_at = max(1, round(self.knob_start * self.total_steps))
        if self.cuts and self.cuts[0][1] >= 1 + len(settings):
            raise ConfigError([f"the first cut of cuts={list(self.cuts)} keeps {self.cuts[0][1]} of the "
                               f"{1 + len(settings)} forks: give cuts= that keep fewer than there are"])
        if schedule is not None and not isinstance(schedule, LRScheduler):
            schedule = LambdaLR(optimizer, schedule)
        ranks_start_alike(self, model, optimizer)
        # sharded forks: your model sharded in place, every other fork a sharded copy (_fork_shard)
        self._sharder = None if shard is None else _Sharder(model, optimizer, shard)
        self._batched = Batched() if batched is True else None  # the forks as one computation (batched=)
        self._shared = _Shared(model, share)  # what every fork holds once: frozen, then unwritten buffers
        if self._sharder is not None:  # FSDP shards a frozen parameter with the rest, per fork
            self._shared.params = []
        start = _Fork(1.0, Replica(0, model, optimizer), schedule, None)
        start.values = dict(bases)
        start.apply(self.knobs)
        # every other fork starts from a copy of your run
        self._forks: list[_Fork] = [start]
        for i, (m, values) in enumerate(settings, 1):
            self._forks.append(start.copied(i, factor=m, values=values, shared=self._shared.memo(),
                                            sharder=self._sharder))
            self._forks[-1].apply(self.knobs)
        self._bases = bases
        # what built the run, for a resume to check (the probe's at its first pass: _open)
        self._built: dict[str, Any] = {"optimizer": optimizer_record(optimizer, schedule is not None),
                                       "schedule": schedule_record(schedule, self.total_steps),
                                       "dropout": dropout_record(model), "probe": None}
        self._clones: list[_Fork] = []  # a cut's annealed copies, one per fork, while they train
        self._parents: list[int] = []  # ... and the fork each was copied from
        self._plan: dict[int, int] = {}  # step -> forks kept; cuts that round to one step follow each other
        for share, keep in self.cuts:
            at = max(1, round(share * self.total_steps), max(self._plan, default=0) + 1)
            if at < self.total_steps:
                self._plan[at] = keep
        self._decide_at: tuple[int, int] | None = None  # (step, keep) of the cut in progress
        self._initial: float | None = None  # the probe loss of the initial weights
        self._probe_units = 0  # the examples the end's test compared (known once it ran)
        self._vectorize: list[bool | None] = [None]  # a mean probe loss per example by vmap? (_each_example)
        self.factor = 1.0  # the lr multiple your run trains at: the winner's after the end
        self.values = dict(bases)  # ... and its knobs' values
        self.decided = False
        self.step_count = 0
        self.fork_steps = 0  # optimizer steps of every fork and copy: the search's cost in steps
        self._fresh = True  # no backward yet in this optimizer step
        self._outside = False  # your run is trained by a framework (the Hugging Face Trainer), not here
        # what a framework clips (Lightning: the optimizer's parameters) and zeroes (HF Trainer: the model)
        self._clip_params: Callable[[_Fork], Iterable[torch.Tensor]] = model_params
        self._zero_model = False
        self._apart: torch.Tensor | None = None  # on device: a gradient some ranks had and others not
        self._crossed: torch.Tensor | None = None  # on device: a step that met another rank's decision
        self._marks: Any = None  # shard= on a device-only group: step markers' tables held (hpx.forks.ranks)
        self._streams: list[bool | None] = [None]  # Python's and NumPy's replayed too (common_draws)
        self._warned = False
        self._scaled: bool | None = None  # whether the last backward was given a GradScaler
        # non-finite losses, read a step late without waiting on the device (one process): _read_losses
        self._losses_bad: tuple[list[_Fork], torch.Tensor] | None = None  # this step's, on device
        self._pending: tuple[int, list[_Fork], torch.Tensor, Any] | None = None  # the last step's
        self.history: list[SyncRecord] = []
        self._watch(model, optimizer)  # one Forks per model; your optimizer's steps that hpx did not take

    # --- the training step ------------------------------------------------------------------

    def step(self, loss_fn: LossFn, batch: Any) -> torch.Tensor:
        """One optimizer step of every fork on the whole ``batch``: :meth:`backward`, then
        :meth:`optimizer_step`, bit for bit. Returns the forks' losses (``[F]``, on device, in
        :attr:`factors` order: your run's first). Past the first step (without ``shard=``), each fork
        is stepped right after its backward (and its gradients' mean over the ranks), its gradients
        then freed (``.grad`` is ``None`` after it). A fork that fails after others stepped stops the
        run (:mod:`hpx.forks.early`: to skip failing batches, call backward, optimizer_step)."""
        if not early_path(self):
            losses = self.backward(loss_fn, batch)
            self.optimizer_step()
            return losses
        if self._batched is not None and (losses := self._batched.step(self, loss_fn, batch)) is not None:
            return losses  # batched=True: every fork in one torch.func computation (hpx.forks.batched)
        losses = self._backward(loss_fn, batch, 1.0, None, early=True)
        self._stepped(self._trained())
        return losses

    def backward(self, loss_fn: LossFn, batch: Any, *, scale: float = 1.0,
                 scaler: Any = None) -> torch.Tensor:
        """Forward and backward of every fork on the whole ``batch``, each drawing the random numbers
        your run draws; gradients add up until :meth:`optimizer_step` (call once per micro-batch to
        accumulate, with ``scale = 1 / k``; ``scaler``: a ``torch.amp.GradScaler``). Returns the
        forks' unscaled losses, as :meth:`step` (``nan`` for your run once it is lost: no longer
        trained)."""
        return self._backward(loss_fn, batch, scale, scaler)

    def _backward(self, loss_fn: LossFn, batch: Any, scale: float, scaler: Any, early: bool = False,
                  ) -> torch.Tensor:
        """:meth:`backward`; ``early``: each fork's optimizer step too (:func:`train_each`)."""
        _checks.check(_checks.loss_fn_problems(loss_fn, batch) + _checks.scale_problems(scale, scaler)
                      + _checks.batch_problems(batch, None))
        self._scaled = scaler is not None  # optimizer_step must be given it too
        bound = self._probe_fn is None  # the probe's loss defaults to this one, once a step succeeds
        if bound:
            self._probe_fn = loss_fn
        try:
            trained = self._open()
            if early:  # past the first step, one process: each fork checked and stepped after its backward
                found = train_each(self, trained, loss_fn, batch)
            else:
                bind_scalers(self._forks[0], trained, scaler)
                calls = [lambda f=f: _forward_backward(f, loss_fn, batch, scale,
                                                       None if scaler is None else f.scaler) for f in trained]
                before = _layout(batch) if self.step_count == 0 else None  # the first step checks loss_fn
                device = _device(self._forks[0].model)
                found = first_checked(lambda: common_draws(device, calls, self._streams), before, batch,
                                      trained, self._forks[0])
                if before is None:  # past the first step: a loss_fn that switched to your model object
                    ConfigError.check(reached(trained, self._forks[0]))
        except BaseException:
            self._fresh = True  # a failed backward (an OOM you skip) leaves no gradient behind
            if bound:  # a refused first step binds nothing: the corrected loop's loss scores the probe
                self._probe_fn, self._initial = None, None
                self._shared.forget()
            raise
        bad = ~torch.isfinite(torch.stack(found))  # device ops; the first bad step is kept on the device
        self._note_bad(bad)
        if self.collective.world_size == 1:  # read a step later (_read_losses)
            held = self._losses_bad
            self._losses_bad = (trained, bad if held is None else held[1] | bad)
        losses = {id(f): v for f, v in zip(trained, found)}
        if all(id(f) in losses for f in self._forks):
            return torch.stack([losses[id(f)] for f in self._forks])
        lost = torch.full((), math.nan, device=_device(self._forks[0].model))  # your run, no longer trained
        return torch.stack([losses.get(id(f), lost) for f in self._forks])

    def optimizer_step(self, *, max_grad_norm: float | None = None,
                       scaler: Any = None) -> torch.Tensor | None:
        """Step every fork's optimizer on its accumulated gradients (averaged over the ranks
        first), at its multiple of its scheduler's learning rates, then its scheduler; then count
        the step, and cut or decide when it is due. ``max_grad_norm`` clips each fork's gradient
        norm as ``torch.nn.utils.clip_grad_norm_``; returns the forks' norms before clipping
        (``[F]``) then, else ``None``."""
        if self._fresh:
            raise ConfigError(["optimizer_step() found no gradients: call forks.backward(loss_fn, batch) "
                               "first (once per micro-batch)"])
        problems = _checks.scaler_problems(scaler)
        if self._scaled is not None and self._scaled != (scaler is not None):
            problems.append("backward() and optimizer_step() must be given the same GradScaler (one had "
                            "scaler=, the other not): every fork would step on gradients still scaled")
        if max_grad_norm is not None and not (isinstance(max_grad_norm, Real)
                                              and not isinstance(max_grad_norm, bool) and max_grad_norm > 0):
            problems.append(f"max_grad_norm must be a number > 0 or None (got {max_grad_norm!r})")
        ConfigError.check(problems)
        trained = self._trained()
        self._reduce(trained)
        bind_scalers(self._forks[0], trained, scaler)
        for f in trained if scaler is not None else ():
            f.scaler.unscale_(f.optimizer)
        norms = None
        if max_grad_norm is not None:  # the annealed copies too, as their forks are (norms not shown)
            clipped = [torch.nn.utils.clip_grad_norm_(self._clip_params(f), float(max_grad_norm))
                       for f in trained]
            norms = torch.stack([n.full_tensor() if is_dtensor(n) else n
                                 for f, n in zip(trained, clipped) if f.ramp is None])
        self._note_applied(trained)  # under torch.distributed: a hash of the settings applied (host floats)
        for f in trained:
            self._step_one(f, None if scaler is None else f.scaler)
        for f in trained if scaler is not None else ():
            f.scaler.update()
        self._stepped(trained)
        return norms

    def _stepped(self, trained: list[_Fork]) -> None:
        """After every fork's optimizer step: what the step left, counted; a cut or decision due."""
        if self.step_count == 0:  # the buffers the first step left unwritten are held once from now on
            self._shared.share_buffers([f.model for f in self._forks])
        self._shared.settle()  # share=False: what a step writes is each fork's own (host reads only)
        self.fork_steps += len(trained) + self._outside  # a framework's step of your run counts too
        self._stash_losses()
        self._advance()

    def _open(self) -> list[_Fork]:
        """The forks a backward trains, their gradients cleared at an optimizer step's first
        micro-batch (and before the first step, the initial weights' probe loss)."""
        if self._fresh and self._sharder is not None and self.collective.world_size > 1:
            self._mark(f"starting step {self.step_count + 1}", 0)  # before FSDP's first collective
        if self._fresh:  # your objects changed alone, what is held once still shared (host reads only)
            ConfigError.check(self._misuse() or self._shared.problems() or _stepped_apart(self._forks))
            self._read_losses()
        if self._initial is None and not self.decided:
            self._initial = self._scores([self._forks[0]], first=True)[0]
            probes_alike(self.collective, self._initial)
            ConfigError.check([] if self._initial == self._initial else [
                "the probe's loss at your model's initial weights is nan: check the probe batches and the "
                "probe's loss_fn for NaN (nothing was trained)"])
            if self._built["probe"] is None:
                self._built["probe"] = probe_record(self._probe)
        trained = self._trained()
        if self._fresh and self.step_count == 0:  # which buffers does a step write? (share_buffers)
            self._shared.watch([f.model for f in self._forks])
        if self._fresh:
            for f in trained:
                f.optimizer.zero_grad(set_to_none=True)
                if self._zero_model:
                    f.model.zero_grad(set_to_none=True)
            self._fresh = False
        return trained

    def _trained(self) -> list[_Fork]:
        """The forks hpx trains: all but a lost run of yours (and yours when a framework trains it,
        ``_outside``), and the annealed copies in flight."""
        start = self._forks[0]
        return ([f for f in self._forks if not f.lost and not (f is start and self._outside)]
                + [c for c in self._clones if not c.lost])

    @torch.no_grad()
    def _reduce(self, trained: list[_Fork]) -> None:
        """Every fork's gradient <- its mean over the ranks (see :func:`hpx.forks.ranks.mean_over_ranks`);
        a parameter some ranks' losses reached and others' did not is named at the next decision."""
        if self.collective.world_size > 1 and self._sharder is None:  # FSDP reduced them in the backward
            apart, met = mean_over_ranks(trained, self.collective)
            self._apart = apart if self._apart is None or apart is None else self._apart | apart
            self._crossed = met if self._crossed is None or met is None else self._crossed | met

    def _step_one(self, f: _Fork, scaler: Any) -> None:
        m = f.multiple_at(self.step_count)  # an annealed copy's falls linearly to 0 over its ramp
        groups = f.optimizer.param_groups
        lrs = [g["lr"] for g in groups]
        if m != 1.0:
            for g in groups:
                g["lr"] = g["lr"] * m
        self._stepping = True  # your optimizer's step hook counts the steps hpx does not take
        try:
            if scaler is not None:
                scaler.step(f.optimizer)
            else:
                f.optimizer.step()
        finally:
            self._stepping = False
            if m != 1.0:  # the scheduler sees its own learning rates
                for g, lr in zip(groups, lrs):
                    g["lr"] = lr
        if f.scheduler is not None:
            if _unstepped(f.scheduler):  # a copy's optimizer step is not wrapped by torch's
                with warnings.catch_warnings():  # order check, which would warn once per copy
                    warnings.filterwarnings("ignore", message=r"Seems like `optimizer\.step\(\)`")
                    f.scheduler.step()
            else:
                f.scheduler.step()

    def _advance(self) -> None:
        self._fresh = True
        self.step_count += 1
        s = self.step_count
        if s == self.total_steps + 1 and not self._warned:
            self._warned = True
            log.warning("step %d is past total_steps=%d: the forks were decided at the run's end; "
                        "training goes on at the winner's multiple %.4g", s, self.total_steps, self.factor)
        due = (self._decide_at is not None and self._decide_at[0] <= s) or (
            self._plan.get(s) is not None and self.cool == 0) or (s == self.total_steps and not self.decided)
        if due:  # a decision's collectives follow: every rank must be at this step
            self._check_ranks(f"deciding at step {s}")
        if self._decide_at is not None and self._decide_at[0] <= s:  # a cut decided on its copies
            scored = [_LOST] * len(self._forks)
            if not self._forks[0].lost:  # your run is kept at every cut: scored as it is, not annealed
                scored[0] = self._forks[0]
            for i, c in zip(self._parents, self._clones):
                scored[i] = _LOST if self._forks[i].lost else c  # a fork lost since: its copy says nothing
            keep = self._decide_at[1]
            self._clones, self._parents, self._decide_at = [], [], None
            if keep == 1:  # the final decision before the run's end: the rest is plain training
                self._finish(scored)
            else:
                self._cut(keep, scored)
        keep = self._plan.get(s)  # after the decision due now: on a short run the next cut starts here
        if keep is not None and keep < len(self._forks) and not self.decided:
            k = min(max(1, round(self.cool * self.total_steps)), self.total_steps - s) if self.cool > 0 else 0
            if k > 0:  # anneal a copy of every challenger over the next k steps, then decide on them
                n = 1 + max(f.replica.index for f in self._forks)  # indices no fork trained now has
                self._parents = self._cut_parents(keep)  # late knob forks, and your run at a cut to 2+: none
                memo = self._shared.memo()
                self._clones = [self._forks[i].copied(n + j, ramp=(s, k), shared=memo, sharder=self._sharder)
                                for j, i in enumerate(self._parents)]
                self._decide_at = (s + k, keep)
            elif keep == 1:
                self._finish()
            else:
                self._cut(keep, self._forks)
        if s == self._late_at and self._late and not self.decided and s < self.total_steps:
            self._branch()
        if s == self.total_steps and not self.decided:
            self._finish()

    # --- inspection and the end ---------------------------------------------------------------

    @property
    def model(self) -> torch.nn.Module:
        """Your model: your run until the end, then holding the winner."""
        return self._forks[0].model

    @property
    def factors(self) -> list[float]:
        """The lr multiples of the forks being trained, your run's first."""
        return [f.factor for f in self._forks]

    @property
    def bases(self) -> dict[str, float]:
        """``{"lr": the multiple your run trains at, knob: its value, ...}``: yours until the end,
        then the winner's."""
        return {"lr": self.factor, **self.values}

    def converge(self) -> torch.nn.Module:
        """Decide now if the run's end has not decided yet (a loop shorter than ``total_steps``),
        and return your model, holding the winner. Under torch.distributed every rank calls it."""
        self._check_ranks("converge()")  # a rank that stepped more or fewer times, or trained apart, raises
        if not self.decided and 0 < self.step_count < self.total_steps:
            log.warning("hpx.Forks: converge() at step %d of total_steps=%d: the end is decided now, on runs "
                        "%d%% of the way through their schedules; give total_steps the number of steps the "
                        "loop takes", self.step_count, self.total_steps,
                        100 * self.step_count // self.total_steps)
        if not self.decided and self._probe_fn is None:  # no step yet, no loss_fn=: nothing to compare
            self._adopt(0)
        elif not self.decided:
            self._clones, self._parents, self._decide_at = [], [], None
            self._finish()
        return self.model

    def __repr__(self) -> str:
        shown = [round(m, 3) for m in self.factors]
        return (f"Forks(step={self.step_count}/{self.total_steps}, multiples={shown}, "
                f"factor={self.factor:.4g}, decided={self.decided})")

