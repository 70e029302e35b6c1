"""Peak memory of ``hpx.Forks`` against plain training, in fresh processes.

    python -m benchmarks.forks_memory             # writes the forks-memory section of docs/benchmarks.md
    python -m benchmarks.forks_memory --no-write
    python -m benchmarks.forks_memory --report-only  # the section again from the committed store
    python -m benchmarks.forks_memory --trace        # the full MLP step by step: where the peak lies

Four models, AdamW with OneCycleLR; the MLPs on scikit-learn's bundled digits (64 features,
batches of 64), the LM on the bytes of CPython's ``pydoc_data.topics`` (batches of 16 x 64):

* **full**: an MLP of about 11 M parameters (64 -> 1920 x 4 -> 10), every parameter trained;
* **frozen base**: the same 11 M MLP frozen (``requires_grad=False``; the optimizer is built on
  ``model.parameters()`` all the same, as fine-tuning code often does) under a trainable head of
  0.5 M parameters;
* **lm**: a causal transformer LM of about 5 M parameters (bytes, d_model 256, 6 pre-norm layers of
  4 heads, context 64), every parameter trained;
* **lora**: the 11 M MLP's linear layers frozen, each beside a trainable low-rank adapter of rank 8
  (LoRA-style: ``base(x) + x A B``), and a trainable head: 0.1 M parameters trained.

Each configuration runs in a fresh process: plain training (a hand-written loop), and
``hpx.Forks`` at its defaults for 40 optimizer steps (so both cuts and their annealed windows fall
inside the run) then ``converge()``. The figure is the process's peak resident memory
(``VmHWM``) minus its resident memory once the data is loaded and before the model is built: what
the model, its optimizer, its gradients, the activations and, for Forks, its forks and annealed
copies add. The ratio ``Forks / plain`` is the one the README states. Linux only.

The children run with ``MALLOC_MMAP_THRESHOLD_=65536``: glibc then maps every tensor of 64 KiB or
more on its own and unmaps it when it is freed, so the resident peak is the peak of live tensors.
With glibc's default (a threshold that rises as large blocks are freed) freed tensors stay in the
heap, and the same plain loop measured 280-340 MiB from one run to the next.

The measurement is kept in ``benchmarks/stored/forks_memory.json`` (committed, with the machine it
was made on), and the section is written from it alone, so a clone rebuilds it
(``tests/test_stored_sections.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from benchmarks import _store

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "benchmarks.md"
MARKER = "forks-memory"
STORE = _store.STORED / "forks_memory.json"
COMMAND = "python -m benchmarks.forks_memory"
KINDS = ("full", "frozen", "lm", "lora")
LABELS = {"full": "MLP, every parameter trained", "frozen": "the same MLP frozen, a trainable head",
          "lm": "transformer LM, every parameter trained",
          "lora": "the MLP's linears frozen beside rank-8 adapters (LoRA-style), a trainable head"}
CONTEXT = 64  # the LM's tokens a sequence
LM_BATCH = 16
METHODS = ("plain", "forks")
STEPS = 40
WIDTH = 1920
BATCH = 64
MMAP_THRESHOLD = 1 << 16  # glibc: every block of 64 KiB or more is mapped alone and given back when freed


def _status(field: str) -> int:
    """A memory figure of this process from /proc/self/status, in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field} (this benchmark needs Linux)")


