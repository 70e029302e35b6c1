"""Checks of what a user hands the public entry points (:class:`hpx.Engine`, its step, :func:`hpx.autolr`),
made before anything is changed: each problem is one sentence that names the value given and says
the fix, for a :class:`~hpx.ConfigError`. Pure functions; nothing here touches an engine."""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from hpx.errors import ConfigError

_COLLECTIVE = ("rank", "world_size", "all_reduce_sum_", "all_gather", "broadcast_", "broadcast_object")


def shown(v: Any) -> str:
    """A value as an error message shows it: a tensor by its shape, a tuple or list of tensors by
    its kind and length, anything else by its (shortened) repr."""
    if torch.is_tensor(v):
        return f"a tensor of shape {tuple(v.shape)}"
    if isinstance(v, (tuple, list)) and any(torch.is_tensor(x) for x in v):
        return f"a {type(v).__name__} of {len(v)} items ({', '.join(type(x).__name__ for x in v[:4])})"
    if isinstance(v, (torch.optim.Optimizer, torch.nn.Module)):  # their reprs run over many lines
        return f"a {type(v).__name__}"
    text = " ".join(repr(v).split())
    return f"{text[:60]}..." if len(text) > 60 else text


def closure_problems(optimizer: torch.optim.Optimizer) -> list[str]:
    """An optimizer whose ``step`` needs a closure (``LBFGS``): hpx steps every replica or fork with
    ``optimizer.step()``, after its own backward."""
    closure = inspect.signature(type(optimizer).step).parameters.get("closure")
    if closure is None or closure.default is not inspect.Parameter.empty:
        return []
    return [f"{type(optimizer).__name__} needs a closure at every step (it re-evaluates the loss), and hpx "
            "steps each replica or fork with optimizer.step(): use a first-order optimizer (SGD, Adam, "
            "AdamW, ...)"]


def backend_problems(backend: Any) -> list[str]:
    """A backend that is not a :class:`~hpx.backends.Collective` (a name such as ``"gloo"``)."""
    if backend is None or all(hasattr(backend, a) for a in _COLLECTIVE):
        return []
    if isinstance(backend, str):
        return [f"backend={backend!r} is a name, not a Collective: call torch.distributed."
                f"init_process_group({backend!r}) and pass backend=hpx.backends.TorchDistributed() (or "
                "leave backend=None to run the replicas in this process)"]
    return [f"backend must be an hpx.backends Collective such as hpx.backends.TorchDistributed(), or None "
            f"to run the replicas in this process (got {shown(backend)})"]


def knobs_problems(knobs: Any) -> list[str]:
    """Knobs given as one knob, or as something that is not a sequence of them."""
    from hpx.knobs.base import Knob
    from hpx.registry import Knobs

    if isinstance(knobs, Knob):
        return [f"knobs must be a list of knobs (got one {type(knobs).__name__}, {knobs.name!r}): wrap it in "
                "a list, knobs=[...]"]
    if not isinstance(knobs, (Knobs, Iterable)) or isinstance(knobs, (str, bytes, dict, Iterator)):
        return [f"knobs must be a list of hpx knobs, e.g. [hpx.LearningRate(spread=0.25)], or hpx.Knobs(...) "
                f"(got {shown(knobs)})"]
    return []


def loss_fn_problems(loss_fn: Any, batch: Any) -> list[str]:
    """A ``loss_fn`` that cannot be called (``None``, or the batch when the arguments are swapped)."""
    if callable(loss_fn) and not torch.is_tensor(loss_fn):
        return []
    if callable(batch) and not torch.is_tensor(batch):
        return [f"loss_fn is {shown(loss_fn)} and the batch is a function: the arguments look swapped; "
                "call engine.step(loss_fn, batch)"]
    return [f"loss_fn must be a function (replica, batch) -> scalar loss (got {shown(loss_fn)}): e.g. "
            "engine.step(lambda rep, b: F.cross_entropy(rep.model(b[0]), b[1]), (x, y))"]


