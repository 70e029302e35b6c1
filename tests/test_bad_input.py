"""A catalogue of mistakes a user can make, each asserting the exception type and that the
message names the bad value and the fix. Mistakes made on a running engine (``ON_AN_ENGINE``)
also go through one shared check, :func:`_refused_unchanged_and_steps_on`: the engine is bit for
bit as an unaffected twin (weights, optimizer state, bases, step, history, search and signal
state, the registry's permutation stream and its next permutation), and it then steps on through
syncs exactly as the twin does."""

from __future__ import annotations

import copy
import hashlib
import json
import math
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
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


def _locked() -> nn.Module:
    """A model holding what cannot be deep-copied (a lock)."""
    m = _model()
    m.lock = threading.Lock()
    return m


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
    Case("optimizer needs a closure", lambda: _engine(optimizer=lambda m: torch.optim.LBFGS(m.parameters())),
         hpx.ConfigError, ("LBFGS needs a closure", "use a first-order optimizer")),
    Case("model cannot be copied",
         lambda: hpx.Engine(_locked(), _sgd, [hpx.LearningRate(spread=0.3)], replicas=2), hpx.ConfigError,
         ("copy.deepcopy failed (TypeError: cannot pickle", "off the model")),
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
    # a declared spread past a bound: the engine's replicas sit on both sides (hpx.Forks leaves a side out)
    Case("additive spread past bounds", lambda: _engine(knobs=[hpx.LabelSmoothing(base=0.05, spread=0.2)]),
         hpx.ConfigError, ("[-0.15, 0.25]", "use a spread <= 0.05")),
    Case("dropout spread past 0", lambda: _engine(knobs=[hpx.Dropout(base=0.05, spread=0.1)]),
         hpx.ConfigError, ("[-0.05, 0.15]", "spread <= 0.05")),
    Case("engine mul base 0", lambda: _engine(knobs=[hpx.WeightDecay(base=0.0, span=10)]), hpx.ConfigError,
         ("knob 'weight_decay' has base 0", "a base > 0", "hpx.Forks")),
    Case("from_zero on additive", lambda: hpx.Knob("ls", base=0.0, kind="add", spread=0.1, from_zero=0.1),
         hpx.ConfigError, ("from_zero of knob 'ls' is for a multiplicative knob", "leave from_zero out")),
    Case("from_zero 0", lambda: hpx.WeightDecay(span=10, from_zero=0.0), hpx.ConfigError,
         ("from_zero of knob 'weight_decay' must be a number > 0", "(got 0.0)")),
    Case("bounds reversed", lambda: hpx.Knob("k", base=1.0, bounds=(2.0, 1.0)), hpx.ConfigError,
         ("low < high", "(2.0, 1.0)")),
    Case("base outside bounds", lambda: hpx.Knob("k", base=5.0, bounds=(0.0, 1.0)), hpx.ConfigError,
         ("must lie in [0, 1]", "5.0")),
    Case("kind typo", lambda: hpx.Knob("k", base=1.0, kind="multiplicative"), hpx.ConfigError,
         ("'mul' or 'add'", "'multiplicative'")),
    Case("empty name", lambda: hpx.Knob("", base=1.0), hpx.ConfigError, ("non-empty string", "''")),
    Case("group bool", lambda: hpx.LearningRate(group=True), hpx.ConfigError, ("index or a name", "True")),
    Case("schedule not callable", lambda: hpx.LearningRate(schedule=0.5), hpx.ConfigError,
         ("must be a function step -> factor", "0.5")),
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
         ("autolr sets its own search and sync schedule, so it takes no meta_lr", "search=hpx.search.HDET")),
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


# --- issue 20, item 8: more mistakes, each named with its fix ---------------------------------


def _frozen_step() -> None:
    m = _model()
    for p in m.parameters():
        p.requires_grad_(False)
    hpx.Engine(m, _sgd, [hpx.LearningRate(spread=0.3)], replicas=2, sync_every=2).step(_ce, (x8, y8))


def _lightning(**kw: Any) -> Any:
    from hpx.integrations.lightning import AutoLR

    return AutoLR(**{"loss_fn": lambda module, b: module(b[0]).sum(), "probe": [(x8, y8)], **kw})


def _transformers(**kw: Any) -> Any:
    from hpx.integrations.transformers import AutoLR

    return AutoLR(**{"loss_fn": lambda model, b: model(b[0]).sum(), "probe": [(x8, y8)], **kw})


