"""Misuse of :class:`hpx.Forks` that would otherwise go unseen, refused before it changes anything:
a model that cannot be forked (on the meta device, or a forward set on the object that every copy
would share), a model another ``Forks`` is training, your own ``optimizer.step()`` between steps, a
``loss_fn`` that computes the loss with your model object after the first step, and an
:meth:`~hpx.Forks.each` that raised part way. The checks on the per-step path are host reads of a
few attributes: nothing waits on a device."""

from __future__ import annotations

import itertools
import types
import weakref
from collections.abc import Callable
from typing import Any

import torch

from hpx import _checks
from hpx.errors import ConfigError
from hpx.forks.fork import _device, _Fork, _unreached
from hpx.history import _fork_label
from hpx.replica import Replica

_RUNS: weakref.WeakKeyDictionary[torch.nn.Module, Any] = weakref.WeakKeyDictionary()
"""model -> a weak reference to the ``Forks`` training it (one at a time)."""


def _rebuilt_on_copy(module: torch.nn.Module) -> bool:
    """Whether ``module`` makes its instance-level forward anew when copied (``torch.compile(model)``'s
    wrapper does, in ``__setstate__``)."""
    try:
        from torch._dynamo.eval_frame import OptimizedModule
    except ImportError:  # pragma: no cover - torch without dynamo
        return False
    return isinstance(module, OptimizedModule)


def _own_method(module: torch.nn.Module) -> bool:
    """Whether the forward set on ``module`` is a method bound to it (a copy rebinds it to itself)."""
    fwd = module.__dict__["forward"]
    return isinstance(fwd, types.MethodType) and fwd.__self__ is module


def model_problems(model: torch.nn.Module) -> list[str]:
    """Why ``model`` cannot be forked: what every fork would copy wrongly, or another Forks's run
    (one that has stepped and not ended; an unstarted one is taken over: its steps are refused)."""
    problems = []
    meta = [n for n, t in itertools.chain(model.named_parameters(), model.named_buffers()) if t.is_meta]
    if meta:
        shown = ", ".join(meta[:3]) + (f" and {len(meta) - 3} more" if len(meta) > 3 else "")
        problems.append(f"{len(meta)} of the model's tensors are on the meta device ({shown}): they hold no "
                        "values to train or copy. Materialize them before building hpx.Forks "
                        "(model.to_empty(device=...) then initialize or load_state_dict them); with shard=, "
                        "pass the model with real weights, and Forks shards it")
    bound = [name or type(model).__name__ for name, m in model.named_modules()
             if "forward" in m.__dict__ and not _rebuilt_on_copy(m) and not _own_method(m)]
    if bound:
        problems.append(f"{bound[0]!r} has a forward set on the object itself (model.forward = "
                        "torch.compile(model.forward)?): every fork's copy would share it and run your "
                        "model's weights, not its own. Compile with model.compile() or torch.compile(model) "
                        "(each copy then compiles its own forward), or define forward in the class")
    held = _RUNS.get(model)
    other = held() if held is not None else None
    if other is not None and not other.decided and other.step_count > 0:  # an unstarted one is taken over
        problems.append(f"the model is already the run of another hpx.Forks ({other!r}), which has not "
                        "ended: both would step it. End that one first (its converge()), or build this Forks "
                        "on a new model")
    return problems


def _written_once(again: list[tuple[str, torch.Tensor]], once: dict[int, torch.Tensor],
                  after: dict[int, tuple[torch.Tensor, int]], fork: str) -> None:
    """Undo ``fn``'s second write, through ``fork``, to tensors every fork holds once (``again``):
    they go back to what ``fn`` made of them on your run (``once``); a tensor ``fn`` left alone on
    your run is refused."""
    stray = [n for n, t in again if id(t) not in once]
    if stray:
        raise ConfigError([f"fn wrote {', '.join(repr(n) for n in stray)}, which every fork holds once, "
                           f"through {fork} but not through your run: write it alike on every fork (fn runs "
                           "on your run first), or build hpx.Forks with share=False"])
    with torch.no_grad():
        for _, t in again:
            t.copy_(once[id(t)])
            after[id(t)] = (after[id(t)][0], t._version)


def _label(forks: Any, f: _Fork) -> str:
    mine = "your run" if f is forks._forks[0] else f"the fork at {_fork_label(f.setting(), forks._bases)}"
    return mine + (" (an annealed copy)" if f.ramp is not None else "")


def reached(trained: list[_Fork], start: _Fork) -> list[str]:
    """After a backward past the first step: a fork other than your run whose loss reached none of its
    parameters (a ``loss_fn`` that switched to your model object). One parameter per fork that had
    a gradient before (``_mark``) is read; the whole model only when it has none now."""
    lost = False
    for f in trained:
        if f is start:
            continue
        mark = getattr(f, "_mark", None)
        if mark is None or mark.grad is None:
            mark = next((p for p in f.model.parameters() if p.grad is not None), None)
            f._mark = mark
            lost = lost or mark is None
    return _unreached(trained, start) if lost else []


