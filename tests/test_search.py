"""Search strategies: the contract every strategy keeps, Bracket's phases, the engine applying them."""

from __future__ import annotations

import copy
import math

import pytest
import torch

import hpx
from hpx.search import HDET, Bracket, Decision, Stretch, SyncView, worst_filled
from tests._digits import ce, data, mlp

# --- views --------------------------------------------------------------------------------


LOG2 = math.log(2)


def view(scores, values=None, *, step=10, bases=(1.0,), spacing=("log",), spreads=(LOG2,),
         kinds=("mul",), explore=(True,), placement="auto", n=None) -> SyncView:
    """A view of ``scores`` (of ``n`` replicas, default one per score). ``placement``: the
    multipliers the scores were taken at (strategies other than Stretch ignore it); "auto":
    Stretch's default, geometric from 1/1.5 to 1.5."""
    scores = torch.tensor(scores, dtype=torch.float64)
    if isinstance(placement, str):
        placement = torch.exp(torch.linspace(-1.0, 1.0, scores.numel(), dtype=torch.float64)
                              * math.log(1.5)) if scores.numel() > 1 else None
    n = scores.numel() if n is None else n
    if values is None:  # each knob's values around its base, in its spacing
        u = hpx.slot_offsets(n)
        values = torch.stack([b * torch.exp(s * u) if sp == "log" else b + s * u
                              for b, s, sp in zip(bases, spreads, spacing)])
    return SyncView(step=step, n_replicas=n, names=tuple(f"k{i}" for i in range(len(bases))),
                    kinds=tuple(kinds), explore=torch.tensor(explore), spacing=tuple(spacing),
                    spreads=torch.tensor(spreads, dtype=torch.float64),
                    bases=torch.tensor(bases, dtype=torch.float64),
                    bounds=torch.tensor([[0.0, math.inf]] * len(bases), dtype=torch.float64),
                    values=torch.as_tensor(values, dtype=torch.float64), scores=scores,
                    placement=placement)


def start_view(**kw) -> SyncView:
    v = view([0.0, 0.0, 0.0, 0.0], step=0, **kw)
    return SyncView(**{**v.__dict__, "scores": torch.empty(0, dtype=torch.float64)})


STRATEGIES = {
    "hdet": lambda: HDET(),
    "hdet-paper": lambda: HDET(hpx.Controller(space="linear", temperature=0.1, debias=False)),
    "bracket": lambda: Bracket(1000, burn_in=0),
    "stretch": lambda: Stretch(1000, burn_in=0.0),
}


def follow(strategy, scores_seq, *, step0=10):
    """Feed views (bases carried over from the decisions) and return the decisions."""
    placement = strategy.start(start_view()).placement  # the engine scores the points it asks for
    bases, out = (1.0,), []
    for i, scores in enumerate(scores_seq):
        d = strategy.decide(view(scores, step=step0 + i, bases=bases, placement=placement))
        if d.bases is not None:
            bases = tuple(d.bases.tolist())
        placement = d.placement
        out.append((d, bases))
    return out


# --- the contract, for every strategy --------------------------------------------------------


@pytest.mark.parametrize("name", STRATEGIES)
def test_equal_scores_move_nothing(name):
    s = STRATEGIES[name]()
    s.start(start_view())
    d = s.decide(view([0.7, 0.7, 0.7, 0.7]))
    assert d.bases is None or d.bases.tolist() == [1.0]


@pytest.mark.parametrize("name", STRATEGIES)
@pytest.mark.parametrize("better", ["high", "low"])
def test_moves_toward_the_better_side(name, better):
    # scores fall with the value: higher is better (and the reverse)
    scores = [4.0, 3.0, 2.0, 1.0] if better == "high" else [1.0, 2.0, 3.0, 4.0]
    s = STRATEGIES[name]()
    s.start(start_view())
    d = s.decide(view(scores))
    assert d.bases is not None
    assert (d.bases.item() > 1.0) == (better == "high") and d.bases.item() != 1.0


