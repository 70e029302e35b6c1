"""The learning-rate suite's tasks: one registry, each task a training set-up as a user writes it.

A task owns its data (a fixed train / probe / validation split that does not depend on the run's
seed), its model, its optimizer (built with the run's peak learning rate) and its torch
scheduler. The run's seed sets the initial weights and the batch order only. Everything ships
with installed packages: scikit-learn's bundled sets, CPython's ``pydoc_data.topics`` text,
synthetic data drawn from fixed generators, and a BERT-style encoder built from a
``transformers`` config (no weights are loaded). Nothing is downloaded.

The tasks span the families a user brings (MLP, CNN with and without BatchNorm, a transformer
LM, a transformer classifier, a BERT-style encoder, GRU and LSTM, small tabular regression and
classification with strong dropout, a long synthetic run), the three common optimizers (SGD with
momentum, Adam, AdamW) and five schedules (OneCycleLR with its momentum cycle, warm-up + cosine,
a long warm-up (25% of the run) + cosine, warm-up + linear decay, step decay), with runs from 100 to
3,000 steps.

``HELD_OUT`` names the tasks kept out of every design decision of the search (see
``docs/benchmarks.md``, "The learning-rate suite"): the search is designed on the others and the
acceptance tables report the two sets apart.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import cache
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.optim.lr_scheduler import LambdaLR, LRScheduler, MultiStepLR, OneCycleLR

__all__ = ["HELD_OUT", "NINTH", "STAGED", "TASKS", "Task", "get_task"]

Batch = tuple[torch.Tensor, torch.Tensor]


# ----------------------------------------------------------------------------- the task shape


@dataclass(frozen=True)
class Task:
    """One set-up: data, model, optimizer and schedule, as a user would write them.

    ``center`` is the middle of the task's grid of peak learning rates (the grid is
    half-decade spaced around it); ``kind`` is ``"cls"`` (cross-entropy) or ``"reg"`` (mean
    squared error on standardised targets). ``sched`` warms up over the first 5% of the steps
    ("cosine", "linear"), over the first 25% ("warmcos": linear from ~0 to the peak, then cosine
    to 0), over the first 30% ("onecycle", torch's OneCycleLR defaults), or not at all ("step").
    """

    name: str
    family: str
    optim: str           # "sgd" (momentum 0.9), "adam" or "adamw"
    sched: str           # "onecycle", "cosine" (warm-up + cosine), "warmcos" (25% warm-up + cosine),
                         # "linear" (warm-up + linear), "step"
    steps: int
    batch: int
    center: float
    data: Callable[[], dict[str, Any]]
    net: Callable[[dict[str, Any]], nn.Module]
    kind: str = "cls"
    weight_decay: float = 0.0
    title: str = ""

    # --- the user's set-up -------------------------------------------------------------------

    def model(self, seed: int) -> nn.Module:
        """The model, its initial weights drawn from ``seed`` (the global RNG is left as it was)."""
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return self.net(self.data())

    def optimizer(self, model: nn.Module, lr: float) -> torch.optim.Optimizer:
        """The optimizer at peak learning rate ``lr``; no weight decay on biases and norms."""
        decay = [p for p in model.parameters() if p.dim() >= 2]
        rest = [p for p in model.parameters() if p.dim() < 2]
        groups = [{"params": decay, "weight_decay": self.weight_decay},
                  {"params": rest, "weight_decay": 0.0}]
        if self.optim == "sgd":
            return torch.optim.SGD(groups, lr=lr, momentum=0.9)
        if self.optim == "adam":
            return torch.optim.Adam(groups, lr=lr)
        if self.optim == "adamw":
            return torch.optim.AdamW(groups, lr=lr)
        raise ValueError(f"unknown optimizer {self.optim!r}")

    def scheduler(self, opt: torch.optim.Optimizer) -> LRScheduler:
        """The task's torch scheduler on ``opt`` (built at the peak lr), stepped once per step."""
        n = self.steps
        if self.sched == "onecycle":  # torch's defaults: 30% warm-up, cosine, momentum 0.95 <-> 0.85
            return OneCycleLR(opt, max_lr=[g["lr"] for g in opt.param_groups], total_steps=n)
        warm = max(1, round(0.05 * n))
        if self.sched == "cosine":
            return LambdaLR(opt, lambda t: (t + 1) / warm if t < warm
                            else 0.5 * (1 + math.cos(math.pi * min(1.0, (t - warm) / (n - warm)))))
        if self.sched == "linear":
            return LambdaLR(opt, lambda t: (t + 1) / warm if t < warm
                            else max(0.0, (n - t) / (n - warm)))
        if self.sched == "warmcos":  # a long linear warm-up (25% of the run), then cosine to 0
            ramp = max(1, round(0.25 * n))
            return LambdaLR(opt, lambda t: (t + 1) / ramp if t < ramp
                            else 0.5 * (1 + math.cos(math.pi * min(1.0, (t - ramp) / (n - ramp)))))
        if self.sched == "step":  # no warm-up; x0.1 at half and at three quarters of the run
            return MultiStepLR(opt, milestones=[n // 2, (3 * n) // 4], gamma=0.1)
        raise ValueError(f"unknown schedule {self.sched!r}")

    def loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        """The training (and probe) loss: cross-entropy or mean squared error."""
        x, y = batch
        out = model(x)
        if self.kind == "reg":
            return F.mse_loss(out.squeeze(-1), y)
        return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))

    def sample(self, gen: torch.Generator) -> Batch:
        """A training batch of ``batch`` examples drawn with replacement by ``gen``."""
        d = self.data()
        if "stream" in d:  # a text: random windows
            return _windows(d["stream"], self.batch, d["ctx"], gen)
        x, y = d["train"]
        idx = torch.randint(0, len(y), (self.batch,), generator=gen)
        return x[idx], y[idx]

    def train_sample(self, n: int = 2000) -> list[Batch]:
        """A fixed sample of at most ``n`` units of the training split, in batches of 500 (a language
        model's: ``n / 8`` random windows of its context), from a generator of its own."""
        d = self.data()
        g = torch.Generator().manual_seed(4242)
        if "stream" in d:
            return [_windows(d["stream"], n // 8, d["ctx"], g)]
        x, y = d["train"]
        idx = torch.randperm(len(y), generator=g)[:n]
        return [(x[idx[i:i + 500]], y[idx[i:i + 500]]) for i in range(0, len(idx), 500)]

    def probe(self) -> list[Batch]:
        """Held-out batches carved from the training side (what the search may score on)."""
        return self.data()["probe"]

    @torch.no_grad()
    def evaluate(self, model: nn.Module, batches: list[Batch] | None = None) -> float:
        """The validation loss, in eval mode (the quantity every table compares); on ``batches``
        instead of the validation split when given."""
        was = model.training
        model.eval()
        tot, n = 0.0, 0
        for x, y in self.data()["val"] if batches is None else batches:
            out = model(x)
            if self.kind == "reg":
                tot += float(F.mse_loss(out.squeeze(-1), y, reduction="sum"))
            else:
                tot += float(F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1), reduction="sum"))
            n += y.numel()
        model.train(was)
        return tot / n

    def constant_loss(self) -> float:
        """The validation loss of the best constant prediction from the training labels (the
        class frequencies, or the mean target): a run that ends here learned nothing."""
        d = self.data()
        ys = torch.cat([y.reshape(-1) for _, y in d["val"]])
        train_y = d["stream"][1:] if "stream" in d else d["train"][1].reshape(-1)
        if self.kind == "reg":
            return float(((ys - train_y.float().mean()) ** 2).mean())
        k = d["classes"]
        freq = torch.bincount(train_y, minlength=k).double() + 1.0
        logp = (freq / freq.sum()).log()
        return float(-logp[ys].mean())

    def grid(self, lo: int = -4, hi: int = 4) -> list[float]:
        """Peak learning rates ``center * 10**(k/2)`` for ``k`` in ``lo..hi`` (half-decade steps)."""
        return [self.center * 10 ** (k / 2) for k in range(lo, hi + 1)]


def _windows(ids: torch.Tensor, n: int, ctx: int, gen: torch.Generator) -> Batch:
    start = torch.randint(0, len(ids) - ctx - 1, (n,), generator=gen)
    w = ids[start[:, None] + torch.arange(ctx + 1)]
    return w[:, :-1], w[:, 1:]


def _split(x: torch.Tensor, y: torch.Tensor, probe: int, val: int, seed: int = 1234,
           probe_batch: int = 100) -> dict[str, Any]:
    """A fixed shuffle: the last ``val`` rows validate, the ``probe`` before them are the probe
    (in batches of ``probe_batch``), the rest train."""
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    x, y = x[perm], y[perm]
    tr = len(y) - probe - val
    px, py = x[tr:tr + probe], y[tr:tr + probe]
    return {"train": (x[:tr], y[:tr]),
            "probe": [(px[i:i + probe_batch], py[i:i + probe_batch]) for i in range(0, probe, probe_batch)],
            "val": [(x[tr + probe:], y[tr + probe:])]}


# ----------------------------------------------------------------------------- data


@cache
def _digits(form: str, noise: float = 0.0, probe: int = 200) -> dict[str, Any]:
    """scikit-learn's digits (1,797 images, 8x8): 1,097 train, 200 probe, 500 validation (with a
    larger ``probe``, its rows come out of the training ones: the validation rows stay the same).
    ``form``: "flat" (64 features), "image" (1x8x8, standardised) or "rows" (8 rows of 8).
    ``noise``: the share of train and probe labels replaced by a random class (fixed draw);
    validation labels stay clean."""
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    x = torch.tensor(x / 16.0, dtype=torch.float32)
    y = torch.tensor(y, dtype=torch.long)
    if form == "image":
        x = (x.reshape(-1, 1, 8, 8) - 0.3) / 0.4
    elif form == "rows":
        x = (x.reshape(-1, 8, 8) - 0.3) / 0.4
    d = _split(x, y, probe=probe, val=500)
    if noise:
        g = torch.Generator().manual_seed(4321)
        ty = d["train"][1].clone()
        flip = torch.rand(len(ty), generator=g) < noise
        ty[flip] = torch.randint(0, 10, (int(flip.sum()),), generator=g)
        d["train"] = (d["train"][0], ty)
        probe = []
        for px, py in d["probe"]:
            py = py.clone()
            f = torch.rand(len(py), generator=g) < noise
            py[f] = torch.randint(0, 10, (int(f.sum()),), generator=g)
            probe.append((px, py))
        d["probe"] = probe
    return {**d, "classes": 10}


def _tabular(loader: str, probe: int, val: int, reg: bool, **kw: Any) -> dict[str, Any]:
    """scikit-learn's ``loader`` (a bundled set, or a generator called with ``kw``), standardised on
    the training rows."""
    import sklearn.datasets as ds

    x, y = getattr(ds, loader)(**kw) if kw else getattr(ds, loader)(return_X_y=True)
    x = torch.tensor(x, dtype=torch.float32)
    y = torch.tensor(y, dtype=torch.float32 if reg else torch.long)
    d = _split(x, y, probe=probe, val=val)
    tx, ty = d["train"]
    mean, std = tx.mean(0), tx.std(0).clamp_min(1e-6)

    def fx(a):
        return (a - mean) / std

    if reg:
        ym, ys = ty.mean(), ty.std()

        def fy(b):
            return (b - ym) / ys
    else:
        def fy(b):
            return b
    return {"train": (fx(tx), fy(ty)), "probe": [(fx(a), fy(b)) for a, b in d["probe"]],
            "val": [(fx(a), fy(b)) for a, b in d["val"]], "classes": 0 if reg else int(y.max()) + 1}


@cache
def _cancer() -> dict[str, Any]:
    """Breast cancer (569 rows, 30 features, 2 classes): 369 train, 100 probe, 100 validation."""
    return _tabular("load_breast_cancer", probe=100, val=100, reg=False)


@cache
def _diabetes() -> dict[str, Any]:
    """Diabetes (442 rows, 10 features, a standardised target): 282 train, 60 probe, 100 validation."""
    return _tabular("load_diabetes", probe=60, val=100, reg=True)


@cache
def _wine() -> dict[str, Any]:
    """Wine (178 rows, 13 features, 3 classes): 98 train, 30 probe, 50 validation."""
    return _tabular("load_wine", probe=30, val=50, reg=False)


@cache
def _iris() -> dict[str, Any]:
    """Iris (150 rows, 4 features, 3 classes): 70 train, 30 probe, 50 validation."""
    return _tabular("load_iris", probe=30, val=50, reg=False)


@cache
def _moons() -> dict[str, Any]:
    """Two interleaved half-moons with noise 0.3 (scikit-learn's generator, fixed seed; 2 features):
    200 train, 100 probe, 200 validation rows."""
    return _tabular("make_moons", probe=100, val=200, reg=False, n_samples=500, noise=0.3, random_state=3)


@cache
def _friedman() -> dict[str, Any]:
    """Friedman's regression problem #1 (scikit-learn's generator, fixed seed; 10 features, 5 of them
    noise, noise sd 1): 300 train, 100 probe, 200 validation rows."""
    return _tabular("make_friedman1", probe=100, val=200, reg=True, n_samples=600, noise=1.0, random_state=4)


@cache
def _blobs() -> dict[str, Any]:
    """Three classes from scikit-learn's ``make_classification`` (fixed seed; 20 features, 6 of them
    informative, 5% of labels flipped): 300 train, 150 probe, 250 validation rows."""
    return _tabular("make_classification", probe=150, val=250, reg=False, n_samples=700, n_features=20,
                    n_informative=6, n_redundant=4, n_classes=3, flip_y=0.05, random_state=8)


@cache
def _sparse() -> dict[str, Any]:
    """scikit-learn's ``make_regression`` (fixed seed; 30 features, 8 of them informative, noise sd 30):
    300 train, 100 probe, 200 validation rows."""
    return _tabular("make_regression", probe=100, val=200, reg=True, n_samples=600, n_features=30,
                    n_informative=8, noise=30.0, random_state=6)


@cache
def _mixture() -> dict[str, Any]:
    """Four classes from scikit-learn's ``make_classification`` (fixed seed; 16 features, 6 of them
    informative, 5% of labels flipped): 500 train, 300 probe, 500 validation rows."""
    return _tabular("make_classification", probe=300, val=500, reg=False, n_samples=1300, n_features=16,
                    n_informative=6, n_redundant=2, n_classes=4, flip_y=0.05, random_state=12)


@cache
def _friedman_wide() -> dict[str, Any]:
    """Friedman's regression problem #1 again (another fixed seed, more rows; noise sd 1): 600 train,
    300 probe, 500 validation rows."""
    return _tabular("make_friedman1", probe=300, val=500, reg=True, n_samples=1400, noise=1.0,
                    random_state=14)


@cache
def _teacher() -> dict[str, Any]:
    """A fixed random 2-layer tanh network of 16 inputs, plus noise (SNR 4): 4,000 train, 400 probe,
    1,000 validation rows."""
    g = torch.Generator().manual_seed(7)
    n = 5400
    x = torch.randn(n, 16, generator=g)
    w1, w2 = torch.randn(16, 32, generator=g) / 4, torch.randn(32, generator=g) / math.sqrt(32)
    f = torch.tanh(x @ w1 * 2) @ w2
    y = f + 0.5 * f.std() * torch.randn(n, generator=g)
    y = (y - y.mean()) / y.std()
    return {**_split(x, y, probe=400, val=1000, probe_batch=200), "classes": 0}


@cache
def _clusters() -> dict[str, Any]:
    """Five classes of Gaussian clusters (3 per class) in 20 dimensions, 10 of them noise: 4,000
    train, 400 probe, 1,000 validation rows."""
    g = torch.Generator().manual_seed(11)
    n, k, per = 5400, 5, 3
    centers = torch.randn(k * per, 10, generator=g) * 1.2
    comp = torch.randint(0, k * per, (n,), generator=g)
    x = torch.cat([centers[comp] + torch.randn(n, 10, generator=g),
                   torch.randn(n, 10, generator=g)], 1)
    y = comp % k
    return {**_split(x, y, probe=400, val=1000, probe_batch=200), "classes": k}


@cache
def _text() -> tuple[torch.Tensor, int]:
    from pydoc_data.topics import topics

    text = "".join(topics[k] for k in sorted(topics))
    chars = sorted(set(text))
    index = {c: i for i, c in enumerate(chars)}
    return torch.tensor([index[c] for c in text], dtype=torch.long), len(chars)


@cache
def _chars(ctx: int, probe: int, val: int) -> dict[str, Any]:
    """CPython's pydoc topics text: the first 90% trains (random windows of ``ctx``), fixed windows
    from the next 5% probe and from the last 5% validate."""
    ids, vocab = _text()
    n = len(ids)
    a, b = int(0.9 * n), int(0.95 * n)
    g = torch.Generator().manual_seed(99)
    return {"stream": ids[:a], "ctx": ctx, "classes": vocab,
            "probe": [_windows(ids[a:b], probe, ctx, g)],
            "val": [_windows(ids[b:], val, ctx, g) for _ in range(2)]}


@cache
def _ngrams(ctx: int) -> dict[str, Any]:
    """The same text as (previous ``ctx`` characters -> next character) pairs."""
    ids, vocab = _text()
    n = len(ids)
    a, b = int(0.9 * n), int(0.95 * n)
    g = torch.Generator().manual_seed(98)

    def pairs(part: torch.Tensor, m: int) -> Batch:
        start = torch.randint(0, len(part) - ctx - 1, (m,), generator=g)
        w = part[start[:, None] + torch.arange(ctx + 1)]
        return w[:, :-1], w[:, -1]

    train_x, train_y = pairs(ids[:a], 60_000)
    return {"train": (train_x, train_y), "classes": vocab,
            "probe": [pairs(ids[a:b], 500)], "val": [pairs(ids[b:], 2000)]}


@cache
def _majority() -> dict[str, Any]:
    """Synthetic token sequences (vocabulary 40, length 24; the first 2 ids are [CLS] and padding):
    the label says which of two marker tokens occurs more often; other tokens are distractors.
    3,000 train, 256 probe, 1,000 validation sequences."""
    g = torch.Generator().manual_seed(5)
    n, length, vocab = 4256, 24, 40
    x = torch.randint(4, vocab, (n, length), generator=g)
    a = torch.randint(1, 7, (n,), generator=g)
    b = torch.randint(1, 7, (n,), generator=g)
    b = torch.where(a == b, b % 6 + 1, b)
    for i in range(n):  # place a markers 2, b markers 3 at random positions after [CLS]
        pos = torch.randperm(length - 1, generator=g)[: int(a[i]) + int(b[i])] + 1
        x[i, pos[: int(a[i])]] = 2
        x[i, pos[int(a[i]):]] = 3
    x[:, 0] = 0
    y = (a > b).long()
    return {**_split(x, y, probe=256, val=1000, probe_batch=128), "classes": 2}


# ----------------------------------------------------------------------------- models


def _mlp(sizes: list[int], dropout: float = 0.0, norm: bool = False) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i in range(len(sizes) - 2):
        layers += [nn.Linear(sizes[i], sizes[i + 1])]
        if norm:
            layers += [nn.LayerNorm(sizes[i + 1])]
        layers += [nn.ReLU()]
        if dropout:
            layers += [nn.Dropout(dropout)]
    layers += [nn.Linear(sizes[-2], sizes[-1])]
    return nn.Sequential(*layers)


def _cnn(bn: bool) -> nn.Sequential:
    def norm(c: int) -> nn.Module:
        return nn.BatchNorm2d(c) if bn else nn.Identity()

    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1), norm(16), nn.ReLU(),
        nn.Conv2d(16, 32, 3, padding=1), norm(32), nn.ReLU(),
        nn.MaxPool2d(2), nn.Flatten(), nn.Linear(32 * 16, 10))


