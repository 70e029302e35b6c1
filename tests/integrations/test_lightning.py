"""hpx.integrations.lightning.AutoLR, run by the real PyTorch Lightning on CPU."""

from __future__ import annotations

import csv
import json
import warnings

import pytest
import torch

pl = pytest.importorskip("lightning.pytorch")

import hpx  # noqa: E402
from hpx.integrations.lightning import AutoLR  # noqa: E402
from tests.integrations._lit import Digits, EndGroup, Report, loader, probe, probe_loss  # noqa: E402


def _trainer(tmp_path, steps, devices=1, **kw):
    if kw.get("strategy") in ("ddp_spawn", "ddp_fork"):  # the children end their gloo group themselves
        kw["callbacks"] = [*kw.get("callbacks", []), EndGroup()]
    return pl.Trainer(accelerator="cpu", devices=devices, max_steps=steps,
                      logger=pl.loggers.CSVLogger(tmp_path), enable_progress_bar=False,
                      enable_model_summary=False, num_sanity_val_steps=0,
                      **{"enable_checkpointing": False, **kw})


def test_two_ddp_processes_explore_agree_and_log(tmp_path):
    steps = 40
    auto = AutoLR(probe_loss, probe=probe(), seed=0)
    trainer = _trainer(tmp_path, steps, devices=2, strategy="ddp_spawn",
                       callbacks=[auto, Report(str(tmp_path))])
    trainer.fit(Digits(lr=0.005, steps=steps), loader())
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for r in ranks:
        assert r["n_replicas"] == 2 and r["step"] == steps
        assert r["schedulers"] == 0  # the module's OneCycleLR was taken over
        assert "stretch" in r["phases"] and r["steps"][0] >= 1
    assert ranks[0]["bases"] == ranks[1]["bases"] and ranks[0]["steps"] == ranks[1]["steps"]
    assert ranks[0]["bases"]["lr"] != 1.0  # the search moved the learning rate
    assert ranks[0]["params"] == ranks[1]["params"]  # DDP replicas stay identical
    # ddp_spawn trained copies of the callback: the parent's never ran; the values came back with
    # the trainer's callback_metrics
    assert auto.engine is None
    assert float(trainer.callback_metrics["hpx/lr_base"]) == pytest.approx(ranks[0]["bases"]["lr"])
    rows = list(csv.DictReader(next(tmp_path.rglob("metrics.csv")).read_text().splitlines()))
    logged = [float(r["hpx/lr_base"]) for r in rows if r.get("hpx/lr_base")]
    assert len(logged) == len(ranks[0]["steps"]) and logged[-1] == pytest.approx(ranks[0]["bases"]["lr"])
    # hpx/lr: the lr the last step before the sync used: OneCycle's there times the base then
    ref = Digits(lr=0.005, steps=steps).configure_optimizers()["lr_scheduler"]["scheduler"]
    onecycle = [ref.get_last_lr()[0]]
    for _ in range(steps - 1):
        ref.optimizer.step()
        ref.step()
        onecycle.append(ref.get_last_lr()[0])
    checked = [(int(r["step"]), float(r["hpx/lr"]), float(r["hpx/lr_base"])) for r in rows if r.get("hpx/lr")]
    assert len(checked) == len(logged)
    before = 1.0
    for step, lr, base in checked:
        assert lr == pytest.approx(onecycle[step - 1] * before, rel=1e-6)
        before = base


