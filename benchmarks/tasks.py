"""The three benchmark tasks, on data that ships with installed packages (nothing is downloaded).

* ``mlp``: scikit-learn's digits, an MLP trained with SGD + momentum; one knob (lr).
* ``charlm``: a character-level causal transformer on the English text of CPython's
  ``pydoc_data.topics``, trained with AdamW; seven knobs (the learning rate of three
  named parameter groups, weight decay, dropout, label smoothing, attention temperature).
* ``cnn``: a small CNN with BatchNorm on the digits images, SGD + momentum; two knobs
  (lr, weight decay). Compared on validation accuracy as well as loss.

These are the tasks of the study of the paper's controller (``python -m benchmarks``). The
learning-rate suite, which judges the learning-rate search, has its own registry of 37 tasks
(``benchmarks/lr/tasks.py``).

Every task has a fixed train / probe / validation split (the split does not depend
on the run's seed; the seed sets the initial weights and the batch order). Plain
training never sees the probe split; hpx may score replicas on it (``ProbeStream``).
The validation split is used only to report results and to pick the grid's oracle.

Every learning rate follows one shape, ``schedule(t)``: a linear warm-up over the
first 10% of the steps and a cosine decay to 0. The "max lr" of a run is the factor
in front of it, for plain training and for hpx's base alike.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cache
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import hpx

__all__ = ["TASKS", "Task", "get_task", "warmup_cosine"]


def warmup_cosine(total: int, warm_frac: float = 0.1) -> Callable[[int], float]:
    """``f(t)``: linear warm-up to 1 over ``warm_frac * total`` steps, then cosine to 0."""
    warm = max(1, round(warm_frac * total))

    def f(t: int) -> float:
        if t < warm:
            return (t + 1) / warm
        frac = min(1.0, (t - warm) / max(1, total - warm))
        return 0.5 * (1.0 + math.cos(math.pi * frac))

    return f


def warmup_flat(total: int, warm_frac: float = 0.1) -> Callable[[int], float]:
    """The paper-faithful base shape: the same warm-up, then flat (the controller's decay
    ``gamma`` brings the base down to the floor instead of a cosine)."""
    warm = max(1, round(warm_frac * total))
    return lambda t: (t + 1) / warm if t < warm else 1.0


# ----------------------------------------------------------------------------- task base


@dataclass
class Task:
    """A benchmark task. Subclasses build data, model and optimizer; runs are driven elsewhere."""

    name: str = ""
    title: str = ""
    steps: int = 1000
    batch: int = 64                  # global batch; hpx splits it among its replicas
    sync_every: int = 25             # T
    grid_center: float = 0.1         # the grid is grid_center * 10**linspace(-1, 1, n)
    metric: str = "loss"             # what the quality target is stated on ("loss" or "acc")
    evals: int = 10                  # points on the validation curve
    plain_replicas: int = 1          # plain training's layout: 1 process with the whole batch, or
                                     # N replicas splitting it (plain DDP on N devices; differs only
                                     # for models whose forward reads the batch, like BatchNorm)
    extra: dict[str, Any] = field(default_factory=dict)

    # --- to be provided --------------------------------------------------------------
    def data(self) -> dict[str, Any]:
        raise NotImplementedError

    def model(self, seed: int) -> nn.Module:
        raise NotImplementedError

    def optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        """The optimizer with its fixed (non-explored) settings; lr is set per step."""
        raise NotImplementedError

    def knobs(self, lr: float, spread: float, schedule: Callable[[int], float],
              scale: float = 1.0) -> list[hpx.Knob]:
        """hpx's knobs, lr bases at ``lr``; other knobs at the plain run's fixed values.
        ``scale`` multiplies every spread."""
        raise NotImplementedError

    def loss(self, model: nn.Module, batch: Any, values: dict[str, float] | None = None) -> torch.Tensor:
        """The training loss; ``values`` are the replica's knob values (or the plain run's)."""
        raise NotImplementedError

    def probe_loss(self, model: nn.Module, batch: Any) -> torch.Tensor:
        """The loss replicas are compared on: the plain objective, no regularisers."""
        x, y = batch
        return F.cross_entropy(model(x), y)

    def sample(self, gen: torch.Generator, size: int) -> Any:
        raise NotImplementedError

    def set_fixed(self, model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, float]:
        """Apply the plain run's fixed non-lr settings; return them as knob values."""
        return {}

    def chance_loss(self) -> float:
        """The loss of predicting the uniform distribution over the classes."""
        return math.log(10)

    # --- shared ----------------------------------------------------------------------
    def grid(self, n: int = 9) -> list[float]:
        """``n`` max learning rates, log-spaced over 10x below to 10x above ``grid_center``."""
        if n == 1:
            return [self.grid_center]
        return [self.grid_center * 10 ** (-1 + 2 * i / (n - 1)) for i in range(n)]

    def schedule(self) -> Callable[[int], float]:
        return warmup_cosine(self.steps)

    def probe_batches(self) -> list[Any]:
        return self.data()["probe"]

    @torch.no_grad()
    def evaluate(self, model: nn.Module) -> dict[str, float]:
        """Validation loss (no regularisers) and accuracy of ``model`` (eval mode)."""
        was = model.training
        model.eval()
        tot, correct, n = 0.0, 0, 0
        for x, y in self.data()["val"]:
            logits = self._logits(model, x)
            tot += float(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1),
                                         reduction="sum"))
            correct += int((logits.argmax(-1) == y).sum())
            n += y.numel()
        model.train(was)
        return {"loss": tot / n, "acc": 100.0 * correct / n}

    def _logits(self, model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return model(x)


def _init(model: nn.Module, seed: int) -> nn.Module:
    """Re-initialise ``model``'s parameters from ``seed`` without touching the global RNG."""
    state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        for m in model.modules():
            if hasattr(m, "reset_parameters") and m is not model:
                m.reset_parameters()
        if hasattr(model, "_init_weights"):
            model._init_weights()
    finally:
        torch.random.set_rng_state(state)
    return model


# ----------------------------------------------------------------------------- digits


@cache
def _digits(images: bool) -> dict[str, Any]:
    """Digits: 1097 train, 200 probe, 500 validation (a fixed shuffle)."""
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    x = torch.tensor(x / 16.0, dtype=torch.float32)
    y = torch.tensor(y, dtype=torch.long)
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(1234))
    x, y = x[perm], y[perm]
    if images:
        x = (x.reshape(-1, 1, 8, 8) - 0.3) / 0.4
    tr, pr = 1097, 1297
    return {
        "train": (x[:tr], y[:tr]),
        "probe": [(x[tr:pr], y[tr:pr])],
        "val": [(x[pr:], y[pr:])],
    }


