"""What hpx.Forks' probe costs (issue 51, item 2): each probe pass scores only what a decision reads.
Your run is scored at a cut only where the cut reads its score (its weights or buffers non-finite,
or no challenger finite), and a mean loss is not scored whole again in the end's test. The passes
are counted here, and every decision, score a decision read and final weight is compared, bit for
bit, with a run that makes the passes hpx made before (``_Scoring._every_pass``)."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hpx
from tests._dist import run_distributed
from tests.test_forks import BATCHES, PROBE, STEPS, _loss, _net

ROWS = PROBE[0][0].shape[0]


class _Counted:
    """A probe loss (per example, or the batch's mean) that counts what it scores: calls on a whole
    probe batch, calls under vmap (every example of a batch at once) and calls on one example."""

    def __init__(self, mean: bool) -> None:
        self.mean = mean
        self.whole = self.vmapped = self.single = 0

    def __call__(self, rep: Any, b: Any) -> torch.Tensor:
        if torch._C._functorch.is_batchedtensor(b[0]):
            self.vmapped += 1
        elif b[0].shape[0] == ROWS:
            self.whole += 1
        else:
            self.single += 1
        return F.mse_loss(rep.model(b[0]).squeeze(-1), b[1], reduction="mean" if self.mean else "none")

    def passes(self) -> float:
        """Forks scored on the whole probe (a vmapped batch counts whole)."""
        return (self.whole + self.vmapped) / len(PROBE)


def _run(every: bool, mean: bool, lr: float = 0.05, before: Any = None, **settings: Any
         ) -> tuple[hpx.Forks, _Counted]:
    """A run at lr (0.05: a challenger wins at the end, so the end's test runs), with the passes of
    before issue 51 (``every``) or now; ``before(i, model)`` is called before step ``i``."""
    model = _net(p=0.0)
    fn = _Counted(mean)
    forks = hpx.Forks(model, torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9), total_steps=STEPS,
                      probe=PROBE, loss_fn=fn, **settings)
    forks._every_pass = every
    for i, b in enumerate(BATCHES[:STEPS]):
        if before is not None:
            before(i, model)
        forks.step(_loss, b)
    forks.converge()
    return forks, fn


def _same(a: float, b: float) -> bool:
    return a == b or (math.isnan(a) and math.isnan(b))


def _decisions(forks: hpx.Forks) -> list[Any]:
    """Every record but your run's score at a cut (not taken there now), and the final state."""
    out: list[Any] = [(r.step, r.phase, r.values, r.bases, r.metrics, r.scores[1:] if r.phase == "cut" else
                       r.scores) for r in forks.history]
    return [*out, forks.factor, forks.values, forks.fork_steps,
            [t.detach().clone() for t in [*forks.model.parameters(), *forks.model.buffers()]]]


def _assert_same(a: list[Any], b: list[Any]) -> None:
    """The same records (scores ``nan`` alike), settings, steps and final weights, bit for bit."""
    *ra, wa = a
    *rb, wb = b
    assert len(ra) == len(rb)
    for x, y in zip(ra, rb):
        if isinstance(x, tuple):
            assert x[:-1] == y[:-1] and len(x[-1]) == len(y[-1]) and all(map(_same, x[-1], y[-1]))
        else:
            assert x == y
    assert len(wa) == len(wb) and all(torch.equal(s, t) for s, t in zip(wa, wb))


@pytest.mark.parametrize("mean", [False, True], ids=["per-example", "mean"])
def test_a_run_scores_the_probe_only_where_a_decision_reads_it(mean):
    """Defaults, 5 forks: the initial weights (1), the first cut's 4 annealed copies (4), the second's
    2 (2), the end's 2 (2) and, for a mean loss, the end's test on each example of the two (2);
    before: your run at both cuts too (2), and a mean loss scored whole again in the test (2)."""
    old, counted_old = _run(True, mean)
    new, counted = _run(False, mean)
    assert new.history[-1].metrics is not None  # the end's test ran (a challenger was best)
    assert (counted.whole, counted.vmapped) == ((18, 4) if mean else (18, 0))
    assert (counted_old.whole, counted_old.vmapped) == ((26, 4) if mean else (22, 0))
    assert counted.passes() == (11 if mean else 9) and counted_old.passes() == (15 if mean else 11)
    assert counted.single == counted_old.single  # the first pass's checks of a mean loss, as before
    _assert_same(_decisions(new), _decisions(old))
    cuts = [r for r in new.history if r.phase == "cut"]
    assert len(cuts) == 2 and all(math.isnan(r.scores[0]) for r in cuts)  # not scored: nan, said so
    assert all(math.isfinite(r.scores[0]) for r in old.history)
    assert new.factor != 1.0


def test_your_run_winning_the_end_decides_as_before():
    """lr 10x too low here: your run wins at the end, no test runs; the same run either way."""
    old, _ = _run(True, False, lr=0.005)
    new, counted = _run(False, False, lr=0.005)
    assert new.factor == 1.0 and counted.passes() == 9
    _assert_same(_decisions(new), _decisions(old))


def test_your_run_with_a_non_finite_weight_at_a_cut_is_scored_and_lost_there_as_before():
    """A NaN written into your run's weights the step before the first cut is decided (step 5): its
    training loss is flagged only at the next step's start, so the cut reads its probe score (its
    weights are not finite), finds it non-finite and keeps it as lost, as it did."""
    def poison(i: int, model: nn.Module) -> None:
        if i == 4:
            with torch.no_grad():
                model[0].weight[0, 0] = math.nan

    old, counted_old = _run(True, False, before=poison)
    new, counted = _run(False, False, before=poison)
    cut = new.history[0]
    assert cut.phase == "cut" and cut.step == 5 and math.isnan(cut.scores[0])
    assert math.isnan(old.history[0].scores[0])
    assert counted.passes() == counted_old.passes() == 10  # read at the first cut; lost at the second
    _assert_same(_decisions(new), _decisions(old))
    assert new.factor != 1.0 and all(torch.isfinite(p).all() for p in new.model.parameters())


def test_a_cut_whose_challengers_all_blew_up_reads_your_runs_score_as_before():
    """Every challenger at 1,000x your lr: lost before the cut, no stand-in of theirs is finite, so
    the cut reads your run's score (is every fork lost?): it is finite, and the run goes on as before."""
    settings = {"multiples": (1.0, 1e3, 3e3), "cuts": ((0.3, 2),)}
    old, counted_old = _run(True, False, lr=0.005, **settings)
    new, counted = _run(False, False, lr=0.005, **settings)
    cut = new.history[0]
    assert cut.phase == "cut" and math.isfinite(cut.scores[0])
    assert not any(math.isfinite(s) for s in cut.scores[1:])
    assert [r.scores for r in new.history] == [r.scores for r in old.history]
    assert counted.passes() == counted_old.passes()
    _assert_same(_decisions(new), _decisions(old))


def _bn_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.BatchNorm1d(32), nn.Tanh(), nn.Linear(32, 1))


def _ranks(rank: int, world: int) -> dict:
    """Both modes, each rank on its half of every batch: a BatchNorm's running statistics differ
    between the ranks, and scoring a fork averages them over the ranks (they stay averaged): your
    run's buffers at each decision, and the final state."""
    out = {}
    for every in (True, False):
        model = _bn_net()
        held: list[list[torch.Tensor]] = []
        forks = hpx.Forks(model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), total_steps=20,
                          probe=PROBE, backend=hpx.backends.TorchDistributed(),
                          on_sync=lambda r, m=model, held=held: held.append([t.clone() for t in m.buffers()]))
        forks._every_pass = every
        for b in BATCHES[:20]:
            forks.step(_loss, tuple(t.chunk(world)[rank] for t in b))
        out[every] = {"history": [(r.step, r.values, r.bases, r.scores[1:] if r.phase == "cut" else r.scores)
                                  for r in forks.history], "held": held,
                      "state": [t.detach().clone() for t in [*model.parameters(), *model.buffers()]]}
    return out


@pytest.mark.procs
def test_under_two_gloo_ranks_your_runs_buffers_are_averaged_at_a_cut_as_before():
    out = run_distributed(_ranks, 2)
    for rank in out:
        assert rank[True]["history"] == rank[False]["history"]
        assert len(rank[True]["held"]) == len(rank[False]["held"]) == 3
        pairs = zip(rank[True]["held"], rank[False]["held"])  # your run's buffers after each decision
        assert all(torch.equal(a, b) for x, y in pairs for a, b in zip(x, y))
        assert all(torch.equal(a, b) for a, b in zip(rank[True]["state"], rank[False]["state"]))
    assert all(torch.equal(a, b) for a, b in zip(out[0][False]["state"], out[1][False]["state"]))
