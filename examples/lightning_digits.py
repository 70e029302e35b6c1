"""hpx inside PyTorch Lightning: two CPU processes (Lightning's DDP) find the learning rate.

The LightningModule is ordinary (an MLP on scikit-learn's digits, SGD + OneCycleLR stepped every
step); the only hpx line is the ``ForksCallback``. Lightning trains your run at the learning rate
given (0.005: far too low; plain Lightning's test loss is 0.70 there, 0.12 at 0.05 and 0.087 at
0.5) while hpx trains forks of it at 0.1x to 10x that learning rate on the same batches, cuts
them, and at the end keeps your run unless a fork is better on held-out digits with confidence
(here the fork at 10x: the run ends as plain Lightning at 0.05 does, test loss 0.12). ``--plain``
trains the same way without the callback, for comparison.

    pip install "hpx-hdet[lightning,examples]"
    python examples/lightning_digits.py              # about 15 s on 2 CPU cores
    python examples/lightning_digits.py --plain --lr 0.05
"""

from __future__ import annotations

import argparse

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from hpx.integrations.lightning import ForksCallback

STEPS = 600


def data() -> tuple[torch.Tensor, torch.Tensor]:
    x, y = load_digits(return_X_y=True)
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    return torch.tensor(x / 16.0, dtype=torch.float32)[perm], torch.tensor(y, dtype=torch.long)[perm]


class Digits(pl.LightningModule):
    def __init__(self, lr: float) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
        self.lr = lr

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        return F.cross_entropy(self(batch[0]), batch[1])

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=self.lr, total_steps=STEPS)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def probe_loss(module: Digits, batch) -> torch.Tensor:
    return F.cross_entropy(module(batch[0]), batch[1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--plain", action="store_true", help="train without hpx, for comparison")
    ap.add_argument("--lr", type=float, default=0.005, help="the (peak) learning rate of your run")
    args = ap.parse_args()
    x, y = data()
    train = DataLoader(TensorDataset(x[:1097], y[:1097]), batch_size=32, shuffle=True,
                       generator=torch.Generator().manual_seed(0))
    probe = [(x[1097:1297], y[1097:1297])]
    module = Digits(lr=args.lr)
    forks = None if args.plain else ForksCallback(probe_loss, probe=probe)
    # strategy="ddp" starts the second process by running this script again
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_steps=STEPS,
                         callbacks=[forks] if forks else [], logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, train)
    if trainer.is_global_zero:
        with torch.no_grad():
            loss = float(F.cross_entropy(module(x[1297:]), y[1297:]))
        found = f", lr {args.lr:g} -> {args.lr * forks.forks.factor:.3g}" if forks else ""
        print(f"{'plain Lightning' if args.plain else 'with hpx ForksCallback'}: test loss {loss:.4f}{found}")
    if torch.distributed.is_initialized():  # Lightning ends the process group at exit for NCCL only; a
        torch.distributed.destroy_process_group()  # gloo group left to interpreter shutdown can abort it


if __name__ == "__main__":
    main()