class _Recurrent(nn.Module):
    """A GRU or LSTM over a sequence; ``lm``: a next-token head at every position (token ids in),
    else a class head on the last state (feature vectors in)."""

    def __init__(self, cell: str, inp: int, hidden: int, out: int, vocab: int = 0) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, inp) if vocab else None
        self.rnn = (nn.GRU if cell == "gru" else nn.LSTM)(inp, hidden, batch_first=True)
        self.head = nn.Linear(hidden, out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, _ = self.rnn(self.embed(x) if self.embed is not None else x)
        return self.head(h) if self.embed is not None else self.head(h[:, -1])


class _CausalLM(nn.Module):
    """A pre-norm causal transformer built from ``nn.TransformerEncoder`` with a causal mask buffer."""

    def __init__(self, vocab: int, ctx: int, d: int = 48, layers: int = 2, heads: int = 4) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(ctx, d)
        layer = nn.TransformerEncoderLayer(d, heads, 4 * d, dropout=0.1, batch_first=True, norm_first=True)
        self.body = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, vocab)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(ctx), persistent=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        return self.head(self.ln(self.body(x, mask=self.mask[:t, :t], is_causal=True)))


class _RowTransformer(nn.Module):
    """A transformer classifier over a digit's 8 rows as tokens (mean-pooled)."""

    def __init__(self, d: int = 32) -> None:
        super().__init__()
        self.inp = nn.Linear(8, d)
        self.pos = nn.Parameter(torch.zeros(8, d))
        layer = nn.TransformerEncoderLayer(d, 4, 2 * d, dropout=0.1, batch_first=True, norm_first=True)
        self.body = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(d, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.inp(x) + self.pos).mean(1))


