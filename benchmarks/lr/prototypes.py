"""Search prototypes written as training loops, to measure a design before it is built into hpx.

A prototype takes the user's model, optimizer and scheduler and the run's batches, trains, and
returns the final model and the factor it ends at on the peak lr. It runs in the suite like a
method (``python -m benchmarks.lr eval --method race``), so its table reads like any other.
"""

from __future__ import annotations

import contextlib
import copy
import math
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from benchmarks.lr.tasks import Task
from hpx.forks.fork import paired_gain as _gain
from hpx.forks.late import corrected as _corrected

__all__ = ["LOOPS", "mechanic", "paired_gain", "probe_at", "probe_loss", "range_test", "steps_taken"]

State = tuple[torch.nn.Module, torch.optim.Optimizer, Any]
_STEPS = [0]  # optimizer steps taken by prototypes in this process, annealed copies included


def steps_taken(reset: bool = False) -> int:
    """The optimizer steps prototypes have taken in this process (forks and annealed copies alike);
    ``reset`` starts the count over after reading it."""
    n = _STEPS[0]
    if reset:
        _STEPS[0] = 0
    return n


def _step(task: Task, state: State, batch: Any, factor: float) -> bool:
    """One optimizer step at ``factor`` times the scheduler's lr; False when the loss is not finite."""
    model, opt, sched = state
    _STEPS[0] += 1
    loss = task.loss(model, batch)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    lrs = [g["lr"] for g in opt.param_groups]
    for g in opt.param_groups:
        g["lr"] *= factor
    opt.step()
    for g, lr in zip(opt.param_groups, lrs):  # the scheduler sees its own values
        g["lr"] = lr
    if _unstepped(sched):  # a deep copy's optimizer.step is not wrapped by torch's order check,
        with warnings.catch_warnings():  # which would warn at its first step (as in hpx.Forks)
            warnings.filterwarnings("ignore", message=r"Seems like `optimizer\.step\(\)`")
            sched.step()
    else:
        sched.step()
    return bool(torch.isfinite(loss))


def _unstepped(sched: Any) -> bool:
    """Whether ``sched`` (or one a SequentialLR or ChainedScheduler holds) has not stepped since it
    was built: the step at which torch checks that the optimizer stepped first."""
    n = getattr(sched, "_step_count", None)
    if n is not None:
        return n == 1
    return any(_unstepped(s) for s in getattr(sched, "_schedulers", ()))


@torch.no_grad()
def probe_loss(task: Task, model: torch.nn.Module) -> float:
    """The mean loss over the task's probe batches (``inf`` when it is not finite)."""
    probe = task.probe()
    loss = sum(float(task.loss(model, b)) for b in probe) / len(probe)
    return loss if math.isfinite(loss) else math.inf


@contextlib.contextmanager
def _holding(model: torch.nn.Module, weights: list[torch.Tensor]) -> Iterator[None]:
    """``model``'s parameters set to ``weights`` inside the block, put back after it."""
    params = list(model.parameters())
    with torch.no_grad():
        keep = [p.detach().clone() for p in params]
        for p, w in zip(params, weights):
            p.copy_(w)
    try:
        yield
    finally:
        with torch.no_grad():
            for p, k in zip(params, keep):
                p.copy_(k)


@torch.no_grad()
def probe_at(task: Task, model: torch.nn.Module, weights: list[torch.Tensor]) -> float:
    """:func:`probe_loss` with ``model``'s parameters set to ``weights`` (then put back)."""
    with _holding(model, weights):
        return probe_loss(task, model)


def race(task: Task, model: torch.nn.Module, opt: torch.optim.Optimizer, sched: Any,
         batches: Sequence[Any], *, start: float = 0.02, length: float = 0.05,
         widths: Sequence[float] = (3.0, 3.0, 1.7, 1.3), average: bool = True,
         guards: Sequence[float] = ()) -> tuple[torch.nn.Module, float]:
    """Races of forks: at ``len(widths)`` back-to-back windows of ``length`` of the run (from
    ``start``), the run is forked into copies at ``1/c``, 1 and ``c`` times its lr factor, each
    trained on the window's batches; the fork whose average weights over the window (its last
    weights unless ``average``) score lowest on the probe goes on, and its factor with it. At each
    share of the run in ``guards`` a shrink-only race (1/2 and 1) follows."""
    total = len(batches)
    h = max(3, round(length * total))
    beta = 1 - min(1.0, 3 / h)
    starts = {round(start * total) + k * h: c for k, c in enumerate(widths)}
    for g in guards:
        starts.setdefault(round(g * total), -2.0)
    state: State = (model, opt, sched)
    factor, t = 1.0, 0
    model.train()
    while t < total:
        c = starts.get(t)
        if c is None or t + h > total:
            _step(task, state, batches[t], factor)
            t += 1
            continue
        mults = (0.5, 1.0) if c < 0 else (1 / c, 1.0, c)
        forks = [copy.deepcopy(state) if m != 1.0 else state for m in mults]
        emas = [[p.detach().clone() for p in f[0].parameters()] for f in forks]
        alive = [True] * len(forks)
        for b in batches[t:t + h]:
            for i, (f, m) in enumerate(zip(forks, mults)):
                if alive[i]:
                    alive[i] = _step(task, f, b, factor * m)
                    with torch.no_grad():
                        torch._foreach_lerp_(emas[i], list(f[0].parameters()), 1 - beta if average else 1.0)
        scores = [probe_at(task, f[0], e) if ok else math.inf for f, e, ok in zip(forks, emas, alive)]
        win = min(range(len(forks)), key=lambda i: (scores[i], abs(math.log(mults[i]))))
        state, factor = forks[win], factor * mults[win]
        t += h
    return state[0], factor


