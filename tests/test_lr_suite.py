"""The learning-rate suite (benchmarks/lr): its tasks, its committed grids, its runner and criteria.

Quick runs check the plumbing, not the numbers; the numbers come from ``python -m benchmarks.lr``.
"""

from __future__ import annotations

import itertools
import json
import math
from dataclasses import replace

import pytest

pytest.importorskip("sklearn")
pytest.importorskip("transformers")
pytest.importorskip("pydoc_data.topics")

import torch

from benchmarks.lr.__main__ import GRIDS, SEEDS, _load, best_of_grid, cells, grid_lrs, verdict
from benchmarks.lr.run import Run, execute
from benchmarks.lr.tasks import HELD_OUT, TASKS, get_task


def test_the_suite_covers_what_the_issue_asks_for():
    ts = list(TASKS.values())
    assert len(ts) >= 12
    for opt in ("sgd", "adam", "adamw"):
        assert sum(t.optim == opt for t in ts) >= 3, opt
    assert sum(t.sched == "onecycle" for t in ts) >= 4
    assert {"cosine", "linear", "step"} <= {t.sched for t in ts}
    assert any(t.steps <= 150 for t in ts) and any(t.steps >= 3000 for t in ts)
    assert {"mlp", "cnn", "transformer", "rnn", "tabular"} <= {t.family for t in ts}


def test_a_third_is_held_out_with_the_families_spread():
    assert set(HELD_OUT) <= set(TASKS)
    assert len(HELD_OUT) * 3 >= len(TASKS)
    assert len({TASKS[t].family for t in HELD_OUT}) >= 4
    design = [t for t in TASKS if t not in HELD_OUT]
    assert {TASKS[t].family for t in HELD_OUT} <= {TASKS[t].family for t in design}


def test_every_committed_grid_has_an_interior_best_with_both_starts_on_it():
    grids = _load(GRIDS)
    for name, task in TASKS.items():
        lrs = grid_lrs(name, grids)
        assert len(lrs) >= 7, name
        ratios = [b / a for a, b in itertools.pairwise(lrs)]
        assert all(r == pytest.approx(10 ** 0.5, rel=1e-6) for r in ratios), name  # half-decades
        i, _, means = best_of_grid(name, grids)
        assert 2 <= i <= len(lrs) - 3, name
        assert means[i] < 0.9 * task.constant_loss(), name  # the best trains
        c = cells(name, grids)
        assert c["10x"] == pytest.approx(lrs[i + 2], rel=1e-6)
        assert c["0.1x"] == pytest.approx(lrs[i - 2], rel=1e-6)


def test_a_task_is_deterministic_in_its_seed_and_leaves_the_global_rng_alone():
    task = TASKS["digits_mlp"]
    before = torch.random.get_rng_state()
    a, b, c = task.model(0), task.model(0), task.model(1)
    assert torch.equal(torch.random.get_rng_state(), before)
    pa, pb, pc = (torch.cat([p.reshape(-1) for p in m.parameters()]) for m in (a, b, c))
    assert torch.equal(pa, pb) and not torch.equal(pa, pc)


def test_the_onecycle_tasks_cycle_momentum_as_torch_does():
    task = TASKS["digits_cnn_bn"]  # AdamW: OneCycle cycles beta1
    opt = task.optimizer(task.model(0), 0.1)
    sched = task.scheduler(opt)
    betas = []
    for _ in range(task.steps):
        betas.append(opt.param_groups[0]["betas"][0])
        opt.step()
        sched.step()
    assert max(betas) == pytest.approx(0.95) and min(betas) == pytest.approx(0.85)


@pytest.mark.parametrize("name", sorted(TASKS))
def test_every_task_trains_plainly_and_under_autolr(name):
    task = TASKS[name]
    plain = execute(Run(name, "plain", task.center, 0, steps=12))
    assert math.isfinite(plain["val"]) and plain["seconds"] > 0 and plain["end_lr"] == task.center
    hpx = execute(Run(name, "autolr", task.center, 0, steps=12))
    assert math.isfinite(hpx["val"]) and hpx["end_lr"] > 0 and hpx["history"]
    assert isinstance(hpx["lost"], bool)


def _row(start, vs_plain, vs_oracle, end, lost=False, cost=1.05, pick=None):
    return {"start": start, "vs_plain": vs_plain, "vs_oracle": vs_oracle, "end_vs_oracle": end,
            "end_vs_pick": end if pick is None else pick, "lost": lost, "cost": cost}


def test_verdict_reads_the_criteria_off_the_rows():
    rows = [_row("1x", 1.01, 1.01, 1.0), _row("1x", 1.04, 1.04, 2.0), _row("1x", math.nan, 1.0, 4.0),
            _row("0.1x", 0.5, 1.04, 0.5), _row("10x", 1.03, 1.2, 3.5, lost=True, cost=1.3),
            _row("0.1x", math.nan, 1.01, 1.0)]
    v = verdict(rows)
    assert v["no_harm_102"] == pytest.approx(1 / 3)
    assert v["no_harm_105_all"] is False  # a NaN ratio at the best lr is not "no harm"
    assert v["recover_105"] == pytest.approx(2 / 3)
    assert v["recover_vs_plain"] is False  # 1.03x plain from 10x off
    assert v["fixed_point_3x"] == pytest.approx(4 / 6)
    assert v["pick_3x"] == pytest.approx(4 / 6)
    assert v["lost"] == 1 and v["cost_max"] == pytest.approx(1.3)
    assert SEEDS == (0, 1)
    # against the probe's pick: its own column; unknown (no probe losses) for any row, unknown for all
    rows[0] = _row("1x", 1.01, 1.01, 1.0, pick=5.0)
    assert verdict(rows)["pick_3x"] == pytest.approx(3 / 6)
    rows[1] = _row("1x", 1.04, 1.04, 2.0, pick=math.nan)
    assert math.isnan(verdict(rows)["pick_3x"])


def test_the_table_reads_the_bar_again_on_the_tasks_whose_probe_resolves_the_grid():
    from benchmarks.lr.__main__ import markdown

    def full(task, resolved, start, vs_plain, vs_oracle):
        return {**_row(start, vs_plain, vs_oracle, 1.0), "task": task, "resolved": resolved,
                "held_out": False, "lr": 1.0, "plain": 1.0, "hpx": 1.0}

    rows = [full(t, t == "a", st, 1.0 if t == "a" else 1.5, 1.0 if t == "a" else 1.5)
            for t in ("a", "b") for st in ("0.1x", "1x", "10x")]
    md = markdown("m", rows)
    assert "at the best lr on 50% of tasks" in md  # both tasks
    assert "On the 1 of these tasks whose probe resolves the grid" in md
    assert "grid's best on both seeds: a)" in md
    assert "no harm on 100%, recovered in 100% of cells" in md
    # no task resolved, no such line
    assert "resolves" not in markdown("m", [dict(r, resolved=False) for r in rows])


def test_the_table_counts_the_bar_again_by_the_probes_size_over_both_sets():
    from benchmarks.lr.__main__ import markdown

    def full(task, held, start, vs_plain, vs_oracle, end):
        return {**_row(start, vs_plain, vs_oracle, end), "task": task, "resolved": False,
                "held_out": held, "lr": 1.0, "plain": 1.0, "hpx": 1.0}

    # char_gru's probe holds 4,096 tokens, wine_short's and iris_short's 30 rows
    rows = [full("char_gru", False, "0.1x", 0.9, 1.01, 1.0), full("char_gru", False, "1x", 1.0, 1.0, 1.0),
            full("char_gru", False, "10x", 0.8, 1.2, 5.0),
            full("wine_short", True, "0.1x", 1.0, 1.3, 0.1), full("wine_short", True, "1x", 1.1, 1.1, 3.2),
            full("wine_short", True, "10x", 0.5, 1.0, 1.0),
            full("iris_short", False, "0.1x", 1.0, 1.0, 1.0), full("iris_short", False, "1x", 1.0, 1.0, 1.0),
            full("iris_short", False, "10x", 1.0, 1.04, 1.0)]
    md = markdown("m", rows)
    assert ("on the 1 task whose probe holds more than 200 examples (tokens for a language model), no "
            "harm on 1 of 1, recovered in 1 of 2 cells, the lr within 3x of the grid's best in 2 of 3") in md
    # the held-out wine_short and the design iris_short are counted together
    assert ("on the 2 tasks whose probe holds 200 or fewer examples (tokens for a language model), no harm "
            "on 1 of 2, recovered in 3 of 4 cells, the lr within 3x of the grid's best in 4 of 6") in md
    # rows of tasks outside the suite are left out of the count
    assert "By the probe's size" not in markdown("m", [dict(r, task="x") for r in rows])


def test_the_probes_pick_is_each_seeds_lowest_probe_loss_and_unknown_while_a_run_lacks_one():
    from benchmarks.lr.__main__ import probe_picks

    grids = {}
    for lr, probes in ((0.1, (0.5, 0.2)), (1.0, (0.3, None)), (10.0, (0.4, 0.9))):
        for seed in SEEDS:
            grids[Run("t", "plain", lr, seed).key] = {"lr": lr, "val": 1.0, "steps": None,
                                                      "probe": probes[seed]}
    assert probe_picks("t", grids) == [1.0, 0.1]  # seed 1's run at 1.0 diverged: never picked
    del grids[Run("t", "plain", 10.0, 1).key]["probe"]
    assert probe_picks("t", grids) is None


