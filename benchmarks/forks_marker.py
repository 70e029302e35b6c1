"""What the step marker of sharded forks costs: ``hpx.Forks(..., shard=fn)`` on 2 gloo processes (CPU),
a step with the marker against the same step without it, interleaved run by run in one pair of
processes, and the marker's all-reduce alone.

    python -m benchmarks.forks_marker                  # 3 rounds, prints the table
    python -m benchmarks.forks_marker --rounds 5 --width 512

Under ``shard=`` each step starts with one all-reduce of ``2 W`` integers (every rank's point and
step, ``hpx/forks/ranks.py``), so that ranks out of step raise ``ConsistencyError`` instead of
meeting FSDP2's collectives with something else. "Without" removes the step's marker only (the
decisions' stay); nothing else differs. The model is an MLP on scikit-learn's bundled digits
(64 -> ``width`` x 3 -> 10, each hidden layer its own FSDP2 unit), AdamW under OneCycleLR,
``hpx.Forks`` at its defaults, ``total_steps = 24`` (both cuts' annealed copies inside), each rank on
its half of every batch of 64. A run's time is its median step (rank 0's; the ranks wait for each
other); the table gives the minimum and median over the rounds.
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

import torch
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
TOTAL = 24
BATCH = 64


def _child(rounds: int, width: int) -> None:
    import torch.distributed as dist
    from sklearn.datasets import load_digits
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import hpx
    from hpx.forks.faults import _Faults
    from hpx.forks.ranks import send_marker

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    d = load_digits()
    x, y = torch.tensor(d.data, dtype=torch.float32) / 16.0, torch.tensor(d.target)
    part = BATCH // world
    batches = [(x[i + rank * part:i + (rank + 1) * part], y[i + rank * part:i + (rank + 1) * part])
               for i in range(0, BATCH * TOTAL, BATCH)]
    marked = _Faults._mark

    def unmarked(self, when: str, point: int) -> None:  # the step's marker left out, the decisions' kept
        if point != 0:
            marked(self, when, point)

    def shard(m: nn.Module) -> None:
        for block in m[:-1]:
            if isinstance(block, nn.Linear):
                fully_shard(block, mesh=mesh)
        fully_shard(m, mesh=mesh)

    times: dict[str, list[float]] = {"with": [], "without": []}
    for r in range(rounds):
        for how in ("with", "without") if r % 2 == 0 else ("without", "with"):
            _Faults._mark = marked if how == "with" else unmarked  # type: ignore[method-assign]
            torch.manual_seed(0)
            model = nn.Sequential(nn.Linear(64, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                                  nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 10))
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
            sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-3, total_steps=TOTAL)
            forks = hpx.Forks(model, opt, total_steps=TOTAL, schedule=sched, probe=[(x[-256:], y[-256:])],
                              backend=hpx.backends.TorchDistributed(), shard=shard)
            steps = []
            for b in batches:
                t0 = time.perf_counter()
                forks.step(lambda rep, bb: F.cross_entropy(rep.model(bb[0]), bb[1]), b)
                steps.append(time.perf_counter() - t0)
            times[how].append(statistics.median(steps[1:]))
    _Faults._mark = marked  # type: ignore[method-assign]
    collective = hpx.backends.TorchDistributed()
    for _ in range(20):
        send_marker(collective, 0, 0, torch.device("cpu"))
    t0 = time.perf_counter()
    for i in range(500):
        send_marker(collective, 0, i, torch.device("cpu"))
    alone = (time.perf_counter() - t0) / 500
    if rank == 0:
        params = 65 * width + 2 * (width + 1) * width + 10 * (width + 1)
        print(json.dumps({"times": times, "alone": alone, "params": params}))
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:
        _child(int(argv[1]), int(argv[2]))
        return {}
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--width", type=int, default=256)
    a = p.parse_args(argv)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           "-m", "benchmarks.forks_marker", "--child", str(a.rounds), str(a.width)]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env)
    if out.returncode != 0:
        raise RuntimeError(f"the child failed:\n{out.stderr[-3000:]}")
    run = json.loads(out.stdout.strip().splitlines()[-1])
    w, wo = (sorted(1e3 * t for t in run["times"][k]) for k in ("with", "without"))
    ratios = sorted(a / b for a, b in zip(run["times"]["with"], run["times"]["without"]))
    print(f"2 gloo ranks, shard=, MLP of {run['params'] / 1e3:.0f} k parameters (width {a.width}), "
          f"{a.rounds} rounds; {platform.machine()}, torch {torch.__version__}\n\n"
          "| step | ms (min) | ms (median) |\n| --- | ---: | ---: |\n"
          f"| with the marker | {w[0]:.1f} | {statistics.median(w):.1f} |\n"
          f"| without | {wo[0]:.1f} | {statistics.median(wo):.1f} |\n\n"
          f"with / without, round by round: {', '.join(f'{r:.3f}' for r in ratios)}; "
          f"the marker's all-reduce alone: {1e3 * run['alone']:.2f} ms")
    return run


if __name__ == "__main__":
    main()
