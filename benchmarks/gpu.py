"""One GPU: plain training, ``hpx.Forks`` and the HDET engine on a 100 M-parameter LM and a ResNet-18.

    python -m benchmarks.gpu                        # on one CUDA GPU; writes the gpu section of
                                                    # docs/benchmarks.md
    python -m benchmarks.gpu --no-write             # print the table only
    python -m benchmarks.gpu --device cpu --tiny    # the plumbing in seconds on a CPU (never writes)

Two models, each trained three ways on the same batches, side by side in one process:

- **lm**: a causal transformer language model built here (pre-LayerNorm blocks, causal
  ``scaled_dot_product_attention``, GELU MLP, learned positions; 14 layers, d_model 768, 12 heads,
  byte-level vocabulary of 256, context 512: 100.02 M parameters; no dropout), on UTF-8 bytes of
  CPython's ``pydoc_data.topics`` (random windows of the first 90% train; fixed windows of the
  last 10% are the probe; random bytes if a distribution stripped that module); batch 16 x 512
  tokens.
- **cnn**: ResNet-18 built here (BasicBlocks 2-2-2-2, widths 64-512, the 7x7 stem and max-pool:
  11.69 M parameters), channels-last, on random 3x224x224 images with random labels of 1000
  classes (a pool of 4 batches, cycled); batch 128.

The three ways, each from the same initial weights (seeded through ``torch.random.fork_rng``, so
the global stream is left as it was), AdamW (betas 0.9/0.95, weight decay 0.1) and torch's
``OneCycleLR`` over the run:

- **plain**: the hand-written loop: ``zero_grad``, forward, ``backward``, ``step``, the
  scheduler's ``step``;
- **hpx.Forks**: the recommended learning-rate search (README, "Use"): ``hpx.Forks(model, opt,
  total_steps=steps, schedule=scheduler, probe=...)``, ``forks.step(loss_fn, batch)`` each step,
  ``forks.converge()`` at the end; its default 5 forks at 0.1x-10x the lr, cut to 3 at 10% of the
  run and to 2 at 25%, each cut scored on annealed copies trained over the next 5%; the probe loss
  is given per example (per sequence for the LM), so the end's paired test needs one pass;
- **hpx.Engine**: HDET in one process, its defaults (shared mode, one optimizer state,
  ``IntervalLoss`` signal, the HDET controller) with 4 replicas, each on a quarter of the batch,
  and one ``LearningRate`` knob per parameter group (spread 0.2) on the ``OneCycleLR`` shape
  (``hpx.schedule.explore_knobs``), syncing every ``steps // 4`` steps.

Every forward runs under ``torch.autocast(device_type, torch.bfloat16)``, enabled on CUDA only;
the loss is taken in float32. Timed per method, with ``torch.cuda.synchronize()`` before and
after on CUDA: from building the optimizer (and the forks or the engine, whose copies are part
of their cost) to the end of ``converge()``; the model is built and moved to the device before
the clock starts. Nothing in the timed loops reads the device back (losses are kept on it and
checked after the clock stops); the host reads are the methods' own (the forks' cuts and end,
the engine's syncs). Before the timed runs, 3 untimed plain steps of each model warm the device
up (kernels, allocator, cuBLAS/cuDNN handles). Peak memory on CUDA:
``torch.cuda.max_memory_allocated`` after ``torch.cuda.reset_peak_memory_stats()``, less what was
allocated before the method started (the data); on a CPU (Linux): the peak resident size over
the resident size at the method's start (the peak reset through ``/proc/self/clear_refs``), or
"n/a" where that is not available. Throughput: the run's batches (tokens or images) over the
wall time; every method trains on the same batches, so it is plain training's data at each
method's speed. A non-finite training loss of your run (plain's, the forks' run at 1x, any
engine replica's) or final probe loss stops the command with a non-zero exit.

Budget (the default 100 steps; an A100/H100 does some 100-300 TFLOP/s of bf16 matmuls, say 100
achieved): an lm step is about 6 x 100 M parameters x 8,192 tokens = 4.9 TFLOP plus 0.5 for
attention, about 55 ms; plain training 100 steps (5.5 s). ``hpx.Forks`` takes 3x its optimizer
steps (5 forks to step 15, where the cut at 10% is decided on copies annealed over 5 steps, 3 to
step 30, 2 for the last 70, and the copies 5 x 5 + 3 x 5: 300 steps) plus 13 forward passes of
the 2-batch probe (initial weights, 5 + 3 copies at the cuts, 2 forks and the paired test at
the end), about 310 steps' worth (17 s); the engine about plain's arithmetic in 4 smaller passes
plus 4 optimizer updates a step (about 8 s). A cnn step is about 3 x 3.6 GFLOP x 128 images =
1.4 TFLOP, some 40 ms at the 35 TFLOP/s convolutions reach: about 4 s plain, 13 s forks, 6 s
engine. With the warm-ups, the models built four times each and the data generated on the
host, the whole command takes about one to two minutes at these rates, and stays under 8
minutes on a GPU 3-4x slower than that. Memory: the forks hold up to 10 model states at once (5
forks and their 5 annealed copies over the first cut's cool-down), each weights, gradients and
AdamW's two moments in float32: 10 x 100 M x 16 bytes = 16 GB for the lm, plus one fork's
activations at a time (about 3 GB at batch 16 x 512); the engine 4 replicas' weights, one
gradient and one optimizer state (about 3 GB); plain training 1.6 GB; each plus activations.
Everything fits an 80 GB GPU with room to spare.

``--tiny`` shrinks both models (an lm of 2 layers, d_model 32, context 32, batch 4; ResNet-18's
layout with one block a stage at width 8, on 3x32x32 images of 10 classes, batch 8) and runs 12
steps, so the whole command takes seconds on a CPU; its table checks the plumbing, not the
numbers, and is never written.
"""

