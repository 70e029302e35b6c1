"""hpx.integrations.transformers.ForksTrainer, run by the real Hugging Face Trainer on CPU, against
plain Trainer runs."""

from __future__ import annotations

import functools
import math
import warnings

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import torch

import hpx
from hpx.integrations.transformers import ForksTrainer
from tests._dist import run_distributed
from tests.integrations._hf import Tiny, forks_args, forks_two_ranks, probe, train_set

POW2 = (1 / 16, 1 / 4, 1, 4, 16)  # powers of 2: m * (lr * schedule) is (m * lr) * schedule exactly


def _plain(out, steps, lr, dropout=0.0, loss=None, **kw):
    from transformers import Trainer

    t = Trainer(model=Tiny(dropout), args=forks_args(out, steps, lr, **kw), train_dataset=train_set(),
                **({} if loss is None else {"compute_loss_func": loss}))
    t.train()
    return t


def _forks(out, steps, lr, dropout=0.0, forks=None, loss=None, **kw):
    return ForksTrainer(model=Tiny(dropout), args=forks_args(out, steps, lr, **kw), train_dataset=train_set(),
                        probe=probe(), forks={"multiples": POW2, **(forks or {})},
                        **({} if loss is None else {"compute_loss_func": loss}))


def _same(a, b):
    return all(torch.equal(p, q) for p, q in zip(a.model.parameters(), b.model.parameters()))


def test_a_confident_winner_is_the_plain_trainer_at_its_multiple_bit_for_bit(tmp_path):
    t = _forks(tmp_path / "f", 60, 1e-4, dropout=0.1)  # 16x too low: the 16x fork wins
    t.train()
    f = t.forks
    assert f.decided and f.factor == 16.0 and f.step_count == 60
    assert [r.phase for r in f.history] == ["cut", "cut", "end"]
    assert f.history[-1].metrics["gain"] > 2  # won with confidence
    # dropout draws included: the 16x fork's random stream is the one plain training has
    assert _same(t, _plain(tmp_path / "p", 60, 16e-4, dropout=0.1))
    assert t.optimizer.param_groups[0]["lr"] == pytest.approx(16e-4 * t.lr_scheduler.lr_lambdas[0](60))
    assert t.lr_scheduler.last_epoch == 60
    # 5 forks to step 9 (the cut at 6 scored on 5 copies annealed over 3 steps), 3 to 18 (the cut at 15,
    # 3 copies for 3 steps), 2 to 60; your run's steps (the Trainer's) counted among them
    assert f.fork_steps == 5 * 9 + 4 * 3 + 3 * 9 + 2 * 3 + 2 * 42  # no annealed copy of your run
    logged = [h for h in t.state.log_history if "hpx/lr_multiple" in h]
    assert [h["step"] for h in logged] == [r.step for r in f.history]
    assert logged[-1]["hpx/lr_multiple"] == 16.0 and logged[-1]["hpx/gain"] > 2
    assert logged[-1]["hpx/bar"] == pytest.approx(f.history[-1].metrics["bar"])  # what the gain cleared
    assert logged[0]["hpx/probe_loss/16x"] == pytest.approx(f.history[0].scores[-1])


@pytest.mark.parametrize("share", [True, False])
def test_share_passes_through_and_a_frozen_base_is_held_once_only_when_shared(tmp_path, share):
    """forks={"share": ...} reaches hpx.Forks: with a frozen first layer, every fork holds your run's
    frozen weights (the same tensors) under share=True and copies of them under share=False."""
    held = []  # at the first cut: whether each challenger's frozen weight is your run's tensor
    t = _forks(tmp_path / "f", 24, 1e-4, forks={"share": share, "on_sync": lambda r: held.append(
        [g.model.net[0].weight.data_ptr() == t.model.net[0].weight.data_ptr() for g in t.forks._forks[1:]])})
    t.model.net[0].requires_grad_(False)
    t.train()
    assert t.forks.decided and len(held) == 3
    assert held[0] and all(x is share for x in held[0])