def _tick(state: State) -> None:
    """The fork's scheduler advances one step without a step of its own (it stays on the run's clock)."""
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch warns once when a scheduler steps before its optimizer
        state[2].step()


def forks(task: Task, model: torch.nn.Module, opt: torch.optim.Optimizer, sched: Any,
          batches: Sequence[Any], *,
          rounds: Sequence[tuple[float, float, Sequence[float]]] = (
              (0.0, 0.15, (10 ** -0.5, 1.0, 10 ** 0.5)),
              (0.15, 0.15, (10 ** -0.5, 1.0, 10 ** 0.5)),
              (0.30, 0.10, (1 / 1.8, 1.0, 1.8)),
              (0.55, 0.10, (0.5, 1.0)))) -> tuple[torch.nn.Module, float]:
    """Forks that share the run's steps instead of adding their own: in each round ``(start,
    length, multipliers)`` (shares of the run) the run is forked at those multiples of its lr
    factor and the forks take the window's steps in turn (fork ``i`` trains on every ``k``-th
    batch, all of them on the run's schedule), so a round costs no more steps than plain training;
    the fork whose weights averaged over its steps score lowest on the probe goes on (ties: the
    smallest move). The price is in progress, not time: the winner made ``1/k`` of the window's
    steps."""
    total = len(batches)
    plan = {}
    for start, length, mults in rounds:
        h = round(length * total)
        if h >= 2 * len(mults):  # each fork gets at least two steps, or the round is skipped
            plan[round(start * total)] = (h, tuple(mults))
    state: State = (model, opt, sched)
    factor, t = 1.0, 0
    model.train()
    while t < total:
        if t not in plan:
            _step(task, state, batches[t], factor)
            t += 1
            continue
        h, mults = plan[t]
        h = min(h, total - t)
        k = len(mults)
        fs = [copy.deepcopy(state) if m != 1.0 else state for m in mults]
        beta = 1 - min(1.0, 3 * k / h)
        emas = [[p.detach().clone() for p in f[0].parameters()] for f in fs]
        alive = [True] * k
        for j, b in enumerate(batches[t:t + h]):
            for i, f in enumerate(fs):
                if i != j % k:
                    _tick(f)
                elif alive[i]:
                    alive[i] = _step(task, f, b, factor * mults[i])
                    with torch.no_grad():
                        torch._foreach_lerp_(emas[i], list(f[0].parameters()), 1 - beta)
                else:
                    _tick(f)
        scores = [probe_at(task, f[0], e) if ok else math.inf for f, e, ok in zip(fs, emas, alive)]
        win = min(range(k), key=lambda i: (scores[i], abs(math.log(mults[i]))))
        state, factor = fs[win], factor * mults[win]
        t += h
    return state[0], factor