from __future__ import annotations

import argparse
import gc
import math
import platform
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
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
METHODS = ("plain", "hpx.Forks", "hpx.Engine")
REPLICAS = 4
SEED = 0
WARMUP_STEPS = 3
PLACEHOLDER = "not yet measured on a GPU: run `python -m benchmarks.gpu` on one"


# ----------------------------------------------------------------------------- models


class Block(nn.Module):
    """A pre-LayerNorm transformer block: causal self-attention, then a GELU MLP (no dropout)."""

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
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
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(ctx, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
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
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
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
        self.blocks = nn.Sequential(*blocks)
        self.fc = nn.Linear(cin, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(self.blocks(self.stem(x)), 1), 1))


# ----------------------------------------------------------------------------- the two set-ups


@dataclass
class Setup:
    """One model's benchmark: how to build it, its data, its losses and its learning rate."""

    name: str
    description: str
    unit: str  # what the throughput counts: "tokens" or "images"
    per_batch: int  # ... in one batch
    build: Callable[[], nn.Module]  # the same initial weights at every call, on the CPU
    lr: float  # the (peak) learning rate of AdamW and OneCycleLR
    batches: list[Any]  # one per step, on the device
    probe: list[Any]  # held-out batches, on the device
    loss: Callable[[nn.Module, Any], torch.Tensor]  # the training loss (a scalar)
    example_loss: Callable[[nn.Module, Any], torch.Tensor]  # the probe's loss of every example
    channels_last: bool = False
    params: int = 0  # counted when the model is first built (warm_up)


def _seeded(build: Callable[[], nn.Module], seed: int) -> Callable[[], nn.Module]:
    """``build`` from torch's global stream seeded with ``seed`` inside ``fork_rng``: the same
    weights at every call, and the global stream left as it was."""

    def made() -> nn.Module:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return build()

    return made


