"""One GPU: plain training, ``hpx.Forks`` and the HDET engine in interleaved rounds, on a 100 M-parameter
LM, a ResNet-18 and a launch-bound MLP of 8,970 parameters.

    python -m benchmarks.gpu                        # one CUDA GPU; writes docs/benchmarks.md's gpu section
    python -m benchmarks.gpu --no-write             # print the table only
    python -m benchmarks.gpu --device cpu --tiny    # the plumbing in seconds on a CPU (never writes)

Models (every method on the same batches): **lm**, a causal transformer LM (pre-LayerNorm, causal
SDPA, GELU MLP, learned positions; 14 layers, d_model 768, 12 heads, bytes, context 512: 100.02 M
parameters) on UTF-8 bytes of ``pydoc_data.topics`` (the last 10% the probe), batch 16 x 512;
**cnn**, ResNet-18 (11.69 M), channels-last, random 3x224x224 images of 1000 classes, batch 128;
**mlp**, 64-64-64-10 with ReLUs (8,970) on digits-like rows (64 features, labels 0-9 from a fixed
random teacher), batch 64, 4x the others' steps: a step is tens of kernel launches and the Python
around them, so it shows each method's host work where launches, not arithmetic, dominate.

Methods, from the same initial weights (seeded inside ``torch.random.fork_rng``), AdamW (betas
0.9/0.95, weight decay 0.1) and ``OneCycleLR``: **plain** (zero_grad, forward, backward, step, the
scheduler's step); **hpx.Forks** as the README has it (``forks.step`` a step, ``forks.converge()``;
5 forks at 0.1x-10x the lr, cut to 3 at 10% of the run and to 2 at 25% on copies annealed over the
next 5%); **hpx.Engine** (HDET in one process: 4 replicas on a quarter of the batch each, a
``LearningRate`` knob a parameter group on the ``OneCycleLR`` shape, a sync every ``steps // 4``);
for the mlp only, **hpx.Forks batched**: Forks with ``batched=True`` (``hpx.forks.batched``: a step of
four forks or more as one vmap; its note counts them). Not here: ``shard=`` needs several ranks.

**Rounds.** Each model runs ``--rounds`` rounds (default 3) of every method in that order, so the
runs interleave (plain, Forks, Engine, plain, ...) and a drift of the device falls on all alike. A
run is timed between two ``torch.cuda.synchronize()`` on CUDA (none on a CPU), from building the
optimizer (and the forks' or the engine's copies) to the end of ``converge()``, the model already on
the device; its wall time over its steps is that round's time a step: the table gives the min,
median and max over the rounds and the ratio of medians to plain training's. The timed loops read
nothing back. 3 untimed plain steps and a probe pass warm each model up; a method's own first calls
(the engine's quarter batches) show in its max. bf16 autocast on CUDA, float32 on a CPU; a
non-finite training or final probe loss stops the command with a non-zero exit.

**Memory** (CUDA; not measured on a CPU): ``gc.collect()``, ``empty_cache()`` and
``reset_peak_memory_stats()`` before each run; ``max_memory_allocated`` and ``max_memory_reserved``
after it, less their levels at its start (the data, named under the table); the largest over the
rounds and the ratio to plain's.

**Budget** (100 steps, 400 for the mlp, 3 rounds, one H200 taken at only 100 TFLOP/s of bf16): an lm
step is 6 x 100 M x 8,192 tokens = 4.9 TFLOP plus 0.5 for attention, 55 ms: a round is plain 5.5 s,
Forks 17 s (3x the optimizer steps, 13 probe passes), the engine 8 s; with 10 builds on the host
(1-2 s each) about 2 min. A cnn step is 3 x 3.6 GFLOP x 128 = 1.4 TFLOP, 40 ms at 35 TFLOP/s: 3
rounds of 4 + 13 + 6 s, about 75 s. The mlp (about 1 ms a plain step, a few for the others' host
work): under 30 s. With CUDA's start and the data about 4 minutes, inside 8; each round's times and
the time spent against ``--budget`` (480 s; reported, not enforced) go to stderr and the section.
Memory: the lm's forks hold up to 10 model states (16 GB) and one fork's activations (3 GB).

``--tiny``: an lm of 2 layers, d_model 32, context 32, batch 4; ResNet-18's layout, a block a stage
at width 8, on 3x16x16 images of 10 classes, batch 8; the same mlp; 12 steps (48 for the mlp). It
checks the plumbing on a CPU and is never written: ``publish`` refuses all but a full-size CUDA run.
"""

