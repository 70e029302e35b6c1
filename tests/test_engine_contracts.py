"""hpx.Engine with your own knobs, strategies, controllers and signals: what it refuses (with a
message naming the object and the fix), what it leaves as it was when it refuses, and the
contracts it keeps for objects that follow them (resume, per-step schedules, history)."""

from __future__ import annotations

import copy
import logging

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hpx
from hpx.controller import ControllerStep
from hpx.errors import ConfigError
from hpx.search import Decision


def _model(drop: float = 0.1, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(drop), nn.Linear(16, 2))


def _loss(rep, b):
    return F.cross_entropy(rep.model(b[0]), b[1])


def _batches(n: int, seed: int = 1, size: int = 16) -> list:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        x = torch.randn(size, 8, generator=g)
        out.append((x, (x[:, 0] > 0).long()))
    return out


def _sgd(lr: float = 0.1):
    return lambda m: torch.optim.SGD(m.parameters(), lr=lr)


class _Fixed:
    """A strategy that returns one decision at every sync."""

    def __init__(self, decision) -> None:
        self.decision = decision

    def start(self, view):
        return Decision()

    def acts_at(self, step):
        return True

    def decide(self, view):
        return self.decision

    def state_dict(self):
        return {}

    def load_state_dict(self, state):
        pass


# --- knobs belong to one engine; a constructor that raises changes nothing ------------------


def test_knobs_of_one_engine_are_refused_by_a_second_which_would_start_from_its_bases():
    knobs = [hpx.LearningRate("lr", spread=0.5)]
    first = hpx.Engine(_model(), _sgd(0.1), knobs, replicas=4, sync_every=5)
    for b in _batches(10):
        first.step(_loss, b)
    with pytest.raises(ConfigError, match=r"knob\(s\) \['lr'\] already belong to another hpx.Engine"):
        hpx.Engine(_model(), _sgd(0.01), knobs, replicas=4, sync_every=5)
    fresh = hpx.Engine(_model(), _sgd(0.01), [hpx.LearningRate("lr", spread=0.5)], replicas=4, sync_every=5)
    assert fresh.bases["lr"] == pytest.approx(0.01)


def test_a_constructor_that_raises_leaves_the_model_and_the_knobs_as_they_were():
    model = _model(drop=0.1)
    knobs = [hpx.Dropout(spread=0.08), hpx.LearningRate(spread=0.5, schedule=lambda t: None)]
    with pytest.raises(ConfigError, match="returned None at step 0"):
        hpx.Engine(model, _sgd(0.1), knobs, replicas=4, sync_every=5)
    assert model[2].p == 0.1  # no replica's value was written into your model
    model[2].p = 0.3  # you change the model and build again with the same declarations
    engine = hpx.Engine(model, _sgd(0.05), [knobs[0], hpx.LearningRate(spread=0.5)], replicas=4, sync_every=5)
    assert engine.bases["dropout"] == pytest.approx(0.3) and engine.bases["lr"] == pytest.approx(0.05)


# --- the settings a strategy or a controller of your own would ignore ------------------------


@pytest.mark.parametrize("setting", [dict(controller=False), dict(warmup=100), dict(meta_lr=0.0),
                                     dict(decay=0.5)])
def test_hdet_settings_beside_a_search_are_refused_as_ignored(setting):
    with pytest.raises(ConfigError, match=f"{next(iter(setting))} would be ignored: a search strategy"):
        hpx.Engine(_model(), _sgd(), [hpx.LearningRate(spread=0.5)], replicas=4,
                   search=hpx.search.HDET(), **setting)


def test_controller_settings_beside_a_controller_of_your_own_are_refused_and_warmup_is_not():
    mine = hpx.Controller(meta_lr=0.2)
    with pytest.raises(ConfigError, match="meta_lr would be ignored: a custom controller"):
        hpx.Engine(_model(), _sgd(), [hpx.LearningRate(spread=0.5)], replicas=4, controller=mine, meta_lr=0.1)
    engine = hpx.Engine(_model(), _sgd(), [hpx.LearningRate(spread=0.5)], replicas=4, controller=mine,
                        warmup=10)
    assert engine.search.warmup == 10  # HDET's own setting, around your controller


# --- a strategy's decision is checked before anything of the sync changes ----------------------


def _three_knobs():
    return [hpx.LearningRate(spread=0.5), hpx.Dropout(spread=0.05), hpx.WeightDecay(base=1e-3, spread=0.5)]