def test_two_processes_resume_mid_run_exactly_as_if_never_stopped(tmp_path):
    # 1400 samples over 2 processes in batches of 32: 22 steps an epoch; saved after the first epoch's
    # last step (saving in on_train_epoch_end instead makes Lightning replay a batch when it resumes).
    # ddp_fork: the same launcher as ddp_spawn, its processes forked from this one rather than started
    # fresh (each fresh one imported Lightning, seconds of CPU); ddp_spawn's pickled callbacks are the
    # test above's.
    steps = 44
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    full.mkdir()
    resumed.mkdir()
    saver = pl.callbacks.ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=22, save_top_k=-1)
    trainer = _trainer(full, steps, devices=2, strategy="ddp_fork", enable_checkpointing=True,
                       callbacks=[AutoLR(probe_loss, probe=probe(), seed=0), Report(str(full)), saver])
    trainer.fit(Digits(lr=0.005, steps=steps), loader())
    ckpt = tmp_path / "ckpt" / "epoch=0-step=22.ckpt"
    saved = torch.load(ckpt, weights_only=False)["callbacks"]
    hpx_state = next(v for k, v in saved.items() if k.startswith("AutoLR"))
    assert [s["first"] for s in hpx_state["ranks"]] == [0, 1]  # every rank's state, in rank order
    trainer = _trainer(resumed, steps, devices=2, strategy="ddp_fork",
                       callbacks=[AutoLR(probe_loss, probe=probe(), seed=0), Report(str(resumed))])
    trainer.fit(Digits(lr=0.005, steps=steps), loader(), ckpt_path=ckpt)
    for r in range(2):
        want = json.loads((full / f"rank{r}.json").read_text())
        got = json.loads((resumed / f"rank{r}.json").read_text())
        assert got["step"] == steps and 22 in want["steps"] and max(want["steps"]) > 22
        assert got["bases"] == want["bases"] and got["steps"] == want["steps"]
        assert got["phases"] == want["phases"] and got["lr"] == want["lr"]
        assert got["params"] == want["params"]  # bit for bit: the resumed run is the same run
    with pytest.raises(hpx.ConfigError, match=r"state of 2 process.*fit runs 1: resume with devices=2"):
        _trainer(tmp_path, steps, callbacks=[AutoLR(probe_loss, probe=probe(), seed=0)]).fit(
            Digits(lr=0.005, steps=steps), loader(), ckpt_path=ckpt)


def test_ddp_spawn_refuses_a_loss_fn_it_cannot_pickle_naming_the_fix(tmp_path):
    auto = AutoLR(lambda module, batch: probe_loss(module, batch), probe=probe())
    trainer = _trainer(tmp_path, 4, devices=2, strategy="ddp_spawn", callbacks=[auto])
    with pytest.raises(hpx.ConfigError) as e:
        trainer.fit(Digits(lr=0.005, steps=4), loader())
    msg = str(e.value)
    assert "loss_fn cannot be pickled" in msg and "module's top level" in msg and "strategy='ddp'" in msg


def test_one_process_explores_with_its_one_model_and_scales_the_modules_schedule(tmp_path):
    steps = 40  # the schedule's length; the trainer stops at 30, mid-schedule
    auto = AutoLR(probe_loss, probe=probe(), total_steps=steps)
    trainer = _trainer(tmp_path, 30, callbacks=[auto])
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        trainer.fit(Digits(lr=0.005, steps=steps), loader())
    assert not [w for w in seen if "replica" in str(w.message)]  # nothing to warn about: the search ran
    e = auto.engine
    assert e.n_replicas == 1 and e.step_count == 30 and trainer.lr_scheduler_configs == []
    assert e.bases["lr"] != 1.0  # the one model scored the four points in turn and the lr moved
    assert all(len(r.points) == 4 for r in e.history if r.phase in ("stretch", "burn-in"))
    # hpx wrote OneCycle's lr for the next step times the base, as Lightning stepping it would have
    ref = Digits(lr=0.005, steps=steps).configure_optimizers()["lr_scheduler"]["scheduler"]
    for _ in range(30):
        ref.optimizer.step()
        ref.step()
    want = ref.get_last_lr()[0] * e.bases["lr"]
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(want, rel=1e-6)


def test_checkpoint_resume_continues_hpxs_state(tmp_path):
    auto = AutoLR(probe_loss, probe=probe())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        saver = pl.callbacks.ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=10, save_top_k=-1)
        trainer = _trainer(tmp_path, 20, callbacks=[auto, saver], enable_checkpointing=True)
        trainer.fit(Digits(lr=0.01, steps=20), loader())
        ckpt = next((tmp_path / "ckpt").glob("*step=10.ckpt"))
        saved_history = [r.step for r in auto.engine.history if r.step <= 10]
        again = AutoLR(probe_loss, probe=probe())
        trainer = _trainer(tmp_path, 20, callbacks=[again])
        trainer.fit(Digits(lr=0.01, steps=20), loader(), ckpt_path=ckpt)
        # a longer run is another search plan (autolr's total_steps): refused, naming both lengths
        with pytest.raises(hpx.ConfigError, match=r"total_steps=20, this engine has search\.total_steps=30"):
            _trainer(tmp_path, 30, callbacks=[AutoLR(probe_loss, probe=probe())]).fit(
                Digits(lr=0.01, steps=30), loader(), ckpt_path=ckpt)
    assert again.engine.step_count == 20
    assert [r.step for r in again.engine.history][: len(saved_history)] == saved_history
    assert [r.bases for r in again.engine.history] == [r.bases for r in auto.engine.history]