def halving(task: Task, model: torch.nn.Module, opt: torch.optim.Optimizer, sched: Any,
            batches: Sequence[Any], *,
            mults: Sequence[float] = tuple(10 ** (k / 2) for k in range(-2, 3)),
            cuts: Sequence[tuple[float, int]] = ((0.10, 3), (0.25, 2), (0.50, 1)),
            protect: bool = False, cool: float = 0.0, confidence: float = 0.0,
            lost_start: bool = False, average: bool = True,
            sided: bool = False, sign: float = 0.0, reserve: float = 0.0, corrected: bool = False,
            drop: float = 0.0, train: tuple[float, float] = (),
            split: bool = False, split_over: int = 1, ahead: bool = False,
            peaked: bool = False, guard: bool = False) -> tuple[torch.nn.Module, float]:
    """Successive halving of whole runs: from the start, one fork per multiple in ``mults`` of the
    peak lr, each a plain run on the same batches and its own copy of the schedule. At each ``(share,
    keep)`` of ``cuts`` the forks' weights averaged over the last ``steps / 40`` steps are scored on
    the probe and the best ``keep`` go on (ties: the nearest to the start); the last one left is
    the run. No reading along a line in weight space, no shortened run: the comparison that placed
    the lr in ``benchmarks.lr.diagnose``, paid for in steps (``sum`` over forks of their length).
    With ``protect`` the start's own fork survives every cut but the last, where it loses only to
    a fork that scores better. With ``cool`` each fork is scored instead at a copy of it annealed
    over the next ``cool`` of the run at every cut before the run's end (its lr factor taken
    linearly to 0; the copy is dropped): the fork as it would end if the run ended there. With
    ``confidence`` ``z > 0`` (and ``protect``), the last cut keeps the start unless the best
    challenger beats it by more than ``z`` standard errors of their paired per-example probe losses
    (:func:`paired_gain`): a difference the probe cannot tell from noise leaves the user's lr in
    place. With ``lost_start`` as well, a start that ends no better on the probe than the initial
    weights did (a lost run: the test is blind there, since a run that diverged or collapsed has
    heavy-tailed per-example losses) gives way to a challenger that ends better than them, without
    the test. Without ``average`` every score reads the forks'
    last weights instead of their averages. With ``sided`` (and ``protect``) a cut that keeps 3
    keeps the start and the best fork on each side of it (below and above its lr), so an early
    reading's pull toward one side cannot cut every fork on the other. With ``sign`` ``> 0`` the
    end's test also passes a challenger whose mean probe loss is lower and that is lower on more
    examples than not by ``sign`` standard errors of a sign test (robust to the few examples that
    carry most of a cross-entropy's variance). With ``reserve`` ``r > 1`` the first cut also keeps
    the fork at ``1/r`` times the best-scoring fork's multiple (when there is one), and that fork
    goes on to the end whatever the later cuts read: early readings favour the faster lr, so the
    slower fork that a finished run would prefer is the one an early cut drops. With ``corrected`` the
    end's bar is raised for the challengers still alive there (Bonferroni: ``hpx.forks.late.corrected``),
    as hpx.Forks raises it for several finished challengers. With ``drop`` ``z > 0``
    (and ``cool``, ``protect``) a cut that keeps 2 keeps the start alone when its annealed copy beats
    the challenger's by ``z`` standard errors, example by example: the rest of the run is plain
    training, and the end's test, which could only keep the start, is not paid for. With ``train``
    ``(zp, zt)`` the end's test also passes a challenger that leads by ``zp`` standard errors on the
    probe and by ``zt`` on a fixed sample of the training split (:meth:`Task.train_sample`, eval
    mode): underfitting, the usual state of a run whose lr is too low, shows on the training split,
    which holds many more examples than a small probe. With ``split`` the forks share each batch
    instead of each taking all of it, as data-parallel replicas share a global batch: the ``n`` forks
    alive train on its ``n`` disjoint parts (their annealed copies on the parts of theirs), so the
    search costs about one run's examples; the winner has trained on a part of every batch. With
    ``split_over`` ``k`` they share batches only while more than ``k`` forks are alive (with 2: the
    phases before the last cut), and take whole batches after. With ``ahead`` (and ``cool``) an
    annealed copy looks ahead to the schedule's peak: it trains at its multiple of the highest lr
    the schedule reaches from the cut on (not of the lr at the cut), falling linearly to 0, so a cut
    inside a warm-up reads each fork as it would end if the schedule had peaked then, instead of
    at the few percent of the peak a warm-up has reached. With ``peaked`` every cut's share is of the
    steps after the schedule's peak (its first highest lr): a cut at ``c`` of the run moves to
    ``p + c (1 - p)``, ``p`` the share of the run before the peak, so a warm-up holds no cut and a
    schedule that starts at its peak keeps its cuts. A last cut (``keep`` 1) before the run's
    end, with ``cool`` and ``confidence``, runs the end's test on the annealed copies of the start
    and the challenger, not on the forks: the run's remaining steps are plain training. With
    ``guard`` (and ``protect``) a cut inside a warm-up (the schedule's lr still to rise after it)
    where every fork above the start scores worse than the start keeps every fork below it: the
    early reading favours the faster lrs, so when even the faster ones lose to the start, it is at
    or above the top of the good range and says nothing of the slower ones. Those the cut's count
    has no room for go on to a cut of the same count at the schedule's first highest lr."""
    total = len(batches)
    if peaked:
        lrs = _lr_trace(opt, sched, total)
        p = lrs.index(max(lrs)) / total
        cuts = [(p + share * (1 - p), keep) for share, keep in cuts]
    plan = {max(1, round(share * total)): keep for share, keep in cuts}
    lam = min(1.0, 40 / total) if average else 1.0
    forks = [copy.deepcopy((model, opt, sched)) if m != 1.0 else (model, opt, sched) for m in mults]
    factors = list(mults)
    emas = [[p.detach().clone() for p in f[0].parameters()] for f in forks]
    alive = [True] * len(forks)
    # each fork draws its dropout from its own copy of the global RNG as it was at the start: the
    # forks see the same draws (common random numbers), and the start's fork those of plain training
    rngs = [torch.random.get_rng_state()] * len(forks)
    initial = _scored(task, model, [p.detach() for p in model.parameters()]) if lost_start else math.nan
    trace = _lr_trace(opt, sched, total) if ahead or guard else []
    top = trace.index(max(trace)) + 1 if guard else 0  # the first step at the schedule's highest lr
    reserved, named = [False] * len(forks), False
    model.train()
    for t, b in enumerate(batches, 1):
        live = [i for i in range(len(forks)) if alive[i]]
        for i, f in enumerate(forks):
            if alive[i]:
                torch.random.set_rng_state(rngs[i])
                shared = split and len(live) > split_over
                alive[i] = _step(task, f, _part(b, live.index(i), len(live)) if shared else b, factors[i])
                rngs[i] = torch.random.get_rng_state()
                with torch.no_grad():
                    torch._foreach_lerp_(emas[i], list(f[0].parameters()), lam)
        keep = plan.get(t)
        if keep is not None and keep < len(forks):
            if cool > 0 and t < total:  # a finished fork is scored as it is
                k = max(1, round(cool * total))
                nxt = [batches[(t + j) % total] for j in range(k)]
                live = [i for i in range(len(forks)) if alive[i]]
                # with ``ahead`` each copy step's factor is rescaled from the scheduler's lr at that
                # step to the schedule's highest lr from the cut on
                peak = [max(trace[t:]) / trace[min(t + j, total - 1)] for j in range(k)] if ahead else None
                copies = [_cooled_copy(task, f, m, [_part(x, live.index(i), len(live)) for x in nxt]
                                       if split and len(live) > split_over else nxt, peak) if ok else None
                          for i, (f, m, ok) in enumerate(zip(forks, factors, alive))]
                scores = [math.inf if c is None else _scored(task, c[0], _last(c)) for c in copies]
            else:
                scores = [_scored(task, f[0], e) if ok else math.inf for f, e, ok in zip(forks, emas, alive)]
            ranked = sorted(range(len(forks)), key=lambda i: (scores[i], abs(math.log(factors[i]))))
            order = ranked[:keep]
            own = [i for i, m in enumerate(factors) if m == 1.0]
            if sided and protect and keep == 3 and own:
                below = [i for i in ranked if factors[i] < 1.0][:1]
                above = [i for i in ranked if factors[i] > 1.0][:1]
                order = sorted([own[0], *below, *above], key=ranked.index)
            if protect and keep > 1 and own and own[0] not in order:
                order = [*order[:keep - 1], own[0]]
            if guard and protect and keep > 1 and own and alive[own[0]] and t < top:
                if all(scores[i] > scores[own[0]] for i in range(len(forks)) if factors[i] > 1.0):
                    below = [i for i in ranked if factors[i] < 1.0 and math.isfinite(scores[i])]
                    order = [own[0], *below]
                    order += [i for i in ranked if i not in order][:max(0, keep - len(order))]
                    if len(order) > keep:  # the rest are cut where the schedule peaks
                        plan[top] = min(keep, plan.get(top, keep))
            if protect and keep == 1 and confidence > 0 and own and order[0] != own[0] and alive[own[0]]:
                lost = scores[own[0]] >= initial > scores[order[0]]  # False without lost_start (nan)
                ch, st = (forks[order[0]][0], emas[order[0]]), (forks[own[0]][0], emas[own[0]])
                if cool > 0 and t < total:  # a decision before the end reads the annealed copies
                    probe_ch, probe_st = (_final_units(task, c) if c is not None else None
                                          for c in (copies[order[0]], copies[own[0]]))
                    probe_ch = probe_ch if probe_ch is not None else torch.full((1,), math.inf)
                    probe_st = probe_st if probe_st is not None else torch.full((1,), math.inf)
                else:
                    probe_ch, probe_st = _unit_losses(task, *ch), _unit_losses(task, *st)
                confirmed = bool(train) and _gain(probe_ch, probe_st) >= train[0] and _gain(
                    _unit_losses(task, *ch, task.train_sample()),
                    _unit_losses(task, *st, task.train_sample())) >= train[1]
                rivals = sum(alive[i] for i in range(len(forks)) if i != own[0])
                z = _corrected(confidence, rivals) if corrected else confidence
                if not lost and not confirmed and not _passes(probe_ch, probe_st, z, sign):
                    order = [own[0]]
            early = drop > 0 and cool > 0 and protect and keep == 2 and len(order) == 2
            if early and own and own[0] in order:
                other = copies[order[0] if order[1] == own[0] else order[1]]
                if copies[own[0]] is not None and (other is None or _gain(
                        _final_units(task, copies[own[0]]), _final_units(task, other)) >= drop):
                    order = [own[0]]
            if reserve > 1 and keep > 1:
                if not named:  # the first cut names the reserve
                    named = True
                    want = factors[ranked[0]] / reserve
                    near = [i for i in range(len(forks)) if abs(math.log(factors[i] / want)) < 1e-6]
                    if near and alive[near[0]] and factors[near[0]] != 1.0:
                        reserved[near[0]] = True
                order += [i for i in range(len(forks)) if reserved[i] and i not in order]
            forks, factors = [forks[i] for i in order], [factors[i] for i in order]
            emas, alive, rngs = [emas[i] for i in order], [alive[i] for i in order], [rngs[i] for i in order]
            reserved = [reserved[i] for i in order]
    torch.random.set_rng_state(rngs[0])  # the global RNG ends where the survivor's run left it
    return forks[0][0], factors[0]