@pytest.mark.parametrize("decision, match", [
    (Decision(bases=[0.2]), r"bases must be 3 numbers, one per knob \['lr', 'dropout', 'weight_decay'\]"),
    (Decision(bases=[0.2, 0.1, 1e-3, 9.0, 9.0]), "bases must be 3 numbers"),
    (Decision(spreads=[0.1]), "spreads must be 3 numbers"),
    (Decision(bases=[float("inf"), 0.1, 1e-3]), r"bases must be finite.*lr=inf"),
])
def test_a_decision_the_engine_cannot_apply_is_refused_naming_the_strategy(decision, match):
    engine = hpx.Engine(_model(), lambda m: torch.optim.SGD(m.parameters(), lr=0.1, weight_decay=1e-3),
                        _three_knobs(), replicas=4, sync_every=5, search=_Fixed(decision))
    bases = dict(engine.bases)
    with pytest.raises(ValueError, match=r"the search's decide\(\) \(_Fixed\) returned a decision.*" + match):
        for b in _batches(5):
            engine.step(_loss, b)
    assert engine.bases == bases


def test_a_base_at_or_below_0_for_a_multiplicative_knob_is_kept_at_its_bound_and_named_once(caplog):
    engine = hpx.Engine(_model(), _sgd(), [hpx.LearningRate(spread=0.5, bounds=(1e-4, 1.0))], replicas=4,
                        sync_every=5, search=_Fixed(Decision(bases=[-0.05])))
    with caplog.at_level(logging.WARNING, logger="hpx"):
        for b in _batches(10):
            engine.step(_loss, b)
    assert engine.bases["lr"] == 1e-4
    assert caplog.text.count("moved knob 'lr' to -0.05, at or below 0; it is kept at its bound 0.0001") == 1


def test_a_strategy_returning_no_decision_is_a_type_error_naming_it():
    engine = hpx.Engine(_model(), _sgd(), [hpx.LearningRate(spread=0.5)], replicas=4, sync_every=5,
                        search=_Fixed(None))
    with pytest.raises(TypeError, match=r"\(_Fixed\) must return a hpx.search.Decision \(got NoneType\)"):
        for b in _batches(5):
            engine.step(_loss, b)


def test_a_numpy_integer_next_sync_is_taken_as_the_integer_it_is():
    engine = hpx.Engine(_model(), _sgd(), [hpx.LearningRate(spread=0.5)], replicas=4, sync_every=5,
                        search=_Fixed(Decision(next_sync=np.int64(3))))
    for b in _batches(8):
        engine.step(_loss, b)
    assert [r.step for r in engine.history] == [5, 8]


def test_a_controller_returning_something_else_than_a_controller_step_is_a_type_error():
    class Dicts(hpx.Controller):
        def update(self, *args, **kwargs):
            return {"bases": args[2]}

    engine = hpx.Engine(_model(), _sgd(), [hpx.LearningRate(spread=0.5)], replicas=4, sync_every=5,
                        controller=Dicts())
    with pytest.raises(TypeError, match=r"update\(\) \(Dicts\) must return a hpx.ControllerStep"):
        for b in _batches(5):
            engine.step(_loss, b)
    assert ControllerStep is hpx.ControllerStep


def test_a_signal_returning_a_list_is_a_type_error_naming_it():
    class Listy:
        def measure(self, ctx):
            return [0.5, 0.4, 0.3, 0.6]

    engine = hpx.Engine(_model(), _sgd(), [hpx.LearningRate(spread=0.5)], replicas=4, sync_every=5,
                        signal=Listy())
    with pytest.raises(TypeError, match=r"signal's measure\(\) \(Listy\) must return a tensor of 4 scores"):
        for b in _batches(5):
            engine.step(_loss, b)


def test_tensors_in_a_decisions_info_reach_the_history_file_as_numbers(tmp_path):
    path = tmp_path / "h.jsonl"
    engine = hpx.Engine(_model(), _sgd(), [hpx.LearningRate(spread=0.5)], replicas=4, sync_every=5,
                        history_file=str(path),
                        search=_Fixed(Decision(bases=[0.105], info={"weights": torch.full((4,), 0.25),
                                                                   "sigma": torch.tensor(0.5)})))
    for b in _batches(10):
        engine.step(_loss, b)
    back = hpx.load_history(str(path))
    assert [r.step for r in back] == [5, 10]
    assert back[0].weights == [0.25] * 4 and back[0].sigma == 0.5
    spread = engine.values("lr")
    assert sum(spread) / len(spread) == pytest.approx(0.105)  # the sync finished: values drawn anew


# --- knobs of your own -------------------------------------------------------------------------