def test_bad_settings_are_named_together():
    with pytest.raises(hpx.ConfigError) as e:
        AutoLR(3, probe=None, backend=1, replicas=2)
    msg = str(e.value)
    for part in ("probe must be held-out batches", "loss_fn must be a function", "backend is set by",
                 "replicas is set by"):
        assert part in msg


def test_n_replicas_in_one_process_with_manual_optimization(tmp_path):
    from tests.integrations._lit import InProcess

    module = InProcess(lr=0.005, steps=40, replicas=4)
    # manual optimization without Lightning optimizers: Lightning counts batches, not steps
    trainer = _trainer(tmp_path, -1, max_epochs=1, limit_train_batches=40, log_every_n_steps=1)
    trainer.fit(module, loader())
    e = module.engine
    assert e.n_replicas == 4 and e.step_count == 40
    assert e.bases["lr"] != 1.0  # the four replicas explored and the search moved the lr
    for rep in e.replicas[1:]:  # converged at the end: every replica holds the consensus
        for p, q in zip(e.replicas[0].model.parameters(), rep.model.parameters()):
            assert torch.equal(p, q)
    assert e.replicas[0].model is module.net  # replica 0 is the module's own network
    rows = list(csv.DictReader(next(tmp_path.rglob("metrics.csv")).read_text().splitlines()))
    assert float([r for r in rows if r.get("hpx/lr_base")][-1]["hpx/lr_base"]) == pytest.approx(e.bases["lr"])


def test_forks_with_manual_optimization(tmp_path):
    """hpx.Forks inside a LightningModule (manual optimization): the module's own network trains as
    your run, the forks are cut, and after fit it holds the winner."""
    from tests.integrations._lit import WithForks

    module = WithForks(lr=0.001, steps=40)
    net = module.net
    trainer = _trainer(tmp_path, -1, max_epochs=1, limit_train_batches=40, log_every_n_steps=1)
    trainer.fit(module, loader())
    f = module.forks
    assert f.step_count == 40 and f.decided and f.model is net is module.net
    assert [r.phase for r in f.history] == ["cut", "cut", "end"]
    assert f.factor != 1.0  # 0.001 is low for this net: a challenger won and was loaded into it
    rows = list(csv.DictReader(next(tmp_path.rglob("metrics.csv")).read_text().splitlines()))
    counts = [float(r["hpx/forks"]) for r in rows if r.get("hpx/forks")]
    # five forks at first, then your run and one challenger, then the winner after the last step
    assert counts[0] == 5 and 2 in counts and counts[-1] == 1


def test_forks_under_two_ddp_processes_decide_alike(tmp_path):
    """hpx.Forks in a LightningModule under DDP (2 gloo processes, ddp_fork: ddp_spawn's launcher, its
    processes forked from this one, not started fresh to import Lightning again): each process trains
    its shard, the forks average their gradients over the processes (TorchDistributed), and both
    processes cut at the same steps, pick the same winner and end with the same weights."""
    from tests.integrations._lit import WithForks

    module = WithForks(lr=0.001, steps=40, out=str(tmp_path))
    trainer = _trainer(tmp_path, -1, devices=2, strategy="ddp_fork", max_epochs=1, limit_train_batches=40)
    trainer.fit(module, loader(16))
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert ranks[0]["step"] == ranks[1]["step"] == 40
    assert ranks[0]["steps"] == ranks[1]["steps"] and len(ranks[0]["steps"]) == 3
    assert ranks[0]["factor"] == ranks[1]["factor"] != 1.0  # 0.001 is low: a challenger won on both
    assert ranks[0]["params"] == ranks[1]["params"]  # the shards differ; the averaged gradients do not
    # the calling process gets rank 0's winner back, as Lightning returns a ddp_spawn (or ddp_fork) fit's
    # weights
    params = torch.cat([p.detach().reshape(-1) for p in module.net.parameters()])
    assert params.tolist() == ranks[0]["params"]


class _EveryFive(Digits):
    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=self.lr)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step", "frequency": 5}}


def test_a_schedule_stepped_every_few_steps_is_refused(tmp_path):
    """Read as stepped every step, the schedule halved the lr at every step instead of every fifth."""
    from hpx.errors import ConfigError

    with pytest.raises(ConfigError, match=r"stepped every step \('interval': 'step', frequency 1\)"):
        _trainer(tmp_path, 20, callbacks=[AutoLR(probe_loss, probe=probe(), seed=0)]).fit(
            _EveryFive(lr=0.003, steps=20), loader())