def test_the_race_prototype_moves_by_its_multipliers_and_keeps_the_winning_fork():
    from benchmarks.lr.prototypes import race

    task = replace(TASKS["digits_mlp"], steps=40)

    def run(widths):
        model = task.model(0)
        opt = task.optimizer(model, 0.1)
        gen = torch.Generator().manual_seed(3)
        return race(task, model, opt, task.scheduler(opt), [task.sample(gen) for _ in range(task.steps)],
                    widths=widths)

    final, factor = run((3.0, 2.0))
    # two races: the factor is one of the nine products of (1/3, 1, 3) and (1/2, 1, 2)
    products = {a * b for a in (1 / 3, 1.0, 3.0) for b in (0.5, 1.0, 2.0)}
    assert any(math.isclose(factor, p) for p in products)
    assert all(torch.isfinite(p).all() for p in final.parameters())
    assert task.evaluate(final) < task.evaluate(task.model(0))
    # a fork that blows up loses (the one at 1e6 times the lr)
    final, factor = run((1e6,))
    assert factor in (1e-6, 1.0) and all(torch.isfinite(p).all() for p in final.parameters())


def test_forks_that_share_the_steps_keep_the_run_on_its_clock_and_step_count():
    task, final, factor, calls = _record_steps("forks", 0.1, rounds=((0.0, 0.5, (0.5, 1.0, 2.0)),))
    factors = [f for f, _ in calls]
    # one optimizer step per batch, never more: the three forks took the first 30 in turn
    assert len(calls) == 60 and factor in (0.5, 1.0, 2.0)
    assert sorted(factors[:30]) == [0.5] * 10 + [1.0] * 10 + [2.0] * 10 and set(factors[30:]) == {factor}
    # the forks' schedulers stayed on the run's clock: the winner's ends where plain training's does
    assert calls[-1][1].last_epoch == 60
    assert all(torch.isfinite(p).all() for p in final.parameters())
    assert task.evaluate(final) < task.evaluate(task.model(0))


def test_a_run_with_dropout_repeats_whatever_ran_before_it_and_leaves_the_global_rng_alone():
    run = Run("cancer_dropout", "plain", 3e-4, 0, steps=12)
    first = execute(run)
    torch.rand(100)  # another run in the same process draws from the global RNG
    state = torch.random.get_rng_state()
    second = execute(run)
    assert torch.equal(torch.random.get_rng_state(), state)
    assert first["val"] == second["val"] and first["probe"] == second["probe"]


def _record_steps(loop, lr, sched=None, **kw):
    """Run a prototype loop (a name in benchmarks.lr.prototypes) on 60 steps of digits_mlp (under
    its OneCycleLR, or ``sched``), recording every optimizer step's ``(lr factor, scheduler)``."""
    from benchmarks.lr import prototypes

    task = replace(TASKS["digits_mlp"], steps=60, **({"sched": sched} if sched else {}))
    model = task.model(0)
    opt = task.optimizer(model, lr)
    gen = torch.Generator().manual_seed(3)
    batches = [task.sample(gen) for _ in range(task.steps)]
    calls = []
    real = prototypes._step
    prototypes._step = lambda *a: calls.append((a[3], a[1][2])) or real(*a)
    try:
        final, factor = getattr(prototypes, loop)(task, model, opt, task.scheduler(opt), batches, **kw)
    finally:
        prototypes._step = real
    return task, final, factor, calls


def test_successive_halving_runs_whole_forks_and_cuts_them_on_time():
    task, final, factor, calls = _record_steps("halving", 0.1)
    # 5 forks to step 6, 3 to step 15, 2 to step 30, then one: 30 + 27 + 30 + 30 optimizer steps
    assert len(calls) == 117
    assert factor in {10 ** (k / 2) for k in range(-2, 3)}
    assert {f for f, _ in calls[-30:]} == {factor}
    # the survivor is a whole run on its own schedule: its scheduler ends where plain training's does
    assert calls[-1][1].last_epoch == 60
    assert task.evaluate(final) < task.evaluate(task.model(0))
    # scoring a fork at an annealed copy adds the copies' steps (3 per fork and cut) and moves no fork
    _, _, _, cooled = _record_steps("halving", 0.1, cool=0.05)
    assert len(cooled) == 117 + 3 * (5 + 3 + 2)
    # after the first cut's 30 steps, the first copy's lr factor falls linearly toward 0
    ramp = [f for f, _ in cooled[30:33]]
    assert ramp == pytest.approx([ramp[0] * (3 - j) / 3 for j in range(3)])
    # a cut at the run's end scores the finished forks as they are: copies at the first two cuts only
    _, _, _, ended = _record_steps("halving", 0.1, cuts=((0.1, 3), (0.25, 2), (1.0, 1)), cool=0.05)
    assert len(ended) == 5 * 6 + 3 * 9 + 2 * 45 + 3 * (5 + 3)


def test_peaked_cuts_fall_among_the_steps_after_the_schedules_peak():
    cuts = ((0.1, 3), (0.25, 2), (1.0, 1))
    _, _, _, shares = _record_steps("halving", 0.1, cuts=cuts)
    _, _, _, peaked = _record_steps("halving", 0.1, cuts=cuts, peaked=True)
    assert len(shares) == 5 * 6 + 3 * 9 + 2 * 45  # cuts at steps 6 and 15
    # OneCycleLR over 60 steps peaks at its 18th step (p = 17/60): the cuts move to steps
    # round(60 p + 6 (1 - p)) = 21 and round(60 p + 15 (1 - p)) = 28
    assert len(peaked) == 5 * 21 + 3 * 7 + 2 * 32
    assert len({f for f, _ in peaked[5 * 20:5 * 21]}) == 5  # five forks to step 21, three after
    assert len({f for f, _ in peaked[5 * 21:5 * 21 + 3]}) == 3
    # a schedule that starts at its peak (step decay) keeps its cuts: the same steps, factor by factor
    _, _, _, step = _record_steps("halving", 0.1, sched="step", cuts=cuts)
    _, _, _, step_peaked = _record_steps("halving", 0.1, sched="step", cuts=cuts, peaked=True)
    assert [f for f, _ in step_peaked] == [f for f, _ in step] and len(step) == len(shares)


def test_the_starts_fork_sees_plain_trainings_dropout_draws():
    from benchmarks.lr.prototypes import halving
    from benchmarks.lr.run import plain_train

    task = replace(TASKS["cancer_dropout"], steps=40)
    gen = torch.Generator().manual_seed(1)
    batches = [task.sample(gen) for _ in range(task.steps)]

    def fresh():
        model = task.model(0)
        opt = task.optimizer(model, 3e-4)
        return model, opt, task.scheduler(opt)

    torch.manual_seed(5)
    plain = task.evaluate(plain_train(task, *fresh(), batches))
    after_plain = torch.random.get_rng_state()
    torch.manual_seed(5)
    # a fork at 1e-4 times the lr draws in between, and loses
    final, factor = halving(task, *fresh(), batches, mults=(1.0, 1e-4), cuts=((0.5, 1),))
    assert factor == 1.0 and task.evaluate(final) == plain
    assert torch.equal(torch.random.get_rng_state(), after_plain)


def test_successive_halving_protects_the_start_until_the_last_cut_only_when_asked():
    cuts = ((0.1, 2), (0.5, 1))
    # from far too low a start, the two higher forks win the first cut; protected, the start stays
    _, _, _, free = _record_steps("halving", 1e-3, mults=(1.0, 10.0, 100.0), cuts=cuts)
    _, _, _, kept = _record_steps("halving", 1e-3, mults=(1.0, 10.0, 100.0), cuts=cuts, protect=True)
    assert {f for f, _ in free[18:60]} == {10.0, 100.0}
    assert 1.0 in {f for f, _ in kept[18:60]}


def test_the_ceiling_table_counts_picks_on_the_best_by_the_probes_size():
    from benchmarks.lr.ceiling import _markdown

    def row(task, held, probe, picks, vs_best):
        return {"task": task, "held_out": held, "best": 1.0, "picks": picks, "val": 0.1,
                "vs_best": vs_best, "probe": probe}

    md = _markdown([row("a", False, 30, [1.0, 1.0], 1.0), row("b", False, 200, [3.16, 1.0], 1.1),
                    row("c", True, 4096, [1.0, 1.0], 1.0), row("d", True, 256, [0.316, 0.316], 1.2)])
    assert "within 2% of the grid's best on 1 of 2 tasks" in md  # a design task, b not
    assert "at most 200 examples: the pick is the grid's best on both seeds on 1 of 2" in md
    assert "more than 200: the pick is the grid's best on both seeds on 1 of 2" in md


def test_a_probe_is_cut_into_disjoint_chunks_and_each_chunk_scored():
    from benchmarks.lr.run import _chunk_losses

    task = TASKS["digits_mlp"]  # a probe of two batches of 100 rows
    model = task.model(0)
    losses = _chunk_losses(task, model, 30)
    assert len(losses) == 6  # 200 rows in chunks of 30; the last 20 rows are left out
    x = torch.cat([b[0] for b in task.probe()])
    y = torch.cat([b[1] for b in task.probe()])
    model.eval()
    with torch.no_grad():
        assert losses[2] == pytest.approx(float(task.loss(model, (x[60:90], y[60:90]))))
    # a language model's probe row is a window of tokens: a chunk of ~256 tokens is whole rows
    lm = TASKS["char_gru"]
    per_row = lm.probe()[0][1][0].numel()
    rows = sum(len(y) for _, y in lm.probe())
    assert per_row > 1 and len(_chunk_losses(lm, lm.model(0), 256)) == rows // round(256 / per_row)