ENGINE_MORE = [
    Case("backend by name", lambda: _engine(backend="gloo"), hpx.ConfigError,
         ("backend='gloo' is a name", "init_process_group('gloo')", "hpx.backends.TorchDistributed()")),
    Case("backend not a collective", lambda: _engine(backend=3), hpx.ConfigError,
         ("backend must be an hpx.backends Collective", "(got 3)")),
    Case("one knob, not a list", lambda: hpx.Engine(_model(), _sgd, hpx.LearningRate(spread=0.3), replicas=2),
         hpx.ConfigError, ("got one LearningRate, 'lr'", "wrap it in a list")),
    Case("knobs a string", lambda: hpx.Engine(_model(), _sgd, "lr", replicas=2), hpx.ConfigError,
         ("knobs must be a list of hpx knobs", "(got 'lr')")),
    Case("knob names as strings", lambda: hpx.Engine(_model(), _sgd, ["lr"], replicas=2), hpx.ConfigError,
         ("got 'lr' of type str", "hpx.LearningRate('lr'")),
    Case("model and optimizer swapped", lambda: hpx.Engine(_sgd, _model(), []), hpx.ConfigError,
         ("model must be a torch.nn.Module (got function)", "pass the model first")),
    Case("Forks with model and optimizer swapped", lambda: hpx.Forks(_sgd_opt(), _model(), total_steps=10,
                                                                      probe=[(x8, y8)]), hpx.ConfigError,
         ("model must be a torch.nn.Module (got a SGD): pass the model first",)),
    Case("on_sync not callable", lambda: _engine(on_sync=3), hpx.ConfigError,
         ("on_sync must be a function record -> None", "(got 3)")),
    Case("seed a string", lambda: _engine(seed="a"), hpx.ConfigError,
         ("seed must be an integer", "(got 'a')")),
    Case("replicas a string", lambda: _engine(replicas="2"), hpx.ConfigError, ("replicas", "(got '2')")),
    Case("history_file a directory", lambda: _engine(history_file="/tmp"), hpx.ConfigError,
         ("history_file='/tmp' is a directory", "'/tmp/history.jsonl'")),
    Case("history_file a number", lambda: _engine(history_file=3), hpx.ConfigError,
         ("history_file", "(got 3)")),
    Case("warm_init negative", lambda: _engine(warm_init=-1.0), hpx.ConfigError, ("warm_init", "(got -1.0)")),
    Case("bucket_cap_mb 0", lambda: _engine(bucket_cap_mb=0), hpx.ConfigError, ("bucket_cap_mb", "(got 0)")),
    Case("schedule returns None",
         lambda: _engine(knobs=[hpx.LearningRate(spread=0.3, schedule=lambda t: None)]),
         hpx.ConfigError, ("its schedule returned None at step 0", "lack a return statement")),
    Case("schedule returns a word", lambda: _engine(knobs=[hpx.LearningRate(spread=0.3,
                                                                              schedule=lambda t: "fast")]),
         hpx.ConfigError, ("returned 'fast' at step 0", "must return a number")),
    Case("probe as one (x, y) tuple", lambda: _engine(signal=hpx.ProbeStream((x8, y8))), hpx.ConfigError,
         ("looks like one batch", "ProbeStream([(x_val, y_val)])")),
    Case("frozen model", _frozen_step, hpx.ConfigError,
         ("the model of replica 0 has no trainable parameters", "requires_grad_(True)")),
    Case("loss_fn None on a fresh engine", lambda: _engine().step(None, (x8, y8)), hpx.ConfigError,
         ("loss_fn must be a function (replica, batch)", "(got None)")),
]

RECIPE_MORE = [
    Case("autolr backend by name", lambda: _auto(backend="gloo"), hpx.ConfigError,
         ("backend='gloo' is a name", "TorchDistributed()")),
    Case("autolr loss_fn not callable", lambda: _auto(loss_fn=3), hpx.ConfigError,
         ("loss_fn must be a function (replica, batch)", "(got 3)")),
    Case("autolr schedule returns None", lambda: _auto(schedule=lambda t: None), hpx.ConfigError,
         ("its schedule returned None at step 0", "must return a number")),
    Case("autolr probe as one (x, y) tuple", lambda: _auto(probe=(x8, y8)), hpx.ConfigError,
         ("looks like one batch", "probe=[(x_val, y_val)]")),
    Case("autolr probe a dict", lambda: _auto(probe={"x": x8, "y": y8}), hpx.ConfigError,
         ("it is a dict (keys 'x', 'y')", "wrap it in a list")),
    Case("autolr probe empty", lambda: _auto(probe=[]), hpx.ConfigError, ("empty", "at least one batch")),
    Case("autolr probe with nan", lambda: _auto(probe=[(torch.full((2, 8), float("inf")), y8[:2])]),
         hpx.ConfigError, ("holds NaN or inf", "clean the held-out data")),
    Case("autolr one knob, not a list", lambda: _auto(knobs=hpx.WeightDecay("wd", base=1e-4)),
         hpx.ConfigError,
         ("got one WeightDecay, 'wd'", "wrap it in a list")),
    Case("autolr total_steps float", lambda: _auto(total_steps=10.5), hpx.ConfigError,
         ("total_steps must be an integer >= 1", "(got 10.5)")),
    Case("autolr total_steps str", lambda: _auto(total_steps="100"), hpx.ConfigError,
         ("total_steps must be an integer >= 1", "(got '100')")),
    Case("autolr total_steps None", lambda: _auto(total_steps=None), hpx.ConfigError,
         ("total_steps must be an integer >= 1", "(got None)")),
    Case("autolr replicas 0", lambda: _auto(replicas=0), hpx.ConfigError, ("replicas", "(got 0)")),
    Case("autolr model not a module", lambda: hpx.autolr("m", _sgd, total_steps=10), hpx.ConfigError,
         ("model must be a torch.nn.Module (got str)", "pass the model first")),
    Case("autolr optimizer None", lambda: _auto(optimizer=None), hpx.ConfigError,
         ("optimizer must be a factory model -> Optimizer", "(got None)")),
    Case("autolr one optimizer, two replicas", lambda: _auto(optimizer=_sgd_opt(), replicas=2),
         hpx.ConfigError,
         ("need one optimizer each", "lambda m:")),
    Case("autolr span str", lambda: _auto(span="2"), hpx.ConfigError,
         ("span must be a number > 1", "(got '2')")),
    Case("autolr sync_every", lambda: _auto(sync_every=10), hpx.ConfigError,
         ("so it takes no sync_every", "search=hpx.search.HDET")),
    Case("autolr schedule of another optimizer", lambda: _auto(
        optimizer=torch.optim.SGD(_model().parameters(), lr=3e-4), schedule=torch.optim.lr_scheduler.LambdaLR(
            torch.optim.SGD(_model().parameters(), lr=0.1), lambda t: 1.0)), hpx.ConfigError,
         ("schedule is built on another optimizer, whose peak learning rates [0.1] are not optimizer's",
          "[0.0003]", "build the scheduler on the optimizer you pass")),
    Case("autolr unknown setting", lambda: _auto(histroy_file="h.jsonl"), hpx.ConfigError,
         ("unknown setting 'histroy_file'", "history_file")),
]

