"""Step time of hpx over plain DDP on torch.distributed (gloo, CPU), measured side by side.

Run it from the repository root::

    python benchmarks/bench_dist.py            # launches 4 gloo ranks with torchrun

It starts ``torchrun --nproc_per_node=4`` on this script. Every rank builds the
same MLP (3.2 M parameters) several times over and trains each copy on the same
synthetic batches:

* ``ddp``: plain DistributedDataParallel (the baseline);
* ``ddp+hook``: DDP with hpx's :func:`~hpx.backends.dist.finite_mean_hook` alone
  (the cost of keeping a NaN rank out of the gradient mean);
* ``hpx``: :class:`hpx.Engine` in shared mode over the DDP model with that hook,
  ``T = 100`` (knobs written, losses gathered, weights averaged every 100 steps);
* ``hpx-noguard``: the same with ``TorchDistributed(nan_guard=False)``;
* ``independent``: hpx in independent mode over the bare model, ``T = 100``
  (no gradient all-reduce at all: weights are averaged every 100 steps);
* ``ddp+pyhook`` (only with ``--variants``): DDP with torch's own Python
  all-reduce hook, the cost of any Python communication hook.

The variants run interleaved: each round times one block of ``--block`` steps
(between barriers, on rank 0) of every variant, in an order that rotates from
round to round, so drift in the machine's speed falls on all of them alike. The
hpx engines count their own steps, so each syncs every ``T`` of its steps
wherever that falls. The ratio to ``ddp`` is total time over total time, with a
bootstrap interval over rounds, for rank 0's wall time and for the CPU time of
all ranks' processes (which load from other work on the machine disturbs less).
About 3 minutes on a 2-CPU machine.

The result replaces the section between ``<!-- bench_dist -->`` and
``<!-- /bench_dist -->`` in ``docs/benchmarks.md`` (created if absent; other
sections are left as they are). ``--no-write`` only prints. The measurement is kept in
``benchmarks/stored/bench_dist.json`` (committed, with the machine it was made on), and the
section is written from it alone, so a clone rebuilds it (``tests/test_stored_sections.py``);
``--report-only`` writes the section again from that store, measuring nothing.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import random
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "benchmarks.md"
STORE = ROOT / "benchmarks" / "stored" / "bench_dist.json"  # benchmarks._store.STORED (run as a script too)
COMMAND = "python benchmarks/bench_dist.py"
BEGIN, END = "<!-- bench_dist -->", "<!-- /bench_dist -->"
VARIANTS = ("ddp", "ddp+hook", "hpx", "hpx-noguard", "independent")
EXTRA = ("ddp+pyhook",)  # DDP with torch's own Python all-reduce hook: what any Python hook costs


def _args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nproc", type=int, default=4, help="gloo ranks (default 4)")
    p.add_argument("--width", type=int, default=1024, help="MLP hidden width (default 1024)")
    p.add_argument("--depth", type=int, default=4, help="hidden layers (default 4)")
    p.add_argument("--batch", type=int, default=32, help="examples per rank per step (default 32)")
    p.add_argument("--sync-every", type=int, default=100, help="T of both hpx variants (default 100)")
    p.add_argument("--steps", type=int, default=300, help="timed steps per variant (default 300)")
    p.add_argument("--block", type=int, default=10, help="steps per timed block (default 10)")
    p.add_argument("--warmup", type=int, default=20, help="untimed steps per variant first (default 20)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank (default 1)")
    p.add_argument("--variants", default=",".join(VARIANTS),
                   help=f"comma-separated, 'ddp' first (default all of {', '.join(VARIANTS)}; also: "
                        f"{', '.join(EXTRA)})")
    p.add_argument("--no-write", action="store_true",
                   help="print only; leave the store and docs/benchmarks.md")
    p.add_argument("--report-only", action="store_true",
                   help="measure nothing: the section from the committed store")
    p.add_argument("--out", help=argparse.SUPPRESS)  # worker: where rank 0 writes its JSON
    return p.parse_args(argv)


# --- the workers (one per rank, started by torchrun) ---------------------------------------


def _mlp(args: argparse.Namespace) -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Linear(64, args.width), nn.ReLU()]
    for _ in range(args.depth - 1):
        layers += [nn.Linear(args.width, args.width), nn.ReLU()]
    layers.append(nn.Linear(args.width, 10))
    return nn.Sequential(*layers)


def _worker(args: argparse.Namespace) -> None:
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.nn.parallel import DistributedDataParallel as DDP

    import hpx
    from hpx.backends.dist import TorchDistributed

    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    backend = TorchDistributed()
    T = args.sync_every

    gen = torch.Generator().manual_seed(rank)
    data = [(torch.randn(args.batch, 64, generator=gen), torch.randint(0, 10, (args.batch,), generator=gen))
            for _ in range(8)]

    def sgd(m: nn.Module) -> torch.optim.Optimizer:
        return torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9)

    knobs = lambda: [hpx.LearningRate("lr", spread=0.25)]  # noqa: E731

    def loss_fn(rep: hpx.Replica, b: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return F.cross_entropy(rep.model(b[0]), b[1])

    def plain(model: nn.Module) -> Callable:
        opt = sgd(model)

        def step(b: tuple[torch.Tensor, torch.Tensor]) -> None:
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(model(b[0]), b[1]).backward()
            opt.step()

        return step

    def pyhook() -> nn.Module:
        model = DDP(_mlp(args))
        model.register_comm_hook(None, allreduce_hook)
        return model

    engines: dict[str, hpx.Engine] = {}

    def engine(name: str, model: nn.Module, collective: TorchDistributed, **settings) -> Callable:
        # (the engine gives a DDP model the NaN-guard hook itself; calling prepare_model
        # first as well is harmless)
        e = engines[name] = hpx.Engine(collective.prepare_model(model), sgd, knobs(), backend=collective,
                                       replicas=1, sync_every=T, seed=0, **settings)
        return lambda b: e.step(loss_fn, b)

    builders: dict[str, Callable[[], Callable]] = {
        # plain DDP: DDP's own (C++) reduction
        "ddp": lambda: plain(DDP(_mlp(args))),
        # DDP with torch's own Python all-reduce hook: the cost of any Python hook
        "ddp+pyhook": lambda: plain(pyhook()),
        # DDP with hpx's NaN-guard hook alone
        "ddp+hook": lambda: plain(backend.prepare_model(DDP(_mlp(args)))),
        # hpx in shared mode over DDP, with and without the NaN guard
        "hpx": lambda: engine("hpx", DDP(_mlp(args)), backend),
        "hpx-noguard": lambda: engine("hpx-noguard", DDP(_mlp(args)), TorchDistributed(nan_guard=False)),
        # hpx in independent mode over the bare model: no gradient traffic
        "independent": lambda: engine("independent", _mlp(args), backend, mode="independent"),
    }
    variants = tuple(args.variants.split(","))  # checked by main()
    steps = {name: builders[name]() for name in variants}

    def block(name: str, n: int) -> tuple[float, float]:
        """(wall seconds on this rank between barriers, CPU seconds of this process)."""
        step = steps[name]
        dist.barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in range(n):
            step(next(batches))
        c1 = time.process_time()  # all of this process's threads (gloo's too)
        dist.barrier()
        return time.perf_counter() - t0, c1 - c0

    batches = itertools.cycle(data)
    for name in variants:  # warm-up: DDP builds its buckets, allocators settle (no sync yet)
        block(name, args.warmup)
    times: dict[str, list[float]] = {n: [] for n in variants}
    cpu = torch.zeros(len(variants), args.steps // args.block, dtype=torch.float64)
    for r in range(cpu.shape[1]):  # each round: one block of each variant, in rotating order
        order = variants[r % len(variants):] + variants[: r % len(variants)]
        for name in order:
            wall, cpu[variants.index(name), r] = block(name, args.block)
            times[name].append(wall)
    dist.all_reduce(cpu)  # CPU seconds summed over ranks
    syncs = {name: len(e.history) for name, e in engines.items()}
    if rank == 0 and args.out:
        n_params = sum(p.numel() for p in _mlp(args).parameters())
        Path(args.out).write_text(json.dumps(
            {"times": times, "cpu": dict(zip(variants, cpu.tolist())), "params": n_params,
             "world": world, "syncs": syncs,
             "load": os.getloadavg()}))
    dist.destroy_process_group()


# --- the launcher ---------------------------------------------------------------------------


def _ratio(values: dict[str, list[float]], name: str, picks: list[list[int]]) -> tuple[float, float, float]:
    """The variant's total over ddp's, and a 95% bootstrap interval over rounds.

    Rounds are resampled as units, so each variant's blocks stay paired with the
    ddp blocks that ran beside them.
    """
    ts, base = values[name], values["ddp"]
    boot = sorted(sum(ts[i] for i in p) / sum(base[i] for i in p) for p in picks)
    return sum(ts) / sum(base), boot[int(0.025 * len(boot))], boot[int(0.975 * len(boot)) - 1]


def _summary(result: dict, block: int, seed: int = 0) -> dict[str, dict[str, float]]:
    times, cpu = result["times"], result["cpu"]
    rng = random.Random(seed)
    rounds = len(times["ddp"])
    picks = [[rng.randrange(rounds) for _ in range(rounds)] for _ in range(2000)]
    out = {}
    for name, ts in times.items():
        wall, wall_lo, wall_hi = _ratio(times, name, picks)
        c, c_lo, c_hi = _ratio(cpu, name, picks)
        out[name] = {"ms_per_step": 1e3 * sum(ts) / (len(ts) * block), "wall": wall, "wall_lo": wall_lo,
                     "wall_hi": wall_hi, "cpu": c, "cpu_lo": c_lo, "cpu_hi": c_hi}
    return out


DESCRIBE = {
    "ddp": "plain DistributedDataParallel with DDP's own (C++) gradient all-reduce.",
    "ddp+pyhook": "DDP with torch's own Python all-reduce hook (`allreduce_hook`), which does "
    "what DDP does: the cost of any Python communication hook. DDP then hands the hook the bucket "
    "unscaled, so the 1/W scaling it otherwise fuses into its gradient copy becomes a separate pass.",
    "ddp+hook": "DDP with hpx's `finite_mean_hook` alone: the price of keeping a NaN or blown-up "
    "rank out of the gradient mean. It is a Python hook, which costs something by itself (measure "
    "it with `--variants ddp,ddp+pyhook,ddp+hook`), plus a norm pass over bucket 0 and a few scalar "
    "operations (the gradient-health verdict) and a one-element all-reduce per step.",
    "hpx": "`hpx.Engine` in shared mode over the DDP model, with that hook: knob writes, losses "
    "accumulated on device, and every T steps one gather of the scores and one flat all-reduce of "
    "the weights and buffers.",
    "hpx-noguard": "the same with `TorchDistributed(nan_guard=False)`: DDP keeps its own reduction, "
    "and a NaN on one rank reaches all (the engine then stops at the sync).",
    "independent": "hpx without DDP (local-SGD style): no gradient traffic at all, weights averaged "
    "every T steps.",
}


def _pct(r: float) -> str:
    return f"{100 * (r - 1):+.1f}%"


def machine() -> tuple[str, int]:
    """This machine, as the section names the one it was measured on, and its logical cores."""
    cpus = os.cpu_count() or 1
    return (f"{cpus} CPUs ({platform.machine()}), {platform.system()}, Python {platform.python_version()}, "
            f"torch {torch.__version__}", cpus)


def _section(args: argparse.Namespace, argv: list[str], result: dict, summary: dict, wall: float,
             on: tuple[str, int] | None = None) -> str:
    """The section's text; ``on``: the machine it was measured on and its cores (default: this one)."""
    on_, cpus = on or machine()
    rows = []
    for name in result["times"]:
        s = summary[name]
        rows.append(f"| {name} | {s['ms_per_step']:.1f} | {s['wall']:.3f} ({_pct(s['wall'])}) "
                    f"| {_pct(s['wall_lo'])} to {_pct(s['wall_hi'])} | {s['cpu']:.3f} ({_pct(s['cpu'])}) "
                    f"| {_pct(s['cpu_lo'])} to {_pct(s['cpu_hi'])} |")
    load = ", ".join(f"{x:.1f}" for x in result["load"])
    # its own ranks load the machine to about max(cores, ranks); more than one above that is other work
    shared = result["load"][0] > max(cpus, args.nproc) + 1
    busy = " (the machine was shared with other work)." if shared else "."
    return "\n".join([
        BEGIN,
        "## torch.distributed: hpx over plain DDP (gloo, CPU)",
        "",
        f"Command: `{' '.join(['python benchmarks/bench_dist.py', *argv])}` "
        f"(it starts `torchrun --nproc_per_node={args.nproc}` "
        f"on itself; this run took {wall:.0f} s).",
        "",
        f"Machine: {on_}; {result['world']} gloo ranks "
        f"with {args.threads} torch thread(s) each; load average at the end {load}{busy}",
        "",
        f"Model: MLP 64 -> {args.depth} x {args.width} -> 10 ({result['params'] / 1e6:.2f} M parameters), "
        f"batch {args.batch} per rank, SGD with momentum; hpx with one LearningRate knob, "
        f"T = {args.sync_every} ({max(result['syncs'].values(), default=0)} syncs in the timed steps). "
        f"{args.steps} timed steps per variant after {args.warmup} untimed ones, in blocks of "
        f"{args.block} steps between barriers; each round runs one block of every variant, in an "
        "order that rotates each round. Wall: rank 0's time between barriers, the variant's total "
        "over ddp's. CPU: CPU seconds of all ranks' processes (every thread), total over ddp's, "
        "which machine load disturbs less. Intervals: 95% bootstrap over rounds.",
        "",
        "| variant | ms/step | wall / ddp | 95% interval | CPU / ddp | 95% interval |",
        "| --- | --- | --- | --- | --- | --- |",
        *rows,
        "",
        *(f"- `{name}`: {DESCRIBE[name]}" for name in result["times"]),
        END,
    ])