@pytest.mark.parametrize("name", STRATEGIES)
def test_a_nonfinite_replica_counts_as_the_worst(name):
    # a replica that blew up is evidence against its value: the same decision as if it had
    # scored worse than every other (by their range), not as if it were absent
    a, b = STRATEGIES[name](), STRATEGIES[name]()
    for s in (a, b):
        s.start(start_view())
    da = a.decide(view([1.0, 2.0, 3.0, math.nan]))
    db = b.decide(view([1.0, 2.0, 3.0, 5.0]))
    assert da.bases.tolist() == db.bases.tolist()
    assert math.isfinite(da.bases.item()) and da.bases.item() < 1.0


@pytest.mark.parametrize("name", STRATEGIES)
def test_no_finite_score_moves_nothing(name):
    s = STRATEGIES[name]()
    s.start(start_view())
    d = s.decide(view([math.nan] * 4))
    assert d.bases is None or d.bases.tolist() == [1.0]


def test_worst_filled():
    t = torch.tensor
    assert worst_filled(t([1.0, 2.0, 3.0])).tolist() == [1.0, 2.0, 3.0]
    assert worst_filled(t([1.0, math.nan, 3.0, math.inf])).tolist() == [1.0, 5.0, 3.0, 5.0]
    assert worst_filled(t([-2.0, math.nan])).tolist() == [-2.0, 0.0]  # equal finite scores: by |worst|
    assert worst_filled(t([0.0, math.nan])).tolist() == [0.0, 1.0]
    assert worst_filled(t([math.nan, math.nan])) is None


@pytest.mark.parametrize("name", STRATEGIES)
def test_state_round_trip_continues_the_same_decisions(name):
    seq = [[4.0, 3.0, 2.0, 1.0], [3.0, 2.5, 2.0, 2.2], [1.0, 2.0, 3.0, 4.0], [2.0, 1.0, 1.5, 3.0]]
    full = follow(STRATEGIES[name](), seq)
    first = STRATEGIES[name]()
    part = follow(first, seq[:2])
    resumed = STRATEGIES[name]()
    resumed.start(start_view())
    resumed.load_state_dict(copy.deepcopy(first.state_dict()))
    bases = part[-1][1]
    for i, scores in enumerate(seq[2:]):
        d = resumed.decide(view(scores, step=12 + i, bases=bases))
        if d.bases is not None:
            bases = tuple(d.bases.tolist())
        assert bases == full[2 + i][1]


@pytest.mark.parametrize("name", STRATEGIES)
def test_decisions_do_not_touch_the_global_rng(name):
    torch.manual_seed(5)
    before = torch.random.get_rng_state()
    follow(STRATEGIES[name](), [[4.0, 3.0, 2.0, 1.0], [1.0, 2.0, 3.0, 4.0]])
    assert torch.equal(before, torch.random.get_rng_state())


# --- Bracket's phases ---------------------------------------------------------------------------


def test_bracket_expands_by_the_span_while_the_edge_wins_then_bisects_on_reversal():
    s = Bracket(1000, span=2.0, burn_in=0, every=50, syncs=10)
    d0 = s.start(start_view(spacing=("linear",), spreads=(0.0,)))
    assert d0.spacing == ("log",) and d0.spreads.tolist() == [pytest.approx(math.log(2))]
    assert d0.next_sync == s.every == 50
    up = [4.0, 3.0, 2.0, 1.0]
    d1 = s.decide(view(up, step=50))
    assert d1.bases.item() == pytest.approx(2.0)       # to the edge of the bracket
    d2 = s.decide(view(up, step=100, bases=(2.0,)))
    assert d2.bases.item() == pytest.approx(4.0)       # and again
    d3 = s.decide(view([1.0, 2.0, 3.0, 4.0], step=150, bases=(4.0,)))  # now lower is better
    assert d3.bases.item() == pytest.approx(4.0 / math.sqrt(2))        # midway (in log) between 2 and 4
    assert d3.info["phase"] == "bracketed" and s.done
    assert d3.spreads.tolist() == [0.0] and d3.next_sync == s.hold_every
    d4 = s.decide(view(up, step=250, bases=(d3.bases.item(),), spreads=(0.0,)))
    assert d4.bases is None and d4.info["phase"] == "hold" and not s.acts_at(250)