def test_the_chunk_table_counts_each_chunks_pick_against_the_grids_best():
    from benchmarks.lr.ceiling import _chunk_table

    grids, store = {}, {}
    # the grid's best (validation) is lr 1.0; chunk 0 agrees on both seeds, chunk 1 prefers 0.1
    for lr, val, chunks in ((0.1, 0.5, [0.4, 0.1]), (1.0, 0.2, [0.3, 0.2]), (10.0, 0.9, [0.9, math.inf])):
        for seed in SEEDS:
            key = Run("digits_mlp", "plain", lr, seed).key
            grids[key] = {"lr": lr, "val": val, "steps": None}
            store[key] = {"chunks": {"30": chunks}}
    md = _chunk_table(["digits_mlp"], grids, store, [30])
    assert "| digits_mlp | 200 | 2 of 4 |" in md and "| all | | 50% (2 of 4) |" in md


def test_the_ceiling_command_runs_as_a_module_and_on_a_task(tmp_path, monkeypatch, capsys):
    import subprocess
    import sys

    from benchmarks.lr import __main__ as suite
    from benchmarks.lr import ceiling

    out = subprocess.run([sys.executable, "-m", "benchmarks.lr.ceiling", "--help"], capture_output=True,
                         text=True, check=True).stdout
    assert "--val-halves" in out and "--chunks" in out
    # one small task end to end, its stores in a temporary directory: the reruns match the grid
    monkeypatch.setattr(suite, "RUNS", tmp_path)
    for name in ("STORE", "CHUNKS", "HALVES"):
        monkeypatch.setattr(ceiling, name, tmp_path / getattr(ceiling, name).name)
    assert ceiling.main(["--tasks", "iris_short", "--jobs", "1", "--val-halves"]) == 0
    md = capsys.readouterr().out
    assert "Reruns agree with the stored grid" in md and "| iris_short | 30 |" in md
    assert "the halves agree in" in md and (tmp_path / "ceiling-val.json").exists()


def test_the_diagnostic_finds_where_a_reading_crosses_and_where_a_parabola_bottoms():
    from benchmarks.lr.diagnose import FACTORS, RHOS, _crossing, _log_rho_star

    assert len(FACTORS) == 5
    assert math.isclose(_crossing([1.0, 1.0, 0.5, -0.5, -1.0]), 10 ** 0.25, rel_tol=1e-9)  # halfway 1x..3.2x
    assert _crossing([-1.0] * 5) == 0.0 and _crossing([1.0] * 5) == math.inf
    for best in (1 / 1.3, 1.0, 1.2):  # a parabola in log rho with its bottom at `best`
        curve = [(math.log(r) - math.log(best)) ** 2 for r in RHOS]
        assert abs(_log_rho_star(curve) - math.log(best)) < 0.02
    assert _log_rho_star([1.0, math.nan] + [1.0] * (len(RHOS) - 2)) == -1.0


def test_the_cost_table_times_plain_training_and_each_method_on_the_same_task():
    from benchmarks.lr.cost import markdown, measure

    rows = measure(["wine_short"], 1, ["Forks", "autolr"])
    (name, plain, (forks, autolr)), = rows
    assert name == "wine_short" and plain > 0 and forks > 0 and autolr > 0
    md = markdown(rows, 1, ["Forks", "autolr"])
    assert (f"| wine_short |  | 100 | {plain:.2f} | {forks:.2f} | {forks / plain:.2f} | {autolr:.2f} | "
            f"{autolr / plain:.2f} |") in md
    assert "| Forks (s) | Forks / plain | autolr (s) | autolr / plain |" in md
    assert f"`hpx.Forks`: median ratio {forks / plain:.2f}" in md
    from benchmarks.lr.cost import _STEPS

    steps = _STEPS[("wine_short", "Forks")]  # counted by the run: about 3x plain training's
    assert 2.5 < steps < 3.5 and f"take {steps:.2f}-{steps:.2f}x plain training's optimizer steps" in md
    assert md.startswith("<!-- lr-cost -->") and md.endswith("<!-- /lr-cost -->")
    # a prototype loop is timed the same way, and named in its table
    (_, _, (halving,)), = measure(["wine_short"], 1, ["halving"])
    md = markdown([("wine_short", plain, [halving])], 1, ["halving"])
    assert "--method halving`" in md and "| halving / plain |" in md


def test_paired_gain_counts_standard_errors_of_the_per_example_difference():
    from benchmarks.lr.prototypes import _unit_losses, paired_gain

    task = replace(TASKS["digits_mlp"], steps=30)
    model = task.model(0)
    start = [p.detach().clone() for p in model.parameters()]
    gen = torch.Generator().manual_seed(2)
    opt = task.optimizer(model, 0.1)
    for _ in range(30):
        loss = task.loss(model, task.sample(gen))
        opt.zero_grad()
        loss.backward()
        opt.step()
    trained = [p.detach().clone() for p in model.parameters()]
    units = _unit_losses(task, model, trained)
    # one loss per probe example, whose mean is the probe loss the suite reads
    assert units.shape == (sum(len(y) for _, y in task.probe()),)
    from benchmarks.lr.prototypes import probe_at
    model.eval()
    assert float(units.mean()) == pytest.approx(probe_at(task, model, trained), rel=1e-5)
    d = _unit_losses(task, model, start) - units
    gain = paired_gain(task, model, trained, model, start)
    assert gain == pytest.approx(float(d.mean()) / (float(d.std()) / len(d) ** 0.5))
    assert gain > 2 and paired_gain(task, model, start, model, trained) == pytest.approx(-gain)
    assert paired_gain(task, model, trained, model, trained) == 0.0
    # the parameters are put back
    assert all(torch.equal(p, w) for p, w in zip(model.parameters(), trained))


def test_a_confident_end_keeps_the_start_unless_the_challenger_wins_by_z_standard_errors():
    cuts = ((0.1, 2), (1.0, 1))
    # the start 1000x too low loses clearly to a 10x fork: with or without a confidence test it moves
    _, _, moved, _ = _record_steps("halving", 1e-4, mults=(1.0, 10.0, 0.5), cuts=cuts, protect=True,
                                   confidence=2.0)
    assert moved == 10.0
    # a bar no difference can clear keeps the start
    _, _, stayed, calls = _record_steps("halving", 1e-4, mults=(1.0, 10.0, 0.5), cuts=cuts, protect=True,
                                        confidence=1e9)
    assert stayed == 1.0 and {f for f, _ in calls[-54:]} == {1.0, 10.0}


def test_a_lost_start_gives_way_to_a_challenger_that_learnt_without_the_test():
    cuts = ((0.1, 2), (1.0, 1))
    # at 30 the start ends worse on the probe than its initial weights; the fork at 0.01x learns.
    # A bar no difference can clear keeps even a lost start, unless lost starts give way
    kw = dict(mults=(1.0, 0.01, 1e-6), cuts=cuts, protect=True, confidence=1e9)
    _, _, kept, _ = _record_steps("halving", 30.0, **kw)
    task, final, moved, _ = _record_steps("halving", 30.0, lost_start=True, **kw)
    assert kept == 1.0 and moved == 0.01
    assert task.evaluate(final) < task.evaluate(task.model(0))


def test_a_sided_cut_keeps_the_start_and_the_best_fork_on_each_side():
    cuts = ((0.1, 3), (1.0, 1))
    mults = (1.0, 0.1, 0.3, 3.0, 10.0)
    # from far too low a start, the two forks above win the cut on their scores alone
    _, _, _, free = _record_steps("halving", 1e-3, mults=mults, cuts=cuts, protect=True)
    _, _, _, sided = _record_steps("halving", 1e-3, mults=mults, cuts=cuts, protect=True, sided=True)
    assert {f for f, _ in free[30:]} == {1.0, 3.0, 10.0}
    later = {f for f, _ in sided[30:]}
    assert len(later) == 3 and 1.0 in later and min(later) < 1.0 < max(later)
    # the fork kept below is the better-scoring of the two below: 0.3 (0.1 learns even less)
    assert later == {0.3, 1.0, 10.0}


@pytest.mark.parametrize("average", [True, False])
def test_halving_scores_averaged_or_last_weights(monkeypatch, average):
    from benchmarks.lr import prototypes

    seen = []
    real = prototypes._scored

    def spy(task, model, weights):
        seen.append(all(torch.equal(w, p) for w, p in zip(weights, model.parameters())))
        return real(task, model, weights)

    monkeypatch.setattr(prototypes, "_scored", spy)
    _record_steps("halving", 0.1, mults=(1.0, 3.0), cuts=((0.5, 1),), average=average)
    # two forks scored at the cut: at their last weights exactly, or at averages that lag them
    assert len(seen) == 2 and seen == [not average] * 2


def test_the_offgrid_command_runs_as_a_module_and_counts_cells(tmp_path, monkeypatch, capsys):
    import subprocess
    import sys

    from benchmarks.lr import offgrid

    out = subprocess.run([sys.executable, "-m", "benchmarks.lr.offgrid", "--help"], capture_output=True,
                         text=True, check=True).stdout
    assert "--offsets" in out and "--method" in out
    monkeypatch.setattr(offgrid, "STORE", tmp_path / "offgrid.json")
    # the committed grid's runs may end elsewhere on this machine's kernels: cells are counted anyway
    assert offgrid.main(["--method", "halving-end", "--tasks", "iris_short", "--jobs", "1",
                         "--offsets", "-0.75", "0.25", "--mixed-numerics"]) == 0
    md = capsys.readouterr().out
    # a start 10^0.25 = 1.78x the best is near it, one at 10^-0.75 = 0.178x is not
    assert "| iris_short | 1.78x |" in md and "| iris_short | 0.178x |" in md
    store = json.loads((tmp_path / "offgrid.json").read_text())
    assert len(store) == 2 * 2 * 2  # plain and the method, 2 starts, 2 seeds