def _stepped_apart(forks: list[_Fork]) -> list[str]:
    """Your objects changed where the forks' copies did not: your scheduler stepped more often
    (``scheduler.step()`` in your loop as well), or by hand your optimizer's groups or their plain
    settings (lr, weight decay, ...), which parameters train, or a dropout rate; compared with a
    fork at your knob values (host reads only: nothing waits on a device)."""
    start = forks[0]
    other = next((f for f in forks[1:] if not f.lost and f.values == start.values), None)  # an lr fork
    if other is None or start.lost:
        return []
    if start.scheduler is not None and other.scheduler is not None:
        mine = getattr(start.scheduler, "last_epoch", None)
        theirs = getattr(other.scheduler, "last_epoch", None)
        if mine is not None and mine != theirs:
            return [f"your scheduler is at step {mine}, the forks' copies of it at {theirs}: hpx.Forks steps "
                    "every fork's scheduler itself; remove scheduler.step() from your loop"]
    if start.model.training != other.model.training:
        mode = {True: "train", False: "eval"}
        return [f"your model is in {mode[start.model.training]} mode where the forks' copies of it are in "
                f"{mode[other.model.training]} mode (model.eval() left on after an evaluation?): call "
                "model.train() before the next step, or set every fork's mode with forks.each(lambda "
                "replica: replica.model.eval())"]
    mine_g, theirs_g = start.optimizer.param_groups, other.optimizer.param_groups
    what = (f"{len(mine_g)} parameter groups where the copies have {len(theirs_g)}"
            if len(mine_g) != len(theirs_g) else
            next((f"parameter group {i}'s {k} {a[k]!r} where the copies have {b.get(k)!r}"
                  for i, (a, b) in enumerate(zip(mine_g, theirs_g)) for k in a
                  if k != "params" and _plain_setting(a[k]) and a[k] != b.get(k)), None)
            or _frozen_apart(start, other) or _dropout_apart(start, other))
    if what is None:
        return []
    return [f"your optimizer or model has {what}: hpx.Forks trains copies of them made when it was built, "
            "and a change made to yours since (a layer unfrozen, a group added, an lr set by hand or by a "
            "scheduler of your own) reaches your run only. Make every fork's change with "
            "forks.each(lambda replica: ...), or make it before hpx.Forks is built"]


def _plain_setting(v: Any) -> bool:
    """A parameter group's setting compared host-side: a number, a flag, a name or a tuple of numbers
    (betas); a tensor is not read (that would wait on its device)."""
    return isinstance(v, (bool, int, float, str)) or (isinstance(v, tuple) and all(
        isinstance(x, (int, float)) for x in v))


def _frozen_apart(start: _Fork, other: _Fork) -> str | None:
    """Which parameter trains on your model and not on the copies, or the other way round."""
    mine, theirs = start.watched()[0], other.watched()[0]
    if [p.requires_grad for p in mine] == [p.requires_grad for p in theirs]:
        return None
    name, p = next((n, p) for (n, p), q in zip(start.model.named_parameters(), theirs)
                   if p.requires_grad != q.requires_grad)
    how = "set to train" if p.requires_grad else "frozen"
    return f"parameter {name!r} {how} (requires_grad={p.requires_grad}) where the copies' is not"


def _dropout_apart(start: _Fork, other: _Fork) -> str | None:
    """Which dropout module's rate differs from the copies', and both rates."""
    mine, theirs = start.watched()[1], other.watched()[1]
    if [m.p for m in mine] == [m.p for m in theirs]:
        return None
    dropout = torch.nn.modules.dropout._DropoutNd
    names = [n for n, m in start.model.named_modules() if isinstance(m, dropout)]
    i = next(i for i, (a, b) in enumerate(zip(mine, theirs)) if a.p != b.p)
    return f"dropout rate {mine[i].p:g} in {names[i]!r} where the copies have {theirs[i].p:g} (set by hand?)"


