"""``Forks.step`` under torch.distributed (without ``shard=``): each fork's gradients sent over the
ranks as its backward ends, while the next fork's forward and backward run, then the fork stepped and
its gradients freed (``hpx/forks/early.py``). The same run, bit for bit, as ``backward()`` then
``optimizer_step()`` and as the one all-reduce over every fork's gradients that step took before
(two gloo ranks); a parameter one rank's loss skips is still named at the first decision; a fork
that fails on every rank skips the batch before any fork stepped, and stops the run after."""

from __future__ import annotations

import contextlib
from typing import Any
from unittest import mock

import pytest
import torch

import hpx
import hpx.forks.ranks
import hpx.forks.search
from hpx.forks import early
from hpx.forks.ranks import _buckets, _mean_bucket
from tests._dist import run_distributed
from tests.test_forks import BATCHES, PROBE, STEPS, _adamw_onecycle, _loss, _net
from tests.test_forks_early_step import _equal
from tests.test_forks_ranks import _branching

SHORT = 12  # steps: both cuts' annealed copies and the knob forks (from step 9), then converge()


class _Mixed(torch.nn.Module):
    """A float64 parameter and ``_net``: two dtypes, two all-reduces per fork (more in small buckets)."""

    def __init__(self, p: float) -> None:
        super().__init__()
        self.net, self.scale = _net(p=p), torch.nn.Parameter(torch.ones(3, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x) * self.scale.mean().float()


def _forks(backend: Any, p: float = 0.2, mixed: bool = False, **settings: Any) -> hpx.Forks:
    torch.manual_seed(1)
    model = _Mixed(p) if mixed else _net(p=p)
    opt, sched = _adamw_onecycle(model, 0.01)
    return hpx.Forks(model, opt, total_steps=STEPS, schedule=sched, probe=PROBE, backend=backend, **settings)


@torch.no_grad()
def _joint_mean(trained: list, collective: Any) -> tuple[Any, Any]:
    """The reduction every step took before: one all-reduce per dtype over every fork's gradients
    together (one bucket here), with the counts of ranks that had each."""
    ps = [p for f in trained for p in f.model.parameters() if p.requires_grad]
    assert len(_buckets(ps)) == 1
    had = [p.grad is not None for p in ps]
    flat = torch.cat([p.grad.reshape(-1) if p.grad is not None else p.new_zeros(p.numel()) for p in ps]
                     + [torch.tensor(had, dtype=ps[0].dtype)])
    collective.all_reduce_sum_([flat])
    return _mean_bucket(ps, flat, had, collective.world_size, False)


def _three_ways(rank: int, world: int) -> dict:
    """The same run three ways on each rank (its share of every batch, its own dropout draws):
    ``step`` (overlapped), ``backward()`` then ``optimizer_step()`` (``_overlap = False``), and that
    with the old joint all-reduce; compared bit for bit after every step."""
    from hpx.backends import TorchDistributed

    taken: list[int] = []
    real = early.train_each
    hpx.forks.search.train_each = lambda *a: taken.append(a[0].step_count) or real(*a)
    runs = {how: _forks(TorchDistributed(), knobs=[hpx.Dropout(spread=0.1)], knob_start=0.3,
                        knob_design="joint") for how in ("new", "old", "joint")}
    runs["old"]._overlap = runs["joint"]._overlap = False
    same, freed, copies = [], [], 0
    for i, b in enumerate(BATCHES[:SHORT]):
        part = tuple(t.chunk(world)[rank] for t in b)
        seen = []
        for how, forks in runs.items():
            torch.manual_seed(100 * rank + i)
            with mock.patch.object(hpx.forks.search, "mean_over_ranks", _joint_mean) if how == "joint" \
                    else contextlib.nullcontext():
                losses = forks.step(_loss, part)
            seen.append((losses, torch.random.get_rng_state()))
        copies += bool(runs["new"]._clones)
        freed.append(all(p.grad is None for f in [*runs["new"]._forks, *runs["new"]._clones]
                         for p in f.model.parameters()))
        same.append(all(torch.equal(seen[0][k], s[k]) for s in seen[1:] for k in (0, 1))
                    and _equal(runs["new"], runs["old"]) and _equal(runs["new"], runs["joint"]))
    hpx.forks.search.train_each = real
    late = len(runs["new"]._forks)  # two after the second cut, and the knob forks (from step 9)
    for forks in runs.values():
        forks.converge()
    same.append(_equal(runs["new"], runs["old"]) and _equal(runs["new"], runs["joint"]))
    new = runs["new"]
    return {"same": same, "freed": freed, "taken": taken, "copies": copies, "late": late,
            "history": [(r.step, r.values, r.scores) for r in new.history] + [new.bases],
            "weights": [p.detach().clone() for p in new.model.parameters()]}


def _in_buckets(rank: int, world: int) -> list[bool]:
    """Two dtypes in buckets of 100 elements (three all-reduces per fork): step and backward() then
    optimizer_step() alike, step by step."""
    from hpx.backends import TorchDistributed

    runs = [_forks(TorchDistributed(), mixed=True) for _ in range(2)]
    runs[1]._overlap = False
    same = []
    with mock.patch.object(hpx.forks.ranks, "_BUCKET", 100):
        for i, b in enumerate(BATCHES[:8]):
            part = tuple(t.chunk(world)[rank] for t in b)
            losses = []
            for forks in runs:
                torch.manual_seed(100 * rank + i)
                losses.append(forks.step(_loss, part))
            same.append(torch.equal(*losses) and _equal(*runs))
    return same


def _failing(rank: int, world: int) -> dict:
    """On every rank: the first challenger's backward fails at step 3 (nothing stepped yet: the batch
    skipped, as plain training that skipped it, though your run's all-reduce was sent), then a later
    fork's at step 5 (after two forks stepped: the run is stopped)."""
    from hpx.backends import TorchDistributed

    def failing(at: int) -> Any:
        def loss(rep: Any, b: Any) -> torch.Tensor:
            if rep.index == at:
                raise RuntimeError(f"out of memory at fork {at}")
            return _loss(rep, b)
        return loss

    forks, skipped = _forks(TorchDistributed(), p=0.0), _forks(TorchDistributed(), p=0.0)
    out: dict[str, Any] = {}
    for i, b in enumerate(BATCHES[:5]):
        part = tuple(t.chunk(world)[rank] for t in b)
        try:
            forks.step(failing(1) if i == 2 else _loss, part)
        except RuntimeError as e:
            out["skip"] = str(e)
        if i != 2:
            skipped.step(_loss, part)
    out["same"] = _equal(forks, skipped)
    try:
        forks.step(failing(3), tuple(t.chunk(world)[rank] for t in BATCHES[5]))
    except hpx.ConfigError as e:
        out["stopped"] = str(e)
    try:
        forks.step(_loss, tuple(t.chunk(world)[rank] for t in BATCHES[6]))
    except hpx.ConfigError as e:
        out["refused"] = str(e)
    return out


def _scenarios(rank: int, world: int) -> dict:
    """Every case in one launch (starting the processes costs more than a case)."""
    return {"three": _three_ways(rank, world), "buckets": _in_buckets(rank, world),
            "failing": _failing(rank, world),
            "apart": {overlap: _branching(rank, world, False, overlap) for overlap in (True, False)}}


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return run_distributed(_scenarios, 2, timeout=180)


@pytest.mark.procs
def test_step_over_two_ranks_is_the_old_path_and_the_joint_all_reduce_bit_for_bit(ranks):
    """Dropout, AdamW and OneCycleLR, a knob's forks, the annealed copies of both cuts, converge(): at
    every step, on each rank, every fork and copy, the losses and the random stream after the step are
    those of backward() then optimizer_step(), and of the one all-reduce over every fork's gradients
    that step took before; no gradient is left after a step; the ranks end alike."""
    for r in ranks:
        three = r["three"]
        assert all(three["same"]) and len(three["same"]) == SHORT + 1
        assert all(three["freed"][1:])  # the first step takes backward() then optimizer_step()
        assert three["taken"] == list(range(1, SHORT)) and three["copies"] > 0 and three["late"] == 4
    a, b = (r["three"] for r in ranks)
    assert repr(a["history"]) == repr(b["history"]) and len(a["history"]) == 4  # cuts, end, bases
    assert all(torch.equal(x, y) for x, y in zip(a["weights"], b["weights"]))


@pytest.mark.procs
def test_step_in_many_buckets_of_two_dtypes_is_the_old_path_bit_for_bit(ranks):
    assert all(all(r["buckets"]) and len(r["buckets"]) == 8 for r in ranks)


@pytest.mark.procs
def test_a_fork_failing_on_every_rank_skips_the_batch_before_any_step_and_stops_the_run_after(ranks):
    for r in ranks:
        out = r["failing"]
        assert out["skip"] == "out of memory at fork 1" and out["same"]
        said = ("failed at step 5 on the fork at 3.16x (RuntimeError: out of memory at fork 3) after your "
                "run and the fork at 0.1x had taken")  # forks 0 and 1 stepped, fork 2's all-reduce sent
        assert said in out["stopped"] and out["refused"] == out["stopped"]


@pytest.mark.procs
def test_a_parameter_one_ranks_loss_skips_is_named_at_the_first_decision_as_before(ranks):
    for r in ranks:
        new, old = r["apart"][True], r["apart"][False]
        assert new == old and int(new.split(":")[0]) <= 4
        assert "some ranks' losses reached a parameter that others' did not" in new


class _Twin:
    """Two ranks in one process, alike (every sum is twice this rank's): a collective whose
    asynchronous all-reduce sums only when waited on, recording what was sent and waited for."""

    rank, world_size = 0, 2

    def __init__(self, events: list, asynchronous: bool = True) -> None:
        self.events = events
        if not asynchronous:
            self.all_reduce_sum_async_ = None

    def all_reduce_sum_(self, tensors: list[torch.Tensor]) -> None:
        for t in tensors:
            t.mul_(2)

    def all_reduce_sum_async_(self, tensor: torch.Tensor) -> Any:
        self.events.append("send")
        twin = self

        class Work:
            def wait(self) -> None:
                twin.events.append("wait")
                tensor.mul_(2)

        return Work()

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        return torch.stack([tensor, tensor])

    def broadcast_(self, tensor: torch.Tensor, src: int = 0) -> None:
        return None

    def broadcast_object(self, obj: object, src: int = 0) -> object:
        return obj

    def check_same(self, tensor: torch.Tensor, what: str) -> None:
        return None


@pytest.mark.parametrize("asynchronous, size", [(True, None), (False, None), (True, 100)],
                         ids=["async", "sync-only-backend", "async-in-buckets"])
def test_each_forks_reduction_is_sent_after_its_backward_and_waited_after_the_next_ones(asynchronous, size):
    """Over two alike ranks (in one process): fork i's all-reduce is sent right after its backward,
    waited on (its fork then stepped) after fork i + 1's backward, and fork i + 1's sent after that;
    a backend without ``all_reduce_sum_async_`` reduces at once. In several buckets (two dtypes, 100
    elements each), the step's first waits for its first bucket's check before it sends the others
    (a decision's marker meets that one). The run is the old path's, bit for bit."""
    events: list = []

    def loss(rep, b):
        events.append(rep.index)
        return _loss(rep, b)

    mixed = size is not None
    fast = _forks(_Twin(events, asynchronous), mixed=mixed)
    slow = _forks(_Twin([], asynchronous), mixed=mixed)
    slow._overlap = False
    with mock.patch.object(hpx.forks.ranks, "_BUCKET", size) if mixed else contextlib.nullcontext():
        for i, b in enumerate(BATCHES[:8]):
            del events[:]
            n = len(fast._trained())  # the forks and annealed copies this step trains
            torch.manual_seed(i)
            a = fast.step(loss, b)
            torch.manual_seed(i)
            assert torch.equal(a, slow.step(_loss, b)) and _equal(fast, slow)
    names = [e if isinstance(e, str) else "fwd" for e in events]
    assert n >= 3 and names.count("fwd") == n
    if not asynchronous:
        assert names == ["fwd"] * n
        return
    k = 3 if mixed else 1  # all-reduces per fork: float64's 3 elements, then float32's 256 and 65
    send, wait = ["send"] * k, ["wait"] * k  # fwd 0, send, fwd 1, wait, send, fwd 2, wait, send, ..., wait
    first = ["send", "fwd", "wait", *send[1:], *wait[1:], *send]
    assert names == ["fwd", *first] + ["fwd", *wait, *send] * (n - 2) + wait
