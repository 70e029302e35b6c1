"""hpx.Forks: whole runs at several lr multiples, cut by successive halving, your run kept unless a
challenger wins with confidence. Every test compares with plain training written out by hand."""

from __future__ import annotations

import copy
import io
import logging
import math
import re
import threading
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hpx
from hpx.backends import TorchDistributed
from hpx.forks.fork import paired_gain
from hpx.forks.late import corrected
from tests._dist import run_distributed

STEPS = 30


def _data(seed: int = 0, n: int = 512) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    w = torch.randn(8, 1, generator=g)
    return x, (x @ w).squeeze(-1) + 0.1 * torch.randn(n, generator=g)


X, Y = _data()
BATCHES = [(X[(16 * i) % 384:(16 * i) % 384 + 16], Y[(16 * i) % 384:(16 * i) % 384 + 16]) for i in range(60)]
PROBE = [(X[384:448], Y[384:448]), (X[448:512], Y[448:512])]


def _net(seed: int = 0, p: float = 0.2) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Dropout(p), nn.Linear(32, 1))


def _loss(rep, b):
    return F.mse_loss(rep.model(b[0]).squeeze(-1), b[1])


def _per_example(rep, b):
    return F.mse_loss(rep.model(b[0]).squeeze(-1), b[1], reduction="none")


class _Rep:
    def __init__(self, model: nn.Module) -> None:
        self.model = model


def _plain(model, opt, sched, batches, clip: float | None = None):
    """The user's loop, as plain training runs it."""
    for b in batches:
        loss = _loss(_Rep(model), b)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        if sched is not None:
            sched.step()
    return model


@torch.no_grad()
def _probe_loss(model: nn.Module) -> float:
    was = model.training
    model.eval()
    v = sum(float(_loss(_Rep(model), b)) for b in PROBE) / len(PROBE)
    model.train(was)
    return v


def _same(a: nn.Module, b: nn.Module) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


def _adamw_onecycle(model: nn.Module, lr: float):
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    return opt, torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=STEPS + 1)


def test_your_run_is_plain_training_bit_for_bit_when_it_is_kept():
    """Your model, optimizer, OneCycle scheduler (and its beta1 cycle) and the global random stream
    end exactly as plain training leaves them, though four other forks trained, two cuts scored
    annealed copies and the end ran the paired test."""
    model = _net()
    opt, sched = _adamw_onecycle(model, 0.01)
    torch.manual_seed(7)
    forks = hpx.Forks(model, opt, total_steps=STEPS, schedule=sched, probe=PROBE, confidence=1e9)
    for b in BATCHES[:STEPS]:
        forks.step(_loss, b)
    rng = torch.random.get_rng_state()

    ref = _net()
    ref_opt, ref_sched = _adamw_onecycle(ref, 0.01)
    torch.manual_seed(7)
    _plain(ref, ref_opt, ref_sched, BATCHES[:STEPS])

    assert [r.phase for r in forks.history] == ["cut", "cut", "end"]
    assert forks.factor == 1.0 and forks.model is model
    assert _same(model, ref)
    assert torch.equal(rng, torch.random.get_rng_state())
    assert sched.last_epoch == ref_sched.last_epoch
    assert opt.param_groups[0]["betas"] == ref_opt.param_groups[0]["betas"]
    got, want = opt.state_dict()["state"], ref_opt.state_dict()["state"]
    assert all(torch.equal(got[k]["exp_avg"], want[k]["exp_avg"]) for k in want)


def test_a_winner_is_plain_training_at_its_multiple_loaded_into_your_objects():
    """With confidence 0 the better-scoring fork wins; your model and optimizer then hold exactly
    what plain training at that multiple of the lr, from the same random stream, ends with."""
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.03, momentum=0.9)
    torch.manual_seed(3)
    forks = hpx.Forks(model, opt, total_steps=40, probe=PROBE, multiples=(0.1, 1.0), cuts=(), confidence=0)
    for b in BATCHES[:40]:
        forks.step(_loss, b)
    runs = {}
    for m in (0.1, 1.0):
        ref = _net()
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.03 * m, momentum=0.9)
        torch.manual_seed(3)
        runs[m] = (_plain(ref, ref_opt, None, BATCHES[:40]), ref_opt)
    best = min(runs, key=lambda m: _probe_loss(runs[m][0]))
    assert best == 0.1  # the scenario: 10x lower is better, so the winner is adopted
    assert forks.factor == best and forks.bases == {"lr": best}
    assert forks.history[-1].bases == {"lr": best}
    assert forks.model is model and _same(model, runs[best][0])
    got, want = opt.state_dict()["state"], runs[best][1].state_dict()["state"]
    assert all(torch.equal(got[k]["momentum_buffer"], want[k]["momentum_buffer"]) for k in want)
    assert opt.param_groups[0]["lr"] == runs[best][1].param_groups[0]["lr"]  # the winner's lr, written in
    assert forks.factors == [best]


def test_a_winner_under_onecycle_is_plain_onecycle_training_at_its_multiple():
    """Every fork follows OneCycleLR's beta1 cycle step by step as torch sets it, and the winner's
    weights and Adam state are those of plain OneCycle training at max_lr times its multiple."""
    n = 40

    def adamw_onecycle(model, lr):
        opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
        return opt, torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=n)

    model = _net()
    opt, sched = adamw_onecycle(model, 0.003)
    torch.manual_seed(3)
    forks = hpx.Forks(model, opt, total_steps=n, schedule=sched, probe=PROBE, multiples=(1.0, 10.0),
                      cuts=(), confidence=0)
    betas = []
    for b in BATCHES[:n]:
        forks.step(_loss, b)
        if not forks.decided:
            betas.append([f.optimizer.param_groups[0]["betas"] for f in forks._forks])
    runs = {}
    for m in (1.0, 10.0):
        ref = _net()
        ref_opt, ref_sched = adamw_onecycle(ref, 0.003 * m)
        torch.manual_seed(3)
        want = []
        for b in BATCHES[:n]:
            _plain(ref, ref_opt, ref_sched, [b])
            want.append(ref_opt.param_groups[0]["betas"])
        runs[m] = (ref, ref_opt)
    assert len({w[0] for w in want}) > 5  # the scenario: beta1 cycles
    assert betas == [[w, w] for w in want[:len(betas)]] and len(betas) == n - 1
    best = min(runs, key=lambda m: _probe_loss(runs[m][0]))
    assert best == 10.0  # the scenario: 10x the lr is better here, so the winner is adopted
    assert forks.factor == best and opt.param_groups[0]["betas"] == runs[best][1].param_groups[0]["betas"]
    for got, ref in zip(model.parameters(), runs[best][0].parameters()):
        torch.testing.assert_close(got, ref)
    got, ref = opt.state_dict()["state"], runs[best][1].state_dict()["state"]
    assert all(torch.allclose(got[k]["exp_avg_sq"], ref[k]["exp_avg_sq"]) for k in ref)


_LR = torch.optim.lr_scheduler


@pytest.mark.parametrize("make", [
    lambda o: _LR.SequentialLR(o, [_LR.LinearLR(o, 0.1, 1.0, 5), _LR.CosineAnnealingLR(o, 35)], [5]),
    lambda o: _LR.ChainedScheduler([_LR.ExponentialLR(o, 0.99), _LR.StepLR(o, 10, 0.5)]),
], ids=["SequentialLR", "ChainedScheduler"])
def test_schedulers_that_hold_schedulers_are_followed_by_every_fork(make):
    """A warm-up then cosine (SequentialLR) or a product of schedules (ChainedScheduler), which keep
    no step count of their own: the winner ends as plain training under the same scheduler at its
    multiple, and no warning of torch's step-order check is left to the user."""
    n = 40
    model = _net(p=0.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.03, momentum=0.9)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        forks = hpx.Forks(model, opt, total_steps=n, schedule=make(opt), probe=PROBE, multiples=(0.1, 1.0),
                          cuts=(), confidence=0)
        for b in BATCHES[:n]:
            forks.step(_loss, b)
    runs = {}
    for m in (0.1, 1.0):
        ref = _net(p=0.0)
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.03 * m, momentum=0.9)
        runs[m] = _plain(ref, ref_opt, make(ref_opt), BATCHES[:n])
    best = min(runs, key=lambda m: _probe_loss(runs[m]))
    assert forks.factor == best
    for got, want in zip(model.parameters(), runs[best].parameters()):
        torch.testing.assert_close(got, want)


def test_a_winner_draws_what_plain_training_draws_when_the_loader_shuffles_with_the_global_stream():
    """Between steps a DataLoader that shuffles without its own generator takes from the global
    stream that dropout draws from; every fork draws at each step what your run draws there, so a
    winner is still plain training at its multiple bit for bit (dropout masks included)."""
    data = torch.utils.data.TensorDataset(X[:96], Y[:96])

    def batches():  # 4 epochs of 6 batches, each epoch's order drawn from the global stream
        for _ in range(4):
            yield from torch.utils.data.DataLoader(data, batch_size=16, shuffle=True)

    model = _net(p=0.3)
    opt = torch.optim.SGD(model.parameters(), lr=0.03, momentum=0.9)
    torch.manual_seed(5)
    forks = hpx.Forks(model, opt, total_steps=24, probe=PROBE, multiples=(0.25, 1.0), cuts=(), confidence=0)
    for b in batches():
        forks.step(_loss, b)
    runs = {}
    for m in (0.25, 1.0):
        ref = _net(p=0.3)
        torch.manual_seed(5)
        runs[m] = _plain(ref, torch.optim.SGD(ref.parameters(), lr=0.03 * m, momentum=0.9), None, batches())
    assert forks.factor == 0.25 and _probe_loss(runs[0.25]) < _probe_loss(runs[1.0])  # the challenger won
    assert _same(model, runs[0.25])