def _write_section(section: str) -> None:
    text = DOC.read_text() if DOC.exists() else "# Benchmarks\n"
    if BEGIN in text and END in text:
        head, rest = text.split(BEGIN, 1)
        tail = rest.split(END, 1)[1]
        text = head + section + tail
    else:
        text = text.rstrip("\n") + "\n\n" + section + "\n"
    DOC.parent.mkdir(parents=True, exist_ok=True)
    DOC.write_text(text)


def narrower(variants: list[str]) -> None:
    """Refuse, before anything runs, a run of fewer variants than the stored section shows (it would
    write the section without the others' rows), naming the run that keeps them."""
    shown = json.loads(STORE.read_text())["args"]["variants"].split(",") if STORE.exists() else []
    lacking = [v for v in shown if v not in variants]
    if lacking:
        sys.path.insert(0, str(ROOT))  # run as a script: the repository's benchmarks package
        from benchmarks import _store

        every = ",".join([*shown, *(v for v in variants if v not in shown)])
        command = COMMAND if every == ",".join(VARIANTS) else f"{COMMAND} --variants {every}"
        _store.refuse_narrower("bench_dist", f"the rows of {', '.join(lacking)}", command, DOC,
                               "or add --no-write to measure these alone")


def stored_section(store: dict) -> str:
    """The section as written from ``store`` (what :data:`STORE` holds): its summary recomputed
    from the stored times (the bootstrap is seeded)."""
    args = argparse.Namespace(**store["args"])
    summary = _summary(store["result"], args.block)
    on = (store["on"], store["cpus"])
    return _section(args, store["argv"], store["result"], summary, store["wall"], on)