def test_your_run_kept_is_the_plain_trainer_bit_for_bit(tmp_path):
    t = _forks(tmp_path / "f", 40, 1e-3, dropout=0.1, forks={"confidence": 1e9})
    t.train()
    assert t.forks.factor == 1.0 and t.forks.decided
    assert _same(t, _plain(tmp_path / "p", 40, 1e-3, dropout=0.1))


def _smoothed(out, labels, num_items_in_batch=None):
    return torch.nn.functional.cross_entropy(out["logits"], labels, label_smoothing=0.1)


def test_accumulation_clipping_and_the_trainers_loss_function_reach_every_fork(tmp_path):
    kw = {"gradient_accumulation_steps": 2, "max_grad_norm": 0.05, "per_device_train_batch_size": 16,
          "loss": _smoothed}
    t = _forks(tmp_path / "f", 40, 1e-4, **kw)
    t.train()
    assert t.forks.factor == 16.0
    assert _same(t, _plain(tmp_path / "p", 40, 16e-4, **kw))


def test_resume_mid_cut_from_another_output_dir_continues_exactly(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        first = _forks(tmp_path / "a", 60, 1e-4, dropout=0.1, save_strategy="steps", save_steps=16)
        first.train()  # the cut at step 15 is scored at 18: checkpoint-16 holds its annealed copies
        saved = torch.load(tmp_path / "a" / "checkpoint-16" / "hpx_forks_rank0.pt", weights_only=False)
        assert len(saved["clones"]) == 2 and saved["forks"][0]["model"] is None  # yours: the Trainer's file
        again = _forks(tmp_path / "b", 60, 1e-4, dropout=0.1, save_strategy="steps", save_steps=16)
        again.train(resume_from_checkpoint=str(tmp_path / "a" / "checkpoint-16"))
    assert again.forks.factor == first.forks.factor and again.forks.fork_steps == first.forks.fork_steps
    assert repr([r.scores for r in again.forks.history]) == repr([r.scores for r in first.forks.history])
    assert _same(again, first)


def test_a_checkpoint_without_hpxs_state_is_named(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _plain(tmp_path, 20, 1e-3, save_strategy="steps", save_steps=10)
        t = _forks(tmp_path, 20, 1e-3, save_strategy="steps", save_steps=10)
        with pytest.raises(hpx.ConfigError, match=r"hpx_forks_rank0\.pt.*saved by a ForksTrainer"):
            t.train(resume_from_checkpoint=True)


def test_bad_settings_are_named_together():
    with pytest.raises(hpx.ConfigError) as e:
        ForksTrainer(model=Tiny(), args=forks_args("/tmp/unused", 10, 1e-3), probe=None, probe_loss=3,
                     forks={"multiples": (1, 2), "backend": None, "total_steps": 9})
    msg = str(e.value)
    for part in ("probe must be held-out batches", "probe_loss must be a function",
                 "unknown forks setting 'backend'", "unknown forks setting 'total_steps'"):
        assert part in msg
    with pytest.raises(hpx.ConfigError, match="multiples must be distinct"):
        ForksTrainer(model=Tiny(), args=forks_args("/tmp/unused", 10, 1e-3), train_dataset=train_set(),
                     probe=probe(), forks={"multiples": (2, 3)}).train()


def test_a_gradient_scaler_is_refused_before_anything_trains(tmp_path):
    t = _forks(tmp_path, 10, 1e-3)
    t.accelerator.scaler = torch.amp.GradScaler("cpu")  # what fp16=True gives the Trainer on a GPU
    before = [p.detach().clone() for p in t.model.parameters()]
    with pytest.raises(hpx.ConfigError, match=r"fp16=True.*bf16=True"):
        t.train()
    assert all(torch.equal(p, q) for p, q in zip(before, t.model.parameters()))


def test_loading_the_best_checkpoint_at_the_end_is_refused(tmp_path):
    args = forks_args(tmp_path, 20, 1e-3, load_best_model_at_end=True, eval_strategy="steps", eval_steps=10,
                      save_strategy="steps", save_steps=10)
    t = ForksTrainer(model=Tiny(), args=args, train_dataset=train_set(), eval_dataset=train_set()[:64],
                     probe=probe())
    with pytest.raises(hpx.ConfigError, match="load_best_model_at_end=True would replace the forks' winner"):
        t.train()
    assert t.state.global_step == 0


def test_a_plateau_scheduler_is_refused_with_the_trainers_own_setting(tmp_path):
    args = forks_args(tmp_path, 20, 1e-3, lr_scheduler_type="reduce_lr_on_plateau", eval_strategy="steps",
                      eval_steps=10)
    t = ForksTrainer(model=Tiny(), args=args, train_dataset=train_set(), eval_dataset=train_set()[:64],
                     probe=probe())
    before = [p.detach().clone() for p in t.model.parameters()]
    with pytest.raises(hpx.ConfigError, match="choose another lr_scheduler_type"):
        t.train()
    assert t.state.global_step == 0 and all(torch.equal(p, q) for p, q in zip(before, t.model.parameters()))


def test_a_probe_without_labels_is_named(tmp_path):
    batch = {k: v for k, v in probe()[0].items() if k != "labels"}
    t = ForksTrainer(model=Tiny(), args=forks_args(tmp_path, 10, 1e-3), train_dataset=train_set(),
                     probe=[batch])
    with pytest.raises(hpx.ConfigError, match="no loss on a probe batch"):
        t.train()


def test_two_processes_train_every_fork_data_parallel_and_agree(tmp_path):
    ranks = run_distributed(forks_two_ranks, 2, str(tmp_path), timeout=240)
    for r in ranks:
        assert r["world"] == 2 and r["factor"] == 16.0 and r["steps"] == [6, 12, 40]
    assert repr(ranks[0]["scores"]) == repr(ranks[1]["scores"])  # repr: nan (your run at a cut) alike
    assert ranks[0]["fork_steps"] == ranks[1]["fork_steps"]
    assert ranks[0]["params"] == ranks[1]["params"]  # DDP for your run, hpx for the others: one model


def test_the_example_prints_the_forks_decisions_and_both_accuracies(tmp_path):
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    # 150 steps (the cuts at 23 and 46): the 10x fork wins and beats plain training by 0.2 of accuracy
    # on the test digits (at 300 steps by 0.1). One torch thread: the example's MLP is small; a second
    # thread added CPU time without shortening the run (on a busy machine it tripled it).
    cmd = [sys.executable, str(root / "examples" / "hf_digits.py"), "--steps", "150", "--out", str(tmp_path)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    lines = (out.stdout + out.stderr).splitlines()
    decisions = [line for line in lines if line.startswith("forks at step")]
    assert [line.split(" (")[1].split(")")[0] for line in decisions] == ["cut", "cut", "end"]
    ended = next(line for line in lines if line.startswith("ForksTrainer: the run ended at"))
    factor = ended.split("ended at ")[1].split("x")[0]
    assert f"kept {factor}x" in decisions[-1]  # what it printed is what the end decided
    forks_acc = float(ended.rsplit(" ", 1)[1])
    plain_acc = float(next(line for line in lines if line.startswith("plain Trainer")).rsplit(" ", 1)[1])
    assert forks_acc > plain_acc  # 10x below a good lr: a challenger won and did better on the test digits


def test_training_stopped_early_decides_where_it_stops_with_the_winners_lr_in_your_optimizer(tmp_path):
    """A callback that stops the Trainer at step 20 of 40 (as early stopping does): the forks decide
    there (they were left undecided, your run kept without a word), and the Trainer's optimizer
    holds the winner's learning rate (it held your run's)."""
    from transformers import TrainerCallback

    class Stop(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            control.should_training_stop = state.global_step >= 20

    t = _forks(tmp_path / "f", 40, 1e-4, lr_scheduler_type="constant", warmup_steps=0)
    t.add_callback(Stop())
    t.train()
    f = t.forks
    assert t.state.global_step == 20 and f.decided and f.factor == 16.0
    assert [r.phase for r in f.history][-1] == "end" and f.history[-1].step == 20
    assert t.optimizer.param_groups[0]["lr"] == 16e-4


def test_a_forward_that_closes_over_your_model_is_refused_before_anything_trains(tmp_path):
    """model.forward = torch.compile(model.forward) (here: a closure, which is what it leaves on the
    model): every copy's step ran your model, so no fork trained and yours took every fork's gradient.
    Refused when the forks are built, before the Trainer's first step."""
    model = Tiny()
    own = model.forward
    model.forward = functools.wraps(own)(lambda *a, **k: own(*a, **k))
    t = ForksTrainer(model=model, args=forks_args(tmp_path, 20, 1e-3), train_dataset=train_set(),
                     probe=probe(), forks={"multiples": POW2})
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(hpx.ConfigError, match=r"'Tiny' has a forward set on the object itself.*"
                       r"model\.compile\(\)"):
        t.train()
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))


def test_torch_compile_with_dropout_is_refused_before_a_step(tmp_path):
    t = _forks(tmp_path, 20, 1e-3, dropout=0.1, torch_compile=True)
    before = [p.detach().clone() for p in t.model.parameters()]
    with pytest.raises(hpx.ConfigError, match="torch_compile=True with dropout"):
        t.train()
    assert all(torch.equal(a, b) for a, b in zip(before, t.model.parameters()))


class _Doubles(ForksTrainer):
    def compute_loss(self, model, inputs, **kw):
        inputs["x"].mul_(2)  # in place: the forks after your run's would see doubled inputs
        return super().compute_loss(model, inputs, **kw)


def test_a_compute_loss_that_changes_the_batch_is_refused_at_the_first_step(tmp_path):
    t = _Doubles(model=Tiny(), args=forks_args(tmp_path, 20, 1e-3), train_dataset=train_set(), probe=probe(),
                 forks={"multiples": POW2})
    with pytest.raises(hpx.ConfigError, match=r"compute_loss \(or training_step\) changed the batch"):
        t.train()


def test_a_head_only_optimizer_with_clipping_gives_a_winner_that_is_the_plain_trainer(tmp_path):
    """The Trainer zeroes every parameter's gradient (model.zero_grad()); the forks zeroed only their
    optimizer's, so the body's gradients piled up in each fork and entered its clipping norm."""
    from transformers import Trainer

    def head(lr):
        model = Tiny()
        return model, torch.optim.SGD(model.net[-1].parameters(), lr=lr, momentum=0.9)

    model, opt = head(1e-3)
    t = ForksTrainer(model=model, args=forks_args(tmp_path / "f", 40, 1e-3, max_grad_norm=0.05),
                     train_dataset=train_set(), probe=probe(), optimizers=(opt, None),
                     forks={"multiples": POW2, "confidence": 0.0})
    t.train()
    assert t.forks.factor != 1.0
    plain_model, plain_opt = head(1e-3 * t.forks.factor)
    Trainer(model=plain_model, args=forks_args(tmp_path / "p", 40, 1e-3, max_grad_norm=0.05),
            train_dataset=train_set(), optimizers=(plain_opt, None)).train()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), plain_model.parameters()))


class _Tuples(Tiny):
    def forward(self, x, labels=None):
        out = super().forward(x, labels)
        return (out["loss"], out["logits"]) if labels is not None else (out["logits"],)


def test_a_model_returning_loss_then_logits_as_a_tuple_is_probed_as_the_trainer_reads_it(tmp_path):
    t = ForksTrainer(model=_Tuples(), args=forks_args(tmp_path, 20, 1e-3), train_dataset=train_set(),
                     probe=probe(), forks={"multiples": POW2})
    t.train()
    assert t.forks.decided and all(math.isfinite(s) for s in t.forks.history[0].scores[1:])


def test_a_knob_only_your_loss_could_read_is_refused_by_the_trainer(tmp_path):
    """The Trainer's own step has no replica to read replica.value() from: the label-smoothing
    forks trained identically, and their probe losses were equal to the last digit."""
    with pytest.raises(hpx.ConfigError, match="knob 'label_smoothing' only publishes a value"):
        ForksTrainer(model=Tiny(), args=forks_args(tmp_path, 20, 1e-3), train_dataset=train_set(),
                     probe=probe(), forks={"knobs": [hpx.LabelSmoothing(base=0.1, spread=0.05)]}).train()
