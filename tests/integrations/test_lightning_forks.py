"""hpx.integrations.lightning.ForksCallback, run by the real PyTorch Lightning on CPU, against
plain Lightning runs."""

from __future__ import annotations

import csv
import json

import pytest
import torch

pl = pytest.importorskip("lightning.pytorch")

from hpx.errors import ConfigError  # noqa: E402
from hpx.integrations.lightning import ForksCallback  # noqa: E402
from tests.integrations._lit import Dropped, EndGroup, loader, probe, probe_loss  # noqa: E402

POW2 = (1 / 16, 1 / 4, 1, 4, 16)  # powers of 2: m * (lr * schedule) is (m * lr) * schedule exactly


def _fit(tmp_path, module, steps, callbacks=(), ckpt_path=None, batch=32, **kw):
    torch.manual_seed(1)  # the same global stream for every fit (the DataLoader draws its seed from it)
    if kw.get("strategy") == "ddp_spawn":
        callbacks = [*callbacks, EndGroup()]
    trainer = pl.Trainer(accelerator="cpu", max_steps=steps, logger=pl.loggers.CSVLogger(tmp_path),
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                         callbacks=list(callbacks), **{"enable_checkpointing": False, "devices": 1, **kw})
    trainer.fit(module, loader(batch), ckpt_path=ckpt_path)
    return trainer


def _params(module):
    return [p.detach().clone() for p in module.parameters()]


def _same(a, b):
    return all(torch.equal(p, q) for p, q in zip(a, b))


def test_a_confident_winner_is_plain_lightning_at_its_multiple_bit_for_bit(tmp_path):
    cb = ForksCallback(probe_loss, probe=probe(), multiples=POW2)
    module = Dropped(lr=0.001, steps=40)
    trainer = _fit(tmp_path / "f", module, 40, [cb])
    f = cb.forks
    assert f.decided and f.factor == 16.0 and f.step_count == 40
    assert [r.phase for r in f.history] == ["cut", "cut", "end"]
    assert f.history[-1].metrics["gain"] > 2
    assert f.model is module  # the winner was loaded into your module
    # dropout draws included: the 16x fork drew what plain training at 16x draws
    plain = Dropped(lr=0.016, steps=40)
    ref = _fit(tmp_path / "p", plain, 40)
    assert _same(_params(module), _params(plain))
    opt, ref_opt = trainer.optimizers[0], ref.optimizers[0]
    assert opt.param_groups[0]["momentum"] == ref_opt.param_groups[0]["momentum"]  # the momentum cycle
    assert all(torch.equal(opt.state[p]["momentum_buffer"], ref_opt.state[q]["momentum_buffer"])
               for p, q in zip(module.parameters(), plain.parameters()))
    assert trainer.lr_scheduler_configs[0].scheduler.last_epoch == 40
    # 5 forks to step 6 (the cut at 4 scored on 5 copies annealed over 2 steps), 3 to 12 (the cut at
    # 10), 2 to 40; your run's steps (Lightning's) counted among them
    assert f.fork_steps == 5 * 6 + 4 * 2 + 3 * 6 + 2 * 2 + 2 * 28  # no annealed copy of your run
    rows = list(csv.DictReader(next((tmp_path / "f").rglob("metrics.csv")).read_text().splitlines()))
    logged = [r for r in rows if r.get("hpx/lr_multiple")]
    assert [int(r["step"]) for r in logged] == [r.step for r in f.history]
    assert float(logged[-1]["hpx/lr_multiple"]) == 16.0 and float(logged[-1]["hpx/gain"]) > 2
    assert float(logged[-1]["hpx/bar"]) == pytest.approx(f.history[-1].metrics["bar"])  # what it cleared
    assert float(logged[0]["hpx/probe_loss/16x"]) == pytest.approx(f.history[0].scores[-1])
    assert float(trainer.callback_metrics["hpx/lr_multiple"]) == 16.0


@pytest.mark.parametrize("share", [True, False])
def test_share_passes_through_and_a_frozen_base_is_held_once_only_when_shared(tmp_path, share):
    """share= reaches hpx.Forks: with a frozen first layer, every fork holds your run's frozen weights
    (the same tensors) under share=True and copies of them under share=False; the run ends alike."""
    held = []  # at the first cut: whether each challenger's frozen weight is your run's tensor
    cb = ForksCallback(probe_loss, probe=probe(), multiples=POW2, share=share, on_sync=lambda r: held.append(
        [g.model.net[0].weight.data_ptr() == module.net[0].weight.data_ptr() for g in cb.forks._forks[1:]]))
    module = Dropped(lr=0.001, steps=24)
    module.net[0].requires_grad_(False)
    _fit(tmp_path / "f", module, 24, [cb])
    assert cb.forks.decided and len(held) == 3
    assert held[0] and all(x is share for x in held[0])


