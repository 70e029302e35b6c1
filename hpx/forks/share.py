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

What is held once is watched the same way with ``share=False`` (your run's frozen parameters and
the buffers the first step left unwritten, which every fork then holds a copy of): a write to one
of them on your model alone, between steps, would reach your run and not the forks, so in both
modes such a write is refused, the same way. (With ``share=False`` a tensor that a step writes is
each fork's own, and is no longer watched from that step on.) Before every step, host reads only:
a frozen parameter unfrozen, a tensor written in place (its version moved), a buffer or parameter
replaced by assignment (your module holds another tensor under its name). At each decision, one
pass over the held tensors (a sum and a norm each, one host read): a write through ``.data``,
which torch does not count as a version.
:meth:`hpx.Forks.each` writes every fork's tensors once: a tensor held once that ``fn`` writes on
your run is not written again through the other forks (``fn`` runs on each, the tensor is theirs
too).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from hpx.averaging import local

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


_CHUNK = 1 << 20  # elements read at once: a digest's float64 temporaries stay within 8 MiB


def _digest(tensors: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """A sum and a norm of each tensor (this rank's shard of a sharded one), in float64, on the first
    one's device (device ops only), taken in chunks so that no float64 copy of a whole tensor is
    made (a frozen base's largest weight would have been copied whole at every decision)."""
    if not tensors:
        return None
    dev = local(tensors[0]).device
    parts = []
    for t in tensors:
        x = local(t).detach()  # a sharded (FSDP2) tensor: this rank's shard
        x = (torch.view_as_real(x) if x.is_complex() else x).reshape(-1)
        total = torch.zeros((), dtype=torch.float64, device=x.device)
        squares = torch.zeros((), dtype=torch.float64, device=x.device)
        for c in x.split(_CHUNK):
            total += torch.sum(c, dtype=torch.float64)
            if c.is_floating_point():
                squares += torch.linalg.vector_norm(c, dtype=torch.float64).square()
        parts += [total.to(dev), squares.to(dev)]
    return torch.stack(parts)


class _Shared:
    """The tensors every fork of one :class:`hpx.Forks` holds once (see the module's docstring)."""

    def __init__(self, model: torch.nn.Module, enabled: bool) -> None:
        self.enabled = enabled
        self._model = model  # your run's: what a write outside forks.each() is looked for on
        names = {id(p): n for n, p in model.named_parameters(remove_duplicate=True)}
        frozen = [(names[id(p)], p) for p in model.parameters() if not p.requires_grad]
        self._params: list[tuple[str, torch.Tensor]] = frozen if enabled else []
        self._frozen: list[tuple[str, torch.Tensor]] = [] if enabled else frozen  # share=False: watched only
        self._buffers: list[tuple[str, torch.Tensor, int]] = []  # (name, tensor, its version when shared)
        self._kept: list[tuple[str, torch.Tensor]] = []  # share=False: the buffers shared=True would hold
        self._watch: list[list[tuple[str, torch.Tensor, int]]] | None = None  # before the first step
        self._before: list[torch.Tensor | None] = []  # ... and your run's values then
        self._versions: dict[int, int] = {}  # id -> version of every held tensor when last checked
        self._digests: dict[int, torch.Tensor] = {}  # id -> its sum and norm when last taken
        # where your model holds them: (kind, name, module, key, tensor)
        self._places: list[tuple[str, str, torch.nn.Module, str, torch.Tensor]] = []
        self._remember()

    # What is held once: setting either list to [] (one run left, sharded forks) stops watching it in
    # both modes (share=False watches the same tensors without holding them once).
    @property
    def params(self) -> list[tuple[str, torch.Tensor]]:
        return self._params

    @params.setter
    def params(self, value: list[tuple[str, torch.Tensor]]) -> None:
        self._params = value
        if not value:
            self._frozen = []
        self._remember()

    @property
    def buffers(self) -> list[tuple[str, torch.Tensor, int]]:
        return self._buffers

    @buffers.setter
    def buffers(self, value: list[tuple[str, torch.Tensor, int]]) -> None:
        self._buffers = value
        if not value:
            self._kept = []
        self._remember()

    def held(self) -> list[tuple[str, str, torch.Tensor]]:
        """``(kind, name, tensor)`` of what your run holds that no step writes: every fork holds it
        once (``share=True``) or a copy of it (``share=False``)."""
        if self.enabled:
            return ([("parameter", n, p) for n, p in self._params]
                    + [("buffer", n, b) for n, b, _ in self._buffers])
        return [("parameter", n, p) for n, p in self._frozen] + [("buffer", n, b) for n, b in self._kept]

    def _remember(self) -> None:
        """Take what is held as it is now: versions, the places your model holds it, its digest
        (device ops, no host read)."""
        held = self.held()
        ids = {id(t) for _, _, t in held}
        self._versions = {id(t): t._version for _, _, t in held}
        places = [("parameter", f"{p}.{k}" if p else k, m, k, t) for p, m in self._model.named_modules()
                  for k, t in m._parameters.items() if t is not None and id(t) in ids]
        places += [("buffer", f"{p}.{k}" if p else k, m, k, t) for p, m in self._model.named_modules()
                   for k, t in m._buffers.items() if t is not None and id(t) in ids]
        self._places = places
        d = _digest([t for _, _, t in held])
        self._digests = {} if d is None else {id(t): d[2 * i:2 * i + 2] for i, (_, _, t) in enumerate(held)}

    def settle(self) -> None:
        """After every optimizer step, ``share=False``: a watched tensor this step wrote is each
        fork's own from now on (written by every fork's step alike), no longer watched (host reads
        only)."""
        if self.enabled or not (self._frozen or self._kept):
            return
        moved = {id(t) for _, _, t in self.held() if self._versions.get(id(t)) != t._version}
        if moved:
            self._frozen = [(n, t) for n, t in self._frozen if id(t) not in moved]
            self._kept = [(n, t) for n, t in self._kept if id(t) not in moved]
            self._places = [pl for pl in self._places if id(pl[4]) not in moved]
            for i in moved:
                self._versions.pop(i, None)
                self._digests.pop(i, None)

    def memo(self) -> dict[int, Any]:
        """A ``copy.deepcopy`` memo in which the shared tensors copy as themselves."""
        memo: dict[int, Any] = {id(p): p for _, p in self.params}
        memo.update({id(b): b for _, b, _ in self.buffers})
        return memo

    def watch(self, models: Sequence[torch.nn.Module]) -> None:
        """Before the first step's first forward: the version of every buffer of every model."""
        if self._watch is None:
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
        kept: list[tuple[str, torch.Tensor]] = []
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
            if not self.enabled:  # every fork keeps its copy; yours is watched
                kept.append((name, t))
                continue
            for n in now[1:]:
                module, key = n[i][0], n[i][1]
                module._buffers[key] = t
            self._buffers.append((name, t, t._version))
        self._kept = kept
        self._remember()

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
        """Take the shared buffers' versions, and what is held, as they are now (after a load, a
        winner's adoption or :meth:`hpx.Forks.each` wrote them). A frozen parameter that each()
        unfroze is no longer held."""
        self._frozen = [(n, p) for n, p in self._frozen if not p.requires_grad]
        self._buffers = [(n, t, t._version) for n, t, _ in self._buffers]
        self._remember()

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
                        f"{_UNSHARE}; a value you set between steps: set it through forks.each(lambda "
                        "replica: ...), which writes it once for every fork"]
        return self._yours_alone()

    def _yours_alone(self) -> list[str]:
        """A held tensor changed on your model outside forks.each(): unfrozen, written in place, or
        replaced by assignment (host reads only)."""
        fix = ("change it through forks.each(lambda replica: ...), which changes every fork's alike (a "
               "tensor held once, once), and resume from your last checkpoint (hpx.load_checkpoint)")
        where = "every fork holds it once" if self.enabled else "every fork holds a copy of it"
        for kind, name, m, key, t in self._places:
            now = (m._parameters if kind == "parameter" else m._buffers).get(key)
            if now is not t:
                return [f"{kind} {name!r} of your model was replaced by assignment after hpx.Forks was "
                        f"built; {where}, and the forks still hold the one it replaced: {fix}"]
        for kind, name, t in self.held():
            if kind == "parameter" and t.requires_grad:
                return [f"parameter {name!r} was frozen when hpx.Forks was built, and now requires grad on "
                        "your model alone: your run would train it and the other forks not. Unfreeze it with "
                        "forks.each(lambda replica: ...)"]
            if self._versions.get(id(t), t._version) != t._version:
                if self.enabled:  # a buffer of this kind is named above; a frozen parameter here
                    return [f"frozen parameter {name!r} was written in place, and every fork holds it once: "
                            "a write by a step mixes the forks' writes, one outside forks.each() reaches "
                            f"every fork at once; {fix}, or build hpx.Forks with share=False, which gives "
                            "every fork a copy of its own"]
                what = "frozen parameter" if kind == "parameter" else "buffer (unwritten by the first step)"
                return [f"{what} {name!r} was written in place on your model between steps, outside "
                        f"forks.each(); {where}, so the write would reach your run alone: {fix}"]
        return []

    def written(self) -> list[str]:
        """The held tensors whose values changed since they were last taken (a write through
        ``.data``, which moves no version): one pass over them and one host read, at a decision."""
        held = [(k, n, t) for k, n, t in self.held() if id(t) in self._digests]
        now = _digest([t for _, _, t in held])
        if now is None:
            return []
        was = torch.cat([self._digests[id(t)].to(now.device) for _, _, t in held])
        moved = (now != was).reshape(-1, 2).any(1).tolist()
        return [f"{kind} {name!r}" for (kind, name, _), m in zip(held, moved) if m]

    def taken(self) -> dict[int, tuple[torch.Tensor, int]]:
        """Each tensor held once (``share=True``) -> its sum and norm and its version, as they are
        now (device ops): what :meth:`moved` compares with."""
        held = [t for _, _, t in self.held()] if self.enabled else []
        d = _digest(held)
        return {} if d is None else {id(t): (d[2 * i:2 * i + 2], t._version) for i, t in enumerate(held)}

    def moved(self, taken: dict[int, tuple[torch.Tensor, int]]) -> list[tuple[str, torch.Tensor]]:
        """The tensors held once, of those in ``taken``, whose values or version moved since (one
        host read)."""
        held = [(n, t) for _, n, t in (self.held() if self.enabled else []) if id(t) in taken]
        if not held:
            return []
        now = _digest([t for _, t in held])
        assert now is not None
        was = torch.cat([taken[id(t)][0].to(now.device) for _, t in held])
        changed = (now != was).reshape(-1, 2).any(1).tolist()
        return [(n, t) for (n, t), c in zip(held, changed) if c or taken[id(t)][1] != t._version]

    def unshare_unfrozen(self, models: Sequence[torch.nn.Module], optimizers: Sequence[torch.optim.Optimizer],
                         ) -> None:
        """Give every model but the first (your run's) its own copy of each shared parameter that
        now requires grad, in its modules and its optimizer (called by :meth:`hpx.Forks.each`
        after ``fn`` ran on your run)."""
        thawed = {id(p): p for _, p in self.params if p.requires_grad}
        if not thawed:
            return
        self._params = [(n, p) for n, p in self._params if id(p) not in thawed]
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