class _Adapted(nn.Module):
    """A frozen linear layer beside a trainable low-rank adapter: ``base(x) + x A B`` (B starts at 0)."""

    def __init__(self, base: nn.Linear, rank: int = 8) -> None:
        super().__init__()
        self.base = base.requires_grad_(False)
        self.a = nn.Parameter(torch.randn(base.in_features, rank) / base.in_features ** 0.5)
        self.b = nn.Parameter(torch.zeros(rank, base.out_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + (x @ self.a) @ self.b


class _LM(nn.Module):
    """A pre-norm causal transformer LM over bytes."""

    def __init__(self, d: int = 256, layers: int = 6, heads: int = 4) -> None:
        super().__init__()
        self.embed, self.pos = nn.Embedding(256, d), nn.Parameter(torch.zeros(CONTEXT, d))
        layer = nn.TransformerEncoderLayer(d, heads, 4 * d, dropout=0.0, batch_first=True, norm_first=True)
        self.body = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d, 256)
        causal = nn.Transformer.generate_square_subsequent_mask(CONTEXT)
        self.register_buffer("mask", causal, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[1]
        h = self.body(self.embed(x) + self.pos[:n], mask=self.mask[:n, :n], is_causal=True)
        return self.head(h)


def _model(kind: str, width: int) -> nn.Module:
    torch.manual_seed(0)
    if kind == "lm":
        return _LM()
    base = nn.Sequential(nn.Linear(64, width), nn.ReLU(), *[m for _ in range(3) for m in
                                                            (nn.Linear(width, width), nn.ReLU())])
    if kind == "full":
        return nn.Sequential(base, nn.Linear(width, 10))
    if kind == "lora":
        base = nn.Sequential(*[_Adapted(m) if isinstance(m, nn.Linear) else m for m in base])
    else:
        base.requires_grad_(False)
    return nn.Sequential(base, nn.Linear(width, 256), nn.ReLU(), nn.Linear(256, 10))


def _loss(model: nn.Module, b: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    out = model(b[0])
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), b[1].reshape(-1))


def _text() -> tuple[torch.Tensor, torch.Tensor]:
    """Windows of CPython's pydoc topics as bytes: inputs and next-byte targets."""
    from pydoc_data.topics import topics

    ids = torch.tensor(list("".join(topics.values()).encode("utf-8")), dtype=torch.long)
    n = (len(ids) - 1) // CONTEXT
    return ids[:n * CONTEXT].reshape(n, CONTEXT), ids[1:n * CONTEXT + 1].reshape(n, CONTEXT)


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    from sklearn.datasets import load_digits

    d = load_digits()
    x = torch.tensor(d.data, dtype=torch.float32) / 16.0
    return x, torch.tensor(d.target)


def _child(kind: str, method: str, steps: int, width: int) -> None:
    import hpx

    torch.set_num_threads(1)
    backend, shard, rank, world = None, None, 0, 1
    if method in SPREAD:  # forks/ranks, forks/sharded: one process of W (torchrun)
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        dist.init_process_group("gloo")
        rank, world = dist.get_rank(), dist.get_world_size()
        backend = hpx.backends.TorchDistributed()
        if method == "forks/sharded":
            mesh = init_device_mesh("cpu", (world,))

            def shard(m: nn.Module) -> None:  # each layer its own unit, then the whole, as FSDP2 does
                for layer in [m for m in m.modules() if isinstance(m, nn.Linear)]:
                    fully_shard(layer, mesh=mesh)
                fully_shard(m, mesh=mesh)
    x, y = _text() if kind == "lm" else _data()
    size, held = (LM_BATCH, 16) if kind == "lm" else (BATCH, 256)
    g = torch.Generator().manual_seed(0)
    order = torch.randperm(len(x) - held, generator=g)  # the last rows are the probe
    batches = [(x[order[i:i + size]], y[order[i:i + size]]) for i in range(0, size * steps, size)
               if i + size <= len(order)]
    while len(batches) < steps:
        batches += batches[: steps - len(batches)]
    part = size // world  # under torchrun each rank trains on its part of every batch
    batches = [(bx[rank * part:(rank + 1) * part], by[rank * part:(rank + 1) * part]) for bx, by in batches]
    probe = [(x[-held:], y[-held:])]
    base = _status("VmRSS")
    model = _model(kind, width)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-3, total_steps=steps)
    if method == "plain":
        for b in batches:
            opt.zero_grad()
            _loss(model, b).backward()
            opt.step()
            sched.step()
        extra = {}
    else:
        forks = hpx.Forks(model, opt, total_steps=steps, schedule=sched, probe=probe, backend=backend,
                          shard=shard)
        trace = []
        for b in batches:
            forks.step(lambda rep, bb: _loss(rep.model, bb), b)
            if method == "forks/trace":  # models alive after the step; resident and peak memory so far
                trace.append((len(forks._forks) + len(forks._clones), _status("VmRSS") - base,
                              _status("VmHWM") - base))
        forks.converge()
        extra = {"fork_steps": forks.fork_steps, **({"trace": trace} if trace else {})}
    peak = _status("VmHWM") - base  # read before the model is built again, for its counts
    resident = _status("VmRSS") - base  # after the run: plain training's weights, gradients, moments
    whole = _model(kind, width)  # the model as built (a sharded one holds a part of it)
    out = {"bytes": peak, "resident": resident, "params": sum(p.numel() for p in whole.parameters()),
           "trained": sum(p.numel() for p in whole.parameters() if p.requires_grad), **extra}
    if world > 1:
        import torch.distributed as dist

        every: list[Any] = [None] * world
        dist.all_gather_object(every, out["bytes"])
        out["bytes"] = max(every)  # the largest rank's peak
        out["ranks"] = every
        if rank == 0:
            print(json.dumps(out))
        dist.destroy_process_group()
        return
    print(json.dumps(out))