def test_your_run_kept_is_plain_lightning_bit_for_bit(tmp_path):
    cb = ForksCallback(probe_loss, probe=probe(), multiples=POW2, confidence=1e9)
    module = Dropped(lr=0.001, steps=40)
    _fit(tmp_path / "f", module, 40, [cb])
    assert cb.forks.decided and cb.forks.factor == 1.0
    plain = Dropped(lr=0.001, steps=40)
    _fit(tmp_path / "p", plain, 40)
    assert _same(_params(module), _params(plain))


def test_accumulation_and_clipping_reach_every_fork(tmp_path):
    kw = {"accumulate_grad_batches": 2, "gradient_clip_val": 0.05}
    cb = ForksCallback(probe_loss, probe=probe(), multiples=POW2)
    module = Dropped(lr=0.001, steps=30)
    _fit(tmp_path / "f", module, 30, [cb], **kw)
    assert cb.forks.factor == 16.0 and cb.forks.step_count == 30
    plain = Dropped(lr=0.016, steps=30)
    _fit(tmp_path / "p", plain, 30, **kw)
    assert _same(_params(module), _params(plain))


def test_a_resumed_fit_ends_as_if_never_stopped(tmp_path):
    """Resumed with ckpt_path from a checkpoint saved at the end of the first epoch (11 steps of
    128; Lightning resumes a plain DataLoader exactly only there), between the first cut (step 10)
    and its decision (15): the same cuts, winner and final weights, bit for bit. No dropout:
    Lightning's checkpoints do not hold the global random stream, so a resumed plain fit draws
    other masks too."""
    full = Dropped(lr=0.001, steps=100, dropout=0.0)
    cb = ForksCallback(probe_loss, probe=probe(), multiples=POW2)
    saver = pl.callbacks.ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=11, save_top_k=-1)
    _fit(tmp_path / "full", full, 100, [cb, saver], batch=128, enable_checkpointing=True)
    ckpt = next((tmp_path / "ckpt").glob("*step=11.ckpt"))
    saved = torch.load(ckpt, weights_only=False)["callbacks"]
    state = next(v for k, v in saved.items() if "ForksCallback" in k)
    assert state["clones"] and state["forks"][0]["model"] is None  # copies in flight; your run is Lightning's
    resumed = Dropped(lr=0.001, steps=100, dropout=0.0)
    again = ForksCallback(probe_loss, probe=probe(), multiples=POW2)
    _fit(tmp_path / "b", resumed, 100, [again], batch=128, ckpt_path=str(ckpt))
    assert [r.step for r in again.forks.history] == [r.step for r in cb.forks.history]
    assert again.forks.factor == cb.forks.factor != 1.0
    assert _same(_params(resumed), _params(full))


class _Manual(Dropped):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        return None


class _Skips(Dropped):
    def training_step(self, batch, batch_idx):
        return None if batch_idx == 3 else super().training_step(batch, batch_idx)


class _Plateau(Dropped):
    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=self.lr)
        sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt)
        return {"optimizer": opt,
                "lr_scheduler": {"scheduler": sched, "interval": "step", "monitor": "train_loss"}}


class _EpochSchedule(Dropped):
    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=self.lr)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, 1)}


@pytest.mark.parametrize("module, kw, words", [
    (_Manual, {}, "manual optimization"),
    (_EpochSchedule, {}, "'interval': 'step'"),
    (_Plateau, {}, "cannot follow ReduceLROnPlateau: it steps on a metric"),
    (_Skips, {}, "returned None at batch 3"),
    (Dropped, {"gradient_clip_val": 0.1, "gradient_clip_algorithm": "value"},
     "gradient_clip_algorithm='value'"),
])
def test_what_it_cannot_follow_is_refused_naming_the_fix(tmp_path, module, kw, words):
    with pytest.raises(ConfigError, match=words):
        _fit(tmp_path, module(), 4, [ForksCallback(probe_loss, probe=probe())], **kw)


def test_bad_settings_are_named_together():
    with pytest.raises(ConfigError) as e:
        ForksCallback("loss", probe=None, span=2.0)
    text = str(e.value)
    assert "probe must be" in text and "loss_fn must be" in text and "unknown setting 'span'" in text


def test_a_lambda_is_refused_under_ddp_spawn_naming_the_fix(tmp_path):
    cb = ForksCallback(lambda m, b: probe_loss(m, b), probe=probe())
    with pytest.raises(ConfigError, match="top level"):
        _fit(tmp_path, Dropped(), 4, [cb], devices=2, strategy="ddp_spawn")