def test_bracket_stops_at_an_interior_minimum_when_asked():
    s = Bracket(1000, burn_in=0, interior=0.5, ranks=False)
    s.start(start_view())
    # a parabola with its minimum at z = 0.1 * log 2, well inside the bracket
    z = math.log(2) * hpx.slot_offsets(4)
    d = s.decide(view(((z - 0.1 * math.log(2)) ** 2).tolist()))
    assert d.bases.item() == pytest.approx(2 ** 0.1, rel=0.02)
    assert s.done


def test_bracket_burn_in_takes_only_downward_moves():
    s = Bracket(1000, burn_in=2)
    s.start(start_view())
    d = s.decide(view([4.0, 3.0, 2.0, 1.0], step=12))  # "higher is better": the first syncs' bias
    assert d.bases.item() == 1.0 and d.info["phase"] == "burn-in"
    d = s.decide(view([1.0, 2.0, 3.0, 40.0], step=24))  # "lower is better" despite it: act at once
    assert d.bases.item() == pytest.approx(0.5) and d.info["phase"] == "burn-in"
    d = s.decide(view([1.0, 2.0, 3.0, 4.0], step=36, bases=(0.5,)))
    assert d.bases.item() == pytest.approx(0.25) and d.info["phase"] == "bracket"


def test_bracket_fits_ranks_so_a_blown_up_replica_does_not_slow_the_retreat():
    # replica at 2x blew up; among the other three the lowest value is best
    scores = [1.0, 1.2, 1.5, 1e6]
    by_rank, by_score = Bracket(1000, burn_in=0), Bracket(1000, burn_in=0, ranks=False)
    by_rank.start(start_view())
    by_score.start(start_view())
    down_rank = by_rank.decide(view(scores)).bases.item()
    down_score = by_score.decide(view(scores)).bases.item()
    assert down_rank == pytest.approx(0.5)   # all the way to the bracket's edge
    assert down_score > 0.6                   # the outlier bends the parabola's minimum inward


def test_bracket_holds_after_its_window_whatever_the_scores():
    s = Bracket(200, every=10, syncs=2, burn_in=0)
    assert s.start(start_view()).next_sync == 10
    s.decide(view([4.0, 3.0, 2.0, 1.0], step=10))
    d = s.decide(view([4.0, 3.0, 2.0, 1.0], step=20, bases=(2.0,)))
    assert s.done and d.info["phase"] == "bracketed" and d.next_sync == s.hold_every == 18  # (200-20)/10


def test_bracket_merge_best_picks_the_best_finite_replica():
    s = Bracket(1000, burn_in=0, merge="best")
    s.start(start_view())
    d = s.decide(view([3.0, math.nan, 0.5, 1.0]))
    assert d.merge.tolist() == [0.0, 0.0, 1.0, 0.0]


def test_bracket_settings_are_checked_together():
    with pytest.raises(hpx.ConfigError) as e:
        Bracket(0, every=0, span=1.0, syncs=0, merge="vote")
    msg = str(e.value)
    for part in ("total_steps", "every", "span", "syncs", "merge"):
        assert part in msg


# --- the engine applies a strategy's decisions -------------------------------------------------


class Scripted:
    """A strategy that syncs at chosen intervals and merges on replica 2 only."""

    def __init__(self, gaps):
        self.gaps, self.i = list(gaps), 0

    def start(self, v):
        return Decision(next_sync=self.gaps[0])

    def decide(self, v):
        self.i += 1
        merge = torch.zeros(v.n_replicas, dtype=torch.float64)
        merge[2] = 1.0
        return Decision(next_sync=self.gaps[min(self.i, len(self.gaps) - 1)], merge=merge,
                        info={"phase": "scripted"})

    def acts_at(self, step):
        return True

    def state_dict(self):
        return {"i": self.i}

    def load_state_dict(self, s):
        self.i = s["i"]


