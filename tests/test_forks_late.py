"""Knob forks branched late from your run (``knob_start``), the joint design, and the end's test
among several finished challengers (``hpx.forks.late``)."""

from __future__ import annotations

import io
import math

import pytest
import torch
from torch import nn

import hpx
from hpx.forks.late import corrected, knob_rungs, knob_settings, split_early
from tests.test_forks import BATCHES, PROBE, _adamw_onecycle, _loss, _net, _plain, _same

pytestmark = pytest.mark.quick


def _dropouts(model: nn.Module) -> list[float]:
    return [m.p for m in model.modules() if isinstance(m, nn.Dropout)]


def test_corrected_confidence_is_bonferroni_on_the_one_sided_level():
    assert corrected(2.0, 1) == 2.0 and corrected(0.0, 5) == 0.0
    assert corrected(2.0, 3) == pytest.approx(2.428, abs=1e-3)  # 2.28% / 3 one-sided
    assert corrected(2.0, 2) < corrected(2.0, 3) < corrected(2.0, 6)


def test_joint_design_moves_every_knob_to_one_side():
    a, b = hpx.Dropout(spread=0.2, base=0.3), hpx.LabelSmoothing(spread=0.1, base=0.0)
    sides = {"dropout": [0.1, 0.5], "label_smoothing": [0.1]}
    bases = {"dropout": 0.3, "label_smoothing": 0.0}
    assert knob_settings([a, b], bases, "joint", sides) == [
        {"dropout": 0.1, "label_smoothing": 0.0}, {"dropout": 0.5, "label_smoothing": 0.1}]
    assert knob_settings([a, b], bases, "each", sides) == [
        {"dropout": 0.1, "label_smoothing": 0.0}, {"dropout": 0.5, "label_smoothing": 0.0},
        {"dropout": 0.3, "label_smoothing": 0.1}]


def test_split_design_races_each_lower_side_from_the_start_and_branches_the_upper_late():
    a, b = hpx.Dropout(spread=0.2, base=0.3), hpx.LabelSmoothing(spread=0.1, base=0.0)
    sides = {"dropout": [0.1, 0.5], "label_smoothing": [0.1]}
    bases = {"dropout": 0.3, "label_smoothing": 0.0}
    # label smoothing at its lower bound has no lower side: one early fork, for the dropout alone
    assert split_early([a, b], bases, sides) == [{"dropout": 0.1, "label_smoothing": 0.0}]
    assert knob_settings([a, b], bases, "split", sides) == [{"dropout": 0.5, "label_smoothing": 0.1}]
    assert split_early([b], {"label_smoothing": 0.0}, {"label_smoothing": [0.1]}) == []


def test_the_default_split_design_on_a_run():
    """knob_start=0.5 on 30 steps at the defaults: the lower dropout fork starts with the lr's forks
    and is scored by the first cut with them; at step 15 the upper one branches from your run, a
    copy of its weights, and it ends among the finished challengers. With knob_start=0 both sides
    start with the lr's forks."""
    model = _net(p=0.2)
    opt, sched = _adamw_onecycle(model, 0.01)
    torch.manual_seed(5)
    forks = hpx.Forks(model, opt, total_steps=30, schedule=sched, probe=PROBE, confidence=1e9,
                      knobs=[hpx.Dropout(spread=0.1)], knob_start=0.5)
    assert forks.knob_design == "split"
    assert [round(f, 3) for f in forks.factors] == [1.0, 0.1, 0.316, 3.162, 10.0, 1.0]
    assert [_dropouts(f.model) for f in forks._forks] == [[0.2]] * 5 + [[pytest.approx(0.1)]]
    for b in BATCHES[:15]:
        forks.step(_loss, b)
    first = next(r for r in forks.history if r.phase == "cut")
    assert len(first.scores) == 6 and round(first.values["dropout"][-1], 3) == 0.1  # raced with the lr's
    upper = forks._forks[-1]
    assert upper.late and _dropouts(upper.model) == [pytest.approx(0.3)] and _same(forks._forks[0].model,
                                                                                   upper.model)
    assert not any(f.late for f in forks._forks[:-1])
    for b in BATCHES[15:30]:
        forks.step(_loss, b)
    end = forks.history[-1]
    assert end.phase == "end" and round(end.values["dropout"][-1], 3) == 0.3
    assert all(math.isfinite(s) for s in end.scores)
    net = _net(p=0.2)
    at_start = hpx.Forks(net, torch.optim.SGD(net.parameters(), lr=0.05), total_steps=30, probe=PROBE,
                         knobs=[hpx.Dropout(spread=0.1)], knob_start=0)
    assert [round(_dropouts(f.model)[0], 3) for f in at_start._forks] == [0.2] * 5 + [0.1, 0.3]


