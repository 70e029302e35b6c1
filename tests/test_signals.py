"""Signals: what the controller compares replicas on."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hpx
from tests.test_engine import batches, ce, mlp, sgd


def test_identical_replicas_score_identically_on_shared_data(digits):
    """Paired comparison: with no spread the replicas stay equal, so shared-data scores are equal
    and the weights uniform; on their own batches (interval loss) they differ."""
    x, y = digits
    for signal in (hpx.SharedBatch(), hpx.ProbeStream([(x[1500:], y[1500:])])):
        engine = hpx.Engine(mlp(), sgd(0.1), [hpx.LearningRate(spread=0.0)], replicas=4, sync_every=5,
                            signal=signal)
        for b in batches(digits, 5):
            engine.step(ce, b)
        rec = engine.history[-1]
        assert max(rec.scores) - min(rec.scores) < 1e-6
        assert rec.weights == pytest.approx([0.25] * 4)
    engine = hpx.Engine(mlp(), sgd(0.1), [hpx.LearningRate(spread=0.0)], replicas=4, sync_every=5)
    for b in batches(digits, 5):
        engine.step(ce, b)
    assert max(engine.history[-1].scores) - min(engine.history[-1].scores) > 1e-4


def test_shared_batch_scores_before_training_on_the_batch(digits):
    """The sync step's batch is scored by the replicas as they were before that step."""
    engine = hpx.Engine(mlp(), sgd(0.5), [hpx.LearningRate(spread=0.5)], replicas=2, sync_every=3,
                        signal=hpx.SharedBatch(), meta_lr=0.0)
    bs = list(batches(digits, 3))
    for b in bs[:2]:
        engine.step(ce, b)
    with torch.no_grad():
        expected = [F.cross_entropy(r.model.eval()(bs[2][0]), bs[2][1]).item() for r in engine.replicas]
    for r in engine.replicas:
        r.model.train()
    engine.step(ce, bs[2])
    assert engine.history[-1].scores == pytest.approx(expected, rel=1e-6)


def test_probe_stream_cycles_and_uses_its_own_loss(digits):
    x, y = digits
    data = [(x[:50], y[:50]), (x[50:100], y[50:100])]
    calls = []

    def probe_loss(rep, batch):
        calls.append(batch[0].shape[0])
        return F.cross_entropy(rep.model(batch[0]), batch[1])

    signal = hpx.ProbeStream(data, probe_loss, batches=3)
    engine = hpx.Engine(mlp(), sgd(0.1), [hpx.LearningRate(spread=0.3)], replicas=2, sync_every=2,
                        signal=signal)
    for b in batches(digits, 4):
        engine.step(ce, b)
    assert len(calls) == 2 * 2 * 3  # syncs x replicas x batches, cycling through 2 batches


def test_probe_scores_in_eval_mode_and_restores_train_mode(digits):
    modes = []

    class Spy(nn.Module):
        def forward(self, x):
            modes.append(self.training)
            return x

    model = nn.Sequential(mlp(), Spy())
    model[1].eval()  # a submodule the user keeps in eval mode must stay so
    x, y = digits
    engine = hpx.Engine(model, sgd(0.1), [], replicas=2, sync_every=1,
                        signal=hpx.ProbeStream([(x[:10], y[:10])]))
    engine.step(ce, next(batches(digits, 1)))
    assert modes[-2:] == [False, False]
    assert model[0].training and not model[1].training


def test_custom_signal_and_bad_signal(digits):
    class Ranked:
        def measure(self, ctx: hpx.SyncContext) -> torch.Tensor:
            return torch.arange(len(ctx.replicas), dtype=torch.float32)  # replica 0 always best

    engine = hpx.Engine(mlp(), sgd(0.1), [hpx.LearningRate(spread=0.5)], replicas=4, sync_every=2,
                        signal=Ranked())
    for b in batches(digits, 2):
        engine.step(ce, b)
    w = engine.history[-1].weights
    assert w == sorted(w, reverse=True) and w[0] > w[-1]
    with pytest.raises(hpx.ConfigError, match="measure"):
        hpx.Engine(mlp(), sgd(0.1), [], signal=object())


def test_shared_batch_without_batch_names_the_fix():
    engine = hpx.Engine(mlp(), sgd(0.1), [hpx.LearningRate(spread=0.5)], replicas=1, sync_every=1,
                        signal=hpx.SharedBatch())
    with pytest.raises(hpx.ConfigError, match="SharedBatch needs"):
        engine.advance()


def test_shared_batch_with_per_replica_batches_scores_replica_0s(digits):
    """With step(batches=[...]) every replica is scored on the first replica's batch."""
    engine = hpx.Engine(mlp(), sgd(0.5), [hpx.LearningRate(spread=0.5)], replicas=2, sync_every=1,
                        signal=hpx.SharedBatch(), meta_lr=0.0)
    b0, b1 = list(batches(digits, 2, size=32))
    with torch.no_grad():
        expected = [F.cross_entropy(r.model.eval()(b0[0]), b0[1]).item() for r in engine.replicas]
    for r in engine.replicas:
        r.model.train()
    engine.step(ce, batches=[b0, b1])
    assert engine.history[-1].scores == pytest.approx(expected, rel=1e-6)