def test_offgrid_rows_read_plain_the_method_and_the_oracle():
    from benchmarks.lr.offgrid import _markdown

    table = [{"task": "t", "offset": 0.25, "plain": 1.0, "hpx": 1.01, "oracle": 0.9, "end_vs_best": 1.78},
             {"task": "t", "offset": -0.75, "plain": 2.0, "hpx": 0.93, "oracle": 0.9, "end_vs_best": 1.0},
             {"task": "u", "offset": 0.75, "plain": 1.0, "hpx": 1.1, "oracle": 1.0, "end_vs_best": 5.6}]
    md = _markdown(table, "m")
    assert "| t | 1.78x | 1.0000 | 1.0100 | 1.010 | 1.122 | 1.78 |" in md
    assert "within 2% of plain training at that start (or better) in 1 of 1 cells" in md
    assert "within 5% of the oracle in 1 of 2 cells; more than 2% worse than plain training there in 1" in md


def test_the_suite_runs_and_reports_several_methods_each_in_its_table(tmp_path, monkeypatch, capsys):
    """``--method autolr Forks``: each method's runs go to its own store and its own table
    (quick mode: 12-step runs, the plumbing only)."""
    from benchmarks.lr import __main__ as suite

    monkeypatch.setattr(suite, "RUNS", tmp_path)
    assert suite.main(["eval", "--quick", "--method", "autolr", "Forks", "--tasks", "iris_short",
                       "--jobs", "1"]) == 0
    out = capsys.readouterr().out
    assert out.index("### autolr") < out.index("### Forks")
    for method in ("autolr", "Forks"):
        store = json.loads((tmp_path / f"{method}-quick.json").read_text())
        assert sorted({k.split("|")[1] for k in store}) == [method]
        assert len(store) == 3 * 2  # 3 starts x 2 seeds


@pytest.mark.parametrize("task", ["iris_short", "cancer_dropout"])
def test_hpx_forks_ends_where_the_prototype_it_was_built_from_ends(task):
    """hpx.Forks, run as a user runs it, against the training-loop prototype it implements
    (``halving-end-cool-z2-lost-last``) from 10x above the grid's best, on a short run: the same
    lr, the same weights (validation loss), on a task with dropout too."""
    from benchmarks.lr.__main__ import GRIDS, _load, best_of_grid

    i, lrs, _ = best_of_grid(task, _load(GRIDS))
    lr = lrs[i] * 10
    ours = execute(Run(task, "Forks", lr, 0, steps=60))
    proto = execute(Run(task, "halving-end-cool-z2-lost-last", lr, 0, steps=60))
    assert ours["end_lr"] != pytest.approx(lr)  # a challenger won: the adoption is compared too
    assert ours["end_lr"] == pytest.approx(proto["end_lr"], rel=1e-9)
    assert ours["val"] == pytest.approx(proto["val"], rel=1e-5)


def test_hpx_forks_with_a_final_cut_ends_where_its_prototype_ends():
    """hpx.Forks with a last cut to one (``Forks-2x``: 5% to 2, the final decision at 54%) against the
    prototype loop of that design (``late-ahead`` without looking ahead is the same loop with the
    copies at the scheduler's lr: ``late``), from 10x below the grid's best on a short run with
    dropout: a challenger wins before the end, and the same lr and weights come out."""
    from benchmarks.lr.__main__ import GRIDS, _load, best_of_grid

    i, lrs, _ = best_of_grid("cancer_dropout", _load(GRIDS))
    lr = lrs[i] / 10
    ours = execute(Run("cancer_dropout", "Forks-2x", lr, 0, steps=60))
    proto = execute(Run("cancer_dropout", "late", lr, 0, steps=60))
    assert ours["end_lr"] != pytest.approx(lr)
    assert ours["end_lr"] == pytest.approx(proto["end_lr"], rel=1e-9)
    assert ours["val"] == pytest.approx(proto["val"], rel=1e-5)


def test_agreement_counts_the_cells_both_methods_ran_and_names_those_that_differ():
    from benchmarks.lr.__main__ import agreement

    a = {"t|A|0.1|0": {"val": 1.0, "end_lr": 0.1}, "t|A|0.1|1": {"val": 2.0, "end_lr": 0.1},
         "t|A|1|0": {"val": None, "end_lr": 1.0}, "t|A|10|0": {"val": 1.0, "end_lr": 1.0},
         "u|A|1|0": {"val": 1.0, "end_lr": 1.0}}
    b = {"t|B|0.1|0": {"val": 1.0 + 1e-7, "end_lr": 0.1}, "t|B|0.1|1": {"val": 2.1, "end_lr": 0.1},
         "t|B|1|0": {"val": None, "end_lr": 1.0}, "t|B|10|0": {"val": 1.0, "end_lr": 3.16}}
    both, differ = agreement("A", "B", a, b)
    assert both == 4 and differ == ["t|A|0.1|1", "t|A|10|0"]


def test_the_coexplore_forks_route_ends_at_a_fork_of_the_lr_or_of_the_knob():
    """The co-exploration benchmark's forks route (hpx.Forks with the dropout knob forked), on a short
    run: it ends at one fork's setting, an lr multiple at the start's dropout or a dropout 0.2 away
    at the start's lr."""
    from benchmarks.lr import coexplore

    task = replace(get_task("moons_dropout"), steps=30)
    model = task.model(0)
    opt = task.optimizer(model, 3e-3)
    sched = task.scheduler(opt)
    coexplore._set_knob(model, opt, "dropout", 0.3)
    gen = torch.Generator().manual_seed(0)
    final, out = coexplore._forks_route(task, model, opt, sched, [task.sample(gen) for _ in range(30)],
                                        "dropout", 3e-3)
    settings = [(3e-3 * 10 ** (k / 2), 0.3) for k in range(-2, 3)] + [(3e-3, 0.1), (3e-3, 0.5)]
    assert any(out["lr"] == pytest.approx(lr) and out["knob"] == pytest.approx(p) for lr, p in settings)
    assert final is model and all(m.p == pytest.approx(out["knob"]) for m in model.modules()
                                  if isinstance(m, torch.nn.Dropout))


def test_a_reserve_fork_a_decade_below_the_first_cuts_best_runs_to_the_end():
    cuts = ((0.1, 2), (0.5, 2), (1.0, 1))
    mults = (1.0, 0.1, 0.3, 3.0, 10.0)
    # from 3x the first cut's best scores 1x: without a reserve it keeps 1x and 0.3x and drops 0.1x;
    # with one, 0.1x (a decade below the best) goes on too, to the end
    _, _, _, free = _record_steps("halving", 3.0, mults=mults, cuts=cuts, protect=True)
    _, _, _, kept = _record_steps("halving", 3.0, mults=mults, cuts=cuts, protect=True, reserve=10.0)
    assert {f for f, _ in free[30:40]} == {0.3, 1.0}
    assert {f for f, _ in kept[30:40]} == {0.1, 0.3, 1.0} and 0.1 in {f for f, _ in kept[-25:]}
    # a reserve that is not the second cut's best still runs to the end beside the two it keeps
    _, _, _, three = _record_steps("halving", 10.0, mults=(1.0, 0.01, 0.1, 10.0), cuts=cuts, protect=True,
                                   reserve=10.0)
    assert {f for f, _ in three[-25:]} == {0.01, 0.1, 1.0}
    # from a start far too low the first cut's best is 10x: the fork a decade below it is the
    # start, which every cut keeps anyway, so nothing changes
    _, _, _, low = _record_steps("halving", 1e-3, mults=mults, cuts=cuts, protect=True)
    _, _, _, low_r = _record_steps("halving", 1e-3, mults=mults, cuts=cuts, protect=True, reserve=10.0)
    assert [f for f, _ in low] == [f for f, _ in low_r]


def test_a_task_with_its_probe_cut_is_the_same_task_with_fewer_probe_examples():
    full = get_task("teacher_long")
    cut = get_task("teacher_long@probe150")
    (x, y), = cut.probe()
    assert cut.name == "teacher_long@probe150" and len(y) == 150
    assert torch.equal(x, full.probe()[0][0][:150])  # the first examples, in order
    assert torch.equal(cut.data()["train"][0], full.data()["train"][0]) and cut.steps == full.steps
    # a language model's probe is cut in whole windows, at most n tokens (one window at least)
    lm = get_task("char_gru@probe200")
    assert [tuple(y.shape) for _, y in lm.probe()] == [(6, 32)]
    assert sum(y.numel() for _, y in get_task("char_gru@probe10").probe()) == 32
    for bad in ("teacher_long@probe0", "teacher_long@probe", "teacher_long@probe1e3"):
        with pytest.raises(SystemExit, match="positive whole number"):
            get_task(bad)
    with pytest.raises(SystemExit, match="unknown task 'nope'"):
        get_task("nope@probe10")