def test_knob_forks_branch_from_your_run_at_knob_start_and_are_not_cut():
    """knob_start=0.5 on 30 steps, the joint design: the lr forks alone until step 15, then two
    dropout forks that hold your run's weights at step 15 with their own rates, at your multiple;
    the cuts before them (10% and 25%) leave them alone, and every fork trained after the branch
    reaches the end."""
    model = _net(p=0.2)
    opt, sched = _adamw_onecycle(model, 0.01)
    torch.manual_seed(5)
    forks = hpx.Forks(model, opt, total_steps=30, schedule=sched, probe=PROBE, confidence=1e9,
                      knobs=[hpx.Dropout(spread=0.1)], knob_start=0.5, knob_design="joint")
    for b in BATCHES[:14]:
        forks.step(_loss, b)
    assert len(forks.factors) == 2 and all(_dropouts(f.model) == [0.2] for f in forks._forks)
    forks.step(_loss, BATCHES[14])
    assert len(forks._forks) == 4
    mine, low, high = forks._forks[0], forks._forks[2], forks._forks[3]
    assert [_dropouts(low.model), _dropouts(high.model)] == [[pytest.approx(0.1)], [pytest.approx(0.3)]]
    assert low.factor == high.factor == 1.0 and _same(mine.model, low.model)
    for b in BATCHES[15:30]:
        forks.step(_loss, b)
    end = forks.history[-1]
    assert end.phase == "end" and len(end.scores) == 4 and all(math.isfinite(s) for s in end.scores)


def test_a_branched_fork_is_plain_training_that_switched_its_rate_at_the_branch():
    """The high-dropout fork (confidence 0, so the best scorer wins) equals plain training at p=0.2
    for 10 steps, then at p=0.4, from the same random stream."""
    model = _net(p=0.2)
    torch.manual_seed(11)
    forks = hpx.Forks(model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), total_steps=20,
                      probe=PROBE, multiples=(1.0,), cuts=(), confidence=0, knob_start=0.5,
                      knobs=[hpx.Dropout(spread=0.2)], knob_design="joint")
    for b in BATCHES[:20]:
        forks.step(_loss, b)
    end = forks.history[-1]
    p = end.values["dropout"][end.scores.index(min(end.scores))]
    ref = _net(p=0.2)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    torch.manual_seed(11)
    _plain(ref, ref_opt, None, BATCHES[:10])
    for m in ref.modules():
        if isinstance(m, nn.Dropout):
            m.p = p
    _plain(ref, ref_opt, None, BATCHES[10:20])
    assert forks.bases["dropout"] == p and _dropouts(model) == [p]
    assert _same(model, ref)


def test_several_finished_challengers_face_a_corrected_bar(monkeypatch):
    """The fork at 3x ranked best and a gain of 2.2 standard errors (above 2, below the 2.428 that
    three challengers must clear): with two dropout forks beside it your run is kept; alone, the
    same gain passes and the run ends at 3x."""
    import hpx.forks.decide as decide

    monkeypatch.setattr(decide, "_ranked", lambda scores, distances: [1, *range(2, len(scores)), 0])

    def run(knobs):
        model = _net(p=0.2)
        torch.manual_seed(3)
        forks = hpx.Forks(model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                          total_steps=20, probe=PROBE, multiples=(1.0, 3.0), cuts=(), knobs=knobs,
                          knob_start=0.5)
        monkeypatch.setattr(forks, "_gain", lambda *a: 2.2)
        for b in BATCHES[:20]:
            forks.step(_loss, b)
        return forks

    three, one = run([hpx.Dropout(spread=0.1)]), run([])
    assert len(three.history[-1].scores) == 4 and len(one.history[-1].scores) == 2
    assert three.bases == {"lr": 1.0, "dropout": 0.2}
    assert one.bases == {"lr": 3.0}


