"""``hpx.Forks(..., batched=True)``: past the first step, the forks and annealed copies of a small model
trained as one batched computation, equal to the forks trained one after the other within float
tolerance.

For a small model a step of the forks is bound by per-call overheads (Python, dispatch, kernel
launches), paid once per fork and annealed copy (up to nine) on the sequential path
(:mod:`hpx.forks.early`). Here their trainable parameters (and the buffers each fork holds of its
own) are stacked along a leading dim, one :func:`torch.func.vmap` runs your ``loss_fn`` on every fork
at once (your model's tensors swapped for each fork's by :func:`torch.func.functional_call` for the
whole of ``loss_fn``), one backward gives every fork's gradients, and the optimizer steps of SGD,
Adam and AdamW are taken on the stacks (each parameter group laid flat, ``[forks, numel]``): torch's
single-tensor step op for op, each fork at its multiple of its scheduler's learning rates (an
annealed copy at its ramp's) with its own step counts. Other optimizers step each fork's own
``optimizer.step()`` on the gradients found. Each fork's parameters, optimizer state and buffers are
written back (BatchNorm's running statistics as its kernel writes them, uncounted) and every fork's
scheduler steps. Every fork draws the random numbers your run draws (``randomness="same"``):
torch's dropout draws the sequential path's masks, and the streams are left as that path leaves
them. Losses, non-finite flags, step counts, cuts and the end are those of :meth:`hpx.Forks.step`.

Equality: batched matrix products round differently from one fork's own (a few units in the last
place of a step's gradients), and Adam's normalised steps carry that on: over 30 steps across both
cuts every fork's weights and optimizer state stayed within 3e-7 with AdamW, 5e-6 relative with SGD,
and a 200-step run of a 6 k-parameter MLP ended within 1.4e-5, the decisions the same
(``tests/test_forks_batched.py``, ``python -m benchmarks.forks_batched``). A parameter whose gradient
is 0 up to rounding (a bias just before a BatchNorm) takes Adam steps in directions the rounding
picks, differently on each path.

Speed (``python -m benchmarks.forks_batched``, one CPU thread): a step of five forks of a 3.5-6
k-parameter MLP 1.5-1.6x faster, nine forks 2.2x, two forks 0.9x; 1.2x at 26 k parameters, 0.4x at
300 k. So a step of fewer than :data:`MIN_FORKS` forks and copies (the run past its first cut) is
the sequential path's. What it costs: every fork's activations alive at once, and the stacks the
forks' tensors are copied into (one copy of what they train, and of its optimizer state).

Where it applies: ``forks.step`` in one process, without ``shard=`` or ``knobs=`` (refused when
Forks is built), past the first step (whose checks of ``loss_fn`` need each fork's own backward);
``backward`` and ``optimizer_step`` (accumulation, ``max_grad_norm``, a ``GradScaler``) are the
sequential path as before. What it cannot take exactly makes the run fall back to the sequential
path, from that step to its end, with one logged warning that says why, before anything of the step
is changed (the random streams put back):

* a loss or forward that vmap cannot run (a ``.item()``, a branch on a value, an op without a
  batching rule), whose error is then met by the sequential path if it is not vmap's;
* a ``loss_fn`` that reads what differs between the forks: ``replica.value("lr")``,
  ``replica.index``, ``replica.optimizer``;
* module or parameter hooks (they would run once for every fork at once); a forward that assigns a
  new tensor to a buffer (a write in place, as BatchNorm's, is taken);
* forks that differ in which parameters train or in train/eval mode, sparse gradients, parameters
  on several devices.

A ``loss_fn`` runs once per step, not once per fork: what it does besides computing the loss (a
counter, a log line) happens once. A failure after the forks began to change (in writing their
step back) stops the run, as :mod:`hpx.forks.early`'s does. ``batched`` changes no state: a
checkpoint saved with it resumes with or without it.
"""
from __future__ import annotations

import logging
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.func import functional_call, vmap
from torch.nn.modules import module as _module
from torch.optim import optimizer as _optimizer

from hpx import _checks
from hpx.forks.early import early_path, halt
from hpx.forks.fork import _device, _Fork, _rng_get, _rng_set, _unstepped
from hpx.replica import Replica
from hpx.signals import LossFn

