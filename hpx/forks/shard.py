"""Forks sharded over the ranks with FSDP2: each fork and annealed copy is your model sharded by
your ``shard`` function (``fully_shard`` on its blocks, then on the whole), so that ``W`` ranks
hold ``1/W`` of every fork's parameters, gradients and optimizer state, and each fork's gradients
are reduce-scattered during its backward, overlapped with it, as FSDP does for plain training.

FSDP2 modules cannot be deep-copied, so a fork is made from a template: a copy of your model on
the ``meta`` device (no memory), taken before your model is sharded. A new fork is the template
copied, sharded by ``shard``, allocated on your model's device (``to_empty``) and given the
source fork's shards, buffers and optimizer state (the optimizer and scheduler deep-copied with
the source's parameters mapped to the new ones). Your model is sharded in place and your
optimizer's parameter groups are pointed at its sharded parameters, so your objects go on being
your run, sharded: after the end they hold the winner's shards.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch

from hpx.averaging import local
from hpx.errors import ConfigError


def _dtensor_type() -> type | None:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch without distributed tensors
        return None
    return DTensor


def is_dtensor(t: Any) -> bool:
    """Whether ``t`` is a distributed tensor (an FSDP2 parameter or its optimizer state)."""
    d = _dtensor_type()
    return d is not None and isinstance(t, d)


def _meta_copy(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` deep-copied with every parameter and buffer on the meta device (no memory)."""
    memo: dict[int, Any] = {}
    for t in [*model.parameters(), *model.buffers()]:
        empty = torch.empty_like(t, device="meta")
        memo[id(t)] = torch.nn.Parameter(empty, requires_grad=t.requires_grad) if isinstance(
            t, torch.nn.Parameter) else empty
    return copy.deepcopy(model, memo)


class _Sharder:
    """Shards your model in place and makes sharded copies of a fork (see the module's docstring)."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 shard: Callable[[torch.nn.Module], Any]) -> None:
        if any(len(s) for s in optimizer.state.values()):
            raise ConfigError(["shard= needs an optimizer that has not stepped yet (its state would have to "
                               "be sharded too): build hpx.Forks before the first step"])
        self.shard = shard
        self.template = _meta_copy(model)
        old = dict(model.named_parameters())
        self._apply(model)
        new = dict(model.named_parameters())
        if new.keys() != old.keys():
            odd = sorted(set(old) ^ set(new))[:3]
            raise ConfigError([f"shard= changed the model's parameter names ({odd}): give a function "
                               "that shards the model in place with fully_shard, as FSDP2 training does"])
        moved = {id(old[k]): new[k] for k in old}
        for g in optimizer.param_groups:
            g["params"] = [moved.get(id(p), p) for p in g["params"]]

    def _apply(self, model: torch.nn.Module) -> None:
        self.shard(model)
        if not any(is_dtensor(p) for p in model.parameters()):
            raise ConfigError(["shard= left every parameter whole: give a function that shards the model "
                               "in place, e.g. shard=lambda m: fully_shard(m, mesh=mesh) (fully_shard each "
                               "block first for a large model)"])

    def copied(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any,
               shared: dict[int, Any]) -> tuple[torch.nn.Module, torch.optim.Optimizer, Any]:
        """A sharded copy of ``model`` (a fork's), its optimizer and its scheduler; the buffers in
        ``shared`` are held by the copy as they are."""
        device = next((p.device for p in model.parameters()), torch.device("cpu"))
        new = copy.deepcopy(self.template)
        self._apply(new)
        new.to_empty(device=device)
        with torch.no_grad():
            for a, b in zip(new.parameters(), model.parameters()):
                local(a).copy_(local(b))
            mods = dict(new.named_modules())
            for prefix, m in model.named_modules():
                for key, b in m._buffers.items():
                    if b is None:
                        continue
                    if id(b) in shared:
                        mods[prefix]._buffers[key] = b
                    else:
                        mods[prefix]._buffers[key].copy_(b)
        moved = {id(b): a for a, b in zip(new.parameters(), model.parameters())}
        opt, sched = copy.deepcopy((optimizer, scheduler), moved)
        return new, opt, sched


def local_state(state: dict[str, Any]) -> dict[str, Any]:
    """A model's or an optimizer's state dict with each DTensor replaced by this rank's shard (a
    checkpoint file per rank holds that rank's shards; see :func:`load_local`)."""
    out: dict[str, Any] = {}
    for k, v in state.items():
        if isinstance(v, dict):
            out[k] = local_state(v)
        else:
            out[k] = local(v)
    return out


def load_local(model: torch.nn.Module, optimizer: torch.optim.Optimizer, saved_model: dict[str, Any],
               saved_optimizer: dict[str, Any]) -> None:
    """Load a :func:`local_state` of a model and its optimizer into a sharded fork of the same
    layout: each shard copied into this rank's part of its DTensor."""
    with torch.no_grad():
        for k, t in model.state_dict().items():
            local(t).copy_(saved_model[k])
    params = [p for g in optimizer.param_groups for p in g["params"]]
    state: dict[Any, Any] = {}
    for idx, entry in saved_optimizer["state"].items():
        p = params[int(idx)]
        state[idx] = {k: _as_dtensor(v, p) for k, v in entry.items()}
    optimizer.load_state_dict({"state": state, "param_groups": saved_optimizer["param_groups"]})


def _as_dtensor(v: Any, p: torch.Tensor) -> Any:
    if not (is_dtensor(p) and torch.is_tensor(v) and v.dim() > 0 and v.shape == p.to_local().shape):
        return v
    d = _dtensor_type()
    assert d is not None
    return d.from_local(v, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())