def _part(batch: Any, i: int, n: int) -> Any:
    """Part ``i`` of ``n`` disjoint parts of a batch of tensors (rows split as evenly as they go)."""
    return tuple(x.tensor_split(n)[i] for x in batch)


def _passes(challenger: torch.Tensor, start: torch.Tensor, z: float, sign: float) -> bool:
    """The end's test on the probe's losses per unit: the challenger's mean lies ``z`` standard
    errors below the start's or (``sign > 0``) it is lower on average and on more units than not
    by ``sign`` standard errors of a sign test."""
    if _gain(challenger, start) >= z:
        return True
    d = start - challenger
    if sign <= 0 or not bool(torch.isfinite(d).all()) or float(d.mean()) <= 0:
        return False
    up, down = int((d > 0).sum()), int((d < 0).sum())
    return (up - down) / math.sqrt(max(1, up + down)) >= sign


def _cooled_copy(task: Task, state: State, factor: float, batches: Sequence[Any],
                 peak: Sequence[float] | None = None) -> State | None:
    """A copy of ``state`` trained on ``batches`` with its lr factor falling linearly from
    ``factor`` to 0 (None when a loss was not finite); ``peak[j]`` multiplies step ``j``'s factor."""
    copy_ = copy.deepcopy(state)
    k = len(batches)
    ok = True
    for j, b in enumerate(batches):
        ok = ok and _step(task, copy_, b, factor * (k - j) / (k + 1) * (peak[j] if peak else 1.0))
    return copy_ if ok else None


