"""Forks' gradients over the ranks (every rank holding every fork): each fork's gradient averaged
in buckets of bounded size, with how many ranks had each parameter's gradient, and the marker a
decision sends so that ranks that ran different numbers of steps raise instead of hanging."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from hpx._buckets import dtype_groups
from hpx.errors import ConsistencyError
from hpx.forks.fork import _device, _Fork

_APART = ("under torch.distributed some ranks' losses reached a parameter that others' did not (a branch "
          "or an expert chosen by the data), so its gradient was averaged over some ranks only and the "
          "ranks' forks drifted apart: make every rank's loss reach every trainable parameter (add 0 * "
          "head(x).sum() for a branch not taken), or freeze the parameters no loss reaches, as plain DDP "
          "(without find_unused_parameters) requires too")


@torch.no_grad()
def mean_over_ranks(trained: Sequence[_Fork],
                    collective: Any) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Every fork's gradient <- its mean over the ranks, fork after fork (:func:`fork_mean`, each
    waited before the next is sent). Returns a device flag (no host read): some parameter's gradient
    on some ranks and not on others; and a rank that sent a decision's marker
    (:func:`check_steps_aligned`)."""
    apart = met = None
    for i, f in enumerate(trained):
        odd, m = fork_mean(f, collective, first=i == 0).wait()
        apart, met = either(apart, odd), either(met, m)
    return apart, met


def either(held: torch.Tensor | None, new: torch.Tensor | None) -> torch.Tensor | None:
    """Two device flags or'ed (no host read); ``None`` is no flag."""
    return held if new is None else new if held is None else held | new


@torch.no_grad()
def fork_mean(f: _Fork, collective: Any, *, first: bool = False, free: bool = False) -> _ForkMean:
    """Start the all-reduce of fork ``f``'s gradients: one per (device, dtype) group of its trainable
    parameters (in buckets of at most :data:`_BUCKET` elements), each holding every trainable
    parameter (zeros where this rank's loss did not reach it, so that every rank's buffers line up)
    and how many ranks had its gradient. Asynchronous where ``collective`` offers
    ``all_reduce_sum_async_`` (:class:`hpx.backends.TorchDistributed`); :meth:`_ForkMean.wait` ends it.

    Every path sends the same per-fork buffers (``step``'s, overlapped, and ``optimizer_step``'s), so
    they agree bit for bit. Over two ranks these are also the sums of one all-reduce over every fork's
    gradients together (one addition per element); over more, where an element sits in the buffer can
    change the order a ring adds the ranks in, and so its last bit.

    ``first``: the step's first reduction, whose first bucket may meet a decision's marker
    (:func:`check_steps_aligned`): where that is read on the host (CPU), its other buckets are sent
    only once it is checked, as a step's sent one after another. ``free``: each gradient let go once
    packed and, after the reduction, a view of the reduced buffer (one copy of the fork's gradients
    alive while it travels, not two); else the buckets are sent one after another, each waited on
    before the next is packed (one bucket's copy at a time), the gradients written in place."""
    params = [p for p in f.model.parameters() if p.requires_grad]
    groups = dtype_groups(params, skip_empty=True).values()
    runs = [b for idx in groups for b in _buckets([params[i] for i in idx])]
    return _ForkMean(runs, collective, first, free)