def main(argv: list[str] | None = None) -> None:
    args = _args(argv)
    if args.report_only:
        sys.path.insert(0, str(ROOT))  # run as a script: the repository's benchmarks package
        from benchmarks import _store

        section = stored_section(_store.load(STORE, COMMAND, DOC, "about 3 min"))
        print(section)
        _write_section(section)
        return
    variants = args.variants.split(",")
    if variants[0] != "ddp" or not set(variants) <= set(VARIANTS + EXTRA) or args.steps < args.block:
        raise SystemExit(f"--variants must start with ddp and name only {', '.join(VARIANTS + EXTRA)} "
                         f"(got {args.variants}); --steps must be at least --block")
    if "LOCAL_RANK" in os.environ:  # started by torchrun
        _worker(args)
        return
    if not args.no_write:  # the variants are measured side by side: fewer would take rows away
        narrower(variants)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc_per_node={args.nproc}", str(Path(__file__).resolve()),
               *(argv if argv is not None else sys.argv[1:]), "--out", str(out)]
        env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
        start = time.perf_counter()
        subprocess.run(cmd, check=True, env=env)
        wall = time.perf_counter() - start
        result = json.loads(out.read_text())
    shown = [a for a in (argv if argv is not None else sys.argv[1:]) if a != "--no-write"]
    on, cpus = machine()
    store = {"args": {k: v for k, v in vars(args).items() if k not in ("out", "no_write", "report_only")},
             "argv": shown, "result": result, "wall": wall, "on": on, "cpus": cpus}
    section = stored_section(store)
    print(section)
    if not args.no_write:
        STORE.parent.mkdir(parents=True, exist_ok=True)
        STORE.write_text(json.dumps(store, separators=(",", ":")) + "\n")
        _write_section(section)
        print(f"\nwrote {DOC.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