class _Written(pl.Callback):
    """Writes what ForksCallback decided in each process to ``out/rank{r}.json``."""

    def __init__(self, out: str) -> None:
        self.out = out

    def on_train_end(self, trainer, pl_module) -> None:
        from pathlib import Path

        f = next(c for c in trainer.callbacks if isinstance(c, ForksCallback)).forks
        Path(self.out, f"rank{trainer.global_rank}.json").write_text(json.dumps({
            "factor": f.factor, "steps": [r.step for r in f.history],
            "params": torch.cat([p.detach().reshape(-1) for p in pl_module.parameters()]).tolist()}))


def test_two_ddp_processes_decide_alike(tmp_path):
    cb = ForksCallback(probe_loss, probe=probe(), multiples=POW2)
    module = Dropped(lr=0.001, steps=40, dropout=0.0)
    trainer = _fit(tmp_path, module, 40, [cb, _Written(str(tmp_path))], devices=2, strategy="ddp_spawn")
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert ranks[0]["steps"] == ranks[1]["steps"] and len(ranks[0]["steps"]) == 3
    assert ranks[0]["factor"] == ranks[1]["factor"] != 1.0
    assert ranks[0]["params"] == ranks[1]["params"]
    # the calling process trained nothing itself: Lightning hands back the winner's weights and the
    # callback's metrics
    assert cb.forks is None
    assert float(trainer.callback_metrics["hpx/lr_multiple"]) == ranks[0]["factor"]
    assert torch.cat([p.detach().reshape(-1) for p in module.parameters()]).tolist() == ranks[0]["params"]


class _StopAt(pl.Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step >= self.step:
            trainer.should_stop = True


def test_a_fit_stopped_early_decides_when_it_stops(tmp_path):
    """A fit that ends before its last step (EarlyStopping, max_time, should_stop) decides there,
    and the module holds the winner."""
    cb = ForksCallback(probe_loss, probe=probe(), multiples=POW2)
    module = Dropped(lr=0.001, steps=40)
    _fit(tmp_path, module, 40, [cb, _StopAt(20)])
    f = cb.forks
    assert f.decided and f.step_count == 20 and [r.phase for r in f.history] == ["cut", "cut", "end"]
    assert f.history[-1].step == 20 and f.model is module


@pytest.mark.slow
def test_the_example_ends_where_plain_lightning_at_the_winners_lr_does(tmp_path):
    """examples/lightning_digits.py (2 processes, strategy="ddp"): from 0.005 the fork at 10x wins,
    and the run's test loss is plain Lightning's at 0.05, to the digit printed."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "examples" / "lightning_digits.py"

    def last(*args):
        out = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True,
                             timeout=300, cwd=tmp_path)
        assert out.returncode == 0, out.stderr[-3000:]
        return out.stdout.strip().splitlines()[-1]

    forks = last()
    assert forks.startswith("with hpx ForksCallback") and forks.endswith("lr 0.005 -> 0.05")
    plain = last("--plain", "--lr", "0.05")
    assert forks.split("test loss ")[1].split(",")[0] == plain.split("test loss ")[1]


def test_bf16_mixed_precision_reaches_every_fork(tmp_path):
    """precision="bf16-mixed": each fork's training_step runs under Lightning's autocast, as your
    run's does (without it the winner would differ from plain Lightning at its multiple)."""
    cb = ForksCallback(probe_loss, probe=probe(), multiples=POW2)
    module = Dropped(lr=0.001, steps=30)
    _fit(tmp_path / "f", module, 30, [cb], precision="bf16-mixed")
    assert cb.forks.factor == 16.0
    plain = Dropped(lr=0.016, steps=30)
    _fit(tmp_path / "p", plain, 30, precision="bf16-mixed")
    assert _same(_params(module), _params(plain))


def test_other_knobs_fork_too_and_the_winners_value_lands_in_your_module(tmp_path):
    """knobs=[hpx.Dropout(spread=0.4)] from p = 0.5, the knob forks from the start (knob_start=0,
    passed on to hpx.Forks): two more forks at your lr, at p = 0.1 and 0.9; the winner (p = 0.1,
    with confidence) has its dropout, a value no state_dict holds, written into your module's
    dropout layer."""
    import hpx

    cb = ForksCallback(probe_loss, probe=probe(), multiples=(1,), cuts=((0.25, 2),),
                       knobs=[hpx.Dropout(spread=0.4)], knob_start=0)
    module = Dropped(lr=0.1, steps=40, dropout=0.5)
    _fit(tmp_path, module, 40, [cb])
    f = cb.forks
    assert len(f.history[0].scores) == 3  # your run, and p = 0.1 and 0.9 at your lr
    assert f.decided and f.factor == 1.0 and f.history[-1].metrics["gain"] > 2
    assert f.values["dropout"] == pytest.approx(0.1) and module.net[2].p == pytest.approx(0.1)


def test_resuming_a_checkpoint_saved_without_the_callback_is_refused_before_a_step(tmp_path):
    """A plain fit's checkpoint at step 11 of 100, resumed with ForksCallback added: the forks would
    count from 0 at step 11 on a plan built for 100 steps (cuts late, the end never reached by
    count). Refused, naming the fix, before anything trains."""
    saver = pl.callbacks.ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=11, save_top_k=-1)
    _fit(tmp_path / "plain", Dropped(lr=0.001, steps=100, dropout=0.0), 11, [saver], batch=128,
         enable_checkpointing=True)
    ckpt = next((tmp_path / "ckpt").glob("*step=11.ckpt"))
    resumed = Dropped(lr=0.001, steps=100, dropout=0.0)
    cb = ForksCallback(probe_loss, probe=probe(), multiples=POW2)
    with pytest.raises(ConfigError, match="saved without ForksCallback"):
        _fit(tmp_path / "b", resumed, 100, [cb], batch=128, ckpt_path=str(ckpt))
    assert cb.forks is None


