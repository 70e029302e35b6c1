"""HDET on torch.distributed: one replica per process, launched by torchrun.

    torchrun --nproc_per_node=4 examples/torchrun_digits.py            # 4 ranks on this machine
    torchrun --nproc_per_node=4 examples/torchrun_digits.py --independent
    python examples/torchrun_digits.py                                  # one process: plain training

Each rank trains one replica of a small MLP on its own shard of scikit-learn's
bundled digits (nothing is downloaded) with its own learning rate and dropout
rate, spread around shared bases. In the default shared mode the model is
wrapped in DistributedDataParallel, which averages the gradients every step;
with ``--independent`` there is no DDP and ranks only meet every ``T`` steps
(local-SGD style). Every ``T`` steps hpx averages the weights and moves the
bases toward the better-scoring side; replicas are scored on one shared batch
(rank 0's), a paired comparison. Rank 0 prints one line per sync (the bases
after it, and the replicas' mean score with its range) and the final validation
accuracy of the averaged model.

On several machines, run the same torchrun command on each with ``--nnodes``,
``--node_rank`` and ``--rdzv_endpoint`` (see ``torchrun --help``). With GPUs the
script uses NCCL and one GPU per process; on CPU it uses gloo.
"""

from __future__ import annotations

import argparse
import math
import os
import socket
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import hpx
from hpx.backends import TorchDistributed


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=600, help="optimizer steps (default 600)")
    p.add_argument("--batch", type=int, default=32, help="examples per rank per step (default 32)")
    p.add_argument("--lr", type=float, default=0.05, help="starting base learning rate (default 0.05)")
    p.add_argument("--sync-every", type=int, default=50, help="T: steps between syncs (default 50)")
    p.add_argument("--warmup", type=int, default=100, help="steps before the bases move (default 100)")
    p.add_argument("--independent", action="store_true", help="no DDP: ranks meet only at syncs")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def single_process_env() -> None:
    """Without torchrun, run as a world of one (what torchrun would have set)."""
    if "RANK" in os.environ:
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))


def digits(rank: int, world: int, device: torch.device, seed: int):
    """This rank's shard of the training split, and the whole validation split."""
    x, y = load_digits(return_X_y=True)
    x = torch.tensor(x / 16.0, dtype=torch.float32)
    y = torch.tensor(y, dtype=torch.long)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))  # same on every rank
    train, val = order[:1500], order[1500:]
    shard = train[rank::world]
    return (x[shard].to(device), y[shard].to(device)), (x[val].to(device), y[val].to(device))


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Dropout(0.1),
                                 nn.Linear(128, 128), nn.ReLU(), nn.Dropout(0.1),
                                 nn.Linear(128, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def main() -> None:
    args = parse_args()
    single_process_env()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(1)  # several ranks share this machine's cores
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    try:
        train(args, rank, world, device)
    finally:
        dist.destroy_process_group()


def train(args: argparse.Namespace, rank: int, world: int, device: torch.device) -> None:
    (x, y), (x_val, y_val) = digits(rank, world, device, args.seed)
    torch.manual_seed(args.seed)  # the same initial weights (hpx broadcasts rank 0's anyway)
    model: nn.Module = MLP().to(device)
    if not args.independent:
        model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    torch.manual_seed(args.seed + 1000 + rank)  # each rank its own batches and dropout masks

    warm, steps = 50, args.steps
    schedule = lambda t: min(1.0, (t + 1) / warm) * 0.5 * (1 + math.cos(math.pi * t / steps))  # noqa: E731
    engine = hpx.Engine(
        model,
        lambda m: torch.optim.SGD(m.parameters(), lr=args.lr, momentum=0.9),
        [hpx.LearningRate("lr", base=args.lr, spread=0.3, schedule=schedule),
         hpx.Dropout("dropout", base=0.1, spread=0.08)],
        backend=TorchDistributed(),
        replicas=1,  # one replica per process
        mode="independent" if args.independent else "shared",
        sync_every=args.sync_every,
        warmup=args.warmup,
        seed=args.seed,
        # Score every replica on the same batch (rank 0's, broadcast) in eval mode: a paired
        # comparison, and dropout is judged by what it did to the weights, not by its own noise.
        signal=hpx.SharedBatch(),
    )

    def loss_fn(rep: hpx.Replica, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return F.cross_entropy(rep.model(batch[0]), batch[1])

    if rank == 0:
        print(f"{world} rank(s), {engine.n_replicas} replicas, mode {engine.config.mode}, "
              f"T = {args.sync_every}, device {device}", flush=True)
    start = time.perf_counter()
    for _ in range(steps):
        idx = torch.randint(0, len(x), (args.batch,), device=device)
        engine.step(loss_fn, (x[idx], y[idx]))
        if rank == 0 and engine.history and engine.history[-1].step == engine.step_count:
            rec = engine.history[-1]
            ok = [s for s in rec.scores if math.isfinite(s)]
            bad = f"  non-finite replicas {rec.nonfinite}" if rec.nonfinite else ""
            print(f"step {rec.step:4d}  base lr {rec.bases['lr']:.4f} (schedule x{schedule(rec.step):.2f})  "
                  f"dropout {rec.bases['dropout']:.3f}  score {sum(ok) / len(ok):.4f} "
                  f"[{min(ok):.4f} .. {max(ok):.4f}]{bad}", flush=True)

    net = engine.converge()  # every rank: the average of all replicas
    net = net.module if isinstance(net, DDP) else net
    net.eval()
    with torch.no_grad():  # a local model, no collectives: fine on one rank alone
        accuracy = (net(x_val).argmax(1) == y_val).float().mean().item()
    if rank == 0:
        print(f"done in {time.perf_counter() - start:.1f} s: validation accuracy {accuracy:.4f} "
              f"({len(y_val)} held-out digits); final bases " +
              ", ".join(f"{k} {v:.4g}" for k, v in engine.bases.items()), flush=True)


if __name__ == "__main__":
    main()
