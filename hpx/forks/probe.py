"""What hpx.Forks reads from the probe, and what it checks across ranks: each fork's probe losses
(per batch or per example), taken without leaving a trace on the models scored, and the checks that
make a wrong loss_fn, batch or probe an error at the first step rather than a wrong decision later.

The probe's cost: each pass scores only what a decision reads. A pass is one fork's forward on
every probe row (eval mode, no gradients); at the defaults (5 forks, cuts to 3 and 2, no knobs) a
run makes 9: the initial weights (1: the end's lost-run test reads it, and the pass checks the
loss and the batches), the challengers' annealed copies at the first cut (4) and the second (2),
and your run and the challenger at the end (2). The end's test reads that pass when the loss gives
one loss per example; with a mean loss it scores each example of the two alone, where a challenger
scored best (2 more, by vmap: 11), not each batch whole again. A cut keeps your run whatever its
score, so it scores it only where a decision reads it: its weights or floating buffers hold a
non-finite value (is it lost?), or no challenger scored finite (is every fork lost?); the cut's
record holds ``nan`` for it otherwise. The knob forks add one pass each at the end (two at the
defaults). A row's pass cost about 0.2x a training example's step (forward, backward, optimizer
step) on an MLP on a CPU, so a probe of R rows costs a run about 9 x 0.2 x R = 2R training
examples: a 5,000-row probe on a 40-step run of 256-row batches was 20% of Forks' CPU time (25%
with a mean loss; ``python -m benchmarks.forks_probe``). The batches are given to the loss as the probe holds
them: a loss that moves them to the device moves each batch once per fork scored, so give a probe
already on the device."""

from __future__ import annotations

import itertools
import logging
import math
import warnings
from collections.abc import Callable, Iterable
from typing import Any

import torch

from hpx import _checks
from hpx._batch import _split
from hpx.averaging import local
from hpx.backends.base import Collective
from hpx.errors import ConfigError, ConsistencyError
from hpx.forks.fork import _LOST, _device, _Fork, _rng_get, _rng_set, _unreached, paired_gain
from hpx.forks.ranks import _APART
from hpx.signals import LossFn, _all_leaves, _leaves

log = logging.getLogger("hpx")


def ranks_start_alike(forks: Any, model: torch.nn.Module,
                      optimizer: torch.optim.Optimizer | None = None) -> None:
    """Under torch.distributed: every rank's settings of ``forks`` (``total_steps``, the number of
    knobs, the multiples, the cuts, ``cool``, ``confidence``) and parameter count are rank 0's, or
    every rank raises ``ConsistencyError`` (they went on to fail inside gloo); then every rank
    starts from rank 0's weights."""
    collective = forks.collective
    if collective.world_size == 1:
        return
    settings = [forks.total_steps, len(forks.knobs), *forks.multiples, *(x for c in forks.cuts for x in c),
                forks.cool, forks.confidence, sum(p.numel() for p in model.parameters())]
    collective.check_same(torch.tensor(settings, dtype=torch.float64),
                          "Forks settings (total_steps, knobs, multiples, cuts, cool, confidence, weights)")
    if optimizer is not None:  # each group's numbers (lr, weight decay, betas): a rank's own lr went unseen
        collective.check_same(torch.tensor(group_numbers(optimizer), dtype=torch.float64),
                              "the optimizer's settings (each parameter group's lr, weight decay, betas, "
                              "...; build the optimizer alike on every rank)")
    with torch.no_grad():
        for t in [*model.parameters(), *model.buffers()]:
            collective.broadcast_(t.data, 0)


def group_numbers(optimizer: torch.optim.Optimizer) -> list[float]:
    """Every parameter group's plain numbers (lr, weight decay, betas, ...), in a fixed order."""
    return [float(x) for g in optimizer.param_groups for k, v in sorted(g.items()) if k != "params"
            for x in (v if isinstance(v, tuple) else (v,))
            if isinstance(x, (int, float)) and not isinstance(x, bool)]