class _NgramMLP(nn.Module):
    """A character MLP language model: the previous characters' embeddings, concatenated."""

    def __init__(self, vocab: int, ctx: int, d: int = 16, hidden: int = 128) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.mlp = nn.Sequential(nn.Linear(ctx * d, hidden), nn.Tanh(), nn.Linear(hidden, vocab))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.embed(x).flatten(1))


class _Bert(nn.Module):
    """``BertForSequenceClassification`` from a tiny config (no weights loaded); logits out."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import BertConfig, BertForSequenceClassification

        cfg = BertConfig(vocab_size=40, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                         intermediate_size=64, max_position_embeddings=32, num_labels=2, pad_token_id=1)
        self.bert = BertForSequenceClassification(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bert(input_ids=x).logits


# ----------------------------------------------------------------------------- the registry


def _t(**kw: Any) -> Task:
    return Task(**kw)


TASKS: dict[str, Task] = {t.name: t for t in [
    _t(name="digits_mlp", family="mlp", optim="sgd", sched="onecycle", steps=600, batch=64, center=0.1,
       data=lambda: _digits("flat"), net=lambda d: _mlp([64, 128, 10]), weight_decay=5e-4,
       title="digits MLP 64-128-10"),
    _t(name="digits_cnn_bn", family="cnn", optim="adamw", sched="onecycle", steps=500, batch=64, center=1e-2,
       data=lambda: _digits("image"), net=lambda d: _cnn(bn=True), weight_decay=0.05,
       title="digits CNN with BatchNorm"),
    _t(name="digits_cnn", family="cnn", optim="sgd", sched="cosine", steps=500, batch=64, center=3e-2,
       data=lambda: _digits("image"), net=lambda d: _cnn(bn=False), weight_decay=5e-4,
       title="digits CNN, no normalisation"),
    _t(name="char_transformer", family="transformer", optim="adamw", sched="cosine", steps=300, batch=16,
       center=3e-3, data=lambda: _chars(64, 64, 128), net=lambda d: _CausalLM(d["classes"], 64),
       weight_decay=0.1, title="char transformer LM (2 layers, d 48, causal mask buffer), pydoc text"),
    _t(name="char_gru", family="rnn", optim="sgd", sched="step", steps=800, batch=16, center=0.3,
       data=lambda: _chars(32, 128, 256), net=lambda d: _Recurrent("gru", 32, 96, d["classes"], d["classes"]),
       title="char GRU LM (hidden 96), pydoc text"),
    _t(name="cancer_dropout", family="tabular", optim="adamw", sched="onecycle", steps=1800, batch=32,
       center=1e-3, data=_cancer, net=lambda d: _mlp([30, 128, 128, 2], dropout=0.5), weight_decay=0.01,
       title="breast-cancer MLP, dropout 0.5 (369 rows)"),
    _t(name="bert_tiny", family="transformer", optim="adamw", sched="linear", steps=150, batch=32,
       center=1e-3, data=_majority, net=lambda d: _Bert(), weight_decay=0.01,
       title="BERT-style encoder from a transformers config (2 layers, d 32), synthetic tokens"),
    _t(name="wine_short", family="mlp", optim="sgd", sched="onecycle", steps=100, batch=16, center=0.03,
       data=_wine, net=lambda d: _mlp([13, 64, 3]), weight_decay=5e-4, title="wine MLP, 100 steps (98 rows)"),
    _t(name="teacher_long", family="mlp", optim="adam", sched="cosine", steps=3000, batch=32, center=1e-3,
       data=_teacher, net=lambda d: _mlp([16, 64, 64, 1]), kind="reg",
       title="regression on a random teacher network, 3,000 steps"),
    _t(name="digits_noisy", family="mlp", optim="sgd", sched="cosine", steps=800, batch=64, center=0.1,
       data=lambda: _digits("flat", noise=0.3), net=lambda d: _mlp([64, 256, 10]), weight_decay=5e-4,
       title="digits MLP, 30% of training labels random"),
    _t(name="char_mlp", family="mlp", optim="adam", sched="step", steps=1000, batch=64, center=3e-3,
       data=lambda: _ngrams(8), net=lambda d: _NgramMLP(d["classes"], 8),
       title="char n-gram MLP LM (8 chars)"),
    # held out (see HELD_OUT)
    _t(name="digits_lstm", family="rnn", optim="adam", sched="onecycle", steps=600, batch=64, center=3e-3,
       data=lambda: _digits("rows"), net=lambda d: _Recurrent("lstm", 8, 64, 10),
       title="LSTM over a digit's rows"),
    _t(name="diabetes_dropout", family="tabular", optim="adam", sched="linear", steps=1500, batch=32,
       center=1e-3, data=_diabetes, net=lambda d: _mlp([10, 128, 128, 1], dropout=0.5), kind="reg",
       title="diabetes regression MLP, dropout 0.5 (282 rows)"),
    _t(name="digits_rows_transformer", family="transformer", optim="adamw", sched="onecycle", steps=500,
       batch=64, center=3e-3, data=lambda: _digits("rows"), net=lambda d: _RowTransformer(),
       weight_decay=0.05,
       title="transformer classifier over a digit's 8 rows"),
    _t(name="clusters_long", family="mlp", optim="adamw", sched="linear", steps=3000, batch=32, center=1e-3,
       data=_clusters, net=lambda d: _mlp([20, 64, 64, 5], norm=True), weight_decay=0.01,
       title="Gaussian clusters, MLP with LayerNorm, 3,000 steps"),
    # the second held-out set (see HELD_OUT), added when the first had informed a design
    _t(name="wine_dropout", family="tabular", optim="adamw", sched="onecycle", steps=1200, batch=16,
       center=1e-3, data=_wine, net=lambda d: _mlp([13, 128, 128, 3], dropout=0.5), weight_decay=0.01,
       title="wine MLP, dropout 0.5 (98 rows), 1,200 steps"),
    _t(name="digits_cnn_bn_sgd", family="cnn", optim="sgd", sched="step", steps=400, batch=32, center=3e-2,
       data=lambda: _digits("image"), net=lambda d: _cnn(bn=True), weight_decay=5e-4,
       title="digits CNN with BatchNorm, SGD, step decay"),
    _t(name="char_lstm", family="rnn", optim="adam", sched="cosine", steps=600, batch=16, center=3e-3,
       data=lambda: _chars(32, 128, 256),
       net=lambda d: _Recurrent("lstm", 32, 96, d["classes"], d["classes"]),
       title="char LSTM LM (hidden 96), pydoc text"),
    _t(name="char_transformer_sgd", family="transformer", optim="sgd", sched="onecycle", steps=300, batch=16,
       center=0.1, data=lambda: _chars(64, 64, 128), net=lambda d: _CausalLM(d["classes"], 64),
       title="char transformer LM under SGD + momentum, OneCycle"),
    _t(name="diabetes_short", family="tabular", optim="sgd", sched="onecycle", steps=120, batch=32,
       center=1e-2, data=_diabetes, net=lambda d: _mlp([10, 64, 1]), kind="reg",
       title="diabetes regression MLP, 120 steps"),
    _t(name="iris_short", family="mlp", optim="sgd", sched="cosine", steps=80, batch=16, center=3e-2,
       data=_iris, net=lambda d: _mlp([4, 32, 3]), title="iris MLP, 80 steps (70 rows)"),
    _t(name="digits_mlp_adam_long", family="mlp", optim="adam", sched="linear", steps=3000, batch=32,
       center=1e-3, data=lambda: _digits("flat"), net=lambda d: _mlp([64, 128, 10]),
       title="digits MLP under Adam, 3,000 steps"),
    _t(name="teacher_sgd", family="mlp", optim="sgd", sched="cosine", steps=1500, batch=32, center=3e-2,
       data=_teacher, net=lambda d: _mlp([16, 64, 64, 1]), kind="reg",
       title="regression on a random teacher network under SGD + momentum"),
    # the third held-out set (see HELD_OUT), added when the second had informed a design
    _t(name="moons_dropout", family="tabular", optim="adamw", sched="onecycle", steps=1000, batch=32,
       center=3e-3, data=_moons, net=lambda d: _mlp([2, 128, 128, 2], dropout=0.3), weight_decay=0.01,
       title="two moons MLP, dropout 0.3 (200 rows), 1,000 steps"),
    _t(name="digits_cnn_adam", family="cnn", optim="adam", sched="linear", steps=400, batch=32, center=1e-3,
       data=lambda: _digits("image"), net=lambda d: _cnn(bn=False),
       title="digits CNN, no normalisation, Adam, warm-up + linear decay"),
    _t(name="friedman_short", family="tabular", optim="sgd", sched="step", steps=150, batch=32, center=1e-2,
       data=_friedman, net=lambda d: _mlp([10, 64, 64, 1]), kind="reg",
       title="Friedman #1 regression MLP under SGD, step decay, 150 steps (300 rows)"),
    _t(name="char_gru_adamw", family="rnn", optim="adamw", sched="cosine", steps=400, batch=16, center=3e-3,
       data=lambda: _chars(32, 128, 256), net=lambda d: _Recurrent("gru", 32, 96, d["classes"], d["classes"]),
       weight_decay=0.01, title="char GRU LM (hidden 96) under AdamW, warm-up + cosine, pydoc text"),
    # the fourth held-out set (see HELD_OUT), added when four of the third had been read
    _t(name="blobs_dropout", family="tabular", optim="adam", sched="cosine", steps=800, batch=32, center=1e-3,
       data=_blobs, net=lambda d: _mlp([20, 128, 128, 3], dropout=0.4),
       title="3-class synthetic classification MLP, dropout 0.4 (300 rows), Adam, warm-up + cosine"),
    _t(name="digits_cnn_bn_adam", family="cnn", optim="adam", sched="step", steps=400, batch=32, center=3e-3,
       data=lambda: _digits("image"), net=lambda d: _cnn(bn=True),
       title="digits CNN with BatchNorm under Adam, step decay"),
    _t(name="char_transformer_adam", family="transformer", optim="adam", sched="linear", steps=500, batch=16,
       center=3e-3, data=lambda: _chars(32, 128, 256), net=lambda d: _CausalLM(d["classes"], 32),
       title="char transformer LM (context 32) under Adam, warm-up + linear decay, pydoc text"),
    _t(name="digits_gru_sgd", family="rnn", optim="sgd", sched="linear", steps=500, batch=32, center=0.1,
       data=lambda: _digits("rows"), net=lambda d: _Recurrent("gru", 8, 64, 10),
       title="GRU over a digit's rows under SGD + momentum, warm-up + linear decay"),
    _t(name="sparse_dropout", family="tabular", optim="adamw", sched="onecycle", steps=1200, batch=32,
       center=1e-3, data=_sparse, net=lambda d: _mlp([30, 128, 128, 1], dropout=0.3), kind="reg",
       weight_decay=0.01, title="sparse linear regression MLP, dropout 0.3 (300 rows), AdamW, OneCycle"),
    # the fifth held-out set (see HELD_OUT), added to widen the held-out evidence, not to replace tasks
    _t(name="digits_cnn_adamw", family="cnn", optim="adamw", sched="onecycle", steps=400, batch=64,
       center=3e-3, data=lambda: _digits("image"), net=lambda d: _cnn(bn=False), weight_decay=0.05,
       title="digits CNN, no normalisation, AdamW, OneCycle"),
    _t(name="cancer_sgd", family="tabular", optim="sgd", sched="cosine", steps=600, batch=32, center=1e-2,
       data=_cancer, net=lambda d: _mlp([30, 64, 64, 2], dropout=0.3), weight_decay=5e-4,
       title="breast-cancer MLP, dropout 0.3 (369 rows), SGD + momentum, warm-up + cosine"),
    _t(name="char_lstm_sgd", family="rnn", optim="sgd", sched="onecycle", steps=500, batch=16, center=0.3,
       data=lambda: _chars(32, 128, 256),
       net=lambda d: _Recurrent("lstm", 32, 96, d["classes"], d["classes"]),
       title="char LSTM LM (hidden 96) under SGD + momentum, OneCycle, pydoc text"),
    _t(name="bert_tiny_cosine", family="transformer", optim="adamw", sched="cosine", steps=300, batch=32,
       center=1e-3, data=_majority, net=lambda d: _Bert(), weight_decay=0.01,
       title="BERT-style encoder from a transformers config, AdamW, warm-up + cosine, 300 steps"),
    _t(name="clusters_adam_step", family="mlp", optim="adam", sched="step", steps=3000, batch=32, center=1e-3,
       data=_clusters, net=lambda d: _mlp([20, 64, 64, 5], norm=True),
       title="Gaussian clusters, MLP with LayerNorm, Adam, step decay, 3,000 steps"),
    # the sixth held-out set (see HELD_OUT), added to widen the held-out evidence, not to replace tasks
    _t(name="digits_mlp_adamw", family="mlp", optim="adamw", sched="onecycle", steps=400, batch=32,
       center=3e-3, data=lambda: _digits("flat"), net=lambda d: _mlp([64, 256, 10], dropout=0.2),
       weight_decay=0.05, title="digits MLP 64-256-10, dropout 0.2, AdamW, OneCycle"),
    _t(name="digits_cnn_bn_cosine", family="cnn", optim="sgd", sched="cosine", steps=300, batch=32,
       center=3e-2, data=lambda: _digits("image"), net=lambda d: _cnn(bn=True), weight_decay=5e-4,
       title="digits CNN with BatchNorm, SGD + momentum, warm-up + cosine, 300 steps"),
    _t(name="char_transformer_step", family="transformer", optim="adamw", sched="step", steps=400, batch=16,
       center=3e-3, data=lambda: _chars(64, 64, 128), net=lambda d: _CausalLM(d["classes"], 64),
       weight_decay=0.1, title="char transformer LM under AdamW, step decay, pydoc text"),
    _t(name="digits_lstm_adamw", family="rnn", optim="adamw", sched="cosine", steps=500, batch=32,
       center=3e-3, data=lambda: _digits("rows"), net=lambda d: _Recurrent("lstm", 8, 64, 10),
       weight_decay=0.01, title="LSTM over a digit's rows under AdamW, warm-up + cosine"),
    _t(name="friedman_dropout", family="tabular", optim="adamw", sched="linear", steps=800, batch=32,
       center=1e-3, data=_friedman, net=lambda d: _mlp([10, 128, 128, 1], dropout=0.2), kind="reg",
       weight_decay=0.01, title="Friedman #1 regression MLP, dropout 0.2 (300 rows), AdamW, linear decay"),
    # the seventh held-out set (see HELD_OUT): OneCycleLR with torch's default 30% warm-up, committed
    # with its grids before any design work on cuts that warm-up does not decide (issue 39)
    _t(name="digits_cnn_bn_onecycle", family="cnn", optim="sgd", sched="onecycle", steps=400, batch=32,
       center=3e-2, data=lambda: _digits("image"), net=lambda d: _cnn(bn=True), weight_decay=5e-4,
       title="digits CNN with BatchNorm, SGD + momentum, OneCycle"),
    _t(name="digits_noisy_onecycle", family="mlp", optim="sgd", sched="onecycle", steps=600, batch=64,
       center=0.1, data=lambda: _digits("flat", noise=0.3), net=lambda d: _mlp([64, 256, 10]),
       weight_decay=5e-4, title="digits MLP, 30% of training labels random, SGD + momentum, OneCycle"),
    _t(name="diabetes_dropout_onecycle", family="tabular", optim="adamw", sched="onecycle", steps=1000,
       batch=32, center=1e-3, data=_diabetes, net=lambda d: _mlp([10, 128, 128, 1], dropout=0.5), kind="reg",
       weight_decay=0.01, title="diabetes regression MLP, dropout 0.5 (282 rows), AdamW, OneCycle"),
    _t(name="moons_dropout_adam_onecycle", family="tabular", optim="adam", sched="onecycle", steps=800,
       batch=32, center=3e-3, data=_moons, net=lambda d: _mlp([2, 128, 128, 2], dropout=0.4),
       title="two moons MLP, dropout 0.4 (200 rows), Adam, OneCycle"),
    _t(name="digits_lstm_sgd_onecycle", family="rnn", optim="sgd", sched="onecycle", steps=500, batch=32,
       center=0.1, data=lambda: _digits("rows"), net=lambda d: _Recurrent("lstm", 8, 64, 10),
       title="LSTM over a digit's rows under SGD + momentum, OneCycle"),
    _t(name="char_gru_onecycle", family="rnn", optim="adamw", sched="onecycle", steps=400, batch=16,
       center=3e-3, data=lambda: _chars(32, 128, 256),
       net=lambda d: _Recurrent("gru", 32, 96, d["classes"], d["classes"]), weight_decay=0.01,
       title="char GRU LM (hidden 96) under AdamW, OneCycle, pydoc text"),
    _t(name="char_mlp_onecycle", family="mlp", optim="adam", sched="onecycle", steps=800, batch=64,
       center=3e-3, data=lambda: _ngrams(8), net=lambda d: _NgramMLP(d["classes"], 8),
       title="char n-gram MLP LM (8 chars) under Adam, OneCycle"),
    _t(name="teacher_onecycle", family="mlp", optim="sgd", sched="onecycle", steps=1000, batch=32,
       center=3e-2, data=_teacher, net=lambda d: _mlp([16, 64, 64, 1]), kind="reg",
       title="regression on a random teacher network under SGD + momentum, OneCycle"),
]}

# The first held-out set (digits_lstm, diabetes_dropout, digits_rows_transformer, clusters_long,
# digits_cnn) was chosen before any design work on the search. Its results for the two-sided dead
# zone were read before the one-sided zone was designed, so it counts as design data from then on.
# The second set, chosen before any search ran on it, spreads the families again (8 of 23 tasks): a
# tabular classification with strong dropout, a BN CNN under SGD, an LSTM LM, a transformer LM under
# SGD, a regression of 120 steps, an MLP of 80 steps, a long Adam MLP, a regression under SGD.
# Two of them (wine_dropout, iris_short) showed the successive-halving prototype keeping a lost start
# (benchmarks/lr/prototypes.py, ``lost_start``), a rule designed after that reading, so they are
# design tasks since. The third set, committed with its grids before any search ran on it, replaces
# them: a small tabular classification with dropout, a CNN without normalisation under Adam, a
# regression of 150 steps under SGD, a GRU LM under AdamW. Four held-out tasks (moons_dropout,
# digits_cnn_adam, digits_mlp_adam_long, diabetes_short) then had their runs read cut by cut while
# the end's test was diagnosed, so they are design tasks since; the fourth set, committed with its
# grids before any search ran on it, replaces them (11 of 32 tasks held out): a tabular
# classification with dropout under Adam, a BN CNN under Adam with step decay, a transformer LM
# under Adam with linear decay, a GRU classifier under SGD, a tabular regression with dropout.
# A fifth set, committed with its grids before any search ran on it, widens the held-out evidence
# (16 of 37 tasks): a CNN without normalisation under AdamW with OneCycle, a small tabular
# classification with dropout under SGD, an LSTM LM under SGD with OneCycle, the BERT-style
# encoder under a cosine schedule, a long LayerNorm MLP under Adam with step decay. A sixth set,
# committed with its grids before any search ran on it, widens it again (21 of 42 tasks): an MLP
# with dropout under AdamW with OneCycle, a BatchNorm CNN under SGD with a cosine schedule, a
# transformer LM under AdamW with step decay, an LSTM classifier under AdamW, a tabular regression
# with dropout under AdamW with linear decay. A seventh set, committed with its grids before any design
# work on where the cuts fall under a warm-up (issue 39), holds OneCycleLR with torch's default 30%
# warm-up only (29 of 50 tasks held out): a BatchNorm CNN and a noisy-label MLP under SGD, a tabular
# regression and a tabular classification with strong dropout, an LSTM classifier under SGD, a GRU LM
# under AdamW, an n-gram MLP LM under Adam, a teacher regression under SGD. An eighth set, committed
# with its grids before any design work on issue 49 (decisions that see what pays late), holds
# warm-ups only, OneCycleLR and a 25% linear warm-up + cosine, with probes of 300 examples or more
# (staged in STAGED below until its runs are in the stores): under the long warm-up + cosine, an
# MLP on digits under AdamW, a CNN without normalisation on digits under SGD, an n-gram MLP LM under
# Adam; under OneCycleLR, a transformer LM under AdamW, a tabular classification with dropout under
# Adam, a tabular regression under SGD, and (added later, see below) a GRU classifier under Adam.
HELD_OUT: tuple[str, ...] = ("digits_cnn_bn_sgd", "char_lstm", "char_transformer_sgd", "teacher_sgd",
                             "friedman_short", "char_gru_adamw", "blobs_dropout", "digits_cnn_bn_adam",
                             "char_transformer_adam", "digits_gru_sgd", "sparse_dropout",
                             "digits_cnn_adamw", "cancer_sgd", "char_lstm_sgd", "bert_tiny_cosine",
                             "clusters_adam_step", "digits_mlp_adamw", "digits_cnn_bn_cosine",
                             "char_transformer_step", "digits_lstm_adamw", "friedman_dropout",
                             "digits_cnn_bn_onecycle", "digits_noisy_onecycle", "diabetes_dropout_onecycle",
                             "moons_dropout_adam_onecycle", "digits_lstm_sgd_onecycle", "char_gru_onecycle",
                             "char_mlp_onecycle", "teacher_onecycle")

# The eighth held-out set, staged: committed with its grids (benchmarks/lr/grids.json) before any design
# work on issue 49, and held out. Its own section reports it (``python -m benchmarks.lr.staged``: hpx.Forks
# and Optuna); its tasks join TASKS and HELD_OUT once their runs are in every store the suite's sections
# read; until then ``get_task`` and the commands' ``--tasks`` reach them by name.
STAGED: dict[str, Task] = {t.name: t for t in [
    _t(name="digits_mlp_warmcos", family="mlp", optim="adamw", sched="warmcos", steps=500, batch=32,
       center=3e-3, data=lambda: _digits("flat", probe=400), net=lambda d: _mlp([64, 128, 128, 10]),
       weight_decay=0.01, title="digits MLP 64-128-128-10 under AdamW, 25% warm-up + cosine, 400-row probe"),
    _t(name="digits_cnn_warmcos", family="cnn", optim="sgd", sched="warmcos", steps=400, batch=32,
       center=3e-2, data=lambda: _digits("image", probe=400), net=lambda d: _cnn(bn=False),
       weight_decay=5e-4,
       title="digits CNN, no normalisation, SGD + momentum, 25% warm-up + cosine, 400-row probe"),
    _t(name="char_mlp_warmcos", family="mlp", optim="adam", sched="warmcos", steps=800, batch=64,
       center=3e-3, data=lambda: _ngrams(6), net=lambda d: _NgramMLP(d["classes"], 6),
       title="char n-gram MLP LM (6 chars) under Adam, 25% warm-up + cosine"),
    _t(name="char_transformer_onecycle", family="transformer", optim="adamw", sched="onecycle", steps=300,
       batch=8, center=3e-3, data=lambda: _chars(16, 256, 512), net=lambda d: _CausalLM(d["classes"], 16),
       weight_decay=0.1, title="char transformer LM (context 16) under AdamW, OneCycle, pydoc text"),
    _t(name="mixture_dropout_onecycle", family="tabular", optim="adam", sched="onecycle", steps=800,
       batch=32, center=1e-3, data=_mixture, net=lambda d: _mlp([16, 128, 128, 4], dropout=0.4),
       title="4-class synthetic classification MLP, dropout 0.4 (500 rows), Adam, OneCycle"),
    _t(name="friedman_sgd_onecycle", family="tabular", optim="sgd", sched="onecycle", steps=600, batch=32,
       center=1e-2, data=_friedman_wide, net=lambda d: _mlp([10, 64, 64, 1]), kind="reg",
       title="Friedman #1 regression MLP (600 rows) under SGD + momentum, OneCycle"),
    # added when friedman_sgd_onecycle's first Forks runs exposed a fault (a run whose outputs overflow
    # the probe's float32 loss was stopped as "the probe's loss is at fault"): a fresh task, its grid
    # committed before any search ran on it
    _t(name="digits_gru_onecycle", family="rnn", optim="adam", sched="onecycle", steps=500, batch=32,
       center=3e-3, data=lambda: _digits("rows", probe=400), net=lambda d: _Recurrent("gru", 8, 64, 10),
       title="GRU over a digit's rows under Adam, OneCycle, 400-row probe"),
]}


# The ninth held-out set: warm-ups again, committed with its grids (benchmarks/lr/grids.json) before any
# design on a warm-up was chosen from the eighth set's reading (that set's misses were read cut by cut,
# so a design chosen from them is judged here). Five tasks under OneCycleLR or a 25% linear warm-up +
# cosine, every probe 400 examples or more: a row transformer on digits and an LSTM LM under a long
# warm-up + cosine, a LayerNorm MLP on digits under SGD, a teacher regression under AdamW and a
# dropout MLP on Gaussian clusters under Adam with OneCycle. Reached by name (get_task), as STAGED.
NINTH: dict[str, Task] = {t.name: t for t in [
    _t(name="digits_rows_transformer_warmcos", family="transformer", optim="adamw", sched="warmcos",
       steps=500, batch=32, center=3e-3, data=lambda: _digits("rows", probe=400),
       net=lambda d: _RowTransformer(),
       weight_decay=0.01, title="row transformer on digits under AdamW, 25% warm-up + cosine, 400-row probe"),
    _t(name="char_lstm_warmcos", family="rnn", optim="adam", sched="warmcos", steps=400, batch=16,
       center=3e-3, data=lambda: _chars(32, 256, 256),
       net=lambda d: _Recurrent("lstm", 32, 96, d["classes"], d["classes"]),
       title="char LSTM LM (hidden 96) under Adam, 25% warm-up + cosine, pydoc text"),
    _t(name="digits_mlp_ln_onecycle", family="mlp", optim="sgd", sched="onecycle", steps=500, batch=32,
       center=0.1, data=lambda: _digits("flat", probe=500), net=lambda d: _mlp([64, 128, 128, 10], norm=True),
       weight_decay=5e-4,
       title="digits LayerNorm MLP 64-128-128-10 under SGD + momentum, OneCycle, 500-row probe"),
    _t(name="teacher_adamw_onecycle", family="mlp", optim="adamw", sched="onecycle", steps=800, batch=32,
       center=3e-3, data=_teacher, net=lambda d: _mlp([16, 64, 64, 1]), kind="reg", weight_decay=0.01,
       title="regression on a random teacher network under AdamW, OneCycle"),
    _t(name="clusters_dropout_onecycle", family="tabular", optim="adam", sched="onecycle", steps=800,
       batch=32, center=1e-3, data=_clusters, net=lambda d: _mlp([20, 128, 128, 5], dropout=0.3),
       title="Gaussian clusters MLP, dropout 0.3, under Adam, OneCycle"),
]}


def get_task(name: str) -> Task:
    """The task ``name``; ``"<task>@probe<n>"`` is that task with its probe cut to its first ``n``
    examples (tokens for a language model, in whole sequences): the same data, model, optimizer
    and schedule, to measure what the probe's size does (``python -m benchmarks.lr.probesize``).
    ``"<task>@whole"`` trains on the probe's examples too (nothing carved out of the training data
    for a probe; a task of rows only), to measure what carving it costs (``benchmarks.lr.carve``)."""
    if name.endswith(WHOLE):
        return _whole(name[:-len(WHOLE)])
    base, cut, size = name.partition("@probe")
    if base in STAGED and not cut:
        return STAGED[base]
    if base in NINTH and not cut:
        return NINTH[base]
    if base not in TASKS:
        raise SystemExit(f"unknown task {base!r} (tasks: {', '.join([*TASKS, *STAGED, *NINTH])})")
    if not cut:
        return TASKS[base]
    if not size.isdigit() or int(size) < 1:
        raise SystemExit(f"{name!r}: the probe's size after '@probe' must be a positive whole number")
    return _probe_cut(base, int(size))


@cache
def _probe_cut(base: str, n: int) -> Task:
    task = TASKS[base]
    kept: list[Batch] = []
    left = n
    for x, y in task.data()["probe"]:
        if left <= 0:
            break
        per = y[0].numel()  # examples per unit: 1 for a row, the context for a language model's window
        k = min(len(y), max(1, left // per))  # whole units, at most n examples (one unit at least)
        kept.append((x[:k], y[:k]))
        left -= k * per
    return replace(task, name=f"{base}@probe{n}", data=lambda: {**task.data(), "probe": kept})


WHOLE = "@whole"


@cache
def _whole(base: str) -> Task:
    if base not in TASKS:
        raise SystemExit(f"unknown task {base!r} (tasks: {', '.join(TASKS)})")
    task = TASKS[base]
    if "stream" in task.data():
        raise SystemExit(f"{base}{WHOLE}: {base} trains on a text's windows, not on rows: its probe cannot "
                         "be put back into a training split of rows (a task of rows only)")

    def data() -> dict[str, Any]:
        d = task.data()
        xs, ys = zip(d["train"], *d["probe"])
        return {**d, "train": (torch.cat(xs), torch.cat(ys))}

    return replace(task, name=f"{base}{WHOLE}", data=cache(data))
