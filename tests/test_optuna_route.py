"""The benchmarks' Optuna route (benchmarks/optuna_route.py) on a tiny synthetic regression.

Optuna is a benchmark dependency (the ``bench`` extra), not ``dev``'s: without it these tests skip.
"""

from __future__ import annotations

import math

import pytest

optuna = pytest.importorskip("optuna")

import torch  # noqa: E402

from benchmarks.optuna_route import Trial, knob_range, search  # noqa: E402

STEPS = 30
START = {"lr": 1.0, "weight_decay": 0.0}
SPACE = {"lr": (0.1, 10.0, True), "weight_decay": (0.0, 0.1, False)}


def _data() -> tuple[list[tuple[torch.Tensor, torch.Tensor]], tuple[torch.Tensor, torch.Tensor],
                     tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(5, generator=g)

    def draw(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(n, 5, generator=g)
        return x, x @ w + 0.3 * torch.randn(n, generator=g)

    return [draw(16) for _ in range(STEPS)], draw(64), draw(64)


def _builder(counter: list[int]):
    batches, probe, val = _data()

    def mse(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> float:
        with torch.no_grad():
            return float(torch.nn.functional.mse_loss(model(batch[0]).squeeze(-1), batch[1]))

    def build(values: dict[str, float]) -> Trial:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(1)
            model = torch.nn.Linear(5, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.05 * values["lr"], weight_decay=values["weight_decay"])

        def step(i: int) -> None:
            counter[0] += 1
            x, y = batches[i]
            loss = torch.nn.functional.mse_loss(model(x).squeeze(-1), y)
            opt.zero_grad()
            loss.backward()
            opt.step()

        return Trial(model, step, lambda: mse(model, probe), lambda m: mse(m, val))

    return build


def _search(seed: int = 0) -> tuple[dict, int, object]:
    counter = [0]
    build = _builder(counter)
    return search(build, steps=STEPS, start=START, space=SPACE, seed=seed), counter[0], build


def test_optuna_route_runs_the_start_first_within_the_budget_and_answers_its_best_complete_trial():
    res, counted, build = _search()
    study = res["study"]
    trials = study.trials
    # (a) the first trial is plain training at the start, to the end
    assert trials[0].params == START
    assert trials[0].state == optuna.trial.TrialState.COMPLETE and trials[0].last_step == STEPS
    # (b) every optimizer step counted, within the budget and at least the start's full run
    assert res["steps_used"] == counted
    assert STEPS <= counted <= math.floor(2.9 * STEPS)
    assert res["steps"] == counted / STEPS and res["trials"] == len(trials)
    # (c) the answer: the completed trial with the lowest final probe loss
    done = [t for t in trials if t.state == optuna.trial.TrialState.COMPLETE]
    assert all(t.last_step == STEPS for t in done)
    best = min(done, key=lambda t: t.value)
    assert res["trial"] == best.number and res["values"] == best.params and res["probe"] == best.value
    # ... and its validation loss is the one of that trial's final model (trained again here)
    again = build(best.params)
    for i in range(STEPS):
        again.step(i)
    assert res["val"] == again.evaluate(again.model)
    # (d) the same seed, the same answer
    res2, counted2, _ = _search()
    assert (res2["values"], res2["val"], counted2, res2["trials"]) == (res["values"], res["val"], counted,
                                                                      res["trials"])


def test_knob_ranges_follow_the_grid():
    assert knob_range("weight_decay", (0.0, 0.3, 1.0, 3.0)) == (0.0, 3.0, False)
    assert knob_range("temperature", (1.0, 0.25, 0.5, 2.0)) == (0.25, 2.0, True)
    assert knob_range("dropout", (0.1, 0.2, 0.4)) == (0.1, 0.4, False)