def test_the_confidence_test_keeps_your_run_when_the_probe_cannot_tell(caplog):
    """Same scenario, confidence 1e9: the challenger scores better but cannot win by a billion
    standard errors, so your run stays and equals plain training at your lr; the log line says over
    how many probe examples, and how much larger a probe would have told the difference."""
    model = _net()
    torch.manual_seed(3)
    forks = hpx.Forks(model, torch.optim.SGD(model.parameters(), lr=0.03, momentum=0.9), total_steps=40,
                      probe=PROBE, multiples=(0.1, 1.0), cuts=(), confidence=1e9)
    with caplog.at_level(logging.INFO, logger="hpx"):
        for b in BATCHES[:40]:
            forks.step(_loss, b)
    end = forks.history[-1]
    assert end.scores[1] < end.scores[0]  # the challenger (0.1) scored better ...
    assert 0 < end.metrics["gain"] < 1e9  # ... by a finite number of standard errors
    factor = f"{(1e9 / end.metrics['gain']) ** 2:.3g}x as large"
    examples = sum(len(y) for _, y in PROBE)
    said = f"standard errors over {examples} probe examples"
    assert any(factor in r.getMessage() and said in r.getMessage() for r in caplog.records
               if "(end)" in r.getMessage())
    ref = _net()
    torch.manual_seed(3)
    _plain(ref, torch.optim.SGD(ref.parameters(), lr=0.03, momentum=0.9), None, BATCHES[:40])
    assert forks.factor == 1.0 and _same(model, ref)


def _two_challengers(confidence: float) -> hpx.Forks:
    model = _net()
    torch.manual_seed(3)
    forks = hpx.Forks(model, torch.optim.SGD(model.parameters(), lr=0.03, momentum=0.9), total_steps=40,
                      probe=PROBE, multiples=(0.1, 0.3, 1.0), cuts=(), confidence=confidence)
    for b in BATCHES[:40]:
        forks.step(_loss, b)
    return forks


def test_the_bar_raised_for_two_challengers_is_recorded_and_named_when_it_keeps_your_run(caplog):
    """With two challengers at the end the bar is ``corrected(confidence, 2)``: a lead between
    ``confidence`` and that bar keeps your run, and the record and the log line give the bar it
    fell short of, with the probe size that would tell (from the bar, not from ``confidence``)."""
    gain = _two_challengers(1e9).history[-1].metrics["gain"]  # the same run at any confidence
    assert gain > 0.2
    confidence = gain - 0.1
    bar = corrected(confidence, 2)
    assert confidence < gain < bar
    with caplog.at_level(logging.INFO, logger="hpx"):
        forks = _two_challengers(confidence)
    end = forks.history[-1]
    assert end.metrics == {"gain": gain, "bar": bar}
    assert forks.factor == 1.0  # kept: the lead cleared confidence, not the raised bar
    said = [r.getMessage() for r in caplog.records if "(end)" in r.getMessage()]
    assert len(said) == 1
    assert f"short of the bar of {bar:.2f}: a probe about {(bar / gain) ** 2:.3g}x as large" in said[0]


def test_a_lead_that_clears_the_raised_bar_wins_and_says_nothing_of_the_probe(caplog):
    gain = _two_challengers(1e9).history[-1].metrics["gain"]
    confidence = 0.5 * gain
    assert corrected(confidence, 2) < gain
    with caplog.at_level(logging.INFO, logger="hpx"):
        forks = _two_challengers(confidence)
    assert forks.history[-1].metrics == {"gain": gain, "bar": corrected(confidence, 2)}
    assert forks.factor != 1.0
    assert not any("as large" in r.getMessage() for r in caplog.records)


def test_a_lost_run_gives_way_without_the_test():
    """A start that ends worse on the probe than the initial weights (SGD past its stability limit
    on a linear regression: the weight oscillates and grows, finite) is lost: the challenger that
    ended better than the initial weights wins, whatever the confidence asked for."""
    torch.manual_seed(0)
    model = nn.Linear(8, 1, bias=False)
    nn.init.zeros_(model.weight)
    forks = hpx.Forks(model, torch.optim.SGD(model.parameters(), lr=1.2), total_steps=20, probe=PROBE,
                      multiples=(0.1, 1.0), cuts=(), confidence=1e9)
    initial = _probe_loss(model)
    for b in BATCHES[:20]:
        forks.step(_loss, b)
    start, challenger = forks.history[-1].scores
    assert math.isfinite(start) and start > initial > challenger
    assert forks.factor == 0.1
    assert forks.history[-1].metrics is None  # no test was run


def test_every_fork_non_finite_is_an_error_naming_the_forks():
    model = nn.Linear(8, 1)
    forks = hpx.Forks(model, torch.optim.SGD(model.parameters(), lr=1e6), total_steps=10, probe=PROBE,
                      multiples=(0.1, 1.0), cuts=())
    with pytest.raises(hpx.NonFiniteError, match=r"\[\{'lr': 1.0\}, \{'lr': 0.1\}\]"):
        for b in BATCHES[:10]:
            forks.step(_loss, b)
    # each fork is dropped the step after its loss went non-finite (4 for three of them, 5 for the
    # rest), and the run stops then, not at the first cut (step 6) nor at the end
    model = nn.Linear(8, 1)
    forks = hpx.Forks(model, torch.optim.SGD(model.parameters(), lr=1e6), total_steps=40, probe=PROBE)
    with pytest.raises(hpx.NonFiniteError, match="at step 5 every fork"):
        for b in BATCHES[:40]:
            forks.step(_loss, b)
    assert forks.step_count == 5 and not forks.decided


def test_cuts_keep_the_best_scoring_forks_and_your_run():
    """Five forks over 40 steps: a cut at step 4 decided at step 6 on annealed copies keeps 3, one at
    step 10 decided at 12 keeps 2, the end keeps 1; each cut keeps the best scores (ties to the
    multiple nearer 1) and your run whatever it scored."""
    model = _net(p=0.0)
    counts = []
    forks = hpx.Forks(model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), total_steps=40,
                      probe=PROBE, on_sync=lambda rec: counts.append((rec.step, rec.phase)))
    alive = []
    for b in BATCHES[:40]:
        forks.step(_loss, b)
        alive.append(len(forks.factors))
    assert alive[:5] == [5] * 5 and alive[5:11] == [3] * 6 and alive[11:39] == [2] * 28 and alive[39] == 1
    assert counts == [(6, "cut"), (12, "cut"), (40, "end")]
    # 5 forks to step 4, a copy of each of the 4 challengers at steps 5-6 (your run is kept: no
    # copy), 3 forks to 10, 2 copies at 11-12, 2 to the end
    assert forks.fork_steps == 5 * 4 + 9 * 2 + 3 * 4 + 5 * 2 + 2 * 28 == 3 * 40 - 4
    for rec, keep, after in zip(forks.history[:2], (3, 2), (forks.history[1], forks.history[2])):
        factors, scores = rec.values["lr"], rec.scores
        ranked = sorted(range(len(scores)), key=lambda i: (scores[i], abs(math.log(factors[i]))))
        kept = ranked[:keep] if 0 in ranked[:keep] else [*ranked[:keep - 1], 0]
        assert sorted(after.values["lr"]) == sorted(factors[i] for i in kept)


def test_a_cut_scores_a_copy_annealed_over_the_next_steps():
    """The score of a challenger at a cut is the probe loss of a copy of it trained on the next k
    batches with its lr multiple falling as (k - j) / (k + 1), j = 0..k-1; your run, kept at every
    cut, has no copy and is not scored there (nan: no decision reads its score, issue 51)."""
    model = _net(p=0.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    forks = hpx.Forks(model, opt, total_steps=20, probe=PROBE, multiples=(0.1, 1.0, 10.0),
                      cuts=((0.5, 2),), cool=0.15)
    for b in BATCHES[:13]:
        forks.step(_loss, b)
    assert forks.history[0].step == 13  # cut at 10, k = 3 steps of annealing
    ref = _net(p=0.0)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.005, momentum=0.9)
    _plain(ref, ref_opt, None, BATCHES[:10])
    for j, b in enumerate(BATCHES[10:13]):
        for g in ref_opt.param_groups:
            g["lr"] = 0.005 * (3 - j) / 4
        _plain(ref, ref_opt, None, [b])
    assert forks.history[0].values["lr"][:2] == [1.0, 0.1]
    assert forks.history[0].scores[1] == pytest.approx(_probe_loss(ref), rel=1e-6)
    assert math.isnan(forks.history[0].scores[0])


