"""``Forks.step`` in one process steps each fork right after its own backward and frees its
gradients (``hpx/forks/early.py``): the same run, bit for bit, as ``backward()`` then
``optimizer_step()``, with one fork's gradients alive at a time; a failure part way is exact up to
the first challenger's backward and stops the run after it."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

import hpx
from hpx.forks import early
from tests.test_forks import BATCHES, PROBE, STEPS, _adamw_onecycle, _loss, _net, _plain, _Rep, _same


def _forks(p: float = 0.2, **settings) -> hpx.Forks:
    model = _net(p=p)
    opt, sched = _adamw_onecycle(model, 0.01)
    return hpx.Forks(model, opt, total_steps=STEPS, schedule=sched, probe=PROBE, **settings)


def _everyone(forks: hpx.Forks) -> list:
    return [*forks._forks, *forks._clones]


def _bits(forks: hpx.Forks) -> list[torch.Tensor]:
    """Every fork's and copy's weights, buffers and optimizer state."""
    out = []
    for f in _everyone(forks):
        out += list(f.model.state_dict().values())
        out += [v for st in f.optimizer.state.values() for v in st.values() if torch.is_tensor(v)]
    return out


def _equal(a: hpx.Forks, b: hpx.Forks) -> bool:
    x, y = _bits(a), _bits(b)
    return len(x) == len(y) and all(torch.equal(u, v) for u, v in zip(x, y))


def _history(forks: hpx.Forks) -> list[dict]:
    return [{k: v for k, v in dataclasses.asdict(r).items() if k != "wall"} for r in forks.history]


def test_step_is_backward_then_optimizer_step_bit_for_bit_across_the_cuts_and_the_end(monkeypatch):
    """Dropout, AdamW and OneCycleLR, the annealed copies of both cuts, the end: every fork and copy
    at every step, the losses, the history and the random stream after each step are those of
    ``backward()`` then ``optimizer_step()``; and the early path is the one taken past step 1."""
    taken = []
    real = early.train_each
    monkeypatch.setattr("hpx.forks.search.train_each",
                        lambda *a: taken.append(a[0].step_count) or real(*a))
    torch.manual_seed(1)
    fast = _forks(knobs=[hpx.Dropout(spread=0.1)])
    torch.manual_seed(1)
    slow = _forks(knobs=[hpx.Dropout(spread=0.1)])
    copies = 0
    for i, b in enumerate(BATCHES[:STEPS]):
        torch.manual_seed(i)
        a = fast.step(_loss, b)
        after = torch.random.get_rng_state()
        torch.manual_seed(i)
        c = slow.backward(_loss, b)
        slow.optimizer_step()
        assert torch.equal(a, c) and torch.equal(after, torch.random.get_rng_state())
        assert fast.step_count == slow.step_count and _equal(fast, slow)
        copies += bool(fast._clones)
    assert copies > 0 and fast.decided and taken == list(range(1, STEPS))
    assert _history(fast) == _history(slow) and len(fast.history) == 3
    assert fast.fork_steps == slow.fork_steps and fast.factors == slow.factors
    assert _same(fast.model, slow.model)


def test_no_fork_holds_a_gradient_after_step():
    forks = _forks()
    forks.step(_loss, BATCHES[0])  # the first step takes backward() then optimizer_step()
    copies = 0
    for b in BATCHES[1:12]:
        copies += len(forks._clones)  # the annealed copies trained at this step
        forks.step(_loss, b)
        assert all(p.grad is None for f in [*forks._forks, *forks._clones] for p in f.model.parameters())
    assert copies > 0


def test_a_python_stream_the_model_draws_from_is_replayed_and_left_as_before():
    """A model that draws from Python's ``random`` (a LayerDrop): every fork draws your run's
    numbers, and the stream after each step is the one backward() then optimizer_step() leave."""
    class Drop(torch.nn.Module):
        def forward(self, x):
            return x * (1.0 if random.random() < 0.7 else 0.0)

    def build():
        model = torch.nn.Sequential(*_net(p=0.0), Drop())
        return hpx.Forks(model, torch.optim.SGD(model.parameters(), lr=0.05), total_steps=STEPS, probe=PROBE)

    fast, slow = build(), build()
    for i, b in enumerate(BATCHES[:8]):
        random.seed(i)
        fast.step(_loss, b)
        mine = random.getstate()
        random.seed(i)
        slow.backward(_loss, b)
        slow.optimizer_step()
        assert mine == random.getstate() and _equal(fast, slow)


def test_a_step_after_a_backward_of_your_own_accumulates_on_the_old_path(monkeypatch):
    """Accumulation (backward() given a micro-batch, then step()) takes backward() then
    optimizer_step(), unchanged: the same run as three backward() calls and one optimizer_step()."""
    taken = []
    real = early.train_each
    monkeypatch.setattr("hpx.forks.search.train_each",
                        lambda *a: taken.append(a[0].step_count) or real(*a))
    mixed, ref = _forks(p=0.0), _forks(p=0.0)
    for b in BATCHES[:3]:
        mixed.step(_loss, b)
        ref.backward(_loss, b)
        ref.optimizer_step()
    mixed.backward(_loss, BATCHES[3], scale=0.5)
    mixed.step(_loss, BATCHES[4])
    ref.backward(_loss, BATCHES[3], scale=0.5)
    ref.backward(_loss, BATCHES[4])
    ref.optimizer_step()
    assert taken == [1, 2] and mixed.step_count == ref.step_count == 4 and _equal(mixed, ref)


def test_a_loss_fn_that_switches_to_your_model_object_is_refused_before_anything_steps():
    """The first challenger's backward is checked before any fork steps (your run's gradients wait
    for it): the refusal changes nothing, as it did when every backward came first."""
    model = _net(p=0.0)
    forks = hpx.Forks(model, torch.optim.SGD(model.parameters(), lr=0.05), total_steps=STEPS, probe=PROBE)
    forks.step(_loss, BATCHES[0])
    forks.step(_loss, BATCHES[1])
    before = _bits(forks)
    with pytest.raises(hpx.ConfigError, match=r"reached none of its parameters.*not with your model object"):
        forks.step(lambda rep, b: _loss(_Rep(model), b), BATCHES[2])
    assert forks.step_count == 2 and all(torch.equal(a, b) for a, b in zip(before, _bits(forks)))
    assert all(p.grad is None for f in forks._forks for p in f.model.parameters())
    assert forks._half is None
    forks.step(_loss, BATCHES[2])
    assert forks.step_count == 3


def _flaky(fail_at: int):
    """The training loss, raising an out-of-memory error at its ``fail_at``-th call (1-based)."""
    calls = {"n": 0}

    def loss(rep, b):
        calls["n"] += 1
        if calls["n"] == fail_at:
            raise RuntimeError("out of memory")
        return _loss(rep, b)

    return loss


@pytest.mark.parametrize("fork", [0, 1])
def test_a_backward_that_fails_before_any_fork_steps_leaves_plain_training_that_skipped_the_batch(fork):
    """Your run's backward, or the first challenger's (the forks' steps wait for it): nothing is
    stepped, no gradient is kept, and a loop that skips the batch is plain training without it."""
    model = _net(p=0.0)
    forks = hpx.Forks(model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9), total_steps=20,
                      probe=PROBE, loss_fn=_loss, confidence=1e9)
    loss = _flaky(5 * 2 + fork + 1)  # step 3: forks.step() past its first step steps early
    for i, b in enumerate(BATCHES[:20]):
        try:
            forks.step(loss, b)
        except RuntimeError:
            assert i == 2
    ref = _net(p=0.0)
    _plain(ref, torch.optim.SGD(ref.parameters(), lr=0.01, momentum=0.9), None, BATCHES[:2] + BATCHES[3:20])
    assert forks.step_count == 19 and _same(model, ref)


def test_a_backward_that_fails_after_forks_stepped_stops_the_run_naming_the_step_and_the_fork(tmp_path):
    """The third fork's backward fails at step 3, after your run and the fork at 0.1x stepped:
    the forks are at different steps. A ConfigError names it; every later step, converge() and
    save_checkpoint refuse the run; a resume from a checkpoint goes on as before."""
    model = _net(p=0.0)
    forks = hpx.Forks(model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9), total_steps=20,
                      probe=PROBE, loss_fn=_loss)
    for b in BATCHES[:2]:
        forks.step(_loss, b)
    assert hpx.save_checkpoint(tmp_path, forks) is not None
    state = [t.clone() for t in _bits(forks)]
    words = (r"forks\.step\(\) failed at step 3 on the fork at 0\.316x \(RuntimeError: out of memory\) "
             r"after your run and the fork at 0\.1x had taken that step's optimizer step.*different steps.*"
             r"forks\.backward\(loss_fn, batch\) then forks\.optimizer_step\(\)")
    with pytest.raises(hpx.ConfigError, match=words) as e:
        forks.step(_flaky(3), BATCHES[2])
    assert isinstance(e.value.__cause__, RuntimeError)
    assert all(p.grad is None for f in forks._forks for p in f.model.parameters())
    moved = [not torch.equal(a, b) for a, b in zip(state, _bits(forks))]
    assert any(moved) and not all(moved)  # some forks stepped, the others not
    with pytest.raises(hpx.ConfigError, match=words):
        forks.step(_loss, BATCHES[2])
    with pytest.raises(hpx.ConfigError, match=words):
        forks.converge()
    assert hpx.save_checkpoint(tmp_path, forks) is None  # refused with a warning: nothing written
    hpx.load_checkpoint(tmp_path, forks)
    ref = _net(p=0.0)
    other = hpx.Forks(ref, torch.optim.SGD(ref.parameters(), lr=0.01, momentum=0.9), total_steps=20,
                      probe=PROBE, loss_fn=_loss)
    for b in BATCHES[:2]:
        other.step(_loss, b)
    assert forks.step_count == 2 and _equal(forks, other)
    for b in BATCHES[2:6]:
        forks.step(_loss, b)
        other.step(_loss, b)
    assert _equal(forks, other)


def test_an_interrupt_after_forks_stepped_stays_an_interrupt_and_stops_the_run():
    model = _net(p=0.0)
    forks = hpx.Forks(model, torch.optim.SGD(model.parameters(), lr=0.01), total_steps=20, probe=PROBE)
    forks.step(_loss, BATCHES[0])
    calls = {"n": 0}

    def interrupted(rep, b):
        calls["n"] += 1
        if calls["n"] == 4:
            raise KeyboardInterrupt
        return _loss(rep, b)

    with pytest.raises(KeyboardInterrupt) as e:
        forks.step(interrupted, BATCHES[1])
    assert any("forks.step() failed at step 2" in n for n in e.value.__notes__)
    with pytest.raises(hpx.ConfigError, match=r"failed at step 2 on the fork at 3\.16x \(KeyboardInterrupt"):
        forks.step(_loss, BATCHES[1])
