"""What built a :class:`hpx.Forks` run, recorded in its checkpoints so that a resume into a run
built otherwise is refused with the difference named, where it used to load silently: the
optimizer's settings (a saved state would overwrite another lr or weight decay), the schedule's
shape (a LambdaLR's function is no part of its state, and a OneCycleLR of another length went
unseen), the dropout rates (the new ones applied to the old run) and the probe's data.

Each is taken when Forks is built (the probe's at its first pass, or at a load), from host values
only; comparing two records is exact for settings and to a relative ``1e-6`` for sums. The probe's
``loss_fn`` cannot be compared (a function) and is not. To change a setting on purpose, resume
first, then change it in every fork with ``forks.each(...)``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch

from hpx.signals import _leaves

_VOLATILE = {"last_epoch", "_step_count", "_last_lr", "_get_lr_called_within_step", "_is_initial",
             "verbose", "lr_lambdas", "_schedulers"}


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _plain(v: Any) -> Any:
    """Numbers, flags, names and lists of them, as JSON would keep them; anything else left out."""
    if isinstance(v, (bool, str)) or v is None or _number(v):
        return v
    if isinstance(v, (list, tuple)):
        items = [_plain(x) for x in v]
        return items if all(x is not _SKIP for x in items) else _SKIP
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
    """The schedule's shape: a LambdaLR's factors at five steps of the run, and every scheduler's
    plain settings (a OneCycleLR's length and phases), a SequentialLR's or ChainedScheduler's parts
    included."""
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
    parts = getattr(scheduler, "_schedulers", None)
    if parts:
        out["parts"] = [schedule_record(s, total_steps) for s in parts]
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


def differences(saved: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """What differs between two records, named (the first few of each kind)."""
    out = []
    for what, label in (("optimizer", "the optimizer's settings"), ("schedule", "the schedule"),
                        ("dropout", "the dropout rates"), ("probe", "the probe's data")):
        if what not in saved or what not in now or saved[what] is None or now[what] is None:
            continue
        a, b = saved[what], now[what]
        if not _close(a, b):
            out.append(f"{label}: saved {_short(a)}, this run {_short(b)}")
    return out


def _close(a: Any, b: Any) -> bool:
    if _number(a) and _number(b):
        return a == b or math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-9)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_close(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_close(x, y) for x, y in zip(a, b))
    return a == b


def _short(v: Any, limit: int = 160) -> str:
    text = repr(v)
    return text if len(text) <= limit else text[: limit - 3] + "..."