def test_engine_syncs_when_the_strategy_says_and_merges_with_its_weights(digits):
    engine = hpx.Engine(mlp(), lambda m: torch.optim.SGD(m.parameters(), lr=0.1),
                        [hpx.LearningRate(span=2.0)], replicas=4, search=Scripted([3, 5, 2]))
    for b in data(digits, 12):
        engine.step(ce, b)
    assert [r.step for r in engine.history] == [3, 8, 10, 12]
    assert all(r.phase == "scripted" for r in engine.history)
    # after the last sync every replica holds replica 2's weights as they were at the sync
    p = [torch.cat([q.detach().reshape(-1) for q in r.model.parameters()]) for r in engine.replicas]
    assert all(torch.equal(p[0], q) for q in p[1:])


def test_engine_writes_geometric_values_and_drops_them_in_hold(digits):
    engine = hpx.Engine(mlp(), lambda m: torch.optim.SGD(m.parameters(), lr=0.1),
                        [hpx.LearningRate("lr")], replicas=4,
                        search=Bracket(40, every=10, syncs=2, burn_in=5, span=4.0))
    lrs = sorted(engine.values("lr"))
    assert lrs == pytest.approx([0.1 * 4 ** u for u in (-1, -1 / 3, 1 / 3, 1)])
    for b in data(digits, 21):
        engine.step(ce, b)
    assert engine.history[-1].phase == "hold"
    assert engine.values("lr") == [0.1] * 4  # burn-in never moved it; hold has no spread


def test_engine_resumes_an_autolr_run_exactly(digits):
    # mid-window: the run's starting parameters (the placement's anchor) are in the checkpoint
    batches = data(digits, 40, seed=3)
    make = lambda: hpx.autolr(mlp(1), lambda m: torch.optim.SGD(m.parameters(), lr=0.02),  # noqa: E731
                              total_steps=40, probe=data(digits, 1, seed=9), replicas=4)
    whole = make()
    for b in batches:
        whole.step(ce, b)
    first = make()
    for b in batches[:13]:
        first.step(ce, b)
    state = copy.deepcopy(first.state_dict())
    second = make()
    second.load_state_dict(state)
    for b in batches[13:]:
        second.step(ce, b)
    assert second.bases == whole.bases
    assert [r.step for r in second.history] == [r.step for r in whole.history]
    for a, b in zip(whole.replicas, second.replicas):
        for p, q in zip(a.model.parameters(), b.model.parameters()):
            assert torch.equal(p, q)


def test_engine_loads_a_format_1_checkpoint(digits):
    engine = hpx.Engine(mlp(), lambda m: torch.optim.SGD(m.parameters(), lr=0.1),
                        [hpx.LearningRate(spread=0.5)], replicas=2, sync_every=4)
    for b in data(digits, 6):
        engine.step(ce, b)
    state = engine.state_dict()
    state["format"] = 1
    state["controller"] = state.pop("search")["controller"]
    del state["next_sync"]
    other = hpx.Engine(mlp(), lambda m: torch.optim.SGD(m.parameters(), lr=0.1),
                       [hpx.LearningRate(spread=0.5)], replicas=2, sync_every=4)
    other.load_state_dict(state)
    assert other.next_sync == 8 and other.bases == engine.bases


def test_engine_rejects_an_incomplete_strategy_and_two_controllers():
    with pytest.raises(hpx.ConfigError, match="lacks start, acts_at"):
        hpx.Engine(mlp(), lambda m: torch.optim.SGD(m.parameters(), lr=0.1), [], replicas=2,
                   search=type("S", (), {"start": 1, "decide": lambda s, v: None,
                                         "state_dict": lambda s: {}, "load_state_dict": lambda s, d: None})())
    with pytest.raises(hpx.ConfigError, match="not both"):
        hpx.Engine(mlp(), lambda m: torch.optim.SGD(m.parameters(), lr=0.1), [], replicas=2,
                   search=HDET(), controller=hpx.Controller())


