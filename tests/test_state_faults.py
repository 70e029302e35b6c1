"""Loads that are refused leave the engine as it was, steps and syncs that fail half-way leave it
clean, and the run's settings that a resume must share are checked (issue 20, items 5, 6 and 9).
Each test fails on the code before the fix. The distributed side (every rank learns a refusal)
is in test_load_agreement.py."""

from __future__ import annotations

import copy
import logging
import os
import shutil
import subprocess
import sys
from typing import Any

import pytest
import torch
from torch import nn

import hpx
import hpx.checkpoint as ckpt
from tests._digits import ce, data, mlp
from tests.test_checkpoint import Counter

T = 4


def _engine(opt: str = "sgd", replicas: int = 2, **kw: Any) -> hpx.Engine:
    def factory(m: nn.Module) -> torch.optim.Optimizer:
        if opt == "adam":
            return torch.optim.Adam(m.parameters(), lr=1e-3)
        return torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)

    return hpx.Engine(mlp(), factory, [hpx.LearningRate(spread=0.3)], replicas=replicas, sync_every=T, **kw)


def _snapshot(engine: hpx.Engine) -> dict[str, Any]:
    """Everything a refusal must leave as it was, copied."""
    return {
        "replicas": copy.deepcopy([(r.model.state_dict(), r.optimizer.state_dict())
                                   for r in engine.replicas]),
        "bases": dict(engine.bases), "step": engine.step_count, "next": engine.next_sync,
        "history": copy.deepcopy(engine.history), "acc": engine._acc.clone(), "acc_n": list(engine._acc_n),
        "slots": engine._slots.clone(),
    }


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    for (ma, oa), (mb, ob) in zip(a["replicas"], b["replicas"]):
        if list(ma) != list(mb) or any(not torch.equal(ma[k], mb[k]) for k in ma):
            return False
        if oa["param_groups"] != ob["param_groups"] or list(oa["state"]) != list(ob["state"]):
            return False
        for i in oa["state"]:
            sa, sb = oa["state"][i], ob["state"][i]
            if list(sa) != list(sb) or any(not torch.equal(torch.as_tensor(sa[k]), torch.as_tensor(sb[k]))
                                           for k in sa):
                return False
    return (a["bases"] == b["bases"] and a["step"] == b["step"] and a["next"] == b["next"]
            and a["history"] == b["history"] and torch.equal(a["acc"], b["acc"])
            and a["acc_n"] == b["acc_n"] and torch.equal(a["slots"], b["slots"]))


def _train(engine: hpx.Engine, batches: list, until: int) -> None:
    while engine.step_count < until:
        engine.step(ce, batches[engine.step_count])


@pytest.fixture
def batches(digits):
    return data(digits, 40, size=16)


def _trained(batches: list, steps: int = 3, **kw: Any) -> hpx.Engine:
    engine = _engine(**kw)
    _train(engine, batches, steps)
    return engine


# --- item 5: refused loads change nothing ---------------------------------------------------


def test_an_sgd_checkpoint_into_an_adam_engine_is_refused_before_anything_changes(tmp_path, batches):
    src = _trained(batches, 6)
    hpx.save_checkpoint(tmp_path, src)
    dst = _trained(batches, 3, opt="adam")
    before = _snapshot(dst)
    with pytest.raises(hpx.ConfigError) as err:
        hpx.load_checkpoint(tmp_path, dst)
    msg = str(err.value)
    assert "SGD" in msg and "Adam" in msg and "optimizer" in msg
    assert _same(before, _snapshot(dst))
    _train(dst, batches, 8)  # and it steps on


def test_an_extra_object_of_another_type_is_refused_with_the_engine_unchanged(tmp_path, batches):
    src = _trained(batches, 6)
    sched = torch.optim.lr_scheduler.StepLR(torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1), 5)
    hpx.save_checkpoint(tmp_path, src, extra={"sched": sched})
    dst = _trained(batches, 3)
    counter = Counter()
    before = _snapshot(dst)
    with pytest.raises(hpx.ConfigError) as err:
        hpx.load_checkpoint(tmp_path, dst, extra={"sched": counter})
    assert "extra['sched']" in str(err.value) and "StepLR" in str(err.value) and "Counter" in str(err.value)
    assert _same(before, _snapshot(dst)) and counter.n == 0


