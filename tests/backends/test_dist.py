"""TorchDistributed on real gloo process groups.

Spawning ranks costs seconds, so each world size is launched once: ``_scenario``
runs every operation on every rank and returns what it saw, and the tests below
check one aspect each of those observations. World size 1 runs in this process.
"""

from __future__ import annotations

import contextlib
import datetime
import math
import time
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist

from hpx.backends.base import Collective
from hpx.backends.dist import TorchDistributed
from hpx.errors import BackendError, ConfigError, ConsistencyError
from tests._dist import RemoteTraceback, free_port, run_distributed

# A 64-byte cap, exact in bytes, so the expected buckets below can be worked by hand.
_TINY_CAP_MB = 64 / 2**20


def _values(gen: torch.Generator, *shape: int, dtype: torch.dtype) -> torch.Tensor:
    """Random values whose sums are exact in any order, so ranks and parent agree bit for bit."""
    ints = torch.randint(-64, 64, shape, generator=gen, dtype=torch.int64)
    return ints.to(dtype) / 8 if dtype.is_floating_point else ints.to(dtype)


def _mixed_inputs(rank: int) -> list[torch.Tensor]:
    """Assorted dtypes and layouts. Byte sizes are noted for the bucket counts."""
    gen = torch.Generator().manual_seed(1000 + rank)
    f32, f64, i64 = torch.float32, torch.float64, torch.int64
    return [
        _values(gen, 3, 4, dtype=f32),  # f32, 48 B
        _values(gen, dtype=f64),  # f64 0-dim, 8 B
        _values(gen, 5, dtype=i64),  # i64, 40 B
        _values(gen, 4, 6, dtype=f32).t(),  # f32 non-contiguous, 96 B
        _values(gen, dtype=f32),  # f32 0-dim, 4 B
        _values(gen, 3, 4, dtype=i64).t(),  # i64 non-contiguous, 96 B
        _values(gen, 2, 3, 2, dtype=f64),  # f64, 96 B
        _values(gen, 0, 3, dtype=f32),  # f32 empty: nothing to send
        _values(gen, 4, dtype=f64)[::2],  # f64 strided, 16 B
        _values(gen, 2, dtype=f32),  # f32, 8 B
    ]


# Elements per all_reduce call, in order: the (device, dtype) groups in first-seen
# order (f32, f64, i64), each filled greedily up to the cap.
# Default cap: one bucket per group.
_EXPECTED_DEFAULT_CALLS = [12 + 24 + 1 + 2, 1 + 12 + 2, 5 + 12]
# 64 B cap: f32 48 | 96 (over the cap: alone) | 4+8;  f64 8 | 96 | 16;  i64 40 | 96.
_EXPECTED_TINY_CALLS = [12, 24, 1 + 2, 1, 12, 2, 5, 12]
# One dtype, numel [10, 5, 20, 3, 16] = [40, 20, 80, 12, 64] B at a 64 B cap:
# 40+20 | 80 | 12 (+64 would overflow) | 64.
_F32_NUMELS = [10, 5, 20, 3, 16]
_EXPECTED_F32_CALLS = [15, 20, 3, 16]

_NAN = float("nan")


@contextlib.contextmanager
def _counting_all_reduce() -> Iterator[list[int]]:
    """Record the numel of every torch.distributed.all_reduce call (the real one still runs)."""
    calls: list[int] = []
    real = dist.all_reduce

    def counting(tensor: torch.Tensor, *args: object, **kwargs: object) -> object:
        calls.append(tensor.numel())
        return real(tensor, *args, **kwargs)

    dist.all_reduce = counting
    try:
        yield calls
    finally:
        dist.all_reduce = real


def _reduce_and_observe(rank: int, bucket_cap_mb: float, inputs: list[torch.Tensor]) -> dict:
    backend = TorchDistributed(bucket_cap_mb=bucket_cap_mb)
    tensors = list(inputs)
    ptrs = [t.data_ptr() for t in tensors]
    strides = [t.stride() for t in tensors]
    with _counting_all_reduce() as calls:
        backend.all_reduce_sum_(tensors)
    return {
        "values": [t.clone() for t in tensors],
        "in_place": all(a is b for a, b in zip(tensors, inputs))
        and [t.data_ptr() for t in tensors] == ptrs
        and [t.stride() for t in tensors] == strides,
        "calls": calls,
    }


def _check_same_outcome(backend: TorchDistributed, tensor: torch.Tensor, what: str) -> object:
    try:
        backend.check_same(tensor, what)
    except ConsistencyError as exc:
        return str(exc)
    return None