SIGNALS_MORE = [
    Case("probe None", lambda: hpx.ProbeStream(None), hpx.ConfigError, ("must be iterable", "NoneType")),
    Case("probe a dict", lambda: hpx.ProbeStream({"x": x8}), hpx.ConfigError,
         ("it is a dict (keys 'x')", "ProbeStream([val_batch])")),
    Case("probe eval_mode a string", lambda: hpx.ProbeStream([(x8, y8)], eval_mode="yes"), hpx.ConfigError,
         ("eval_mode must be True or False", "(got 'yes')")),
    Case("shared batch eval_mode a number", lambda: hpx.SharedBatch(eval_mode=3), hpx.ConfigError,
         ("eval_mode must be True or False", "(got 3)")),
    Case("probe batches str", lambda: hpx.ProbeStream([(x8, y8)], batches="2"), hpx.ConfigError,
         ("batches must be an integer >= 1", "(got '2')")),
    Case("probe batches bool", lambda: hpx.ProbeStream([(x8, y8)], batches=True), hpx.ConfigError,
         ("batches must be an integer >= 1", "(got True)")),
]

STRATEGIES_MORE = [
    Case("stretch total_steps str", lambda: hpx.search.Stretch("100"), hpx.ConfigError,
         ("total_steps must be an integer >= 1", "(got '100')")),
    Case("stretch knob not a name", lambda: hpx.search.Stretch(100, knob=3), hpx.ConfigError,
         ("knob must be a knob's name or None", "(got 3)")),
    Case("stretch until past the run", lambda: hpx.search.Stretch(100, until=1.5), hpx.ConfigError,
         ("until must be a share of the run in (0, 1]", "(got 1.5)")),
    Case("hdet warmup str", lambda: hpx.search.HDET(warmup="3"), hpx.ConfigError,
         ("warmup must be an integer >= 0", "(got '3')")),
    Case("hdet decay negative", lambda: hpx.search.HDET(decay=-0.1), hpx.ConfigError,
         ("[0, 1)", "(got -0.1)")),
    Case("bracket total float", lambda: hpx.search.Bracket(100.5), hpx.ConfigError,
         ("total_steps", "(got 100.5)")),
    Case("bracket every str", lambda: hpx.search.Bracket(100, every="5"), hpx.ConfigError,
         ("every must be an integer >= 1", "(got '5')")),
]

SCHEDULERS_MORE = [
    Case("onecycle given no optimizer", lambda: hpx.OneCycleLR("opt", max_lr=0.1, total_steps=10), TypeError,
         ("str is not an Optimizer", "hpx.OneCycleLR(optimizer, max_lr=")),
    Case("onecycle max_lr negative", lambda: hpx.OneCycleLR(_sgd_opt(), max_lr=-0.1, total_steps=10),
         hpx.ConfigError, ("max_lr must be a finite number >= 0", "(got -0.1)")),
    Case("onecycle total_steps 0", lambda: hpx.OneCycleLR(_sgd_opt(), max_lr=0.1, total_steps=0),
         hpx.ConfigError, ("total_steps must be a positive integer", "(got 0)")),
    Case("onecycle div_factor 0",
         lambda: hpx.OneCycleLR(_sgd_opt(), max_lr=0.1, total_steps=10, div_factor=0),
         hpx.ConfigError, ("div_factor must be a finite number > 0", "(got 0)")),
    Case("explore spread a string", lambda: hpx.ExploreLR(torch.optim.lr_scheduler.StepLR(_sgd_opt(), 5),
                                                          spread="a"),
         hpx.ConfigError, ("spread must be a number in [0, 1)", "(got 'a')")),
]

