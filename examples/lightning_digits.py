"""hpx inside PyTorch Lightning: two CPU processes (Lightning's DDP) find the learning rate.

The LightningModule is ordinary (an MLP on scikit-learn's digits, SGD + OneCycleLR stepped every
step); the only hpx line is the ``AutoLR`` callback. Started at a learning rate 10x below a good
one, the two processes score the run's displacement on held-out digits and move the learning
rate. ``--plain`` trains the same way without the callback, for comparison.

    pip install "hpx-hdet[lightning,examples]"
    python examples/lightning_digits.py            # about 20 s on 2 CPU cores
    python examples/lightning_digits.py --plain
"""

from __future__ import annotations

import argparse

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from hpx.integrations.lightning import AutoLR

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
    args = ap.parse_args()
    x, y = data()
    train = DataLoader(TensorDataset(x[:1097], y[:1097]), batch_size=32, shuffle=True,
                       generator=torch.Generator().manual_seed(0))
    probe = [(x[1097:1297], y[1097:1297])]
    module = Digits(lr=0.05)  # 10x below a good learning rate for this model
    auto = None if args.plain else AutoLR(probe_loss, probe=probe, seed=0)
    # strategy="ddp" starts the second process by running this script again
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_steps=STEPS,
                         callbacks=[auto] if auto else [], logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, train)
    if trainer.is_global_zero:
        with torch.no_grad():
            loss = float(F.cross_entropy(module(x[1297:]), y[1297:]))
        found = f", lr 0.05 -> {0.05 * auto.engine.bases['lr']:.3g}" if auto else ""
        print(f"{'plain Lightning' if args.plain else 'with hpx AutoLR'}: test loss {loss:.4f}{found}")


if __name__ == "__main__":
    main()