def probes_alike(collective: Collective, initial: float) -> None:
    """Under torch.distributed, at the first step: every rank's probe gives the initial weights (rank
    0's) rank 0's loss, or every rank raises ``ConsistencyError``; a probe sharded over the ranks
    (a ``DistributedSampler``) was used silently, only rank 0's deciding."""
    if collective.world_size == 1:
        return
    ref = collective.broadcast_object(initial, 0)
    same = ref == initial or math.isclose(ref, initial, rel_tol=1e-4) or (ref != ref and initial != initial)
    collective.check_same(torch.tensor([float(same)]), "probe losses at the initial weights (give every rank "
                          "the same probe batches, not a shard of them: rank 0's probe decides)")


# The loss that scores the probe, as an error names it: Forks(..., loss_fn=), or the loss given to
# step()/backward() when no loss_fn= was given (it then scores the probe too).
_PROBE_FN = "the probe's loss_fn (the loss_fn= you gave for the probe)"
_STEP_FN = ("the loss_fn given to forks.step() or forks.backward() (it scores the probe too, as no "
            "Forks(..., loss_fn=) was given)")


def probe_losses(forks: list[_Fork], probe: Iterable[Any], fn: LossFn, collective: Collective, units: bool,
                 averaged: list[_Fork], first: bool = False, skip: set[int] | None = None,
                 vectorize: list[bool | None] | None = None, who: str = _PROBE_FN, scalar: bool = False,
                 ) -> list[list[torch.Tensor]]:
    """Each fork's probe loss per batch (a scalar) or per example, in eval mode, without touching
    the global random stream; per example for every batch with ``units`` (a loss that gives one
    number per batch is then evaluated for each example alone). The probe is read once and every
    fork scores each batch, so losses pair up even when the probe is a shuffled DataLoader. Under
    torch.distributed the floating buffers of the forks in ``averaged`` are averaged over the ranks
    first. What a forward leaves on a model (every module's mode, attributes and buffers: a hidden
    state kept as ``self.h``) is put back after the pass, so scoring your run does not change how
    it trains. On the ``first`` pass (before any step) the loss is also checked for what would fail
    or mislead later: a batch it changes, and a mean it could not give one example at a time.
    ``vectorize`` holds whether such a mean is evaluated for all of a batch's examples at once
    (:func:`_each_example`): ``[None]`` until the first batch decides it. ``who``: the loss as an
    error names it (the probe's own, or the training loss that also scores the probe). ``scalar``
    (with ``units``): the loss is known to give one number per batch (it did on every batch of a
    pass just made), so a batch of several examples goes straight to its examples, not first
    scored whole again for a number that would be thrown away."""
    dev = _device(forks[0].model)
    keep = _rng_get(dev)
    for f in forks:
        if collective.world_size > 1 and any(f is a for a in averaged):
            _average_buffers(f.model, collective, skip or set())
    kept = [_ModelState(f.model) for f in forks]
    for f in forks:
        f.model.eval()
    out: list[list[torch.Tensor]] = [[] for _ in forks]
    try:  # in full precision, whether or not it runs inside your autocast (the first pass does)
        with torch.no_grad(), torch.autocast(dev.type, enabled=False):
            for i, b in enumerate(probe):
                rows, before = _rows(b), _layout(b) if first else None
                for f, mine in zip(forks, out):
                    whole = not (units and scalar and rows > 1)  # else the batch's number is known unread
                    v = _scalar_or_rows(_probed(fn, f, b, i, who, first), who) if whole else None
                    if v is not None and first and i == 0 and v.numel() == 1 and rows > 1:
                        ConfigError.check(_one_example_problems(f, fn, b, rows, who))
                    if v is None or (units and v.numel() == 1 and rows > 1):  # each example on its own
                        held = vectorize if vectorize is not None else [False]
                        v = _each_example(fn, f, b, rows, held, who)
                    mine.append(v.detach().to("cpu", torch.float64))
                if first:
                    ConfigError.check(batch_changed(before, b, who))
    finally:
        for k in kept:
            k.restore()
        _rng_set(keep, dev)
    return out


