"""The end's test on a probe loss that returns the batch's mean: hpx evaluates each example alone,
all of a batch's examples at once with ``torch.func.vmap`` where it can, one at a time where not.
Every case is compared with the losses one example at a time, computed here by hand."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hpx
from hpx.forks.probe import _each_example

STEPS = 30


def _data(n: int = 544) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, 6, generator=g)
    return x, (x @ torch.randn(6, 1, generator=g)).squeeze(-1) + 0.1 * torch.randn(n, generator=g)


X, Y = _data()
BATCHES = [(X[16 * i:16 * i + 16], Y[16 * i:16 * i + 16]) for i in range(STEPS)]
PROBE = [(X[480:512], Y[480:512]), (X[512:544], Y[512:544])]


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Dropout(0.1), nn.Linear(16, 1))


def _mean(rep, b):
    return F.mse_loss(rep.model(b[0]).squeeze(-1), b[1])


def _by_hand(model: nn.Module, loss_fn) -> torch.Tensor:
    """Each probe example's loss, one forward per example (eval mode)."""
    model.eval()
    rep = type("R", (), {"model": model})()
    with torch.no_grad():
        out = [loss_fn(rep, (x[i:i + 1], y[i:i + 1])) for x, y in PROBE for i in range(len(x))]
    model.train()
    return torch.stack(out).double()


def _run(loss_fn) -> hpx.Forks:
    model = _net()
    forks = hpx.Forks(model, torch.optim.SGD(model.parameters(), lr=0.01), total_steps=STEPS, probe=PROBE,
                      loss_fn=loss_fn, multiples=(1.0, 10.0), cuts=(), confidence=1e9)
    for b in BATCHES:
        forks.step(_mean, b)
    return forks


def test_a_mean_loss_is_taken_per_example_by_vmap_as_one_at_a_time():
    """The per-example losses of a mean loss, vectorized, equal the ones computed by hand one
    example at a time, and the end's gain equals the gain of a loss that returns them itself."""
    forks = _run(_mean)
    assert forks._vectorize == [True]
    f = forks._forks[0]
    b = PROBE[0]
    f.model.eval()
    with torch.no_grad():
        v = _each_example(_mean, f, b, len(b[0]), [True])
    f.model.train()
    assert v.double() == pytest.approx(_by_hand(f.model, _mean)[:32], rel=1e-5, abs=1e-7)
    per = _run(lambda rep, b: F.mse_loss(rep.model(b[0]).squeeze(-1), b[1], reduction="none"))
    assert forks.history[-1].metrics["gain"] == pytest.approx(per.history[-1].metrics["gain"], rel=1e-5)


def test_a_loss_vmap_cannot_run_is_taken_one_example_at_a_time():
    """A loss that reads a value on the host (``.item()``) cannot be vectorized: hpx says so once
    (``_vectorize`` False) and evaluates one example at a time, with the same gain."""
    def host(rep, b):
        out = rep.model(b[0]).squeeze(-1)
        scale = 1.0 if float(out.abs().max().item()) >= 0 else 2.0  # a host read inside the loss
        return scale * F.mse_loss(out, b[1])

    forks = _run(host)
    assert forks._vectorize == [False]
    expected = _run(_mean).history[-1].metrics["gain"]
    assert forks.history[-1].metrics["gain"] == pytest.approx(expected, rel=1e-5)


def test_a_loss_whose_vectorized_values_disagree_is_taken_one_example_at_a_time():
    """A loss that counts its calls (one vectorized call, against one call per example by hand):
    the first batch's check finds the values apart, and every example is then taken alone, as
    the hand-written loop takes them."""
    calls = [0]

    def counting(rep, b):
        calls[0] += 1
        return F.mse_loss(rep.model(b[0]).squeeze(-1), b[1]) + calls[0] * 1e-3

    f = _run(_mean)._forks[0]
    f.model.eval()
    vectorize: list[bool | None] = [None]
    with torch.no_grad():
        v = _each_example(counting, f, PROBE[0], 32, vectorize)
    assert vectorize == [False]
    # one vectorized call, four for the check, then one per example: the last 32 calls' offsets
    expected = _by_hand(f.model, _mean)[:32] + torch.arange(6, 38, dtype=torch.float64) * 1e-3
    assert v.double() == pytest.approx(expected, rel=1e-5, abs=1e-7)


def test_a_loss_per_example_is_read_once_at_the_end():
    """With a probe loss that returns each example's loss, the end scores both forks and runs the
    paired test on that one pass: the loss is called once per fork and probe batch at the end."""
    calls = [0]

    def counted(rep, b):
        calls[0] += 1
        return F.mse_loss(rep.model(b[0]).squeeze(-1), b[1], reduction="none")

    model = _net()
    forks = hpx.Forks(model, torch.optim.SGD(model.parameters(), lr=0.01), total_steps=STEPS, probe=PROBE,
                      loss_fn=counted, multiples=(1.0, 10.0), cuts=(), confidence=1e9)
    for b in BATCHES[:-1]:
        forks.step(_mean, b)
    before = calls[0]
    forks.step(_mean, BATCHES[-1])
    assert forks.decided and forks.history[-1].metrics["gain"] != 0
    assert calls[0] - before == 2 * len(PROBE)


def test_a_transformer_layer_vectorized_per_example_warns_nothing_and_equals_the_loop():
    """``nn.TransformerEncoderLayer`` in eval mode takes torch's fused fast path, which vmap runs
    through a slower fallback and warns of it: hpx chose vmap, the user cannot act on that warning,
    so the end's per-example pass shows none, and its values are still the one-at-a-time losses."""
    import warnings

    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(8, 2, dim_feedforward=16, dropout=0.0, batch_first=True).eval()
    head = nn.Linear(8, 1)

    def loss(rep, b):
        return F.mse_loss(head(rep.model(b[0])).mean(dim=(1, 2)), b[1])

    rep = type("R", (), {"model": layer})()
    f = type("F", (), {"replica": rep})()
    g = torch.Generator().manual_seed(2)
    batch = (torch.randn(12, 5, 8, generator=g), torch.randn(12, generator=g))
    with torch.no_grad(), warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        vectorize: list[bool | None] = [None]
        v = _each_example(loss, f, batch, 12, vectorize)
    assert vectorize == [True]
    assert [str(w.message) for w in seen] == []
    with torch.no_grad():
        by_hand = torch.stack([loss(rep, (batch[0][i:i + 1], batch[1][i:i + 1])) for i in range(12)])
    assert v.double() == pytest.approx(by_hand.double(), rel=1e-4, abs=1e-6)