def batch_problems(batch: Any, batches: Any) -> list[str]:
    """A batch the replicas cannot share: a generator or iterator (read once, by one replica), or
    ``batches`` that is not a sequence."""
    if isinstance(batch, Iterator):
        return [f"batch is a {type(batch).__name__}, an iterator: the replicas split one "
                "batch, which an iterator is not; give the batch itself (next(it), or one batch from "
                "your DataLoader)"]
    if batches is not None and (isinstance(batches, (Iterator, str, bytes, dict))
                                or not hasattr(batches, "__len__") or not hasattr(batches, "__getitem__")):
        return [f"batches must be a list with one batch per local replica (got {shown(batches)}): give "
                "batches=[batch_0, batch_1, ...], or batch=... to split one batch among them"]
    return []


def scale_problems(scale: Any, scaler: Any) -> list[str]:
    problems = []
    if not isinstance(scale, (int, float)) or isinstance(scale, bool) or not 0 < scale < float("inf"):
        problems.append(f"scale must be a number > 0 (got {scale!r}): 1 / k when accumulating k "
                        "micro-batches")
    return problems + scaler_problems(scaler, ("scale",))


def scaler_problems(scaler: Any, uses: tuple[str, ...] = ("unscale_", "step", "update")) -> list[str]:
    """A scaler without the GradScaler methods the call ``uses``."""
    if scaler is not None and not all(callable(getattr(scaler, m, None)) for m in uses):
        return [f"scaler must be a torch.amp.GradScaler or None (got {shown(scaler)}): give the same "
                "torch.amp.GradScaler to engine.backward and engine.optimizer_step"]
    return []


def no_grad_problem(model: torch.nn.Module, loss: torch.Tensor, who: str) -> str:
    """Why the loss of ``who`` (``"replica 3"``, ``"the fork at 10x"``) has no gradient to run
    backward on, and the fix."""
    if not loss.is_floating_point():
        dtype = str(loss.dtype).removeprefix("torch.")
        return (f"loss_fn returned a {dtype} tensor for {who}: backward "
                "needs a floating-point loss computed from the model's output (e.g. F.cross_entropy("
                "rep.model(x), y)), not a count or an integer")
    if not any(p.requires_grad for p in model.parameters()):
        return (f"the model of {who} has no trainable parameters (every parameter has requires_grad="
                "False), so its loss has no gradient: unfreeze the parameters to train "
                "(p.requires_grad_(True)), or give hpx the part that trains")
    return (f"the loss of {who} does not require grad: it was detached, or computed under "
            "torch.no_grad() or from .item() values; return the loss tensor computed from rep.model's "
            "output, with its graph")


def record_problems(loss: Any, replica: Any, n_local: int) -> list[str]:
    problems = []
    if not torch.is_tensor(loss) or loss.numel() != 1:
        problems.append(f"record takes a replica's scalar loss tensor (got {shown(loss)}): pass the loss "
                        "tensor your loss function returned, engine.record(loss, replica=l)")
    if not isinstance(replica, int) or isinstance(replica, bool) or not 0 <= replica < n_local:
        problems.append(f"replica must be a local replica's index, 0 to {n_local - 1} (got {replica!r})")
    return problems


def check(problems: list[str]) -> None:
    ConfigError.check(problems)


def unknown_problems(unknown: dict[str, Any], fn: Any) -> list[str]:
    """Keyword arguments ``fn`` does not take, each with the nearest it does (``steps`` ->
    ``total_steps``)."""
    import difflib
    import inspect

    known = [n for n, p in inspect.signature(fn).parameters.items()
             if p.kind is p.KEYWORD_ONLY or (p.kind is p.POSITIONAL_OR_KEYWORD and n != "self")]
    out = []
    for name in unknown:
        near = difflib.get_close_matches(name, known, n=1, cutoff=0.7) or [n for n in known if name in n][:1]
        hint = f": did you mean {near[0]}=?" if near else f" (it takes {', '.join(known)})"
        out.append(f"unknown setting {name!r}{hint}")
    return out

