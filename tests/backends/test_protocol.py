"""The engine knows backends only through the Collective protocol."""

from __future__ import annotations

import torch

import hpx
import hpx.engine.facade
from tests._digits import ce, data, mlp


class _Solo:
    """A one-process backend written from the protocol alone (no hpx class behind it)."""

    rank = 0
    world_size = 1

    def all_reduce_sum_(self, tensors):
        return None

    def all_gather(self, tensor):
        return tensor.unsqueeze(0)

    def broadcast_(self, tensor, src=0):
        return None

    def broadcast_object(self, obj, src=0):
        return obj

    def check_same(self, tensor, what):
        return None


class _Three(_Solo):
    default_replicas = 3


def _run(digits, backend, replicas=None, steps=12):
    engine = hpx.Engine(mlp(1), lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9),
                        [hpx.LearningRate("lr", spread=0.5)], backend=backend, replicas=replicas,
                        sync_every=5, seed=3)
    for b in data(digits, steps, seed=2):
        engine.step(ce, b)
    return engine


def test_any_collective_drives_the_engine_like_the_in_process_one(digits):
    ours, theirs = _run(digits, hpx.backends.InProcess(), replicas=2), _run(digits, _Solo(), replicas=2)
    assert ours.bases == theirs.bases
    for a, b in zip(ours.replicas, theirs.replicas):
        for p, q in zip(a.model.parameters(), b.model.parameters()):
            assert torch.equal(p, q)


def test_the_default_replica_count_is_the_backends(digits):
    assert _run(digits, None, steps=0).n_replicas == 4  # the default backend: every replica in process
    assert _run(digits, _Three(), steps=0).n_replicas == 3
    assert _run(digits, _Solo(), steps=0).n_replicas == 1  # no default_replicas: one per process
    assert not hasattr(hpx.engine.facade, "InProcess")  # the engine imports no concrete backend