def _lr_trace(opt: torch.optim.Optimizer, sched: Any, total: int) -> list[float]:
    """The first group's lr at each of the run's ``total`` steps, read from a copy of the optimizer
    and scheduler stepped through the run without training (``opt`` and ``sched`` are untouched)."""
    o, s = copy.deepcopy((opt, sched))
    out = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(total):
            out.append(o.param_groups[0]["lr"])
            s.step()
    return out


def _last(state: State) -> list[torch.Tensor]:
    """A state's own (last) weights."""
    return [p.detach() for p in state[0].parameters()]


def _final_units(task: Task, state: State) -> torch.Tensor:
    """:func:`_unit_losses` at a state's own (last) weights."""
    return _unit_losses(task, state[0], _last(state))


@torch.no_grad()
def _unit_losses(task: Task, model: torch.nn.Module, weights: list[torch.Tensor],
                 batches: Sequence[Any] | None = None) -> torch.Tensor:
    """The probe's loss per unit (an example; a sequence's mean for a language model) at ``weights``,
    in eval mode (on ``batches`` instead when given)."""
    was = model.training
    model.eval()
    units = []
    try:
        with _holding(model, weights):
            for x, y in task.probe() if batches is None else batches:
                out = model(x)
                if task.kind == "reg":
                    units.append((out.squeeze(-1) - y) ** 2)
                else:
                    per = F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1), reduction="none")
                    units.append(per.reshape(y.shape[0], -1).mean(1))
    finally:
        model.train(was)
    return torch.cat(units).double()


def paired_gain(task: Task, model_a: torch.nn.Module, weights_a: list[torch.Tensor],
                model_b: torch.nn.Module, weights_b: list[torch.Tensor]) -> float:
    """How many standard errors ``a`` scores below ``b`` on the probe, example by example: the mean
    of ``loss_b - loss_a`` over the probe's units over its standard error (``inf`` when ``b`` is
    not finite and ``a`` is, ``-inf`` the other way round, 0 when they are equal everywhere)."""
    return _gain(_unit_losses(task, model_a, weights_a), _unit_losses(task, model_b, weights_b))