def _scenario(rank: int, world_size: int) -> dict:
    """Every TorchDistributed operation on one rank; returns what this rank observed."""
    out: dict = {"rank": rank}
    last = world_size - 1
    out["reduce_default"] = _reduce_and_observe(rank, 25.0, _mixed_inputs(rank))
    out["reduce_tiny"] = _reduce_and_observe(rank, _TINY_CAP_MB, _mixed_inputs(rank))
    f32_inputs = [torch.full((n,), float(rank + 1)) for n in _F32_NUMELS]
    out["reduce_f32"] = _reduce_and_observe(rank, _TINY_CAP_MB, f32_inputs)
    with _counting_all_reduce() as calls:
        TorchDistributed().all_reduce_sum_([])
    out["reduce_empty_calls"] = calls

    backend = TorchDistributed()
    out["is_collective"] = isinstance(backend, Collective)
    out["gather"] = backend.all_gather(rank * 10 + torch.arange(6).reshape(2, 3))
    out["gather_0dim"] = backend.all_gather(torch.tensor(rank + 0.5, dtype=torch.float64))
    out["gather_strided"] = backend.all_gather(torch.arange(8.0).reshape(2, 4)[:, ::2] + rank)

    src = min(1, last)
    dense = torch.full((2, 3), float(rank))
    strided_base = torch.full((3, 4), -1.0)
    strided = strided_base[:, 1::2]
    strided.fill_(float(rank))
    ptrs = (dense.data_ptr(), strided.data_ptr())
    backend.broadcast_(dense, src=src)
    backend.broadcast_(strided, src=src)
    out["broadcast"] = (dense, strided_base)
    out["broadcast_in_place"] = (dense.data_ptr(), strided.data_ptr()) == ptrs
    out["object"] = backend.broadcast_object({"from": rank, "items": [rank, "x"]}, src=last)

    agree = {
        "floats": torch.tensor([1.5, -2.0, 0.0]),
        "nan": torch.tensor([1.0, _NAN, 3.0]),
        "ints": torch.arange(4),
        "0dim nan": torch.tensor(_NAN, dtype=torch.float64),
        "empty": torch.zeros(0, 3),
    }
    out["same_ok"] = {k: _check_same_outcome(backend, t, k) for k, t in agree.items()}
    if world_size > 1:
        is_last = rank == last
        nan_vs_number = torch.tensor([1.0, 2.0 if is_last else _NAN, 3.0])
        shape = torch.zeros(4 if is_last else 3)
        dtype = torch.zeros(3, dtype=torch.float64 if is_last else torch.float32)
        all_but_0 = torch.tensor([float(rank), 7.0])
        out["same_bad"] = {
            "knob bases": _check_same_outcome(backend, nan_vs_number, "knob bases"),
            "shapes": _check_same_outcome(backend, shape, "shapes"),
            "dtypes": _check_same_outcome(backend, dtype, "dtypes"),
            "rank values": _check_same_outcome(backend, all_but_0, "rank values"),
        }
    # After the errors above every rank must still be in step with the others.
    ones = torch.ones(())
    backend.all_reduce_sum_([ones])
    out["in_step"] = ones.item()
    return out


@pytest.fixture(scope="module", params=[1, 2, 3], ids=lambda w: f"W{w}")
def observed(request: pytest.FixtureRequest) -> tuple[int, list[dict]]:
    """(world_size, per-rank observations) from one run of ``_scenario``."""
    world_size = request.param
    if world_size > 1:
        return world_size, run_distributed(_scenario, world_size, timeout=120.0)
    # One rank needs no spawn: a private group in this process, gone before return
    # so that no other test sees an initialised default group.
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{free_port()}",
        rank=0,
        world_size=1,
        timeout=datetime.timedelta(seconds=60),
    )
    try:
        return 1, [_scenario(0, 1)]
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("case", ["reduce_default", "reduce_tiny"])
def test_all_reduce_sum_equals_independent_sum(observed, case):
    world_size, per_rank = observed
    all_inputs = [_mixed_inputs(r) for r in range(world_size)]
    expected = [sum(ts[i] for ts in all_inputs) for i in range(len(all_inputs[0]))]
    for obs in per_rank:
        got = obs[case]["values"]
        assert len(got) == len(expected)
        for i, (g, e) in enumerate(zip(got, expected)):
            assert g.dtype == e.dtype and g.shape == e.shape, (obs["rank"], i)
            assert torch.equal(g, e), (obs["rank"], i, g, e)


def test_all_reduce_sum_is_in_place(observed):
    _, per_rank = observed
    for obs in per_rank:
        for case in ("reduce_default", "reduce_tiny", "reduce_f32"):
            assert obs[case]["in_place"], (obs["rank"], case)


