"""``hpx.Forks(..., batched=True)`` (``hpx/forks/batched.py``): past the first step the forks and annealed
copies are trained as one ``torch.func`` computation, equal to the sequential path (the same forks, one
after the other) within float tolerance, with the same decisions; what it cannot take exactly falls back
to the sequential path before the step changes anything, and settings it cannot take are refused."""

from __future__ import annotations

import copy
import dataclasses
import logging

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hpx
from hpx.forks import batched
from tests.test_forks import BATCHES, PROBE, STEPS, _adamw_onecycle, _loss, _net

TOL = 1e-5  # on |a - b| / (1 + |a|); measured at most 7e-6 (SGD's 10x fork), 4e-7 with AdamW


@pytest.fixture(autouse=True)
def _every_step(monkeypatch):
    """Every step of two forks or more batched (by default a step of fewer than ``MIN_FORKS`` is not:
    it would be slower), so that these runs compare the batched path at every step."""
    monkeypatch.setattr(batched, "MIN_FORKS", 2)


def _everyone(forks: hpx.Forks) -> list:
    return [*forks._forks, *forks._clones]


def _tensors(forks: hpx.Forks) -> list[torch.Tensor]:
    """Every fork's and copy's weights, buffers and optimizer state, in order."""
    out = []
    for f in _everyone(forks):
        out += list(f.model.state_dict().values())
        out += [v for st in f.optimizer.state.values() for v in st.values() if torch.is_tensor(v)]
    return out


def _gap(a: hpx.Forks, b: hpx.Forks) -> float:
    """The largest difference between the two runs' tensors (they must hold the same ones), relative
    to ``1 + |a|``."""
    x, y = _tensors(a), _tensors(b)
    assert len(x) == len(y) and [t.shape for t in x] == [t.shape for t in y]
    return max(_apart(u, v) for u, v in zip(x, y))


def _apart(u: torch.Tensor, v: torch.Tensor) -> float:
    u, v = u.double(), v.double()
    return ((u - v).abs() / (1 + u.abs())).nan_to_num().max().item()


def _decisions(forks: hpx.Forks) -> list[tuple]:
    """What each decision did (its scores aside): the step, the multiples scored, the winner."""
    return [(r.phase, r.step, r.values, r.bases) for r in forks.history]


def _pair(make, loss_fn=_loss, steps: int = STEPS, seed: int = 0):
    """The same run twice, sequential and batched, step by step: the worst gap of their tensors and
    losses over the run (each step from the same random stream, which each must leave alike)."""
    torch.manual_seed(seed)
    seq = make(False)
    torch.manual_seed(seed)
    bat = make(True)
    worst = lost = 0.0
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []
    for i, b in enumerate(BATCHES[:steps]):
        torch.manual_seed(100 + i)
        x = seq.step(loss_fn, b)
        after = torch.random.get_rng_state()
        torch.manual_seed(100 + i)
        y = bat.step(loss_fn, b)
        assert torch.equal(after, torch.random.get_rng_state())  # the same draws, the streams left alike
        assert torch.equal(x.isnan(), y.isnan())
        lost = max(lost, _apart(x, y))
        seen.append((x, y))
        worst = max(worst, _gap(seq, bat))
    bat.seen = seen  # both runs' losses at each step
    return seq, bat, worst, lost


def _alike(seq: hpx.Forks, bat: hpx.Forks) -> None:
    assert _decisions(seq) == _decisions(bat) and seq.factors == bat.factors
    assert seq.fork_steps == bat.fork_steps and seq.step_count == bat.step_count
    for r, s in zip(seq.history, bat.history):
        assert r.scores == pytest.approx(s.scores, rel=1e-4, nan_ok=True)


def test_adamw_onecycle_with_dropout_equals_the_sequential_forks_across_both_cuts_and_the_end():
    """Dropout (the same masks as the sequential path draws), AdamW, OneCycleLR (its beta1 cycle), both
    cuts' annealed copies and the end: every fork's and copy's weights and optimizer state within
    ``TOL`` at every step, the same decisions, every step past the first on the batched path."""
    def make(batched):
        model = _net(p=0.2)
        opt, sched = _adamw_onecycle(model, 0.01)
        return hpx.Forks(model, opt, total_steps=STEPS, schedule=sched, probe=PROBE, batched=batched)

    seq, bat, worst, lost = _pair(make)
    assert worst < TOL and lost < TOL
    _alike(seq, bat)
    assert [r.phase for r in bat.history] == ["cut", "cut", "end"] and bat.decided
    assert bat._batched.taken == STEPS - 1 and bat._batched.why is None