from __future__ import annotations

import argparse
import gc
import math
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import hpx
from benchmarks import report

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "benchmarks.md"
MARKER = "gpu"
METHODS = ("plain", "hpx.Forks", "hpx.Engine")  # a round runs them in this order
BATCHED = "hpx.Forks batched"  # the mlp's fourth method, after the others
METHODS_OF = {"mlp": (*METHODS, BATCHED)}  # a model's methods where they are not METHODS
REPLICAS, SEED, WARMUP_STEPS, ROUNDS = 4, 0, 3, 3
MLP_STEPS = 4  # the mlp runs this many times the others' steps
BUDGET_S = 480.0
PLACEHOLDER = "not yet measured on a GPU: run `python -m benchmarks.gpu` on one"

Loss = Callable[[nn.Module, Any], torch.Tensor]


# ----------------------------------------------------------------------------- models


class Block(nn.Module):
    """A pre-LayerNorm transformer block: causal self-attention, then a GELU MLP (no dropout)."""

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class CausalLM(nn.Module):
    """Token and position embeddings, ``layers`` blocks, a final LayerNorm and a linear head."""

    def __init__(self, vocab: int, d: int, layers: int, heads: int, ctx: int) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(ctx, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)
        for name, p in self.named_parameters():
            if p.dim() >= 2:
                nn.init.normal_(p, std=0.02)
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


class BasicBlock(nn.Module):
    """ResNet's two 3x3 convolutions with batch norm and a shortcut (1x1 when the shape changes)."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout)
        self.conv2, self.bn2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False), nn.BatchNorm2d(cout)
        self.short: nn.Module = nn.Identity()
        if stride != 1 or cin != cout:
            self.short = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(y)) + self.short(x))


class ResNet18(nn.Module):
    """ResNet-18 (He et al. 2016): the 7x7 stem and max-pool, four stages of ``depth`` (2)
    BasicBlocks at widths ``w, 2w, 4w, 8w``, global average pooling and a linear classifier."""

    def __init__(self, classes: int, width: int = 64, depth: int = 2) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 7, 2, 3, bias=False), nn.BatchNorm2d(width),
                                  nn.ReLU(), nn.MaxPool2d(3, 2, 1))
        blocks: list[nn.Module] = []
        cin = width
        for i, stride in enumerate((1, 2, 2, 2)):
            cout = width * 2 ** i
            blocks += [BasicBlock(cin, cout, stride), *(BasicBlock(cout, cout, 1) for _ in range(depth - 1))]
            cin = cout
        self.blocks, self.fc = nn.Sequential(*blocks), nn.Linear(cin, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(self.blocks(self.stem(x)), 1), 1))


def mlp() -> nn.Module:
    """64-64-64-10 with ReLUs: 8,970 parameters."""
    return nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))


# ----------------------------------------------------------------------------- the three set-ups


@dataclass
class Setup:
    """One model's benchmark: how to build it, its data, its losses and its learning rate."""

    name: str
    description: str
    unit: str  # what the throughput counts: "tokens", "images" or "rows"
    per_batch: int  # ... in one batch
    build: Callable[[], nn.Module]  # the model, on the CPU, from torch's global stream seeded with seed
    lr: float  # the (peak) learning rate of AdamW and OneCycleLR
    batches: list[Any]  # one per step (so as many as the run's steps), on the device
    probe: list[Any]  # held-out batches, on the device
    loss: Loss  # the training loss (a scalar)
    example_loss: Loss  # the probe's loss of every example
    seed: int
    channels_last: bool = False
    params: int = 0  # counted when the model is first built (warm_up)


def _losses(device: torch.device, sequence: bool = False) -> tuple[Loss, Loss]:
    """The training loss (a scalar) and the probe's loss of every example (a sequence's mean over
    its tokens when ``sequence``): cross-entropy in float32 of logits under bf16 autocast on CUDA."""

    def example_loss(model: nn.Module, b: Any) -> torch.Tensor:
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            logits = model(b[0])
        if sequence:
            return F.cross_entropy(logits.float().transpose(1, 2), b[1], reduction="none").mean(1)
        return F.cross_entropy(logits.float(), b[1], reduction="none")

    return (lambda model, b: example_loss(model, b).mean()), example_loss