def _autocast(device: torch.device) -> Any:
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")


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
    cut = int(0.9 * len(ids))
    train, held = ids[:cut], ids[cut:]
    g = torch.Generator().manual_seed(SEED)

    def windows(stream: torch.Tensor, starts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        w = torch.stack([stream[s:s + ctx + 1] for s in starts.tolist()]).to(device)
        return w[:, :-1], w[:, 1:]

    batches = [windows(train, torch.randint(0, len(train) - ctx - 1, (batch,), generator=g))
               for _ in range(steps)]
    stride = (len(held) - ctx - 1) // (2 * batch)
    probe = [windows(held, torch.arange(i * batch, (i + 1) * batch) * stride) for i in range(2)]

    def loss(model: nn.Module, b: Any) -> torch.Tensor:
        with _autocast(device):
            logits = model(b[0])
        return F.cross_entropy(logits.float().flatten(0, 1), b[1].flatten())

    def example_loss(model: nn.Module, b: Any) -> torch.Tensor:
        with _autocast(device):
            logits = model(b[0])
        return F.cross_entropy(logits.float().transpose(1, 2), b[1], reduction="none").mean(1)

    build = _seeded(lambda: CausalLM(256, d, layers, heads, ctx), SEED)
    desc = (f"causal transformer LM, {layers} layers, d_model {d}, {heads} heads, byte-level (256), "
            f"context {ctx}; {source}; batch {batch} x {ctx} tokens; probe 2 batches of held-out windows")
    return Setup("lm", desc, "tokens", batch * ctx, build, 3e-3 if tiny else 6e-4, batches, probe,
                 loss, example_loss)


def cnn_setup(tiny: bool, steps: int, device: torch.device) -> Setup:
    """ResNet-18 on random 3x224x224 images of 1000 classes (11.69 M parameters), or one block a
    stage at width 8 on 3x32x32 images of 10 classes with ``--tiny``."""
    width, depth, size, classes, batch = (8, 1, 32, 10, 8) if tiny else (64, 2, 224, 1000, 128)
    g = torch.Generator().manual_seed(SEED + 1)

    def sample() -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(batch, 3, size, size, generator=g).to(device, memory_format=torch.channels_last)
        return x, torch.randint(0, classes, (batch,), generator=g).to(device)

    pool = [sample() for _ in range(4)]
    batches = [pool[i % len(pool)] for i in range(steps)]
    probe = [sample() for _ in range(2)]

    def loss(model: nn.Module, b: Any) -> torch.Tensor:
        with _autocast(device):
            logits = model(b[0])
        return F.cross_entropy(logits.float(), b[1])

    def example_loss(model: nn.Module, b: Any) -> torch.Tensor:
        with _autocast(device):
            logits = model(b[0])
        return F.cross_entropy(logits.float(), b[1], reduction="none")

    build = _seeded(lambda: ResNet18(classes, width, depth), SEED + 1)
    name = "ResNet-18" if depth == 2 else f"ResNet-18's layout with {depth} block(s) a stage, width {width}"
    desc = (f"{name}, channels-last, random 3x{size}x{size} images, {classes} classes "
            f"(a pool of 4 batches, cycled); batch {batch}; probe 2 batches of other random images")
    return Setup("cnn", desc, "images", batch, build, 3e-3 if tiny else 2e-3, batches, probe, loss,
                 example_loss, channels_last=True)


# ----------------------------------------------------------------------------- measuring


@dataclass
class Result:
    """One (model, method) run: its wall time, peak memory, optimizer steps and final probe loss."""

    model: str
    method: str
    wall: float  # seconds
    peak: float | None  # bytes over the method's start, or None when not measured
    units_per_s: float
    optimizer_steps: int
    probe_loss: float
    note: str = ""


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _status(name: str) -> int | None:
    """A memory figure of this process from /proc/self/status in bytes (Linux), else None."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(name + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


class PeakMemory:
    """Peak memory over a region: CUDA's allocator peak over what was allocated at its start, or
    on a CPU the peak resident size over the resident size at its start (Linux: the peak is reset
    through /proc/self/clear_refs); ``None`` where neither is available."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.base: int | None = None

    @staticmethod
    def label(device: torch.device) -> str:
        if device.type == "cuda":
            return "peak MB (torch.cuda.max_memory_allocated, over the data)"
        return "peak MB (CPU: peak RSS growth, /proc VmHWM; n/a where unavailable)"

    def start(self) -> None:
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.device)
            self.base = torch.cuda.memory_allocated(self.device)
        elif self.device.type == "cpu":
            try:
                Path("/proc/self/clear_refs").write_text("5")  # the peak resident size starts again here
                self.base = _status("VmRSS")
            except OSError:
                self.base = None

    def read(self) -> float | None:
        if self.base is None:
            return None
        if self.device.type == "cuda":
            return float(torch.cuda.max_memory_allocated(self.device) - self.base)
        peak = _status("VmHWM")
        return None if peak is None else float(max(0, peak - self.base))


def check_finite(losses: torch.Tensor, what: str = "training loss") -> None:
    """Raise ``FloatingPointError`` naming the first step if ``losses`` (``[steps, ...]``) holds a NaN
    or inf (one host read, after the clock stopped)."""
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
    model = setup.build().to(device)
    return model.to(memory_format=torch.channels_last) if setup.channels_last else model


def _plain(setup: Setup, device: torch.device, steps: int) -> tuple[nn.Module, torch.Tensor, int, dict]:
    model = _model(setup, device)
    _sync(device)
    t0 = time.perf_counter()
    opt = _optimizer(model, setup.lr)
    sched = _scheduler(opt, setup.lr, steps)
    losses = []
    for b in setup.batches[:steps]:
        opt.zero_grad(set_to_none=True)
        loss = setup.loss(model, b)
        loss.backward()
        opt.step()
        sched.step()
        losses.append(loss.detach())
    _sync(device)
    return model, torch.stack(losses), steps, {"wall": time.perf_counter() - t0}