@pytest.mark.parametrize("which", ["sgd", "adam-amsgrad-l2", "rmsprop"])
def test_other_optimizers_and_a_batchnorm_equal_the_sequential_forks(which):
    """SGD (Nesterov momentum, weight decay) under a cosine schedule; Adam with amsgrad and L2 weight
    decay on a model with BatchNorm (running statistics written under vmap); RMSprop, which the
    batched path does not take on stacked tensors: each fork's own ``optimizer.step()`` on the
    gradients found."""
    def make(batched):
        torch.manual_seed(0)
        if which == "adam-amsgrad-l2":
            # no bias before the BatchNorm: its gradient is 0 up to rounding, which Adam's normalised steps
            # turn into full steps in directions the rounding picks (on either path, differently)
            model = nn.Sequential(nn.Linear(8, 32, bias=False), nn.BatchNorm1d(32), nn.Tanh(),
                                  nn.Linear(32, 1))
            opt = torch.optim.Adam(model.parameters(), lr=0.01, amsgrad=True, weight_decay=1e-3)
        else:
            model = _net(p=0.1)
            opt = (torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, nesterov=True,
                                   weight_decay=1e-3)
                   if which == "sgd" else torch.optim.RMSprop(model.parameters(), lr=1e-3))
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, STEPS)
        return hpx.Forks(model, opt, total_steps=STEPS, schedule=sched, probe=PROBE, batched=batched)

    seq, bat, worst, lost = _pair(make)
    assert worst < TOL and lost < TOL
    _alike(seq, bat)
    assert bat._batched.taken == STEPS - 1


def test_a_layer_unfrozen_mid_run_and_a_lost_run_equal_the_sequential_forks():
    """A frozen first layer held once by every fork (``share=True``, not stacked), unfrozen at step 10
    through ``each`` (its optimizer state is made by each fork's own step, then stacked); and with
    no cut, your run lost to a non-finite loss (``nan`` in its place) while the other forks go on."""
    def make(batched):
        model = _net(p=0.0)
        model[0].requires_grad_(False)
        opt = torch.optim.AdamW(model.parameters(), lr=0.01)
        return hpx.Forks(model, opt, total_steps=STEPS, probe=PROBE, batched=batched)

    torch.manual_seed(0)
    seq, bat = make(False), make(True)
    for i, b in enumerate(BATCHES[:STEPS]):
        if i == 10:
            for f in (seq, bat):
                f.each(lambda r: r.model[0].requires_grad_(True))
        x, y = seq.step(_loss, b), bat.step(_loss, b)
        assert _apart(x, y) < TOL and _gap(seq, bat) < TOL
    _alike(seq, bat)
    assert bat._batched.taken == STEPS - 1

    def diverging(batched):
        model = _net(p=0.0)
        opt = torch.optim.SGD(model.parameters(), lr=1.0, momentum=0.9)
        return hpx.Forks(model, opt, total_steps=STEPS, probe=PROBE, multiples=(1e-3, 1e-2, 1), cuts=(),
                         batched=batched)

    seq, bat, _, _ = _pair(diverging)  # your run's loss grows to 1e35 first: 5e-5 apart there
    assert max(_apart(x[1:], y[1:]) for x, y in bat.seen) < TOL
    yours = [y for _, y in bat.seen if y[0].isnan()]
    assert len(yours) > 5 and all(y[1:].isfinite().all() for y in yours)
    assert bat._batched.taken == STEPS - 1
    _alike(seq, bat)


def _counted_forward(model: nn.Module) -> nn.Module:
    class Last(nn.Module):  # assigns a new tensor to a buffer at every forward
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("last", torch.zeros(()))

        def forward(self, x):
            self.last = x.detach().mean()
            return x

    return nn.Sequential(*model, Last())