def test_a_task_whole_trains_on_its_probe_too_and_nothing_else_changes():
    base = get_task("wine_short")
    whole = get_task("wine_short@whole")
    (bx, by), probe = base.data()["train"], base.probe()
    wx, wy = whole.data()["train"]
    assert whole.name == "wine_short@whole" and len(wy) == len(by) + sum(len(y) for _, y in probe)
    assert torch.equal(wx, torch.cat([bx, *(x for x, _ in probe)]))  # the training rows, then the probe's
    assert torch.equal(wy, torch.cat([by, *(y for _, y in probe)]))
    assert whole.data()["val"] is base.data()["val"] and whole.probe() is probe
    same = ("steps", "batch", "optim", "sched", "center")
    assert [getattr(whole, k) for k in same] == [getattr(base, k) for k in same]
    with pytest.raises(SystemExit, match="char_gru trains on a text's windows"):
        get_task("char_gru@whole")
    with pytest.raises(SystemExit, match="unknown task 'nope'"):
        get_task("nope@whole")


def test_carve_reads_the_seeds_paired_ratio_and_marks_a_cost_beyond_2_percent_and_2_se():
    from benchmarks.lr import carve
    from benchmarks.lr.__main__ import GRIDS, _load
    grids = _load(GRIDS)
    pairs = carve._runs("wine_short", grids)
    assert [c.seed for c, _ in pairs] == list(carve.SEEDS) and all(c.key in grids for c, _ in pairs[:2])
    assert all(w.task == "wine_short@whole" and w.lr == c.lr for c, w in pairs)

    def store(ratios):  # carved runs of the seeds after 1, and whole runs making each seed's ratio
        carved = [grids[c.key]["val"] for c, _ in pairs[:2]] + [0.05, 0.06, 0.04, 0.05][:len(pairs) - 2]
        out = {c.key: {"val": v} for (c, _), v in zip(pairs[2:], carved[2:])}
        out.update({w.key: {"val": v / r} for (_, w), v, r in zip(pairs, carved, ratios)})
        return out

    n = len(pairs)
    steady = [1.10, 1.12, 1.08, 1.11, 1.09, 1.10][:n]  # carving costs about 10%, seed after seed
    (row,) = carve.rows(["wine_short"], grids, store(steady))
    assert row["ratio"] == pytest.approx(math.exp(sum(map(math.log, steady)) / n))
    assert carve._worse(row) and row["pairs"] == n
    (noisy,) = carve.rows(["wine_short"], grids, store([1.3, 0.8, 1.25, 0.85, 1.2, 0.9][:n]))
    assert noisy["ratio"] > 1.02 and not carve._worse(noisy)  # within its own noise
    (small,) = carve.rows(["wine_short"], grids, store([1.01] * n))
    assert not carve._worse(small)  # steady, but within 2%
    assert "| wine_short |  | 23% |" in carve.section(["wine_short"], grids, store(steady))

def test_probesize_counts_the_bar_for_the_whole_probe_and_each_cut():
    from benchmarks.lr.__main__ import bar_counts as counts
    from benchmarks.lr.probesize import _as_base, markdown

    def row(start, vs_plain, vs_oracle, end):
        return {"start": start, "vs_plain": vs_plain, "vs_oracle": vs_oracle, "end_vs_oracle": end}

    good = [row("0.1x", 0.9, 1.0, 1.0), row("1x", 1.0, 1.0, 1.0), row("10x", 0.5, 1.01, 1.0)]
    kept = [row("0.1x", 1.0, 1.3, 0.1), row("1x", 1.0, 1.0, 1.0), row("10x", 1.0, 1.2, 10.0)]
    assert counts(good) == (1, 1, 2, 2, 3, 3) and counts(kept) == (1, 1, 0, 2, 1, 3)
    assert counts([row("1x", math.nan, 1.0, 1.0)])[:2] == (0, 1)  # a NaN ratio is not "no harm"
    md = markdown("Forks", [100], ["teacher_long"], {"teacher_long": good}, {("teacher_long", 100): kept})
    assert "| teacher_long |  | 400: 1/1, 2/2, 3/3 | 1/1, 0/2, 1/3 |" in md
    assert "--sizes 100" in md
    # a cut task's runs are read under the base task's keys, one method only
    store = {"teacher_long@probe100|Forks|0.001|0": {"val": 1.0}, "teacher_long|Forks|0.001|0": {"val": 2.0},
             "teacher_long@probe100|autolr|0.001|0": {"val": 3.0}}
    assert _as_base(store, "teacher_long@probe100", "teacher_long", "Forks") == {
        "teacher_long|Forks|0.001|0": {"val": 1.0}}


def test_an_early_drop_leaves_the_start_alone_only_when_its_annealed_copy_wins_by_z():
    from benchmarks.lr import prototypes
    from benchmarks.lr.run import plain_train

    cuts = ((0.25, 2), (1.0, 1))
    kw = {"mults": (1.0, 1e-3, 1e-4), "cuts": cuts, "protect": True, "cool": 0.05, "confidence": 2.0}
    prototypes.steps_taken(reset=True)
    task, final, factor, dropped = _record_steps("halving", 1.0, drop=2.0, **kw)
    assert prototypes.steps_taken(reset=True) == len(dropped)
    # 3 forks to step 15, an annealed copy of each (3 steps), then the start alone: 45 + 9 + 45
    assert len(dropped) == 99 and {f for f, _ in dropped[-45:]} == {1.0} and factor == 1.0
    model = task.model(0)
    opt = task.optimizer(model, 1.0)
    gen = torch.Generator().manual_seed(3)
    plain = plain_train(task, model, opt, task.scheduler(opt), [task.sample(gen) for _ in range(60)])
    assert task.evaluate(final) == task.evaluate(plain)  # the rest of the run is plain training
    # a bar the copy does not clear keeps the challenger to the end, where the test judges
    _, _, _, kept = _record_steps("halving", 1.0, drop=1e9, **kw)
    assert len(kept) == 45 + 9 + 2 * 45


def test_the_bar_table_reads_each_row_against_its_threshold(tmp_path, monkeypatch):
    from benchmarks.lr import bar

    def row(task, start, vs_plain, vs_oracle, end, lost=False):
        return {"task": task, "start": start, "vs_plain": vs_plain, "vs_oracle": vs_oracle,
                "end_vs_oracle": end, "lost": lost}

    good = [row(f"t{i}", s, 1.0, 1.0, 1.0) for i in range(10) for s in ("0.1x", "1x", "10x")]
    harm, rec, warm, near, lost = bar._suite_rows(good)
    assert warm == "no OneCycleLR task in this set"
    assert near == "30 of 30 cells (100%) (met)"
    assert harm == "10 of 10 tasks (100%) <= 1.02; the largest 1.000 (met)"
    assert rec.startswith("20 of 20 cells (100%)") and rec.endswith("(met)") and lost == "0 (met)"
    # one task at 1.03: still 90% <= 1.02, and all <= 1.05; a second at 1.06 breaks both
    one = [row("t0", "1x", 1.03, 1.03, 1.0), *good[3:], *good[:1], *good[2:3]]
    assert bar._suite_rows(one)[0].endswith("(met)")
    two = [*one, row("t10", "1x", 1.06, 1.06, 1.0)]
    assert bar._suite_rows(two)[0] == "9 of 11 tasks (82%) <= 1.02; the largest 1.060 (not met)"
    # a recovered cell that is still more than 2% worse than plain at its start fails the row
    worse = [*good, row("t11", "10x", 1.03, 1.0, 1.0)]
    assert bar._suite_rows(worse)[1] == "21 of 21 cells (100%); at most 1.030x plain at that start (not met)"
    assert bar._suite_rows([*good, row("t12", "1x", 1.0, 1.0, 4.0, lost=True)])[4] == "1 (not met)"
    # recovery under a warm-up: the OneCycleLR tasks' cells from 10x above only, against 75%
    onecycle = [row("digits_mlp", "10x", 1.0, 1.2, 10.0), row("wine_short", "10x", 1.0, 1.04, 1.0),
                row("digits_cnn", "10x", 1.0, 1.5, 10.0), row("wine_short", "0.1x", 1.0, 1.5, 1.0)]
    assert bar._suite_rows([*good, *onecycle])[2] == "1 of 2 cells (50%) (not met)"
    assert bar._suite_rows([*good, *onecycle[1:]])[2] == "1 of 1 cells (100%) (met)"
    # the cost row: the method's optimizer steps over plain's, per task of the set, from the cost
    # store, against 2.0x; its seconds over plain's beside them (tests/test_report_stores.py: more)
    cost = tmp_path / "cost.json"
    cost.write_text(json.dumps({"digits_mlp": {"plain": 1.0, "Forks": 3.0, "Forks steps": 2.9},
                                "char_gru": {"plain": 2.0, "Forks": 2.2, "Forks steps": 2.91}}))
    monkeypatch.setattr(bar, "COST", cost)
    n_design = sum(t not in HELD_OUT for t in TASKS)
    assert bar._cost_row("Forks", held=False) == (
        f"2.90-2.91x plain training's optimizer steps over 2 tasks ({n_design - 2} not measured: "
        "`python -m benchmarks.lr.cost`) (not met); wall time median 2.05x plain's, 1.10-3.00 (not judged)")
    assert bar._cost_row("Forks", held=True) == "no runs: `python -m benchmarks.lr.cost`"