def test_resume_mid_cut_is_bit_for_bit(tmp_path):
    """A state saved while a cut's annealed copies train (with dropout: every fork's random stream),
    loaded into a fresh Forks on a fresh model, continues exactly as the uninterrupted run."""
    def build():
        model = _net()
        opt, sched = _adamw_onecycle(model, 0.01)
        return model, hpx.Forks(model, opt, total_steps=STEPS, schedule=sched, probe=PROBE,
                                knobs=[hpx.Dropout(spread=0.1)], knob_start=0, knob_design="each")

    torch.manual_seed(5)
    model, forks = build()
    for b in BATCHES[:4]:
        forks.step(_loss, b)
    assert len(forks._clones) == 6  # the first cut's copies are in flight (4 lr challengers, 2 dropout)
    buf = io.BytesIO()
    torch.save({"forks": forks.state_dict(), "rng": torch.random.get_rng_state()}, buf)
    for b in BATCHES[4:STEPS]:
        forks.step(_loss, b)

    model2, forks2 = build()
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    forks2.load_state_dict(saved["forks"])
    torch.random.set_rng_state(saved["rng"])
    for b in BATCHES[4:STEPS]:
        forks2.step(_loss, b)
    assert _same(model, model2) and forks.bases == forks2.bases
    assert [(r.step, r.values, r.scores, r.bases) for r in forks.history] == \
        [(r.step, r.values, r.scores, r.bases) for r in forks2.history]


def test_a_state_from_other_settings_is_refused_and_changes_nothing():
    model = _net()
    forks = hpx.Forks(model, torch.optim.SGD(model.parameters(), lr=0.05), total_steps=20, probe=PROBE)
    state = copy.deepcopy(forks.state_dict())
    other_model = _net(seed=1)
    other = hpx.Forks(other_model, torch.optim.SGD(other_model.parameters(), lr=0.05), total_steps=30,
                      probe=PROBE)
    before = copy.deepcopy(other_model.state_dict())
    with pytest.raises(hpx.ConfigError, match=r"total_steps=20 \(this run has 30\)"):
        other.load_state_dict(state)
    with pytest.raises(hpx.ConfigError, match="not a Forks state"):
        other.load_state_dict({"format": "hpx/1"})
    assert all(torch.equal(a, b) for a, b in zip(before.values(), other_model.state_dict().values()))


def _end_test(probe, loss_fn) -> tuple[list[float], float]:
    """The end's scores and the challenger's gain of a 40-step run kept by a confidence no gain
    reaches (0.1x against your SGD run), with this probe and probe loss."""
    model = _net()
    torch.manual_seed(3)
    forks = hpx.Forks(model, torch.optim.SGD(model.parameters(), lr=0.03, momentum=0.9), total_steps=40,
                      probe=probe, loss_fn=loss_fn, multiples=(0.1, 1.0), cuts=(), confidence=1e9)
    for b in BATCHES[:40]:
        forks.step(_loss, b)
    return forks.history[-1].scores, forks.history[-1].metrics["gain"]


def test_per_example_losses_give_the_same_test_as_one_example_at_a_time():
    """A probe loss that returns every example's loss, and one that returns the batch mean (hpx then
    scores one example at a time), give the same scores and the same paired test."""
    gains = [_end_test(PROBE, fn) for fn in (_loss, _per_example)]
    assert gains[0][0] == pytest.approx(gains[1][0], rel=1e-6)
    assert gains[0][1] == pytest.approx(gains[1][1], rel=1e-5)


def test_paired_gain():
    b = torch.tensor([1.0, 2.0, 3.0, 4.0])
    a = b - torch.tensor([0.5, 1.5, 0.5, 1.5])  # differences: mean 1, std 0.5774
    assert paired_gain(a, b) == pytest.approx(1.0 / (0.5773502691896258 / 2.0))
    assert paired_gain(b, a) == pytest.approx(-1.0 / (0.5773502691896258 / 2.0))
    assert paired_gain(b - 1, b) == math.inf and paired_gain(b, b) == 0.0
    assert paired_gain(b, torch.tensor([1.0, math.nan, 3.0, 4.0])) == math.inf
    assert paired_gain(torch.tensor([math.inf, 1.0, 1.0, 1.0]), b) == -math.inf
    # one unit gives no standard error: no evidence either way (it was an infinite gain), unless a
    # side is not finite
    one = torch.tensor([2.0])
    assert paired_gain(one - 1, one) == 0.0 and paired_gain(one, one - 1) == 0.0
    assert paired_gain(one, torch.tensor([math.nan])) == math.inf


def test_accumulation_and_clipping_follow_plain_training():
    """Two half batches at scale 1/2 make the whole batch's step; max_grad_norm clips each fork as
    clip_grad_norm_ does and returns the forks' norms, your run's first."""
    model = _net(p=0.0)
    forks = hpx.Forks(model, torch.optim.SGD(model.parameters(), lr=0.05), total_steps=20, probe=PROBE,
                      multiples=(0.1, 1.0), cuts=())
    ref = _net(p=0.0)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05)
    for b in BATCHES[:5]:
        for part in zip(*(t.chunk(2) for t in b)):
            forks.backward(_loss, part, scale=0.5)
        norms = forks.optimizer_step(max_grad_norm=0.5)
        ref_opt.zero_grad()
        _loss(_Rep(ref), b).backward()
        want = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        ref_opt.step()
        assert norms.shape == (2,) and float(norms[0]) == pytest.approx(float(want), rel=1e-5)
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(model.parameters(), ref.parameters()))
    with pytest.raises(hpx.ConfigError, match="found no gradients"):
        forks.optimizer_step()


def test_a_grad_scaler_is_followed_per_fork():
    model = _net(p=0.0)
    forks = hpx.Forks(model, torch.optim.SGD(model.parameters(), lr=0.05), total_steps=20, probe=PROBE,
                      multiples=(0.1, 1.0), cuts=())
    ref = _net(p=0.0)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    for b in BATCHES[:5]:
        forks.backward(_loss, b, scaler=scaler)
        forks.optimizer_step(scaler=scaler)
        _plain(ref, ref_opt, None, [b])
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(model.parameters(), ref.parameters()))


def test_converge_before_the_end_decides_and_steps_past_it_warn_once(caplog):
    model = _net(p=0.0)
    forks = hpx.Forks(model, torch.optim.SGD(model.parameters(), lr=0.03, momentum=0.9), total_steps=40,
                      probe=PROBE, multiples=(0.1, 1.0), cuts=(), confidence=0)
    for b in BATCHES[:30]:
        forks.step(_loss, b)
    assert not forks.decided
    assert forks.converge() is model and forks.decided and len(forks.factors) == 1
    assert [r.step for r in forks.history] == [30]
    with caplog.at_level(logging.WARNING, logger="hpx"):
        for b in BATCHES[30:45]:
            losses = forks.step(_loss, b)
    assert losses.shape == (1,)
    assert len([r for r in caplog.records if "past total_steps=40" in r.getMessage()]) == 1
    assert forks.step_count == 45


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"multiples": (0.1, 10.0)}, r"one of them 1 \(your run\)"),
    ({"multiples": (1.0, 1.0, 3.0)}, "multiples must be distinct"),
    ({"multiples": iter((0.1, 1.0, 10.0))}, "multiples must be a tuple or list of distinct numbers"),
    ({"cuts": ((0.5, 2), (0.2, 3))}, "shares rising"),
    ({"cuts": ((0.1, 5),)}, "keeps 5 of the 5 forks"),
    ({"multiples": (0.1, 1.0, 10.0)}, r"cuts=\[\(0.1, 3\), \(0.25, 2\)\] keeps 3 of the 3 forks: give cuts="),
    ({"cool": 0.2}, r"cool=0.2 overlaps the cuts"),
    ({"confidence": -1}, "confidence must be a number >= 0"),
    ({"total_steps": 1}, "total_steps must be an integer >= 2"),
    ({"probe": (b for b in PROBE)}, "may not iterate twice"),
    ({"probe": []}, "probe is empty"),
    ({"probe": PROBE[0]}, "looks like one batch"),
    ({"schedule": 3}, "schedule must be a torch LRScheduler"),
])
def test_bad_settings_name_the_value_and_the_fix(kwargs, match):
    model = _net()
    settings = {"total_steps": 20, "probe": PROBE, **kwargs}
    with pytest.raises(hpx.ConfigError, match=match):
        hpx.Forks(model, torch.optim.SGD(model.parameters(), lr=0.1), **settings)


def test_set_ups_forks_cannot_run_are_refused_with_the_fix_before_anything_trains():
    model, other = _net(), _net(seed=1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(torch.optim.SGD(other.parameters(), lr=0.1), 5)
    with pytest.raises(hpx.ConfigError, match="built on another optimizer"):
        hpx.Forks(model, opt, total_steps=20, probe=PROBE, schedule=sched)
    with pytest.raises(hpx.ConfigError, match="not the model's"):
        hpx.Forks(model, torch.optim.SGD(other.parameters(), lr=0.1), total_steps=20, probe=PROBE)
    # an optimizer that needs a closure cannot be stepped per fork: refused, nothing trained
    with pytest.raises(hpx.ConfigError, match="LBFGS needs a closure at every step"):
        hpx.Forks(model, torch.optim.LBFGS(model.parameters()), total_steps=20, probe=PROBE)
    # a model that cannot be deep-copied: the error says what Forks copies and what to do
    model.lock = threading.Lock()
    with pytest.raises(hpx.ConfigError, match=r"copy.deepcopy failed \(TypeError: cannot pickle"):
        hpx.Forks(model, opt, total_steps=20, probe=PROBE)
    del model.lock
    # a metric-driven schedule cannot be stepped per fork: refused before anything trains
    before = [p.detach().clone() for p in model.parameters()]
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt)
    with pytest.raises(hpx.ConfigError, match="ReduceLROnPlateau steps on a metric"):
        hpx.Forks(model, opt, total_steps=20, probe=PROBE, schedule=plateau)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert opt.param_groups[0]["lr"] == 0.1