def _forks(setup: Setup, device: torch.device, steps: int) -> tuple[nn.Module, torch.Tensor, int, dict]:
    model = _model(setup, device)
    _sync(device)
    t0 = time.perf_counter()
    opt = _optimizer(model, setup.lr)
    forks = hpx.Forks(model, opt, total_steps=steps, schedule=_scheduler(opt, setup.lr, steps),
                      probe=setup.probe, loss_fn=lambda rep, b: setup.example_loss(rep.model, b))
    losses = []
    for b in setup.batches[:steps]:
        losses.append(forks.step(lambda rep, bb: setup.loss(rep.model, bb), b)[0])  # your run's
    final = forks.converge()
    _sync(device)
    wall = time.perf_counter() - t0
    cuts = [r.step for r in forks.history if r.phase == "cut"]
    kept = ", then ".join(str(k) for _, k in forks.cuts)
    return final, torch.stack(losses), forks.fork_steps, {
        "wall": wall, "note": f"cuts (to {kept} forks) decided at steps {cuts}; ended at "
                              f"{forks.factor:.3g}x the lr"}


def _engine(setup: Setup, device: torch.device, steps: int) -> tuple[nn.Module, torch.Tensor, int, dict]:
    model = _model(setup, device)
    _sync(device)
    t0 = time.perf_counter()
    template = _optimizer(model, setup.lr)  # the schedule's param groups; never stepped
    knobs = hpx.schedule.explore_knobs(_scheduler(template, setup.lr, steps), spread=0.2)
    del template
    engine = hpx.Engine(model, lambda m: _optimizer(m, setup.lr), knobs, replicas=REPLICAS,
                        sync_every=max(1, steps // 4))
    losses = [engine.step(lambda rep, bb: setup.loss(rep.model, bb), b) for b in setup.batches[:steps]]
    final = engine.converge()
    _sync(device)
    wall = time.perf_counter() - t0
    why = engine.unshared_reason
    shared = "one optimizer state" if why is None else f"an optimizer state each ({why})"
    lr = ", ".join(f"{k} {v:.3g}" for k, v in engine.bases.items() if k.startswith("lr"))
    return final, torch.stack(losses), steps * REPLICAS, {
        "wall": wall, "note": f"{REPLICAS} replicas, {shared}; {len(engine.history)} syncs; ended with "
                              f"the lr base at {lr}"}


RUNNERS: dict[str, Callable[[Setup, torch.device, int], tuple[nn.Module, torch.Tensor, int, dict]]] = {
    "plain": _plain, "hpx.Forks": _forks, "hpx.Engine": _engine}


def run_one(setup: Setup, method: str, device: torch.device, steps: int) -> Result:
    """Train ``setup``'s model with ``method`` and measure it; raise (naming both) if it fails or a
    loss is non-finite."""
    mem = PeakMemory(device)
    mem.start()
    try:
        final, losses, opt_steps, info = RUNNERS[method](setup, device, steps)
        peak = mem.read()
        check_finite(losses)
        pl = probe_loss(setup, final)
    except Exception as exc:
        raise RuntimeError(f"benchmarks.gpu: {setup.name} / {method} failed: "
                           f"{type(exc).__name__}: {exc}") from exc
    if not math.isfinite(pl):
        raise FloatingPointError(f"benchmarks.gpu: {setup.name} / {method}: the final probe loss is {pl}")
    wall = info["wall"]
    return Result(setup.name, method, wall, peak, setup.per_batch * steps / wall, opt_steps, pl,
                  info.get("note", ""))


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
    del model, opt
    gc.collect()


# ----------------------------------------------------------------------------- the table


def _ratio(a: float | None, b: float | None, floor: float = 0.0) -> str:
    """``a / b`` to 2 decimals, or "n/a" when either is missing or ``b`` is not above ``floor``."""
    if a is None or b is None or b <= floor:
        return "n/a"
    return f"{a / b:.2f}"


def table(results: list[Result], device: torch.device, units: dict[str, str]) -> str:
    """The markdown table: a row per (model, method), ratios to that model's plain training."""
    lines = [f"| model | method | wall s | x plain | {PeakMemory.label(device)} | x plain | throughput "
             "| optimizer steps | final probe loss |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    plain = {r.model: r for r in results if r.method == "plain"}
    for r in results:
        p = plain[r.model]
        mb = "n/a" if r.peak is None else f"{r.peak / 2 ** 20:,.1f}"
        lines.append(f"| {r.model} | {r.method} | {r.wall:.2f} | {_ratio(r.wall, p.wall)} | {mb} | "
                     f"{_ratio(r.peak, p.peak, floor=2 ** 20)} | {r.units_per_s:,.0f} {units[r.model]}/s | "
                     f"{r.optimizer_steps} | {r.probe_loss:.4f} |")
    return "\n".join(lines)


def _device_text(device: torch.device) -> str:
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return (f"{torch.cuda.get_device_name(device)} ({props.total_memory / 2 ** 30:.0f} GiB), CUDA "
                f"{torch.version.cuda}, bf16 autocast")
    return f"{device.type} ({platform.machine()}, {torch.get_num_threads()} torch thread(s)), float32"


def section(results: list[Result], setups: list[Setup], device: torch.device, steps: int, wall: float,
            command: str) -> str:
    """The gpu section of docs/benchmarks.md (printed on every run, written on CUDA only)."""
    size = max((s.params for s in setups), default=0) / 1e6  # what ran: 100 M, or --tiny's models
    lines = [f"## On one GPU: plain training, `hpx.Forks` and the HDET engine at {size:.3g} M parameters", "",
             f"Command: `{command}` ({wall:.0f} s in all) on {_device_text(device)}; Python "
             f"{platform.python_version()}, torch {torch.__version__}. What is measured: the docstring of "
             f"`benchmarks/gpu.py`. {steps} steps a run; AdamW and OneCycleLR; each method from the same "
             "initial weights on the same batches, one after the other in one process.", ""]
    if device.type != "cuda":
        lines += [f"Not run on a GPU ({PLACEHOLDER}); this table checks the plumbing, not the numbers.", ""]
    for s in setups:
        lines.append(f"- **{s.name}** ({s.params / 1e6:.2f} M parameters): {s.description}.")
    lines += ["", table(results, device, {s.name: s.unit for s in setups}), ""]
    for r in results:
        if r.note:
            lines.append(f"- {r.model} / {r.method}: {r.note}.")
    lines += ["", "Optimizer steps: plain training's; the forks' and their annealed copies' together "
              "(`forks.fork_steps`); the engine's replicas' (each on a quarter of the batch). Throughput: "
              "the run's batches over its wall time (every method trains on the same batches)."]
    return "\n".join(lines)


# ----------------------------------------------------------------------------- the command


def _parse(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.gpu", description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", help="torch device (default cuda)")
    ap.add_argument("--tiny", action="store_true", help="tiny models and 12 steps: seconds on a CPU")
    ap.add_argument("--steps", type=int, default=None,
                    help="steps a run (default 100, 12 with --tiny; at least 10)")
    ap.add_argument("--no-write", action="store_true", help="print the table, do not write the docs")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; print the section; write it into docs/benchmarks.md on CUDA (not with
    ``--tiny`` or ``--no-write``). Raises ``SystemExit`` with a message when CUDA is asked and
    missing; any failure of a method raises."""
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
    if steps < 10:
        raise SystemExit(f"benchmarks.gpu: --steps must be at least 10, so that the forks' cuts fall inside "
                         f"the run (got {steps})")
    _ = hpx.Forks, hpx.Engine, hpx.schedule.explore_knobs  # hpx loads its modules now, not on the clock
    if device.type == "cpu" and not args.tiny:
        print("benchmarks.gpu: the full-size models on a CPU take hours; --tiny checks the plumbing",
              file=sys.stderr)
    threads = torch.get_num_threads()
    if device.type == "cpu":
        torch.set_num_threads(1)
    try:
        start = time.perf_counter()
        setups = [lm_setup(args.tiny, steps, device), cnn_setup(args.tiny, steps, device)]
        results = []
        for s in setups:
            warm_up(s, device)
            for method in METHODS:
                r = run_one(s, method, device, steps)
                print(f"{s.name} / {method}: {r.wall:.2f} s", file=sys.stderr, flush=True)
                results.append(r)
        shown = " ".join(a for a in argv if a != "--no-write")
        text = section(results, setups, device, steps, time.perf_counter() - start,
                       f"python -m benchmarks.gpu {shown}".strip())
    finally:
        torch.set_num_threads(threads)
    print(text)
    if device.type == "cuda" and not args.tiny and not args.no_write:
        report.write_section(DOC, MARKER, text)
        print(f"\nwritten: {DOC.relative_to(ROOT)}, section <!-- {MARKER} -->", file=sys.stderr)
    elif not args.no_write:
        why = "--tiny" if args.tiny else f"on {device.type}, not CUDA"
        print(f"\nnot written to {DOC.relative_to(ROOT)} ({why})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
