"""What ``hpx.Forks`` adds beyond its optimizer steps: its wall time against a hand-written loop
that takes the same steps.

    python -m benchmarks.forks_overhead               # writes its section of docs/benchmarks.md
    python -m benchmarks.forks_overhead --no-write
    python -m benchmarks.forks_overhead --report-only # the section again from the committed store

An MLP (64 -> 512 -> 512 -> 10) on scikit-learn's bundled digits, AdamW under OneCycleLR, batches
of 64 drawn from the first 797 rows, 300 optimizer steps; the probe is 100 or 1,000 of the other
rows (in batches of 250), its loss per example (``reduction="none"``) or the batch's mean (the
end's test then needs each example's loss alone: :func:`hpx.forks.probe._each_example`).

``hpx.Forks`` runs at its defaults and records, at each step, which models it stepped (forks and
annealed copies), at which multiple of the scheduler's learning rate, and which model each new
copy was copied from. The hand-written loop steps the same models (copies of the model, optimizer
and scheduler, each made off its clock) at the same multiples on the same batches, step by step:
the same optimizer steps, and nothing else (no probe, no decision). The ratio of their wall times
is what Forks adds beyond its steps: the copies it makes, the probe passes at every cut, the end's
test, its checks. The loop first written here stepped every model at your learning rate instead;
it is timed too, because a model's learning rate changes its kernels' speed (gradients that
shrink into subnormal floats, which a CPU computes slowly), so that loop's ratio mixes that in.
Forks and the two loops run back to back, five times per case, in one process with one torch
thread; the table gives the median time of each and the median of the five ratios (single ratios
spread by several percent on these machines).

The measurement is kept in ``benchmarks/stored/forks_overhead.json`` (committed, with the machine
it was made on) and the section is written from it alone (``tests/test_stored_sections.py``).
"""

from __future__ import annotations

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


Plan = list[list[tuple[int, float, "int | None"]]]


def _forks(x: torch.Tensor, y: torch.Tensor, probe_rows: int, kind: str,
           keep: list[Any] | None = None) -> tuple[float, Plan, float]:
    """Forks' wall time; at each step, the models it stepped (a key each, the multiple of the lr
    each stepped at, and for a model first stepped then, the key of the one it was copied from);
    and its steps over plain training's. Reading the plan costs Forks' clock a few attribute reads."""
    model, opt, sched, batches, probe = _setup(x, y, probe_rows)
    t0 = time.perf_counter()
    forks = hpx.Forks(model, opt, total_steps=STEPS, schedule=sched, probe=probe,
                      loss_fn=_per_example if kind == "per example" else _loss)
    plan: Plan = []
    seen: set[int] = set()
    for i, b in enumerate(batches):
        if keep is not None and i == len(batches) - 1:  # the forks before the end's decision
            keep.extend((id(f), [p.detach().clone() for p in f.model.parameters()]) for f in forks._forks)
        parents = {id(c): id(forks._forks[j]) for j, c in zip(forks._parents, forks._clones)}
        now = [(id(f), f.multiple_at(forks.step_count), None if id(f) in seen else parents.get(id(f)))
               for f in forks._trained()]
        seen.update(k for k, _, _ in now)
        plan.append(now)
        forks.step(_loss, b)
    forks.converge()
    return time.perf_counter() - t0, plan, forks.fork_steps / forks.step_count


