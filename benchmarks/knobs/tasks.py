"""The co-exploration suite's tasks: a training set-up, the knobs besides the lr, and their grid.

Each task is a set-up as a user writes it (data, model, optimizer, torch schedule: a
:class:`benchmarks.lr.tasks.Task`) with one or two knobs besides the learning rate, and the values
each knob takes on the task's grid of plain runs: five peak learning rates half a decade apart
around ``center`` times four values of one knob (a 2-D grid), or times three values of each of two
knobs (a 3-D grid, coarser). The knobs are the built-in ones a user declares:

* ``dropout``: every ``nn.Dropout`` module's ``p``;
* ``weight_decay``: the decayed parameter group's (group 0: the weights, not biases or norms);
* ``label_smoothing``: the training loss's, read by the loss (the probe and validation losses are
  never smoothed);
* ``temperature``: an attention temperature the model's attention modules read (scores divided by
  ``sqrt(d_head) * temperature``).

``late`` marks the tasks where the better regularization is expected to show only late: small
training sets, long runs, models that overfit. ``HELD_OUT`` names the tasks kept out of every
design decision: they were committed with their grids (``benchmarks/knobs/stored/grid.json``)
before any search ran on any task of this suite, and the acceptance table reports them apart.
Everything ships with installed packages (scikit-learn's bundled sets and generators, CPython's
``pydoc_data.topics`` text); nothing is downloaded.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cache
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from benchmarks.lr.tasks import Task, _split, _tabular, _text, _windows

__all__ = ["FIRST_HELD_OUT", "HELD_OUT", "KNOBS", "SECOND_HELD_OUT", "TASKS", "THIRD_HELD_OUT", "CoTask",
           "get_task"]

KNOBS = ("dropout", "weight_decay", "label_smoothing", "temperature")
LR_STEPS = (-2, -1, 0, 1, 2)  # the grid's peak lrs: center * 10 ** (k / 2)


@dataclass(frozen=True)
class CoTask:
    """A set-up and its knobs: ``axes`` maps each knob besides the lr to its grid values (the first
    value is the set-up's own, which the model and optimizer are built with)."""

    task: Task
    axes: tuple[tuple[str, tuple[float, ...]], ...]
    late: bool = False

    @property
    def name(self) -> str:
        return self.task.name

    def lrs(self) -> list[float]:
        """The grid's peak learning rates."""
        return [self.task.center * 10 ** (k / 2) for k in LR_STEPS]

    def cells(self) -> list[tuple[float, ...]]:
        """Every cell of the grid: ``(lr, value of the first knob[, value of the second])``."""
        out: list[tuple[float, ...]] = [(lr,) for lr in self.lrs()]
        for _, values in self.axes:
            out = [(*c, v) for c in out for v in values]
        return out

    def knob_names(self) -> tuple[str, ...]:
        return tuple(k for k, _ in self.axes)


def set_knobs(model: nn.Module, opt: torch.optim.Optimizer, values: dict[str, float]) -> None:
    """Write the knobs' values a plain run trains at (label smoothing is read by the loss)."""
    for name, v in values.items():
        if name == "dropout":
            for m in model.modules():
                if isinstance(m, nn.Dropout):
                    m.p = v
        elif name == "weight_decay":
            opt.param_groups[0]["weight_decay"] = v
        elif name == "temperature":
            for m in model.modules():
                if isinstance(m, _Attention):
                    m.temperature = v


def train_loss(task: Task, model: nn.Module, batch: Any, smoothing: float = 0.0) -> torch.Tensor:
    """The training loss: the task's, with ``smoothing`` for a classification's cross-entropy."""
    if not smoothing or task.kind == "reg":
        return task.loss(model, batch)
    x, y = batch
    out = model(x)
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1), label_smoothing=smoothing)


# ----------------------------------------------------------------------------- data