def test_signal_is_not_asked_when_the_search_does_not_read_it(digits):
    """Before the controller's warm-up (or with it off) a sync costs no scoring: the interval's
    training loss is recorded instead."""

    class Refuses:
        def prepare(self, ctx):
            raise AssertionError("prepare called")

        def measure(self, ctx):
            raise AssertionError("measure called")

    engine = hpx.Engine(mlp(), sgd(0.1), [hpx.LearningRate(spread=0.5)], replicas=2, sync_every=3,
                        signal=Refuses(), warmup=100)
    losses = torch.zeros(2)
    for b in batches(digits, 3):
        losses += engine.step(ce, b)
    assert engine.history[-1].scores == pytest.approx((losses / 3).tolist(), rel=1e-5)
    assert engine.history[-1].weights is None


# --- the probe's data -------------------------------------------------------------------


def test_probe_data_problems_are_named_at_once(digits):
    x, y = digits
    with pytest.raises(hpx.ConfigError, match="ProbeStream data is empty"):
        hpx.ProbeStream([])
    bad = x[:32].clone()
    bad[3, 5] = float("nan")
    with pytest.raises(hpx.ConfigError, match="probe batch 1 holds NaN or inf"):
        hpx.ProbeStream([(x[:32], y[:32]), (bad, y[:32])])
    with pytest.raises(hpx.ConfigError, match=r"batches must be an integer >= 1 \(got True\)"):
        hpx.ProbeStream([(x[:32], y[:32])], batches=True)


def test_a_nan_probe_batch_from_a_stream_is_named_at_the_sync(digits):
    x, y = digits
    bad = x[:32].clone()
    bad[0, 0] = float("inf")

    def stream():
        yield x[:32], y[:32]
        yield bad, y[:32]

    class Restartable:  # like a DataLoader: iterable again and again
        def __iter__(self):
            return stream()

    engine = hpx.Engine(mlp(), sgd(), [hpx.LearningRate(spread=0.3)], replicas=2, sync_every=2,
                        signal=hpx.ProbeStream(Restartable()))
    bs = batches(digits, 4)
    for _ in range(2):
        engine.step(ce, next(bs))  # the first sync scores on the clean batch
    engine.step(ce, next(bs))
    with pytest.raises(hpx.ConfigError, match="probe batch 1 holds NaN or inf"):
        engine.step(ce, next(bs))


def test_resume_keeps_the_probe_streams_position(digits):
    import copy

    x, y = digits
    probe = [(x[1400 + 32 * i: 1432 + 32 * i], y[1400 + 32 * i: 1432 + 32 * i]) for i in range(3)]
    data = list(batches(digits, 12))

    def build():
        return hpx.Engine(mlp(), sgd(0.1), [hpx.LearningRate(spread=0.5)], replicas=2, sync_every=2,
                          signal=hpx.ProbeStream(probe))

    full = build()
    for b in data:
        full.step(ce, b)
    part = build()
    for b in data[:5]:  # two syncs: the probe has moved on to its third batch
        part.step(ce, b)
    saved = copy.deepcopy(part.state_dict())
    assert saved["signal"] == {"position": 2}
    resumed = build()
    resumed.load_state_dict(saved)
    for b in data[5:]:
        resumed.step(ce, b)
    assert [r.scores for r in resumed.history] == [r.scores for r in full.history]


def test_one_batch_given_as_the_probe_is_named_with_the_fix(digits):
    """``probe=(x, y)`` is one batch, not a list of them: iterated, it would give ``x`` and
    then ``y`` as batches and fail inside torch with a dtype error; it is refused up front."""
    x, y = digits
    one = (x[:32], y[:32])
    for given in (one, list(one), {"input": x[:32], "target": y[:32]}):
        with pytest.raises(hpx.ConfigError, match=r"iterable of batches.*probe=\["):
            model = mlp()
            hpx.autolr(model, sgd()(model), total_steps=10, probe=given, loss_fn=ce)
        with pytest.raises(hpx.ConfigError, match=r"ProbeStream data .*one batch"):
            hpx.ProbeStream(given)
    with pytest.raises(hpx.ConfigError, match=r"a tuple of 2 tensors with 32 rows each \(float32 \[32, 64\], "
                                              r"int64 \[32\]\).*probe=\[\(x_val, y_val\)\]"):
        model = mlp()
        hpx.autolr(model, sgd()(model), total_steps=10, probe=one)
    # lists of batches stay valid, batches of plain tensors too (token ids of one shape)
    hpx.ProbeStream([one, one])
    hpx.ProbeStream([one])
    hpx.ProbeStream([torch.zeros(4, 16, dtype=torch.long), torch.ones(4, 16, dtype=torch.long)])
    hpx.ProbeStream([torch.zeros(4, 16, dtype=torch.long), torch.ones(4, 12, dtype=torch.long)])


def test_a_probe_stream_over_a_dataloader_leaves_the_global_random_stream_alone():
    """A DataLoader's iterator draws its seed from the global stream (shuffle or not): reading the
    probe moved your run's stream, so its dropout masks and shuffles depended on the probe's type."""
    x = torch.randn(64, 8)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x[:, 0]), batch_size=16,
                                         shuffle=True)
    stream = hpx.ProbeStream(loader, batches=3)
    state = torch.random.get_rng_state()
    for _ in range(5):  # past the end of an epoch: a new iterator
        stream._next()
    assert torch.equal(torch.random.get_rng_state(), state)