def test_an_extra_whose_load_fails_leaves_the_engine_and_the_other_extras_unchanged(tmp_path, batches):
    src = _trained(batches, 6)
    hpx.save_checkpoint(tmp_path, src, extra={"a": Counter(), "b": Counter()})

    def refuse(self, s: dict) -> None:
        raise KeyError("missing 'm'")

    Picky = type("Counter", (Counter,), {"load_state_dict": refuse})  # passes the type's name check

    dst = _trained(batches, 3)
    a = Counter()
    a.n = 7
    before = _snapshot(dst)
    with pytest.raises(hpx.ConfigError) as err:
        hpx.load_checkpoint(tmp_path, dst, extra={"a": a, "b": Picky()})
    assert "extra['b']" in str(err.value) and "missing 'm'" in str(err.value)
    assert _same(before, _snapshot(dst)) and a.n == 7


def test_a_step_folder_copied_over_another_is_refused(tmp_path, batches):
    src = _engine()
    for s in (4, 6):
        _train(src, batches, s)
        hpx.save_checkpoint(tmp_path, src, keep=5)
    shutil.rmtree(tmp_path / "step-000000006")
    shutil.copytree(tmp_path / "step-000000004", tmp_path / "step-000000006")
    dst = _trained(batches, 3)
    before = _snapshot(dst)
    with pytest.raises(hpx.ConfigError) as err:
        hpx.load_checkpoint(tmp_path, dst)
    assert "step-000000006" in str(err.value) and "step 4" in str(err.value)
    assert _same(before, _snapshot(dst))


# --- item 6: half-finished steps and syncs ---------------------------------------------------


@pytest.mark.parametrize("mode", ["shared", "independent"])
def test_a_step_whose_loss_fn_raised_leaves_no_gradient_behind(batches, mode):
    clean, faulted = _engine(replicas=3, mode=mode), _engine(replicas=3, mode=mode)
    _train(clean, batches, 2)
    _train(faulted, batches, 2)

    def boom(rep, b):
        if rep.index == 2:
            raise RuntimeError("data loader hiccup")
        return ce(rep, b)

    with pytest.raises(RuntimeError, match="hiccup"):
        faulted.step(boom, batches[2])
    _train(clean, batches, 7)
    _train(faulted, batches, 7)
    for a, b in zip(clean.replicas, faulted.replicas):
        for p, q in zip(a.model.parameters(), b.model.parameters()):
            assert torch.equal(p, q)


@pytest.mark.parametrize("mode", ["shared", "independent"])
def test_a_micro_batch_whose_loss_fn_raised_leaves_no_loss_in_the_intervals_sums(batches, mode):
    """Accumulating 2 micro-batches, the second raises: the step is dropped, and the first
    micro-batch's losses must leave the interval's sums with it (they stayed, so the retried step
    counted them twice and the sync scored the replicas on other numbers)."""

    def boom(rep, b):
        raise RuntimeError("data loader hiccup")

    def run(fault: bool) -> hpx.Engine:
        engine = _engine(mode=mode)
        for t in range(2 * T):
            a, b = batches[2 * t], batches[2 * t + 1]
            if fault and t == 1:
                engine.backward(ce, a, scale=0.5)
                with pytest.raises(RuntimeError, match="hiccup"):
                    engine.backward(boom, b, scale=0.5)
            engine.backward(ce, a, scale=0.5)
            engine.backward(ce, b, scale=0.5)
            engine.optimizer_step()
        return engine

    clean, faulted = run(False), run(True)
    assert [r.scores for r in faulted.history] == [r.scores for r in clean.history]
    assert [r.bases for r in faulted.history] == [r.bases for r in clean.history]
    for a, b in zip(clean.replicas, faulted.replicas):
        assert all(torch.equal(p, q) for p, q in zip(a.model.parameters(), b.model.parameters()))