@cache
def _digits_small(train: int, form: str = "flat") -> dict[str, Any]:
    """scikit-learn's digits with a small training split: 500 validation rows, a 400-row probe,
    the first ``train`` of the rest train (the others are not used)."""
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    x = torch.tensor(x / 16.0, dtype=torch.float32)
    if form == "image":
        x = (x.reshape(-1, 1, 8, 8) - 0.3) / 0.4
    elif form == "rows":
        x = (x.reshape(-1, 8, 8) - 0.3) / 0.4
    d = _split(x, torch.tensor(y, dtype=torch.long), probe=400, val=500, seed=2026)
    tx, ty = d["train"]
    return {**d, "train": (tx[:train], ty[:train]), "classes": 10}


@cache
def _synth(seed: int, classes: int) -> dict[str, Any]:
    """scikit-learn's ``make_classification`` (20 features, 5 informative, 5% labels flipped):
    300 train, 300 probe, 600 validation rows."""
    return _tabular("make_classification", probe=300, val=600, reg=False, n_samples=1200, n_features=20,
                    n_informative=5, n_redundant=5, n_classes=classes, flip_y=0.05, random_state=seed)


@cache
def _friedman_small(seed: int = 21) -> dict[str, Any]:
    """Friedman's regression #1 (noise sd 1): 200 train, 300 probe, 500 validation rows."""
    return _tabular("make_friedman1", probe=300, val=500, reg=True, n_samples=1000, noise=1.0,
                    random_state=seed)


@cache
def _moons_small() -> dict[str, Any]:
    """Two half-moons with noise 0.35: 150 train, 300 probe, 500 validation rows."""
    return _tabular("make_moons", probe=300, val=500, reg=False, n_samples=950, noise=0.35, random_state=22)


@cache
def _cancer_small() -> dict[str, Any]:
    """Breast cancer (569 rows): 269 train, 150 probe, 150 validation."""
    return _tabular("load_breast_cancer", probe=150, val=150, reg=False)


@cache
def _diabetes_small() -> dict[str, Any]:
    """Diabetes (442 rows, a standardised target): 192 train, 100 probe, 150 validation."""
    return _tabular("load_diabetes", probe=100, val=150, reg=True)


@cache
def _chars_small(ctx: int, train_chars: int) -> dict[str, Any]:
    """The pydoc topics text with a small training part (its first ``train_chars`` characters, so a
    model overfits), 48 probe and 96 validation windows of ``ctx`` from the text's end."""
    ids, vocab = _text()
    n = len(ids)
    a, b = int(0.9 * n), int(0.95 * n)
    g = torch.Generator().manual_seed(97)
    return {"stream": ids[:train_chars], "ctx": ctx, "classes": vocab,
            "probe": [_windows(ids[a:b], 48, ctx, g)],
            "val": [_windows(ids[b:], 48, ctx, g) for _ in range(2)]}


# ----------------------------------------------------------------------------- models


def _mlp(sizes: list[int], dropout: float = 0.0) -> nn.Sequential:
    """An MLP with a dropout module after every hidden layer (``p = dropout``, kept at 0 as a module
    so the dropout knob has somewhere to write)."""
    layers: list[nn.Module] = []
    for i in range(len(sizes) - 2):
        layers += [nn.Linear(sizes[i], sizes[i + 1]), nn.ReLU(), nn.Dropout(dropout)]
    layers += [nn.Linear(sizes[-2], sizes[-1])]
    return nn.Sequential(*layers)


def _cnn(dropout: float = 0.0) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(),
        nn.MaxPool2d(2), nn.Flatten(), nn.Dropout(dropout), nn.Linear(32 * 16, 128), nn.ReLU(),
        nn.Dropout(dropout), nn.Linear(128, 10))