INTEGRATIONS = [
    Case("lightning loss_fn None", lambda: _lightning(loss_fn=None), hpx.ConfigError,
         ("loss_fn must be a function (module, batch) -> loss", "(got NoneType)")),
    Case("lightning probe as one (x, y) tuple", lambda: _lightning(probe=(x8, y8)), hpx.ConfigError,
         ("looks like one batch", "probe=[(x_val, y_val)]")),
    Case("lightning probe None", lambda: _lightning(probe=None), hpx.ConfigError,
         ("probe must be held-out batches", "got NoneType")),
    Case("lightning total_steps 0", lambda: _lightning(total_steps=0), hpx.ConfigError,
         ("total_steps must be an integer >= 1", "(got 0)")),
    Case("lightning backend", lambda: _lightning(backend="gloo"), hpx.ConfigError,
         ("backend is set by the callback", "remove backend=...")),
    Case("lightning on_sync", lambda: _lightning(on_sync=print), hpx.ConfigError,
         ("on_sync is set by the callback", "remove on_sync=...")),
    Case("lightning unknown setting", lambda: _lightning(sede=1), hpx.ConfigError,
         ("unknown setting 'sede'", "seed")),
    Case("transformers loss_fn 3", lambda: _transformers(loss_fn=3), hpx.ConfigError,
         ("loss_fn must be a function (model, batch) -> loss", "(got int)")),
    Case("transformers total_steps", lambda: _transformers(total_steps=10), hpx.ConfigError,
         ("total_steps is set by the callback", "remove total_steps=...")),
    Case("transformers probe a dict", lambda: _transformers(probe={"input_ids": x8}), hpx.ConfigError,
         ("it is a dict (keys 'input_ids')", "wrap it in a list")),
    Case("transformers controller setting", lambda: _transformers(meta_lr=0.1), hpx.ConfigError,
         ("unknown setting 'meta_lr'", "span")),
]

ALL = (CONSTRUCTION + KNOBS + STEPS + SIGNALS + RECIPE + STRATEGIES + SCHEDULERS + ENGINE_MORE
       + RECIPE_MORE + SIGNALS_MORE + STRATEGIES_MORE + SCHEDULERS_MORE + INTEGRATIONS)


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


def test_a_schedule_that_returns_none_mid_run_stops_the_next_step() -> None:
    engine = _engine(knobs=[hpx.LearningRate(spread=0.3, schedule=lambda t: 1.0 if t < 3 else None)])
    for _ in range(3):
        engine.step(_ce, _xy(8))
    before = copy.deepcopy(engine.state_dict())
    with pytest.raises(hpx.ConfigError) as err:
        engine.step(_ce, _xy(8))
    assert "its schedule returned None at step 3" in str(err.value) and "return" in str(err.value)
    after = engine.state_dict()
    assert after["step"] == before["step"] == 3
    for a, b in zip(before["replicas"], after["replicas"]):
        assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])


def test_one_replica_with_a_spread_warns(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("WARNING", logger="hpx"):
        _engine(replicas=1)
    assert "one replica in all" in caplog.text and "replicas >= 2" in caplog.text




# --- on a running engine: refused, bit-for-bit unchanged, and it steps on like an unaffected one --


def _live(**kw: Any) -> hpx.Engine:
    """An engine with optimizer state (momentum), two replicas and a sync every 2 steps."""
    return _engine(optimizer=lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9), **kw)


def _live_autolr(total_steps: int = 40) -> hpx.Engine:
    return hpx.autolr(_model(), lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9),
                      total_steps=total_steps, replicas=2, probe=[_xy(8)])


def _train(engine: hpx.Engine, steps: int, seed: int) -> None:
    torch.manual_seed(seed)  # dropout draws from the global stream: the same masks for both engines
    for i in range(steps):
        engine.step(_ce, _xy(8) if i % 2 else (x8.flip(0), y8.flip(0)))


def _snapshot(engine: hpx.Engine) -> dict[str, Any]:
    """Everything a refused call must leave as it was: the state (weights, optimizer state, bases,
    step, next sync, history, search, signal, accumulators, the registry's permutation stream),
    the values written into the replicas, and the next permutation the registry would draw."""
    state = copy.deepcopy(engine.state_dict())
    for rec in state["history"]:
        rec.pop("wall", None)  # seconds since the engine was built: not the same for its twin
    gen = torch.Generator()
    gen.set_state(state["knobs"]["rng"])
    state["next permutation"] = torch.randperm(engine.n_replicas, generator=gen)
    state["values"] = {name: engine.values(name) for name in engine.knobs.names}
    state["lrs"] = [[g["lr"] for g in r.optimizer.param_groups] for r in engine.replicas]
    return state