def _text_bytes() -> tuple[torch.Tensor, str]:
    """CPython's pydoc topics as UTF-8 bytes (sorted keys), and where they came from."""
    try:
        from pydoc_data.topics import topics
    except ImportError:
        g = torch.Generator().manual_seed(SEED)
        return torch.randint(0, 256, (500_000,), generator=g), "random bytes (pydoc_data is not installed)"
    text = "".join(topics[k] for k in sorted(topics)).encode("utf-8")
    return torch.frombuffer(bytearray(text), dtype=torch.uint8).long(), "UTF-8 bytes of pydoc_data.topics"


def lm_setup(tiny: bool, steps: int, device: torch.device) -> Setup:
    """The causal LM: 14 x 768 byte-level (100.02 M parameters), or 2 x 32 with ``--tiny``."""
    d, layers, heads, ctx, batch = (32, 2, 2, 32, 4) if tiny else (768, 14, 12, 512, 16)
    ids, source = _text_bytes()
    train, held = ids[:int(0.9 * len(ids))], ids[int(0.9 * len(ids)):]
    g = torch.Generator().manual_seed(SEED)

    def windows(stream: torch.Tensor, starts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        w = torch.stack([stream[s:s + ctx + 1] for s in starts.tolist()]).to(device)
        return w[:, :-1], w[:, 1:]

    batches = [windows(train, torch.randint(0, len(train) - ctx - 1, (batch,), generator=g))
               for _ in range(steps)]
    stride = (len(held) - ctx - 1) // (2 * batch)
    probe = [windows(held, torch.arange(i * batch, (i + 1) * batch) * stride) for i in range(2)]
    build = partial(CausalLM, 256, d, layers, heads, ctx)
    desc = (f"causal transformer LM, {layers} layers, d_model {d}, {heads} heads, byte-level (256), "
            f"context {ctx}; {source}; batch {batch} x {ctx} tokens; probe 2 batches of held-out windows")
    return Setup("lm", desc, "tokens", batch * ctx, build, 3e-3 if tiny else 6e-4, batches, probe,
                 *_losses(device, sequence=True), SEED)


def cnn_setup(tiny: bool, steps: int, device: torch.device) -> Setup:
    """ResNet-18 on random 3x224x224 images of 1000 classes (11.69 M parameters), or one block a
    stage at width 8 on 3x16x16 images of 10 classes with ``--tiny``."""
    width, depth, size, classes, batch = (8, 1, 16, 10, 8) if tiny else (64, 2, 224, 1000, 128)
    g = torch.Generator().manual_seed(SEED + 1)

    def sample() -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(batch, 3, size, size, generator=g).to(device, memory_format=torch.channels_last)
        return x, torch.randint(0, classes, (batch,), generator=g).to(device)

    pool = [sample() for _ in range(4)]
    batches, probe = [pool[i % len(pool)] for i in range(steps)], [sample() for _ in range(2)]
    build = partial(ResNet18, classes, width, depth)
    name = "ResNet-18" if depth == 2 else f"ResNet-18's layout with {depth} block(s) a stage, width {width}"
    desc = (f"{name}, channels-last, random 3x{size}x{size} images, {classes} classes "
            f"(a pool of 4 batches, cycled); batch {batch}; probe 2 batches of other random images")
    return Setup("cnn", desc, "images", batch, build, 3e-3 if tiny else 2e-3, batches, probe,
                 *_losses(device), SEED + 1, channels_last=True)


def mlp_setup(tiny: bool, steps: int, device: torch.device) -> Setup:
    """The launch-bound mlp: 64-64-64-10 (8,970 parameters) on digits-like rows, batch 64; the same
    with ``--tiny`` (it is tiny already). ``steps`` is its own (``MLP_STEPS`` x the others')."""
    g = torch.Generator().manual_seed(SEED + 2)
    teacher = [torch.randn(64, 64, generator=g), torch.randn(64, 10, generator=g)]

    def sample(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(n, 64, generator=g)
        return x.to(device), (torch.tanh(x @ teacher[0]) @ teacher[1]).argmax(1).to(device)

    pool = [sample(64) for _ in range(16)]
    batches, probe = [pool[i % len(pool)] for i in range(steps)], [sample(256) for _ in range(2)]
    desc = ("MLP 64-64-64-10 with ReLUs, launch-bound; digits-like rows (64 normal features, 10 classes "
            "by a fixed random teacher; a pool of 16 batches, cycled); batch 64; probe 2 batches of 256 "
            f"other rows; {MLP_STEPS}x the others' steps")
    return Setup("mlp", desc, "rows", 64, mlp, 3e-3, batches, probe, *_losses(device), SEED + 2)


# ----------------------------------------------------------------------------- measuring


@dataclass
class Run:
    """One round of one (model, method)."""

    model: str
    method: str
    round: int
    wall: float  # seconds, from the optimizer's making to the end of converge()
    steps: int
    optimizer_steps: int
    probe_loss: float
    note: str = ""
    memory: tuple[float, float, float] | None = None  # CUDA: allocated at the start; both peaks over it


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def check_finite(losses: torch.Tensor, what: str = "training loss") -> None:
    """Raise ``FloatingPointError`` naming the first step where ``losses`` (``[steps, ...]``) isn't finite."""
    bad = ~torch.isfinite(losses)
    if bool(bad.any()):
        step = int(bad.reshape(len(losses), -1).any(1).nonzero()[0, 0])
        raise FloatingPointError(f"non-finite {what} at step {step} ({losses[step].tolist()}); the "
                                 "benchmark's numbers would be meaningless")


def _optimizer(model: nn.Module, lr: float) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)


def _scheduler(opt: torch.optim.Optimizer, lr: float, steps: int) -> torch.optim.lr_scheduler.LRScheduler:
    return torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps)