def _scored(task: Task, model: torch.nn.Module, weights: list[torch.Tensor]) -> float:
    """:func:`probe_at` in eval mode (no dropout; BatchNorm reads its running statistics and does not
    update them), then back to training."""
    model.eval()
    try:
        return probe_at(task, model, weights)
    finally:
        model.train()


@torch.no_grad()
def _dot(a: list[torch.Tensor], b: list[torch.Tensor]) -> torch.Tensor:
    return torch.stack([(x * y).sum() for x, y in zip(a, b)]).sum()


_MECHANIC_BETAS = (0.9, 0.99, 0.999, 0.9999, 0.99999, 0.999999)


def mechanic(task: Task, model: torch.nn.Module, opt: torch.optim.Optimizer, sched: Any,
             batches: Sequence[Any], *, betas: Sequence[float] = _MECHANIC_BETAS,
             decay: float = 0.01, s_init: float = 1e-8, eps: float = 1e-8) -> tuple[torch.nn.Module, float]:
    """Mechanic (Cutkosky, Defazio and Mehta, 2023, Algorithm 1): a learning-rate tuner that wraps
    the user's optimizer and schedule and learns one scale ``s`` on their accumulated update online,
    from the training gradient alone, at no extra forward or backward: the weights are ``x_ref + s *
    Delta``, ``Delta`` the sum of the base optimizer's updates, and ``s`` is the sum of ``len(betas)``
    parameter-free online learners fed ``h_t = <Delta_t, g_t + decay * |g_t| / |x_t| * x_t>``, the
    derivative of the training loss along the scale. No probe is read. The factor returned is the
    final ``s``: the final weights are the base run's whole displacement times ``s``, the stretch
    that ``Stretch`` reads on the probe, here learned from the training loss."""
    params = [p for p in model.parameters() if p.requires_grad]
    ref = [p.detach().clone() for p in params]
    delta = [torch.zeros_like(p) for p in params]
    beta = torch.tensor(betas, dtype=torch.float64)
    n = len(betas)
    m = torch.zeros(n, dtype=torch.float64)
    v = torch.zeros(n, dtype=torch.float64)
    r = torch.zeros(n, dtype=torch.float64)
    s = torch.zeros(n, dtype=torch.float64)
    model.train()
    for b in batches:
        _STEPS[0] += 1
        loss = task.loss(model, b)
        if not torch.isfinite(loss):
            break
        opt.zero_grad(set_to_none=True)
        loss.backward()
        with torch.no_grad():
            g = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
            gn = _dot(g, g).sqrt()
            xn = _dot(params, params).sqrt()
            h = float(_dot(delta, g) + decay * gn / xn.clamp_min(1e-30) * _dot(delta, params))
            old = [p.detach().clone() for p in params]
        opt.step()
        sched.step()
        with torch.no_grad():
            for d, p, o in zip(delta, params, old):
                d.add_(p - o)
            m = torch.maximum(beta * m, torch.tensor(abs(h), dtype=torch.float64))
            v = beta ** 2 * v + h * h
            r = (beta * r - s * h).clamp_min(0.0)
            w = s_init / n * m + r
            s = w / (v.sqrt() + eps)
            total = float(s.sum())
            if not math.isfinite(total):
                break
            for p, x0, d in zip(params, ref, delta):
                torch.add(x0, d, alpha=total, out=p)
    return model, max(float(s.sum()), 1e-12)


def range_test(task: Task, model: torch.nn.Module, opt: torch.optim.Optimizer, sched: Any,
               batches: Sequence[Any], *, rule: str = "steep", steps: int = 100, low: float = 1e-7,
               high: float = 10.0, smooth: float = 0.98, skip: int = 10) -> tuple[torch.nn.Module, float]:
    """The learning-rate range test (Smith, 2017), as Lightning's ``Tuner.lr_find`` runs it: before
    the run, a copy of the model and optimizer trains on the run's first ``steps`` batches with the
    peak lr rising geometrically from ``low`` to ``high`` (absolute, whatever the start), stopping
    when the loss passes 4 times its lowest; the loss is smoothed (an exponential average,
    debiased). The suggestion is the lr where the smoothed loss falls fastest, the first ``skip``
    points left out (``"steep"``, Lightning's default), or a tenth of the lr where it is lowest
    (``"min10"``, the rule of thumb for one-cycle's peak). Then the run trains plainly at that peak
    lr, from its own start. The factor returned is that lr over the start's."""
    k = min(steps, len(batches))
    tmodel, topt = copy.deepcopy((model, opt))
    start = opt.param_groups[0]["lr"]  # the peak lr the optimizer was built with
    ratios = [g["lr"] / start for g in topt.param_groups]
    lrs = [low * (high / low) ** (i / (k - 1)) for i in range(k)]
    avg, losses = 0.0, []
    tmodel.train()
    for i, (b, lr) in enumerate(zip(batches, lrs)):
        _STEPS[0] += 1
        for g, r in zip(topt.param_groups, ratios):
            g["lr"] = lr * r
        loss = task.loss(tmodel, b)
        value = float(loss.detach())
        if not math.isfinite(value):
            break
        avg = smooth * avg + (1 - smooth) * value
        losses.append(avg / (1 - smooth ** (i + 1)))
        if losses[-1] > 4 * min(losses):
            break  # diverged: lr_find's early stop
        topt.zero_grad(set_to_none=True)
        loss.backward()
        topt.step()
    n = len(losses)
    if rule == "steep":
        if n <= skip + 2:
            best = 0
        else:
            slopes = [losses[i + 1] - losses[i - 1] for i in range(skip, n - 1)]
            best = skip + min(range(len(slopes)), key=slopes.__getitem__)
        lr = lrs[best]
    else:
        lr = lrs[min(range(n), key=losses.__getitem__)] / 10 if n else lrs[0]
    factor = lr / start
    state: State = (model, opt, sched)
    model.train()
    for b in batches:
        _step(task, state, b, factor)
    return model, factor