def test_bad_decisions_name_the_value(digits):
    class BadMerge(Scripted):
        def decide(self, v):
            return Decision(merge=torch.tensor([1.0, -1.0]))

    engine = hpx.Engine(mlp(), lambda m: torch.optim.SGD(m.parameters(), lr=0.1),
                        [hpx.LearningRate(spread=0.5)], replicas=2, search=BadMerge([2]))
    with pytest.raises(ValueError, match="merge weights"):
        for b in data(digits, 2):
            engine.step(ce, b)


def test_bracket_moves_additive_knobs_in_their_own_units_and_keeps_a_share_of_their_spread():
    s = Bracket(1000, burn_in=0, hold_spread=0.5, syncs=1, every=10)
    d0 = s.start(start_view(kinds=("add",), spacing=("linear",), spreads=(0.1,), bases=(0.3,)))
    assert d0.spacing == ("linear",) and d0.spreads.tolist() == [pytest.approx(0.1)]  # its own spread
    # dropout-like knob: the lowest value scores best
    d = s.decide(view([1.0, 2.0, 3.0, 4.0], kinds=("add",), spacing=("linear",), spreads=(0.1,),
                      bases=(0.3,), step=10))
    assert d.bases.item() == pytest.approx(0.2)          # 0.3 - alpha, in the knob's units
    assert d.info["phase"] == "bracketed" and d.spreads.tolist() == [pytest.approx(0.05)]


# --- Stretch ------------------------------------------------------------------------------------


def test_stretch_trains_at_the_base_and_places_replicas_geometrically():
    s = Stretch(1000, span=1.5)
    d = s.start(start_view())
    assert d.spreads.tolist() == [0.0] and d.next_sync == s.every == 10  # 400 steps, 40 syncs
    assert d.placement.tolist() == pytest.approx([1.5 ** u for u in (-1, -1 / 3, 1 / 3, 1)])


@pytest.mark.parametrize("better", ["shrunk", "stretched"])
def test_stretch_moves_by_the_fitted_scale_and_lands_on_the_shrunk_point_only(better):
    s = Stretch(1000, span=1.5, burn_in=0.0, dead_zone=0.0)
    rho = s.start(start_view()).placement
    z = rho.log()
    target = -0.2 if better == "shrunk" else 0.25  # scores: a parabola in log rho, minimum at target
    d = s.decide(view((z - target).pow(2).tolist(), bases=(2.0,), placement=rho))
    assert d.bases.item() == pytest.approx(2.0 * math.exp(target), rel=0.01)
    assert d.merge is None  # the consensus goes to a point on the line
    assert d.land == pytest.approx(math.exp(target) if better == "shrunk" else 1.0, rel=0.01)
    assert torch.equal(d.placement, rho)


@pytest.mark.parametrize("target", [-0.35, -0.15, 0.1, 0.3])
def test_stretch_shrinks_only_by_what_the_reading_exceeds_its_dead_zone(target):
    s = Stretch(1000, span=1.5, burn_in=0.0)  # the default dead zone, 0.2 in log rho, on shrinks
    assert s.dead_zone == 0.2
    rho = s.start(start_view()).placement
    z = rho.log()
    d = s.decide(view((z - target).pow(2).tolist(), bases=(2.0,), placement=rho))
    excess = target if target > 0 else min(target + 0.2, 0.0)  # a stretch moves by all of it
    assert d.bases.item() == pytest.approx(2.0 * math.exp(excess), rel=0.01)
    assert d.land == pytest.approx(math.exp(min(excess, 0.0)), rel=0.01)
    assert d.info["rho"] == pytest.approx(math.exp(target), rel=0.01)  # the reading, as fitted
    with pytest.raises(hpx.ConfigError, match="dead_zone must be a number >= 0"):
        Stretch(1000, dead_zone=-0.1)


def test_stretch_burn_in_takes_only_shrinks():
    s = Stretch(1000, burn_in=0.1)  # the first 100 steps
    s.start(start_view())
    up = s.decide(view([4.0, 3.0, 2.0, 1.0], step=50))
    down = s.decide(view([1.0, 2.0, 3.0, 4.0], step=60))
    assert up.bases.item() == 1.0 and down.bases.item() < 1.0
    after = s.decide(view([4.0, 3.0, 2.0, 1.0], step=101, bases=tuple(down.bases.tolist())))
    assert after.bases.item() > down.bases.item()