def _ranks(rank: int, world: int) -> dict:
    """Each rank trains on its half of every batch; every fork is data-parallel over the ranks."""
    model = _net(p=0.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    if rank == 1:  # rank 0's weights are broadcast at the start
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
    forks = hpx.Forks(model, opt, total_steps=20, probe=PROBE, backend=TorchDistributed())
    for b in BATCHES[:20]:
        forks.step(_loss, tuple(t.chunk(world)[rank] for t in b))
    return {"params": [p.detach().clone() for p in model.parameters()], "factor": forks.factor,
            "history": [(r.step, r.values, r.scores) for r in forks.history]}


@pytest.mark.procs
def test_forks_over_two_gloo_ranks_agree_and_match_one_process():
    out = run_distributed(_ranks, 2)
    assert repr(out[0]["history"]) == repr(out[1]["history"]) and out[0]["factor"] == out[1]["factor"]
    assert all(torch.equal(a, b) for a, b in zip(out[0]["params"], out[1]["params"]))
    model = _net(p=0.0)
    forks = hpx.Forks(model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), total_steps=20,
                      probe=PROBE)
    for b in BATCHES[:20]:
        forks.step(_loss, b)
    assert [(s, v) for s, v, _ in out[0]["history"]] == [(r.step, r.values) for r in forks.history]
    assert out[0]["factor"] == forks.factor
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(out[0]["params"], model.parameters()))


def test_a_run_that_blows_up_is_no_longer_trained_and_loses_at_the_end():
    """Your run's weights go non-finite: at the cut it is kept for the end (it is yours) but no
    longer trained, its loss reads nan, and at the end the finite challenger wins and is loaded
    into your model."""
    model = _net(p=0.0)
    forks = hpx.Forks(model, torch.optim.SGD(model.parameters(), lr=1e5), total_steps=20, probe=PROBE,
                      multiples=(1e-6, 1e-5, 1.0), cuts=((0.5, 2),), cool=0.0, confidence=1e9)
    for b in BATCHES[:10]:
        forks.step(_loss, b)
    assert not math.isfinite(forks.history[0].scores[0]) and forks.factors[0] == 1.0
    calls = []
    for b in BATCHES[10:19]:
        losses = forks.step(lambda rep, b: calls.append(rep.index) or _loss(rep, b), b)
        assert math.isnan(float(losses[0])) and math.isfinite(float(losses[1]))
    assert 0 not in calls  # your blown-up run took no forward
    forks.step(_loss, BATCHES[19])
    assert forks.factor in (1e-6, 1e-5) and all(torch.isfinite(p).all() for p in model.parameters())


def _example(*launch: str, flags: tuple[str, ...] = ()) -> list[str]:
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(root)}
    cmd = [sys.executable, *launch, str(root / "examples" / "torchrun_forks.py"), "--steps", "100", *flags]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env)
    how = " ".join(launch) or "python"
    assert proc.returncode == 0, f"{how} exited {proc.returncode}:\n{proc.stderr[-3000:]}"
    return proc.stdout.strip().splitlines()


@pytest.mark.procs
@pytest.mark.slow
def test_the_torchrun_example_decides_on_two_ranks_as_in_one_process():
    """examples/torchrun_forks.py under torchrun (2 gloo ranks, each its share of every batch) prints
    the decisions of the same script in one process (rank 0 alone prints). 100 steps (its default is 600)
    are enough for the same search, a challenger winning (0.03 -> 0.3 in each)."""
    one = _example()
    two = _example("-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2")
    steps = [line.split("probe loss")[0].strip() for line in one[:-1]]
    assert steps == ["step    15  cut", "step    30  cut", "step   100  end"]  # cuts at 15% and 30%
    assert [line.split("probe loss")[0].strip() for line in two[:-1]] == steps
    assert one[-1].startswith("1 rank(s): lr 0.03 -> ") and two[-1].startswith("2 rank(s): lr 0.03 -> ")
    assert one[-1].split("-> ")[1].split(";")[0] == two[-1].split("-> ")[1].split(";")[0]
    sharded = _example("-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                       flags=("--shard",))
    assert [line.split("probe loss")[0].strip() for line in sharded[:-1]] == steps
    assert sharded[-1].split(";")[0] == two[-1].split(";")[0]  # each fork sharded: the same winner


def _dropouts(model: nn.Module) -> list[float]:
    return [m.p for m in model.modules() if isinstance(m, nn.Dropout)]


def test_a_knob_forks_at_its_spread_and_the_winner_is_plain_training_at_its_value():
    """knobs=[hpx.Dropout(spread=0.2)] from p = 0.2: forks at p = 0 and 0.4 beside your run, at your
    lr; the winner (confidence 0) is loaded into your model, its dropout rate included, and equals
    plain training at that rate from the same random stream."""
    model = _net(p=0.2)
    torch.manual_seed(11)
    forks = hpx.Forks(model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), total_steps=40,
                      probe=PROBE, multiples=(1.0,), cuts=(), confidence=0, knobs=[hpx.Dropout(spread=0.2)],
                      knob_start=0)
    assert [f.values["dropout"] for f in forks._forks] == [0.2, 0.0, pytest.approx(0.4)]
    assert [_dropouts(f.model) for f in forks._forks] == [[0.2], [0.0], [pytest.approx(0.4)]]
    for b in BATCHES[:40]:
        forks.step(_loss, b)
    end = forks.history[-1]
    assert end.values == {"lr": [1.0, 1.0, 1.0], "dropout": [0.2, 0.0, pytest.approx(0.4)]}
    best = min(range(3), key=lambda i: end.scores[i])
    p = end.values["dropout"][best]
    assert forks.bases == {"lr": 1.0, "dropout": p} and _dropouts(model) == [p]
    ref = _net(p=p)
    torch.manual_seed(11)
    _plain(ref, torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9), None, BATCHES[:40])
    assert _same(model, ref)


def test_weight_decay_and_label_smoothing_forks():
    """A geometric spread forks at base / span and base * span (the optimizer's group holds each
    fork's value); an additive one at base -+ spread, and the loss reads its value from the
    replica."""
    model = _net(p=0.0)
    seen = set()

    def smoothed(rep, b):
        seen.add(rep.value("label_smoothing"))
        return _loss(rep, b) + 0.0 * rep.value("label_smoothing")

    forks = hpx.Forks(model, torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.01),
                      total_steps=20, probe=PROBE, multiples=(1.0,), cuts=(), loss_fn=_loss,  # the probe's
                      knobs=[hpx.WeightDecay(group=0, span=10), hpx.LabelSmoothing(base=0.05, spread=0.05)],
                      knob_start=0, knob_design="each")
    wds = [f.optimizer.param_groups[0]["weight_decay"] for f in forks._forks]
    assert wds == [0.01, pytest.approx(0.001), pytest.approx(0.1), 0.01, 0.01]
    assert [f.values["label_smoothing"] for f in forks._forks] == [0.05, 0.05, 0.05, 0.0, 0.1]
    forks.step(smoothed, BATCHES[0])
    assert seen == {0.0, 0.05, 0.1}


@pytest.mark.parametrize(("p", "knob", "forks_at"), [
    (0.8, hpx.Dropout(spread=0.2), [pytest.approx(0.6)]),  # not at a chance-level 0.99 (clamped before)
    (0.0, hpx.Dropout(spread=0.2), [pytest.approx(0.2)]),  # upward only from 0
    (0.9, hpx.Dropout(spread=0.05), [pytest.approx(0.85), pytest.approx(0.95)]),  # both inside
])
def test_a_side_outside_the_knobs_bounds_is_left_out_not_moved_onto_the_bound(p, knob, forks_at):
    model = _net(p=p)
    forks = hpx.Forks(model, torch.optim.SGD(model.parameters(), lr=0.1), total_steps=20, probe=PROBE,
                      multiples=(1.0,), cuts=(), knobs=[knob], knob_start=0)
    assert [f.values["dropout"] for f in forks._forks[1:]] == forks_at


def test_a_spread_that_puts_both_sides_outside_the_bounds_is_refused_naming_them():
    model = _net(p=0.1)
    with pytest.raises(hpx.ConfigError, match=r"dropout: a spread of 5 from your value 0.1 puts both sides "
                       r"outside its bounds \[0, 0.99\].*give a smaller spread"):
        hpx.Forks(model, torch.optim.SGD(model.parameters(), lr=0.1), total_steps=20, probe=PROBE,
                  knobs=[hpx.Dropout(spread=5)])


@pytest.mark.parametrize(("knobs", "match"), [
    ([hpx.LearningRate(span=2.0)], "leave it out of knobs"),
    ([hpx.Dropout()], "has no spread"),
    ([hpx.Dropout(spread=0.1), hpx.Dropout(spread=0.2)], "used twice"),
    (hpx.Dropout(spread=0.1), "must be a list of hpx knobs"),
])
def test_knobs_forks_cannot_take_are_refused(knobs, match):
    model = _net()
    with pytest.raises(hpx.ConfigError, match=match):
        hpx.Forks(model, torch.optim.SGD(model.parameters(), lr=0.1), total_steps=20, probe=PROBE,
                  knobs=knobs)


