"""hpx.autolr on a model sharded with FSDP2, launched by torchrun.

    torchrun --nproc_per_node=4 examples/torchrun_fsdp.py               # one replica, 4 shards
    torchrun --nproc_per_node=4 examples/torchrun_fsdp.py --replicas 2  # 2 replicas x 2 shards (HSDP)

The model is sharded with ``torch.distributed.fsdp.fully_shard`` over a device mesh: every
rank holds a 1/S slice of the parameters, gradients and optimizer state. ``hpx.backends.Mesh``
tells hpx which ranks form a replica. With one replica (a 1-D ``"shard"`` mesh) the model
scores autolr's 4 points in turn at each sync; with ``--replicas 2`` the mesh is
``("replicate", "shard")``, FSDP averages the gradients over all ranks (HSDP), and the points
are spread over the two replicas (two rounds of two). Every rank keeps only its shards of the
starting point the search measures from.

Each rank trains on its own slice of scikit-learn's bundled digits (nothing is downloaded).
Rank 0 prints the learning rate at each sync of the search and the final validation accuracy.
With GPUs the script uses NCCL and one GPU per process; on CPU it uses gloo.
"""

from __future__ import annotations

import argparse
import math
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import hpx
from hpx.backends import Mesh


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--replicas", type=int, default=1, help="replicas R; each shards over world / R ranks")
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--batch", type=int, default=16, help="examples per rank per step")
    p.add_argument("--lr", type=float, default=0.01, help="starting (peak) SGD learning rate")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def main() -> None:
    args = parse_args()
    if "RANK" not in os.environ:
        raise SystemExit("launch with torchrun, e.g. torchrun --nproc_per_node=4 examples/torchrun_fsdp.py")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    else:
        torch.set_num_threads(1)  # several ranks share this machine's cores
    device = torch.device("cuda") if cuda else torch.device("cpu")
    dist.init_process_group("nccl" if cuda else "gloo")
    try:
        if world % args.replicas:
            raise SystemExit(f"--replicas {args.replicas} does not divide the {world} processes")
        train(args, rank, world, device)
    finally:
        dist.destroy_process_group()


def train(args: argparse.Namespace, rank: int, world: int, device: torch.device) -> None:
    x, y = load_digits(return_X_y=True)
    x, y = torch.tensor(x / 16.0, dtype=torch.float32), torch.tensor(y, dtype=torch.long)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(args.seed))  # same on every rank
    train_idx, probe_idx, val_idx = order[:1300], order[1300:1500], order[1500:]
    mine = train_idx[rank::world]  # each rank its own slice of the training data
    xt, yt = x[mine].to(device), y[mine].to(device)
    probe = [(x[probe_idx].to(device), y[probe_idx].to(device))]  # the same on every rank

    shards = world // args.replicas
    if args.replicas > 1:
        mesh = init_device_mesh(device.type, (args.replicas, shards), mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("shard",))
    torch.manual_seed(args.seed)  # the same initial weights on every rank, before sharding
    model = nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(),
                          nn.Linear(512, 10)).to(device)
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)  # HSDP on the 2-D mesh: gradients averaged over every rank

    steps, warm = args.steps, args.steps // 10
    schedule = lambda t: min(1.0, (t + 1) / warm) * 0.5 * (1 + math.cos(math.pi * t / steps))  # noqa: E731
    engine = hpx.autolr(model, torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9),
                        total_steps=steps, schedule=schedule, probe=probe, backend=Mesh(mesh),
                        seed=args.seed)

    def loss_fn(rep: hpx.Replica, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return F.cross_entropy(rep.model(batch[0]), batch[1])

    if rank == 0:
        print(f"{world} processes: {args.replicas} replica(s) x {shards} shard(s); start lr {args.lr:g}",
              flush=True)
    gen = torch.Generator().manual_seed(args.seed + rank)
    start = time.perf_counter()
    for _ in range(steps):
        idx = torch.randint(0, len(yt), (args.batch,), generator=gen).to(device)
        engine.step(loss_fn, (xt[idx], yt[idx]))
        rec = engine.history[-1] if engine.history else None
        if rank == 0 and rec is not None and rec.step == engine.step_count and rec.step % 60 == 0:
            print(f"step {rec.step:4d}  {rec.phase:8s} lr {rec.bases['lr'] * args.lr:.4f}", flush=True)

    model.eval()
    with torch.no_grad():  # every rank runs the forward: the sharded layers gather their weights
        logits = model(x[val_idx].to(device))
    accuracy = (logits.argmax(1).cpu() == y[val_idx]).float().mean().item()
    if rank == 0:
        print(f"done in {time.perf_counter() - start:.1f} s: lr {args.lr:g} -> "
              f"{engine.bases['lr'] * args.lr:.4g}; validation accuracy {accuracy:.4f}", flush=True)


if __name__ == "__main__":
    main()