def _resumed(build, forks_at_20: int, before_load=None) -> bool:
    """Train ``build()``'s run 20 of 30 steps (``forks_at_20`` forks then), save it, finish it; a fresh
    ``build()`` loads the state (after ``before_load(saved_state)``) and finishes it. Whether the two
    ends are the same run bit for bit (weights and the values the run ends at)."""
    torch.manual_seed(5)
    model, forks = build()
    for b in BATCHES[:20]:
        forks.step(_loss, b)
    assert len(forks._forks) == forks_at_20
    buf = io.BytesIO()
    torch.save({"forks": forks.state_dict(), "rng": torch.random.get_rng_state()}, buf)
    for b in BATCHES[20:30]:
        forks.step(_loss, b)
    model2, forks2 = build()
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    if before_load is not None:
        before_load(saved["forks"])
    forks2.load_state_dict(saved["forks"])
    torch.random.set_rng_state(saved["rng"])
    for b in BATCHES[20:30]:
        forks2.step(_loss, b)
    return _same(model, model2) and forks.bases == forks2.bases


def test_resume_after_the_branch_is_bit_for_bit():
    def build():
        model = _net()
        opt, sched = _adamw_onecycle(model, 0.01)
        return model, hpx.Forks(model, opt, total_steps=30, schedule=sched, probe=PROBE,
                                knobs=[hpx.Dropout(spread=0.1)], knob_start=0.4, knob_design="joint")

    assert _resumed(build, 4)  # your run, the lr challenger, two dropout forks (branched at 12)


@pytest.mark.parametrize("bad", [1.0, -0.1, "half"])
def test_a_bad_knob_start_is_refused(bad):
    model = _net()
    with pytest.raises(hpx.ConfigError, match=r"knob_start must be a share of the run in \[0, 1\)"):
        hpx.Forks(model, torch.optim.SGD(model.parameters(), lr=0.05), total_steps=20, probe=PROBE,
                  knobs=[hpx.Dropout(spread=0.1)], knob_start=bad)


def test_a_bad_knob_design_is_refused():
    model = _net()
    with pytest.raises(hpx.ConfigError, match="knob_design must be one of 'each', 'joint'"):
        hpx.Forks(model, torch.optim.SGD(model.parameters(), lr=0.05), total_steps=20, probe=PROBE,
                  knobs=[hpx.Dropout(spread=0.1)], knob_design="grid")


def test_a_state_saved_with_another_knob_start_is_refused():
    def build(start, design="joint"):
        model = _net()
        return hpx.Forks(model, torch.optim.SGD(model.parameters(), lr=0.05), total_steps=20, probe=PROBE,
                         knobs=[hpx.Dropout(spread=0.1)], knob_start=start, knob_design=design)

    state = build(0.5).state_dict()
    with pytest.raises(hpx.ConfigError, match=r"knob_start=0.5 \(this run has 0.0\)"):
        build(0.0).load_state_dict(state)
    # a state saved before the settings existed was built with knob_start=0, knob_design="each"
    old = {k: v for k, v in build(0.0, "each").state_dict().items() if k not in ("knob_start", "knob_design")}
    with pytest.raises(hpx.ConfigError, match=r"knob_design='each' \(this run has 'joint'\)"):
        build(0.0).load_state_dict(old)
    build(0.0, "each").load_state_dict(old)


def test_knob_forks_branched_before_a_cut_are_kept_by_it_without_annealed_copies():
    """knob_start=0.1 on 30 steps: the dropout forks branch at step 3, and the cuts at 10% and 25%
    (decided on annealed copies of the lr challengers only) keep them; all four finish."""
    model = _net(p=0.2)
    opt, sched = _adamw_onecycle(model, 0.01)
    torch.manual_seed(5)
    forks = hpx.Forks(model, opt, total_steps=30, schedule=sched, probe=PROBE, confidence=1e9,
                      knobs=[hpx.Dropout(spread=0.1)], knob_start=0.1, knob_design="joint")
    copies = []
    for b in BATCHES[:30]:
        forks.step(_loss, b)
        copies.append(len(forks._clones))
    assert max(copies) == 4  # the first cut's: the lr challengers', none of the knob forks'
    cuts = [r for r in forks.history if r.phase == "cut"]
    assert len(cuts) == 2 and [round(v, 3) for v in cuts[-1].values["dropout"]][-2:] == [0.1, 0.3]
    end = forks.history[-1]
    assert len(end.scores) == 4
    assert sorted(round(v, 3) for v in end.values["dropout"]) == [0.1, 0.2, 0.2, 0.3]