def test_all_reduce_sum_buckets(observed):
    world_size, per_rank = observed
    total = world_size * (world_size + 1) / 2  # sum of rank + 1
    for obs in per_rank:
        assert obs["reduce_default"]["calls"] == _EXPECTED_DEFAULT_CALLS
        assert obs["reduce_tiny"]["calls"] == _EXPECTED_TINY_CALLS
        assert obs["reduce_f32"]["calls"] == _EXPECTED_F32_CALLS
        for n, t in zip(_F32_NUMELS, obs["reduce_f32"]["values"]):
            assert torch.equal(t, torch.full((n,), total))
        assert obs["reduce_empty_calls"] == []


def test_all_gather_stacks_in_rank_order(observed):
    world_size, per_rank = observed
    expected = torch.stack([r * 10 + torch.arange(6).reshape(2, 3) for r in range(world_size)])
    expected_0dim = torch.arange(world_size, dtype=torch.float64) + 0.5
    expected_strided = torch.stack(
        [torch.arange(8.0).reshape(2, 4)[:, ::2] + r for r in range(world_size)]
    )
    for obs in per_rank:
        assert obs["gather"].shape == (world_size, 2, 3)
        assert torch.equal(obs["gather"], expected)
        assert obs["gather_0dim"].shape == (world_size,)
        assert torch.equal(obs["gather_0dim"], expected_0dim)
        assert torch.equal(obs["gather_strided"], expected_strided)


def test_broadcast_in_place_from_src(observed):
    world_size, per_rank = observed
    src = min(1, world_size - 1)
    expected_strided_base = torch.full((3, 4), -1.0)
    expected_strided_base[:, 1::2] = float(src)
    for obs in per_rank:
        dense, strided_base = obs["broadcast"]
        assert torch.equal(dense, torch.full((2, 3), float(src)))
        # Only the view's elements change; the rest of its base is left alone.
        assert torch.equal(strided_base, expected_strided_base)
        assert obs["broadcast_in_place"]


def test_broadcast_object_from_last_rank(observed):
    world_size, per_rank = observed
    last = world_size - 1
    for obs in per_rank:
        assert obs["object"] == {"from": last, "items": [last, "x"]}


def test_check_same_passes_when_ranks_agree(observed):
    _, per_rank = observed
    for obs in per_rank:
        assert obs["same_ok"] == dict.fromkeys(obs["same_ok"])
        assert obs["in_step"] == len(per_rank)


@pytest.mark.parametrize("observed", [2, 3], indirect=True, ids=lambda w: f"W{w}")  # one rank can't disagree
def test_check_same_raises_on_every_rank_naming_the_disagreeing_ones(observed):
    world_size, per_rank = observed
    last = world_size - 1
    expected_ranks = {
        "knob bases": [last],
        "shapes": [last],
        "dtypes": [last],
        "rank values": list(range(1, world_size)),
    }
    for obs in per_rank:
        for what, ranks in expected_ranks.items():
            message = obs["same_bad"][what]
            assert message is not None, (obs["rank"], what)
            assert message.startswith(f"{what} differ across ranks: ")
            assert f"ranks {ranks} disagree with rank 0" in message
        assert "torch.float64" in obs["same_bad"]["dtypes"]
        assert "(4,)" in obs["same_bad"]["shapes"]


def test_no_process_group_raises_backend_error_with_launch_hint():
    assert not dist.is_initialized(), "a test left a default process group behind"
    with pytest.raises(BackendError, match="torchrun --nproc_per_node"):
        TorchDistributed()


@pytest.mark.parametrize("cap", [0.0, -1.0, math.nan])
def test_bucket_cap_must_be_positive(cap):
    with pytest.raises(ConfigError, match="bucket_cap_mb"):
        TorchDistributed(bucket_cap_mb=cap)


def test_is_a_collective(observed):
    _, per_rank = observed
    assert all(obs["is_collective"] for obs in per_rank)


# The harness itself: errors and hangs in children must surface quickly and clearly.


def _fail_on_rank_1(rank: int, world_size: int) -> None:
    if rank == 1:
        raise ValueError("boom from rank 1")
    dist.barrier()  # rank 1 never arrives: this rank hangs or loses its peer


def _sleep(rank: int, world_size: int) -> None:
    time.sleep(600)


def test_harness_reraises_the_first_child_error_and_stops_the_others():
    start = time.monotonic()
    with pytest.raises(ValueError, match="boom from rank 1") as info:
        run_distributed(_fail_on_rank_1, 2, timeout=60.0)
    assert time.monotonic() - start < 30
    cause = info.value.__cause__
    assert isinstance(cause, RemoteTraceback)
    assert "_fail_on_rank_1" in str(cause) and "rank 1 of 2" in str(cause)


def test_harness_times_out_and_kills_children():
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"did not finish within 1 s; ranks \[0\]"):
        run_distributed(_sleep, 1, timeout=1.0)
    assert time.monotonic() - start < 10
