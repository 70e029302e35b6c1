"""hpx on real data in one process: an MLP on scikit-learn's digits, 4 replicas on the CPU.

The replicas co-explore the learning rate and the dropout rate. The learning rate
starts 10x below a good value; watch the controller raise it. Replicas are
compared on held-out batches (a probe split), so dropout is judged on what it is
for, generalisation, rather than on the training loss it always raises.

    python examples/digits.py                 # about 15 s on one CPU core
    python examples/digits.py --replicas 8 --lr 0.3
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import nn

import hpx


def data(seed: int):
    """Digits split into train (1197), probe (300) and test (300); nothing is downloaded."""
    x, y = load_digits(return_X_y=True)
    x = torch.tensor(x / 16.0, dtype=torch.float32)
    y = torch.tensor(y, dtype=torch.long)
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    x, y = x[perm], y[perm]
    return (x[:1197], y[:1197]), (x[1197:1497], y[1197:1497]), (x[1497:], y[1497:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--replicas", type=int, default=4)
    ap.add_argument("--lr", type=float, default=0.01, help="starting SGD learning rate")
    ap.add_argument("--dropout", type=float, default=0.2, help="starting dropout rate")
    ap.add_argument("--steps", type=int, default=1200)
    ap.add_argument("--sync-every", type=int, default=25)
    ap.add_argument("--batch", type=int, default=64, help="batch per replica")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="runs/digits", help="where to write the history and plot")
    args = ap.parse_args()

    torch.manual_seed(args.seed)
    torch.set_num_threads(1)
    (xt, yt), probe, (xs, ys) = data(args.seed)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Dropout(args.dropout), nn.Linear(256, 10))

    knobs = [
        hpx.LearningRate("lr", spread=0.5),   # replicas at 0.5x .. 1.5x the base
        hpx.Dropout("dropout", spread=0.1),   # replicas at base -0.1 .. +0.1
    ]

    def loss_fn(rep: hpx.Replica, batch) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(rep.model(x), y)

    engine = hpx.Engine(
        model,
        lambda m: torch.optim.SGD(m.parameters(), lr=args.lr, momentum=0.9),
        knobs,
        replicas=args.replicas,
        sync_every=args.sync_every,
        seed=args.seed,
        signal=hpx.ProbeStream([probe]),  # every replica scored on the same held-out batch
    )

    gen = torch.Generator().manual_seed(args.seed)
    start = time.perf_counter()
    print(f"{args.replicas} replicas, T={args.sync_every}, start lr={args.lr:g} dropout={args.dropout:g}")
    for _ in range(args.steps):
        idx = torch.randint(0, len(yt), (args.batch * args.replicas,), generator=gen)
        engine.step(loss_fn, (xt[idx], yt[idx]))  # split among the replicas
        if engine.history and engine.history[-1].step == engine.step_count:
            rec = engine.history[-1]
            if len(engine.history) % 4 == 0:
                print(f"step {rec.step:5d}  lr {rec.bases['lr']:.4f}  dropout {rec.bases['dropout']:.3f}  "
                      f"probe loss {min(rec.scores):.4f}..{max(rec.scores):.4f}")

    final = engine.converge().eval()
    with torch.no_grad():
        acc = (final(xs).argmax(1) == ys).float().mean().item()
        test_loss = F.cross_entropy(final(xs), ys).item()
    took = time.perf_counter() - start
    print("\nknob trajectories (base at each 8th sync):")
    print(hpx.format_history(engine.history, every=8))
    out = Path(args.out)
    hpx.save_history(engine.history, out / "history.json")
    try:
        png = hpx.plot_history(engine.history, out / "trajectories.png", title="digits MLP, hpx")
        print(f"plot: {png}")
    except ImportError:
        print("(install matplotlib for a plot)")
    print(f"\nlr {args.lr:g} -> {engine.bases['lr']:.4g}, dropout {args.dropout:g} -> "
          f"{engine.bases['dropout']:.3f}")
    print(f"test accuracy {acc:.4f}, test loss {test_loss:.4f}, {took:.1f} s")


if __name__ == "__main__":
    main()