def test_a_training_step_that_reads_the_step_and_epoch_sees_your_runs_in_every_fork(tmp_path):
    """A fork's copy of the module has no trainer, and Lightning then reads global_step and
    current_epoch as 0: a loss ramped by them trained the forks on another loss, and the winner
    was not plain Lightning at its multiple. The copies see your run's step and epoch."""
    from tests.integrations._lit import Ramped

    cb = ForksCallback(probe_loss, probe=probe(), multiples=POW2)
    module = Ramped(lr=0.001, steps=60)
    _fit(tmp_path / "f", module, 60, [cb])
    assert cb.forks.factor == 16.0
    plain = Ramped(lr=0.016, steps=60)
    _fit(tmp_path / "p", plain, 60)
    assert _same(_params(module), _params(plain))


def test_a_training_step_that_reads_the_trainer_is_refused_in_a_forks_words(tmp_path):
    from tests.integrations._lit import ReadsTrainer

    cb = ForksCallback(probe_loss, probe=probe(), multiples=POW2)
    with pytest.raises(ConfigError, match="in a fork's copy of your module, which has no trainer"):
        _fit(tmp_path / "f", ReadsTrainer(lr=0.001, steps=20), 20, [cb])


class _Wrapped(Dropped):
    """A training_step replaced on the instance by a function that closes over the module's own
    (what Lightning does with torch.compile(module)): every copy would run this module."""

    def __init__(self) -> None:
        super().__init__()
        own = self.training_step
        self.training_step = lambda batch, batch_idx: own(batch, batch_idx)


def _trainer(tmp_path, callbacks, **kw):
    return pl.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False,
                      num_sanity_val_steps=0, enable_checkpointing=False, devices=1, callbacks=callbacks,
                      **kw)


@pytest.mark.parametrize("case", ["swa", "unbounded", "accumulation-scheduler", "wrapped"])
def test_what_would_train_something_other_than_the_winner_is_refused_before_a_step(tmp_path, case):
    """StochasticWeightAveraging wrote your run's average over the winner; max_epochs=-1 crashed with
    an OverflowError; a GradientAccumulationScheduler without max_steps put the cuts at a quarter and
    a half of the run; a training_step closing over your module (torch.compile(module)) trained your
    run once per fork and no copy."""
    cb = ForksCallback(probe_loss, probe=probe(), multiples=POW2)
    module = _Wrapped() if case == "wrapped" else Dropped(lr=0.001, steps=40)
    before = _params(module)
    kw = {"max_steps": 40}
    words = {"swa": "StochasticWeightAveraging writes your run's weight average",
             "unbounded": "the fit's length is unknown", "accumulation-scheduler": "give max_steps",
             "wrapped": "reached none of its parameters: the framework's step ran your module"}[case]
    if case == "swa":
        swa = pl.callbacks.StochasticWeightAveraging(swa_lrs=0.01)
        kw = {"max_steps": 40, "max_epochs": 2, "callbacks": [cb, swa]}
    elif case == "unbounded":
        kw = {"max_epochs": -1, "max_time": {"seconds": 30}}
    elif case == "accumulation-scheduler":
        kw = {"max_epochs": 2, "callbacks": [cb, pl.callbacks.GradientAccumulationScheduler({0: 1, 1: 2})]}
    trainer = _trainer(tmp_path, kw.pop("callbacks", [cb]), **kw)
    with pytest.raises(ConfigError, match=words):
        trainer.fit(module, loader(32))
    if case != "wrapped":  # refused before any step (the wrapped one at its first)
        assert _same(_params(module), before)