def test_a_refused_knob_leaves_the_optimizer_as_it_was():
    """The checks that need the model (a knob with nothing to write, a cut keeping every fork) run
    before a function schedule becomes a LambdaLR on your optimizer."""
    model = nn.Linear(8, 1)  # no dropout module
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(hpx.ConfigError, match="dropout"):
        hpx.Forks(model, opt, total_steps=20, probe=PROBE, schedule=lambda t: 0.5,
                  knobs=[hpx.Dropout(spread=0.1)])
    with pytest.raises(hpx.ConfigError, match="keeps 2 of the 2 forks"):
        hpx.Forks(model, opt, total_steps=20, probe=PROBE, schedule=lambda t: 0.5, multiples=(1.0, 2.0),
                  cuts=((0.5, 2),))
    assert opt.param_groups[0]["lr"] == 0.1 and "initial_lr" not in opt.param_groups[0]


def _resumable(total: int = STEPS):
    model = _net()
    opt, sched = _adamw_onecycle(model, 0.01)
    return model, hpx.Forks(model, opt, total_steps=total, schedule=sched, probe=PROBE,
                            knobs=[hpx.Dropout(spread=0.1)])


def test_save_and_load_checkpoint_resume_forks_bit_for_bit(tmp_path):
    """hpx.save_checkpoint every 5 steps; the process "dies" after step 13 (a cut's copies were in
    flight at the save of step 10... and at 5); a fresh Forks loads the newest checkpoint with the
    random streams and ends exactly as the uninterrupted run."""
    torch.manual_seed(5)
    model, forks = _resumable()
    for t, b in enumerate(BATCHES[:STEPS], 1):
        forks.step(_loss, b)
        if t % 5 == 0 and t <= 10:
            assert hpx.save_checkpoint(tmp_path, forks) is not None
    torch.manual_seed(123)  # the new process's own stream: the checkpoint's replaces it
    model2, forks2 = _resumable()
    assert hpx.load_checkpoint(tmp_path, forks2) == 10
    assert forks2.step_count == 10
    for b in BATCHES[10:STEPS]:
        forks2.step(_loss, b)
    assert _same(model, model2) and forks.bases == forks2.bases
    assert repr([r.scores for r in forks.history]) == repr([r.scores for r in forks2.history])


def test_a_blown_up_challenger_is_saved_and_a_refused_load_changes_nothing(tmp_path):
    model = _net(p=0.0)
    forks = hpx.Forks(model, torch.optim.SGD(model.parameters(), lr=0.05), total_steps=20, probe=PROBE,
                      multiples=(1.0, 1e30), cuts=())
    for b in BATCHES[:5]:
        forks.step(_loss, b)
    assert not all(torch.isfinite(p).all() for p in forks._forks[1].model.parameters())
    assert hpx.save_checkpoint(tmp_path, forks) is not None  # the search's state, as it is
    other_model = _net(seed=1, p=0.0)
    before = copy.deepcopy(other_model.state_dict())
    other = hpx.Forks(other_model, torch.optim.SGD(other_model.parameters(), lr=0.05), total_steps=20,
                      probe=PROBE, multiples=(1.0, 3.0), cuts=())
    with pytest.raises(hpx.ConfigError, match=r"multiples=\(1.0, 1e\+30\) \(this run has \(1.0, 3.0\)\)"):
        hpx.load_checkpoint(tmp_path, other)
    with pytest.raises(hpx.ConfigError, match="elastic=False"):
        hpx.load_checkpoint(tmp_path, other, elastic=True)
    assert _same_state(before, other_model.state_dict()) and other.step_count == 0


def _same_state(a: dict, b: dict) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.values(), b.values()))


def test_a_state_of_another_architecture_is_refused_before_anything_changes():
    model = _net()
    forks = hpx.Forks(model, torch.optim.SGD(model.parameters(), lr=0.05), total_steps=20, probe=PROBE)
    state = copy.deepcopy(forks.state_dict())
    wide = nn.Sequential(nn.Linear(8, 64), nn.Tanh(), nn.Dropout(0.2), nn.Linear(64, 1))
    other = hpx.Forks(wide, torch.optim.SGD(wide.parameters(), lr=0.05), total_steps=20, probe=PROBE)
    before = copy.deepcopy(wide.state_dict())
    with pytest.raises(hpx.ConfigError, match="another model"):
        other.load_state_dict(state)
    assert _same_state(before, wide.state_dict())


def _ranks_resume(rank: int, world: int, folder: str) -> bool:
    """2 ranks save with hpx.save_checkpoint at step 10, then fresh Forks on both load it and
    finish: the same weights as the uninterrupted run."""
    def build():
        model = _net(p=0.0)
        return model, hpx.Forks(model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                total_steps=20, probe=PROBE, backend=TorchDistributed())

    def shard(b):
        return tuple(t.chunk(world)[rank] for t in b)

    model, forks = build()
    for t, b in enumerate(BATCHES[:20], 1):
        forks.step(_loss, shard(b))
        if t == 10:
            hpx.save_checkpoint(folder, forks)
    model2, forks2 = build()
    assert hpx.load_checkpoint(folder, forks2) == 10
    for b in BATCHES[10:20]:
        forks2.step(_loss, shard(b))
    return _same(model, model2) and forks.bases == forks2.bases


@pytest.mark.procs
def test_forks_resume_from_a_checkpoint_on_two_gloo_ranks(tmp_path):
    assert run_distributed(_ranks_resume, 2, str(tmp_path)) == [True, True]
    model = _net(p=0.0)  # in one process it is refused with the fix Forks takes (not elastic=True)
    forks = hpx.Forks(model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), total_steps=20,
                      probe=PROBE)
    with pytest.raises(hpx.ConfigError, match="resume with the saved run's process count") as e:
        hpx.load_checkpoint(str(tmp_path), forks)
    assert "elastic" not in str(e.value)


def test_a_shuffled_probe_loader_keeps_the_losses_paired():
    """The probe as a shuffled DataLoader: each decision reads it once and scores every fork on each
    batch, so the paired test sees the same pairs as with a fixed list (the same gain)."""
    dataset = torch.utils.data.TensorDataset(X[384:512], Y[384:512])
    shuffled = torch.utils.data.DataLoader(dataset, batch_size=16, shuffle=True,  # a new order per pass
                                           generator=torch.Generator().manual_seed(0))
    gains = [_end_test(probe, _per_example) for probe in (PROBE, shuffled)]
    assert gains[0][0] == pytest.approx(gains[1][0], rel=1e-5)
    assert gains[0][1] == pytest.approx(gains[1][1], rel=1e-5)


def test_a_batchnorm_winner_brings_its_running_statistics_and_adams_step():
    """The winner's buffers (BatchNorm's running statistics and num_batches_tracked) and its Adam
    state (the step count included) are what your model and optimizer hold after the end."""
    def bn_net():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(8, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 1))

    model = bn_net()
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    forks = hpx.Forks(model, opt, total_steps=30, probe=PROBE, multiples=(1.0, 100.0), cuts=(), confidence=0)
    for b in BATCHES[:30]:
        forks.step(_loss, b)
    assert forks.factor == 100.0  # Adam at 1e-4 is too slow for 30 steps here: the faster fork wins
    ref = bn_net()
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-4 * 100.0)
    _plain(ref, ref_opt, None, BATCHES[:30])
    assert _same(model, ref) and int(model[1].num_batches_tracked) == 30
    got, want = opt.state_dict()["state"], ref_opt.state_dict()["state"]
    assert all(torch.equal(got[k]["step"], want[k]["step"])
               and torch.equal(got[k]["exp_avg_sq"], want[k]["exp_avg_sq"]) for k in want)


def test_a_submodule_you_put_in_eval_mode_stays_there_and_is_trained_as_plain_training_trains_it():
    """Fine-tuning with frozen BatchNorm statistics: the model trains, one BatchNorm is put in eval
    mode. Scoring the probe (eval mode for all) must give every module its own mode back, so the
    frozen statistics never move and your kept run is plain training bit for bit."""
    def net():
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(8, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 1))
        m.train()
        m[1].eval()
        return m

    model = net()
    frozen = model[1].running_mean.clone()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    forks = hpx.Forks(model, opt, total_steps=20, probe=PROBE, confidence=1e9)
    for b in BATCHES[:20]:
        forks.step(_loss, b)
    assert model.training and not model[1].training
    assert torch.equal(model[1].running_mean, frozen)
    ref = net()
    _plain(ref, torch.optim.SGD(ref.parameters(), lr=0.01, momentum=0.9), None, BATCHES[:20])
    assert _same(model, ref)