def measure(kind: str, method: str, steps: int = STEPS, width: int = WIDTH, ranks: int = 1) -> dict:
    """Run one configuration in a fresh process (``ranks`` > 1: that many gloo processes under
    torchrun); its peak memory over its baseline, in bytes (the largest rank's)."""
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD)}
    run = [sys.executable, "-m"] if ranks == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}", "-m"]
    out = subprocess.run([*run, "benchmarks.forks_memory", "--child", kind, method,
                          str(steps), str(width)], cwd=ROOT, capture_output=True, text=True, env=env)
    if out.returncode != 0:
        raise RuntimeError(f"the {kind}/{method} child failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


RANKS = 4
SPREAD = ("forks/ranks", "forks/sharded")  # under torchrun: every fork on every rank; each fork sharded


def machine() -> str:
    """This machine, as the section names the one it was measured on."""
    return (f"{platform.machine()}, 1 torch thread; Python {platform.python_version()}, "
            f"torch {torch.__version__}")


def section(res: dict, command: str, wall: float, on: str | None = None) -> str:
    """The section's text; ``on``: the machine it was measured on (default: this one)."""
    mib = 2 ** 20
    lines = ["## Forks' peak memory against plain training", "",
             f"Command: `{command}` ({wall:.0f} s) on {on or machine()}. What is measured: the docstring of "
             "`benchmarks/forks_memory.py` (fresh processes; peak resident memory over the process's "
             f"baseline; AdamW, {STEPS} steps, Forks at its defaults).", "",
             "| model | parameters (trained) | plain MiB | Forks MiB | Forks / plain |",
             "| --- | ---: | ---: | ---: | ---: |"]
    for kind in [k for k in KINDS if k in res]:  # a store made before a kind was added lacks its row
        p, f = res[kind]["plain"], res[kind]["forks"]
        lines.append(f"| {LABELS[kind]} | {p['params'] / 1e6:.1f} M ({p['trained'] / 1e6:.2f} M) | "
                     f"{p['bytes'] / mib:.0f} | {f['bytes'] / mib:.0f} | {f['bytes'] / p['bytes']:.2f} |")
    if "ranks" in res:
        one, plain = res["full"]["forks"]["bytes"], res["full"]["plain"]["bytes"]
        bar = one / RANKS + plain
        lines += ["", f"Under torchrun, {RANKS} gloo processes on this machine, the full MLP, each rank "
                  "training on its quarter of every batch: the largest rank's peak over its own baseline "
                  "(taken once the process group is up). The bar: one-process Forks / 4 plus one model's "
                  f"working set (plain training's peak above): {one / mib:.0f} / {RANKS} + "
                  f"{plain / mib:.0f} = {bar / mib:.0f} MiB.", "",
                  "| layout | MiB per rank (largest) | x one-process Forks | within the bar |",
                  "| --- | ---: | ---: | --- |"]
        for method, label in zip(SPREAD, ("every rank holds every fork whole (the default)",
                                          "each fork sharded over the ranks (`shard=`, FSDP2)")):
            b = res["ranks"][method]["bytes"]
            lines.append(f"| {label} | {b / mib:.0f} | {b / one:.2f} | {'yes' if b <= bar else 'no'} |")
    return "\n".join(lines)


def trace(kind: str = "full") -> str:
    """Where Forks' peak lies, step by step (``--trace``): the models alive after each step (forks
    and annealed copies) and the resident memory then and at its peak so far, beside the floor that
    the models alive set: each holds its weights and AdamW's two moments (3 P bytes, P its float32
    parameters' bytes), on top of what plain training's process holds beyond its own model, its
    gradients and its moments (its resident memory after its last step less 4 P). Rows are the
    steps where the models alive change or the peak rises."""
    mib = 2 ** 20
    plain, forks = measure(kind, "plain"), measure(kind, "forks/trace")
    p = 4 * plain["trained"] / mib  # P in MiB; every parameter is trained in the full MLP
    rest = plain["resident"] / mib - 4 * p
    lines = [f"{LABELS[kind]}: P = {p:.1f} MiB of float32 parameters; plain training's peak "
             f"{plain['bytes'] / mib:.0f} MiB, {plain['resident'] / mib:.0f} MiB resident after its last "
             f"step (4 P for weights, gradients and AdamW's moments, and {rest:.0f} MiB besides)", "",
             "| step | models alive | resident MiB | peak so far MiB | floor: 3 P x models + the rest |",
             "| ---: | ---: | ---: | ---: | ---: |"]
    seen = (0, 0)
    for i, (n, rss, hwm) in enumerate(forks["trace"], 1):
        if (n, hwm) != seen and (n != seen[0] or hwm > seen[1]):
            lines.append(f"| {i} | {n} | {rss / mib:.0f} | {hwm / mib:.0f} | {3 * p * n + rest:.0f} |")
        seen = (n, hwm)
    most = max(n for n, _, _ in forks["trace"])
    floor = 3 * p * most + rest
    lines += ["", f"Forks' peak {forks['bytes'] / mib:.0f} MiB = {forks['bytes'] / plain['bytes']:.2f}x "
              f"plain's. With {most} models alive the floor is {floor:.0f} MiB = "
              f"{floor * mib / plain['bytes']:.2f}x plain's before any step's own memory; one fork's "
              f"gradients, the least a step holds, make it {(floor + p) * mib / plain['bytes']:.2f}x."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:
        _child(argv[1], argv[2], int(argv[3]), int(argv[4]))
        return {}
    if argv[:1] == ["--trace"]:
        print(trace())
        return {}
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--no-write", action="store_true",
                   help="print the table only: neither the store nor the docs")
    p.add_argument("--report-only", action="store_true",
                   help="measure nothing: the section from the committed store")
    a = p.parse_args(argv)
    if a.report_only:
        store = _store.load(STORE, COMMAND, DOC, "about 7 min")
        res = store["res"]
    else:
        t0 = time.perf_counter()
        res: dict[str, Any] = {k: {m: measure(k, m) for m in METHODS} for k in KINDS}
        res["ranks"] = {m: measure("full", m, ranks=RANKS) for m in SPREAD}
        store = {"res": res, "wall": time.perf_counter() - t0, "command": COMMAND, "on": machine()}
        if not a.no_write:
            _store.save(STORE, store)
    _store.publish(stored_section(store), MARKER, not a.no_write, DOC)
    return res


def stored_section(store: dict) -> str:
    """The section as written from ``store`` (what :data:`STORE` holds)."""
    return section(store["res"], store["command"], store["wall"], store["on"])


if __name__ == "__main__":
    main()