class _Attention(nn.Module):
    """Causal self-attention whose scores are divided by ``sqrt(d_head) * temperature``."""

    def __init__(self, d: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.heads, self.temperature = heads, 1.0
        self.qkv, self.out = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        scale = 1.0 / (math.sqrt(d // self.heads) * self.temperature)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
        return self.drop(self.out(y.transpose(1, 2).reshape(b, t, d)))


class _Block(nn.Module):
    def __init__(self, d: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = _Attention(d, heads, dropout)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d), nn.Dropout(dropout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class _TinyLM(nn.Module):
    """A pre-norm causal transformer LM written out (its attention reads a temperature)."""

    def __init__(self, vocab: int, ctx: int, d: int = 32, layers: int = 2, heads: int = 2,
                 dropout: float = 0.0) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(ctx, d)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.Sequential(*[_Block(d, heads, dropout) for _ in range(layers)])
        self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.drop(self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device)))
        return self.head(self.ln(self.blocks(x)))


class _GruLM(nn.Module):
    """A character GRU LM with dropout on its embeddings and on its outputs."""

    def __init__(self, vocab: int, d: int = 32, hidden: int = 128, dropout: float = 0.0) -> None:
        super().__init__()
        self.embed, self.rnn = nn.Embedding(vocab, d), nn.GRU(d, hidden, batch_first=True)
        self.drop_in, self.drop_out = nn.Dropout(dropout), nn.Dropout(dropout)
        self.head = nn.Linear(hidden, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, _ = self.rnn(self.drop_in(self.embed(x)))
        return self.head(self.drop_out(h))


class _RowLSTM(nn.Module):
    """An LSTM over a digit's 8 rows, a class head on the last state."""

    def __init__(self) -> None:
        super().__init__()
        self.rnn, self.head = nn.LSTM(8, 64, batch_first=True), nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, _ = self.rnn(x)
        return self.head(h[:, -1])


# ----------------------------------------------------------------------------- the registry


def _c(axes: dict[str, tuple[float, ...]], late: bool = False, **kw: Any) -> CoTask:
    return CoTask(Task(**kw), tuple(axes.items()), late)


TASKS: dict[str, CoTask] = {t.name: t for t in [
    # --- design tasks
    _c({"dropout": (0.0, 0.2, 0.4, 0.6)}, late=True,
       name="k_digits300_dropout", family="mlp", optim="adamw", sched="cosine", steps=600, batch=32,
       center=1e-3, data=lambda: _digits_small(300), net=lambda d: _mlp([64, 512, 512, 10]),
       title="digits, 300 training rows, wide MLP 64-512-512-10, AdamW, cosine, 600 steps"),
    _c({"weight_decay": (0.0, 0.3, 1.0, 3.0)}, late=True,
       name="k_digits300_wd", family="mlp", optim="adamw", sched="cosine", steps=600, batch=32,
       center=1e-3, data=lambda: _digits_small(300), net=lambda d: _mlp([64, 512, 512, 10]),
       title="digits, 300 training rows, wide MLP, AdamW (decoupled decay), cosine, 600 steps"),
    _c({"weight_decay": (0.0, 5e-4, 5e-3, 5e-2)}, late=True,
       name="k_cancer_sgd_wd", family="tabular", optim="sgd", sched="onecycle", steps=1500, batch=32,
       center=3e-2, data=_cancer_small, net=lambda d: _mlp([30, 256, 256, 2]),
       title="breast cancer, 269 rows, MLP 30-256-256-2, SGD + momentum (L2), OneCycle, 1,500 steps"),
    _c({"label_smoothing": (0.0, 0.05, 0.15, 0.3)},
       name="k_digits_ls", family="mlp", optim="sgd", sched="onecycle", steps=500, batch=64,
       center=0.1, data=lambda: _digits_small(897), net=lambda d: _mlp([64, 256, 10]),
       title="digits, 897 training rows, MLP 64-256-10, SGD + momentum, OneCycle, label smoothing"),
    _c({"dropout": (0.0, 0.1, 0.25, 0.4)}, late=True,
       name="k_char_tf_dropout", family="transformer", optim="adamw", sched="cosine", steps=400, batch=16,
       center=3e-3, data=lambda: _chars_small(32, 60_000), net=lambda d: _TinyLM(d["classes"], 32),
       weight_decay=0.01, title="char transformer LM (2 layers, d 32) on 60,000 characters, AdamW, cosine"),
    _c({"temperature": (1.0, 0.25, 0.5, 2.0)},
       name="k_char_tf_temp", family="transformer", optim="adam", sched="linear", steps=400, batch=16,
       center=3e-3, data=lambda: _chars_small(32, 400_000), net=lambda d: _TinyLM(d["classes"], 32),
       title="char transformer LM (2 layers, d 32), Adam, warm-up + linear decay, attention temperature"),
    _c({"weight_decay": (0.0, 0.03, 0.3, 3.0)}, late=True,
       name="k_moons_wd", family="tabular", optim="adamw", sched="cosine", steps=2000, batch=32,
       center=3e-3, data=_moons_small, net=lambda d: _mlp([2, 256, 256, 2]),
       title="two moons, 150 rows, MLP 2-256-256-2, AdamW, cosine, 2,000 steps"),
    _c({"dropout": (0.0, 0.3, 0.6), "label_smoothing": (0.0, 0.1, 0.3)},
       name="k_synth_dropout_ls", family="tabular", optim="adam", sched="onecycle", steps=800, batch=32,
       center=1e-3, data=lambda: _synth(31, 4), net=lambda d: _mlp([20, 256, 256, 4]),
       title="4-class synthetic classification, 300 rows, MLP, Adam, OneCycle: dropout x label smoothing"),
    _c({"dropout": (0.0, 0.25, 0.5), "weight_decay": (0.0, 0.1, 1.0)}, late=True,
       name="k_digits_cnn_dropout_wd", family="cnn", optim="adamw", sched="cosine", steps=500, batch=32,
       center=1e-3, data=lambda: _digits_small(500, "image"), net=lambda d: _cnn(),
       title="digits, 500 training images, CNN with dropout, AdamW, cosine: dropout x weight decay"),
    _c({"dropout": (0.0, 0.1, 0.3, 0.5)}, late=True,
       name="k_friedman_dropout", family="tabular", optim="adamw", sched="linear", steps=1000, batch=32,
       center=1e-3, data=lambda: _friedman_small(21), net=lambda d: _mlp([10, 256, 256, 1]), kind="reg",
       title="Friedman #1 regression, 200 rows, MLP 10-256-256-1, AdamW, warm-up + linear, 1,000 steps"),
    # --- held out (committed with their grids before any search ran on this suite)
    _c({"dropout": (0.0, 0.2, 0.4, 0.6)}, late=True,
       name="k_digits400_dropout_sgd", family="mlp", optim="sgd", sched="onecycle", steps=800, batch=32,
       center=3e-2, data=lambda: _digits_small(400), net=lambda d: _mlp([64, 384, 384, 10]),
       title="digits, 400 training rows, MLP 64-384-384-10, SGD + momentum, OneCycle, 800 steps"),
    _c({"dropout": (0.0, 0.1, 0.3, 0.5)}, late=True,
       name="k_char_gru_dropout", family="rnn", optim="adamw", sched="cosine", steps=400, batch=16,
       center=3e-3, data=lambda: _chars_small(32, 60_000), net=lambda d: _GruLM(d["classes"], hidden=96),
       weight_decay=0.01, title="char GRU LM (hidden 96) on 60,000 characters, AdamW, cosine"),
    _c({"weight_decay": (0.0, 0.1, 1.0, 10.0)}, late=True,
       name="k_diabetes_wd", family="tabular", optim="adamw", sched="onecycle", steps=1000, batch=32,
       center=1e-3, data=_diabetes_small, net=lambda d: _mlp([10, 256, 256, 1]), kind="reg",
       title="diabetes regression, 192 rows, MLP 10-256-256-1, AdamW, OneCycle, 1,000 steps"),
    _c({"label_smoothing": (0.0, 0.1, 0.2, 0.4)},
       name="k_digits_rows_ls", family="rnn", optim="adam", sched="cosine", steps=500, batch=32,
       center=3e-3, data=lambda: _digits_small(897, "rows"), net=lambda d: _RowLSTM(),
       title="LSTM over digits' rows, 897 training rows, Adam, cosine, label smoothing"),
    _c({"dropout": (0.0, 0.3, 0.6), "weight_decay": (0.0, 0.3, 3.0)}, late=True,
       name="k_synth_dropout_wd", family="tabular", optim="adamw", sched="cosine", steps=1000, batch=32,
       center=1e-3, data=lambda: _synth(32, 3), net=lambda d: _mlp([20, 256, 256, 3]),
       title="3-class synthetic classification, 300 rows, MLP, AdamW, cosine: dropout x weight decay"),
    # --- the second held-out set (committed with its grids before any search ran on it; see HELD_OUT)
    _c({"dropout": (0.0, 0.2, 0.4, 0.6)}, late=True,
       name="k_synth5_dropout", family="tabular", optim="adamw", sched="onecycle", steps=800, batch=32,
       center=1e-3, data=lambda: _synth(33, 5), net=lambda d: _mlp([20, 384, 384, 5]),
       title="5-class synthetic classification, 300 rows, MLP 20-384-384-5, AdamW, OneCycle, 800 steps"),
    _c({"label_smoothing": (0.0, 0.05, 0.15, 0.3)},
       name="k_digits_cnn_ls", family="cnn", optim="sgd", sched="cosine", steps=400, batch=32,
       center=3e-2, data=lambda: _digits_small(700, "image"), net=lambda d: _cnn(),
       title="digits, 700 training images, CNN, SGD + momentum, cosine, label smoothing"),
    _c({"weight_decay": (0.0, 0.1, 1.0, 10.0)}, late=True,
       name="k_friedman_wd", family="tabular", optim="adamw", sched="cosine", steps=1000, batch=32,
       center=1e-3, data=lambda: _friedman_small(23), net=lambda d: _mlp([10, 256, 256, 1]), kind="reg",
       title="Friedman #1 regression (another draw), 200 rows, MLP 10-256-256-1, AdamW, cosine, 1,000 steps"),
    _c({"dropout": (0.0, 0.3, 0.6), "label_smoothing": (0.0, 0.1, 0.3)}, late=True,
       name="k_digits250_dropout_ls", family="mlp", optim="adam", sched="linear", steps=600, batch=32,
       center=1e-3, data=lambda: _digits_small(250), net=lambda d: _mlp([64, 512, 512, 10]),
       title="digits, 250 training rows, wide MLP, Adam, warm-up + linear decay: dropout x label smoothing"),
    _c({"dropout": (0.0, 0.2, 0.4), "weight_decay": (0.0, 0.1, 1.0)}, late=True,
       name="k_char_tf_dropout_wd", family="transformer", optim="adamw", sched="cosine", steps=400, batch=16,
       center=3e-3, data=lambda: _chars_small(32, 40_000), net=lambda d: _TinyLM(d["classes"], 32),
       title="char transformer LM (2 layers, d 32), 40,000 characters, AdamW, cosine: dropout x decay"),
    # --- the third held-out set (committed with its grids before any search ran on it; see HELD_OUT)
    _c({"weight_decay": (0.0, 5e-4, 5e-3, 5e-2)}, late=True,
       name="k_synth6_sgd_wd", family="tabular", optim="sgd", sched="cosine", steps=1000, batch=32,
       center=3e-2, data=lambda: _synth(34, 6), net=lambda d: _mlp([20, 384, 384, 6]),
       title="6-class synthetic classification, 300 rows, MLP 20-384-384-6, SGD + momentum (L2), cosine"),
    _c({"dropout": (0.0, 0.2, 0.4, 0.6)}, late=True,
       name="k_digits_cnn_dropout", family="cnn", optim="adam", sched="onecycle", steps=500, batch=32,
       center=1e-3, data=lambda: _digits_small(300, "image"), net=lambda d: _cnn(),
       title="digits, 300 training images, CNN with dropout, Adam, OneCycle, 500 steps"),
    _c({"label_smoothing": (0.0, 0.05, 0.15, 0.3)},
       name="k_char_gru_ls", family="rnn", optim="adam", sched="cosine", steps=400, batch=16,
       center=3e-3, data=lambda: _chars_small(32, 400_000), net=lambda d: _GruLM(d["classes"], hidden=96),
       title="char GRU LM (hidden 96) on 400,000 characters, Adam, cosine, label smoothing"),
    _c({"dropout": (0.0, 0.3, 0.6), "label_smoothing": (0.0, 0.1, 0.3)}, late=True,
       name="k_moons_dropout_ls", family="tabular", optim="adamw", sched="linear", steps=1500, batch=32,
       center=3e-3, data=_moons_small, net=lambda d: _mlp([2, 256, 256, 2]),
       title="two moons, 150 rows, MLP 2-256-256-2, AdamW, warm-up + linear: dropout x label smoothing"),
    _c({"dropout": (0.0, 0.2, 0.4), "weight_decay": (0.0, 0.3, 3.0)}, late=True,
       name="k_friedman_dropout_wd", family="tabular", optim="adamw", sched="onecycle", steps=800, batch=32,
       center=1e-3, data=lambda: _friedman_small(25), net=lambda d: _mlp([10, 256, 256, 1]), kind="reg",
       title="Friedman #1 regression (a third draw), 200 rows, MLP, AdamW, OneCycle: dropout x weight decay"),
]}

# Held out: kept out of every design decision of the search; committed with their grids before any
# search ran on any task of this suite. Five of fifteen: an MLP with dropout under SGD (small data),
# a GRU LM with dropout (small text), a regression with decoupled weight decay, an LSTM classifier
# with label smoothing, a 3-D grid of dropout x weight decay.
FIRST_HELD_OUT: tuple[str, ...] = ("k_digits400_dropout_sgd", "k_char_gru_dropout", "k_diabetes_wd",
                                   "k_digits_rows_ls", "k_synth_dropout_wd")

# The second held-out set: five set-ups committed with their grids (2026-11-29) before any search ran on
# them, when the first set's cell-by-cell reading had informed the next design (docs/method.md, "Knobs
# that pay late"): a tabular MLP with dropout under OneCycle, a CNN with label smoothing, a regression
# with decoupled weight decay, and two 3-D grids (dropout x label smoothing on a small-data MLP, dropout
# x weight decay on a char transformer).
SECOND_HELD_OUT: tuple[str, ...] = ("k_synth5_dropout", "k_digits_cnn_ls", "k_friedman_wd",
                                    "k_digits250_dropout_ls", "k_char_tf_dropout_wd")

# The third held-out set: five set-ups committed with their grids (2026-11-29) before any search ran on
# them, when the second set had been read once and a next design was about to be measured (docs/method.md,
# "A ladder of lower forks"): a tabular MLP with coupled L2 under SGD, a CNN with dropout under OneCycle,
# a GRU LM with label smoothing, and two 3-D grids (dropout x label smoothing on two moons, dropout x
# weight decay on a regression under OneCycle).
THIRD_HELD_OUT: tuple[str, ...] = ("k_synth6_sgd_wd", "k_digits_cnn_dropout", "k_char_gru_ls",
                                   "k_moons_dropout_ls", "k_friedman_dropout_wd")

HELD_OUT: tuple[str, ...] = FIRST_HELD_OUT + SECOND_HELD_OUT + THIRD_HELD_OUT


def get_task(name: str) -> CoTask:
    if name not in TASKS:
        raise SystemExit(f"unknown task {name!r} (tasks: {', '.join(TASKS)})")
    return TASKS[name]