@pytest.mark.parametrize("name", ["digits_mlp", "char_mlp", "char_gru"])
def test_a_runs_losses_per_unit_are_the_probe_loss_taken_apart(name):
    """``execute(..., units=True)`` (what ``benchmarks.lr.trainsplit`` replays the end's test on):
    one loss per probe unit (an example; a language model's sequence) whose mean is the run's probe
    loss, a fixed training sample of at most 2,000 units, and plain training's loss at every step."""
    run = Run(name, "plain", get_task(name).center, 0, steps=12)
    out = execute(run, units=True)
    probe = get_task(name).probe()
    units = out["units"]
    assert len(units["probe"]) == sum(len(y) for _, y in probe)
    assert math.isclose(sum(units["probe"]) / len(units["probe"]), out["probe"], rel_tol=1e-5)
    assert 0 < len(units["train"]) <= 2000 and len(out["step_losses"]) == 12
    assert execute(run, units=True)["units"] == units  # the training sample is fixed


def test_the_mechanic_prototype_learns_a_scale_that_divides_the_start_out():
    """Mechanic's weights are ``x_ref + s * Delta``: from starts a hundredfold apart (SGD, whose
    steps are linear in the lr) the learnt scale absorbs most of the difference, so the lr each
    ends at (``s`` times its own) agrees within 2x, and both train."""
    from benchmarks.lr.prototypes import mechanic

    task = replace(TASKS["digits_mlp"], steps=200)

    def run(lr):
        model = task.model(0)
        opt = task.optimizer(model, lr)
        gen = torch.Generator().manual_seed(3)
        batches = [task.sample(gen) for _ in range(task.steps)]
        final, s = mechanic(task, model, opt, task.scheduler(opt), batches)
        return final, s * lr

    (low, lr_low), (high, lr_high) = run(0.1), run(10.0)
    assert 0.5 < lr_low / lr_high < 2
    initial = task.evaluate(task.model(0))
    assert task.evaluate(low) < 0.2 * initial and task.evaluate(high) < 0.2 * initial