def test_an_on_sync_callback_that_raises_still_finishes_the_sync(batches):
    calls = []

    def cb(rec):
        calls.append(rec.step)
        if len(calls) == 1:
            raise RuntimeError("dashboard down")

    clean, faulted = _engine(), _engine(on_sync=cb)
    _train(clean, batches, T)
    with pytest.raises(RuntimeError, match="dashboard down"):
        _train(faulted, batches, T)
    assert faulted.step_count == T
    assert torch.equal(faulted._acc, torch.zeros_like(faulted._acc)) and faulted._acc_n == [0, 0]
    assert torch.equal(faulted._slots, clean._slots)
    _train(clean, batches, 3 * T)
    _train(faulted, batches, 3 * T)
    assert [r.bases for r in clean.history] == [r.bases for r in faulted.history]
    for a, b in zip(clean.replicas, faulted.replicas):
        assert all(torch.equal(p, q) for p, q in zip(a.model.parameters(), b.model.parameters()))


@pytest.mark.parametrize("metrics", [{"acc": "high"}, {"acc": None}, {"acc": [1, 2]},
                                     {"acc": torch.ones(3)}])
def test_log_refuses_what_a_sync_cannot_read(batches, metrics):
    engine = _trained(batches, 2)
    with pytest.raises(hpx.ConfigError) as err:
        engine.log(metrics)
    assert "'acc'" in str(err.value) and "number" in str(err.value)
    engine.log({"ok": 1, "t": torch.tensor(0.5)})
    _train(engine, batches, 2 * T)  # every later step and sync goes on
    assert engine.history[0].metrics == {"ok": 1.0, "t": 0.5}


def test_a_history_file_that_is_a_directory_is_refused_at_construction(tmp_path):
    with pytest.raises(hpx.ConfigError) as err:
        _engine(history_file=str(tmp_path))
    assert str(tmp_path) in str(err.value) and "directory" in str(err.value)


# --- item 9 ---------------------------------------------------------------------------------


def _autolr(total: int, span: float = 1.5, **kw: Any) -> hpx.Engine:
    return hpx.autolr(mlp(), lambda m: torch.optim.SGD(m.parameters(), lr=0.05), total_steps=total,
                      loss_fn=ce, span=span, replicas=2, **kw)


def test_stepping_past_autolrs_total_steps_warns_once(batches, caplog):
    engine = _autolr(6)
    with caplog.at_level(logging.WARNING, logger="hpx"):
        _train(engine, batches, 6)
        assert "total_steps" not in caplog.text
        _train(engine, batches, 9)
    hits = [r.getMessage() for r in caplog.records if "total_steps=6" in r.getMessage()]
    assert len(hits) == 1 and "step 7" in hits[0]


@pytest.mark.parametrize("other, needle", [(dict(total=30), "total_steps=20"),
                                           (dict(total=20, span=2.0), "span=1.5")])
def test_resuming_autolr_with_another_total_steps_or_span_is_refused(tmp_path, batches, other, needle):
    src = _autolr(20)
    _train(src, batches, 4)
    hpx.save_checkpoint(tmp_path, src)
    dst = _autolr(other["total"], other.get("span", 1.5))
    before = _snapshot(dst)
    with pytest.raises(hpx.ConfigError) as err:
        hpx.load_checkpoint(tmp_path, dst)
    assert needle in str(err.value)
    assert _same(before, _snapshot(dst))
    with pytest.raises(hpx.ConfigError):
        hpx.load_checkpoint(tmp_path, _autolr(other["total"], other.get("span", 1.5)), elastic=True)


