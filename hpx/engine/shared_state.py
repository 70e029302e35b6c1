"""One optimizer state for all local replicas in shared-gradient mode.

In shared mode every replica steps on the same mean gradient (Eq. 2) and differs from the
others only in its learning rate (and decoupled weight decay). For the optimizers listed in
:data:`_SHAREABLE`, the state (momentum buffers, Adam's moments, step counts) is then a
function of the gradients alone, so the ``L`` local replicas' states are equal bit for bit
and keeping ``L`` of them stores the same numbers ``L`` times. Their update is also linear
in the learning rate:

    p_l <- p_l * (1 - lr_l * wd_l) - lr_l * u

with one direction ``u`` for all replicas. :class:`_SharedState` keeps one optimizer (of
the replicas' class and settings) over *direction* tensors: each step it zeroes them, steps
that optimizer with ``lr = 1`` and no weight decay (so they hold ``-u``, and the state
advances once), then applies ``u`` to every replica with its own values. That is one
optimizer's arithmetic instead of ``L``, and one state instead of ``L``.

It is not shareable, and each replica keeps its own state, when the state depends on the
replica's own weights or values: weight decay added to the gradient (SGD's, Adam's
``weight_decay`` without ``decoupled_weight_decay``, also when a knob or your loop sets it
later), a knob that writes another optimizer setting (momentum, betas), or an optimizer not listed here.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hpx.errors import ConfigError
from hpx.replica import Replica

# update linear in lr, state a function of the gradients (and step) alone
_SHAREABLE = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.NAdam, torch.optim.RAdam,
              torch.optim.Adamax, torch.optim.RMSprop, torch.optim.Adagrad)
_VALUES = ("lr", "weight_decay")  # what may differ between replicas


def _decoupled(opt: torch.optim.Optimizer, group: dict) -> bool:
    return isinstance(opt, torch.optim.AdamW) or bool(group.get("decoupled_weight_decay", False))


def unshareable(replicas: Sequence[Replica], optimizer_knobs: Sequence[str]) -> str | None:
    """Why the local replicas' optimizer states cannot be one (``None``: they can).

    ``optimizer_knobs``: the parameter-group keys that knobs write (keys the optimizer does
    not read are harmless)."""
    opt = replicas[0].optimizer
    name = type(opt).__name__
    if type(opt) not in _SHAREABLE:
        return f"{name} is not one of the optimizers whose update is known to be linear in lr"
    other = sorted((set(optimizer_knobs) & set(opt.defaults)) - set(_VALUES))
    if other:
        return f"knobs write the optimizer's {', '.join(other)}, on which its state depends"
    if "weight_decay" in optimizer_knobs and not all(_decoupled(opt, g) for g in opt.param_groups):
        return (f"a knob writes the weight decay, which {name} couples into its state through each "
                "replica's own weights")
    for i, g in enumerate(opt.param_groups):
        if g.get("differentiable") or g.get("capturable") or g.get("fused"):
            return f"parameter group {i} is differentiable, capturable or fused"
        if g.get("weight_decay", 0) and not _decoupled(opt, g):
            return (f"parameter group {i}: {name}'s weight_decay={g['weight_decay']} enters its state "
                    "through each replica's own weights")
        if isinstance(opt, torch.optim.SGD) and not g.get("momentum", 0):
            return "SGD without momentum keeps no state to share"
    shapes = [[tuple(p.shape) for p in g["params"]] for g in opt.param_groups]
    for r in replicas[1:]:
        o = r.optimizer
        if type(o) is not type(opt) or [[tuple(p.shape) for p in g["params"]]
                                        for g in o.param_groups] != shapes:
            return f"replica {r.index}'s optimizer differs from replica {replicas[0].index}'s"
    return _settings_differ(replicas)


def _same(a: object, b: object) -> bool:
    """Equal settings; tensors (a tensor lr, betas) compared by value."""
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if torch.is_tensor(a) or torch.is_tensor(b):
        return torch.is_tensor(a) and torch.is_tensor(b) and bool(torch.equal(a, b))
    return a == b


def _state_tensors(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [torch.as_tensor(v) for g in opt.param_groups for p in g["params"]
            for _, v in sorted(opt.state.get(p, {}).items())]


def _coupled_decay(opt: torch.optim.Optimizer) -> str | None:
    """A weight decay set since the engine was built, which this optimizer couples into its state
    (the shared state's step leaves it out: it would be each replica's own)."""
    return next((f"parameter group {i} has weight_decay={g['weight_decay']}, which {type(opt).__name__} "
                 "couples into its state through each replica's own weights"
                 for i, g in enumerate(opt.param_groups)
                 if g.get("weight_decay", 0) and not _decoupled(opt, g)), None)


def _settings_differ(replicas: Sequence[Replica]) -> str | None:
    opt = replicas[0].optimizer
    keys = [k for k in opt.defaults if k not in _VALUES]
    first = [[g.get(k) for k in keys] for g in opt.param_groups]
    for r in replicas[1:]:
        for i, (g, want) in enumerate(zip(r.optimizer.param_groups, first)):
            got = [g.get(k) for k in keys]
            try:  # every step: plain values compare at C speed
                if got == want:
                    continue
            except RuntimeError:  # a tensor of several elements: compared by value below
                pass
            if not all(_same(a, b) for a, b in zip(got, want)):
                k = next(k for k, a, b in zip(keys, got, want) if not _same(a, b))
                return (f"replica {r.index}'s parameter group {i} has {k}={g.get(k)!r}, replica "
                        f"{replicas[0].index}'s {opt.param_groups[i].get(k)!r}")
    return None


class _SharedState:
    """One optimizer over direction tensors, standing in for the ``L`` replicas' states."""

    def __init__(self, replicas: Sequence[Replica]) -> None:
        self.replicas = list(replicas)
        opt = replicas[0].optimizer
        self._keys = [k for k in opt.defaults if k not in _VALUES]
        # per replica, per group: the parameters that train (the optimizer skips the others)
        self._params = [[[p for p in g["params"] if p.requires_grad] for g in r.optimizer.param_groups]
                        for r in replicas]
        # a direction per parameter, numbered as the replica's; empty for frozen ones (which the
        # optimizer skips): fine-tuning a few parameters of a large model stores only theirs
        self._dirs = [[torch.zeros_like(p) if p.requires_grad else p.new_empty(0) for p in g["params"]]
                      for g in opt.param_groups]
        groups = []
        for g, dirs in zip(opt.param_groups, self._dirs):
            groups.append({**{k: g[k] for k in self._keys if k in g}, "params": dirs, "lr": 1.0,
                           "weight_decay": 0.0})
        self.optimizer = type(opt)(groups)
        # the directions of the parameters that train, in the order of self._params
        self._train = [[d for d, p in zip(dirs, g["params"]) if p.requires_grad]
                       for dirs, g in zip(self._dirs, opt.param_groups)]
        self._decoupled = [_decoupled(opt, g) for g in opt.param_groups]
        # False until the first shared step (and again after a load): the replicas' optimizers
        # hold the state, as built or as loaded, until that step takes it over
        self.engaged = False

    @property
    def param_groups(self) -> list[dict]:  # what a GradScaler unscales: the shared gradient
        return self.optimizer.param_groups

    def attach(self) -> None:
        """Point the directions' gradients at local replica 0's (the mean, equal on all)."""
        for dirs, ps in zip(self._train, self._params[0]):
            for d, p in zip(dirs, ps):
                d.grad = p.grad

    def parameters(self) -> list[torch.Tensor]:
        return [d for dirs in self._train for d in dirs]

    def check(self) -> None:
        """Before a shared step: take the replicas' state over if it is not yet (it must be equal
        on all), and raise if a replica's optimizer was stepped on its own since, or the
        replicas' settings drifted apart."""
        own = [r for r in self.replicas if r.optimizer.state]
        if own and self.engaged:
            raise ConfigError(
                [f"replica {own[0].index}'s optimizer was stepped outside engine.optimizer_step() while "
                 "the replicas share one optimizer state: step through engine.optimizer_step() (or "
                 "engine.step()) only, or build the engine with shared_optimizer_state=False"])
        if not self.engaged:
            start = _state_tensors(self.replicas[0].optimizer)
            for r in self.replicas[1:]:
                other = _state_tensors(r.optimizer)
                if len(other) != len(start) or not all(torch.equal(a, b) for a, b in zip(start, other)):
                    raise ConfigError(
                        [f"replica {r.index}'s optimizer holds another state than replica "
                         f"{self.replicas[0].index}'s, so they cannot share one: build the engine with "
                         "shared_optimizer_state=False"])
            self.adopt()
            self.engaged = True
        why = _settings_differ(self.replicas) or _coupled_decay(self.replicas[0].optimizer)
        if why is not None:
            raise ConfigError([f"the replicas share one optimizer state, but {why}: the state depends "
                               "on it; build the engine with shared_optimizer_state=False"])

    @torch.no_grad()
    def step(self) -> None:
        """Advance the shared state once and apply the direction to every replica (the
        gradients must be attached). A GradScaler calls this only if they are finite."""
        first = self.replicas[0].optimizer.param_groups
        for sg, g in zip(self.optimizer.param_groups, first):
            for k in self._keys:  # e.g. a scheduler's momentum: equal on every replica
                sg[k] = g[k]
        dirs = self.parameters()
        torch._foreach_zero_(dirs)
        self.optimizer.step()
        for r, params in zip(self.replicas, self._params):
            # after the shared-gradient mean every parameter that trains has a gradient
            for g, ps, ds, decoupled in zip(r.optimizer.param_groups, params, self._train, self._decoupled):
                if not ps:
                    continue
                lr, wd = g["lr"], g.get("weight_decay", 0.0) if decoupled else 0.0
                if torch.is_tensor(lr):  # no host read: scale on the device
                    if wd:
                        torch._foreach_mul_(ps, 1 - lr * wd)
                    torch._foreach_add_(ps, torch._foreach_mul(ds, lr))
                    continue
                if wd:
                    torch._foreach_mul_(ps, 1.0 - lr * wd)
                torch._foreach_add_(ps, ds, alpha=lr)

    # --- checkpoints: in the replicas' own format, so that either kind of engine loads them

    def replica_state(self, optimizer: torch.optim.Optimizer) -> dict:
        """``optimizer.state_dict()``, with the shared state in it once that holds the state
        (the directions mirror the replica's groups: their parameters are numbered alike)."""
        own = optimizer.state_dict()
        return {**own, "state": self.optimizer.state_dict()["state"]} if self.engaged else own

    def adopt(self) -> None:
        """Take replica 0's optimizer state as the shared one and drop every replica's copy."""
        mine = self.optimizer.state_dict()
        saved = self.replicas[0].optimizer.state_dict()
        self.optimizer.load_state_dict({"state": saved["state"], "param_groups": mine["param_groups"]})
        for r in self.replicas:
            r.optimizer.state.clear()
