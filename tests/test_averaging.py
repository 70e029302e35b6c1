"""The converge step's weighted average: the one-process foreach path against the flat-bucket path."""

from __future__ import annotations

import torch

from hpx.averaging import average_


class _Identity:
    """A collective of one process that claims two, so average_ takes its flat-bucket path."""

    rank, world_size = 0, 2

    def all_reduce_sum_(self, tensors):
        return None

    def all_gather(self, tensor):
        return torch.stack([tensor, tensor])


def _replicas(seed):
    g = torch.Generator().manual_seed(seed)
    shapes = [(7, 3), (5,), (2, 2, 2)]
    return [[torch.randn(s, generator=g) for s in shapes] for _ in range(4)]


def test_one_process_path_equals_the_bucket_path_with_weights_and_a_write_mask():
    weights, write = [1.0, 0.0, 2.0, 1.0], [True, True, False, True]
    local, flat = _replicas(0), _replicas(0)
    before = [t.clone() for t in local[2]]
    average_(local, weights, 4.0, _InProcess(), write=write)
    average_(flat, weights, 4.0, _Identity(), write=write, bucket_cap_mb=1e-5)  # several buckets
    for a, b in zip(local, flat):
        for x, y in zip(a, b):
            assert torch.equal(x, y)
    for x, y in zip(local[2], before):  # not written: kept as it was
        assert torch.equal(x, y)
    expected = (_replicas(0)[0][0] + 2 * _replicas(0)[2][0] + _replicas(0)[3][0]) / 4
    torch.testing.assert_close(local[0][0], expected, rtol=0, atol=1e-6)  # replica 1 (weight 0) left out


def test_a_nan_replica_with_weight_zero_does_not_reach_the_mean():
    reps = _replicas(1)
    reps[3][1][0] = float("nan")
    average_(reps, [1.0, 1.0, 1.0, 0.0], 3.0, _InProcess())
    assert all(torch.isfinite(t).all() for rep in reps for t in rep)


class _InProcess:
    rank, world_size = 0, 1

    def all_reduce_sum_(self, tensors):
        return None

    def all_gather(self, tensor):
        return tensor.unsqueeze(0)


def test_a_checked_mean_that_is_not_finite_writes_nothing_on_either_path():
    for coll in (_InProcess(), _Identity()):
        reps = _replicas(2)
        reps[1][2][0, 1, 0] = float("inf")
        before = [[t.clone() for t in rep] for rep in reps]
        assert average_(reps, [1.0] * 4, 4.0, coll, check_finite=True) is False
        for rep, was in zip(reps, before):
            for x, y in zip(rep, was):
                assert torch.equal(x, y)
        assert average_(reps, [1.0, 0.0, 1.0, 1.0], 3.0, coll, check_finite=True) is True  # left out
        assert all(torch.isfinite(t).all() for rep in reps for t in rep)


def test_one_replica_in_all_is_its_own_mean_and_only_checked():
    rep = _replicas(3)[:1]
    before = [t.clone() for t in rep[0]]
    assert average_(rep, [1.0], 1.0, _InProcess(), check_finite=True) is True
    assert all(torch.equal(a, b) for a, b in zip(rep[0], before))
    rep[0][0][0, 0] = float("nan")
    assert average_(rep, [1.0], 1.0, _InProcess(), check_finite=True) is False


class _ShardDisagrees(_InProcess):
    """One replica whose other shard (another process) found a NaN: the averaged flag is 0.5."""

    processes = object()  # replicas span several processes

    def all_gather(self, tensor):
        return (tensor.unsqueeze(0) + 0.0) / 2


def test_every_process_of_a_replica_acts_on_one_verdict():
    reps = _replicas(4)
    before = [[t.clone() for t in rep] for rep in reps]
    assert average_(reps, [1.0] * 4, 4.0, _ShardDisagrees(), check_finite=True) is False
    assert all(torch.equal(a, b) for rep, was in zip(reps, before) for a, b in zip(rep, was))


class _Recording(_Identity):
    def __init__(self):
        self.calls = []

    def all_reduce_sum_(self, tensors):
        self.calls.append([(t.dtype, t.numel()) for t in tensors])


def test_low_precision_is_summed_in_float32_one_bucket_at_a_time():
    g = torch.Generator().manual_seed(4)
    shapes = [(64, 32), (32,), (32, 16)]
    reps = [[torch.randn(s, generator=g).to(torch.bfloat16) for s in shapes] for _ in range(4)]
    want = [(sum(rep[i].float() for rep in reps) / 4).to(torch.bfloat16) for i in range(len(shapes))]
    coll = _Recording()
    assert average_(reps, [1.0] * 4, 4.0, coll, bucket_cap_mb=32 * 32 * 2 / 2**20, check_finite=True)
    for rep in reps:
        for t, w in zip(rep, want):
            assert t.dtype == torch.bfloat16 and torch.equal(t, w)
    # every float32 sum was reduced on its own, before the next bucket was summed
    assert len(coll.calls) >= 2 and all(len(c) == 1 and c[0][0] == torch.float32 for c in coll.calls)
    assert max(c[0][1] for c in coll.calls) < sum(torch.Size(s).numel() for s in shapes)