def test_a_save_killed_midway_leaves_no_temp_file_after_the_next_save(tmp_path, batches):
    engine = _trained(batches, 4)
    hpx.save_checkpoint(tmp_path, engine)
    # a process that died while writing: its temp files stay behind under its PID
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True).stdout.strip()
    folder = tmp_path / "step-000000004"
    stale = [folder / f".rank-00000.pt.tmp-{dead}", folder / f".rank-00000.pt.sha256.tmp-{dead}"]
    for f in stale:
        f.write_bytes(b"x" * 1000)
    alive = folder / f".rank-00000.pt.tmp-{os.getppid()}"  # a live process's write is left alone
    alive.write_bytes(b"y")
    _train(engine, batches, 5)
    hpx.save_checkpoint(tmp_path, engine, keep=5)
    assert not any(f.exists() for f in stale) and alive.exists()
    for f in stale:
        f.write_bytes(b"x")
    assert hpx.load_checkpoint(tmp_path, _engine()) == 5
    assert not any(f.exists() for f in stale)


def test_keep_1_is_refused_under_torch_distributed(tmp_path, batches, monkeypatch):
    engine = _trained(batches, 2)
    monkeypatch.setattr(ckpt, "_processes", lambda e: type("P", (), {"world_size": 2, "rank": 0})())
    with pytest.raises(hpx.ConfigError) as err:
        hpx.save_checkpoint(tmp_path, engine, keep=1)
    assert "keep=1" in str(err.value) and "keep=2" in str(err.value)
    assert not tmp_path.exists() or not any(tmp_path.iterdir())
    monkeypatch.undo()
    assert hpx.save_checkpoint(tmp_path, engine, keep=1).is_file()  # one process: one is enough


# --- item 1b: a long schedule is read lazily ------------------------------------------------


def _opt_groups() -> tuple[nn.Module, torch.optim.Optimizer]:
    model = mlp()
    return model, torch.optim.SGD([{"params": model[0].parameters(), "lr": 0.1},
                                   {"params": model[2].parameters(), "lr": 0.02}], lr=0.1, momentum=0.9)


def test_autolr_with_a_billion_steps_and_a_torch_scheduler_returns_at_once(batches):
    import time

    model, opt = _opt_groups()
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=[0.1, 0.02], total_steps=10**9)
    t0 = time.monotonic()
    engine = hpx.autolr(model, opt, total_steps=10**9, schedule=sched, loss_fn=ce)
    assert time.monotonic() - t0 < 60  # the table of every step took ~5,600 s here; the prefix read ~0.6 s
    _train(engine, batches, 3)
    _, ref_opt = _opt_groups()
    ref = torch.optim.lr_scheduler.OneCycleLR(ref_opt, max_lr=[0.1, 0.02], total_steps=10**9)
    for _ in range(3):
        ref_opt.step()
        ref.step()
    got = [g["lr"] for g in engine.replicas[0].optimizer.param_groups]
    assert got == pytest.approx([g["lr"] for g in ref_opt.param_groups], rel=1e-12)
    momenta = [g["momentum"] for g in engine.replicas[0].optimizer.param_groups]
    assert momenta == pytest.approx([g["momentum"] for g in ref_opt.param_groups], rel=1e-12)


def test_a_long_schedule_read_lazily_matches_the_table_and_checks_the_shape(monkeypatch):
    from hpx.schedule import _shadow

    _, opt = _opt_groups()

    def sched() -> torch.optim.lr_scheduler.LRScheduler:
        return torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=300)

    table, peaks, _ = _shadow.read_schedule(sched(), 300)
    monkeypatch.setattr(_shadow, "_EAGER_STEPS", 50)
    lazy, lazy_peaks, _ = _shadow.read_schedule(sched(), 300)
    assert isinstance(lazy, _shadow._LazySchedule) and lazy_peaks == peaks
    assert [lazy(t) for t in range(0, 320)] == [table(t) for t in range(0, 320)]
    assert lazy(120) == table(120)  # an earlier step again (a resume): read anew
    # group 1 departs from group 0's shape at step 80, past the steps read at once
    bent = torch.optim.lr_scheduler.LambdaLR(opt, [lambda t: 1.0, lambda t: 1.0 if t < 80 else 0.5])
    lazy, _, _ = _shadow.read_schedule(bent, 300)
    assert lazy(79) == 1.0
    with pytest.raises(hpx.ConfigError, match="param group 1 follows another shape than group 0 at step 80"):
        lazy(81)