def test_a_spread_past_the_bounds_is_named_when_the_base_is_read_from_the_replica(caplog):
    """Refused by the engine when the knob is declared with its base (the knob itself is accepted:
    hpx.Forks leaves a side past a bound out); with a base read from your model or optimizer (a
    dropout rate of 0) the engine trains on, clamping, and says so (it did not)."""
    with caplog.at_level(logging.WARNING, logger="hpx"):
        hpx.Engine(_model(), _sgd(0.1), [hpx.LearningRate(span=10, bounds=(0.05, 1.0))], replicas=4)
        hpx.Engine(_model(drop=0.1), _sgd(0.1), [hpx.Dropout(spread=0.3)], replicas=4)
    assert "would span [0.01, 1], past its bounds [0.05, 1]" in caplog.text
    assert "knob 'dropout' would span [-0.2, 0.4], past its bounds [0, 0.99]" in caplog.text
    knob = hpx.LearningRate(base=0.1, span=10, bounds=(0.05, 1.0))  # declared: Forks would take it
    with pytest.raises(ConfigError, match=r"would span \[0.01, 1\], past its bounds \[0.05, 1\]"):
        hpx.Engine(_model(), _sgd(0.1), [knob], replicas=4)
    with pytest.raises(ConfigError, match=r"would span \[-0.2, 0.4\], past its bounds \[0, 0.99\]: .*use a "
                       r"spread <= 0.1"):
        hpx.Engine(_model(drop=0.1), _sgd(0.1), [hpx.Dropout(base=0.1, spread=0.3)], replicas=4)


def test_a_knob_subclass_with_a_per_step_scale_is_written_at_every_step():
    class WarmMomentum(hpx.Custom):
        def scale(self, step):
            return min(1.0, step / 10)

    knob = WarmMomentum("momentum", set=lambda r, v: r.optimizer.param_groups[0].__setitem__("momentum", v),
                        base=0.9, spread=0.05)
    engine = hpx.Engine(_model(), lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9), [knob],
                        replicas=2, sync_every=50, shared_optimizer_state=False)
    seen = []
    for b in _batches(6):
        engine.step(_loss, b)
        seen.append(engine.replicas[0].optimizer.param_groups[0]["momentum"])
    # the value for the next step, its warm-up factor (step + 1) / 10 on replica 0's 0.9 * (1 - 0.05)
    assert seen == pytest.approx([0.855 * s / 10 for s in range(1, 7)])


def test_a_custom_get_that_returns_no_number_names_the_knob():
    knob = hpx.Custom("t", get=lambda r: getattr(r.model, "temp", None), set=lambda r, v: None)
    with pytest.raises(ConfigError, match="get of knob 't' returned None; it must return the setting's"):
        hpx.Engine(_model(), _sgd(), [knob], replicas=2)


def test_a_module_attribute_kept_as_a_buffer_is_refused_and_an_int_dropout_rate_is_taken():
    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 2)
            self.register_buffer("temperature", torch.tensor(1.0))

        def forward(self, x):
            return self.lin(x) / self.temperature

    knob = hpx.ModuleAttribute("temperature", attribute="temperature", modules=Scaled, spread=0.2)
    with pytest.raises(ConfigError, match="'temperature' is a Tensor, and the knob writes a Python float"):
        hpx.Engine(Scaled(), _sgd(), [knob], replicas=2)
    model = nn.Sequential(nn.Linear(8, 16), nn.Dropout(0), nn.Linear(16, 2))  # torch keeps p=0 an int
    engine = hpx.Engine(model, _sgd(), [hpx.Dropout(spread=0.0)], replicas=2)
    assert engine.bases["dropout"] == 0.0


def test_a_torch_scheduler_as_a_knobs_schedule_points_to_explore_knobs():
    opt = torch.optim.SGD(_model().parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=10)
    with pytest.raises(ConfigError, match=r"is a torch scheduler \(CosineAnnealingLR\).*explore_knobs"):
        hpx.LearningRate(spread=0.5, schedule=sched)


# --- checkpoints ----------------------------------------------------------------------------


def _trained(knobs, opt, n=10, **kw):
    engine = hpx.Engine(_model(drop=0.0), opt, knobs, replicas=4, sync_every=5, **kw)
    for b in _batches(n):
        engine.step(_loss, b)
    return engine