def _hand(x: torch.Tensor, y: torch.Tensor, probe_rows: int, plan: Plan, same_lrs: bool = True,
          out: dict[int, Any] | None = None) -> float:
    """The hand-written loop, on the batches Forks saw: at step ``t`` each model of ``plan[t]``
    steps at its multiple of its scheduler's lr (``same_lrs``; else every model at your lr, the
    loop this benchmark used to time), a model first stepped at ``t`` starting as a copy of the one
    it was copied from (or of your run). The copies are made off the clock: they are what Forks
    adds. Returns the time on the clock; ``out`` receives the models, by key."""
    model, opt, sched, batches, _ = _setup(x, y, probe_rows)
    runs: dict[int, Any] = {}
    spent = 0.0
    with warnings.catch_warnings():  # a copied scheduler's optimizer is not wrapped by torch's order check
        warnings.filterwarnings("ignore", message=r"Seems like `optimizer\.step\(\)`")
        for now, (bx, by) in zip(plan, batches):
            for key, _, parent in now:
                if key not in runs:
                    runs[key] = (model, opt, sched) if not runs else copy.deepcopy(
                        runs[parent] if parent is not None else runs[next(iter(runs))])
            t0 = time.perf_counter()
            for key, mult, _ in now:
                m, o, s = runs[key]
                loss = F.cross_entropy(m(bx), by)
                o.zero_grad(set_to_none=True)
                loss.backward()
                mult = mult if same_lrs else 1.0
                lrs = [g["lr"] for g in o.param_groups]
                for g in o.param_groups:
                    g["lr"] = g["lr"] * mult
                o.step()
                for g, lr in zip(o.param_groups, lrs):
                    g["lr"] = lr
                s.step()
            spent += time.perf_counter() - t0
    if out is not None:
        out.update({key: m for key, (m, _, _) in runs.items()})
    return spent


def measure() -> list[dict[str, Any]]:
    torch.set_num_threads(1)
    logging.getLogger("hpx").setLevel(logging.WARNING)
    x, y = _data()
    out = []
    for rows, kind in CASES:
        forks_s, hand_s, hand_1x, steps = [], [], [], 0.0
        for _ in range(REPEATS):
            t, plan, steps = _forks(x, y, rows, kind)
            forks_s.append(t)
            hand_s.append(_hand(x, y, rows, plan))
            hand_1x.append(_hand(x, y, rows, plan, same_lrs=False))
        out.append({"probe": rows, "loss": kind, "steps": steps, "forks": forks_s, "hand": hand_s,
                    "hand_1x": hand_1x})
        print(out[-1], file=sys.stderr)
    return out


def machine() -> str:
    return (f"{platform.machine()}, 1 torch thread; Python {platform.python_version()}, "
            f"torch {torch.__version__}")


def section(res: list[dict[str, Any]], command: str, wall: float, on: str) -> str:
    lines = ["## What Forks adds beyond its steps", "",
             f"Command: `{command}` ({wall:.0f} s) on {on}. What is measured: the docstring of "
             f"`benchmarks/forks_overhead.py` (an MLP on digits, {STEPS} steps, Forks at its defaults, "
             "against a hand-written loop that steps the same models at the same learning rates on the "
             f"same batches; medians of {REPEATS} runs of each, back to back). The bar: at most "
             f"{BAR:.2f}x, whatever the probe's size. The last two columns time the loop this benchmark "
             "first used, every model at your learning rate: the same number of steps, but not the same "
             "arithmetic (a model at 10x or at an annealed copy's falling lr computes at another "
             "speed), so it is no measure of what Forks adds.", "",
             "| probe rows | probe loss | Forks' steps / plain's | Forks s | loop s | Forks / loop "
             "(median of the runs' ratios) | within the bar | loop at your lr s | Forks / it |",
             "| ---: | --- | ---: | ---: | ---: | ---: | --- | ---: | ---: |"]
    for r in res:
        f, h, h1 = (statistics.median(r[k]) for k in ("forks", "hand", "hand_1x"))
        ratio = statistics.median(a / b for a, b in zip(r["forks"], r["hand"]))
        ratio_1x = statistics.median(a / b for a, b in zip(r["forks"], r["hand_1x"]))
        lines.append(f"| {r['probe']:,} | {r['loss']} | {r['steps']:.2f} | {f:.2f} | {h:.2f} | {ratio:.3f} | "
                     f"{'yes' if ratio <= BAR else 'no'} | {h1:.2f} | {ratio_1x:.3f} |")
    return "\n".join(lines)


def stored_section(store: dict) -> str:
    """The section as written from ``store`` (what :data:`STORE` holds)."""
    return section(store["res"], store["command"], store["wall"], store["on"])


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    store = _store.measured(argv, __doc__.split("\n")[0], measure, stored_section, STORE, COMMAND, MARKER,
                            "about 2 min", machine)
    return store["res"]


if __name__ == "__main__":
    main()