class DigitsMLP(Task):
    WD = 1e-3

    def data(self):
        return _digits(False)

    def model(self, seed):
        return _init(nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10)), seed)

    def optimizer(self, model):
        return torch.optim.SGD(model.parameters(), lr=0.0, momentum=0.9, weight_decay=self.WD)

    def knobs(self, lr, spread, schedule, scale=1.0):
        return [hpx.LearningRate("lr", base=lr, spread=spread * scale, schedule=schedule)]

    def loss(self, model, batch, values=None):
        x, y = batch
        return F.cross_entropy(model(x), y)

    def sample(self, gen, size):
        x, y = self.data()["train"]
        idx = torch.randint(0, len(y), (size,), generator=gen)
        return x[idx], y[idx]


class DigitsCNN(DigitsMLP):
    WD = 5e-4

    def data(self):
        return _digits(True)

    def model(self, seed):
        net = nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
            nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
            nn.MaxPool2d(2), nn.Flatten(), nn.Linear(32 * 16, 10),
        )
        return _init(net, seed)

    def optimizer(self, model):
        return torch.optim.SGD(model.parameters(), lr=0.0, momentum=0.9, weight_decay=self.WD)

    def knobs(self, lr, spread, schedule, scale=1.0):
        return [hpx.LearningRate("lr", base=lr, spread=spread * scale, schedule=schedule),
                hpx.WeightDecay("weight_decay", base=self.WD, spread=0.5 * scale)]


# ----------------------------------------------------------------------------- char LM


@cache
def _text() -> dict[str, Any]:
    """pydoc_data.topics joined (sorted keys); 90% train, 5% probe, the last 5% validation."""
    from pydoc_data.topics import topics

    text = "".join(topics[k] for k in sorted(topics))
    chars = sorted(set(text))
    index = {c: i for i, c in enumerate(chars)}
    ids = torch.tensor([index[c] for c in text], dtype=torch.long)
    n = len(ids)
    a, b = int(0.9 * n), int(0.95 * n)
    return {"train": ids[:a], "probe_ids": ids[a:b], "val_ids": ids[b:], "vocab": len(chars)}


