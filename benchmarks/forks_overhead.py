"""What ``hpx.Forks`` adds beyond its optimizer steps: its wall time against a hand-written loop
that takes the same steps.

    python -m benchmarks.forks_overhead               # writes its section of docs/benchmarks.md
    python -m benchmarks.forks_overhead --no-write
    python -m benchmarks.forks_overhead --report-only # the section again from the committed store

An MLP (64 -> 512 -> 512 -> 10) on scikit-learn's bundled digits, AdamW under OneCycleLR, batches
of 64 drawn from the first 797 rows, 300 optimizer steps; the probe is 100 or 1,000 of the other
rows (in batches of 250), its loss per example (``reduction="none"``) or the batch's mean (the
end's test then needs each example's loss alone: :func:`hpx._fork_probe._each_example`).

``hpx.Forks`` runs at its defaults and records how many models it stepped at each step (forks and
annealed copies). The hand-written loop steps that many independent copies of the model, optimizer
and scheduler on the same batches, step by step: the same optimizer steps, and nothing else (no
probe, no copies made, no decision). The ratio of their wall times is what Forks adds beyond its
steps: the copies it makes, the probe passes at every cut, the end's test, its checks. Each pair
runs back to back, five pairs per case, in one process with one torch thread; the table gives the
median time of each and the median of the five ratios (single ratios spread by several percent
on these machines).

The measurement is kept in ``benchmarks/stored/forks_overhead.json`` (committed, with the machine
it was made on) and the section is written from it alone (``tests/test_stored_sections.py``).
"""

from __future__ import annotations

import argparse
import copy
import logging
import platform
import statistics
import sys
import time
import warnings
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import hpx
from benchmarks import _store

DOC = _store.DOC
MARKER = "forks-overhead"
STORE = _store.STORED / "forks_overhead.json"
COMMAND = "python -m benchmarks.forks_overhead"
STEPS = 300
BATCH = 64
TRAIN_ROWS = 797
REPEATS = 5
CASES = ((100, "per example"), (1000, "per example"), (1000, "mean"))
BAR = 1.05


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    from sklearn.datasets import load_digits

    d = load_digits()
    x = torch.tensor(d.data, dtype=torch.float32)
    return (x - x.mean(0)) / (x.std(0) + 1e-6), torch.tensor(d.target)


def _setup(x: torch.Tensor, y: torch.Tensor, probe_rows: int):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=3e-3, total_steps=STEPS)
    g = torch.Generator().manual_seed(0)
    picks = [torch.randint(0, TRAIN_ROWS, (BATCH,), generator=g) for _ in range(STEPS)]
    batches = [(x[i], y[i]) for i in picks]
    rows = torch.arange(TRAIN_ROWS, TRAIN_ROWS + probe_rows)
    probe = [(x[r], y[r]) for r in rows.split(250)]
    return model, opt, sched, batches, probe


def _loss(rep: Any, b: Any) -> torch.Tensor:
    return F.cross_entropy(rep.model(b[0]), b[1])


def _per_example(rep: Any, b: Any) -> torch.Tensor:
    return F.cross_entropy(rep.model(b[0]), b[1], reduction="none")


def _forks(x: torch.Tensor, y: torch.Tensor, probe_rows: int, kind: str) -> tuple[float, list[int], float]:
    """Forks' wall time, the models it stepped at each step, and its steps over plain training's."""
    model, opt, sched, batches, probe = _setup(x, y, probe_rows)
    t0 = time.perf_counter()
    forks = hpx.Forks(model, opt, total_steps=STEPS, schedule=sched, probe=probe,
                      loss_fn=_per_example if kind == "per example" else _loss)
    live = []
    for b in batches:
        live.append(len(forks._trained()))
        forks.step(_loss, b)
    forks.converge()
    return time.perf_counter() - t0, live, forks.fork_steps / forks.step_count


def _hand(x: torch.Tensor, y: torch.Tensor, probe_rows: int, live: list[int]) -> float:
    """The hand-written loop: ``live[t]`` independent copies of the run stepped on batch ``t``."""
    model, opt, sched, batches, _ = _setup(x, y, probe_rows)
    t0 = time.perf_counter()
    runs = [(model, opt, sched)] + [copy.deepcopy((model, opt, sched)) for _ in range(max(live) - 1)]
    with warnings.catch_warnings():  # a copied scheduler's optimizer is not wrapped by torch's order check
        warnings.filterwarnings("ignore", message=r"Seems like `optimizer\.step\(\)`")
        for n, (bx, by) in zip(live, batches):
            for m, o, s in runs[:n]:
                loss = F.cross_entropy(m(bx), by)
                o.zero_grad(set_to_none=True)
                loss.backward()
                o.step()
                s.step()
    return time.perf_counter() - t0


def measure() -> list[dict[str, Any]]:
    torch.set_num_threads(1)
    logging.getLogger("hpx").setLevel(logging.WARNING)
    x, y = _data()
    out = []
    for rows, kind in CASES:
        forks_s, hand_s, steps = [], [], 0.0
        for _ in range(REPEATS):
            t, live, steps = _forks(x, y, rows, kind)
            forks_s.append(t)
            hand_s.append(_hand(x, y, rows, live))
        out.append({"probe": rows, "loss": kind, "steps": steps, "forks": forks_s, "hand": hand_s})
        print(out[-1], file=sys.stderr)
    return out


def machine() -> str:
    return (f"{platform.machine()}, 1 torch thread; Python {platform.python_version()}, "
            f"torch {torch.__version__}")


def section(res: list[dict[str, Any]], command: str, wall: float, on: str) -> str:
    lines = ["## What Forks adds beyond its steps", "",
             f"Command: `{command}` ({wall:.0f} s) on {on}. What is measured: the docstring of "
             f"`benchmarks/forks_overhead.py` (an MLP on digits, {STEPS} steps, Forks at its defaults, "
             "against a hand-written loop that takes the same optimizer steps; medians of "
             f"{REPEATS} pairs run back to back). The bar: at most {BAR:.2f}x, whatever the "
             "probe's size.", "",
             "| probe rows | probe loss | Forks' steps / plain's | Forks s | hand-written loop s | "
             "Forks / loop (median of the pairs) | within the bar |",
             "| ---: | --- | ---: | ---: | ---: | ---: | --- |"]
    for r in res:
        f, h = statistics.median(r["forks"]), statistics.median(r["hand"])
        ratio = statistics.median(a / b for a, b in zip(r["forks"], r["hand"]))
        lines.append(f"| {r['probe']:,} | {r['loss']} | {r['steps']:.2f} | {f:.2f} | {h:.2f} | {ratio:.3f} | "
                     f"{'yes' if ratio <= BAR else 'no'} |")
    return "\n".join(lines)


def stored_section(store: dict) -> str:
    """The section as written from ``store`` (what :data:`STORE` holds)."""
    return section(store["res"], store["command"], store["wall"], store["on"])


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--no-write", action="store_true",
                   help="print the table only: neither the store nor the docs")
    p.add_argument("--report-only", action="store_true",
                   help="measure nothing: the section from the committed store")
    a = p.parse_args(sys.argv[1:] if argv is None else argv)
    if a.report_only:
        store = _store.load(STORE, COMMAND, DOC, "about 2 min")
    else:
        t0 = time.perf_counter()
        res = measure()
        store = {"res": res, "wall": time.perf_counter() - t0, "command": COMMAND, "on": machine()}
        if not a.no_write:
            _store.save(STORE, store)
    _store.publish(stored_section(store), MARKER, not a.no_write, DOC)
    return store["res"]


if __name__ == "__main__":
    main()
