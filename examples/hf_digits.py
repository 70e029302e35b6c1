"""hpx inside the Hugging Face Trainer: ``ForksTrainer`` finds the learning rate of a run.

The model is ordinary (an MLP on scikit-learn's handwritten digits that returns its loss, as a
transformers model does), trained by the Trainer with AdamW and its linear schedule, from a
learning rate 10x below a good one. ``ForksTrainer`` is the only change from a plain ``Trainer``:
the other forks (0.1x to 10x the learning rate) train beside your run on the same batches, and
at the end a challenger replaces your run only if it is better on the probe with confidence. The
same run by a plain ``Trainer`` is printed beside it.

    pip install "hpx-hdet[transformers,examples]"
    python examples/hf_digits.py                       # about 5 s on a laptop CPU
    torchrun --nproc_per_node=2 examples/hf_digits.py  # each fork data-parallel over 2 processes
"""

from __future__ import annotations

import argparse
import logging
import os

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import nn
from transformers import Trainer, TrainingArguments

from hpx.integrations.transformers import ForksTrainer


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Dropout(0.1), nn.Linear(128, 10))

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        logits = self.net(x)
        if labels is None:
            return {"logits": logits}
        return {"logits": logits, "loss": F.cross_entropy(logits, labels)}


def splits() -> tuple[list[dict[str, torch.Tensor]], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Training examples (1,200), a probe batch (300) and a test batch (297), in a fixed shuffle."""
    x, y = load_digits(return_X_y=True)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    x = torch.tensor(x / 16.0, dtype=torch.float32)[order]
    y = torch.tensor(y, dtype=torch.long)[order]
    train = [{"x": x[i], "labels": y[i]} for i in range(1200)]
    return train, {"x": x[1200:1500], "labels": y[1200:1500]}, {"x": x[1500:], "labels": y[1500:]}


def accuracy(model: nn.Module, batch: dict[str, torch.Tensor]) -> float:
    model.eval()
    with torch.no_grad():
        return float((model(batch["x"])["logits"].argmax(-1) == batch["labels"]).float().mean())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--lr", type=float, default=3e-4, help="your learning rate (10x below a good one)")
    p.add_argument("--out", default="hf_digits_out")
    a = p.parse_args()
    if int(os.environ.get("RANK", "0")) == 0:  # hpx logs one line per decision (here: from process 0)
        logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    train, probe, test = splits()
    args = TrainingArguments(output_dir=a.out, max_steps=a.steps, per_device_train_batch_size=32,
                             learning_rate=a.lr, lr_scheduler_type="linear", warmup_steps=a.steps // 20,
                             save_strategy="no", report_to="none", logging_steps=10**6, disable_tqdm=True,
                             use_cpu=not torch.cuda.is_available(), seed=0)
    trainer = ForksTrainer(model=MLP(), args=args, train_dataset=train, probe=[probe])
    trainer.train()
    plain = Trainer(model=MLP(), args=args, train_dataset=train)
    plain.train()
    if trainer.args.process_index == 0:
        print(f"ForksTrainer: the run ended at {trainer.forks.factor:g}x your lr; "
              f"test accuracy {accuracy(trainer.model, test):.3f}")
        print(f"plain Trainer at your lr: test accuracy {accuracy(plain.model, test):.3f}")
    del trainer, plain  # their DDP wrappers first: a gloo group left to interpreter shutdown can abort it
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