def test_a_model_that_keeps_a_tensor_of_the_graph_is_forked_and_cut_as_any_other():
    """A forward that keeps its output on the model (``self.last = out``, as attention maps are
    kept) leaves a tensor of the autograd graph there, which copy.deepcopy refuses; the cuts copy
    every fork mid-run, so the copy takes it detached, and the kept run is plain training."""
    class Keeps(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.body = _net(p=0.0)
            self.last: list[torch.Tensor] = []

        def forward(self, x):
            out = self.body(x)
            self.last = [out]
            return out

    model = Keeps()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    forks = hpx.Forks(model, opt, total_steps=STEPS, probe=PROBE, confidence=1e9)
    for b in BATCHES[:STEPS]:
        forks.step(_loss, b)
    assert [r.phase for r in forks.history] == ["cut", "cut", "end"]
    ref = Keeps()
    _plain(ref, torch.optim.SGD(ref.parameters(), lr=0.01, momentum=0.9), None, BATCHES[:STEPS])
    assert _same(model, ref)


@pytest.mark.parametrize("steps", [4, 6, 10])
def test_a_short_run_makes_both_cuts_one_after_the_other(steps):
    """On a run of a few steps the cuts' steps and their annealed copies' decisions coincide: the
    first cut is decided before the second starts (the second's copies replaced the first's
    before), so 5 forks are cut to 3 and then to 2."""
    forks = hpx.Forks(_net(), lambda m: torch.optim.SGD(m.parameters(), lr=0.01), total_steps=steps,
                      probe=PROBE)
    for b in BATCHES[:steps]:
        forks.step(_loss, b)
    assert [(r.phase, len(r.scores)) for r in forks.history] == [("cut", 5), ("cut", 3), ("end", 2)]


def test_a_callback_that_raises_finds_the_cut_and_the_end_made():
    """on_sync callbacks run once a decision is applied: one that raises leaves the run as the
    decision left it (it left a cut recorded but not made, every fork still training)."""
    def boom(rec):
        raise RuntimeError(f"callback at {rec.phase}")

    model = _net()
    forks = hpx.Forks(model, torch.optim.SGD(model.parameters(), lr=0.01), total_steps=STEPS, probe=PROBE,
                      on_sync=boom)
    phases = []
    for b in BATCHES[:STEPS]:
        try:
            forks.step(_loss, b)
        except RuntimeError as e:
            phases.append((str(e), len(forks.factors)))
    assert phases == [("callback at cut", 3), ("callback at cut", 2), ("callback at end", 1)]
    assert forks.decided and len(forks.history) == 3
    assert forks.converge() is model and len(forks.history) == 3


def _sequential(opt):
    return torch.optim.lr_scheduler.SequentialLR(
        opt, [torch.optim.lr_scheduler.LinearLR(opt, 0.25, total_iters=5),
              torch.optim.lr_scheduler.LambdaLR(opt, lambda t: 1 - t / 40)], milestones=[5])


@pytest.mark.parametrize("lr, make", [  # the scheduler of plain training at lr multiple m
    (0.01, lambda opt, m: torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.01 * m, total_steps=40)),
    (0.01, lambda opt, m: torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=40, eta_min=1e-3 * m)),
    (0.01, lambda opt, m: _sequential(opt)),
    (0.001, lambda opt, m: None),
], ids=["onecycle", "cosine-eta-min", "sequential", "constant"])
def test_a_winner_goes_on_without_hpx_as_plain_training_at_its_multiple(lr, make):
    """After the end your optimizer and scheduler hold the winner's learning rates, not your run's:
    training on with them alone (a longer schedule, a framework resuming the saved state) is plain
    training at the winner's multiple, step for step (they held 1x and trained on at it before)."""
    model = _net(p=0.0)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    sched = make(opt, 1)
    forks = hpx.Forks(model, opt, total_steps=20, schedule=sched, probe=PROBE, multiples=(1.0, 16.0),
                      cuts=(), confidence=0)
    for b in BATCHES[:20]:
        forks.step(_loss, b)
    assert forks.factor == 16.0
    _plain(model, opt, sched, BATCHES[20:40])  # on alone

    ref = _net(p=0.0)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=16 * lr)
    _plain(ref, ref_opt, make(ref_opt, 16), BATCHES[:40])
    assert opt.param_groups[0]["lr"] == ref_opt.param_groups[0]["lr"]
    assert _same(model, ref)


@pytest.mark.parametrize("make, words", [
    (lambda m: (torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9), None),
     "optimizer is torch.optim.adamw.AdamW, this one's torch.optim.sgd.SGD"),
    (lambda m: (torch.optim.Adam(m.parameters(), lr=0.01), None), "this one's torch.optim.adam.Adam"),
    (lambda m: (torch.optim.AdamW(m.parameters(), lr=0.01), None),
     "scheduler is torch.optim.lr_scheduler.LambdaLR, this one's none"),
], ids=["sgd", "adam", "no-schedule"])
def test_a_state_of_another_optimizer_or_schedule_is_refused_and_changes_nothing(make, words):
    """Saved with AdamW and a schedule; loaded into a Forks on SGD (torch's SGD then failed at the next
    step, after the load), on Adam (AdamW's groups went into Adam silently) or without a schedule
    (the run went on at a constant lr)."""
    model = _net()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    forks = hpx.Forks(model, opt, total_steps=20, probe=PROBE, schedule=lambda t: 1 - t / 20)
    for b in BATCHES[:5]:
        forks.step(_loss, b)
    state = copy.deepcopy(forks.state_dict())
    other_model = _net(seed=1)
    other_opt, sched = make(other_model)
    other = hpx.Forks(other_model, other_opt, total_steps=20, probe=PROBE, schedule=sched)
    before = copy.deepcopy((other_model.state_dict(), other_opt.state_dict()))
    with pytest.raises(hpx.ConfigError, match=words):
        other.load_state_dict(state)
    assert all(torch.equal(a, b) for a, b in zip(before[0].values(), other_model.state_dict().values()))
    assert other_opt.state_dict() == before[1] and other.step_count == 0


def test_a_loss_fn_that_trains_your_model_instead_of_the_fork_it_is_given_is_refused_at_the_first_step():
    """``lambda rep, b: loss(model(b[0]), ...)`` (your model object, not ``rep.model``) trained your
    run at 5x its gradient and no fork at all, without a word. Refused at the first backward, your
    model's gradients cleared and its weights untouched."""
    model = _net(p=0.0)
    before = copy.deepcopy(model.state_dict())
    forks = hpx.Forks(model, torch.optim.SGD(model.parameters(), lr=0.01), total_steps=20, probe=PROBE)
    with pytest.raises(hpx.ConfigError, match=r"rep\.model\(batch\[0\]\)"):
        forks.step(lambda rep, b: F.mse_loss(model(b[0]).squeeze(-1), b[1]), BATCHES[0])
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(a, b) for a, b in zip(before.values(), model.state_dict().values()))
    forks.step(_loss, BATCHES[0])  # fixed, the run goes on from its first step
    assert forks.step_count == 1


def test_a_refused_first_step_binds_no_probe_loss():
    """The probe's loss defaults to the first step's loss_fn, bound only once a step succeeds: after
    the refused slip above, the slip's loss (your model object) scored every fork alike, every
    decision a tie, and the run ended at 1x where a fresh object ends elsewhere."""
    def run(slip: bool) -> hpx.Forks:
        model = _net(p=0.0)
        opt = torch.optim.SGD(model.parameters(), lr=0.0005, momentum=0.9)  # far too low
        forks = hpx.Forks(model, opt, total_steps=STEPS, probe=PROBE, confidence=0)
        if slip:
            with pytest.raises(hpx.ConfigError, match=r"rep\.model\(batch\[0\]\)"):
                forks.step(lambda rep, b: F.mse_loss(model(b[0]).squeeze(-1), b[1]), BATCHES[0])
        for b in BATCHES[:STEPS]:
            forks.step(_loss, b)
        return forks

    fresh, slipped = run(False), run(True)
    assert fresh.factor != 1.0 and slipped.factor == fresh.factor
    assert [r.scores for r in slipped.history] == [r.scores for r in fresh.history]
    assert len(set(slipped.history[0].scores)) > 1  # not a tie


def test_a_backward_that_fails_leaves_no_gradient_behind():
    """A loss that raises for one fork (an out-of-memory error you catch to skip the batch): the forks
    that took the batch's backward before it must not carry its gradient into the next step, so
    your run is plain training that skipped the batch. A loop that skips batches calls backward()
    then optimizer_step(), which step no fork before every backward is done; forks.step() steps each
    fork after its own backward, so there a failure after a fork stepped stops the run
    (tests/test_forks_early_step.py)."""
    calls = {"n": 0}

    def flaky(rep, b):
        calls["n"] += 1
        if calls["n"] == 8:  # step 2, the third fork
            raise RuntimeError("out of memory")
        return _loss(rep, b)

    model = _net(p=0.0)
    forks = hpx.Forks(model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9), total_steps=20,
                      probe=PROBE, loss_fn=_loss, confidence=1e9)
    for i, b in enumerate(BATCHES[:20]):
        try:
            forks.backward(flaky, b)
        except RuntimeError:
            assert i == 1
            continue
        forks.optimizer_step()
    ref = _net(p=0.0)
    _plain(ref, torch.optim.SGD(ref.parameters(), lr=0.01, momentum=0.9), None, BATCHES[:1] + BATCHES[2:20])
    assert forks.step_count == 19 and _same(model, ref)


def test_stepping_your_scheduler_yourself_is_refused_naming_the_fix():
    """hpx steps every fork's scheduler; a loop that also calls scheduler.step() gave your run a
    schedule twice as fast as its challengers', silently."""
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda t: 1 - t / 20)
    forks = hpx.Forks(model, opt, total_steps=20, schedule=sched, probe=PROBE)
    forks.step(_loss, BATCHES[0])
    sched.step()
    with pytest.raises(hpx.ConfigError, match=r"at step 2, the forks' copies of it at 1: .*remove sched"):
        forks.step(_loss, BATCHES[1])  # refused at the step's start, before anything changes
    assert forks.step_count == 1


