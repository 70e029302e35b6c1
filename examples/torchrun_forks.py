"""hpx.Forks on torch.distributed, launched by torchrun: every fork data-parallel over the ranks.

    torchrun --nproc_per_node=2 examples/torchrun_forks.py           # 2 ranks on this machine
    torchrun --nproc_per_node=2 examples/torchrun_forks.py --shard   # each fork sharded (FSDP2)
    python examples/torchrun_forks.py                                # one process, the same search

An MLP on scikit-learn's bundled digits (nothing is downloaded), started 10x below a good
learning rate. Every rank holds every fork (your run and its copies at 0.1x to 10x the learning
rate) and trains it on its own share of each batch; each fork's gradients are averaged over the
ranks at every step, so each fork is ordinary data-parallel training. Every rank scores the same
held-out batch, and rank 0's decisions are broadcast. Rank 0 prints a line per decision and the
final test metrics of your model, which then holds the winner.

With ``--shard`` each fork (your run included) is sharded over the ranks with FSDP2
(``shard=``: ``fully_shard`` on each layer, then on the model), so each rank holds a 1/W part of
every fork and its gradients are reduce-scattered during the backward: the memory of the forks
divided by the ranks, for a model that fits once per device. The decisions are the same.

On several machines, run the same torchrun command on each with ``--nnodes``, ``--node_rank`` and
``--rdzv_endpoint`` (see ``torchrun --help``). With GPUs the script uses NCCL and one GPU per
process; on CPU it uses gloo.
"""

from __future__ import annotations

import argparse
import gc
import math
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import nn

import hpx


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lr", type=float, default=0.03, help="starting (peak) SGD learning rate")
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--batch", type=int, default=64, help="the global batch, shared by the ranks")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--shard", action="store_true", help="shard each fork over the ranks (FSDP2)")
    args = ap.parse_args()

    distributed = "RANK" in os.environ  # launched by torchrun
    cuda = torch.cuda.is_available()
    if not distributed:
        train(args, 0, 1, torch.device("cuda" if cuda else "cpu"), distributed)
        return
    dist.init_process_group("nccl" if cuda else "gloo")
    try:
        train(args, dist.get_rank(), dist.get_world_size(),
              torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if cuda else "cpu"), distributed)
    finally:
        gc.collect()  # nothing of the run may outlive the process group (torch aborts at exit otherwise)
        dist.destroy_process_group()


def train(args: argparse.Namespace, rank: int, world: int, device: torch.device, distributed: bool) -> None:
    torch.set_num_threads(1)

    x, y = load_digits(return_X_y=True)
    x = torch.tensor(x / 16.0, dtype=torch.float32, device=device)
    y = torch.tensor(y, dtype=torch.long, device=device)
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(args.seed)).to(device)
    x, y = x[perm], y[perm]
    (xt, yt), probe, (xs, ys) = (x[:1197], y[:1197]), (x[1197:1497], y[1197:1497]), (x[1497:], y[1497:])

    torch.manual_seed(args.seed)  # the same initial weights everywhere (hpx broadcasts rank 0's)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10)).to(device)
    warm = max(1, args.steps // 10)

    def schedule(t: int) -> float:  # linear warm-up, then cosine to 0
        if t < warm:
            return (t + 1) / warm
        return 0.5 * (1 + math.cos(math.pi * (t - warm) / (args.steps - warm)))

    def decided(rec: hpx.SyncRecord) -> None:
        if rank == 0:
            scored = ", ".join(f"{m * args.lr:.3g}: " + ("kept" if s != s else f"{s:.4f}")  # nan: yours
                               for m, s in zip(rec.values["lr"], rec.scores))
            print(f"step {rec.step:5d}  {rec.phase:4s} probe loss by lr  {scored}", flush=True)

    shard = None
    if args.shard and distributed:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(device.type, (world,))

        def shard(m: nn.Module) -> None:  # as an FSDP2 script shards its model: each layer, then the whole
            for layer in m:
                if isinstance(layer, nn.Linear):
                    fully_shard(layer, mesh=mesh)
            fully_shard(m, mesh=mesh)

    forks = hpx.Forks(
        model,
        torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9),
        total_steps=args.steps,
        schedule=schedule,
        probe=[probe],                                       # the same batch on every rank
        backend=hpx.backends.TorchDistributed() if distributed else None,
        on_sync=decided,
        shard=shard,                                         # None: every rank holds every fork whole
    )
    gen = torch.Generator().manual_seed(args.seed)  # every rank draws the same global batch ...
    for _ in range(args.steps):
        idx = torch.randint(0, len(yt), (args.batch,), generator=gen).to(device)
        mine = idx.tensor_split(world)[rank]         # ... and trains on its share of it
        forks.step(lambda rep, b: F.cross_entropy(rep.model(b[0]), b[1]), (xt[mine], yt[mine]))
    model = forks.converge()                         # your model, holding the winner

    model.eval()  # every rank evaluates (a sharded model gathers its layers from every rank)
    with torch.no_grad():
        logits = model(xs)
    loss, acc = F.cross_entropy(logits, ys).item(), (logits.argmax(1) == ys).float().mean().item()
    if rank == 0:
        print(f"{world} rank(s): lr {args.lr:g} -> {forks.factor * args.lr:.4g}; test loss {loss:.4f}, "
              f"accuracy {acc:.4f}")


if __name__ == "__main__":
    main()