def test_a_checkpoint_is_refused_by_a_knob_of_another_kind_or_on_another_setting(tmp_path):
    two = lambda m: torch.optim.SGD([{"params": m[0].parameters()},  # noqa: E731
                                     {"params": m[3].parameters(), "lr": 0.001}], lr=0.1)
    hpx.save_checkpoint(tmp_path, _trained([hpx.LearningRate("lr", spread=0.5)], two))
    for knob, match in ((hpx.LearningRateScale("lr", spread=0.5), "is a LearningRate.*this run's a "
                                                                  "LearningRateScale"),
                        (hpx.LearningRate("lr", group=1, spread=0.5), "on lr of parameter group 0, this "
                                                                      "run's a LearningRate \\(mul\\) on lr "
                                                                      "of parameter group 1")):
        engine = hpx.Engine(_model(drop=0.0), two, [knob], replicas=4, sync_every=5)
        lrs = [g["lr"] for g in engine.replicas[0].optimizer.param_groups]
        with pytest.raises(ConfigError, match=match):
            hpx.load_checkpoint(tmp_path, engine)
        assert [g["lr"] for g in engine.replicas[0].optimizer.param_groups] == lrs


class _Iterable:
    """Re-iterable probe data without a length (a DataLoader over an IterableDataset)."""

    def __init__(self, batches):
        self.batches = batches

    def __iter__(self):
        return iter(self.batches)


def test_a_probe_without_a_length_resumes_where_the_run_was(tmp_path):
    probe = _Iterable(_batches(2, seed=5, size=32))
    build = lambda: hpx.Engine(_model(drop=0.0), _sgd(), [hpx.LearningRate(spread=0.5)],  # noqa: E731
                               replicas=2, sync_every=2, signal=hpx.ProbeStream(probe))
    whole = build()
    for b in _batches(20):
        whole.step(_loss, b)
    part = build()
    for b in _batches(20)[:10]:
        part.step(_loss, b)
    hpx.save_checkpoint(tmp_path, part)
    resumed = build()
    assert hpx.load_checkpoint(tmp_path, resumed) == 10
    for b in _batches(20)[10:]:
        resumed.step(_loss, b)
    assert resumed.signal._pos == whole.signal._pos == 10
    assert all(torch.equal(p, q) for p, q in zip(whole.model.parameters(), resumed.model.parameters()))


def test_a_signal_that_refuses_its_state_leaves_the_engine_as_it_was(tmp_path):
    class Picky(hpx.IntervalLoss):
        def state_dict(self):
            return {"v": 1}

        def load_state_dict(self, state):
            raise ValueError("not mine")

    hpx.save_checkpoint(tmp_path, _trained([hpx.LearningRate(spread=0.5)], _sgd(), signal=Picky()))
    engine = hpx.Engine(_model(drop=0.0), _sgd(), [hpx.LearningRate(spread=0.5)], replicas=4, sync_every=5,
                        signal=Picky())
    weights = [p.clone() for p in engine.model.parameters()]
    with pytest.raises(ValueError, match="not mine"):
        hpx.load_checkpoint(tmp_path, engine)
    assert engine.step_count == 0 and engine.bases["lr"] == 0.1
    assert all(torch.equal(p, q) for p, q in zip(weights, engine.model.parameters()))


def test_a_signal_of_your_own_without_state_is_named_when_the_run_is_saved(tmp_path, caplog):
    class Stateful:
        def __init__(self):
            self.n = 0

        def measure(self, ctx):
            self.n += 1
            return torch.stack([_loss(r, ctx.batch).detach() for r in ctx.replicas])

    engine = _trained([hpx.LearningRate(spread=0.5)], _sgd(), signal=Stateful())
    with caplog.at_level(logging.WARNING, logger="hpx"):
        hpx.save_checkpoint(tmp_path, engine)
    assert "the signal Stateful has no state_dict(): a resumed run starts it afresh" in caplog.text


def test_an_engine_loaded_with_an_earlier_checkpoint_of_a_torch_schedule_resumes_exactly(tmp_path):
    def build():
        model = _model(drop=0.0)
        template = torch.optim.SGD(model.parameters(), lr=0.1)
        knobs = hpx.schedule.explore_knobs(torch.optim.lr_scheduler.StepLR(template, step_size=7, gamma=0.5),
                                           spread=0.3)
        return hpx.Engine(model, _sgd(), knobs, replicas=2, sync_every=5)

    data = _batches(30)
    whole = build()
    for b in data:
        whole.step(_loss, b)
    engine = build()
    for b in data[:17]:
        engine.step(_loss, b)
    hpx.save_checkpoint(tmp_path, engine)
    for b in data[17:]:
        engine.step(_loss, b)
    assert hpx.load_checkpoint(tmp_path, engine) == 17  # back to step 17, the schedule too
    for b in data[17:]:
        engine.step(_loss, b)
    assert all(torch.equal(p, q) for p, q in zip(whole.model.parameters(), engine.model.parameters()))