def test_a_probe_whose_loss_is_nan_at_the_start_is_refused_before_anything_trains():
    model = _net()
    before = copy.deepcopy(model.state_dict())
    bad = [(PROBE[0][0], torch.full_like(PROBE[0][1], math.nan))]
    forks = hpx.Forks(model, torch.optim.SGD(model.parameters(), lr=0.01), total_steps=20, probe=bad)
    with pytest.raises(hpx.ConfigError, match="initial weights is nan: check the probe"):
        forks.step(_loss, BATCHES[0])
    assert all(torch.equal(a, b) for a, b in zip(before.values(), model.state_dict().values()))


@pytest.mark.parametrize("given", [False, True])
def test_a_loss_that_returns_a_float_is_named_as_the_function_it_came_from(given):
    """A loss that returns ``.item()``: with no probe loss_fn= the step's loss scores the probe, and the
    error named "the probe's loss_fn", which the user never gave; it names the step's loss, or the
    probe's when one was given. Nothing trains."""
    def floating(rep, b):
        return _loss(rep, b).item()

    model = _net()
    before = copy.deepcopy(model.state_dict())
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    forks = hpx.Forks(model, opt, total_steps=20, probe=PROBE, **({"loss_fn": floating} if given else {}))
    named = r"the probe's loss_fn \(the loss_fn= you gave" if given else r"the loss_fn given to forks\.step"
    with pytest.raises(TypeError, match=named + r".* must return a tensor.*not \.item\(\)"):
        forks.step(_loss if given else floating, BATCHES[0])
    assert forks.step_count == 0
    assert all(torch.equal(a, b) for a, b in zip(before.values(), model.state_dict().values()))


def test_a_probe_the_loss_fails_on_is_refused_naming_the_probe_batch_and_nothing_trains():
    """A probe label out of range raised a bare IndexError from the first step, naming nothing."""
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))
    before = copy.deepcopy(model.state_dict())
    xs = [(X[i:i + 16], torch.randint(0, 3, (16,))) for i in range(0, 64, 16)]
    probe = [(X[384:400], torch.full((16,), 7))]  # 3 classes: label 7 is out of range

    def ce(rep, b):
        return F.cross_entropy(rep.model(b[0]), b[1], reduction="none")

    forks = hpx.Forks(model, torch.optim.SGD(model.parameters(), lr=0.01), total_steps=4, probe=probe,
                      loss_fn=ce)
    with pytest.raises(hpx.ConfigError, match=r"the probe's loss_fn .* failed on probe batch 0 before "
                       r"anything trained \(IndexError: Target 7 is out of bounds.*labels in range"):
        forks.step(ce, xs[0])
    assert forks.step_count == 0
    assert all(torch.equal(a, b) for a, b in zip(before.values(), model.state_dict().values()))


def test_converge_before_any_step_keeps_your_run():
    """Nothing trained and no loss_fn= to score with: your run is kept (it raised an AssertionError)."""
    model = _net()
    forks = hpx.Forks(model, torch.optim.SGD(model.parameters(), lr=0.01), total_steps=20, probe=PROBE)
    assert forks.converge() is model and forks.decided and forks.factor == 1.0
    assert forks.converge() is model