class _Guards:
    """The checks above that need the search's state, and :meth:`each` (a mixin of ``Forks``)."""

    _forks: Any
    _clones: Any
    _shared: Any
    _outside: bool
    _bases: Any
    _stepping = False  # hpx itself is stepping the forks' optimizers
    _outside_steps = 0  # steps of your optimizer that hpx did not take
    _half: str | None = None  # what an each() that raised part way left

    def _watch(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Hold ``model`` as this search's run, and count your optimizer's steps hpx does not take
        (a post-step hook: one Python call per step)."""
        _RUNS[model] = weakref.ref(self)
        me = weakref.ref(self)

        def counted(opt: Any, args: Any, kwargs: Any) -> None:
            forks = me()
            if forks is not None and not forks._stepping:
                forks._outside_steps += 1

        handle = optimizer.register_step_post_hook(counted)
        weakref.finalize(self, handle.remove)  # gone with this search: a later Forks adds its own

    def _misuse(self) -> list[str]:
        """Why the next step must be refused before it changes anything."""
        if self._half is not None:
            return [self._half]
        held = _RUNS.get(self._forks[0].model)
        if held is not None and held() is not self:
            return [f"another hpx.Forks was built on this one's model before it took a step ({held()!r}): "
                    "that one trains the model now; step it, or build this one again"]
        if self._outside_steps and not self._outside:
            return [f"your optimizer was stepped {self._outside_steps} time(s) outside hpx.Forks "
                    "(optimizer.step() in your loop?): forks.step() steps every fork's optimizer, yours "
                    "included, so your run took steps the other forks did not. Remove optimizer.step() from "
                    "the loop, and resume from your last checkpoint (hpx.load_checkpoint) or start again"]
        return []

    def _check_held(self, when: str) -> None:
        """At a decision: what every fork holds once (or a copy of, ``share=False``) changed on your
        model through ``.data``, which moves no version (one pass over it, one host read; under
        torch.distributed one gather, so that every rank raises alike). Every later step is refused."""
        written = self._shared.written()
        bad = [0] if written else []
        if self.collective.world_size > 1:
            flag = torch.tensor([1.0 if written else 0.0], device=_device(self._forks[0].model))
            bad = [r for r, v in enumerate(self.collective.all_gather(flag).reshape(-1).tolist()) if v > 0]
        if not bad:
            return
        what = ", ".join(written) if written else "a tensor held by every fork"
        where = "" if self.collective.world_size == 1 else f" on rank(s) {bad}"
        self._half = (f"{when}: {what}{where} changed on your model outside forks.each() (a write through "
                      ".data, which torch does not count), so your run and the forks trained on different "
                      "values of it: change it through forks.each(lambda replica: ...), which changes every "
                      "fork's alike, and resume from your last checkpoint (hpx.load_checkpoint)")
        raise ConfigError([self._half])

    def each(self, fn: Callable[[Replica], Any]) -> None:
        """Call ``fn(replica)`` on every fork and annealed copy (your run's first) to change them all
        alike mid-run: unfreeze a layer, add a parameter group, set an lr by hand. A change made to
        your own objects alone reaches your run only, and is refused at the next step. A frozen
        parameter ``fn`` unfreezes on your run is first given to every other fork as a copy of its
        own (frozen, it was held once for all), so each fork trains its own.

        A tensor every fork holds once (a frozen parameter, a buffer no step writes; ``share=True``)
        that ``fn`` writes on your run is written once: ``fn``'s writes to it through the other
        forks are undone (``r.model.scale.mul_(2)`` doubles it once, not once per fork). ``fn`` that
        writes such a tensor through another fork but not through your run is refused.

        ``fn`` that raises on some fork leaves the forks it ran on changed and the rest not: every
        step is then refused, naming them, until ``each`` runs through on every fork (call it again
        with a function that works on all) or ``hpx.load_checkpoint`` restores the run."""
        if not callable(fn):
            raise ConfigError([f"each() takes a function replica -> None, e.g. forks.each(lambda replica: "
                               f"replica.model.eval()) (got {_checks.shown(fn)})"])
        forks = [*self._forks, *self._clones]
        done = 0
        try:
            taken = self._shared.taken()  # what every fork holds once, before fn
            fn(forks[0].replica)
            done = 1
            if self._shared.params:
                self._shared.unshare_unfrozen([f.model for f in forks], [f.optimizer for f in forks])
                for f in forks:
                    f._watched = None  # its parameters are listed again
            once = {id(t): t.detach().clone() for _, t in self._shared.moved(taken)}  # fn's write, once
            after = self._shared.taken() if taken else {}
            for f in forks[1:]:
                fn(f.replica)
                if after:
                    _written_once(self._shared.moved(after), once, after, _label(self, f))
                done += 1
        except BaseException as e:
            ran = ", ".join(_label(self, f) for f in forks[:done]) or "no fork"
            rest = ", ".join(_label(self, f) for f in forks[done + 1:])
            rest = f" (not on {rest})" if rest else ""
            self._half = (f"forks.each(fn) raised ({type(e).__name__}: {e}) on {_label(self, forks[done])}, "
                          f"having run on {ran}{rest}: the forks now differ in more than their settings. "
                          "Call forks.each again with a function that works on every fork (it runs on each, "
                          "your run first), or resume from your last checkpoint")
            raise
        finally:
            self._shared.refresh()
        self._half = None