class _ForkMean:
    """One fork's all-reduces in flight (:func:`fork_mean`)."""

    def __init__(self, runs: list[list[torch.Tensor]], collective: Any, first: bool, free: bool) -> None:
        self.runs, self.collective, self.free = runs, collective, free
        self.sent: list[tuple[torch.Tensor, list[bool], Any]] = []
        held = not free or (first and bool(runs) and runs[0][0].device.type == "cpu")
        for ps in runs[:1] if held else runs:  # kept: each bucket's copy sent once the last is done
            self._send(ps)

    def _send(self, ps: list[torch.Tensor]) -> None:
        had = [p.grad is not None for p in ps]
        has = ps[0].new_ones(len(ps))
        for j in (j for j, mine in enumerate(had) if not mine):
            has[j] = 0
        flat = torch.cat([p.grad.reshape(-1) if p.grad is not None else p.new_zeros(p.numel()) for p in ps]
                         + [has])
        if self.free:
            for p in ps:
                p.grad = None
        start = getattr(self.collective, "all_reduce_sum_async_", None)
        if start is None:
            self.collective.all_reduce_sum_([flat])
        self.sent.append((flat, had, None if start is None else start(flat)))

    @torch.no_grad()
    def wait(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The gradients <- their mean; returns the device flags of a gradient some ranks lacked and
        of a rank that sent a decision's marker instead, which is raised as :class:`ConsistencyError`
        at once on the CPU (a host read of a CPU tensor: free) and at the next decision elsewhere."""
        world = self.collective.world_size
        apart = met = None
        for k, ps in enumerate(self.runs):
            if k == len(self.sent):  # the first bucket checked (kept: the last one done), the next sent now
                for rest in self.runs[k:] if self.free else [ps]:
                    self._send(rest)
            flat, had, work = self.sent[k]
            if work is not None:
                work.wait()
            odd, m = _mean_bucket(ps, flat, had, world, self.free)
            apart, met = either(apart, odd), either(met, m)
        self.sent = []
        return apart, met


_MET = ("the ranks ran different numbers of optimizer steps: every step's gradient all-reduce must pair with "
        "the same step's on every rank. Give every rank as many batches (drop_last=True, one length per "
        "rank), skip a bad batch on every rank or on none, and call converge() and load_checkpoint on every "
        "rank")


def first_bucket(trained: Sequence[_Fork]) -> list[torch.Tensor]:
    """The parameters of a step's first all-reduce (the first fork's first bucket, :func:`fork_mean`):
    the shape a decision's marker takes so that a rank still at a step pairs with it
    (:func:`check_steps_aligned`)."""
    params = [p for f in trained[:1] for p in f.model.parameters() if p.requires_grad]
    groups = list(dtype_groups(params, skip_empty=True).values())
    return _buckets([params[i] for i in groups[0]])[0] if groups else []


def check_steps_aligned(trained: Sequence[_Fork], collective: Any, step: int, when: str,
                        starting: bool = False) -> None:
    """Before a decision (or converge(), or a load) under torch.distributed: every rank sends one
    all-reduce shaped as a step's first, zeros where the gradients go and the marker ``-(W + 1)``
    where the counts of ranks go. Ranks at the same point see ``W`` markers; a rank still at a
    training step pairs its gradients with it instead, and both raise :class:`ConsistencyError`
    within that one collective, where they used to hang until the process group's timeout (the
    engine's marker, ``hpx/engine/aligned.py``, for Forks' buckets). Float gradients of 16 bits are not
    checked (the sum of markers is not exact there).

    ``starting``: the first step's marker, sent before the first probe pass (whose collectives are
    not a step's), twice the others': a rank that starts training while another loads a checkpoint
    (or decides, or saves) pairs its marker with the other's, the sum is neither rank's marker times
    ``W``, and both raise (with two markers any mix is caught: ``a n_a + 2 a n_b = a W`` only if
    ``n_b = 0``)."""
    ps = first_bucket(trained)
    if not ps or ps[0].dtype not in (torch.float32, torch.float64):
        return
    world = collective.world_size
    mark = -float(world + 1) * (2 if starting else 1)  # a step's counts are 0..W: a marker makes it negative
    flat = ps[0].new_zeros(sum(p.numel() for p in ps) + len(ps))
    flat[-len(ps):] = mark
    collective.all_reduce_sum_([flat])
    if not bool((flat[-len(ps):] == mark * world).all()):
        other = ("loading a checkpoint, deciding or saving while this one starts training" if starting
                 else "at a training step")
        raise ConsistencyError(f"{when} at step {step}, another rank was {other}: {_MET}")


def met_a_marker(count_sums: torch.Tensor) -> torch.Tensor:
    """After a step's all-reduce: a negative count means a rank sent a decision's marker (device
    flag; :class:`hpx.Forks` reads it at once on the CPU, at the next decision elsewhere)."""
    return (count_sums < 0).any()


_BUCKET = 1 << 24  # elements in one all-reduce (64 MiB of float32): the flat copy's memory stays bounded


def _buckets(ps: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """``ps`` in consecutive runs of at most :data:`_BUCKET` elements (a larger tensor alone)."""
    out: list[list[torch.Tensor]] = [[]]
    size = 0
    for p in ps:
        if out[-1] and size + p.numel() > _BUCKET:
            out.append([])
            size = 0
        out[-1].append(p)
        size += p.numel()
    return out


def _mean_bucket(ps: list[torch.Tensor], flat: torch.Tensor, had: list[bool], world: int,
                 free: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """After one all-reduce of ``ps``' gradients (``had``: this rank's, where it had one) and of how
    many ranks had each: the gradients <- their mean (``free``: views of ``flat``). Returns the device
    flags of :meth:`_ForkMean.wait`."""
    counts, grads = flat[-len(ps):], flat[:-len(ps)].div_(world)
    met = met_a_marker(counts)
    if met.device.type == "cpu" and bool(met):
        raise ConsistencyError(f"a training step of this rank met another rank's decision, converge() or "
                               f"load_checkpoint: {_MET}")
    for p, part, mine in zip(ps, grads.split([p.numel() for p in ps]), had):
        if not mine:
            continue
        if not free:
            p.grad.copy_(part.view_as(p.grad))
        elif p.is_contiguous():
            p.grad = part.view_as(p)
        else:  # the parameter's own layout, as autograd gives it
            p.grad = torch.empty_like(p).copy_(part.view(p.shape))
    return ((counts > 0) & (counts < world)).any(), met


_DIGEST_RUN = 1 << 20  # elements digested at once: a decision's transient memory stays bounded (~25 MiB)
_BITS = {1: torch.int8, 2: torch.int16}  # a float's bits as integers; 4 bytes and more: as int32 words


@torch.no_grad()
def weights_digest(forks: Sequence[_Fork]) -> torch.Tensor:
    """Each fork's trainable weights in three integers (``[F, 3]`` int64, on their device; no host
    read): the sum of their bits read as integers, the sum of those weighted by position (1 to 251,
    so a swap or two changes that cancel in the first are caught too), and how many are not finite.
    Integer sums are exact and do not depend on the order a device adds in, so ranks that hold the
    same weights bit for bit give the same digest on any hardware, and a one-bit difference gives
    another. For a decision's agreement check (:meth:`hpx.forks.faults._Faults._check_apart`)."""
    rows = []
    weight: torch.Tensor | None = None
    for f in forks:
        params = [p for p in f.model.parameters() if p.requires_grad and p.numel()]
        dev = _device(f.model)
        sums = torch.zeros(3, dtype=torch.int64, device=dev)
        for idx in dtype_groups(params, skip_empty=True).values():
            for run in _digest_runs([params[i] for i in idx]):
                flat = torch.cat(run) if len(run) > 1 else run[0]
                if flat.is_complex():
                    flat = torch.view_as_real(flat).reshape(-1)
                bits = flat.view(_BITS.get(flat.element_size(), torch.int32)).to(torch.int64)
                if weight is None or weight.device != bits.device or weight.numel() < bits.numel():
                    weight = torch.arange(bits.numel(), device=bits.device).remainder_(251).add_(1)
                sums[0] += bits.sum()
                sums[1] += bits.mul_(weight[:bits.numel()]).sum()
                sums[2] += (~torch.isfinite(flat)).sum()
        rows.append(sums)
    return torch.stack(rows) if rows else torch.zeros(0, 3, dtype=torch.int64)


