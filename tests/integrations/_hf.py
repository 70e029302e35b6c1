"""A tiny model for the Hugging Face Trainer on scikit-learn's digits (importable by spawned ranks)."""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import nn


class Tiny(nn.Module):
    def __init__(self, dropout: float = 0.0) -> None:
        super().__init__()
        torch.manual_seed(0)
        drop = [nn.Dropout(dropout)] if dropout else []
        self.net = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), *drop, nn.Linear(32, 10))

    def forward(self, x, labels=None):
        logits = self.net(x)
        out = {"logits": logits}
        if labels is not None:
            out["loss"] = F.cross_entropy(logits, labels)
        return out


def digits():
    x, y = load_digits(return_X_y=True)
    return torch.tensor(x / 16.0, dtype=torch.float32), torch.tensor(y, dtype=torch.long)


def train_set():
    x, y = digits()
    return [{"x": x[i], "labels": y[i]} for i in range(1400)]


def probe():
    x, y = digits()
    return [{"x": x[1400:1600], "labels": y[1400:1600]}]


def probe_loss(model, batch):
    return model(**batch)["loss"]


def trainer(out, steps, callbacks, lr=1e-3, **kw):
    from transformers import Trainer, TrainingArguments

    args = TrainingArguments(output_dir=str(out), max_steps=steps, per_device_train_batch_size=32,
                             learning_rate=lr, lr_scheduler_type="linear", warmup_steps=4, report_to="none",
                             use_cpu=True, logging_steps=10_000, disable_tqdm=True, seed=0,
                             **{"save_strategy": "no", **kw})
    return Trainer(model=Tiny(), args=args, train_dataset=train_set(), callbacks=callbacks)


def two_ranks(rank, world_size, out):
    """One Trainer per rank under an initialised gloo group; what each rank's engine did."""
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size),
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29999"})
    from hpx.integrations.transformers import AutoLR

    auto = AutoLR(probe_loss, probe=probe(), seed=0)
    t = trainer(out, 40, [auto], lr=3e-4)
    t.train()
    e = auto.engine
    params = torch.cat([p.detach().reshape(-1) for p in t.model.parameters()])
    return {"bases": e.bases, "steps": [r.step for r in e.history], "n": e.n_replicas,
            "step": e.step_count, "params": params[:50].tolist(), "phases": [r.phase for r in e.history],
            "logged": [h for h in t.state.log_history if "hpx/lr_base" in h]}


def forks_args(out, steps, lr, **kw):
    from transformers import TrainingArguments

    return TrainingArguments(output_dir=str(out), max_steps=steps, learning_rate=lr, report_to="none",
                             use_cpu=True, logging_steps=10_000, disable_tqdm=True, seed=0,
                             **{"save_strategy": "no", "per_device_train_batch_size": 32,
                                "lr_scheduler_type": "linear", "warmup_steps": 4, **kw})


def forks_two_ranks(rank, world_size, out):
    """A ForksTrainer per rank under an initialised gloo group; what each rank's forks did."""
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size),
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29998"})
    from hpx.integrations.transformers import ForksTrainer

    t = ForksTrainer(model=Tiny(dropout=0.1), args=forks_args(out, 40, 1e-4, per_device_train_batch_size=16),
                     train_dataset=train_set(), probe=probe(), forks={"multiples": (1 / 16, 1 / 4, 1, 4, 16)})
    t.train()
    f = t.forks
    params = torch.cat([p.detach().reshape(-1) for p in t.model.parameters()])
    return {"world": f.collective.world_size, "factor": f.factor, "steps": [r.step for r in f.history],
            "scores": [r.scores for r in f.history], "fork_steps": f.fork_steps, "params": params.tolist()}
