"""``benchmarks.forks_overhead`` times Forks against a hand-written loop that must take the same
steps: the same models at the same learning rates on the same batches. Checked here bit for bit:
every fork that reaches the run's last step is there at the loop's weights for it."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("sklearn")

from benchmarks import forks_overhead as fo


def test_the_hand_written_loop_ends_every_fork_at_forks_weights(monkeypatch):
    # 100 steps rather than the benchmark's 300: both cuts (at 15 and 30) and their annealed copies
    # fall inside the run all the same, and the loop is checked step for step, not timed
    monkeypatch.setattr(fo, "STEPS", 100)
    x, y = fo._data()
    ended: list = []
    _, plan, steps = fo._forks(x, y, 100, "per example", keep=ended)
    assert {round(m, 3) for _, m, _ in plan[0]} == {0.1, 0.316, 1.0, 3.162, 10.0}
    assert any(parent is not None for now in plan for _, _, parent in now)  # annealed copies, copied
    assert sum(len(now) for now in plan) / len(plan) == pytest.approx(steps)
    models: dict = {}
    fo._hand(x, y, 100, plan[:-1], out=models)  # up to the last step, before the end's decision
    assert len(ended) == 2
    for key, params in ended:
        assert all(torch.equal(a, b) for a, b in zip(params, models[key].parameters()))
    at_1x: dict = {}
    fo._hand(x, y, 100, plan[:-1], same_lrs=False, out=at_1x)  # the loop this benchmark first timed
    key, params = ended[1]  # the challenger: not at your lr, so not at its weights
    assert not all(torch.equal(a, b) for a, b in zip(params, at_1x[key].parameters()))