def test_stretch_holds_after_its_window_and_frees_the_placement():
    s = Stretch(100, until=0.2, syncs=2, guard_until=0.2, hold_syncs=4)  # syncs at 10 and 20
    s.start(start_view())
    d1 = s.decide(view([1.0, 2.0, 3.0, 4.0], step=10))
    assert d1.placement is not None and d1.next_sync == 10 and s.acts_at(20)
    d2 = s.decide(view([1.0, 2.0, 3.0, 4.0], step=20))
    assert d2.placement is None and d2.next_sync == 20 and not s.acts_at(21)
    d3 = s.decide(view([1.0, 2.0, 3.0, 4.0], step=40))
    assert d3.bases is None and d3.info["phase"] == "hold"


def test_stretch_guard_takes_only_shrinks_after_the_window_until_its_end():
    s = Stretch(100, until=0.2, syncs=2, burn_in=0.0, guard_until=0.5, hold_syncs=5)
    s.start(start_view())
    d = s.decide(view([4.0, 3.0, 2.0, 1.0], step=10))
    assert d.bases.item() > 1.0 and d.info["phase"] == "stretch"
    b = tuple(d.bases.tolist())
    up = s.decide(view([4.0, 3.0, 2.0, 1.0], step=30, bases=b))
    assert up.bases.item() == b[0] and up.info["phase"] == "guard" and up.placement is not None
    down = s.decide(view([1.0, 2.0, 3.0, 4.0], step=40, bases=b))
    assert down.bases.item() < b[0]
    assert down.land < 1.0  # the consensus lands on the shrunk point
    last = s.decide(view([1.0, 2.0, 3.0, 4.0], step=50, bases=b))
    assert last.placement is None and not s.acts_at(51) and last.next_sync == 10


def test_stretch_searches_the_named_multiplicative_knob_only():
    s = Stretch(1000, burn_in=0.0, knob="k1")
    v = view([4.0, 3.0, 2.0, 1.0], bases=(0.5, 1.0), spreads=(0.1, LOG2), kinds=("add", "mul"),
             spacing=("linear", "log"), explore=(True, True))
    d0 = s.start(v)
    assert d0.spreads.tolist() == [0.1, 0.0]  # the other knob keeps its spread
    d = s.decide(v)
    assert d.bases[0].item() == 0.5 and d.bases[1].item() > 1.0
    with pytest.raises(hpx.ConfigError, match="'k0' is additive"):
        Stretch(1000, knob="k0").start(v)
    with pytest.raises(hpx.ConfigError, match="needs a multiplicative knob"):
        Stretch(1000).start(view([1.0, 2.0], kinds=("add",), spacing=("linear",), spreads=(0.1,)))


def test_stretch_settings_are_checked_together():
    with pytest.raises(hpx.ConfigError) as e:
        Stretch(0, until=1.5, syncs=0, span=1.0, burn_in=1.0, guard_until=2.0, hold_syncs=0, knob=3)
    msg = str(e.value)
    for part in ("total_steps", "until", "syncs", "span", "burn_in", "guard_until", "hold_syncs", "knob"):
        assert part in msg


class _Spy:
    """A probe signal that keeps each replica's parameters as they were scored."""

    def __init__(self, batch):
        self.batch, self.seen = batch, []

    def measure(self, ctx):
        self.seen.append([torch.cat([p.detach().reshape(-1) for p in r.model.parameters()]).clone()
                          for r in ctx.replicas])
        return torch.stack([ce(r, self.batch).detach() for r in ctx.replicas])


def _flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()