class Attention(nn.Module):
    """Causal self-attention whose logits are divided by ``temperature`` (an hpx knob)."""

    def __init__(self, d: int, heads: int, p: float) -> None:
        super().__init__()
        self.heads, self.temperature = heads, 1.0
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.drop = nn.Dropout(p)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        scale = 1.0 / (math.sqrt(d // self.heads) * self.temperature)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
        return self.drop(self.proj(y.transpose(1, 2).reshape(b, t, d)))


class Block(nn.Module):
    def __init__(self, d: int, heads: int, p: float) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = Attention(d, heads, p)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d), nn.Dropout(p))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class CharTransformer(nn.Module):
    def __init__(self, vocab: int, d: int = 48, layers: int = 2, heads: int = 4, ctx: int = 64,
                 p: float = 0.1) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(ctx, d)
        self.drop = nn.Dropout(p)
        self.blocks = nn.ModuleList(Block(d, heads, p) for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab)

    def _init_weights(self):
        for name, p in self.named_parameters():
            if p.dim() >= 2:
                nn.init.normal_(p, std=0.02)
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def forward(self, idx):
        t = idx.shape[1]
        x = self.drop(self.tok(idx) + self.pos(torch.arange(t, device=idx.device)))
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln(x))

    def param_groups(self) -> dict[str, list[nn.Parameter]]:
        """embed (token, position embeddings), body (attention/MLP/head matrices), norm
        (LayerNorm weights and every bias: no weight decay)."""
        groups: dict[str, list[nn.Parameter]] = {"embed": [], "body": [], "norm": []}
        for name, p in self.named_parameters():
            if name.startswith(("tok.", "pos.")):
                groups["embed"].append(p)
            elif p.dim() >= 2:
                groups["body"].append(p)
            else:
                groups["norm"].append(p)
        return groups


class CharLM(Task):
    CTX = 64
    WD, DROPOUT, SMOOTHING, TEMP = 0.1, 0.1, 0.05, 1.0
    GROUPS = ("embed", "body", "norm")

    def data(self):
        d = _text()
        if "probe" not in d:
            g = torch.Generator().manual_seed(99)
            d["probe"] = [self._windows(d["probe_ids"], 32, g) for _ in range(4)]
            d["val"] = [self._windows(d["val_ids"], 64, g) for _ in range(4)]
        return d

    def _windows(self, ids: torch.Tensor, n: int, gen: torch.Generator):
        start = torch.randint(0, len(ids) - self.CTX - 1, (n,), generator=gen)
        off = torch.arange(self.CTX + 1)
        w = ids[start[:, None] + off]
        return w[:, :-1], w[:, 1:]

    def sample(self, gen, size):
        return self._windows(self.data()["train"], size, gen)

    def model(self, seed):
        return _init(CharTransformer(self.data()["vocab"], ctx=self.CTX, p=self.DROPOUT), seed)

    def optimizer(self, model):
        g = model.param_groups()
        return torch.optim.AdamW(
            [{"params": g["embed"], "name": "embed", "weight_decay": 0.0},
             {"params": g["body"], "name": "body", "weight_decay": self.WD},
             {"params": g["norm"], "name": "norm", "weight_decay": 0.0}],
            lr=0.0, betas=(0.9, 0.99))

    def knobs(self, lr, spread, schedule, scale=1.0):
        return [
            *[hpx.LearningRate(f"lr/{g}", group=g, base=lr, spread=spread * scale, schedule=schedule)
              for g in self.GROUPS],
            hpx.WeightDecay("weight_decay", group="body", base=self.WD, spread=0.5 * scale),
            hpx.Dropout("dropout", base=self.DROPOUT, spread=0.05 * scale),
            hpx.LabelSmoothing("smoothing", base=self.SMOOTHING, spread=0.05 * scale),
            hpx.AttentionTemperature("attn_temp", modules=Attention, base=self.TEMP, spread=0.25 * scale),
        ]

    def loss(self, model, batch, values=None):
        x, y = batch
        s = self.SMOOTHING if values is None else values.get("smoothing", self.SMOOTHING)
        logits = model(x)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1), label_smoothing=s)

    def chance_loss(self):
        return math.log(self.data()["vocab"])

    def probe_loss(self, model, batch):
        x, y = batch
        logits = model(x)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


TASKS: dict[str, Callable[..., Task]] = {
    "mlp": lambda **kw: DigitsMLP(**{"name": "mlp", "title": "digits MLP 64-128-10 (SGD)", "steps": 600,
                                     "batch": 64, "sync_every": 20, "grid_center": 0.3, **kw}),
    "charlm": lambda **kw: CharLM(**{"name": "charlm",
                                     "title": "char transformer (2 layers, d 48, ctx 64), pydoc, AdamW",
                                     "steps": 300, "batch": 16, "sync_every": 15, "grid_center": 1e-2,
                                     **kw}),
    "cnn": lambda **kw: DigitsCNN(**{"name": "cnn", "title": "digits CNN + BatchNorm (SGD)",
                                     "steps": 600, "batch": 64, "sync_every": 20, "grid_center": 0.1,
                                     "metric": "acc", **kw}),
}


def get_task(name: str, **overrides: Any) -> Task:
    try:
        return TASKS[name](**overrides)
    except KeyError:
        raise SystemExit(f"unknown task {name!r} (tasks: {', '.join(TASKS)})") from None
