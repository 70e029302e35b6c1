"""What built a :class:`hpx.Forks` run, recorded in its checkpoints so that a resume into a run
built otherwise is refused with the difference named, where it used to load silently: the
optimizer's settings (a saved state would overwrite another lr or weight decay), the schedule's
whole shape (a LambdaLR's function is no part of its state; a OneCycleLR of another length, or of
another ``pct_start``, went unseen), the dropout rates (the new ones applied to the old run), the
probe's data and the probe's loss as it scores.

Each is taken when Forks is built (the probe's data at its first pass, or at a load) from host
values only, except the probe's loss. A loss function cannot be compared, and its values at your
run's weights change as the run trains, so it is fingerprinted at each save instead
(:func:`probe_loss_record`): the losses it gives your run's model at the weights being saved on the
first probe batch (their count, mean and first few, in float64), beside that batch's data. A load
scores the same batch with this run's ``loss_fn`` on the saved weights (swapped in for the call
only, by ``torch.func.functional_call``: nothing of the run changes, at the cost of one transient
copy of your run's weights on its device) and compares. A probe whose first batch differs from the
saved one (a shuffled loader) leaves that comparison out. Its cost is one probe batch per save and
per load, never per step.

Comparing two records is exact for settings, to a relative ``1e-6`` for sums and ``1e-5`` for the
probe's losses (the same loss on the same weights gives the same bits; label smoothing added moves
them by far more). A field a record saved before it was kept lacks (``_NEW``) is unknown, not a
difference. To change an optimizer setting or dropout rate on purpose, resume first, then change it
in every fork with ``forks.each(...)``; a schedule or a probe loss of another shape is a fresh run.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from typing import Any

import torch

from hpx.signals import _leaves

_VOLATILE = {"last_epoch", "_step_count", "_last_lr", "_get_lr_called_within_step", "_is_initial",
             "verbose", "lr_lambdas", "_schedulers"}
# fields records saved before them lack: unknown there, not a difference
_NEW = {"shape", "arguments", "probe_loss"}
# containers of settings, left out of the names a difference is given by
_GROUPS = {"settings", "shape", "arguments"}


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _plain(v: Any, nested: bool = False) -> Any:
    """Numbers, flags, names and lists of them, as JSON would keep them (``nested``: and the plain
    entries of dicts, such as a OneCycleLR's phases); anything else left out."""
    if isinstance(v, (bool, str)) or v is None or _number(v):
        return v
    if isinstance(v, (list, tuple)):
        items = [_plain(x, nested) for x in v]
        return items if all(x is not _SKIP for x in items) else _SKIP
    if nested and isinstance(v, dict) and all(isinstance(k, str) for k in v):
        kept = {k: _plain(x, nested) for k, x in sorted(v.items())}
        return {k: x for k, x in kept.items() if x is not _SKIP}
    return _SKIP


_SKIP = object()


_SCHEDULED = {"params", "lr", "momentum", "betas"}  # what a scheduler writes as the run goes


def optimizer_record(optimizer: torch.optim.Optimizer, scheduled: bool) -> list[dict[str, Any]]:
    """Each parameter group's settings (weight decay, eps, ...; the lr, momentum and betas too when
    no scheduler writes them: a scheduler's record holds where they start), not its tensors."""
    out = []
    for g in optimizer.param_groups:
        kept = {k: _plain(v) for k, v in g.items() if k not in (_SCHEDULED if scheduled else {"params"})}
        out.append({k: v for k, v in sorted(kept.items()) if v is not _SKIP})
    return out


def schedule_record(scheduler: Any, total_steps: int) -> dict[str, Any]:
    """The schedule's whole shape: a LambdaLR's factors at five steps of the run; every scheduler's
    settings from its ``state_dict`` less what moves as it steps (``settings``: plain values, as
    records saved before ``shape`` held; ``shape``: the entries made of dicts, such as phases); a
    OneCycleLR's arguments, each by name (``arguments``: ``pct_start`` is only in its phases,
    ``max_lr``, ``div_factor`` and ``final_div_factor`` only in the optimizer's groups); a
    SequentialLR's or ChainedScheduler's parts included."""
    if scheduler is None:
        return {}
    out: dict[str, Any] = {"type": type(scheduler).__name__}
    fns = getattr(scheduler, "lr_lambdas", None)
    if fns:
        steps = sorted({0, total_steps // 4, total_steps // 2, (3 * total_steps) // 4,
                        max(0, total_steps - 1)})
        out["factors"] = [[float(f(t)) for t in steps] for f in fns]
    state = scheduler.state_dict()
    out["settings"] = {k: p for k, p in ((k, _plain(v)) for k, v in sorted(state.items())
                                         if k not in _VOLATILE) if p is not _SKIP}
    arguments = _onecycle_arguments(scheduler, state)
    covered = {"_schedule_phases"} if arguments else set()  # named in the arguments
    shape = {k: p for k, p in ((k, _plain(v, nested=True)) for k, v in sorted(state.items())
                               if k not in _VOLATILE | covered | out["settings"].keys()) if p is not _SKIP}
    if shape:
        out["shape"] = shape
    if arguments:
        out["arguments"] = arguments
    parts = getattr(scheduler, "_schedulers", None)
    if parts:
        out["parts"] = [schedule_record(s, total_steps) for s in parts]
    return out


def _onecycle_arguments(scheduler: Any, state: dict[str, Any]) -> dict[str, Any] | None:
    """Every argument a torch ``OneCycleLR`` was built with, read back from its state and its
    optimizer's groups (one value per group; the value itself for one group)."""
    if not isinstance(scheduler, torch.optim.lr_scheduler.OneCycleLR):
        return None

    def near(x: float) -> float:  # a ratio read back: 25.000000000000004 is 25.0
        return float(f"{float(x):.12g}")

    def each(values: list[Any]) -> Any:
        return values[0] if len(values) == 1 else values

    try:
        total, phases = int(state["total_steps"]), state["_schedule_phases"]
        groups = scheduler.optimizer.param_groups
        kind = state.get("_anneal_func_type") or getattr(getattr(scheduler, "anneal_func", None),
                                                         "__name__", "?").replace("_annealing_", "")
        out: dict[str, Any] = {
            "total_steps": total, "pct_start": near((float(phases[0]["end_step"]) + 1) / total),
            "anneal_strategy": kind, "three_phase": len(phases) == 3,
            "max_lr": each([float(g["max_lr"]) for g in groups]),
            "div_factor": each([near(g["max_lr"] / g["initial_lr"]) for g in groups]),
            "final_div_factor": each([near(g["initial_lr"] / g["min_lr"]) for g in groups]),
            "cycle_momentum": bool(state.get("cycle_momentum"))}
        if out["cycle_momentum"]:
            out["base_momentum"] = each([float(g["base_momentum"]) for g in groups])
            out["max_momentum"] = each([float(g["max_momentum"]) for g in groups])
    except (KeyError, IndexError, TypeError, ValueError, ZeroDivisionError, AttributeError):
        return None  # not built as torch builds it: its state's shape is compared instead
    return out


def dropout_record(model: torch.nn.Module) -> list[float]:
    """The dropout rate of every dropout module, in order."""
    kinds = torch.nn.modules.dropout._DropoutNd
    return [float(m.p) for m in model.modules() if isinstance(m, kinds)]


def probe_record(probe: Iterable[Any]) -> list[list[float]]:
    """Per tensor position of a probe batch: its examples, sum and sum of squares over the whole
    probe (order does not matter: a shuffled loader gives the same record)."""
    totals: list[list[float]] = []
    for batch in probe:
        leaves = [t for _, t in _leaves(batch, "batch") if t.dtype != torch.bool and t.numel()]
        for i, t in enumerate(leaves):
            d = t.detach().double()
            row = [float(t.shape[0]) if t.dim() else 1.0, float(d.sum()), float((d * d).sum())]
            if i < len(totals):
                totals[i] = [a + b for a, b in zip(totals[i], row)]
            else:
                totals.append(row)
    return totals


_HEAD = 4  # the first losses of the batch kept beside their count and mean


def probe_loss_record(fn: Any, replica: Any, probe: Iterable[Any],
                      weights: dict[str, Any] | None = None) -> dict[str, Any] | None:
    """The probe's loss as it scores (see the module's docstring): ``fn`` on the first probe batch
    at your run's weights (``replica.model``'s own, or ``weights``, a saved ``state_dict`` of it,
    swapped in for the call only), as the probe scores it (eval mode, no grad, full precision, the
    random streams and what a forward leaves on the model put back). ``None`` when unknown: no
    batch, a weight missing from ``weights``, a loss that is not finite."""
    from hpx.forks.fork import _device, _rng_get, _rng_set
    from hpx.forks.probe import _ModelState, _scalar_or_rows

    model = replica.model
    tensors: dict[str, torch.Tensor] | None = None
    if weights is not None:
        live = dict(model.named_parameters())
        if any(n not in weights or not torch.is_tensor(weights[n]) for n in live):
            return None
        live.update((n, b) for n, b in model.named_buffers() if torch.is_tensor(weights.get(n)))
        tensors = {n: weights[n].to(device=t.device, dtype=t.dtype) for n, t in live.items()}
    dev = _device(model)
    keep = _rng_get(dev)  # a shuffled loader draws as it is read
    kept = _ModelState(model)
    model.eval()
    try:
        batch = next(iter(probe), None)
        if batch is None:
            return None
        with torch.no_grad(), torch.autocast(dev.type, enabled=False):
            if tensors is None:
                v = fn(replica, batch)
            else:
                v = torch.func.functional_call(_Called(model, lambda b: fn(replica, b)),
                                               {f"model.{n}": t for n, t in tensors.items()}, (batch,),
                                               tie_weights=True, strict=False)
        losses = _scalar_or_rows(v).to("cpu", torch.float64)
    finally:
        kept.restore()
        _rng_set(keep, dev)
    if not bool(torch.isfinite(losses).all()):
        return None
    return {"batch": probe_record([batch]), "examples": losses.numel(), "mean": float(losses.mean()),
            "first": [float(x) for x in losses[:_HEAD]]}


class _Called(torch.nn.Module):
    """A call of the probe's loss as a module holding your model, for ``functional_call`` to swap
    the saved weights in for it (the model itself is not changed)."""

    def __init__(self, model: torch.nn.Module, call: Any) -> None:
        super().__init__()
        self.model = model
        self.call = call

    def forward(self, batch: Any) -> Any:
        return self.call(batch)


def probe_loss_saved(forks: Any) -> dict[str, Any] | None:
    """The record of the probe's loss a save keeps: at your run's weights, once the first probe
    pass checked the loss (not for a decided run, which a resume does not check, nor for sharded
    forks, whose forward every rank takes together). Resumed with no loss bound yet (the step's
    loss scores the probe, and no step ran since the load): the record loaded, of these weights."""
    if forks.decided or forks._sharder is not None:
        return None
    if forks._probe_fn is None:
        return forks._built.get("probe_loss")
    if forks._initial is None:
        return None
    return probe_loss_record(forks._probe_fn, forks._forks[0].replica, forks._probe)


def probe_loss_now(forks: Any, saved: Any, state: dict[str, Any]) -> dict[str, Any] | None:
    """This run's probe loss on the saved weights of your run in ``state``, to compare with the
    saved record ``saved``: ``None`` (unknown) with no record saved, no loss yet, sharded forks, or
    a first probe batch other than the saved one."""
    if not isinstance(saved, dict) or forks._probe_fn is None or forks._sharder is not None:
        return None
    weights = state["forks"][0].get("model")
    if not isinstance(weights, dict):
        return None
    now = probe_loss_record(forks._probe_fn, forks._forks[0].replica, forks._probe, weights)
    if now is None or not _close(saved.get("batch"), now["batch"]):
        return None
    return now


_LABELS = (("optimizer", "the optimizer's settings", ""),
           ("schedule", "the schedule",
            " (build the schedule with the saved run's scheduler and arguments, or start a fresh run)"),
           ("dropout", "the dropout rates", ""),
           ("probe", "the probe's data", ""),
           ("probe_loss", "the probe's loss (its values on the first probe batch at the saved weights)",
            " (give the probe the saved run's loss_fn=, or start a fresh run)"))


def differences(saved: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """What differs between two records, each setting named by its saved and this run's value,
    with the fix where resuming first cannot apply it."""
    out = []
    for what, label, fix in _LABELS:
        if what not in saved or what not in now or saved[what] is None or now[what] is None:
            continue
        odd = _diffs(saved[what], now[what], "", 1e-5 if what == "probe_loss" else 1e-6)
        public = [d for d in odd if not re.split(r"[.\]]", d[0])[-1].startswith("_")]
        odd = public or odd  # a private field by its argument's name where one is given (anneal_strategy)
        if odd:
            shown: dict[str, tuple[Any, Any]] = {}
            for path, x, y in odd:  # a length is both in a OneCycleLR's settings and its arguments
                shown.setdefault(path, (x, y))
            if list(shown) == [""]:  # the record is one value (the dropout rates)
                a_s, b_s = _short(shown[""][0]), _short(shown[""][1])
            else:
                a_s, b_s = (_short({k: v[i] for k, v in shown.items()}) for i in (0, 1))
            out.append(f"{label}: saved {a_s}, this run {b_s}{fix}")
    return out


class _Absent:
    def __repr__(self) -> str:
        return "(none)"


_ABSENT = _Absent()


def _diffs(a: Any, b: Any, path: str, rel: float) -> list[tuple[str, Any, Any]]:
    """Each setting that differs, by its name (``parts[1].gamma``) and both values; the fields of
    ``_NEW`` that one record lacks are left out."""
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for k in [*a, *(k for k in b if k not in a)]:
            name = path if k in _GROUPS else f"{path}.{k}" if path else str(k)
            if k not in a or k not in b:
                if k not in _NEW:
                    out.append((name, a.get(k, _ABSENT), b.get(k, _ABSENT)))
                continue
            out += _diffs(a[k], b[k], name, rel)
        return out
    if (isinstance(a, list) and isinstance(b, list) and len(a) == len(b)
            and any(isinstance(x, dict) for x in a + b)):
        return [d for i, (x, y) in enumerate(zip(a, b))
                for d in _diffs(x, y, f"{path}[{i}]" if len(a) > 1 else path, rel)]
    return [] if _close(a, b, rel) else [(path, a, b)]


def _close(a: Any, b: Any, rel: float = 1e-6) -> bool:
    if _number(a) and _number(b):
        return a == b or math.isclose(a, b, rel_tol=rel, abs_tol=1e-9)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_close(a[k], b[k], rel) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_close(x, y, rel) for x, y in zip(a, b))
    return a == b


def _short(v: Any, limit: int = 160) -> str:
    text = repr(v)
    return text if len(text) <= limit else text[: limit - 3] + "..."
