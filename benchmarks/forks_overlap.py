"""``hpx.Forks`` under torch.distributed: step time and peak memory per rank of the step's paths, on
2 gloo processes (CPU), fresh processes per run, the paths interleaved round by round.

    python -m benchmarks.forks_overlap                 # 3 rounds, prints the table
    python -m benchmarks.forks_overlap --rounds 5 --width 1024 --steps 24

The paths (``hpx/forks/early.py``):

* **joint**: ``forks.step`` as it was before each fork's reduction was overlapped: every fork's
  backward, then one all-reduce over every fork's gradients together, then every optimizer step;
* **per-fork**: ``backward()`` then ``optimizer_step()`` as they are now (``forks._overlap = False``):
  every fork's backward, then each fork's all-reduce in turn (the same per-fork buffers as ``step``),
  then every optimizer step;
* **overlapped**: ``forks.step`` now: each fork's all-reduce sent as its backward ends and waited on
  after the next fork's backward, the fork then stepped and its gradients freed.

The three give the same run bit for bit over two ranks (``tests/test_forks_overlap.py``). The model
is an MLP on scikit-learn's bundled digits (64 -> ``width`` x 3 -> 10), AdamW under OneCycleLR,
``hpx.Forks`` at its defaults, ``total_steps = 60``, each rank training on its half of every batch
of 64; ``steps`` steps are timed (both cuts' annealed copies fall inside 24: nine models trained per
step at the first's). The step time is each run's median step past the first (rank 0's; the ranks
wait for each other), and the memory each run's peak resident memory over the process's baseline
once the process group is up (``VmHWM``; the largest rank's), the children run with
``MALLOC_MMAP_THRESHOLD_=65536`` as in ``benchmarks/forks_memory.py``. The table gives the minimum and
the median over the rounds. Linux only.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
PATHS = ("joint", "per-fork", "overlapped")
TOTAL = 60
BATCH = 64
MMAP_THRESHOLD = 1 << 16


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field} (this benchmark needs Linux)")


@torch.no_grad()
def _joint_mean(trained: list, collective: Any) -> tuple[Any, Any]:
    """The reduction ``forks.step`` took before: per dtype, one all-reduce over every fork's gradients
    together (in buckets of at most 2^24 elements), with how many ranks had each gradient."""
    from hpx._buckets import dtype_groups
    from hpx.forks.ranks import _buckets, _mean_bucket, either

    params = [p for f in trained for p in f.model.parameters() if p.requires_grad]
    apart = met = None
    for idx in dtype_groups(params, skip_empty=True).values():
        for ps in _buckets([params[i] for i in idx]):
            had = [p.grad is not None for p in ps]
            flat = torch.cat([p.grad.reshape(-1) if p.grad is not None else p.new_zeros(p.numel())
                              for p in ps] + [torch.tensor(had, dtype=ps[0].dtype)])
            collective.all_reduce_sum_([flat])
            odd, m = _mean_bucket(ps, flat, had, collective.world_size, False)
            apart, met = either(apart, odd), either(met, m)
    return apart, met


def _child(path: str, steps: int, width: int) -> None:
    import torch.distributed as dist
    from sklearn.datasets import load_digits

    import hpx
    import hpx.forks.search

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    d = load_digits()
    x, y = torch.tensor(d.data, dtype=torch.float32) / 16.0, torch.tensor(d.target)
    g = torch.Generator().manual_seed(0)
    order = torch.randperm(len(x) - 256, generator=g)
    part = BATCH // world
    batches = [(x[order[i:i + BATCH]][rank * part:(rank + 1) * part],
                y[order[i:i + BATCH]][rank * part:(rank + 1) * part])
               for i in range(0, len(order) - BATCH, BATCH)][:steps]
    probe = [(x[-256:], y[-256:])]
    base = _status("VmRSS")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, width), nn.ReLU(), *[m for _ in range(2) for m in
                                                             (nn.Linear(width, width), nn.ReLU())],
                          nn.Linear(width, 10))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-3, total_steps=TOTAL)
    forks = hpx.Forks(model, opt, total_steps=TOTAL, schedule=sched, probe=probe,
                      backend=hpx.backends.TorchDistributed())
    if path != "overlapped":
        forks._overlap = False
    if path == "joint":
        hpx.forks.search.mean_over_ranks = _joint_mean
    times = []
    for b in batches:
        t0 = time.perf_counter()
        forks.step(lambda rep, bb: F.cross_entropy(rep.model(bb[0]), bb[1]), b)
        times.append(time.perf_counter() - t0)
    peak = _status("VmHWM") - base
    every: list[Any] = [None] * world
    dist.all_gather_object(every, peak)
    if rank == 0:
        print(json.dumps({"times": times, "bytes": max(every), "ranks": every,
                          "params": sum(p.numel() for p in model.parameters())}))
    dist.destroy_process_group()


def measure(path: str, steps: int, width: int, ranks: int = 2) -> dict:
    """One run of ``path`` on ``ranks`` fresh gloo processes (torchrun)."""
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}",
           "-m", "benchmarks.forks_overlap", "--child", path, str(steps), str(width)]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env)
    if out.returncode != 0:
        raise RuntimeError(f"the {path} child failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def table(runs: dict[str, list[dict]], width: int, steps: int, rounds: int) -> str:
    mib = 2 ** 20
    params = runs[PATHS[0]][0]["params"]
    lines = [f"2 gloo ranks, MLP of {params / 1e6:.1f} M parameters (width {width}), {steps} steps timed, "
             f"{rounds} rounds; {platform.machine()}, torch {torch.__version__}", "",
             "| path | step ms (min) | step ms (median) | peak MiB per rank (min) | (median) |",
             "| --- | ---: | ---: | ---: | ---: |"]
    for path in PATHS:
        ms = [1e3 * statistics.median(r["times"][1:]) for r in runs[path]]
        mem = [r["bytes"] / mib for r in runs[path]]
        lines.append(f"| {path} | {min(ms):.1f} | {statistics.median(ms):.1f} | {min(mem):.0f} | "
                     f"{statistics.median(mem):.0f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, list[dict]]:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:
        _child(argv[1], int(argv[2]), int(argv[3]))
        return {}
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--width", type=int, default=1024)
    a = p.parse_args(argv)
    runs: dict[str, list[dict]] = {path: [] for path in PATHS}
    for r in range(a.rounds):  # interleaved: a machine that slows down slows every path alike
        for path in PATHS if r % 2 == 0 else PATHS[::-1]:
            runs[path].append(measure(path, a.steps, a.width))
    print(table(runs, a.width, a.steps, a.rounds))
    return runs


if __name__ == "__main__":
    main()