@torch.no_grad()
def probe_loss(setup: Setup, model: nn.Module) -> float:
    """The mean per-example probe loss of ``model`` (eval mode; one host read)."""
    model.eval()
    return float(torch.cat([setup.example_loss(model, b) for b in setup.probe]).mean())


def _model(setup: Setup, device: torch.device) -> nn.Module:
    with torch.random.fork_rng(devices=[]):  # the same weights at every call; the global stream kept
        torch.manual_seed(setup.seed)
        model = setup.build().to(device)
    return model.to(memory_format=torch.channels_last) if setup.channels_last else model


Trained = tuple[nn.Module, list[torch.Tensor], int, str]  # final model, losses, optimizer steps, note


def _plain(setup: Setup, model: nn.Module) -> Trained:
    opt = _optimizer(model, setup.lr)
    sched = _scheduler(opt, setup.lr, len(setup.batches))
    losses = []
    for b in setup.batches:
        opt.zero_grad(set_to_none=True)
        loss = setup.loss(model, b)
        loss.backward()
        opt.step()
        sched.step()
        losses.append(loss.detach())
    return model, losses, len(setup.batches), ""


def _forks(setup: Setup, model: nn.Module, batched: bool = False) -> Trained:
    opt, n = _optimizer(model, setup.lr), len(setup.batches)
    forks = hpx.Forks(model, opt, total_steps=n, schedule=_scheduler(opt, setup.lr, n), batched=batched,
                      probe=setup.probe, loss_fn=lambda rep, b: setup.example_loss(rep.model, b))
    losses = [forks.step(lambda rep, bb: setup.loss(rep.model, bb), b)[0] for b in setup.batches]
    final = forks.converge()  # losses[i]: your run's
    cuts = [r.step for r in forks.history if r.phase == "cut"]
    kept, b = ", then ".join(str(k) for _, k in forks.cuts), forks._batched
    done = "" if b is None else f"; {b.taken} steps batched" + (f" (fell back: {b.why})" if b.why else "")
    return final, losses, forks.fork_steps, (f"cuts (to {kept} forks) decided at steps {cuts}; ended at "
                                             f"{forks.factor:.3g}x the lr{done}")