__all__ = ["MIN_FORKS", "Batched", "batched_problems"]

log = logging.getLogger("hpx")

MIN_FORKS = 4
"""The fewest forks and annealed copies a step trains for it to take the batched path: one vmap
costs about what two or three forks' sequential steps cost on a CPU (``python -m
benchmarks.forks_batched``), so a step of two or three (the run past its first cut) is sequential."""

_ADAM = ("betas", "eps", "weight_decay", "amsgrad", "maximize", "capturable", "differentiable", "fused",
         "decoupled_weight_decay")
_SGD = ("momentum", "dampening", "weight_decay", "nesterov", "maximize", "differentiable", "fused")


class _Unbatchable(Exception):
    """What the batched path cannot take exactly (the step falls back before anything changed)."""


def batched_problems(batched: Any, shard: Any, knobs: Sequence[Any], backend: Any) -> list[str]:
    """Why ``Forks(..., batched=batched)`` cannot be built with these settings."""
    if not isinstance(batched, bool):
        return [f"batched must be True or False (got {_checks.shown(batched)}): True trains a small model's "
                "forks as one batched computation (hpx.forks.batched)"]
    if not batched:
        return []
    try:
        world = int(backend.world_size) if backend is not None else 1
    except Exception:  # a backend that is no Collective is named by its own check
        world = 1
    knobs = list(knobs) if isinstance(knobs, (list, tuple)) else [knobs] if knobs else []
    why = ("shard= spreads each fork over the ranks" if shard is not None else
           f"knobs= gives each fork its own knob values "
           f"({', '.join(str(getattr(k, 'name', k)) for k in knobs)}), read by the loss or set on each "
           "fork's modules" if knobs else
           f"the backend has {world} ranks, and each fork's gradients are averaged over them" if world > 1
           else None)
    return [] if why is None else [f"batched=True trains the forks of a model in one process as one "
                                   f"torch.func computation, and {why}: drop batched=True"]


class _Standin(Replica):
    """The replica ``loss_fn`` is given on the batched path: ``model`` is your model, holding each
    fork's tensors under vmap; what differs between the forks cannot be read."""

    __slots__ = ("_trained",)

    def __init__(self, model: torch.nn.Module, trained: list[_Fork]) -> None:
        self.model, self._values, self._trained = model, {}, trained

    @property
    def index(self) -> int:  # type: ignore[override]
        raise _Unbatchable("loss_fn reads replica.index, which is each fork's own")

    @property
    def optimizer(self) -> torch.optim.Optimizer:  # type: ignore[override]
        raise _Unbatchable("loss_fn reads replica.optimizer, which is each fork's own")

    def value(self, name: str) -> float:
        seen = {f.replica.value(name) for f in self._trained}
        if len(seen) > 1:
            raise _Unbatchable(f"loss_fn reads replica.value({name!r}), which differs between the forks")
        return seen.pop()

    @property
    def values(self) -> dict[str, float]:  # type: ignore[override]
        seen = [f.replica.values for f in self._trained]
        if any(v != seen[0] for v in seen):
            raise _Unbatchable("loss_fn reads replica.values, which differ between the forks")
        return seen[0]


