"""What :class:`hpx.Forks` holds once for every fork: the tensors no step writes.

A fork's memory is what it trains: its trainable parameters, their gradients and its optimizer
state. A frozen parameter (``requires_grad=False``: a pretrained base under a new head or adapters)
and a buffer that training never writes (a causal mask, position ids, the running statistics of a
BatchNorm kept in eval mode) are the same in every fork at every step, so every fork and annealed
copy holds your run's tensor itself rather than a copy of it.

* Frozen parameters are shared from the start (``copy.deepcopy`` is given them as already copied).
* Buffers are shared once the first optimizer step has shown which ones a step writes: those it
  left unchanged in every fork, both in value and in version (torch's count of in-place writes),
  and equal in every fork (a knob may set one). A normalisation layer's running statistics are
  never shared: the kernel updates them without counting the write, and a layer in eval mode at
  the first step may be put back in train mode later.
* Before every step, host reads only (a flag and a version per shared tensor, no device sync):
  a shared parameter that now requires grad (a layer unfrozen on your model alone) is refused
  before anything changes, and a shared buffer written since (a cache filled late) stops the run
  with its name. Unfreeze through :meth:`hpx.Forks.each`, which first gives every other fork its
  own copy of what the change unfreezes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

_UNSHARE = ("or build hpx.Forks with share=False, which gives every fork its own copy of every tensor")


def _named_buffers(model: torch.nn.Module) -> list[tuple[torch.nn.Module, str, str, torch.Tensor]]:
    """``(module, key, full name, tensor)`` for every buffer, each module once (a module used twice
    is walked once), in ``named_modules`` order: the same order in every fork."""
    out = []
    for prefix, m in model.named_modules():
        for key, b in m._buffers.items():
            if b is not None:
                out.append((m, key, f"{prefix}.{key}" if prefix else key, b))
    return out


def _slots(model: torch.nn.Module) -> list[tuple[torch.nn.Module, str]]:
    """``(module, key)`` of every registered parameter, tied ones at each place they are held."""
    return [(m, key) for m in model.modules() for key, p in m._parameters.items() if p is not None]


class _Shared:
    """The tensors every fork of one :class:`hpx.Forks` holds once (see the module's docstring)."""

    def __init__(self, model: torch.nn.Module, enabled: bool) -> None:
        self.enabled = enabled
        names = {id(p): n for n, p in model.named_parameters(remove_duplicate=True)}
        self.params: list[tuple[str, torch.Tensor]] = [
            (names[id(p)], p) for p in model.parameters() if not p.requires_grad] if enabled else []
        self.buffers: list[tuple[str, torch.Tensor, int]] = []  # (name, tensor, its version when shared)
        self._watch: list[list[tuple[str, torch.Tensor, int]]] | None = None  # before the first step
        self._before: list[torch.Tensor | None] = []  # ... and your run's values then

    def memo(self) -> dict[int, Any]:
        """A ``copy.deepcopy`` memo in which the shared tensors copy as themselves."""
        memo: dict[int, Any] = {id(p): p for _, p in self.params}
        memo.update({id(b): b for _, b, _ in self.buffers})
        return memo

    def watch(self, models: Sequence[torch.nn.Module]) -> None:
        """Before the first step's first forward: the version of every buffer of every model."""
        if self.enabled and self._watch is None:
            self._watch = [[(n, b, b._version) for _, _, n, b in _named_buffers(m)] for m in models]
            norms = torch.nn.modules.batchnorm._NormBase
            self._before = [None if isinstance(m, norms) else b.detach().clone()
                            for m, _, _, b in _named_buffers(models[0])]

    def forget(self) -> None:
        """Drop what :meth:`watch` saw (a first step that failed: the next one watches again)."""
        self._watch, self._before = None, []

    def share_buffers(self, models: Sequence[torch.nn.Module]) -> None:
        """After the first optimizer step: the buffers it left unwritten in every model (``models[0]``
        your run's, the others forks' and copies' in the order :meth:`watch` saw them) become your
        run's own tensors in every model."""
        watched, self._watch = self._watch, None
        before, self._before = self._before, []
        if watched is None or len(watched) != len(models):
            return
        now = [_named_buffers(m) for m in models]
        if any(len(w) != len(n) for w, n in zip(watched, now)):
            return  # a module added a buffer during the step: share nothing
        untouched = [before[i] is not None and all(w[i][1] is n[i][3] and w[i][2] == n[i][3]._version
                                                   for w, n in zip(watched, now))
                     for i in range(len(now[0]))]
        mine = now[0]
        for i, ok in enumerate(untouched):
            if not ok:
                continue
            _, _, name, t = mine[i]
            was = before[i]
            assert was is not None
            same = all(n[i][2] == name and n[i][3].shape == t.shape and n[i][3].dtype == t.dtype
                       and n[i][3].device == t.device and torch.equal(n[i][3], was) for n in now)
            if not same:  # written without a version (a fused kernel), or set apart by a knob
                continue
            for n in now[1:]:
                module, key = n[i][0], n[i][1]
                module._buffers[key] = t
            self.buffers.append((name, t, t._version))

    def adopt(self, model: torch.nn.Module) -> None:
        """Point ``model``'s buffers at the shared ones (a fork rebuilt from a checkpoint)."""
        if not self.buffers:
            return
        shared = {n: t for n, t, _ in self.buffers}
        for m, key, name, b in _named_buffers(model):
            t = shared.get(name)
            if t is not None and t is not b and t.shape == b.shape and t.dtype == b.dtype:
                m._buffers[key] = t

    def refresh(self) -> None:
        """Take the shared buffers' versions as they are now (after a load or a winner's adoption
        copied values into them)."""
        self.buffers = [(n, t, t._version) for n, t, _ in self.buffers]

    def problems(self) -> list[str]:
        """What broke the sharing since the last step (host reads only)."""
        for name, p in self.params:
            if p.requires_grad:
                return [f"parameter {name!r} was frozen when hpx.Forks was built, so every fork holds it "
                        "once, and now requires grad: a layer unfrozen on your model alone would be "
                        "trained by every fork at once. Unfreeze it with forks.each(lambda replica: ...), "
                        f"which gives every fork its own copy first, {_UNSHARE}"]
        for name, t, v in self.buffers:
            if t._version != v:
                return [f"buffer {name!r} was written in place after the first step, which left it "
                        "untouched, so every fork holds it once and the forks' writes to it have mixed: "
                        "write it at every step (the first included) or keep it out of the model's buffers, "
                        f"{_UNSHARE}"]
        return []

    def unshare_unfrozen(self, models: Sequence[torch.nn.Module], optimizers: Sequence[torch.optim.Optimizer],
                         ) -> None:
        """Give every model but the first (your run's) its own copy of each shared parameter that
        now requires grad, in its modules and its optimizer (called by :meth:`hpx.Forks.each`
        after ``fn`` ran on your run)."""
        thawed = {id(p): p for _, p in self.params if p.requires_grad}
        if not thawed:
            return
        self.params = [(n, p) for n, p in self.params if id(p) not in thawed]
        for model, opt in zip(models[1:], optimizers[1:]):
            own: dict[int, torch.nn.Parameter] = {}
            for m, key in _slots(model):
                p = m._parameters[key]
                if id(p) in thawed:
                    if id(p) not in own:
                        own[id(p)] = torch.nn.Parameter(p.detach().clone(), requires_grad=True)
                    m._parameters[key] = own[id(p)]
            for g in opt.param_groups:
                g["params"] = [own.get(id(p), p) for p in g["params"]]
            for old, new in own.items():
                if thawed[old] in opt.state:
                    opt.state[new] = opt.state.pop(thawed[old])