def _digest_runs(ps: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """``ps``' elements (flat) in consecutive runs of at most :data:`_DIGEST_RUN` (a larger tensor split)."""
    out: list[list[torch.Tensor]] = [[]]
    size = 0
    for p in ps:
        for part in p.detach().reshape(-1).split(_DIGEST_RUN):
            if out[-1] and size + part.numel() > _DIGEST_RUN:
                out.append([])
                size = 0
            out[-1].append(part)
            size += part.numel()
    return [r for r in out if r]


# --- the step marker of sharded forks -------------------------------------------------------------

_POINTS = ("starting step {next}", "deciding at step {step}", "in converge() at step {step}",
           "saving step {step}", "loading a checkpoint at step {step}")
_KINDS = {"deciding": 1, "converge()": 2, "saving": 3, "loading": 4}  # a check's ``when``, by its first word


def point_of(when: str) -> int:
    """The kind of point a check's label ``when`` names (an index of :data:`_POINTS`; a check of
    another name counts as a decision's)."""
    return _KINDS.get(when.split(" ", 1)[0], 1)


def _host_marker(collective: Any) -> bool:
    """Whether ``collective`` takes CPU tensors: a gloo process group, or one with a CPU backend
    beside NCCL (``init_process_group("cpu:gloo,cuda:nccl")``, torch's default without a backend),
    where a marker is sent and read on the host without waiting on the device."""
    if not hasattr(collective, "group"):
        return False
    import torch.distributed as dist

    group = collective.group or dist.distributed_c10d._get_default_group()
    try:
        group._get_backend(torch.device("cpu"))
    except Exception:  # no CPU backend (NCCL alone), or a torch without the lookup
        return "gloo" in str(dist.get_backend(collective.group))
    return True


@torch.no_grad()
def send_marker(collective: Any, point: int, step: int, device: torch.device) -> torch.Tensor:
    """Under ``shard=`` (whose step collectives are FSDP2's, which no marker of hpx can meet), one
    small all-reduce before each step's first collective and before every decision, ``converge()``,
    save and load: each rank writes its row ``(point, step)`` of a ``[W, 2]`` table, zeros elsewhere,
    and the sum is every rank's row. Every point that starts collectives sends it first, so ranks
    that reached different points (a rank one step short, a save or a load on some ranks only) meet
    in two markers of one shape and see each other's rows there, before any of FSDP's collectives
    pair with something else (which gloo answers by aborting the process). Returns the table: on the
    host where the process group has a CPU backend (read at once, free), else on ``device`` (kept by
    :func:`held_marker` and read at the next decision: ``hpx.forks.faults._Faults._mark``)."""
    host = _host_marker(collective)
    rows = torch.zeros(collective.world_size, 2, dtype=torch.int64,
                       device=torch.device("cpu") if host else device)
    rows[collective.rank, 0], rows[collective.rank, 1] = point, step
    collective.all_reduce_sum_([rows])
    return rows


def marker_problem(rows: torch.Tensor, when: str) -> str | None:
    """The error a marker's table (:func:`send_marker`) gives: ``None`` where every rank is at the
    same point of the same step, else every rank's point and step named (a host read)."""
    table = rows.tolist()
    if all(r == table[0] for r in table):
        return None
    said = [f"rank {r} " + (_POINTS[p] if 0 <= p < len(_POINTS) else "elsewhere at step {step}").format(
        step=s, next=s + 1) for r, (p, s) in enumerate(table)]
    return f"{when}, the ranks were at different points ({'; '.join(said)}): {_MET}"


def held_marker(held: tuple[torch.Tensor, torch.Tensor] | None,
                rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A device marker's table kept for the next decision without a host read: the flag of any
    mismatch so far, and the first mismatched table (else the latest)."""
    bad = (rows != rows[:1]).any()
    if held is None:
        return bad, rows
    was, first = held
    return was | bad, torch.where(was, first, rows)
