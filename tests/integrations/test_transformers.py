"""hpx.integrations.transformers.AutoLR, run by the real Hugging Face Trainer on CPU."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import hpx
from hpx.integrations.transformers import AutoLR
from tests._dist import run_distributed
from tests.integrations._hf import probe, probe_loss, trainer, two_ranks


class _Spy:
    """Records the lr the next optimizer step will use, after AutoLR wrote it."""

    def __init__(self):
        self.lrs = {}

    def __getattr__(self, name):  # every other TrainerCallback event: nothing
        if name.startswith("on_"):
            return lambda *a, **k: None
        raise AttributeError(name)

    def on_step_end(self, args, state, control, optimizer=None, **kw):
        self.lrs[state.global_step] = optimizer.param_groups[0]["lr"]


def test_one_process_explores_with_its_one_model_and_scales_the_trainers_schedule(tmp_path):
    import warnings

    auto, spy = AutoLR(probe_loss, probe=probe()), _Spy()
    t = trainer(tmp_path, 40, [auto, spy], lr=3e-4)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        t.train()
    assert not [w for w in seen if "replica" in str(w.message)]  # nothing to warn about: the search ran
    e = auto.engine
    assert e.n_replicas == 1 and e.step_count == 40
    assert e.bases["lr"] != 1.0  # the one model scored the four points in turn and the lr moved
    lam = t.lr_scheduler.lr_lambdas[0]
    for step in range(1, 40):  # the lr for the next step: the linear schedule times the base then
        base = next((r.bases["lr"] for r in reversed(e.history) if r.step <= step), 1.0)
        assert spy.lrs[step] == pytest.approx(3e-4 * lam(step) * base, rel=1e-9)
    logged = [h for h in t.state.log_history if "hpx/lr_base" in h]
    assert logged[-1]["hpx/lr_base"] == pytest.approx(e.bases["lr"])
    # hpx/lr is the lr the step before each sync used (it was the Trainer's next, unscaled one)
    used = {step + 1: lr for step, lr in spy.lrs.items()}  # spy: the lr written for the next step
    later = [h for h in logged if h["step"] in used]
    assert len(later) >= 5
    assert [h["hpx/lr"] for h in later] == pytest.approx([used[h["step"]] for h in later], rel=1e-9)


class _Logs:
    """What the Trainer's on_log hands every callback (what TensorBoard, W&B, ... write)."""

    def __init__(self):
        self.logs = []

    def __getattr__(self, name):  # every other TrainerCallback event: nothing
        if name.startswith("on_"):
            return lambda *a, **k: None
        raise AttributeError(name)

    def on_log(self, args, state, control, logs=None, **kw):
        self.logs.append((state.global_step, dict(logs)))


def test_training_loss_is_recorded_and_reported_through_the_trainers_logging(tmp_path, caplog):
    import logging

    logs = _Logs()  # before AutoLR, as the Trainer puts its reporting integrations
    auto = AutoLR(probe_loss, probe=probe())
    t = trainer(tmp_path, 100, [logs, auto], lr=3e-4)
    with caplog.at_level(logging.WARNING, logger="hpx"):
        t.train()
    e = auto.engine
    late = [r for r in e.history if not r.searched]  # the last 10%: the training loss is the score
    assert late and all(len(r.scores) == 1 and 0 < r.scores[0] < 5 for r in late)
    assert not [r for r in caplog.records if "finite score" in r.getMessage()]  # no false NaN alarm
    seen = [(step, entry) for step, entry in logs.logs if "hpx/lr_base" in entry]
    assert [step for step, _ in seen] == [r.step for r in e.history]  # one log per sync, at its step
    assert seen[-1][1]["hpx/lr_base"] == pytest.approx(e.bases["lr"]) and "hpx/lr" in seen[-1][1]
    assert [h["step"] for h in t.state.log_history if "hpx/lr_base" in h] == [r.step for r in e.history]


def test_a_model_that_returns_no_loss_is_named_once(tmp_path, caplog):
    import logging

    import torch.nn.functional as F

    auto = AutoLR(probe_loss, probe=probe())
    t = trainer(tmp_path, 20, [auto], lr=3e-4)
    t.compute_loss_func = lambda out, labels, num_items_in_batch=None: F.cross_entropy(out["logits"], labels)
    with caplog.at_level(logging.WARNING, logger="hpx"):
        t.train()
    said = [r.getMessage() for r in caplog.records if "holds no loss" in r.getMessage()]
    assert len(said) == 1 and "compute_loss_func" in said[0]


def test_resume_from_a_checkpoint_path_in_another_output_dir_continues_exactly(tmp_path):
    import warnings

    import torch

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        first = AutoLR(probe_loss, probe=probe())
        t1 = trainer(tmp_path / "a", 20, [first], save_strategy="steps", save_steps=10)
        t1.train()
        again = AutoLR(probe_loss, probe=probe())
        t2 = trainer(tmp_path / "b", 20, [again], save_strategy="steps", save_steps=10)
        t2.train(resume_from_checkpoint=str(tmp_path / "a" / "checkpoint-10"))
    assert again.engine.step_count == 20 and again.engine.bases == first.engine.bases
    assert [r.step for r in again.engine.history] == [r.step for r in first.engine.history]
    for p, q in zip(t1.model.parameters(), t2.model.parameters()):
        assert torch.equal(p, q)  # the resumed run is the same run
    assert (tmp_path / "b" / "checkpoint-20" / "hpx_rank0.pt").exists()


def test_checkpoint_resume_continues_hpxs_state(tmp_path):
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        first = AutoLR(probe_loss, probe=probe())
        trainer(tmp_path, 20, [first], save_strategy="steps", save_steps=10).train()
        assert (tmp_path / "checkpoint-10" / "hpx_rank0.pt").exists()
        again = AutoLR(probe_loss, probe=probe())
        trainer(tmp_path, 20, [again], save_strategy="steps", save_steps=10).train(
            resume_from_checkpoint=str(tmp_path / "checkpoint-10"))
    assert again.engine.step_count == 20
    assert [r.step for r in again.engine.history] == [r.step for r in first.engine.history]
    assert again.engine.bases == first.engine.bases


def test_two_processes_explore_and_agree(tmp_path):
    ranks = run_distributed(two_ranks, 2, str(tmp_path), timeout=240)
    for r in ranks:
        assert r["n"] == 2 and r["step"] == 40 and "stretch" in r["phases"]
        assert r["logged"] and r["logged"][-1]["hpx/lr_base"] == pytest.approx(r["bases"]["lr"])
    assert ranks[0]["bases"] == ranks[1]["bases"] and ranks[0]["steps"] == ranks[1]["steps"]
    assert ranks[0]["bases"]["lr"] != 1.0  # the search moved the learning rate
    assert ranks[0]["params"] == ranks[1]["params"]  # DDP and hpx keep the replicas identical


def test_bad_settings_are_named_together():
    with pytest.raises(hpx.ConfigError) as e:
        AutoLR(3, probe=None, backend=1, mode="shared")
    msg = str(e.value)
    for part in ("probe must be held-out batches", "loss_fn must be a function", "backend is set by",
                 "mode is set by"):
        assert part in msg