def test_engine_scores_replicas_on_the_runs_displacement_and_lands_where_the_search_says(digits):
    model = mlp(2)
    anchor = _flat(model)
    spy = _Spy(data(digits, 1, seed=9, size=256)[0])
    search = Stretch(100, until=0.1, syncs=2, burn_in=0.0, guard_until=0.1)  # syncs at 5 and 10
    engine = hpx.Engine(model, lambda m: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9),
                        [hpx.LearningRateScale("lr")], replicas=4, signal=spy, search=search)
    assert engine.values("lr") == [1.0] * 4  # no spread while training
    rho = search._rho(4)
    for b in data(digits, 5):
        engine.step(ce, b)
    seen = spy.seen[-1]
    unit = [(p - anchor) / r for p, r in zip(seen, rho.tolist())]  # the consensus's displacement
    for u in unit[1:]:
        torch.testing.assert_close(u, unit[0], rtol=1e-5, atol=1e-6)
    assert not torch.allclose(seen[0], seen[-1])
    landed = math.exp(min(search.moves[-1], 0.0))
    for r in engine.replicas:
        torch.testing.assert_close(_flat(r.model), anchor + landed * unit[0], rtol=1e-5, atol=1e-6)
    assert engine.bases["lr"] == pytest.approx(math.exp(search.moves[-1]))
    assert engine.state_dict()["anchor"] is not None
    for b in data(digits, 5, seed=4):
        engine.step(ce, b)
    assert engine.state_dict()["anchor"] is None  # the window is over: the copy is freed
    assert len(spy.seen) == 2


def test_engine_refuses_a_placement_without_an_anchor_and_a_foreign_anchor(digits):
    class Late(Scripted):
        def decide(self, v):
            return Decision(placement=torch.ones(2), next_sync=1)

    engine = hpx.Engine(mlp(), lambda m: torch.optim.SGD(m.parameters(), lr=0.1),
                        [hpx.LearningRate(spread=0.5)], replicas=2, search=Late([1]))
    with pytest.raises(ValueError, match="no longer holds the run's starting parameters"):
        engine.step(ce, data(digits, 1)[0])
    auto = hpx.autolr(mlp(), lambda m: torch.optim.SGD(m.parameters(), lr=0.1), total_steps=50,
                      probe=data(digits, 1), replicas=2)
    state = auto.state_dict()
    state["anchor"] = state["anchor"][:-1]
    before = _flat(auto.replicas[0].model)
    with pytest.raises(hpx.ConfigError, match="starting parameters"):
        auto.load_state_dict(state)
    assert torch.equal(_flat(auto.replicas[0].model), before)


def test_stretch_scores_at_least_points_multipliers_a_multiple_of_the_replicas():
    s = Stretch(1000, points=4)
    assert [s._rho(n).numel() for n in (1, 2, 3, 4, 5, 8)] == [4, 4, 6, 4, 5, 8]
    rho = s._rho(1)
    assert rho[0].item() == pytest.approx(1 / 1.5) and rho[-1].item() == pytest.approx(1.5)
    assert s.start(start_view()).placement.numel() == 4
    with pytest.raises(hpx.ConfigError, match="points must be an integer >= 2"):
        Stretch(1000, points=1)


def test_stretch_does_not_move_on_scores_taken_without_a_placement():
    """After an elastic resume the replicas are scored where they trained (identical): no fit."""
    s = Stretch(1000, burn_in=0.0)
    s.start(start_view())
    d = s.decide(view([4.0, 3.0, 2.0, 1.0], placement=None))
    assert d.bases.item() == 1.0 and d.land is None and d.placement is not None


class _Rounds:
    """A probe signal that records, per call, the round, the batch ids and each local replica's
    parameters."""

    def __init__(self, batches):
        self.inner = hpx.ProbeStream(batches, loss_fn=ce, batches=2)
        self.calls = []

    def measure(self, ctx):
        scores = self.inner.measure(ctx)
        self.calls.append((ctx.round, [id(b) for b in self.inner._held],
                           [_flat(r.model) for r in ctx.replicas]))
        return scores


