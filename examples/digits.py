"""hpx on real data in one process: an MLP on scikit-learn's digits, one model on the CPU.

The recommended way to find the learning rate, ``hpx.Forks``: build the optimizer with the
learning rate you would have used (here 10x below a good one), give the run's length, its
schedule and held-out batches, and train as usual. Your run is forked into whole runs at 0.1x,
0.32x, 1x, 3.2x and 10x that learning rate, on the same batches. At 10% and 25% of the run the
forks are cut (to 3, then to your run and the best challenger), each scored on the held-out
batches as it would end if annealed then; at the end the challenger replaces your run only if it
beats it there by 2 standard errors, example by example. For comparison the script also trains
the same model plainly at the starting learning rate, on the same batches.

    python examples/digits.py                 # about 10 s on one CPU core
    python examples/digits.py --lr 0.3        # start near a good value instead
"""

from __future__ import annotations

import argparse
import math
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


def warmup_cosine(total: int, warm: float = 0.1):
    """The lr's shape: a linear warm-up over the first 10% of the run, then cosine to 0."""
    w = max(1, round(warm * total))
    return lambda t: (t + 1) / w if t < w else 0.5 * (1 + math.cos(math.pi * min(1.0, (t - w) / (total - w))))


def make_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10))


def test_metrics(model: nn.Module, xs, ys) -> tuple[float, float]:
    model.eval()
    with torch.no_grad():
        logits = model(xs)
    return F.cross_entropy(logits, ys).item(), (logits.argmax(1) == ys).float().mean().item()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lr", type=float, default=0.03, help="starting (peak) SGD learning rate")
    ap.add_argument("--steps", type=int, default=1200)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="runs/digits", help="where to write the history and plot")
    args = ap.parse_args()

    torch.set_num_threads(1)
    (xt, yt), probe, (xs, ys) = data(args.seed)
    schedule = warmup_cosine(args.steps)

    def loss_fn(rep: hpx.Replica, batch) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(rep.model(x), y)

    def decided(rec: hpx.SyncRecord) -> None:  # called at each cut and at the end
        scored = ", ".join(f"{m * args.lr:.3g}: " + ("kept" if s != s else f"{s:.4f}")  # nan: your run, kept
                           for m, s in zip(rec.values["lr"], rec.scores))
        print(f"step {rec.step:5d}  {rec.phase:4s} probe loss by lr  {scored}  -> keeps lr "
              f"{rec.bases['lr'] * args.lr:.3g}" if rec.phase == "end" else
              f"step {rec.step:5d}  {rec.phase:4s} probe loss by lr  {scored}")

    model = make_model(args.seed)
    forks = hpx.Forks(
        model,
        torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9),
        total_steps=args.steps,
        schedule=schedule,
        probe=[probe],          # held-out batches the forks are scored on
        on_sync=decided,
    )

    gen = torch.Generator().manual_seed(args.seed)
    start = time.perf_counter()
    print(f"{args.steps} steps, start lr {args.lr:g}")
    for _ in range(args.steps):
        idx = torch.randint(0, len(yt), (args.batch,), generator=gen)
        forks.step(loss_fn, (xt[idx], yt[idx]))
    hpx_loss, hpx_acc = test_metrics(forks.converge(), xs, ys)  # your model, holding the winner
    took = time.perf_counter() - start

    # the same model trained plainly at the starting learning rate, on the same batches
    plain = make_model(args.seed)
    opt = torch.optim.SGD(plain.parameters(), lr=args.lr, momentum=0.9)
    gen = torch.Generator().manual_seed(args.seed)
    for t in range(args.steps):
        idx = torch.randint(0, len(yt), (args.batch,), generator=gen)
        for g in opt.param_groups:
            g["lr"] = args.lr * schedule(t)
        opt.zero_grad()
        F.cross_entropy(plain(xt[idx]), yt[idx]).backward()
        opt.step()
    plain_loss, plain_acc = test_metrics(plain, xs, ys)

    out = Path(args.out)
    hpx.save_history(forks.history, out / "history.json")
    try:
        png = hpx.plot_history(forks.history, out / "trajectories.png", title="digits MLP, hpx.Forks")
        print(f"plot: {png}")
    except ImportError:
        print("(install matplotlib for a plot)")
    print(f"\nlr {args.lr:g} -> {forks.factor * args.lr:.4g}; history: {out / 'history.json'}")
    print(f"hpx.Forks: test loss {hpx_loss:.4f}, accuracy {hpx_acc:.4f} ({took:.1f} s)")
    print(f"plain at lr {args.lr:g}: test loss {plain_loss:.4f}, accuracy {plain_acc:.4f}")


if __name__ == "__main__":
    main()