class _Mutates(Dropped):
    def training_step(self, batch, batch_idx):
        batch[0].mul_(2)  # in place: the forks after your run's would see doubled inputs
        return super().training_step(batch, batch_idx)


class _DrawsAtBatchStart(Dropped):
    def on_train_batch_start(self, batch, batch_idx):
        torch.rand(1)  # the module's own hook runs after every callback's: the forks drew before it


class _HeadGroups(Dropped):
    """The usual groups (biases without decay, listed first): Lightning clips the optimizer's
    parameters in this order, and the norm's sum with them."""

    def configure_optimizers(self):
        named = list(self.named_parameters())
        biases = [p for n, p in named if n.endswith("bias")]
        return torch.optim.AdamW([{"params": biases, "weight_decay": 0.0},
                                  {"params": [p for n, p in named if not n.endswith("bias")]}], lr=self.lr)


class _Clips(Dropped):
    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        self.clip_gradients(optimizer, gradient_clip_val=0.01, gradient_clip_algorithm="norm")


class _LogsThroughLogger(Dropped):
    def training_step(self, batch, batch_idx):
        self.logger.log_metrics({"x": 1.0}, step=self.global_step)
        return super().training_step(batch, batch_idx)


class _Unfreezes(pl.callbacks.BaseFinetuning):
    def freeze_before_training(self, pl_module):
        self.freeze(pl_module.net[0])

    def finetune_function(self, pl_module, epoch, optimizer):
        if epoch == 1:
            self.unfreeze_and_add_param_group(pl_module.net[0], optimizer)


def test_a_training_step_that_changes_the_batch_is_refused_at_the_first_step(tmp_path):
    cb = ForksCallback(probe_loss, probe=probe(), multiples=POW2)
    with pytest.raises(ConfigError, match="training_step changed the batch it was given"):
        _fit(tmp_path / "f", _Mutates(lr=0.001, steps=20), 20, [cb])


@pytest.mark.parametrize("module, kw", [(_DrawsAtBatchStart, {}), (_HeadGroups, {"gradient_clip_val": 0.05})],
                         ids=["draws-in-on_train_batch_start", "clipped-groups"])
def test_a_winner_is_plain_lightning_with_draws_before_training_step_and_clipped_groups(tmp_path, module, kw):
    """The forks drew their masks before the module's on_train_batch_start drew, and clipped over the
    model's parameters where Lightning clips the optimizer's, group by group (a norm summed in another
    order): either left the winner off plain Lightning at its multiple."""
    cb = ForksCallback(probe_loss, probe=probe(), multiples=POW2)
    mine = module(lr=0.001, steps=40)
    _fit(tmp_path / "f", mine, 40, [cb], **kw)
    assert cb.forks.factor != 1.0
    plain = module(lr=0.001 * cb.forks.factor, steps=40)
    _fit(tmp_path / "p", plain, 40, **kw)
    assert _same(_params(mine), _params(plain))


@pytest.mark.parametrize("case", ["clipping-hook", "finetuning", "second-fit", "logger"])
def test_what_runs_for_your_run_alone_is_refused_naming_it(tmp_path, case):
    cb = ForksCallback(probe_loss, probe=probe(), multiples=POW2)
    module = {"clipping-hook": _Clips, "logger": _LogsThroughLogger}.get(case, Dropped)(lr=0.001, steps=20)
    callbacks = [cb]
    if case == "finetuning":
        callbacks.append(_Unfreezes())
    if case == "second-fit":
        _fit(tmp_path / "a", module, 20, callbacks)
    words = {"clipping-hook": "the module overrides configure_gradient_clipping",
             "finetuning": "a BaseFinetuning callback", "second-fit": "this ForksCallback searched a fit",
             "logger": r"self.logger\) in a fork's copy"}[case]
    with pytest.raises(ConfigError, match=words):
        _fit(tmp_path / "b", module, 20 if case != "second-fit" else 40, callbacks)


def test_bf16_true_precision_scores_the_probe_in_the_modules_dtype(tmp_path):
    cb = ForksCallback(probe_loss, probe=probe(), multiples=POW2)
    module = Dropped(lr=0.001, steps=20)
    _fit(tmp_path / "f", module, 20, [cb], precision="bf16-true")
    assert cb.forks.decided and all(p.dtype == torch.bfloat16 for p in module.parameters())