_TO_THE_END = ((0.10, 3), (0.25, 2), (1.0, 1))  # the start and the best challenger are judged finished

# A loop: f(task, model, optimizer, scheduler, batches) -> (final model, end factor).
LOOPS: dict[str, Callable[..., tuple[torch.nn.Module, float]]] = {
    "race": race,
    "race-last-guard": lambda *a: race(*a, average=False, guards=(0.5, 0.7)),
    "forks": forks,
    "forks-long": lambda *a: forks(*a, rounds=((0.0, 0.3, (10 ** -0.5, 1.0, 10 ** 0.5)),
                                               (0.3, 0.2, (1 / 1.8, 1.0, 1.8)))),
    "halving": halving,
    "halving-protect": lambda *a: halving(*a, protect=True),
    "halving-cool": lambda *a: halving(*a, cool=0.05),
    "halving-end": lambda *a: halving(*a, cuts=_TO_THE_END, protect=True),
    "halving-end-z1": lambda *a: halving(*a, cuts=_TO_THE_END, protect=True, confidence=1.0),
    "halving-end-z2": lambda *a: halving(*a, cuts=_TO_THE_END, protect=True, confidence=2.0),
    "halving-end-z2-lost": lambda *a: halving(*a, cuts=_TO_THE_END, protect=True, confidence=2.0,
                                              lost_start=True),
    "halving-end-cool-z2-lost": lambda *a: halving(*a, cuts=_TO_THE_END, protect=True, cool=0.05,
                                                   confidence=2.0, lost_start=True),
    "halving-end-cool-z2-lost-last": lambda *a: halving(*a, cuts=_TO_THE_END, protect=True, cool=0.05,
                                                        confidence=2.0, lost_start=True, average=False),
    "halving-end-cool-z1.5-lost-last": lambda *a: halving(*a, cuts=_TO_THE_END, protect=True, cool=0.05,
                                                          confidence=1.5, lost_start=True, average=False),
    # one cut, at 10% of the run, straight to your run and the best challenger (no 3-fork phase)
    "halving-two-cool-z2-lost-last": lambda *a: halving(*a, cuts=((0.10, 2), (1.0, 1)), protect=True,
                                                        cool=0.05, confidence=2.0, lost_start=True,
                                                        average=False),
    "halving-end-cool-z3-lost-last": lambda *a: halving(*a, cuts=_TO_THE_END, protect=True, cool=0.05,
                                                        confidence=3.0, lost_start=True, average=False),
    "halving-end-cool-z2-sign2-lost-last": lambda *a: halving(*a, cuts=_TO_THE_END, protect=True, cool=0.05,
                                                              confidence=2.0, lost_start=True, average=False,
                                                              sign=2.0),
    "halving-late-cool-z2-lost": lambda *a: halving(*a, cuts=((0.25, 3), (0.50, 2), (1.0, 1)),
                                                    protect=True, cool=0.05, confidence=2.0, lost_start=True,
                                                    average=False),
    "halving-sided-z2-lost": lambda *a: halving(*a, cuts=((0.10, 3), (1.0, 1)), protect=True, sided=True,
                                                confidence=2.0, lost_start=True, average=False),
    "halving-end-cool-z2-lost-last-drop2": lambda *a: halving(
        *a, cuts=_TO_THE_END, protect=True, cool=0.05, confidence=2.0, lost_start=True, average=False,
        drop=2.0),
    "halving-end-cool-z2-lost-last-drop0": lambda *a: halving(
        *a, cuts=_TO_THE_END, protect=True, cool=0.05, confidence=2.0, lost_start=True, average=False,
        drop=1e-9),
    "halving-end-cool-z2-lost-last-reserve": lambda *a: halving(
        *a, cuts=_TO_THE_END, protect=True, cool=0.05, confidence=2.0, lost_start=True, average=False,
        reserve=10.0),
    # the same with the end's bar raised for the challengers left (Bonferroni, as hpx.Forks' knob forks)
    "halving-end-cool-z2-lost-last-reserve-bonf": lambda *a: halving(
        *a, cuts=_TO_THE_END, protect=True, cool=0.05, confidence=2.0, lost_start=True, average=False,
        reserve=10.0, corrected=True),
    "halving-end-cool-z2-lost-last-train": lambda *a: halving(
        *a, cuts=_TO_THE_END, protect=True, cool=0.05, confidence=2.0, lost_start=True, average=False,
        train=(1.0, 3.0)),
    # no early reading at all: the start and a fork a decade each side run to the end (3.0x the
    # steps, as the cooled halving), the confident end picks among the finished runs
    # Mechanic, the published scale tuner: the training gradient along the run's displacement
    "mechanic": mechanic,
    # Forks' design with the forks sharing each batch, as data-parallel replicas would (one run's examples)
    "split-end-cool-z2-lost-last": lambda *a: halving(*a, cuts=_TO_THE_END, protect=True, cool=0.05,
                                                      confidence=2.0, lost_start=True, average=False,
                                                      split=True),
    # the same, sharing batches only until the last cut (your run and the challenger take whole
    # batches to the end): about 1.8x one run's examples
    "split-early-end-cool-z2-lost-last": lambda *a: halving(*a, cuts=_TO_THE_END, protect=True, cool=0.05,
                                                            confidence=2.0, lost_start=True, average=False,
                                                            split=True, split_over=2),
    # issue 39's budget (at most 2.0x plain training's steps as hpx.Forks takes them): one cut at 8%
    # of the run to your run and the best challenger, a final decision at 35% on annealed copies of
    # both (4% windows), then plain training; with annealed copies that look ahead to the peak lr
    "lean-ahead": lambda *a: halving(*a, cuts=((0.08, 2), (0.35, 1)), protect=True, cool=0.04,
                                     confidence=2.0, lost_start=True, average=False, ahead=True),
    "lean": lambda *a: halving(*a, cuts=((0.08, 2), (0.35, 1)), protect=True, cool=0.04,
                               confidence=2.0, lost_start=True, average=False),
    # the same budget spent on a later final: the first cut at 5% of the run (3% windows), the final
    # decision at 54%
    "late-ahead": lambda *a: halving(*a, cuts=((0.05, 2), (0.54, 1)), protect=True, cool=0.03,
                                     confidence=2.0, lost_start=True, average=False, ahead=True),
    # hpx.Forks' design with annealed copies that look ahead to the schedule's peak lr (measured for
    # issue 39's warm-up and not adopted: docs/method.md)
    "halving-end-cool-z2-lost-last-ahead": lambda *a: halving(*a, cuts=_TO_THE_END, protect=True, cool=0.05,
                                                              confidence=2.0, lost_start=True, average=False,
                                                              ahead=True),
    # hpx.Forks' design with every cut placed in the steps after the schedule's peak (issue 39's warm-up)
    # hpx.Forks' design with the warm-up guard (forks below the start kept while every fork above
    # loses to it inside a warm-up; docs/method.md)
    "halving-end-cool-z2-lost-last-guard": lambda *a: halving(*a, cuts=_TO_THE_END, protect=True, cool=0.05,
                                                              confidence=2.0, lost_start=True, average=False,
                                                              guard=True),
    "halving-end-cool-z2-lost-last-peak": lambda *a: halving(*a, cuts=_TO_THE_END, protect=True, cool=0.05,
                                                             confidence=2.0, lost_start=True, average=False,
                                                             peaked=True),
    # late-ahead's cuts with the copies at the scheduler's lr: hpx.Forks with cuts=((0.05, 2), (0.54, 1)),
    # cool=0.03 (Forks-2x in benchmarks/lr/run.py)
    "late": lambda *a: halving(*a, cuts=((0.05, 2), (0.54, 1)), protect=True, cool=0.03,
                               confidence=2.0, lost_start=True, average=False),
    # the lr range test before the run (lr_find), then plain training at its suggestion
    "rangetest-steep": range_test,
    "rangetest-min10": lambda *a: range_test(*a, rule="min10"),
    "trio-z2-lost": lambda *a: halving(*a, mults=(0.1, 1.0, 10.0), cuts=((1.0, 1),), protect=True,
                                       confidence=2.0, lost_start=True, average=False),
}
