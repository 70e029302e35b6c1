"""A tiny LightningModule on scikit-learn's digits, importable by spawned processes."""

from __future__ import annotations

import json
from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def digits() -> tuple[torch.Tensor, torch.Tensor]:
    x, y = load_digits(return_X_y=True)
    return torch.tensor(x / 16.0, dtype=torch.float32), torch.tensor(y, dtype=torch.long)


def loader(batch: int = 32) -> DataLoader:
    x, y = digits()
    return DataLoader(TensorDataset(x[:1400], y[:1400]), batch_size=batch, shuffle=False)


def probe() -> list[tuple[torch.Tensor, torch.Tensor]]:
    x, y = digits()
    return [(x[1400:1600], y[1400:1600])]


def probe_loss(module: Digits, batch) -> torch.Tensor:
    return F.cross_entropy(module(batch[0]), batch[1])


class Digits(pl.LightningModule):
    def __init__(self, lr: float = 0.01, steps: int = 40) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))
        self.lr, self.steps = lr, steps

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        return F.cross_entropy(self(batch[0]), batch[1])

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=self.lr, total_steps=self.steps)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class Report(pl.Callback):
    """Writes what the AutoLR callback saw to ``out/rank{r}.json`` when fitting ends."""

    def __init__(self, out: str) -> None:
        self.out = out

    def on_fit_end(self, trainer, pl_module) -> None:
        from hpx.integrations.lightning import AutoLR

        auto = next(c for c in trainer.callbacks if isinstance(c, AutoLR))
        e = auto.engine
        params = torch.cat([p.detach().reshape(-1) for p in pl_module.parameters()])
        Path(self.out, f"rank{trainer.global_rank}.json").write_text(json.dumps({
            "bases": e.bases, "steps": [r.step for r in e.history], "step": e.step_count,
            "n_replicas": e.n_replicas, "schedulers": len(trainer.lr_scheduler_configs),
            "lr": trainer.optimizers[0].param_groups[0]["lr"], "params": params.tolist(),
            "phases": [r.phase for r in e.history],
        }))


class EndGroup(pl.Callback):
    """Destroys the gloo process group when a ``ddp_spawn`` child's fit ends (put it last).

    Lightning destroys the group at exit only for NCCL; a spawned child that exits with a gloo
    group alive tears it down during interpreter shutdown, which can abort the process
    ("terminate called without an active exception") after the fit has finished. Nothing runs a
    collective after the callbacks' teardown in a ``ddp_spawn`` child (the results go back to
    the parent through a queue)."""

    def teardown(self, trainer, pl_module, stage) -> None:
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


class InProcess(pl.LightningModule):
    """N replicas in one process: manual optimization, hpx.autolr's engine steps them all."""

    def __init__(self, lr: float = 0.01, steps: int = 40, replicas: int = 4) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))
        self.lr, self.steps, self.replicas = lr, steps, replicas
        self.automatic_optimization = False  # the engine steps every replica's optimizer
        self.engine = None

    def configure_optimizers(self):
        return None  # each replica gets its own optimizer from the factory below

    def on_fit_start(self):
        import hpx

        self.engine = hpx.autolr(
            self.net, lambda m: torch.optim.SGD(m.parameters(), lr=self.lr, momentum=0.9),
            total_steps=self.steps, probe=probe(), replicas=self.replicas, seed=0,
            loss_fn=lambda rep, b: F.cross_entropy(rep.model(b[0]), b[1]))

    def training_step(self, batch, batch_idx):
        self.engine.step(lambda rep, b: F.cross_entropy(rep.model(b[0]), b[1]), batch)
        self.log("hpx/lr_base", self.engine.bases["lr"])

    def on_fit_end(self):
        self.engine.converge()  # self.net (replica 0) holds the consensus


class WithForks(pl.LightningModule):
    """hpx.Forks in Lightning: manual optimization, the forks step themselves in training_step."""

    def __init__(self, lr: float = 0.01, steps: int = 40, out: str | None = None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))
        self.lr, self.steps, self.out = lr, steps, out  # out: each process writes what it decided there
        self.automatic_optimization = False  # hpx.Forks steps every fork's optimizer
        self.forks = None

    def configure_optimizers(self):
        return None  # the forks' optimizers are built below, on the network and its copies

    def on_fit_start(self):
        import hpx
        from hpx.backends import TorchDistributed

        # under DDP the forks average their gradients over the processes themselves: they train
        # self.net and its copies directly, never through Lightning's DDP wrapper
        backend = TorchDistributed() if self.trainer.world_size > 1 else None
        self.forks = hpx.Forks(self.net, torch.optim.SGD(self.net.parameters(), lr=self.lr, momentum=0.9),
                               total_steps=self.steps, probe=probe(), backend=backend)

    def training_step(self, batch, batch_idx):
        losses = self.forks.step(lambda rep, b: F.cross_entropy(rep.model(b[0]), b[1]), batch)
        self.log("hpx/forks", float(len(self.forks.factors)))
        self.log("train_loss", losses[0])

    def on_fit_end(self):
        self.forks.converge()  # self.net holds the winner
        if self.out is not None:
            params = torch.cat([p.detach().reshape(-1) for p in self.net.parameters()])
            Path(self.out, f"rank{self.trainer.global_rank}.json").write_text(json.dumps({
                "factor": self.forks.factor, "steps": [r.step for r in self.forks.history],
                "step": self.forks.step_count, "params": params.tolist()}))


class Dropped(pl.LightningModule):
    """The digits MLP with dropout, SGD with momentum and OneCycleLR (its momentum cycle too) stepped
    every step: what the ForksCallback tests train."""

    def __init__(self, lr: float = 0.001, steps: int = 40, dropout: float = 0.1) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Dropout(dropout), nn.Linear(32, 10))
        self.lr, self.steps = lr, steps

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        loss = F.cross_entropy(self(batch[0]), batch[1])
        self.log("train_loss", loss)  # a fork's copy has no trainer: dropped there
        return loss

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=self.lr, total_steps=self.steps)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class Ramped(Dropped):
    """A loss weighted by the step and the epoch, as curricula and auxiliary-loss ramps are."""

    def training_step(self, batch, batch_idx):
        w = 1.0 + self.global_step / 8 + self.current_epoch
        return w * F.cross_entropy(self(batch[0]), batch[1])


class ReadsTrainer(Dropped):
    def training_step(self, batch, batch_idx):
        self.log("lr", self.lr_schedulers().get_last_lr()[0])
        return super().training_step(batch, batch_idx)