_WARNED: dict[str, bool] = {}  # in-place changes already warned of, by the first tensor's name


class _ModelState:
    """What a forward may leave on a model: each module's attributes (its mode, a hidden state kept
    as ``self.h``, a cache) and buffers, kept by reference to be put back, and the versions of its
    tensors, to tell a change made in place (which cannot be undone: ``Embedding(max_norm=...)``
    renormalises rows of its weight in its forward)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.saved = [(m, dict(vars(m)), dict(m._buffers)) for m in model.modules()]
        named = itertools.chain(model.named_parameters(), model.named_buffers())
        self.versions = [(n, t, t._version) for n, t in named]

    def restore(self) -> None:
        for m, attrs, bufs in self.saved:
            m.__dict__.clear()
            m.__dict__.update(attrs)
            m._buffers.clear()
            m._buffers.update(bufs)
        changed = [n for n, t, v in self.versions if t._version != v]
        if changed and not _WARNED.get(changed[0]):
            _WARNED[changed[0]] = True
            log.warning("the model's forward changed %s in place while the probe was scored (an "
                        "Embedding(max_norm=...) renormalises its weight's rows): hpx cannot undo it, so "
                        "the run is no longer exactly plain training", changed[:3])


def mean_score(parts: list[torch.Tensor], first: bool = False) -> float:
    """A fork's probe loss from its losses per batch (scalars) or per example: their mean; ``inf``
    when it is not finite (``nan`` stays on the ``first`` pass, which checks the loss)."""
    if not parts:
        raise ConfigError(["the probe yielded no batches: give a list of held-out batches (an "
                           "exhausted generator cannot be iterated again)"])
    if any(p.numel() > 1 for p in parts):  # losses per example
        flat = torch.cat([p.reshape(-1) for p in parts])
    else:
        flat = torch.stack([p.reshape(()) for p in parts])
    v = float(flat.mean())
    return v if math.isfinite(v) or (first and math.isnan(v)) else math.inf


def _layout(batch: Any) -> Any:
    """What a loss_fn may change in a batch: each tensor (by identity and version) and each dict's
    keys."""
    if torch.is_tensor(batch):
        return ("tensor", id(batch), batch._version)
    if isinstance(batch, (list, tuple)):
        return (type(batch).__name__, [_layout(b) for b in batch])
    if isinstance(batch, dict):
        return ("dict", [(k, _layout(v)) for k, v in batch.items()])
    return ("other", id(batch))


def batch_changed(before: Any, batch: Any, who: str) -> list[str]:
    """A batch that ``who`` changed in place: every fork is given the same batch object, so the
    forks after the first would see other data."""
    if before is None or _layout(batch) == before:
        return []
    return [f"{who} changed the batch it was given (a tensor modified in place, as x.mul_(2), or an entry "
            "removed, as batch.pop('labels')); every fork is given the same batch, so the forks after "
            "your run's saw other data: compute on copies (x = x * 2; batch['labels'])"]


def first_checked(call: Callable[[], Any], before: Any, batch: Any, trained: list[_Fork],
                  start: _Fork) -> Any:
    """``call()`` (every fork's forward and backward); on the first step (``before``: the batch's
    :func:`_layout` before it) also what a wrong loss_fn does silently: a batch it changes in place,
    a loss computed with your model object (:func:`hpx.forks.fork._unreached`). A failure (a later fork's
    ``KeyError`` after ``batch.pop('labels')``) names a batch the loss changed."""
    try:
        out = call()
    except Exception:
        ConfigError.check(batch_changed(before, batch, "loss_fn"))
        raise
    if before is not None:
        ConfigError.check(batch_changed(before, batch, "loss_fn") + _unreached(trained, start))
    return out


def _probed(fn: LossFn, f: _Fork, batch: Any, i: int, who: str, first: bool) -> Any:
    """``fn`` on probe batch ``i``; a failure names the probe batch and the loss. On the first pass
    (before anything trained: a wrong probe, such as a label out of range) it is a ConfigError that
    refuses the step; later (an out-of-memory error) the error is raised as it is, with a note."""
    try:
        return fn(f.replica, batch)
    except Exception as e:
        if first and not isinstance(e, ConfigError):
            raise ConfigError([f"{who} failed on probe batch {i} before anything trained "
                               f"({type(e).__name__}: {e}): check that batch (labels in range, shapes "
                               "and dtypes the model takes) and the loss; nothing was trained"]) from e
        e.add_note(f"hpx: raised by {who} on probe batch {i}")
        raise


def _each_example(fn: LossFn, f: _Fork, batch: Any, rows: int, vectorize: list[bool | None],
                  who: str = _PROBE_FN) -> torch.Tensor:
    """The loss ``fn`` gives for each of the batch's ``rows`` examples alone (a batch of one row):
    all at once, by ``torch.func.vmap`` over batches of one row, unless ``vectorize[0]`` is False;
    else one example at a time. The first batch decides (``vectorize[0]`` None): vmap must run the
    loss (an op it cannot batch, such as ``.item()`` or a branch on a value, raises) and agree with
    the one-at-a-time losses on the first examples; where not, every later batch takes the loop."""
    def looped(parts: list[Any]) -> torch.Tensor:
        return torch.stack([_scalar_or_rows(fn(f.replica, r), who).reshape(()) for r in parts])

    if vectorize[0] is not False:
        stacked, dims = _rowwise(batch, rows)
        try:
            with warnings.catch_warnings():  # torch's note that an op runs through vmap's slower
                # fallback (a transformer layer's fused path): hpx chose vmap, the user cannot act on it
                warnings.filterwarnings("ignore", message="There is a performance drop because we have "
                                        "not yet implemented the batching rule", category=UserWarning)
                v = torch.func.vmap(lambda one: _scalar_or_rows(fn(f.replica, one), who).reshape(()),
                                    in_dims=(dims,))(stacked)
        except Exception:  # any failure of the vectorized pass: the loop
            vectorize[0] = False
        else:
            if vectorize[0] is None:
                head = looped(_split(batch, rows)[:4])
                vectorize[0] = bool(torch.allclose(v[:len(head)].double(), head.double(), rtol=1e-4,
                                                   atol=1e-6, equal_nan=True))
            if vectorize[0]:
                return v
    return looped(_split(batch, rows))


def _rowwise(batch: Any, rows: int) -> tuple[Any, Any]:
    """``batch`` with every tensor of ``rows`` rows given a dimension of 1 after its first, and the
    ``in_dims`` that map ``vmap`` over those rows (anything else is given whole to every example):
    inside the map, each call sees a batch of one example."""
    if torch.is_tensor(batch):
        return (batch.unsqueeze(1), 0) if batch.dim() >= 1 and batch.shape[0] == rows else (batch, None)
    if isinstance(batch, (list, tuple)):
        parts = [_rowwise(b, rows) for b in batch]
        if hasattr(batch, "_fields"):  # a namedtuple
            return type(batch)(*(p[0] for p in parts)), type(batch)(*(p[1] for p in parts))
        return type(batch)(p[0] for p in parts), type(batch)(p[1] for p in parts)
    if isinstance(batch, dict):
        parts_ = {k: _rowwise(v, rows) for k, v in batch.items()}
        return {k: p[0] for k, p in parts_.items()}, {k: p[1] for k, p in parts_.items()}
    return batch, None


def _one_example_problems(f: _Fork, fn: LossFn, batch: Any, rows: int, who: str = _PROBE_FN) -> list[str]:
    """Why the end's test could not evaluate the probe's mean loss one example at a time (found at
    the first probe pass, not at the run's end)."""
    fix = "return one loss per example (reduction='none') through loss_fn="
    odd = [w for w, x in _all_leaves(batch, "batch")
           if not torch.is_tensor(x) and not isinstance(x, (int, float, bool, type(None)))]
    if odd:
        return [f"{odd[0]} of a probe batch is not a tensor, and hpx cannot cut it into examples for the "
                f"end's test (which scores a mean loss one example at a time): {fix}"]
    lengths = {w: int(t.shape[0]) for w, t in _leaves(batch, "batch") if t.dim() >= 1}
    if any(n != rows for n in lengths.values()):
        return [f"the tensors of a probe batch have different lengths ({lengths}), so hpx cannot cut it into "
                f"examples for the end's test: {fix}"]
    try:
        fn(f.replica, _split(batch, rows)[0])
    except Exception as e:
        return [f"{who} fails on one example of a probe batch ({type(e).__name__}: {e}; a "
                f".squeeze() that drops the batch dimension?), and the end's test scores a mean loss one "
                f"example at a time: {fix}"]
    return []


def _scalar_or_rows(v: Any, who: str = _PROBE_FN) -> torch.Tensor:
    if not torch.is_tensor(v) or v.dim() > 1:
        fix = "return the loss tensor, not .item()" if not torch.is_tensor(v) else "shape [B] at most"
        raise TypeError(f"{who} must return a tensor: a scalar or one loss per example (got "
                        f"{_checks.shown(v)}; {fix})")
    return v.detach().reshape(-1)


def _rows(batch: Any) -> int:
    """The number of examples in ``batch``: the first dimension of its first tensor (1 if none)."""
    for _, t in _leaves(batch, "batch"):
        if t.dim() >= 1:
            return int(t.shape[0])
    return 1


@torch.no_grad()
def _average_buffers(model: torch.nn.Module, collective: Collective, skip: set[int]) -> None:
    """A model's floating buffers (running statistics) <- their mean over the ranks; those in
    ``skip`` (held once by every fork, never written by a step: alike on every rank) are left."""
    bufs = [b for b in model.buffers() if b.is_floating_point() and b.numel() and id(b) not in skip]
    if bufs:
        collective.all_reduce_sum_(bufs)
        for b in bufs:
            b.div_(collective.world_size)


class _Scoring:
    """The probe's scores of forks, for :class:`hpx.Forks` (a mixin: it reads the search's probe,
    loss and collective). Each pass scores only what a decision reads (the module's docstring)."""

    _forks: Any
    _probe: Any
    _probe_fn: Any
    _probe_given: bool  # a loss_fn= of the probe's own; else the step's loss scores the probe
    _outside: bool
    _shared: Any
    _apart: Any
    _probe_units: int
    _vectorize: list[bool | None]  # whether a mean probe loss is evaluated per example by vmap
    collective: Any
    _every_pass = False
    """``True``: the probe passes hpx made before issue 51 (your run scored at every cut for the
    record, a mean loss scored whole again in the end's test): the same decisions, more passes. Kept
    to show that they are the same (``tests/test_forks_probe_cost.py``) and what they cost
    (``benchmarks/forks_probe.py``)."""

    def _probe_losses(self, forks: list[_Fork], units: bool, first: bool = False, average: bool = True,
                      scalar: bool = False) -> list[list[torch.Tensor]]:
        """Each fork's probe loss per batch (a scalar) or per example (``units``; ``scalar``: the
        loss gives one number per batch): see :func:`probe_losses`. Under torch.distributed the
        forks' floating buffers are averaged over the ranks first (not with ``average=False``: they
        were just now); your run's are left as they are when a framework trains it (its own
        data-parallel wrapper keeps them)."""
        assert self._probe_fn is not None
        who = _PROBE_FN if self._probe_given else _STEP_FN
        return probe_losses(forks, self._probe, self._probe_fn, self.collective, units,
                            self._averaged(forks) if average else [], first, skip=self._kept_buffers(),
                            vectorize=self._vectorize, who=who, scalar=scalar)

    def _averaged(self, forks: list[_Fork]) -> list[_Fork]:
        """The forks whose buffers scoring averages over the ranks: all but your run when a framework
        trains it."""
        return [f for f in forks if not (self._outside and f is self._forks[0])]

    def _kept_buffers(self) -> set[int]:
        """The buffers every fork holds once (never written by a step: alike on every rank)."""
        return {id(t) for _, t, _ in self._shared.buffers}

    def _scores(self, forks: list[_Fork], first: bool = False, average: bool = True) -> list[float]:
        """Each fork's probe loss: the mean over examples (a loss that gives them) or over batches;
        ``inf`` when it is not finite (``nan`` stays on the ``first`` pass, which checks the loss)."""
        return self._scored(forks, first, average)[0]

    def _scored(self, forks: list[_Fork], first: bool = False, average: bool = True
                ) -> tuple[list[float], list[list[torch.Tensor]]]:
        """:meth:`_scores`, and the probe's losses they were taken from (per batch or per example)."""
        if self._apart is not None and bool(self._apart):  # a decision's host read: not per step
            raise ConsistencyError(_APART)
        if first:  # the first pass's collectives follow: every rank must be starting its first step
            self._check_started()
        found = self._probe_losses(forks, units=False, first=first, average=average)
        return [mean_score(parts, first) for parts in found], found

    def _cut_scores(self, scored: list[Any]) -> tuple[list[float], bool]:
        """A cut's scores of its stand-ins ``scored`` (your run first; ``_LOST``: ``inf``), and whether
        your run's was taken. A cut keeps your run whatever its score, so its score is taken only
        where a decision reads it: when your run's trainable weights or floating buffers hold a
        non-finite value (is it lost?), or no challenger's stand-in scored finite (is every fork
        lost?). Else it is ``nan`` (the record says so), and what scoring it would have left on it
        stays done: under torch.distributed its floating buffers are averaged over the ranks."""
        yours = scored[0]
        read = self._every_pass or yours is _LOST or yours.lost or not self._finite_state(yours)
        if not read and self.collective.world_size > 1 and self._averaged([yours]):
            _average_buffers(yours.model, self.collective, self._kept_buffers())
        rest = scored if read else scored[1:]
        live = [c for c in rest if c is not _LOST]
        found = iter(self._scores(live) if live else [])
        scores = [math.inf if c is _LOST else next(found) for c in rest]
        if read:
            return scores, True
        if self._agreed(not any(map(math.isfinite, scores))):  # no challenger finite: yours is read
            return [self._scores([yours], average=False)[0], *scores], True
        return [math.nan, *scores], False

    def _finite_state(self, f: _Fork) -> bool:
        """Whether every trainable weight and floating buffer of ``f`` is finite (on every rank: one
        all-reduce under torch.distributed; a host read, at a decision)."""
        model = f.model
        held = [local(p) for p in model.parameters() if p.requires_grad]
        held += [local(b) for b in model.buffers() if b.is_floating_point()]
        held = [t for t in held if t.numel()]
        dev = _device(model)
        bad = (torch.stack([~torch.isfinite(t).all() for t in held]).sum().double().reshape(1) if held
               else torch.zeros(1, dtype=torch.float64, device=dev))
        if self.collective.world_size > 1:  # a sharded run: every rank's part
            self.collective.all_reduce_sum_([bad])
        return float(bad) == 0

    def _gain(self, a: _Fork, b: _Fork, held: tuple[Any, Any] = (None, None)) -> float:
        """How many standard errors ``a`` scores below ``b`` on the probe, example by example: from
        ``held``, their losses from a pass just made, when the loss gave one per example (so the
        end reads the probe once), else from a pass that takes each example alone (where that pass
        gave one number per batch, not scoring each batch whole again)."""
        pa, pb = held
        if pa is None or pb is None or any(p.numel() == 1 for p in pa + pb):
            scalar = (pa is not None and pb is not None and all(p.numel() == 1 for p in pa + pb)
                      and not self._every_pass)
            pa, pb = self._probe_losses([a, b], units=True, scalar=scalar)
        la, lb = torch.cat([p.reshape(-1) for p in pa]), torch.cat([p.reshape(-1) for p in pb])
        self._probe_units = len(la)  # for the log line: what the test had to go on
        return paired_gain(la, lb)