# --- the ladder: two lower forks per knob -------------------------------------------------------


@pytest.mark.parametrize(("knob", "rungs"), [
    (hpx.Dropout(spread=0.2, base=0.5), [0.3, 0.1]),  # one and two spreads down
    (hpx.Dropout(spread=0.2, base=0.3), [0.1, 0.0]),  # the second past the bound: onto it, dropout off
    (hpx.Dropout(spread=0.2, base=0.1), [0.0]),  # both past it: onto it, one fork
    (hpx.Dropout(spread=0.2, base=0.05), []),  # 0 would move it by less than half a spread
    (hpx.Dropout(spread=0.2, base=0.0), []),  # at the bound: nothing below
    (hpx.LabelSmoothing(spread=0.1, base=0.15), [0.05, 0.0]),
    (hpx.WeightDecay(span=10, base=0.05), [0.005, 0.0005]),  # geometric: a decade, two decades
    (hpx.WeightDecay(span=10, base=0.0), []),  # a multiplicative knob at 0: upward only (from_zero)
    (hpx.WeightDecay(spread=0.5, base=0.4), [0.2, 0.1]),  # multiplicative: (1 - spread) ** r
    (hpx.Knob("t", base=0.7, spread=0.2, kind="add", bounds=(0.5, 2.0)), [0.5]),  # a bound of your own
])
def test_knob_rungs_move_one_and_two_spreads_down_and_onto_the_lower_bound(knob, rungs):
    assert knob_rungs(knob) == [pytest.approx(v) for v in rungs]


def test_the_ladder_design_races_both_rungs_from_the_start_and_branches_the_upper_late():
    """knob_design="ladder", dropout 0.3 with a spread of 0.1 on 30 steps: dropout 0.2 and 0.1 are
    raced with the lr's forks from the start and scored at the first cut; 0.4 branches from your
    run at knob_start; the winner's rate is written into your model."""
    a = hpx.Dropout(spread=0.2, base=0.3)
    assert split_early([a], {"dropout": 0.3}, {"dropout": [0.1, 0.5]}, "ladder") == [
        {"dropout": pytest.approx(0.1)}, {"dropout": 0.0}]
    assert knob_settings([a], {"dropout": 0.3}, "ladder", {"dropout": [0.1, 0.5]}) == [{"dropout": 0.5}]
    model = _net(p=0.3)
    opt, sched = _adamw_onecycle(model, 0.01)
    torch.manual_seed(5)
    forks = hpx.Forks(model, opt, total_steps=30, schedule=sched, probe=PROBE, confidence=0,
                      knobs=[hpx.Dropout(spread=0.1)], knob_start=0.5, knob_design="ladder")
    assert [_dropouts(f.model) for f in forks._forks] == [[0.3]] * 5 + [[pytest.approx(0.2)],
                                                                        [pytest.approx(0.1)]]
    for b in BATCHES[:15]:
        forks.step(_loss, b)
    first = next(r for r in forks.history if r.phase == "cut")
    assert len(first.scores) == 7 and [round(v, 3) for v in first.values["dropout"][-2:]] == [0.2, 0.1]
    assert forks._forks[-1].late and _dropouts(forks._forks[-1].model) == [pytest.approx(0.4)]
    for b in BATCHES[15:30]:
        forks.step(_loss, b)
    end = forks.history[-1]
    won = min(zip(end.scores, end.values["dropout"]))[1]  # confidence=0: the best scorer wins
    assert forks.values["dropout"] == pytest.approx(won) and _dropouts(model) == [pytest.approx(won)]


def test_a_ladder_run_resumes_bit_for_bit_and_refuses_a_split_state():
    def build(design="ladder"):
        model = _net(p=0.3)
        opt, sched = _adamw_onecycle(model, 0.01)
        return model, hpx.Forks(model, opt, total_steps=30, schedule=sched, probe=PROBE, cuts=((0.1, 4),),
                                knobs=[hpx.Dropout(spread=0.1)], knob_start=0.4, knob_design=design)

    def refused_by_split(state):
        with pytest.raises(hpx.ConfigError, match=r"knob_design='ladder' \(this run has 'split'\)"):
            build("split")[1].load_state_dict(state)

    # your run, two lr challengers, a rung, the upper fork (at 12)
    assert _resumed(build, 5, refused_by_split)