class _Call(torch.nn.Module):
    """A module whose forward is a call: :func:`torch.func.functional_call` swaps the forks' tensors
    into ``model`` (your model, its submodule) for the whole of ``loss_fn``, not only its forward."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, fn: Callable[[], torch.Tensor]) -> torch.Tensor:
        return fn()


class _Layout:
    """Which of the forks' tensors are stacked (every trainable parameter; a frozen one where the forks
    do not all hold your run's own, ``share=False``), and the stack the trainable ones are copied into
    at every step (held from step to step: one copy of what the forks train)."""

    __slots__ = ("frozen", "key", "keys", "lists", "out", "stack", "tied", "train", "views")

    def __init__(self, key: tuple[Any, ...], lists: list[list[torch.Tensor]], names: list[str],
                 train: list[int], frozen: list[int], tied: bool) -> None:
        self.key, self.lists, self.train, self.frozen, self.tied = key, lists, train, frozen, tied
        self.keys = [f"model.{names[k]}" for k in train + frozen]
        first, n = lists[0], len(lists)
        self.stack = [torch.empty((n, *first[k].shape), dtype=first[k].dtype, device=first[k].device)
                      .requires_grad_() for k in train]
        self.views = [s.detach()[i] for s in self.stack for i in range(n)]  # [j * n + i]: fork i's
        self.out = [ps[k] for k in train for ps in lists]


def _hooked(model: torch.nn.Module, params: list[torch.Tensor]) -> str | None:
    """A module or parameter hook, which would run once for every fork at once."""
    kinds = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
    if any(getattr(_module, f"_global{k}", None) for k in kinds):
        return "a global module hook is registered"
    for name, mod in model.named_modules():
        if any(getattr(mod, k, None) for k in kinds):
            return f"module {name or type(mod).__name__!r} has a hook"
    if any(getattr(p, "_backward_hooks", None) or getattr(p, "_post_accumulate_grad_hooks", None)
           for p in params):
        return "a parameter has a hook"
    return None


class Batched:
    """The batched path of one :class:`hpx.Forks` run (``batched=True``): :meth:`step` takes a step,
    or returns ``None`` where the run takes the sequential path (see the module's docstring)."""

    def __init__(self) -> None:
        self.why: str | None = None  # why the run fell back to the sequential path (then for good)
        self.taken = 0  # steps taken on the batched path
        self._layout: _Layout | None = None
        self._steps: _Steps | None = None
        self._call: _Call | None = None

    def step(self, forks: Any, loss_fn: LossFn, batch: Any) -> torch.Tensor | None:
        """:meth:`hpx.Forks.step` on the batched path: the forks' losses (``[F]``), or ``None``."""
        if self.why is not None or not (early_path(forks) and forks.collective.world_size == 1
                                        and not forks._outside and len(forks._trained()) >= MIN_FORKS):
            return None
        _checks.check(_checks.loss_fn_problems(loss_fn, batch) + _checks.batch_problems(batch, None))
        forks._scaled = False
        bound = forks._probe_fn is None  # as Forks._backward: the probe's loss defaults to this one
        if bound:
            forks._probe_fn = loss_fn
        try:
            trained = forks._open()
            losses = self._train(forks, trained, loss_fn, batch)
        except BaseException:
            forks._fresh = True
            if bound:
                forks._probe_fn, forks._initial = None, None
            raise
        if losses is None:  # fell back: the sequential path takes this step (nothing was changed)
            if bound:
                forks._probe_fn = None
            return None
        bad = ~torch.isfinite(losses)  # device ops, read a step later (Forks._read_losses)
        forks._note_bad(bad)
        held = forks._losses_bad
        forks._losses_bad = (trained, bad if held is None else held[1] | bad)
        n = len(forks._forks)
        if len(trained) >= n and all(a is b for a, b in zip(trained, forks._forks)):
            out = losses[:n]
        else:  # your run lost: nan in its place, as Forks._backward
            at = {id(f): i for i, f in enumerate(trained)}
            lost = torch.full((), float("nan"), device=losses.device)
            out = torch.stack([losses[at[id(f)]] if id(f) in at else lost for f in forks._forks])
        self.taken += 1
        forks._stepped(trained)
        return out

    def _fall_back(self, forks: Any, why: str) -> None:
        self.why = why
        self._layout = self._steps = self._call = None
        log.warning("hpx.Forks(batched=True): %s at step %d, so the forks are trained one after the other "
                    "from this step to the run's end (as without batched=True)", why, forks.step_count + 1)

    def _plan(self, start: _Fork, trained: list[_Fork]) -> _Layout:
        """The layout of the stacked tensors, kept while the forks trained and their parameters are the
        same; raises :class:`_Unbatchable`."""
        lists = [f.watched()[0] for f in trained]
        mine = start.watched()[0]
        key = (*map(id, trained), *map(id, lists), id(mine), *(p.requires_grad for p in mine))
        if self._layout is not None and self._layout.key == key:
            return self._layout
        named = list(start.model.named_parameters())
        if any(len(ps) != len(named) for ps in lists):
            raise _Unbatchable("the forks' models have other parameters than your model")
        train = [k for k, p in enumerate(mine) if p.requires_grad]
        if any([k for k, p in enumerate(ps) if p.requires_grad] != train for ps in lists):
            raise _Unbatchable("the forks differ in which parameters train")
        if not train:
            raise _Unbatchable("no parameter trains")
        if len({lists[0][k].device for k in train}) > 1:
            raise _Unbatchable("the parameters are on several devices")
        frozen = [k for k, p in enumerate(mine)
                  if not p.requires_grad and any(ps[k] is not p for ps in lists)]
        tied = len(list(start.model.named_parameters(remove_duplicate=False))) > len(named)
        self._layout = _Layout(key, lists, [n for n, _ in named], train, frozen, tied)
        return self._layout

    def _train(self, forks: Any, trained: list[_Fork], loss_fn: LossFn,
               batch: Any) -> torch.Tensor | None:
        """Every fork's forward, backward and optimizer step as one computation: their losses
        (detached, in ``trained``'s order), or ``None`` where it fell back before anything changed."""
        start = forks._forks[0]
        base = start.model
        device = _device(base)
        rng = _rng_get(device, forks._streams[0] is not False)
        try:
            lay = self._plan(start, trained)
            why = _hooked(base, start.watched()[0]) or next(
                ("your run and the forks are in different train/eval modes" for f in trained
                 if f.model.training != base.training), None)
            if why is not None:
                raise _Unbatchable(why)
            losses, bufs, grads = self._forward_backward(base, lay, trained, loss_fn, batch)
            if any(g is not None and g.layout != torch.strided for g in grads):
                raise _Unbatchable("the gradients are sparse")
        except BaseException as e:
            _rng_set(rng, device)  # the streams as before the step: the sequential path draws them again
            if not isinstance(e, Exception):
                raise
            self._fall_back(forks, str(e) if isinstance(e, _Unbatchable) else
                            f"vmap could not run the step ({type(e).__name__}: {e})")
            return None
        try:  # from here the forks change: a failure leaves them apart, and stops the run
            with torch.no_grad():
                for ts, s, v in bufs:  # each fork's buffers as the forward left them
                    # a write torch counts (add_) is counted on each fork's; BatchNorm's running statistics,
                    # which its kernel writes uncounted, are written uncounted (through .data), as there
                    torch._foreach_copy_(ts if s._version != v else [t.data for t in ts], list(s.unbind(0)))
                steps = self._optimizer(trained, lay, grads)
                done = steps is not None and steps.run(trained, lay, grads, forks.step_count)
            for i, f in enumerate(trained):
                if done:
                    _step_scheduler(f)
                    continue
                for k, g in zip(lay.train, grads):  # each fork's own optimizer.step(), as sequentially
                    lay.lists[i][k].grad = None if g is None else g[i]
                forks._step_one(f, None)
                f.optimizer.zero_grad(set_to_none=True)
                if forks._zero_model:
                    f.model.zero_grad(set_to_none=True)
        except BaseException as e:
            for f in trained:
                f.optimizer.zero_grad(set_to_none=True)
            forks._half = (f"forks.step() failed at step {forks.step_count + 1} on the batched path "
                           f"(batched=True) while it wrote the forks' step ({type(e).__name__}: {e}), so the "
                           "forks may now be at different steps and this run cannot go on: resume from your "
                           "last checkpoint (hpx.load_checkpoint)")
            halt(forks, e)
        return losses

    def _optimizer(self, trained: list[_Fork], lay: _Layout, grads: list[Any]) -> _Steps | None:
        """The optimizer steps on stacked tensors, kept while the optimizers' groups and states are the
        same objects (a resume loads new ones); ``None`` where they cannot be taken so."""
        opts = [f.optimizer for f in trained]
        key = (lay.key, *(id(o.state) for o in opts), *(g is None for g in grads),
               *(id(g["params"]) for o in opts for g in o.param_groups))
        if self._steps is None or self._steps.key != key:
            self._steps = _Steps.made(key, opts, lay, grads)
        return self._steps

    def _forward_backward(self, base: torch.nn.Module, lay: _Layout, trained: list[_Fork], loss_fn: LossFn,
                          batch: Any) -> tuple[torch.Tensor, list[Any], list[Any]]:
        """One vmap of ``loss_fn`` over the stacked forks and one backward: the losses (detached), the
        stacked buffers ``(each fork's, stacked, version)`` and the stacked gradients (``None``: a
        parameter the loss did not reach)."""
        if self._call is None or self._call.model is not base:
            self._call = _Call(base)
        call = self._call
        with torch.no_grad():
            torch._foreach_copy_(lay.views, lay.out)
        tensors = [*lay.stack, *(torch.stack([ps[k].detach() for ps in lay.lists]) for k in lay.frozen)]
        keys, bufs = list(lay.keys), []
        mine = list(base.named_buffers())
        if mine:
            each = [list(f.model.buffers()) for f in trained]
            if any(len(b) != len(mine) for b in each):
                raise _Unbatchable("the forks' models have other buffers than your model")
            for i, (name, b) in enumerate(mine):
                ts = [e[i] for e in each]
                if any(t is not b for t in ts):  # not held once (share=True) by every fork
                    s = torch.stack([t.detach() for t in ts])
                    keys.append(f"model.{name}")
                    tensors.append(s)
                    bufs.append((ts, s, s._version))
        replica, first = _Standin(base, trained), len(lay.keys)

        def one(ts: list[torch.Tensor]) -> torch.Tensor:
            def inside() -> torch.Tensor:
                loss = loss_fn(replica, batch)
                if not torch.is_tensor(loss) or loss.numel() != 1:
                    raise TypeError(f"loss_fn must return a scalar tensor (got {_checks.shown(loss)})")
                moved = [n for n, t in zip(keys[first:], ts[first:]) if call.get_buffer(n) is not t]
                if moved:
                    raise _Unbatchable(f"the forward assigns a new tensor to buffer {moved[0][6:]!r}")
                return loss.reshape(())

            return functional_call(call, dict(zip(keys, ts)), (inside,), tie_weights=lay.tied)

        losses = vmap(one, randomness="same")(tensors)
        grads = torch.autograd.grad(losses.sum(), lay.stack, allow_unused=True)
        return losses.detach(), bufs, list(grads)


def _step_scheduler(f: _Fork) -> None:
    """A fork's scheduler steps after its optimizer step, as :meth:`hpx.Forks._step_one` steps it."""
    if f.scheduler is None:
        return
    if _unstepped(f.scheduler):  # a copy's optimizer step is not wrapped by torch's order check
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r"Seems like `optimizer\.step\(\)`")
            f.scheduler.step()
    else:
        f.scheduler.step()