@pytest.mark.parametrize("replicas", [1, 2])
def test_fewer_replicas_than_points_score_them_in_turn_and_decide_as_many_replicas_do(digits, replicas):
    """One model (or two) scoring Stretch's four points in rounds, on the same probe batches
    in every round, takes the decisions four replicas take (shared gradients: the mean of four
    quarter-batch gradients is the whole batch's) and lands the same weights."""
    probe = data(digits, 6, seed=9, size=128)
    batches = data(digits, 30, seed=3, size=32)
    runs = {}
    for n in (4, replicas):
        signal = _Rounds(probe)
        engine = hpx.Engine(mlp(), lambda m: torch.optim.SGD(m.parameters(), lr=0.3, momentum=0.9),
                            [hpx.LearningRateScale("lr")], replicas=n, signal=signal,
                            search=Stretch(100, until=0.3, syncs=3, burn_in=0.0, guard_until=0.3))
        for b in batches:
            engine.step(ce, b)
        runs[n] = (engine, signal)
    big, small = runs[4], runs[replicas]
    rounds = 4 // replicas
    assert [c[0] for c in small[1].calls] == list(range(rounds)) * 3  # three syncs
    for k in range(0, len(small[1].calls), rounds):  # every round of a sync: the same batches
        assert len({tuple(c[1]) for c in small[1].calls[k:k + rounds]}) == 1
    # the points scored: the same four, point p on replica p % N in round p // N
    first_big = big[1].calls[0][2]
    seen = [p for c in small[1].calls[:rounds] for p in c[2]]
    for a, b in zip(seen, first_big):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    e_big, e_small = big[0], small[0]
    assert [r.points for r in e_small.history] == [r.points for r in e_big.history]
    for rb, rs in zip(e_big.history, e_small.history):
        assert rs.scores == pytest.approx(rb.scores, rel=1e-4)
        assert rs.bases["lr"] == pytest.approx(rb.bases["lr"], rel=1e-4)
    assert e_big.bases["lr"] != 1.0  # the search moved
    for r in e_small.replicas:
        torch.testing.assert_close(_flat(r.model), _flat(e_big.replicas[0].model), rtol=1e-4, atol=1e-5)


def _autolr_on_ranks(rank, world_size, batches, probe):
    """autolr over DDP with one replica per rank, each rank on its share of every batch."""
    from torch.nn.parallel import DistributedDataParallel

    model = DistributedDataParallel(mlp())
    engine = hpx.autolr(model, torch.optim.SGD(model.parameters(), lr=0.3, momentum=0.9), total_steps=60,
                        probe=probe, loss_fn=ce, backend=hpx.backends.TorchDistributed(), seed=0)
    for x, y in batches:
        share = len(x) // world_size
        engine.step(ce, (x[rank * share:(rank + 1) * share], y[rank * share:(rank + 1) * share]))
    return {"history": [(r.step, r.points, r.scores, r.bases["lr"]) for r in engine.history],
            "params": _flat(model.module)}


def test_two_ranks_score_four_points_in_two_rounds_as_one_process_does(digits):
    """Under torch.distributed (2 gloo ranks, DDP) the 4 points span the ranks in 2 rounds:
    the same points, scores, decisions and weights as one model scoring them in turn."""
    from tests._dist import run_distributed

    batches, probe = data(digits, 60, seed=3, size=32), data(digits, 2, seed=9, size=128)
    ranks = run_distributed(_autolr_on_ranks, 2, batches, probe, timeout=180)
    model = mlp()
    ref = hpx.autolr(model, torch.optim.SGD(model.parameters(), lr=0.3, momentum=0.9), total_steps=60,
                     probe=probe, loss_fn=ce, seed=0)
    for b in batches:
        ref.step(ce, b)
    want = [(r.step, r.points, r.scores, r.bases["lr"]) for r in ref.history]
    assert any(h[3] != 1.0 for h in want)  # the search moved
    for r in ranks:
        got = r["history"]
        assert [(s, p) for s, p, _, _ in got] == [(s, p) for s, p, _, _ in want]
        for (_, points, scores, base), (_, _, ref_scores, ref_base) in zip(got, want):
            assert base == pytest.approx(ref_base, rel=1e-4)
            if points is not None:  # the points' scores (a hold sync records each replica's loss)
                assert scores == pytest.approx(ref_scores, rel=1e-4)
        torch.testing.assert_close(r["params"], _flat(model), rtol=1e-4, atol=1e-5)
    assert torch.equal(ranks[0]["params"], ranks[1]["params"])