def _same(a: Any, b: Any, where: str = "state") -> None:
    if torch.is_tensor(a):
        assert torch.is_tensor(b) and a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(a, b) or (a.is_floating_point() and torch.equal(a.isnan(), b.isnan())
                                     and torch.equal(a.nan_to_num(), b.nan_to_num())), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b), f"{where}: keys {list(a)} vs {list(b)}"
        for k in a:
            _same(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{where}[{i}]")
    elif isinstance(a, float) and math.isnan(a):
        assert isinstance(b, float) and math.isnan(b), where
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def _refused_unchanged_and_steps_on(case: EngineCase) -> None:
    """The shared check: ``case.mistake`` on an engine mid-run raises ``case.error`` naming the value
    and the fix, leaves the engine bit for bit as an unaffected twin is, and the engine then steps
    on (through syncs) exactly as the twin does."""
    engine, twin = case.make(), case.make()
    for e in (engine, twin):
        _train(e, 3, seed=1)  # momentum buffers, a sync, a step into the next interval
        if case.prelude is not None:
            case.prelude(e)
    before = _snapshot(engine)
    with pytest.raises(case.error) as err:
        case.mistake(engine)
    text = str(err.value)
    for needle in case.needles:
        assert needle in text, f"{needle!r} not in {text!r}"
    after = _snapshot(engine)
    _same(after, before)
    _same(after, _snapshot(twin))
    for e in (engine, twin):
        if case.prelude is not None:
            e.optimizer_step()
        _train(e, 4, seed=2)
    _same(_snapshot(engine), _snapshot(twin))
    steps = 7 + (case.prelude is not None)
    assert engine.step_count == twin.step_count == steps and len(engine.history) == len(twin.history) >= 3


@dataclass
class EngineCase:
    name: str
    mistake: Callable[[hpx.Engine], Any]
    error: type[Exception]
    needles: tuple[str, ...]
    make: Callable[[], hpx.Engine] = _live
    prelude: Callable[[hpx.Engine], Any] | None = None  # a valid call made on both engines first


def _backward(e: hpx.Engine) -> None:
    e.backward(_ce, (x8, y8))


def _ckpt(mutate: Callable[[dict], Any] | None = None, make: Callable[[], hpx.Engine] = _live) -> Path:
    """A checkpoint directory of a run like the live engine's at step 2; ``mutate`` rewrites its file
    (what it returns: a new state, or raw bytes) and its digest is written to match, as a file
    damaged before it was digested would."""
    root = Path(tempfile.mkdtemp(prefix="hpx-bad-"))
    other = make()
    _train(other, 2, seed=3)
    path = hpx.save_checkpoint(root, other)
    if mutate is not None:
        out = mutate(torch.load(path, weights_only=False))
        if isinstance(out, bytes):
            path.write_bytes(out)
        else:
            torch.save(out, path)
        sidecar = path.with_name(path.name + ".sha256")
        info = json.loads(sidecar.read_text())
        info["sha256"] = hashlib.sha256(path.read_bytes()).hexdigest()
        sidecar.write_text(json.dumps(info))
    return root


def _without(*keys: str, inner: bool = True) -> Callable[[dict], dict]:
    def cut(state: dict) -> dict:
        target = state["engine"] if inner else state
        for k in keys:
            del target[k]
        return state
    return cut


def _step_folder() -> Path:
    return next(_ckpt().glob("step-*"))


def _other_content() -> Path:
    root = Path(tempfile.mkdtemp(prefix="hpx-bad-"))
    (root / "notes.txt").write_text("not a checkpoint")
    return root


def _adam_ckpt() -> Path:
    return _ckpt(make=lambda: _engine(optimizer=lambda m: torch.optim.Adam(m.parameters(), lr=1e-3)))


def _empty() -> str:
    return tempfile.mkdtemp(prefix="hpx-bad-")


ON_AN_ENGINE = [
    # the step's arguments
    EngineCase("uncollated", lambda e: e.step(_ce, [(x8[i], y8[i]) for i in range(8)]), hpx.ConfigError,
               ("list of 8 separate examples", "default_collate")),
    EngineCase("lengths differ", lambda e: e.step(_ce, (x8, y8[:6])), hpx.ConfigError,
               ("batch[0]: 8, batch[1]: 6", "same examples")),
    EngineCase("batches=(x, y)", lambda e: e.step(_ce, batches=(x8, y8)), hpx.ConfigError,
               ("like one batch (x, y)", "batch=(x, y)")),
    EngineCase("batches wrong count", lambda e: e.step(_ce, batches=[(x8, y8)] * 3), hpx.ConfigError,
               ("3 entries for 2 local replicas", "one batch per local replica")),
    EngineCase("batches a number", lambda e: e.step(_ce, batches=3), hpx.ConfigError,
               ("batches must be a list with one batch per local replica", "(got 3)")),
    EngineCase("batches a generator", lambda e: e.step(_ce, batches=((x8, y8) for _ in range(2))),
               hpx.ConfigError, ("batches must be a list", "batches=[batch_0, batch_1, ...]")),
    EngineCase("batch and batches", lambda e: e.step(_ce, (x8, y8), batches=[(x8, y8)] * 2), hpx.ConfigError,
               ("give batch or batches, not both",)),
    EngineCase("batch a generator", lambda e: e.step(_ce, (b for b in (x8, y8))), hpx.ConfigError,
               ("batch is a generator, an iterator", "give the batch itself (next(it)")),
    EngineCase("batch an iterator", lambda e: e.step(_ce, iter([(x8, y8)])), hpx.ConfigError,
               ("batch is a list_iterator", "give the batch itself")),
    EngineCase("batch None", lambda e: e.step(_ce), hpx.ConfigError,
               ("loss_fn failed on batch None", "engine.step(loss_fn, (x, y))")),
    EngineCase("batch smaller than replicas", lambda e: e.step(_ce, (x8[:1], y8[:1])), hpx.ConfigError,
               ("a batch of size 1 cannot be split among 2 replicas", "at least one example per replica")),
    EngineCase("scalar in batch", lambda e: e.step(_ce, (x8, torch.tensor(1))), hpx.ConfigError,
               ("batch[1] is a 0-dim tensor", "one row per example")),
    EngineCase("loss_fn None", lambda e: e.step(None, (x8, y8)), hpx.ConfigError,
               ("loss_fn must be a function (replica, batch)", "(got None)")),
    EngineCase("loss_fn and batch swapped", lambda e: e.step((x8, y8), _ce), hpx.ConfigError,
               ("the arguments look swapped", "engine.step(loss_fn, batch)")),
    EngineCase("loss_fn a string", lambda e: e.step("cross_entropy", (x8, y8)), hpx.ConfigError,
               ("(got 'cross_entropy')", "lambda rep, b:")),
    EngineCase("loss_fn a tensor", lambda e: e.step(torch.tensor(1.0), (x8, y8)), hpx.ConfigError,
               ("(got a tensor of shape ())", "loss_fn must be a function")),
    EngineCase("backward loss_fn None", lambda e: e.backward(None, (x8, y8)), hpx.ConfigError,
               ("loss_fn must be a function", "(got None)")),
    # what loss_fn returns
    EngineCase("loss a float", lambda e: e.step(lambda r, b: 1.0, (x8, y8)), TypeError,
               ("loss_fn must return a scalar tensor", "float")),
    EngineCase("loss per example", lambda e: e.step(lambda r, b: F.cross_entropy(r.model(b[0]), b[1],
                                                                                 reduction="none"), (x8, y8)),
               TypeError, ("scalar tensor", "shape torch.Size([4])")),
    EngineCase("loss and logits", lambda e: e.step(lambda r, b: (_ce(r, b), r.model(b[0])), (x8, y8)),
               TypeError, ("scalar tensor", "tuple")),
    EngineCase("loss detached", lambda e: e.step(lambda r, b: _ce(r, b).detach(), (x8, y8)), hpx.ConfigError,
               ("the loss of replica 0 does not require grad", "return the loss tensor computed from")),
    EngineCase("loss under no_grad", lambda e: e.step(lambda r, b: torch.no_grad()(_ce)(r, b), (x8, y8)),
               hpx.ConfigError, ("does not require grad", "torch.no_grad()")),
    EngineCase("loss an integer", lambda e: e.step(lambda r, b: (r.model(b[0]).argmax(1) == b[1]).sum(),
                                                   (x8, y8)),
               hpx.ConfigError, ("loss_fn returned a int64 tensor for replica 0", "floating-point loss")),
    EngineCase("loss from .item()", lambda e: e.step(lambda r, b: torch.tensor(_ce(r, b).item()), (x8, y8)),
               hpx.ConfigError, ("does not require grad", ".item()")),
    EngineCase("loss_fn raises", lambda e: e.step(lambda r, b: r.model(b), (x8, y8)), TypeError,
               ("linear(): argument 'input'",)),
    # backward / optimizer_step / record / log
    EngineCase("scale 0", lambda e: e.backward(_ce, (x8, y8), scale=0), hpx.ConfigError,
               ("scale must be a number > 0 (got 0)", "1 / k when accumulating")),
    EngineCase("scale a string", lambda e: e.backward(_ce, (x8, y8), scale="1"), hpx.ConfigError,
               ("scale must be a number > 0 (got '1')", "1 / k")),
    EngineCase("scale nan", lambda e: e.backward(_ce, (x8, y8), scale=float("nan")), hpx.ConfigError,
               ("scale must be a number > 0 (got nan)",)),
    EngineCase("backward scaler", lambda e: e.backward(_ce, (x8, y8), scaler=3), hpx.ConfigError,
               ("scaler must be a torch.amp.GradScaler or None (got 3)", "same torch.amp.GradScaler")),
    EngineCase("optimizer_step scaler", lambda e: e.optimizer_step(scaler="amp"), hpx.ConfigError,
               ("scaler must be a torch.amp.GradScaler or None (got 'amp')", "engine.optimizer_step"),
               prelude=_backward),
    EngineCase("max_grad_norm 0", lambda e: e.optimizer_step(max_grad_norm=0), hpx.ConfigError,
               ("max_grad_norm must be a number > 0 or None (got 0)",), prelude=_backward),
    EngineCase("max_grad_norm a string", lambda e: e.optimizer_step(max_grad_norm="1.0"), hpx.ConfigError,
               ("max_grad_norm must be a number > 0 or None (got '1.0')",), prelude=_backward),
    EngineCase("optimizer_step before backward", lambda e: e.optimizer_step(), hpx.ConfigError,
               ("found no gradients", "call engine.backward(loss_fn, batch) first")),
    EngineCase("record a float", lambda e: e.record(0.5), hpx.ConfigError,
               ("record takes a replica's scalar loss tensor (got 0.5)", "engine.record(loss, replica=l)")),
    EngineCase("record a vector", lambda e: e.record(torch.ones(3)), hpx.ConfigError,
               ("(got a tensor of shape (3,))", "engine.record(loss, replica=l)")),
    EngineCase("record replica out of range", lambda e: e.record(torch.tensor(0.5), replica=5),
               hpx.ConfigError,
               ("replica must be a local replica's index, 0 to 1 (got 5)",)),
    EngineCase("record replica negative", lambda e: e.record(torch.tensor(0.5), replica=-1), hpx.ConfigError,
               ("0 to 1 (got -1)",)),
    EngineCase("log a list", lambda e: e.log([1.0]), hpx.ConfigError,
               ("log takes a dict of name -> number (got [1.0])",)),
    EngineCase("log a word", lambda e: e.log({"acc": "high"}), hpx.ConfigError,
               ("log's metric 'acc' is 'high'", "give a number or a one-element tensor")),
    EngineCase("log a vector", lambda e: e.log({"acc": torch.ones(3)}), hpx.ConfigError,
               ("'acc' is a tensor of shape (3,)", "one-element tensor")),
    EngineCase("log a non-string name", lambda e: e.log({1: 0.5}), hpx.ConfigError,
               ("log takes a dict of name -> number (got {1: 0.5})",)),
    EngineCase("values of an unknown knob", lambda e: e.values("wd"), KeyError,
               ("no knob named 'wd'", "(knobs: 'lr')")),
    # state and checkpoints
    EngineCase("checkpoint of another engine",
               lambda e: e.load_state_dict(_engine(sync_every=5).state_dict()),
               hpx.ConfigError, ("sync_every=5", "build it with the saved run's settings")),
    EngineCase("checkpoint not a dict", lambda e: e.load_state_dict([1, 2]), hpx.ConfigError,
               ("a checkpoint is the dict Engine.state_dict() returns (got list)",)),
    EngineCase("checkpoint missing keys", lambda e: e.load_state_dict(
        {k: v for k, v in _live().state_dict().items() if k not in ("slots", "acc")}), hpx.ConfigError,
               ("lacks ['slots', 'acc']", "resume from an intact checkpoint")),
    EngineCase("checkpoint of other knobs", lambda e: e.load_state_dict(_live(knobs=[hpx.LearningRate(
        "lr2", spread=0.3)]).state_dict()), hpx.ConfigError, ("holds knobs ['lr2']", "declares ['lr']")),
    EngineCase("elastic from nothing", lambda e: e.load_elastic([]), hpx.ConfigError,
               ("load_elastic needs the saved run's checkpoints", "one per process")),
    EngineCase("save keep 0", lambda e: hpx.save_checkpoint(_empty(), e, keep=0), hpx.ConfigError,
               ("keep must be an integer >= 1 (got 0)",)),
    EngineCase("save keep a string", lambda e: hpx.save_checkpoint(_empty(), e, keep="2"), hpx.ConfigError,
               ("keep must be an integer >= 1 (got '2')",)),
    EngineCase("save extra not a mapping", lambda e: hpx.save_checkpoint(_empty(), e, extra=3),
               hpx.ConfigError,
               ("extra must be a mapping name -> object", "(got int)")),
    EngineCase("save directory a number", lambda e: hpx.save_checkpoint(3, e), hpx.ConfigError,
               ("directory must be a path", "(got int)", "save_checkpoint(directory, engine)")),
    EngineCase("save arguments swapped", lambda e: hpx.save_checkpoint(e, _empty()), hpx.ConfigError,
               ("(got Engine)", "engine must be an hpx.Engine or hpx.Forks (got str)")),
    EngineCase("load arguments swapped", lambda e: hpx.load_checkpoint(e, _empty()), hpx.ConfigError,
               ("directory must be a path", "load_checkpoint(directory, engine)")),
    EngineCase("load extra not stateful", lambda e: hpx.load_checkpoint(_empty(), e, extra={"s": 1}),
               hpx.ConfigError, ("extra['s'] (int) has no state_dict/load_state_dict",)),
    EngineCase("load required, nothing there", lambda e: hpx.load_checkpoint(_empty(), e, required=True),
               hpx.ConfigError, ("no checkpoint in", "required=True")),
    EngineCase("load required a string", lambda e: hpx.load_checkpoint(_empty(), e, required="yes"),
               hpx.ConfigError, ("required must be True or False (got 'yes')",)),
    EngineCase("load a file", lambda e: hpx.load_checkpoint(next(_ckpt().glob("step-*/rank-*.pt")), e),
               hpx.ConfigError, ("is a file", "the one that holds the step-... folders")),
    EngineCase("load a step folder", lambda e: hpx.load_checkpoint(_step_folder(), e), hpx.ConfigError,
               ("is one step's folder", "resumes from the newest complete step")),
    EngineCase("save into a file", lambda e: hpx.save_checkpoint(next(_ckpt().glob("step-*/rank-*.pt")), e),
               hpx.ConfigError, ("is a file: give save_checkpoint", "holds the step-... folders")),
    EngineCase("save into a step folder", lambda e: hpx.save_checkpoint(_step_folder(), e), hpx.ConfigError,
               ("is one step's folder: give save_checkpoint",)),
    EngineCase("load a directory of other things", lambda e: hpx.load_checkpoint(_other_content(), e),
               hpx.ConfigError, ("holds notes.txt but no checkpoint", "an empty or new one for a first run")),
    EngineCase("load another optimizer's checkpoint", lambda e: hpx.load_checkpoint(_adam_ckpt(), e),
               hpx.ConfigError, ("saved from a Adam", "build the engine with a Adam")),
    EngineCase("load into a larger engine",
               lambda e: hpx.load_checkpoint(_ckpt(make=lambda: _live(replicas=4)), e),
               hpx.ConfigError, ("checkpoint has 4 replicas, this engine 2", "elastic=True")),
    EngineCase("load with an extra never saved", lambda e: hpx.load_checkpoint(
        _ckpt(), e, extra={"opt": torch.optim.SGD([torch.zeros(1)], lr=0.1)}), hpx.ConfigError,
               ("holds no state for ['opt']", "give load_checkpoint the extra objects that were saved")),
    # files that match their digest but are not what they should be
    EngineCase("damaged: not a pickle",
               lambda e: hpx.load_checkpoint(_ckpt(lambda st: b"\x80\x02garbage"), e), hpx.ConfigError,
               ("cannot be read as a checkpoint (UnpicklingError", "delete its step folder")),
    EngineCase("damaged: a list", lambda e: hpx.load_checkpoint(_ckpt(lambda st: [1, 2]), e), hpx.ConfigError,
               ("holds a list, not a checkpoint", "delete its step folder")),
    EngineCase("damaged: no engine", lambda e: hpx.load_checkpoint(_ckpt(_without("engine", inner=False)), e),
               hpx.ConfigError, ("a checkpoint is the dict Engine.state_dict() returns (got NoneType)",)),
    EngineCase("damaged: no random streams",
               lambda e: hpx.load_checkpoint(_ckpt(_without("rng", inner=False)), e),
               hpx.ConfigError, ("holds no usable random streams ('rng': NoneType)", "rng=False")),
    EngineCase("damaged: random streams garbled", lambda e: hpx.load_checkpoint(
        _ckpt(lambda st: {**st, "rng": {"torch": 3}}), e), hpx.ConfigError,
               ("holds no usable random streams ('rng': dict)", "delete its step folder")),
    EngineCase("damaged: no step", lambda e: hpx.load_checkpoint(_ckpt(_without("step")), e), hpx.ConfigError,
               ("lacks ['step']", "delete the damaged step folder")),
    EngineCase("damaged: no search", lambda e: hpx.load_checkpoint(_ckpt(_without("search")), e),
               hpx.ConfigError, ("lacks ['search']", "resume from an intact checkpoint")),
    EngineCase("damaged: no history", lambda e: hpx.load_checkpoint(_ckpt(_without("history", "acc_n")), e),
               hpx.ConfigError, ("lacks ['acc_n', 'history']", "intact checkpoint")),
    EngineCase("damaged: unknown format",
               lambda e: hpx.load_checkpoint(_ckpt(_without("format", inner=False)), e),
               hpx.ConfigError, ("unknown checkpoint file format None",)),
    EngineCase("damaged: another step's state", lambda e: hpx.load_checkpoint(
        _ckpt(lambda st: {**st, "step": 9, "engine": {**st["engine"], "step": 9}}), e), hpx.ConfigError,
               ("is in the folder of step 2 but holds the state of step 9",
                "name it after the step it holds")),
    # autolr's engine
    EngineCase("autolr: loss_fn None", lambda e: e.step(None, (x8, y8)), hpx.ConfigError,
               ("loss_fn must be a function", "(got None)"), make=_live_autolr),
    EngineCase("autolr: batch a generator", lambda e: e.step(_ce, (b for b in (x8, y8))), hpx.ConfigError,
               ("batch is a generator", "next(it)"), make=_live_autolr),
    EngineCase("autolr: loss detached", lambda e: e.step(lambda r, b: _ce(r, b).detach(), (x8, y8)),
               hpx.ConfigError, ("does not require grad", "with its graph"), make=_live_autolr),
    EngineCase("autolr: log a word", lambda e: e.log({"acc": "high"}), hpx.ConfigError,
               ("'acc' is 'high'", "give a number"), make=_live_autolr),
    EngineCase("autolr: checkpoint of another length",
               lambda e: hpx.load_checkpoint(_ckpt(make=lambda: _live_autolr(total_steps=50)), e),
               hpx.ConfigError, ("total_steps=50", "saved run's settings"), make=_live_autolr),
]


@pytest.mark.parametrize("case", ON_AN_ENGINE, ids=[c.name for c in ON_AN_ENGINE])
def test_a_refused_call_leaves_the_engine_as_it_was_and_it_steps_on(case: EngineCase) -> None:
    _refused_unchanged_and_steps_on(case)