def _engine(setup: Setup, model: nn.Module) -> Trained:
    steps = len(setup.batches)
    template = _optimizer(model, setup.lr)  # the schedule's param groups; never stepped
    knobs = hpx.schedule.explore_knobs(_scheduler(template, setup.lr, steps), spread=0.2)
    del template
    engine = hpx.Engine(model, lambda m: _optimizer(m, setup.lr), knobs, replicas=REPLICAS,
                        sync_every=max(1, steps // 4))
    losses = [engine.step(lambda rep, bb: setup.loss(rep.model, bb), b) for b in setup.batches]
    final = engine.converge()
    why = engine.unshared_reason
    shared = "one optimizer state" if why is None else f"an optimizer state each ({why})"
    lr = ", ".join(f"{k} {v:.3g}" for k, v in engine.bases.items() if k.startswith("lr"))
    return final, losses, steps * REPLICAS, (f"{REPLICAS} replicas, {shared}; {len(engine.history)} syncs; "
                                             f"ended with the lr base at {lr}")


RUNNERS: dict[str, Callable[[Setup, nn.Module], Trained]] = {
    "plain": _plain, "hpx.Forks": _forks, "hpx.Engine": _engine, BATCHED: partial(_forks, batched=True)}


def run_one(setup: Setup, method: str, device: torch.device, round_: int = 0) -> Run:
    """Train ``setup``'s model once with ``method``, timed between two synchronizations, with CUDA's
    memory peaks reset before; raise (naming both) if it fails or a loss is non-finite."""
    try:
        memory = base = None
        if device.type == "cuda":  # free what the last run left; a CPU's memory is not measured
            gc.collect()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
            base = torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device)
        model = _model(setup, device)  # its weights count in the peaks; its building not in the time
        _sync(device)
        t0 = time.perf_counter()
        final, losses, opt_steps, note = RUNNERS[method](setup, model)
        _sync(device)
        wall = time.perf_counter() - t0
        if base is not None:
            memory = (float(base[0]), float(torch.cuda.max_memory_allocated(device) - base[0]),
                      float(torch.cuda.max_memory_reserved(device) - base[1]))
        check_finite(torch.stack(losses))
        pl = probe_loss(setup, final)
    except Exception as exc:
        raise RuntimeError(f"benchmarks.gpu: {setup.name} / {method} failed: "
                           f"{type(exc).__name__}: {exc}") from exc
    if not math.isfinite(pl):
        raise FloatingPointError(f"benchmarks.gpu: {setup.name} / {method}: the final probe loss is {pl}")
    return Run(setup.name, method, round_, wall, len(setup.batches), opt_steps, pl, note, memory)


def measure(setup: Setup, device: torch.device, rounds: int, start: float, budget: float) -> list[Run]:
    """``rounds`` rounds of every method, interleaved (plain, Forks, Engine, plain, ...); each
    round's times and the time since ``start`` (``time.perf_counter``) against ``budget`` on stderr."""
    runs: list[Run] = []
    for i in range(rounds):
        t = time.perf_counter()
        mine = METHODS_OF.get(setup.name, METHODS)
        runs += [run_one(setup, method, device, i) for method in mine]
        took = time.perf_counter() - t
        times = ", ".join(f"{r.method} {r.wall:.2f} s" for r in runs[-len(mine):])
        ahead = f"; {rounds} rounds ~{took * rounds:.0f} s" if i == 0 else ""
        print(f"[budget] {setup.name} round {i + 1}/{rounds}: {times} ({took:.1f} s with the builds{ahead}); "
              f"elapsed {time.perf_counter() - start:.0f} s of {budget:.0f} s", file=sys.stderr, flush=True)
    return runs


def warm_up(setup: Setup, device: torch.device) -> None:
    """A few untimed plain steps and a probe pass, so that no method pays the device's first calls."""
    model = _model(setup, device)
    setup.params = sum(p.numel() for p in model.parameters())
    opt = _optimizer(model, setup.lr)
    for b in setup.batches[:WARMUP_STEPS]:
        opt.zero_grad(set_to_none=True)
        setup.loss(model, b).backward()
        opt.step()
    probe_loss(setup, model)
    _sync(device)


# ----------------------------------------------------------------------------- the table


COLUMNS = ("model", "method", "ms/step min", "ms/step median", "ms/step max", "x plain (medians)",
           "peak allocated MB", "x plain", "peak reserved MB", "x plain", "throughput (median)",
           "optimizer steps", "final probe loss")


def _ratio(a: float | None, b: float | None, floor: float = 0.0) -> str:
    """``a / b`` to 2 decimals, or "n/a" when either is missing or ``b`` is not above ``floor``."""
    return "n/a" if a is None or b is None or b <= floor else f"{a / b:.2f}"


def _mb(x: float | None) -> str:
    return "n/a" if x is None else f"{x / 2 ** 20:,.1f}"


def _stats(runs: list[Run]) -> tuple[list[float], float, float | None, float | None]:
    """One (model, method)'s rounds: seconds a step (round order), their median, the largest
    allocated and reserved peaks (None on a CPU)."""
    per_step = [r.wall / r.steps for r in runs]
    mem = [r.memory for r in runs if r.memory is not None]
    peaks = [max(m[i] for m in mem) if mem else None for i in (1, 2)]
    return per_step, statistics.median(per_step), peaks[0], peaks[1]


def table(runs: list[Run], setups: list[Setup]) -> str:
    """The markdown table: a row per (model, method) over its rounds, ratios to that model's plain
    training (side by side: the same rounds)."""
    lines = ["| " + " | ".join(COLUMNS) + " |", "| --- | --- |" + " ---: |" * (len(COLUMNS) - 2)]
    for s in setups:
        plain = _stats([r for r in runs if (r.model, r.method) == (s.name, "plain")])
        for method in dict.fromkeys(r.method for r in runs if r.model == s.name):  # in the rounds' order
            mine = [r for r in runs if (r.model, r.method) == (s.name, method)]
            per_step, median, alloc, res = _stats(mine)
            ms = " | ".join(f"{1e3 * x:,.2f}" for x in (min(per_step), median, max(per_step)))
            lines.append(f"| {s.name} | {method} | {ms} | {_ratio(median, plain[1])} | {_mb(alloc)} | "
                         f"{_ratio(alloc, plain[2], 2**20)} | {_mb(res)} | {_ratio(res, plain[3], 2**20)} | "
                         f"{s.per_batch / median:,.0f} {s.unit}/s | {mine[0].optimizer_steps} | "
                         f"{statistics.median(r.probe_loss for r in mine):.4f} |")
    return "\n".join(lines)


def _device_text(device: torch.device) -> str:
    if device.type == "cuda":
        gib = torch.cuda.get_device_properties(device).total_memory / 2**30
        return f"{torch.cuda.get_device_name(device)} ({gib:.0f} GiB), CUDA {torch.version.cuda}, bf16"
    return f"{device.type} ({platform.machine()}, {torch.get_num_threads()} torch thread(s)), float32"


def section(runs: list[Run], setups: list[Setup], device: torch.device, rounds: int, wall: float,
            command: str, budget: float = BUDGET_S) -> str:
    """The gpu section of docs/benchmarks.md (printed on every run, written by ``publish`` on CUDA)."""
    size = max((s.params for s in setups), default=0) / 1e6  # what ran: 100 M, or --tiny's models
    steps = ", ".join(f"{s.name} {len(s.batches)}" for s in setups)
    lines = [f"## On one GPU: plain training, `hpx.Forks` and the HDET engine, up to {size:.3g} M parameters",
             "", f"Command: `{command}` ({wall:.0f} s in all, {'within' if wall <= budget else 'OVER'} the "
             f"{budget:.0f} s budget) on {_device_text(device)}; Python {platform.python_version()}, torch "
             f"{torch.__version__}. What is measured: the docstring of `benchmarks/gpu.py`. {rounds} "
             f"interleaved rounds (plain, Forks, Engine, plain, ...); steps a run: {steps}; AdamW and "
             "OneCycleLR; each method from the same initial weights on the same batches; Forks' batched "
             "path (`batched=True`) for the mlp only.", ""]
    if device.type != "cuda":
        lines += [f"Not run on a GPU ({PLACEHOLDER}); this table checks the plumbing, not the numbers; "
                  "a CPU's memory is not measured.", ""]
    lines += [f"- **{s.name}** ({s.params / 1e6:.4g} M parameters): {s.description}." for s in setups]
    lines += ["", table(runs, setups), ""]
    last = {(r.model, r.method): r for r in runs if r.note}  # the last round's notes
    lines += [f"- {m} / {k} (round {r.round + 1}): {r.note}." for (m, k), r in last.items()]
    base = {s.name: [r.memory[0] for r in runs if r.model == s.name and r.memory] for s in setups}
    lines += [f"- {m}: allocated at a run's start (the data; not in its peaks): {_mb(min(b))}-{_mb(max(b))} "
              "MB." for m, b in base.items() if b]
    lines += ["", "ms/step: a round's wall time over its steps, min / median / max over the rounds; x plain: "
              "the ratio of medians (or of the largest peaks) to plain training's, side by side. Optimizer "
              "steps: plain training's; the forks' and their annealed copies' together "
              "(`forks.fork_steps`); the engine's replicas' (each on a quarter of the batch)."]
    return "\n".join(lines)


def publish(text: str, device: torch.device, tiny: bool, doc: Path | None = None) -> Path:
    """Write ``text`` into the gpu section of ``doc`` (docs/benchmarks.md). Only a full-size CUDA
    run's figures may stand there: anything else raises ``ValueError`` and writes nothing."""
    if device.type != "cuda" or tiny:
        raise ValueError(f"benchmarks.gpu: not writing a {'--tiny' if tiny else device.type} run's "
                         "figures into the GPU section; only a full-size CUDA run is written")
    report.write_section(DOC if doc is None else doc, MARKER, text)
    return DOC if doc is None else doc


# ----------------------------------------------------------------------------- the command


def _parse(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.gpu", description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", help="torch device (default cuda)")
    ap.add_argument("--tiny", action="store_true", help="tiny models and 12 steps: seconds on a CPU")
    ap.add_argument("--steps", type=int, default=None,
                    help=f"steps a run (default 100, 12 with --tiny; at least 10); the mlp's {MLP_STEPS}x")
    ap.add_argument("--rounds", type=int, default=ROUNDS, help=f"interleaved rounds (default {ROUNDS})")
    ap.add_argument("--budget", type=float, default=BUDGET_S,
                    help=f"seconds to keep to: reported, not enforced (default {BUDGET_S:.0f})")
    ap.add_argument("--no-write", action="store_true", help="print the table, do not write the docs")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; print the section; write it into docs/benchmarks.md on CUDA (not with
    ``--tiny`` or ``--no-write``). Raises ``SystemExit`` with a message when CUDA is asked and
    missing or an argument is out of range; any failure of a method raises."""
    argv = sys.argv[1:] if argv is None else list(argv)
    args = _parse(argv)
    try:
        device = torch.device(args.device)
    except RuntimeError as exc:
        raise SystemExit(f"benchmarks.gpu: --device {args.device!r} is not a torch device ({exc})") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"benchmarks.gpu: --device {args.device} was asked, but CUDA is not available "
                         f"(torch {torch.__version__}, CUDA build: {torch.version.cuda}). To check the "
                         "plumbing on a CPU: python -m benchmarks.gpu --device cpu --tiny")
    steps = args.steps if args.steps is not None else (12 if args.tiny else 100)
    if steps < 10 or args.rounds < 1:
        raise SystemExit(f"benchmarks.gpu: --steps must be at least 10, so that the forks' cuts fall inside "
                         f"the run, and --rounds at least 1 (got {steps} and {args.rounds})")
    _ = hpx.Forks, hpx.Engine, hpx.schedule.explore_knobs  # hpx loads its modules now, not on the clock
    if device.type == "cpu" and not args.tiny:
        print("benchmarks.gpu: the full-size models on a CPU take hours; --tiny checks the plumbing",
              file=sys.stderr)
    threads = torch.get_num_threads()
    if device.type == "cpu":
        torch.set_num_threads(1)
    try:
        start, runs, setups = time.perf_counter(), [], []
        for make, n in ((lm_setup, steps), (cnn_setup, steps), (mlp_setup, MLP_STEPS * steps)):
            t, setup = time.perf_counter(), make(args.tiny, n, device)
            warm_up(setup, device)
            setups.append(setup)
            runs += measure(setup, device, args.rounds, start, args.budget)
            print(f"[budget] {setup.name} done in {time.perf_counter() - t:.0f} s (data, warm-up, rounds); "
                  f"elapsed {time.perf_counter() - start:.0f} s of {args.budget:.0f} s", file=sys.stderr)
        wall, shown = time.perf_counter() - start, " ".join(a for a in argv if a != "--no-write")
        text = section(runs, setups, device, args.rounds, wall, f"python -m benchmarks.gpu {shown}".strip(),
                       args.budget)
    finally:
        torch.set_num_threads(threads)
    print(text)
    if wall > args.budget:
        print(f"\nbenchmarks.gpu: {wall:.0f} s, over the {args.budget:.0f} s budget", file=sys.stderr)
    if not args.no_write and device.type == "cuda" and not args.tiny:
        print(f"\nwritten: {publish(text, device, args.tiny)}, section <!-- {MARKER} -->", file=sys.stderr)
    elif not args.no_write:
        why = "--tiny" if args.tiny else f"on {device.type}, not CUDA"
        print(f"\nnot written to {DOC}, section <!-- {MARKER} --> ({why})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
