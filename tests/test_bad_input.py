"""A catalogue of mistakes a user can make, each asserting the exception type, that the
message names the bad value and the fix, and that nothing was modified (the model's weights,
the engine's step and knobs)."""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hpx


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.1), nn.Linear(16, 3))


def _sgd(m: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(m.parameters(), lr=0.1)


def _ce(rep: hpx.Replica, b: Any) -> torch.Tensor:
    return F.cross_entropy(rep.model(b[0]), b[1])


def _xy(n: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, 8, generator=g), torch.randint(0, 3, (n,), generator=g)


def _engine(**kw: Any) -> hpx.Engine:
    knobs = kw.pop("knobs", [hpx.LearningRate(spread=0.3)])
    return hpx.Engine(_model(), kw.pop("optimizer", _sgd), knobs, **{"replicas": 2, "sync_every": 2, **kw})


@dataclass
class Case:
    name: str
    call: Callable[[], Any]       # the mistake (builds what it needs)
    error: type[Exception]
    needles: tuple[str, ...]      # the bad value and the fix, as the message must name them


# --- construction: mistakes caught before anything is touched ------------------------------

CONSTRUCTION = [
    Case("sync_every bool", lambda: _engine(sync_every=True), hpx.ConfigError,
         ("sync_every must be an integer", "(got True)")),
    Case("sync_every float", lambda: _engine(sync_every=5.0), hpx.ConfigError, ("sync_every", "(got 5.0)")),
    Case("sync_every str", lambda: _engine(sync_every="10"), hpx.ConfigError, ("sync_every", "(got '10')")),
    Case("sync_every 0", lambda: _engine(sync_every=0), hpx.ConfigError, ("sync_every", "(got 0)")),
    Case("replicas 0", lambda: _engine(replicas=0), hpx.ConfigError, ("replicas", "(got 0)")),
    Case("replicas bool", lambda: _engine(replicas=True), hpx.ConfigError, ("replicas must be an integer",)),
    Case("mode typo", lambda: _engine(mode="shard"), hpx.ConfigError, ("mode", "'shared'", "'shard'")),
    Case("unknown setting", lambda: _engine(sync_evry=3), hpx.ConfigError,
         ("unknown setting 'sync_evry'", "sync_every")),
    Case("momentum 1", lambda: _engine(momentum=1.0), hpx.ConfigError, ("momentum", "(got 1.0)")),
    Case("temperature -1", lambda: _engine(temperature=-1), hpx.ConfigError,
         ("temperature must be 'auto' or a number > 0", "(got -1)")),
    Case("history_limit 0", lambda: _engine(history_limit=0), hpx.ConfigError, ("history_limit", "(got 0)")),
    Case("config and settings", lambda: _engine(config=hpx.EngineConfig(), seed=1), hpx.ConfigError,
         ("either config=", "not both")),
    Case("model not a module", lambda: hpx.Engine(lambda x: x, _sgd, []), hpx.ConfigError,
         ("model must be a torch.nn.Module", "function")),
    Case("optimizer not a factory", lambda: _engine(optimizer=0.1), hpx.ConfigError,
         ("optimizer must be a factory", "0.1")),
    Case("one optimizer, many replicas", lambda: hpx.Engine(_model(), _sgd(_model()), [], replicas=2),
         hpx.ConfigError, ("need one optimizer each", "lambda m:")),
    Case("factory returns a list", lambda: _engine(optimizer=lambda m: [m]), hpx.ConfigError,
         ("returned list, not an Optimizer",)),
    Case("factory on another model", lambda: _engine(optimizer=lambda m: _sgd(_model())), hpx.ConfigError,
         ("not its model's", "lambda m")),
    Case("knob group out of range", lambda: _engine(knobs=[hpx.LearningRate(group=3, spread=0.3)]),
         hpx.ConfigError, ("parameter group 3", "1 group(s)")),
    Case("knob group name unknown", lambda: _engine(knobs=[hpx.LearningRate(group="body", spread=0.3)]),
         hpx.ConfigError, ("'body'", "'name': ...")),
    Case("two knobs on one lr", lambda: _engine(knobs=[hpx.LearningRate("a", spread=0.3),
                                                       hpx.LearningRate("b", spread=0.3)]),
         hpx.ConfigError, ("['a', 'b']", "lr of parameter group 0", "one knob per setting")),
    Case("scale and group lr", lambda: _engine(knobs=[hpx.LearningRateScale("s", span=2.0),
                                                      hpx.LearningRate("lr0", spread=0.3)]),
         hpx.ConfigError, ("['s', 'lr0']", "lr of parameter group 0")),
    Case("two dropout knobs", lambda: _engine(knobs=[hpx.Dropout("d1", spread=0.05),
                                                     hpx.Dropout("d2", spread=0.05)]),
         hpx.ConfigError, ("['d1', 'd2']", "p of module 2")),
    Case("dropout without dropout", lambda: hpx.Engine(nn.Linear(8, 3), _sgd, [hpx.Dropout(spread=0.05)],
                                                       replicas=2),
         hpx.ConfigError, ("found no modules", "'p'")),
    Case("search without decide", lambda: _engine(search=object()), hpx.ConfigError,
         ("must implement hpx.search.Search", "decide")),
    Case("search and controller", lambda: _engine(search=hpx.search.HDET(), controller=hpx.Controller()),
         hpx.ConfigError, ("search=... or controller=obj", "not both")),
    Case("signal without measure", lambda: _engine(signal=3), hpx.ConfigError,
         ("signal must have a measure(ctx) method", "3")),
    Case("controller not an object", lambda: _engine(controller="hdet"), hpx.ConfigError,
         ("controller must be True, False or an object", "'hdet'")),
]

# --- knobs -----------------------------------------------------------------------------------

KNOBS = [
    Case("base nan", lambda: hpx.LearningRate(base=float("nan")), hpx.ConfigError,
         ("base of knob 'lr' must be a finite number", "nan")),
    Case("base negative mul", lambda: hpx.LearningRate(base=-0.1), hpx.ConfigError, ("must be > 0", "-0.1")),
    Case("base bool", lambda: hpx.LearningRate(base=True), hpx.ConfigError, ("finite number", "True")),
    Case("spread negative", lambda: hpx.LearningRate(spread=-0.1), hpx.ConfigError,
         ("spread of knob 'lr' must be a number >= 0", "-0.1")),
    Case("mul spread >= 1", lambda: hpx.LearningRate(spread=1.5), hpx.ConfigError, ("[0, 1)", "1.5")),
    Case("span < 1", lambda: hpx.LearningRate(span=0.5), hpx.ConfigError, ("span", "0.5")),
    Case("span and spread", lambda: hpx.LearningRate(span=2.0, spread=0.2), hpx.ConfigError,
         ("spread or span", "not both")),
    Case("span on additive", lambda: hpx.Knob("ls", base=0.1, kind="add", span=2.0), hpx.ConfigError,
         ("additive", "spread=")),
    Case("additive spread past bounds", lambda: hpx.LabelSmoothing(base=0.05, spread=0.2), hpx.ConfigError,
         ("[-0.15, 0.25]", "use a spread <= 0.05")),
    Case("dropout spread past 0", lambda: hpx.Dropout(base=0.05, spread=0.1), hpx.ConfigError,
         ("[-0.05, 0.15]", "spread <= 0.05")),
    Case("bounds reversed", lambda: hpx.Knob("k", base=1.0, bounds=(2.0, 1.0)), hpx.ConfigError,
         ("low < high", "(2.0, 1.0)")),
    Case("base outside bounds", lambda: hpx.Knob("k", base=5.0, bounds=(0.0, 1.0)), hpx.ConfigError,
         ("must lie in [0, 1]", "5.0")),
    Case("kind typo", lambda: hpx.Knob("k", base=1.0, kind="multiplicative"), hpx.ConfigError,
         ("'mul' or 'add'", "'multiplicative'")),
    Case("empty name", lambda: hpx.Knob("", base=1.0), hpx.ConfigError, ("non-empty string", "''")),
    Case("group bool", lambda: hpx.LearningRate(group=True), hpx.ConfigError, ("index or a name", "True")),
    Case("schedule not callable", lambda: hpx.LearningRate(schedule=0.5), hpx.ConfigError,
         ("must be callable", "0.5")),
    Case("attribute not identifier", lambda: hpx.ModuleAttribute("t", attribute="a.b", modules=nn.Dropout,
                                                                 base=1.0), hpx.ConfigError,
         ("identifier", "'a.b'")),
    Case("module attribute no modules", lambda: hpx.ModuleAttribute("t", attribute="p", base=1.0),
         hpx.ConfigError, ("needs modules=",)),
]

# --- data and the training step ---------------------------------------------------------------


def _step(batch: Any = None, **kw: Any) -> Callable[[], Any]:
    return lambda: _engine().step(_ce, batch, **kw)


def _twice(f: Callable[[], Any]) -> None:
    f()
    f()


x8, y8 = _xy(8)
STEPS = [
    Case("uncollated samples", _step([(x8[i], y8[i]) for i in range(8)]), hpx.ConfigError,
         ("list of 8 separate examples", "default_collate")),
    Case("scalar in batch", _step((x8, torch.tensor(1))), hpx.ConfigError,
         ("batch[1] is a 0-dim tensor", "one row per example")),
    Case("x and y lengths differ", _step((x8, y8[:6])), hpx.ConfigError,
         ("batch[0]: 8, batch[1]: 6", "same examples")),
    Case("batch smaller than replicas", lambda: _engine(replicas=4).step(_ce, (x8[:3], y8[:3])),
         hpx.ConfigError, ("a batch of size 3", "at least one example per replica")),
    Case("batches=(x, y)", _step(batches=(x8, y8)), hpx.ConfigError,
         ("like one batch (x, y)", "batch=(x, y)")),
    Case("batches wrong count", _step(batches=[(x8, y8)] * 3), hpx.ConfigError,
         ("3 entries for 2 local replicas",)),
    Case("batch and batches", _step((x8, y8), batches=[(x8, y8)] * 2), hpx.ConfigError,
         ("batch or batches", "not both")),
    Case("loss not scalar", lambda: _engine().step(lambda r, b: F.cross_entropy(r.model(b[0]), b[1],
                                                                                reduction="none"), (x8, y8)),
         TypeError, ("scalar tensor", "shape")),
    Case("loss a float", lambda: _engine().step(lambda r, b: 1.0, (x8, y8)), TypeError,
         ("scalar tensor", "float")),
    Case("advance without record", lambda: _twice(_engine(replicas=1).advance), hpx.ConfigError,
         ("no loss recorded", "Engine.record(loss)")),
]

# --- signals ----------------------------------------------------------------------------------

SIGNALS = [
    Case("probe empty", lambda: hpx.ProbeStream([]), hpx.ConfigError, ("empty", "at least one batch")),
    Case("probe not iterable", lambda: hpx.ProbeStream(3), hpx.ConfigError, ("iterable", "int")),
    Case("probe with nan", lambda: hpx.ProbeStream([(torch.full((2, 8), float("nan")), y8[:2])]),
         hpx.ConfigError, ("probe batch 0 holds NaN or inf", "clean the held-out data")),
    Case("probe batches 0", lambda: hpx.ProbeStream([(x8, y8)], batches=0), hpx.ConfigError,
         ("batches must be an integer >= 1", "(got 0)")),
]

def _sgd_opt() -> torch.optim.Optimizer:
    return _sgd(_model())


def _auto(**kw: Any) -> hpx.Engine:
    return hpx.autolr(_model(), kw.pop("optimizer", _sgd), **{"total_steps": 100, **kw})


SIGNALS += [
    Case("shared batch loss_fn", lambda: hpx.SharedBatch(loss_fn=3), hpx.ConfigError,
         ("loss_fn must be a function (replica, batch)", "(got 3)")),
    Case("probe loss_fn", lambda: hpx.ProbeStream([(x8, y8)], loss_fn="ce"), hpx.ConfigError,
         ("loss_fn must be a function", "(got 'ce')")),
]

RECIPE = [
    Case("autolr total_steps 0", lambda: _auto(total_steps=0), hpx.ConfigError,
         ("total_steps must be an integer >= 1", "(got 0)")),
    Case("autolr controller setting", lambda: _auto(meta_lr=0.1), hpx.ConfigError,
         ("meta_lr belong to hpx.search.HDET", "search=hpx.search.HDET")),
    Case("autolr probe not iterable", lambda: _auto(probe=3), hpx.ConfigError,
         ("probe must be an iterable of batches", "int")),
    Case("autolr schedule", lambda: _auto(schedule=3), hpx.ConfigError,
         ("schedule must be a function step -> factor, a torch LRScheduler", "int")),
    Case("autolr knob named lr", lambda: _auto(knobs=[hpx.WeightDecay("lr", base=1e-4)]), hpx.ConfigError,
         ("knob name 'lr' is autolr's own", "name yours differently")),
    Case("autolr lr 0", lambda: _auto(optimizer=lambda m: torch.optim.SGD(m.parameters(), lr=0.0)),
         hpx.ConfigError, ("every group's lr is 0", "build the optimizer with the lr you would use")),
]

STRATEGIES = [
    Case("bracket every 0", lambda: hpx.search.Bracket(100, every=0), hpx.ConfigError,
         ("every must be an integer >= 1", "(got 0)")),
    Case("bracket span 1", lambda: hpx.search.Bracket(100, span=1.0), hpx.ConfigError,
         ("span must be a number > 1", "(got 1.0)")),
    Case("bracket merge", lambda: hpx.search.Bracket(100, merge="max"), hpx.ConfigError,
         ("'mean' or 'best'", "'max'")),
    Case("bracket total 0", lambda: hpx.search.Bracket(0), hpx.ConfigError, ("total_steps", "(got 0)")),
    Case("stretch until 0", lambda: hpx.search.Stretch(100, until=0.0), hpx.ConfigError,
         ("until must be a share of the run in (0, 1]", "(got 0.0)")),
    Case("stretch span 1", lambda: hpx.search.Stretch(100, span=1.0), hpx.ConfigError,
         ("span must be a number > 1", "(got 1.0)")),
    Case("stretch syncs 0", lambda: hpx.search.Stretch(100, syncs=0), hpx.ConfigError,
         ("syncs must be an integer >= 1", "(got 0)")),
    Case("stretch knob absent", lambda: hpx.Engine(_model(), _sgd, [hpx.LearningRate("lr")], replicas=2,
                                                   search=hpx.search.Stretch(100, knob="wd")),
         hpx.ConfigError, ("Stretch searches knob 'wd'", "['lr']")),
    Case("autolr span 1", lambda: _auto(span=1.0), hpx.ConfigError,
         ("span must be a number > 1", "(got 1.0)")),
    Case("hdet decay 1", lambda: hpx.search.HDET(decay=1.0), hpx.ConfigError, ("[0, 1)", "(got 1.0)")),
    Case("hdet warmup -1", lambda: hpx.search.HDET(warmup=-1), hpx.ConfigError, ("warmup", "(got -1)")),
    Case("hdet controller", lambda: hpx.search.HDET(controller=3), hpx.ConfigError,
         ("update, log_mask, state_dict and load_state_dict", "(got 3)")),
    Case("controller meta_lr", lambda: hpx.Controller(meta_lr=-1), hpx.ConfigError, ("meta_lr", "(got -1)")),
    Case("controller temperature", lambda: hpx.Controller(temperature=0), hpx.ConfigError,
         ("'auto' or a number > 0", "(got 0)")),
    Case("knob names repeat", lambda: hpx.Knobs(hpx.LearningRate("a"), hpx.WeightDecay("a", base=1e-4)),
         hpx.ConfigError, ("unique", "['a']")),
]

SCHEDULERS = [
    Case("onecycle no length", lambda: hpx.OneCycleLR(_sgd_opt(), max_lr=0.1), hpx.ConfigError,
         ("give total_steps", "epochs and steps_per_epoch")),
    Case("onecycle pct_start", lambda: hpx.OneCycleLR(_sgd_opt(), max_lr=0.1, total_steps=10, pct_start=1.5),
         hpx.ConfigError, ("pct_start must be in [0, 1]", "1.5")),
    Case("onecycle anneal", lambda: hpx.OneCycleLR(_sgd_opt(), max_lr=0.1, total_steps=10,
                                                   anneal_strategy="sin"),
         hpx.ConfigError, ("'cos' or 'linear'", "'sin'")),
    Case("onecycle max_lr count", lambda: hpx.OneCycleLR(_sgd_opt(), max_lr=[0.1, 0.2], total_steps=10),
         hpx.ConfigError, ("one per param group", "2 values")),
    Case("explore not a scheduler", lambda: hpx.ExploreLR(3), hpx.ConfigError, ("LRScheduler", "int")),
    Case("explore spread", lambda: hpx.ExploreLR(torch.optim.lr_scheduler.StepLR(_sgd_opt(), 5), spread=-0.1),
         hpx.ConfigError, ("spread must be a number in [0, 1)", "-0.1")),
]

ALL = CONSTRUCTION + KNOBS + STEPS + SIGNALS + RECIPE + STRATEGIES + SCHEDULERS


@pytest.mark.parametrize("case", ALL, ids=[c.name for c in ALL])
def test_a_mistake_is_named_with_its_fix(case: Case) -> None:
    with pytest.raises(case.error) as err:
        case.call()
    text = str(err.value)
    for needle in case.needles:
        assert needle in text, f"{needle!r} not in {text!r}"


def test_a_refused_step_changes_nothing() -> None:
    engine = _engine()
    x, y = _xy(8)
    engine.step(_ce, (x, y))
    before = copy.deepcopy([r.model.state_dict() for r in engine.replicas]), engine.step_count, engine.bases
    for bad in ([(x[i], y[i]) for i in range(8)], (x, y[:6]), (x, torch.tensor(1))):
        with pytest.raises(hpx.ConfigError):
            engine.step(_ce, bad)
    after = [r.model.state_dict() for r in engine.replicas]
    assert all(torch.equal(a[k], b[k]) for a, b in zip(before[0], after) for k in a)
    assert engine.step_count == before[1] and engine.bases == before[2]


def test_a_numpy_base_is_taken() -> None:
    knob = hpx.LearningRate(base=np.float32(0.1), spread=0.3)
    assert knob.base == pytest.approx(0.1) and type(knob.base) is float


def test_a_negative_schedule_factor_stops_the_next_step() -> None:
    engine = _engine(knobs=[hpx.LearningRate(spread=0.3, schedule=lambda t: 1.0 - t / 2)])
    x, y = _xy(8)
    for _ in range(3):  # factors 1, 0.5, 0 are fine; -0.5 is written after the third step
        engine.step(_ce, (x, y))
    before = copy.deepcopy([r.model.state_dict() for r in engine.replicas])
    with pytest.raises(hpx.ConfigError) as err:
        engine.step(_ce, (x, y))
    assert "factor -0.5 at step 3" in str(err.value) and "total_steps" in str(err.value)
    after = [r.model.state_dict() for r in engine.replicas]
    assert all(torch.equal(a[k], b[k]) for a, b in zip(before, after) for k in a)


def test_one_replica_with_a_spread_warns(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("WARNING", logger="hpx"):
        _engine(replicas=1)
    assert "one replica in all" in caplog.text and "replicas >= 2" in caplog.text


def _engine_state(engine: hpx.Engine) -> tuple:
    return (copy.deepcopy([(r.model.state_dict(), r.optimizer.state_dict()) for r in engine.replicas]),
            engine.step_count, dict(engine.bases), len(engine.history), engine.next_sync)


def _unchanged(a: tuple, b: tuple) -> bool:
    (sa, *ra), (sb, *rb) = a, b
    for (ma, oa), (mb, ob) in zip(sa, sb):
        if any(not torch.equal(ma[k], mb[k]) for k in ma) or oa["param_groups"] != ob["param_groups"]:
            return False
        st_a, st_b = oa["state"], ob["state"]
        if any(not torch.equal(st_a[i][k], st_b[i][k]) for i in st_a for k in st_a[i]):
            return False
    return ra == rb


ON_AN_ENGINE = [
    ("uncollated", lambda e: e.step(_ce, [(x8[i], y8[i]) for i in range(8)]), hpx.ConfigError),
    ("lengths differ", lambda e: e.step(_ce, (x8, y8[:6])), hpx.ConfigError),
    ("batches=(x, y)", lambda e: e.step(_ce, batches=(x8, y8)), hpx.ConfigError),
    ("loss a float", lambda e: e.step(lambda r, b: 1.0, (x8, y8)), TypeError),
    ("bad max_grad_norm", lambda e: (e.backward(_ce, (x8, y8)), e.optimizer_step(max_grad_norm=0)),
     hpx.ConfigError),
    ("bad scale", lambda e: e.backward(_ce, (x8, y8), scale=0), hpx.ConfigError),
    ("checkpoint of another engine", lambda e: e.load_state_dict(_engine(sync_every=5).state_dict()),
     hpx.ConfigError),
    ("checkpoint not a dict", lambda e: e.load_state_dict([1, 2]), hpx.ConfigError),
    ("save keep 0", lambda e: hpx.save_checkpoint("/nonexistent-hpx-dir", e, keep=0), hpx.ConfigError),
    ("load extra not stateful", lambda e: hpx.load_checkpoint("/nonexistent-hpx-dir", e, extra={"s": 1}),
     hpx.ConfigError),
]


@pytest.mark.parametrize("call, error", [(c, e) for _, c, e in ON_AN_ENGINE],
                         ids=[n for n, _, _ in ON_AN_ENGINE])
def test_a_refused_call_leaves_the_engine_as_it_was(call, error) -> None:
    engine = _engine()
    for _ in range(3):  # momentum buffers, a sync, and a step into the next interval
        engine.step(_ce, _xy(8))
    before = _engine_state(engine)
    with pytest.raises(error):
        call(engine)
    assert _unchanged(before, _engine_state(engine))