FALLBACKS = {  # what the batched path cannot take exactly -> (loss_fn, model, the reason logged)
    "item": (lambda rep, b: _loss(rep, b) * (_loss(rep, b).item() > -1), None, "vmap could not run"),
    "value": (lambda rep, b: _loss(rep, b) * (1 + 0 * rep.value("lr")), None, "replica.value('lr')"),
    "optimizer": (lambda rep, b: _loss(rep, b) + 0 * len(rep.optimizer.param_groups), None,
                  "replica.optimizer"),
    "hook": (_loss, lambda m: m[0].register_forward_hook(lambda *a: None) and m, "has a hook"),
    "buffer": (_loss, _counted_forward, "assigns a new tensor to buffer '4.last'"),
}


@pytest.mark.parametrize("case", FALLBACKS)
def test_what_it_cannot_take_falls_back_before_anything_changes_with_one_warning(case, caplog):
    """The step that meets it is the sequential path's, as is every later one: the run is the
    sequential run bit for bit, and one warning says why."""
    loss_fn, change, why = FALLBACKS[case]

    def make(batched):
        model = _net()
        if change is not None:
            model = change(model)
        opt, sched = _adamw_onecycle(model, 0.01)
        return hpx.Forks(model, opt, total_steps=STEPS, schedule=sched, probe=PROBE, batched=batched)

    torch.manual_seed(0)
    seq, bat = make(False), make(True)
    with caplog.at_level(logging.WARNING, logger="hpx"):
        for i, b in enumerate(BATCHES[:12]):
            torch.manual_seed(i)
            x = seq.step(loss_fn, b)
            torch.manual_seed(i)
            assert torch.equal(x, bat.step(loss_fn, b))
    assert all(torch.equal(u, v) for u, v in zip(_tensors(seq), _tensors(bat)))
    said = [r.getMessage() for r in caplog.records if "batched=True" in r.getMessage()]
    assert len(said) == 1 and why in said[0] and "at step 2" in said[0]
    assert why in bat._batched.why and bat._batched.taken == 0


class _World2:
    """A collective of two ranks (only read, never called, before the refusal)."""

    rank, world_size = 0, 2

    def all_reduce_sum_(self, *a): ...
    def all_gather(self, *a): ...
    def broadcast_(self, *a): ...
    def broadcast_object(self, *a): ...


@pytest.mark.parametrize("settings, said", [
    ({"batched": "yes"}, "batched must be True or False (got 'yes')"),
    ({"batched": 1}, "batched must be True or False (got 1)"),
    ({"batched": True, "knobs": [hpx.Dropout(spread=0.1)]}, "knobs= gives each fork its own knob values"),
    ({"batched": True, "shard": lambda m: None}, "shard= spreads each fork over the ranks"),
    ({"batched": True, "backend": _World2()}, "the backend has 2 ranks"),
])
def test_settings_it_cannot_take_are_refused_when_forks_is_built(settings, said):
    model = _net()
    opt, sched = _adamw_onecycle(model, 0.01)
    with pytest.raises(hpx.ConfigError, match=r"batched") as e:
        hpx.Forks(model, opt, total_steps=STEPS, schedule=sched, probe=PROBE, **settings)
    assert said in str(e.value)
    if settings["batched"] is True:
        assert "drop batched=True" in str(e.value)


def test_a_checkpoint_resumes_with_or_without_batched():
    """``batched`` changes no state: a batched run saved part way resumes batched bit for bit, and
    sequentially within float tolerance, with the same decisions."""
    def make(batched):
        model = _net()
        opt, sched = _adamw_onecycle(model, 0.01)
        return hpx.Forks(model, opt, total_steps=STEPS, schedule=sched, probe=PROBE, batched=batched)

    def go(forks, start):
        for i, b in enumerate(BATCHES[start:STEPS], start):
            torch.manual_seed(i)
            forks.step(_loss, b)
        return forks

    first = make(True)
    for i, b in enumerate(BATCHES[:12]):
        torch.manual_seed(i)
        first.step(_loss, b)
    saved = copy.deepcopy(first.state_dict())
    assert "batched" not in saved
    go(first, 12)
    again, plain = make(True), make(False)
    for f in (again, plain):
        f.load_state_dict(copy.deepcopy(saved))
        go(f, 12)
    assert all(torch.equal(u, v) for u, v in zip(_tensors(first), _tensors(again)))
    assert _gap(first, plain) < TOL and _decisions(first) == _decisions(plain)
    assert again._batched.taken == STEPS - 12