@pytest.mark.parametrize("rule", ["steep", "min10"])
def test_the_range_test_sweeps_a_copy_for_its_budget_then_trains_plainly_at_its_suggestion(rule):
    """lr_find's prototype: the sweep trains a copy for 100 steps at rising lrs (the user's
    model untouched), then the run is plain training at the suggested multiple of the start's lr."""
    from benchmarks.lr.prototypes import range_test, steps_taken
    from benchmarks.lr.run import plain_train

    task = replace(TASKS["digits_mlp"], steps=100)
    gen = torch.Generator().manual_seed(3)
    batches = [task.sample(gen) for _ in range(task.steps)]
    model = task.model(0)
    opt = task.optimizer(model, 0.1)
    steps_taken(reset=True)
    final, factor = range_test(task, model, opt, task.scheduler(opt), batches, rule=rule)
    # the sweep stopped before its last lr (SGD at lr 10 blows the loss up on digits), after the
    # points the steepest-descent rule skips
    assert 100 + 12 <= steps_taken(reset=True) < 100 + 100
    assert 1e-8 <= factor * 0.1 <= 10
    plain = task.model(0)
    popt = task.optimizer(plain, 0.1 * factor)
    plain_train(task, plain, popt, task.scheduler(popt), batches)
    for a, b in zip(final.parameters(), plain.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_eval_refuses_a_stored_grid_that_this_machine_does_not_repeat(tmp_path, monkeypatch, capsys):
    """A method run here is compared with plain runs stored from the grid; where the stored grid
    came from other floating-point kernels, eval names the run that differs and the fix, and runs
    nothing (unless --mixed-numerics)."""
    from benchmarks.lr import __main__ as suite

    monkeypatch.setattr(suite, "RUNS", tmp_path)
    args = ["eval", "--quick", "--method", "Forks", "--tasks", "iris_short", "--jobs", "1"]
    assert suite.main(args) == 0  # the grid made here repeats here
    grids_path = tmp_path / "grids-quick.json"
    grids = json.loads(grids_path.read_text())
    i, lrs, _ = best_of_grid("iris_short", grids, suite.QUICK_STEPS)
    key = Run("iris_short", "plain", lrs[i], 0, suite.QUICK_STEPS).key
    grids[key]["val"] *= 1.3  # as if another machine's kernels had made it
    grids_path.write_text(json.dumps(grids))
    (tmp_path / "Forks-quick.json").unlink()
    with pytest.raises(SystemExit, match=r"does not repeat on this machine.*grid --fresh"):
        suite.main(args)
    assert not (tmp_path / "Forks-quick.json").exists()
    assert suite.main([*args, "--mixed-numerics"]) == 0
    assert len(json.loads((tmp_path / "Forks-quick.json").read_text())) == 3 * 2


def test_fresh_starts_the_named_tasks_over_and_keeps_every_other_tasks_runs(tmp_path, monkeypatch):
    """``--fresh --tasks X`` reruns X's runs and writes the store back with the other tasks' runs
    as they were (it used to write back X's alone: a committed store lost every other task)."""
    from benchmarks.lr import __main__ as suite

    monkeypatch.setattr(suite, "RUNS", tmp_path)
    both = ["eval", "--quick", "--method", "Forks", "--jobs", "1", "--tasks", "iris_short", "wine_short"]
    assert suite.main(both) == 0
    paths = {"eval": tmp_path / "Forks-quick.json", "grid": tmp_path / "grids-quick.json"}
    for command, path in paths.items():
        store = json.loads(path.read_text())
        for r in store.values():
            r["val"] = -1.0  # a mark each rerun replaces
        path.write_text(json.dumps(store))
        args = [command, "--quick", "--method", "Forks", "--jobs", "1", "--fresh", "--tasks", "iris_short"]
        assert suite.main(args) == 0
        after = json.loads(path.read_text())
        assert sorted(after) == sorted(store)  # no task's runs dropped
        assert all((r["val"] == -1.0) == k.startswith("wine_short|") for k, r in after.items()), command
    assert suite.forget({"a|x": 1, "a@whole|x": 2, "b|x": 3}, ["a"]) == {"a@whole|x": 2, "b|x": 3}


def test_here_makes_this_machines_own_grid_and_runs_beside_the_committed_ones(tmp_path, monkeypatch, capsys):
    """``--here``: a grid of this machine's own (made where it lacks a task) and the methods' runs
    against it, in runs/lr; the committed grid, stores and docs are neither read nor written."""
    from benchmarks.lr import __main__ as suite

    doc = tmp_path / "benchmarks.md"
    doc.write_text("the docs\n")
    stored = tmp_path / "stored"
    stored.mkdir()
    # a committed grid whose best lr is another one (the top of the grid), and a committed store
    real = {k: v for k, v in suite._load(suite.GRIDS).items() if k.startswith("iris_short|plain|")}
    top = max(r["lr"] for r in real.values())
    (stored / "grids.json").write_text(json.dumps({k: {**v, "val": 0.01 if v["lr"] == top else 1.0}
                                                   for k, v in real.items()}))
    (stored / "Forks.json").write_text("{}")
    before = {p.name: p.read_bytes() for p in stored.iterdir()}
    for name, path in (("RUNS", tmp_path / "runs"), ("STORED", stored), ("GRIDS", stored / "grids.json"),
                       ("DOC", doc)):
        monkeypatch.setattr(suite, name, path)
    report = ["report", "--here", "--method", "Forks", "--tasks", "iris_short"]
    with pytest.raises(SystemExit, match=r"grids-here.json holds no results for iris_short.*"
                                         r"grid --here --tasks iris_short"):
        suite.main(report)  # no grid here yet: the command that makes it is named
    assert suite.main(["eval", "--here", "--method", "Forks", "--tasks", "iris_short", "--jobs", "1"]) == 0
    grids = json.loads((tmp_path / "runs" / "grids-here.json").read_text())
    runs = json.loads((tmp_path / "runs" / "Forks-here.json").read_text())
    assert {k.split("|")[0] for k in grids} == {"iris_short"} and len(grids) >= 9 * 2
    # the starts are read off this machine's grid, not the committed one (whose best is its top)
    here = suite.cells("iris_short", grids)
    keys = [Run("iris_short", "Forks", lr, s).key for lr in here.values() for s in suite.SEEDS]
    assert sorted(runs) == sorted(keys)
    assert here["1x"] != top == suite.cells("iris_short", json.loads(before["grids.json"]))["1x"]
    assert {p.name: p.read_bytes() for p in stored.iterdir()} == before  # nothing committed written
    capsys.readouterr()
    assert suite.main(report) == 0  # read from this machine's runs; the docs are not written
    assert "| iris_short |" in capsys.readouterr().out and doc.read_text() == "the docs\n"
    # a grid stopped part way (a seed's run missing) is not a grid: the same refusal
    grids.pop(next(k for k in grids if k.endswith("|1")))
    assert not suite.grid_complete("iris_short", grids) and suite.grid_complete("iris_short", real)


def test_same_reads_the_stores_of_the_mode_it_is_given(tmp_path, monkeypatch, capsys):
    """``same --quick`` (or ``--here``) compares the two methods' quick (or this machine's) stores,
    not the full-length ones."""
    from benchmarks.lr import __main__ as suite

    monkeypatch.setattr(suite, "RUNS", tmp_path)
    monkeypatch.setattr(suite, "STORED", tmp_path / "stored")  # the full-length stores: none
    for suffix in ("-quick", "-here"):
        for method, lr in (("Forks", 0.1), ("halving", 0.3)):
            run = {"val": 0.5, "end_lr": lr}
            (tmp_path / f"{method}{suffix}.json").write_text(json.dumps({f"iris_short|{method}|0.1|0": run}))
    assert suite.main(["same", "--quick", "--method", "Forks", "halving", "--tasks", "iris_short",
                       "--jobs", "1"]) == 0
    assert "1 cells run by both; the same lr and validation loss in 0" in capsys.readouterr().out
    assert suite.main(["same", "--here", "--method", "Forks", "halving"]) == 0
    assert "1 cells run by both; the same lr and validation loss in 0" in capsys.readouterr().out


def test_two_grids_made_with_other_rounding_are_compared_run_by_run():
    """benchmarks.lr.numerics: the same runs in two stored grids; a run that ended elsewhere counts
    as apart (and how far), one equal bit for bit as the same, and a best that moved is named."""
    from benchmarks.lr.numerics import compare, markdown

    lrs = [0.1 * 10 ** (k / 2) for k in range(-4, 5)]
    there = {Run("iris_short", "plain", lr, s).key: {"lr": lr, "val": 0.5 + abs(k), "steps": None}
             for k, lr in enumerate(lrs) for s in SEEDS}
    here = json.loads(json.dumps(there))
    best = Run("iris_short", "plain", lrs[0], 0).key
    here[best]["val"] = 0.5 * 1.5   # 50% apart, still the best
    rows = compare(there, here)
    assert [r["task"] for r in rows] == ["iris_short"]
    (r,) = rows
    assert (r["runs"], r["same"], r["apart"]) == (18, 17, 1)
    assert r["largest"] == pytest.approx(0.5) and r["at_best"] == pytest.approx(1.25)
    here[Run("iris_short", "plain", lrs[1], 0).key]["val"] = 0.01
    here[Run("iris_short", "plain", lrs[1], 1).key]["val"] = 0.01
    assert "(moved)" in markdown(compare(there, here))


def test_the_noise_table_reads_each_nudged_pair_against_the_oracle():
    """benchmarks.lr.noise: plain training at the grid's best lr nudged by k parts in a million, its
    2-seed mean over the grid's; the summary counts the pairs and tasks past 2% and 5%."""
    from benchmarks.lr import noise

    lrs = [0.1 * 10 ** (k / 2) for k in range(-4, 5)]
    grids = {Run("iris_short", "plain", lr, s).key: {"lr": lr, "val": 0.5 + abs(k), "steps": None}
             for k, lr in enumerate(lrs) for s in SEEDS}  # the best: lrs[0], 0.5 on both seeds
    store = {noise._nudged("iris_short", grids, k, s).key: {"val": 0.5 * f}
             for k, f in zip(noise.NUDGES, (1.0, 1.03, 1.10)) for s in SEEDS}
    (row,) = noise.rows(["iris_short"], grids, store)
    assert row["oracle"] == 0.5 and row["ratios"] == pytest.approx([1.0, 1.03, 1.10])
    assert noise._nudged("iris_short", grids, 2, 0).lr == pytest.approx(lrs[0] * (1 + 2e-6), rel=1e-12)
    md = noise.markdown([row])
    assert "1 end more than 5% above the oracle and 2 more than 2%" in md
    assert "above 1.05 on 1 of 1 (iris_short)" in md


def test_the_bar_says_what_a_perfect_search_would_read_from_the_nudged_runs(tmp_path, monkeypatch):
    """bar.resolution: the nudged runs of benchmarks.lr.noise counted against the quality rows'
    5% and 2%, design and held-out tasks apart; until they exist it names the command."""
    from benchmarks.lr import bar, noise

    monkeypatch.setattr(noise, "PATH", tmp_path / "noise.json")
    assert "no runs yet (`python -m benchmarks.lr.noise`)" in bar.resolution()[1]
    grids = _load(GRIDS)
    store = {}
    for t in TASKS:
        oracle = best_of_grid(t, grids)[2][best_of_grid(t, grids)[0]]
        for k, f in zip(noise.NUDGES, (1.0, 1.03, 1.10 if t == "digits_lstm" else 1.0)):
            for s in SEEDS:
                store[noise._nudged(t, grids, k, s).key] = {"val": oracle * f}
    (tmp_path / "noise.json").write_text(json.dumps(store))
    line = bar.resolution()[1]
    n_design = sum(t not in HELD_OUT for t in TASKS)
    n_held = len(TASKS) - n_design
    assert (f"design: {3 * n_design - 1} of {3 * n_design} nudged pairs within 5% of the oracle and "
            f"{n_design * 2 - 1} within 2%; {n_design - 1} of {n_design} tasks") in line
    assert f"held-out: {3 * n_held} of {3 * n_held} nudged pairs within 5%" in line


def test_the_cost_command_can_flush_subnormal_floats_while_it_measures_and_restores_the_default(
        monkeypatch, capsys):
    """--flush-denormal: the runs are timed with subnormal floats flushed to 0 (a diverging fork of
    an LSTM then runs at the others' speed on a CPU), torch's default is put back after, and the
    docs' section (the default numerics') is not written."""
    from benchmarks.lr import cost

    calls = []
    real = torch.set_flush_denormal
    monkeypatch.setattr(torch, "set_flush_denormal", lambda on: calls.append(on) or real(on))
    monkeypatch.setattr(cost, "_save", lambda *a: pytest.fail("the section's store was written"))
    args = ["--tasks", "iris_short", "--repeats", "1", "--method", "Forks", "--flush-denormal"]
    assert cost.main(args) == 0
    assert calls == [True, False]
    assert "| iris_short |" in capsys.readouterr().out
    assert torch.tensor(1e-39, dtype=torch.float32) * 1 != 0  # subnormals are back


def _split_halving(**kw):
    """halving(split=True) on 60 steps of digits_mlp (cuts at 10% to 3 and 25% to 2): the run's
    batches and the input of every optimizer step taken, in order."""
    from benchmarks.lr import prototypes

    task = replace(TASKS["digits_mlp"], steps=60)
    model = task.model(0)
    opt = task.optimizer(model, 0.1)
    gen = torch.Generator().manual_seed(3)
    batches = [task.sample(gen) for _ in range(task.steps)]
    seen = []
    real = prototypes._step
    prototypes._step = lambda t, state, b, f: seen.append(b[0]) or real(t, state, b, f)
    try:
        prototypes.halving(task, model, opt, task.scheduler(opt), batches,
                           cuts=((0.1, 3), (0.25, 2), (1.0, 1)), protect=True, split=True, **kw)
    finally:
        prototypes._step = real
    return batches, seen


def test_split_forks_share_each_batch_between_the_forks_alive():
    """halving(split=True): at every step the forks alive train on disjoint parts of the batch,
    which together are the batch (five parts, then three, then two after the cuts)."""
    batches, seen = _split_halving()
    assert sum(len(x) for x in seen) == sum(len(b[0]) for b in batches)  # every row once, no more
    assert len(seen) == 5 * 6 + 3 * 9 + 2 * 45
    assert torch.equal(torch.cat(seen[:5]), batches[0][0])  # the five parts of the first batch, in order


def test_split_forks_take_whole_batches_once_no_more_than_split_over_are_alive():
    """halving(split=True, split_over=2): parts while 5 and 3 forks are alive, whole batches for
    your run and the challenger after the second cut."""
    batches, seen = _split_halving(split_over=2)
    b = len(batches[0][0])
    sizes = [len(x) for x in seen]
    assert len(sizes) == 5 * 6 + 3 * 9 + 2 * 45
    assert sum(sizes[:5 * 6 + 3 * 9]) == 15 * b and set(sizes[5 * 6 + 3 * 9:]) == {b}


def test_the_bar_says_what_the_probes_own_pick_would_read(tmp_path, monkeypatch):
    """bar.probe_ceiling: the grid's runs' probe losses counted against the quality rows, design and
    held-out apart. A probe that agrees with validation reads every task within 2%; one task whose
    probe prefers the grid's largest lr loses exactly that task and its two runs' lr; a grid run
    without a probe loss makes it name the command instead."""
    from benchmarks.lr import bar

    grids = _load(GRIDS)
    fake = {k: {**r, "probe": r["val"]} for k, r in grids.items()}
    flipped = "digits_mlp"  # a design task; its grid's largest lr is far above its best
    lrs = grid_lrs(flipped, grids)
    i, _, means = best_of_grid(flipped, grids)
    for s in SEEDS:
        for lr in lrs:
            fake[Run(flipped, "plain", lr, s).key]["probe"] = -lr
    top = [grids[Run(flipped, "plain", lrs[-1], s).key]["val"] for s in SEEDS]
    assert None not in top and sum(top) / 2 > 1.05 * means[i] and lrs[-1] > 3 * lrs[i]
    path = tmp_path / "grids.json"
    path.write_text(json.dumps(fake))
    monkeypatch.setattr(bar, "GRIDS", path)
    import benchmarks.lr.__main__ as suite

    monkeypatch.setattr(suite, "RUNS", tmp_path)  # no stored ceiling runs to fill a gap from
    line = bar.probe_ceiling()[1]
    n_design = sum(t not in HELD_OUT for t in TASKS)
    n_held = len(TASKS) - n_design
    assert f"design: within 2% of the grid's best on {n_design - 1} of {n_design} tasks" in line
    assert f"within 5% on {n_design - 1} of {n_design}" in line
    assert f"held-out: within 2% of the grid's best on {n_held} of {n_held} tasks" in line
    design_lr3 = int(line.split("design:")[1].split("the lr within 3x in ")[1].split(" of")[0])
    assert design_lr3 <= 2 * n_design - 2
    del fake[Run(flipped, "plain", lrs[0], 0).key]["probe"]
    path.write_text(json.dumps(fake))
    assert "carry no probe loss yet (`python -m benchmarks.lr.ceiling`)" in bar.probe_ceiling()[1]


def test_the_end_tests_robust_statistics_read_a_heavy_tail_as_they_should():
    """benchmarks.lr.endtest: Yuen's statistic with nothing trimmed is the mean's z; the signed-rank
    statistic is 0 on differences symmetric about 0 and takes its sign from them; with one huge
    difference against the rest, the mean's z falls below 2 while the trimmed and rank statistics
    still read the lead the other differences show."""
    from benchmarks.lr.endtest import STATISTICS, signrank_z, trimmed_z
    from hpx.forks.fork import paired_gain

    g = torch.Generator().manual_seed(0)
    d = torch.randn(60, generator=g, dtype=torch.float64) + 0.5
    assert trimmed_z(d, 0.0) == pytest.approx(paired_gain(torch.zeros_like(d), d), rel=1e-12)
    assert STATISTICS["mean"](d) == pytest.approx(trimmed_z(d, 0.0), rel=1e-12)
    sym = torch.cat([d, -d])
    assert signrank_z(sym) == pytest.approx(0.0, abs=1e-12)
    assert signrank_z(d) > 2 and signrank_z(-d) == pytest.approx(-signrank_z(d))
    tailed = d.clone()
    tailed[0] = -200.0  # one example the challenger gets badly wrong
    assert STATISTICS["mean"](tailed) < 1
    assert trimmed_z(tailed, 0.1) > 2 and trimmed_z(tailed, 0.2) > 2 and signrank_z(tailed) > 2
    ties = torch.tensor([1.0, 1.0, 1.0, -1.0, 0.0, 2.0], dtype=torch.float64)
    # ranks of |d| with zeros dropped: the four 1s share rank 2.5, the 2 has rank 5
    w, n = 2.5 * 3 + 5, 5
    var = n * (n + 1) * (2 * n + 1) / 24 - (4 ** 3 - 4) / 48
    assert signrank_z(ties) == pytest.approx((w - n * (n + 1) / 4) / math.sqrt(var), rel=1e-12)


def test_the_end_tests_replay_counts_passes_by_where_they_start_and_what_validation_says():
    """benchmarks.lr.endtest.table: a pass from the grid's best onto a challenger more than 2% worse
    is a bad pass from 1x; from 10x off a pass of a challenger 5% better is a good one, of one more
    than 2% worse a bad one; each statistic is read at the threshold given."""
    from benchmarks.lr.endtest import STATISTICS, table

    def row(start, ratio, **z):
        return {"start": start, "ratio": ratio, **{k: z.get(k, 0.0) for k in STATISTICS}}

    rows = [row("1x", 1.10, mean=3.0, signrank=3.0), row("10x", 0.90, trim10=2.5, signrank=2.0),
            row("0.1x", 0.80, mean=2.0, trim10=2.0), row("10x", 1.30, trim20=5.0, signrank=1.9)]
    lines = {ln.split(" | ")[0][2:]: ln for ln in table(rows, 2.0).splitlines()[2:]}
    assert lines["mean"] == "| mean | 1 | 1 of 2 | 0 | 1 / 1 |"
    assert lines["trim10"] == "| trim10 | 0 | 2 of 2 | 0 | 2 / 0 |"
    assert lines["trim20"] == "| trim20 | 0 | 0 of 2 | 1 | 0 / 1 |"
    assert lines["signrank"] == "| signrank | 1 | 1 of 2 | 0 | 1 / 1 |"
    assert "passes at z >= 1.5" in table(rows, 1.5)


def test_the_replays_validation_ratio_handles_lost_runs_and_a_loss_of_zero():
    """trainsplit.val_ratio: a run can fit a small validation split exactly (wine_dropout does), so a
    start's loss of 0 must not divide by zero; a lost challenger is infinitely worse, a lost start
    infinitely better to leave."""
    from benchmarks.lr.trainsplit import val_ratio

    assert val_ratio(0.5, 0.25) == 0.5
    assert val_ratio(0.0, 0.0) == 1.0 and val_ratio(0.0, 0.1) == math.inf
    assert val_ratio(math.inf, 0.3) == 0.0 and val_ratio(0.3, math.inf) == math.inf
    assert val_ratio(math.nan, 0.3) == 0.0 and val_ratio(0.3, math.nan) == math.inf


def test_the_cost_command_keeps_each_tasks_row_and_writes_the_docs_only_when_every_task_has_one(
        tmp_path, monkeypatch, capsys):
    """benchmarks.lr.cost with the default methods: the tasks measured replace their rows of the
    store and the others are kept; the section is written (from the whole store, in the suite's
    order) only once every task has a row."""
    from benchmarks.lr import cost

    store = tmp_path / "cost.json"
    monkeypatch.setattr(cost, "COST", store)
    monkeypatch.setattr(cost, "DOC", tmp_path / "docs" / "benchmarks.md")
    (tmp_path / "docs").mkdir()
    doc = tmp_path / "docs" / "benchmarks.md"
    doc.write_text("# B\n\n<!-- lr-cost -->\nold\n<!-- /lr-cost -->\n")
    def measure(names, repeats, methods):
        cost._STEPS.clear()
        return [(n, 1.0, [3.0, 2.0]) for n in names]

    monkeypatch.setattr(cost, "measure", measure)
    others = {t: {"plain": 2.0, "Forks": 5.0, "autolr": 3.0, "Forks steps": 3.0}
              for t in TASKS if t not in ("iris_short", "wine_short")}
    store.write_text(json.dumps({**others, "gone_task": {"plain": 1.0}}))
    assert cost.main(["--tasks", "iris_short", "--repeats", "1"]) == 0
    kept = json.loads(store.read_text())
    assert kept["iris_short"] == {"plain": 1.0, "Forks": 3.0, "autolr": 2.0}
    assert "gone_task" not in kept and kept["digits_mlp"] == others["digits_mlp"]
    assert "no cost measured yet for wine_short" in capsys.readouterr().out
    assert "old" in doc.read_text()
    assert cost.main(["--tasks", "wine_short", "--repeats", "1"]) == 0
    text = doc.read_text()
    assert "old" not in text and "| iris_short |" in text and "| digits_mlp |" in text
    assert text.index("| digits_mlp |") < text.index("| wine_short |") < text.index("| iris_short |")
    assert "| wine_short |  | 100 | 1.00 | 3.00 | 3.00 | 2.00 | 2.00 |" in text


def _sweep_grid():
    """A synthetic task's grid for benchmarks.lr.sweep: 9 lrs half a decade apart, the validation
    loss lowest at index 4 on both seeds and the probe agreeing, each run's probe losses per example
    50 values spread around its mean (the run at index 4 spread half as wide, so that its
    difference with any other run has a spread the test can read)."""
    grids, store = {}, {}
    noise = torch.linspace(-0.5, 0.5, 50, dtype=torch.float64)
    for k in range(9):
        lr = 1e-3 * 10 ** (k / 2)
        for s in SEEDS:
            key = Run("syn", "plain", lr, s).key
            val = 1.0 + 0.1 * abs(k - 4)
            grids[key] = {"lr": lr, "val": val, "probe": val}
            store[key] = {"units": {"probe": (val + noise * (0.5 if k == 4 else 1.0)).tolist()}}
    return grids, store


def test_the_sweep_replay_keeps_the_start_unless_the_best_candidate_wins_by_z():
    """benchmarks.lr.sweep.kept: the lowest-scoring candidate replaces the start when it scores
    lower (z = 0) and, with z > 0, only when it wins by z standard errors of the per-example
    difference; read counts the bar's rows on what each start keeps."""
    from benchmarks.lr import sweep
    from hpx.forks.fork import paired_gain

    grids, store = _sweep_grid()
    decade = sweep.SWEEPS["3 runs, a decade apart"]
    assert sweep.kept("syn", 6, 0, decade, 0.0, grids, store) == 4  # the probe agrees with validation
    assert sweep.kept("syn", 4, 0, decade, 0.0, grids, store) == 4  # the best start stays
    # the per-example difference of runs 4 and 6: a mean gap of 0.2 over a spread the test reads
    units = [torch.tensor(store[Run("syn", "plain", 1e-3 * 10 ** (k / 2), 0).key]["units"]["probe"])
             for k in (4, 6)]
    gain = paired_gain(*units)
    assert 0 < gain < math.inf
    assert sweep.kept("syn", 6, 0, decade, gain * 0.99, grids, store) == 4
    assert sweep.kept("syn", 6, 0, decade, gain * 1.01, grids, store) == 6
    r = sweep.read(["syn"], decade, 0.0, grids, store)
    assert (r["harm"], r["largest"], r["recovered"], r["off"], r["near"], r["cells"]) == (1, 1.0, 2, 2, 3, 3)
    kept_starts = sweep.read(["syn"], decade, 1e9, grids, store)  # nothing passes: every start stays
    assert (kept_starts["recovered"], kept_starts["near"]) == (0, 1)


def test_the_replays_name_the_command_that_stores_their_runs_when_they_are_missing(tmp_path, monkeypatch):
    """benchmarks.lr.endtest and benchmarks.lr.sweep read the runs benchmarks.lr.trainsplit stores;
    without them they exit naming it and the tasks missing, instead of failing on a missing key."""
    from benchmarks.lr import endtest, sweep, trainsplit

    empty = tmp_path / "units.json"
    empty.write_text("{}")
    monkeypatch.setattr(trainsplit, "STORE", empty)
    for module in (endtest, sweep):
        with pytest.raises(SystemExit, match=r"no runs of digits_mlp, .*python -m benchmarks.lr.trainsplit"):
            module.main([])