def _plain_step(opt: torch.optim.Optimizer) -> bool:
    """Whether ``opt.step()`` is its class's own, with no hook but hpx's step counter."""
    own = opt.__dict__.get("step")
    return (not _optimizer._global_optimizer_pre_hooks and not _optimizer._global_optimizer_post_hooks
            and not opt._optimizer_step_pre_hooks
            and all(getattr(h, "__qualname__", "").startswith("_Guards._watch.")
                    for h in opt._optimizer_step_post_hooks.values())
            and (own is None or getattr(own, "_wrapped_by_lr_sched", False)))


class _Steps:
    """The forks' optimizer steps (SGD, Adam, AdamW) taken on stacked tensors: torch's single-tensor
    step, op for op, on each parameter group's trainable parameters laid flat (``[forks, numel]``),
    each fork's numbers (its learning rate, its bias corrections) a tensor along the leading dim;
    each fork's parameters and optimizer state are then written back."""

    def __init__(self, key: tuple[Any, ...], adam: bool, n: int) -> None:
        self.key, self.adam, self.n = key, adam, n
        self.names = (("exp_avg", "exp_avg_sq") if adam else ("momentum_buffer",))
        self.groups: list[tuple[int, list[int], list[list[Any]], list[int]]] = []  # (i, js, states, sizes)
        self.flat: dict[tuple[int, str], tuple[torch.Tensor, list[torch.Tensor]]] = {}  # (group, what)
        self.checked: set[int] = set()  # the groups whose states were found like their parameters

    @classmethod
    def made(cls, key: tuple[Any, ...], opts: list[torch.optim.Optimizer], lay: _Layout,
             grads: list[Any]) -> _Steps | None:
        """The plan for these optimizers, or ``None`` (each fork then steps its own optimizer)."""
        kind = type(opts[0])
        adam = kind in (torch.optim.Adam, torch.optim.AdamW)
        if not (adam or kind is torch.optim.SGD) or any(type(o) is not kind for o in opts):
            return None
        if any(len(o.param_groups) != len(opts[0].param_groups) for o in opts):
            return None
        where = [{id(ps[k]): j for j, k in enumerate(lay.train)} for ps in lay.lists]
        plan = cls(key, adam, len(opts))
        for gi, gs in enumerate(zip(*(o.param_groups for o in opts))):
            if any(len(g["params"]) != len(gs[0]["params"]) for g in gs):
                return None
            js = []
            for pos in range(len(gs[0]["params"])):
                at = {where[i].get(id(g["params"][pos])) for i, g in enumerate(gs)}
                j = at.pop()
                if at:
                    return None
                if j is not None and grads[j] is not None:  # not reached: skipped, as the optimizer skips it
                    js.append(j)
            if len({(lay.stack[j].dtype, lay.stack[j].is_complex()) for j in js}) > 1 or any(
                    lay.stack[j].is_complex() for j in js):
                return None
            states = [[o.state.get(lay.lists[i][lay.train[j]]) for i, o in enumerate(opts)] for j in js]
            plan.groups.append((gi, js, states, [lay.stack[j][0].numel() for j in js]))
        return plan

    def _flat(self, gi: int, what: str, like: list[torch.Tensor], sizes: list[int]
              ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """A group's flat buffer for ``what`` (``[forks, numel]``) and its views shaped as ``like``
        (``[j * n + i]``), made once."""
        held = self.flat.get((gi, what))
        if held is None:
            n, t = self.n, like[0]
            buf = torch.empty((n, sum(sizes)), dtype=t.dtype, device=t.device)
            views, a = [], 0
            for j, size in enumerate(sizes):
                views += [buf[i, a:a + size].view(like[j * n + i].shape) for i in range(n)]
                a += size
            held = self.flat[(gi, what)] = (buf, views)
        return held

    def run(self, trained: list[_Fork], lay: _Layout, grads: list[Any], step: int) -> bool:
        """Every fork's optimizer step at ``step``; ``False``, having changed nothing, where it cannot be
        taken here (a hook, ``maximize``, ``capturable``, ``fused``, a tensor learning rate, settings that
        differ between the forks but the learning rate, a state not made yet or not like its parameter)."""
        opts = [f.optimizer for f in trained]
        if not all(_plain_step(o) for o in opts):
            return False
        keys = _ADAM if self.adam else _SGD
        ms = [f.multiple_at(step) for f in trained]
        jobs = []
        for gi, js, states, sizes in self.groups:
            gs = [o.param_groups[gi] for o in opts]
            g0 = gs[0]
            settings = [g0.get(k) for k in keys]
            if (any(g0.get(k) for k in ("maximize", "capturable", "differentiable", "fused"))
                    or any([g.get(k) for k in keys] != settings for g in gs[1:])
                    or any(torch.is_tensor(v) for v in [*settings, *g0.get("betas", ())])
                    or any(type(g["lr"]) not in (float, int) for g in gs)):
                return False
            need = ((*self.names, *(("max_exp_avg_sq",) if g0["amsgrad"] else ()), "step") if self.adam
                    else self.names if g0["momentum"] != 0 else ())
            try:
                now = {k: [st[k] for row in states for st in row] for k in need}  # [j * n + i]
            except (KeyError, TypeError):  # a state not made yet (the optimizer makes it at its step)
                now = {}
            if any(t is None for ts in now.values() for t in ts) or len(now) < len(need):
                self.key = ()  # looked up again at the next step
                return False
            if gi not in self.checked:  # the states once (a resume loads new ones: another plan)
                mine = [lay.views[j * self.n] for j in js]
                if any(t.shape != mine[a // self.n].shape or t.dtype != mine[a // self.n].dtype
                       for k in need if k != "step" for a, t in enumerate(now[k])) or any(
                        s.device.type != "cpu" for s in now.get("step", ())):
                    return False
                self.checked.add(gi)
            lrs = [g["lr"] * m if m != 1.0 else g["lr"] for g, m in zip(gs, ms)]  # as Forks._step_one
            jobs.append((gi, g0, js, sizes, now, lrs))
        for gi, g0, js, sizes, now, lrs in jobs:
            if not js:
                continue
            out = [lay.out[j * self.n + i] for j in js for i in range(self.n)]
            params, views = self._flat(gi, "params", out, sizes)
            torch._foreach_copy_(views, [lay.views[j * self.n + i] for j in js for i in range(self.n)])
            grad = torch.cat([grads[j].reshape(self.n, -1) for j in js], 1)
            state = {}
            for k in need:
                if k != "step":
                    state[k] = self._flat(gi, k, now[k], sizes)
                    torch._foreach_copy_(state[k][1], now[k])
            (_adam if self.adam else _sgd)(g0, params, grad, {k: v[0] for k, v in state.items()},
                                           now.get("step"), lrs, sizes)
            for k, (_, v) in state.items():
                torch._foreach_copy_(now[k], v)
            torch._foreach_copy_(out, views)
        return True


def _on(rows: list[Any], like: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Host numbers (per-fork ones a row a fork) as a tensor in ``like``'s dtype (as torch casts a
    Python scalar) on its device (a GPU's without waiting on it)."""
    host = torch.tensor(rows, dtype=dtype or like.dtype)
    return host if like.device.type == "cpu" else host.pin_memory().to(like.device, non_blocking=True)


def _adam(g: dict[str, Any], p: torch.Tensor, grad: torch.Tensor, state: dict[str, torch.Tensor],
          steps: list[torch.Tensor], lrs: list[float], sizes: list[int]) -> None:
    """torch's ``_single_tensor_adam`` (Adam, AdamW) on a group laid flat (``[forks, numel]``);
    ``steps``: each fork's step count of each parameter (``[j * n + i]``, host tensors)."""
    beta1, beta2 = g["betas"]
    wd, eps, n = g["weight_decay"], g["eps"], len(lrs)
    torch._foreach_add_(steps, 1)
    counts = [float(s) for s in steps]  # host tensors (capturable=False): no device is waited on
    cols = [0] if all(c == counts[0] for c in counts) else range(len(sizes))  # one count, or each's
    table = _on([[1 - lr * wd] + [-(lr / (1 - beta1 ** counts[j * n + i])) for j in cols]
                 + [(1 - beta2 ** counts[j * n + i]) ** 0.5 for j in cols] for i, lr in enumerate(lrs)], p)
    q = len(cols)
    size, root = table[:, 1:1 + q], table[:, 1 + q:]
    if q > 1:  # each parameter's numbers over its elements
        at = _on(sizes, p, torch.int64)
        size, root = (t.repeat_interleave(at, dim=1, output_size=p.shape[1]) for t in (size, root))
    if wd != 0:
        if g.get("decoupled_weight_decay", False):
            p.mul_(table[:, :1])
        else:
            grad = grad.add(p, alpha=wd)
    avg, sq = state["exp_avg"], state["exp_avg_sq"]
    avg.lerp_(grad, 1 - beta1)
    sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    top = sq
    if g["amsgrad"]:
        top = torch.maximum(state["max_exp_avg_sq"], sq, out=state["max_exp_avg_sq"])
    denom = (top.sqrt() / root).add_(eps)
    p.add_(avg * size / denom)  # param.addcdiv_(exp_avg, denom, value=-step_size), in its order


def _sgd(g: dict[str, Any], p: torch.Tensor, grad: torch.Tensor, state: dict[str, torch.Tensor],
         steps: Any, lrs: list[float], sizes: list[int]) -> None:
    """torch's ``_single_tensor_sgd`` on a group laid flat (``[forks, numel]``)."""
    wd, momentum = g["weight_decay"], g["momentum"]
    if wd != 0:
        grad = grad.add(p, alpha=wd)
    if momentum != 0:
        buf = state["momentum_buffer"]
        buf.mul_(momentum).add_(grad, alpha=1 - g["dampening"])
        grad = grad.add(buf, alpha=momentum) if g["nesterov"] else buf
    p.add_(grad * _on([[-lr] for lr in lrs], p))