def _ranks_disagree(rank, world, what):
    model = _net(p=0.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    steps = 20 + 4 * rank if what == "settings" else 20
    probe = PROBE[rank:rank + 1] if what == "probe" else PROBE  # a validation set sharded over the ranks
    try:
        forks = hpx.Forks(model, opt, total_steps=steps, probe=probe, backend=TorchDistributed())
        forks.step(_loss, BATCHES[0])
    except hpx.ConsistencyError as e:
        return str(e)
    return None


def _every_disagreement(rank: int, world: int) -> dict:
    """Each case in turn in one launch (starting the processes costs more than a case)."""
    return {what: _ranks_disagree(rank, world, what) for what in ("settings", "probe")}


@pytest.fixture(scope="module")
def disagreements() -> list[dict]:
    return run_distributed(_every_disagreement, 2)


@pytest.mark.procs
@pytest.mark.parametrize("what, words", [("settings", "Forks settings"), ("probe", "same probe batches")])
def test_ranks_that_disagree_on_settings_or_probe_all_raise_naming_it(disagreements, what, words):
    """total_steps that differ between ranks aborted inside gloo (mismatched message sizes); a probe
    sharded over the ranks was used silently, rank 0's deciding. Both raise on every rank now."""
    out = [r[what] for r in disagreements]
    assert all(msg is not None and words in msg for msg in out)


def test_a_finished_run_extended_is_refused_with_how_to_train_on():
    """A checkpoint of a run that has ended, loaded into a longer one: the search cannot be
    stretched; the message says so, and how to train on (the saved objects hold the winner)."""
    model = _net()
    forks = hpx.Forks(model, torch.optim.SGD(model.parameters(), lr=0.05), total_steps=20, probe=PROBE)
    for b in BATCHES[:20]:
        forks.step(_loss, b)
    longer = hpx.Forks(_net(), lambda m: torch.optim.SGD(m.parameters(), lr=0.05), total_steps=30,
                       probe=PROBE)
    with pytest.raises(hpx.ConfigError, match="ended at step 20, decided: to train on past its end, load"):
        longer.load_state_dict(forks.state_dict())


def test_a_forks_loss_errors_name_the_fork_and_the_fix():
    """A training loss without a graph names the fork (not 'replica 0', an engine's word); a probe
    loss returned as a Python number says to return the tensor."""
    model = _net()
    forks = hpx.Forks(model, torch.optim.SGD(model.parameters(), lr=0.01), total_steps=20, probe=PROBE)
    with pytest.raises(hpx.ConfigError, match="the loss of the fork at 1x does not require grad"):
        forks.step(lambda rep, b: _loss(rep, b).detach(), BATCHES[0])
    other = hpx.Forks(_net(), lambda m: torch.optim.SGD(m.parameters(), lr=0.01), total_steps=20, probe=PROBE,
                      loss_fn=lambda rep, b: float(_loss(rep, b)))
    with pytest.raises(TypeError, match=r"must return a tensor: .* return the loss tensor, not .item"):
        other.step(_loss, BATCHES[0])


def test_a_weight_decay_knob_on_a_group_without_decay_forks_upward_and_the_engine_names_the_group():
    """The usual groups (no decay on biases first): WeightDecay reads group 0's 0, which Forks
    explores upward (AdamW: to 0.01) and the engine, which spreads by ratios, refuses naming the group
    that decays."""
    model = _net()
    groups = [{"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0},
              {"params": [p for p in model.parameters() if p.dim() >= 2], "weight_decay": 0.01}]
    opt = torch.optim.AdamW(groups, lr=0.01)
    forks = hpx.Forks(model, opt, total_steps=20, probe=PROBE, multiples=(1.0,), cuts=(),
                      knobs=[hpx.WeightDecay(span=10)], knob_start=0)
    assert [f.optimizer.param_groups[0]["weight_decay"] for f in forks._forks] == [0.0, 0.01]
    forks = hpx.Forks(model, opt, total_steps=20, probe=PROBE, knobs=[hpx.WeightDecay(span=10, group=1)],
                      knob_start=0)
    assert forks.bases["weight_decay"] == 0.01
    with pytest.raises(hpx.ConfigError, match=r"weight_decay=0.0 from parameter group 0 .*give group=1"):
        hpx.Engine(_net(), lambda m: torch.optim.AdamW([
            {"params": [p for p in m.parameters() if p.dim() < 2], "weight_decay": 0.0},
            {"params": [p for p in m.parameters() if p.dim() >= 2], "weight_decay": 0.01}], lr=0.01),
            [hpx.WeightDecay(span=10)], replicas=2)


class _Stateful(nn.Module):
    """Truncated backpropagation through time: the hidden state is carried from batch to batch on the
    model (``self.h``), as a plain attribute or a buffer."""

    def __init__(self, buffer: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.rnn, self.out = nn.GRU(1, 8, batch_first=True), nn.Linear(8, 1)
        if buffer:
            self.register_buffer("h", None)
        else:
            self.h = None

    def forward(self, x):
        y, h = self.rnn(x.unsqueeze(-1), self.h)
        self.h = h.detach()
        return self.out(y[:, -1])


@pytest.mark.parametrize("buffer", [False, True], ids=["attribute", "buffer"])
def test_scoring_the_probe_leaves_no_trace_on_a_model_that_keeps_state(buffer):
    """The probe is scored on your model before the first step and at the end: a hidden state its
    forward keeps was left there (the probe's, of another batch size: the next step failed; or the
    next batch started from it, so your kept run was not plain training)."""
    def probe_loss(rep, b):  # the probe is another stream: it starts from no state
        rep.model.h = None
        return _per_example(rep, b)

    model = _Stateful(buffer)
    forks = hpx.Forks(model, torch.optim.SGD(model.parameters(), lr=0.01), total_steps=20, probe=PROBE,
                      loss_fn=probe_loss, confidence=1e9)
    for b in BATCHES[:20]:
        forks.step(_loss, b)
    ref = _Stateful(buffer)
    _plain(ref, torch.optim.SGD(ref.parameters(), lr=0.01), None, BATCHES[:20])
    assert _same(model, ref) and torch.equal(model.h, ref.h)


def test_every_run_trained_at_a_step_has_its_own_index():
    """rep.index tells the runs trained at a step apart (a cut's annealed copies were numbered after
    the forks left, so a copy shared its index with a surviving fork)."""
    forks = hpx.Forks(_net(), lambda m: torch.optim.SGD(m.parameters(), lr=0.01), total_steps=STEPS,
                      probe=PROBE, loss_fn=_loss)
    seen: list[list[int]] = []
    for b in BATCHES[:STEPS]:
        seen.append([])
        forks.step(lambda rep, b: seen[-1].append(rep.index) or _loss(rep, b), b)
    assert all(len(set(s)) == len(s) for s in seen) and max(len(s) for s in seen) == 9  # 5 forks, 4 copies


def test_a_loss_fn_that_changes_the_batch_is_refused_at_the_first_step():
    """Every fork is given the same batch: a loss that scales the inputs in place gave each later
    fork other data; one that pops the labels made the next fork fail with a bare KeyError."""
    model = _net(p=0.0)
    forks = hpx.Forks(model, torch.optim.SGD(model.parameters(), lr=0.01), total_steps=20, probe=PROBE,
                      loss_fn=_loss)
    x, y = BATCHES[0]
    with pytest.raises(hpx.ConfigError, match=r"changed the batch it was given.*compute on copies"):
        forks.step(lambda rep, b: F.mse_loss(rep.model(b[0].mul_(1.0)).squeeze(-1), b[1]), (x.clone(), y))

    def pops(rep, b):
        return F.mse_loss(rep.model(b["x"]).squeeze(-1), b.pop("y"))

    with pytest.raises(hpx.ConfigError, match=r"batch\.pop\('labels'\)"):
        forks.step(pops, {"x": x, "y": y})
    assert _same(model, _net(p=0.0)) and forks.step_count == 0


def test_a_probe_mean_the_end_could_not_take_apart_is_refused_before_the_first_step():
    """The end's test scores a mean probe loss one example at a time; a loss that cannot be taken
    apart so failed at the run's last step (a .squeeze() dropping the batch dimension) or split it
    wrongly (text kept as a list of strings), after the whole run."""
    model = _net(p=0.0)

    def squeezed(rep, b):  # a binary classifier's usual loss
        return F.binary_cross_entropy_with_logits(rep.model(b[0]).squeeze(), (b[1] > 0).float())

    forks = hpx.Forks(model, torch.optim.SGD(model.parameters(), lr=0.01), total_steps=20, probe=PROBE,
                      loss_fn=squeezed)
    with pytest.raises(hpx.ConfigError, match=r"fails on one example of a probe batch.*reduction='none'"):
        forks.step(_loss, BATCHES[0])
    texts = [{"x": x, "y": y, "text": ["row"] * len(y)} for x, y in PROBE]
    forks = hpx.Forks(_net(), lambda m: torch.optim.SGD(m.parameters(), lr=0.01), total_steps=20, probe=texts,
                      loss_fn=lambda rep, b: F.mse_loss(rep.model(b["x"]).squeeze(-1), b["y"]))
    with pytest.raises(hpx.ConfigError, match=r"batch\['text'\]\[0\] of a probe batch is not a tensor"):
        forks.step(_loss, BATCHES[0])


@pytest.mark.parametrize("kwargs, words", [
    ({"steps": 20}, r"total_steps must be an integer .*unknown setting 'steps': did you mean total_steps=\?"),
    ({"total_steps": 20, "confidense": 3}, r"unknown setting 'confidense': did you mean confidence=\?"),
    ({"total_steps": 20, "foo": 1}, r"unknown setting 'foo' \(it takes model, optimizer, total_steps"),
])
def test_a_misspelt_setting_names_the_one_meant(kwargs, words):
    """Python's 'unexpected keyword argument' (or a missing total_steps) named no setting to use."""
    with pytest.raises(hpx.ConfigError, match=words):
        hpx.Forks(_net(), lambda m: torch.optim.SGD(m.parameters(), lr=0.01), probe=PROBE, **kwargs)


@pytest.mark.parametrize("from_step", [1, STEPS - 1])
def test_a_probe_loss_that_is_nan_for_your_finite_run_is_an_error_not_a_win_for_a_challenger(from_step):
    """Your run's probe loss nan at the end (its weights finite): a challenger used to replace it,
    logged at INFO only. Now it is said to be the probe's loss, at the cut or the end where it shows."""
    broken = {"on": False}

    def probe_loss(rep, b):
        out = _per_example(rep, b)
        return out * math.nan if broken["on"] and rep.value("lr") == 1.0 else out

    model = _net(p=0.0)
    forks = hpx.Forks(model, torch.optim.SGD(model.parameters(), lr=0.01), total_steps=STEPS, probe=PROBE,
                      loss_fn=probe_loss)
    with pytest.raises(hpx.NonFiniteError, match=r"at step \d+ the probe's loss_fn gave your run a "
                                                 r"non-finite loss while its weights are finite"):
        for i, b in enumerate(BATCHES[:STEPS]):
            broken["on"] = i >= from_step
            forks.step(_loss, b)
    assert forks.factor == 1.0 and all(torch.isfinite(p).all() for p in model.parameters())


def test_a_nan_batch_stops_the_run_the_next_step_naming_the_step():
    """A batch holding NaN at step 21 of 60: every fork's loss is NaN there. It went on for 40 steps
    without a word; it is now an error at the next step's start, before anything else changes."""
    model = _net(p=0.0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-3, total_steps=60)
    forks = hpx.Forks(model, opt, total_steps=60, schedule=sched, probe=PROBE)
    batches = [(b[0].clone(), b[1]) for b in BATCHES[:60]]
    batches[20][0][3, 2] = math.nan  # step 21
    with pytest.raises(hpx.NonFiniteError, match=r"at step 21 every fork's loss was non-finite.*the batch or "
                                                 r"the loss holds a NaN"):
        for b in batches:
            forks.step(_loss, b)
    assert forks.step_count == 21


def test_a_challenger_that_blows_up_is_dropped_the_next_step_and_your_run_is_plain_training():
    model = _net(p=0.0)
    forks = hpx.Forks(model, torch.optim.SGD(model.parameters(), lr=0.05), total_steps=STEPS, probe=PROBE,
                      multiples=(1.0, 3e4), cuts=(), confidence=1e9)
    for b in BATCHES[:STEPS]:
        forks.step(_loss, b)
    assert forks.factor == 1.0
    assert forks.fork_steps < 2 * STEPS - 20  # the 3e4x fork stopped training within a few steps
    ref = _net(p=0.0)
    _plain(ref, torch.optim.SGD(ref.parameters(), lr=0.05), None, BATCHES[:STEPS])
    assert _same(model, ref)


def test_the_reliability_doc_holds_the_non_finite_table_naming_these_tests():
    from pathlib import Path

    from benchmarks import reliability

    assert all(callable(globals().get(test)) for *_, test in reliability.FORKS_RUN_ROWS)
    doc = (Path(__file__).parents[1] / "docs" / "reliability.md").read_text()
    assert "\n".join(reliability.FORKS_RUN_SECTION) in doc


def _built(lr=0.01, wd=0.01, p=0.2, schedule="lambda", probe=PROBE):
    model = _net(p=p)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=wd)
    if schedule == "lambda":
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda t: 1 - t / 40)
    elif schedule == "lambda2":
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda t: 0.01 + 0 * t)
    else:
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=schedule)
    return model, hpx.Forks(model, opt, total_steps=20, schedule=sched, probe=probe)


@pytest.mark.parametrize("change, words", [
    ({"lr": 0.02}, "the schedule: saved"),  # the optimizer's lr is the schedule's to write: its base_lrs
    ({"wd": 0.1}, "the optimizer's settings: saved"),
    ({"p": 0.5}, "the dropout rates: saved [0.2], this run [0.5]"),
    ({"schedule": "lambda2"}, "the schedule: saved"),
    ({"probe": [(X[:64], Y[:64])]}, "the probe's data: saved"),
], ids=["lr", "weight-decay", "dropout", "lambda-function", "probe"])
def test_a_resume_into_a_run_built_otherwise_is_refused_naming_the_difference(change, words, tmp_path):
    """Each of these loaded silently: the saved optimizer state won over another lr or weight decay,
    the new dropout rate or LambdaLR function applied to the old run, another probe scored it."""
    _, forks = _built()
    for b in BATCHES[:5]:
        forks.step(_loss, b)
    hpx.save_checkpoint(tmp_path, forks)
    model, other = _built(**change)
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(hpx.ConfigError, match=re.escape(words) + r".*Build hpx.Forks as the saved run was"):
        hpx.load_checkpoint(tmp_path, other)
    assert other.step_count == 0 and all(torch.equal(a, b) for a, b in zip(before.values(),
                                                                            model.state_dict().values()))
    _, same = _built()
    assert hpx.load_checkpoint(tmp_path, same) == 5  # built alike: resumes


def test_a_resume_into_a_onecycle_of_another_length_is_refused(tmp_path):
    _, forks = _built(schedule=40)
    forks.step(_loss, BATCHES[0])
    hpx.save_checkpoint(tmp_path, forks)
    _, other = _built(schedule=80)
    with pytest.raises(hpx.ConfigError, match=r"the schedule: saved .*'total_steps': 40"):
        hpx.load_checkpoint(tmp_path, other)