def test_an_engine_history_whose_strategy_names_a_phase_cut_is_shown_as_an_engines():
    engine = hpx.Engine(_model(), _sgd(), [hpx.Dropout(spread=0.05)], replicas=4, sync_every=5,
                        search=_Fixed(Decision(info={"phase": "cut"})))
    for b in _batches(10):
        engine.step(_loss, b)
    table = hpx.format_history(engine.history)
    assert table.splitlines()[0].split()[:2] == ["step", "dropout"] and len(table.splitlines()) == 3


def test_sparse_gradients_are_refused_in_shared_mode_and_train_in_independent_mode():
    class Bag(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.e = nn.Embedding(20, 4, sparse=True)
            self.out = nn.Linear(4, 2)

        def forward(self, x):
            return self.out(self.e(x).mean(1))

    sparse = lambda m: torch.optim.SparseAdam(list(m.e.parameters()), lr=0.01)  # noqa: E731
    with pytest.raises(ConfigError, match=r"module 'e' gives sparse gradients.*mode='independent'"):
        hpx.Engine(Bag(), sparse, [hpx.LearningRate(spread=0.5)], replicas=2)
    engine = hpx.Engine(Bag(), sparse, [hpx.LearningRate(spread=0.5)], replicas=2, mode="independent")
    g = torch.Generator().manual_seed(0)
    x, y = torch.randint(0, 20, (8, 3), generator=g), torch.randint(0, 2, (8,), generator=g)
    before = engine.replicas[0].model.e.weight.clone()
    engine.step(lambda rep, b: F.cross_entropy(rep.model(b[0]), b[1]), (x, y))
    assert not torch.equal(before, engine.replicas[0].model.e.weight)


# --- the shared mode's numerics -------------------------------------------------------------


def test_a_batch_that_splits_unevenly_gives_the_whole_batchs_mean_gradient():
    """10 examples over 4 replicas are cut 3, 3, 2, 2: each part's mean loss is weighted by its
    rows, so the replicas' mean gradient is the batch's (an unweighted mean was 0.18 away)."""
    torch.manual_seed(0)
    model = nn.Linear(8, 2)
    x, y = torch.randn(10, 8), torch.randint(0, 2, (10,))
    plain = copy.deepcopy(model)
    F.cross_entropy(plain(x), y).backward()
    engine = hpx.Engine(model, _sgd(), [hpx.LearningRate(spread=0.0)], replicas=4,
                        shared_optimizer_state=False)
    engine.backward(_loss, (x, y))
    engine.reduce()
    for r in engine.replicas:
        assert torch.allclose(r.model.weight.grad, plain.weight.grad, atol=1e-6)


def test_a_float64_model_trains_in_shared_mode_with_a_gradient_per_replica():
    model = _model().double()
    engine = hpx.Engine(model, _sgd(), [hpx.LearningRate(spread=0.5)], replicas=4,
                        shared_optimizer_state=False)
    for x, y in _batches(3):
        engine.step(_loss, (x.double(), y))
    assert all(torch.isfinite(p).all() and p.dtype == torch.float64 for p in engine.model.parameters())


def test_a_very_negative_loss_counts_as_a_blow_up_as_a_very_large_one():
    def nll(rep, b):  # replica 1's loss jumps to -1e6 at step 8: 1e4 times the run's range
        out = _loss(rep, b)
        return out - 1e6 if rep.index == 1 and engine.step_count == 8 else out

    engine = hpx.Engine(_model(drop=0.0), _sgd(), [hpx.LearningRate(spread=0.5)], replicas=4, sync_every=9)
    for b in _batches(9):
        engine.step(nll, b)
    assert engine.history[0].nonfinite == [1]


def test_unfreezing_a_layer_after_the_engine_was_built_is_refused_in_shared_mode():
    model = _model()
    model[0].requires_grad_(False)
    def sgd(m):
        return torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=0.1, momentum=0.9)

    engine = hpx.Engine(model, sgd, [hpx.LearningRate(spread=0.5)], replicas=4)
    for b in _batches(2):
        engine.step(_loss, b)
    for r in engine.replicas:
        r.model[0].requires_grad_(True)
    with pytest.raises(ConfigError, match="the parameters that train changed since the engine was built"):
        engine.step(_loss, _batches(1)[0])
