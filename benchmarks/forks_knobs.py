"""What knobs add to ``hpx.Forks``' cost: its optimizer steps and wall time over plain training's,
with no knob and with one, two and three knobs besides the learning rate.

    python -m benchmarks.forks_knobs               # writes its section of docs/benchmarks.md
    python -m benchmarks.forks_knobs --no-write
    python -m benchmarks.forks_knobs --report-only # the section again from the committed store

An MLP (64 -> 256 -> 256 -> 10, two ``nn.Dropout`` at 0.1) on scikit-learn's bundled digits,
AdamW (weight decay 0.01) under a cosine schedule, batches of 64 from the first 1,000 rows,
300 optimizer steps; the probe is 400 of the other rows, scored per example without smoothing.
At the defaults (``knob_design="split"``) each knob with a lower side adds a fork from the start,
that knob moved down by its spread, raced and cut with the lr's forks, and the knobs add one fork
in all, every knob moved up, branched from your run at 70% of the run (``knob_start``) and run to
the end: ``hpx.Dropout(spread=0.2)``,
then ``hpx.WeightDecay(group=0, span=10)``, then ``hpx.LabelSmoothing(base=0.1, spread=0.05)``
(the training loss reads the fork's value).

The steps are counted by ``forks.fork_steps`` (all forks and annealed copies); they follow from the
settings, not from the machine. Wall time: plain training and every Forks setting run back to
back in rounds (``REPEATS``), in one process with one torch thread; the table gives the median of
each setting's ratios to plain training in the same round.

The measurement is kept in ``benchmarks/stored/forks_knobs.json`` (committed, with the machine it
was made on) and the section is written from it alone (``tests/test_stored_sections.py``).
"""

from __future__ import annotations

import logging
import math
import platform
import statistics
import sys
import time
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import hpx
from benchmarks import _store

DOC = _store.DOC
MARKER = "forks-knobs"
STORE = _store.STORED / "forks_knobs.json"
COMMAND = "python -m benchmarks.forks_knobs"
STEPS = 300
BATCH = 64
TRAIN_ROWS = 1000
PROBE_ROWS = 400
REPEATS = 3
SETTINGS = ("no knob", "dropout", "dropout, weight decay", "dropout, weight decay, label smoothing")


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    return torch.tensor(x / 16.0, dtype=torch.float32), torch.tensor(y, dtype=torch.long)


def _knobs(n: int) -> list[hpx.Knob]:
    return [hpx.Dropout(spread=0.2), hpx.WeightDecay(group=0, span=10),
            hpx.LabelSmoothing(base=0.1, spread=0.05)][:n]


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Dropout(0.1), nn.Linear(256, 256), nn.ReLU(),
                         nn.Dropout(0.1), nn.Linear(256, 10))


def _batches(x: torch.Tensor, y: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    out = []
    while len(out) < STEPS:
        order = torch.randperm(TRAIN_ROWS, generator=g)
        out += [(x[order[i:i + BATCH]], y[order[i:i + BATCH]])
                for i in range(0, TRAIN_ROWS - BATCH + 1, BATCH)]
    return out[:STEPS]


def _cosine(t: int) -> float:
    return 0.5 * (1 + math.cos(math.pi * t / STEPS))


def _run(x: torch.Tensor, y: torch.Tensor, knobs: int | None) -> tuple[float, float, int]:
    """One run: plain training (``knobs`` None) or Forks with the first ``knobs`` knobs; (seconds,
    optimizer steps over plain training's, the forks it started with)."""
    batches = _batches(x, y)
    probe = [(x[TRAIN_ROWS:TRAIN_ROWS + PROBE_ROWS], y[TRAIN_ROWS:TRAIN_ROWS + PROBE_ROWS])]
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    t0 = time.perf_counter()
    if knobs is None:
        sched = torch.optim.lr_scheduler.LambdaLR(opt, _cosine)
        for bx, by in batches:
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(model(bx), by, label_smoothing=0.1).backward()
            opt.step()
            sched.step()
        return time.perf_counter() - t0, 1.0, 1
    chosen = _knobs(knobs)
    smoothing = any(isinstance(k, hpx.LabelSmoothing) for k in chosen)

    def loss(rep: Any, b: Any) -> torch.Tensor:
        ls = rep.value("label_smoothing") if smoothing else 0.1
        return F.cross_entropy(rep.model(b[0]), b[1], label_smoothing=ls)

    def probe_loss(rep: Any, b: Any) -> torch.Tensor:
        return F.cross_entropy(rep.model(b[0]), b[1], reduction="none")

    forks = hpx.Forks(model, opt, total_steps=STEPS, schedule=_cosine, probe=probe, loss_fn=probe_loss,
                      knobs=chosen)
    started = len(forks._forks)
    for b in batches:
        forks.step(loss, b)
    forks.converge()
    return time.perf_counter() - t0, forks.fork_steps / forks.step_count, started


def measure() -> list[dict[str, Any]]:
    torch.set_num_threads(1)
    logging.getLogger("hpx").setLevel(logging.WARNING)
    x, y = _data()
    times: dict[str, list[float]] = {"plain": [], **{s: [] for s in SETTINGS}}
    steps: dict[str, float] = {}
    started: dict[str, int] = {}
    for _ in range(REPEATS):  # rounds: every setting once, back to back
        times["plain"].append(_run(x, y, None)[0])
        for n, name in enumerate(SETTINGS):
            t, steps[name], started[name] = _run(x, y, n)
            times[name].append(t)
        print({k: round(v[-1], 2) for k, v in times.items()}, file=sys.stderr)
    return [{"knobs": name, "count": n, "forks": started[name], "steps": steps[name], "seconds": times[name],
             "plain": times["plain"]} for n, name in enumerate(SETTINGS)]


def machine() -> str:
    return (f"{platform.machine()}, 1 torch thread; Python {platform.python_version()}, "
            f"torch {torch.__version__}")


def section(res: list[dict[str, Any]], command: str, wall: float, on: str) -> str:
    lines = ["## What knobs cost in hpx.Forks", "",
             f"Command: `{command}` ({wall:.0f} s) on {on}. What is measured: the docstring of "
             f"`benchmarks/forks_knobs.py` (an MLP with dropout on digits, {STEPS} steps, AdamW under a "
             "cosine schedule, Forks at its default cuts, with 0-3 knobs besides the learning rate; "
             f"wall time against plain training in the same round, the median of {REPEATS} rounds). "
             "At the defaults each knob with a lower side adds a fork from the start (that knob moved "
             "down by its spread, raced and cut with the lr's forks: 0.15 of a run's steps when the "
             "first cut drops it), and the knobs add one fork in all, every knob moved up, branched from "
             "your run at 70% of it and run to the end (0.3); the lr's forks are those of a run without "
             "knobs.", "",
             "| knobs besides the lr | forks at the start | optimizer steps / plain's "
             "| wall time / plain's |",
             "| --- | ---: | ---: | ---: |"]
    for r in res:
        ratio = statistics.median(a / b for a, b in zip(r["seconds"], r["plain"]))
        lines.append(f"| {r['knobs']} | {r['forks']} | {r['steps']:.2f}x | {ratio:.2f}x |")
    return "\n".join(lines)


def stored_section(store: dict) -> str:
    """The section as written from ``store`` (what :data:`STORE` holds)."""
    return section(store["res"], store["command"], store["wall"], store["on"])


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    store = _store.measured(argv, __doc__.split("\n")[0], measure, stored_section, STORE, COMMAND, MARKER,
                            "about 1 min", machine)
    return store["res"]


if __name__ == "__main__":
    main()