def test_backward_and_optimizer_step_stay_the_sequential_path():
    """Accumulation and clipping go through ``backward`` and ``optimizer_step``, which batched=True
    leaves as they are."""
    runs = []
    for on in (False, True):
        model = _net()
        opt, sched = _adamw_onecycle(model, 0.01)
        forks = hpx.Forks(model, opt, total_steps=STEPS, schedule=sched, probe=PROBE, batched=on)
        torch.manual_seed(0)
        for b in BATCHES[:10]:
            for part in (slice(0, 8), slice(8, 16)):
                forks.backward(_loss, (b[0][part], b[1][part]), scale=0.5)
            forks.optimizer_step(max_grad_norm=1.0)
        runs.append(forks)
    assert all(torch.equal(u, v) for u, v in zip(_tensors(runs[0]), _tensors(runs[1])))
    assert runs[1]._batched.taken == 0


def test_the_record_of_a_batched_run_is_the_sequential_runs():
    """What the callbacks get (a SyncRecord per decision) differs only in the probe scores' last
    digits and the wall time."""
    def make(batched):
        model = _net()
        opt, sched = _adamw_onecycle(model, 0.01)
        return hpx.Forks(model, opt, total_steps=STEPS, schedule=sched, probe=PROBE, batched=batched)

    seq, bat, _, _ = _pair(make, loss_fn=lambda rep, b: F.mse_loss(rep.model(b[0]).squeeze(-1), b[1]))
    drop = {"wall", "scores", "metrics"}
    assert ([{k: v for k, v in dataclasses.asdict(r).items() if k not in drop} for r in seq.history]
            == [{k: v for k, v in dataclasses.asdict(r).items() if k not in drop} for r in bat.history])


def test_a_step_of_fewer_than_min_forks_takes_the_sequential_path(monkeypatch):
    """At the defaults a step of fewer than ``MIN_FORKS`` forks and copies (the run past its first cut)
    is the sequential path's, where one vmap would cost more than the forks' own steps."""
    monkeypatch.setattr(batched, "MIN_FORKS", 4)
    model = _net()
    opt, sched = _adamw_onecycle(model, 0.01)
    forks = hpx.Forks(model, opt, total_steps=STEPS, schedule=sched, probe=PROBE, batched=True)
    wide = 0
    for b in BATCHES[:STEPS]:
        wide += forks.step_count > 0 and len(forks._trained()) >= 4
        forks.step(_loss, b)
    assert forks._batched.taken == wide and 0 < wide < STEPS - 5 and forks._batched.why is None


def test_an_interrupt_in_the_batched_forward_changes_nothing_and_a_failure_after_stops_the_run(monkeypatch):
    """A ``KeyboardInterrupt`` (or an error) while vmap runs leaves every fork, the random stream and
    the step count as they were: the run goes on as if that batch had been skipped. A failure while
    the forks' step is written back leaves them apart: the run is stopped, as the sequential path
    stops it."""
    def make():
        model = _net()
        opt, sched = _adamw_onecycle(model, 0.01)
        return hpx.Forks(model, opt, total_steps=STEPS, schedule=sched, probe=PROBE, batched=True)

    def interrupted(rep, b):
        raise KeyboardInterrupt

    torch.manual_seed(0)
    hit, skipped = make(), make()
    for i, b in enumerate(BATCHES[:12]):
        torch.manual_seed(i)
        if i == 5:
            with pytest.raises(KeyboardInterrupt):
                hit.step(interrupted, b)
            continue
        hit.step(_loss, b)
        torch.manual_seed(i)
        skipped.step(_loss, b)
    assert all(torch.equal(u, v) for u, v in zip(_tensors(hit), _tensors(skipped)))
    assert hit.step_count == skipped.step_count == 11 and hit._batched.why is None

    def broken(f):
        raise RuntimeError("a scheduler that fails")

    monkeypatch.setattr(batched, "_step_scheduler", broken)
    with pytest.raises(hpx.ConfigError, match="failed at step 12 on the batched path"):
        hit.step(_loss, BATCHES[12])
    with pytest.raises(hpx.ConfigError, match="failed at step 12 on the batched path"):
        hit.step(_loss, BATCHES[13])  # every later step is refused
