"""``hpx.Forks(..., batched=True)`` against the sequential forks: the CPU time of a step of a small
model's forks, and a whole run both ways.

    python -m benchmarks.forks_batched               # writes its section of docs/benchmarks.md
    python -m benchmarks.forks_batched --no-write
    python -m benchmarks.forks_batched --report-only # the section again from the committed store

MLPs of digits' shape (64 -> w -> w -> 10, ReLU) on scikit-learn's bundled digits (scaled to [0, 1]),
AdamW (weight decay 0.01) under OneCycleLR, batches drawn from the first 1,000 rows, the probe 400
of the others. Per step: two ``hpx.Forks`` built alike (the same weights, optimizer, schedule and
batches), one with ``batched=True``, take their first step (sequential on both) and two more, then
``ROUNDS`` blocks of ``BLOCK`` steps each, the two alternating which goes first each round: CPU time
of this process with one torch thread, per step, min and median over the blocks. The steps are the
first 10% of a long run (``total_steps`` large), where the five forks train; a cut's window trains
nine (five forks and four annealed copies), the rest of the run three and then two.

By forks: the 6.0 k MLP, batch 32, with 2, 3, 4, 5 and 9 forks (``multiples`` that many, no cut),
the batched path taken at every count (``hpx.forks.batched.MIN_FORKS`` set to 2 for it): what
:data:`~hpx.forks.batched.MIN_FORKS` (below it a step is sequential) is chosen from.

A whole run: the 6.0 k MLP, ``RUN`` steps at the defaults (both cuts and their annealed copies, the
probe at each, the end), sequential and batched alternating, ``REPEATS`` times: CPU time, min and
median, the largest difference of the final weights (your model, holding the winner) and whether
every decision was the same.

The measurement is kept in ``benchmarks/stored/forks_batched.json`` (committed, with the machine it
was made on) and the section is written from it alone (``tests/test_stored_sections.py``).
"""

from __future__ import annotations

import platform
import statistics
import time
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import hpx
from benchmarks import _store

DOC = _store.DOC
MARKER = "forks-batched"
STORE = _store.STORED / "forks_batched.json"
COMMAND = "python -m benchmarks.forks_batched"
CASES = ((32, 32), (48, 32), (48, 64), (128, 32), (512, 32))  # (width, batch)
COUNTS = (2, 3, 4, 5, 9)  # forks trained, for the 6.0 k MLP
ROUNDS, BLOCK = 20, 8
LONG = 100_000  # total_steps of the per-step cases: no cut in the steps timed
RUN, REPEATS = 200, 3
TRAIN_ROWS, PROBE_ROWS = 1000, 400


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    return torch.tensor(x / 16.0, dtype=torch.float32), torch.tensor(y, dtype=torch.long)


def _mlp(width: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                         nn.Linear(width, 10))


def _loss(rep: Any, b: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return F.cross_entropy(rep.model(b[0]), b[1])


def _forks(width: int, total: int, batched: bool, probe: list[Any], **settings: Any) -> hpx.Forks:
    model = _mlp(width)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=3e-3, total_steps=total)
    return hpx.Forks(model, opt, total_steps=total, schedule=sched, probe=probe, batched=batched, **settings)


def _multiples(n: int) -> tuple[float, ...]:
    """``n`` lr multiples a quarter of a decade apart, 1 among them."""
    return tuple(10 ** (k / 4) for k in range(-(n // 2), n - n // 2))


def _batches(x: torch.Tensor, y: torch.Tensor, batch: int, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [(x[i], y[i]) for i in (torch.randint(0, TRAIN_ROWS, (batch,), generator=g) for _ in range(n))]


def per_step(width: int, batch: int, x: torch.Tensor, y: torch.Tensor, probe: list[Any],
             forks: int = 5) -> dict[str, Any]:
    """CPU seconds per step of ``forks`` forks, each way (see the module's docstring)."""
    settings = {} if forks == 5 else {"multiples": _multiples(forks), "cuts": ()}
    runs = {b: _forks(width, LONG, b, probe, **settings) for b in (False, True)}
    batches = _batches(x, y, batch, 3 + ROUNDS * BLOCK)
    for f in runs.values():
        for b in batches[:3]:
            f.step(_loss, b)
    times: dict[bool, list[float]] = {False: [], True: []}
    for r in range(ROUNDS):
        block = batches[3 + r * BLOCK:3 + (r + 1) * BLOCK]
        for batched in ((False, True) if r % 2 == 0 else (True, False)):
            t = time.process_time()
            for b in block:
                runs[batched].step(_loss, b)
            times[batched].append((time.process_time() - t) / BLOCK)
    assert runs[True]._batched.taken == 2 + ROUNDS * BLOCK  # every step past the first was batched
    return {"width": width, "batch": batch, "forks": len(runs[True].factors),
            "params": sum(p.numel() for p in runs[True].model.parameters()),
            "sequential": [min(times[False]), statistics.median(times[False])],
            "batched": [min(times[True]), statistics.median(times[True])]}


def whole_run(x: torch.Tensor, y: torch.Tensor, probe: list[Any]) -> dict[str, Any]:
    """A whole run of the 6.0 k MLP each way, ``REPEATS`` times: CPU time, the final weights' largest
    difference, and whether the decisions were the same."""
    batches = _batches(x, y, 32, RUN)
    times: dict[bool, list[float]] = {False: [], True: []}
    ends: dict[bool, hpx.Forks] = {}
    for r in range(REPEATS):
        for batched in ((False, True) if r % 2 == 0 else (True, False)):
            torch.manual_seed(1)
            forks = _forks(48, RUN, batched, probe)
            t = time.process_time()
            for b in batches:
                forks.step(_loss, b)
            times[batched].append(time.process_time() - t)
            ends[batched] = forks
    seq, bat = ends[False], ends[True]
    gap = max((u - v).abs().max().item() for u, v in zip(seq.model.state_dict().values(),
                                                       bat.model.state_dict().values()))
    same = [(h.phase, h.step, h.values, h.bases) for h in seq.history] == [
        (h.phase, h.step, h.values, h.bases) for h in bat.history]
    return {"steps": RUN, "sequential": [min(times[False]), statistics.median(times[False])],
            "batched": [min(times[True]), statistics.median(times[True])], "gap": gap, "same": same,
            "decisions": len(bat.history), "factor": bat.factor, "taken": bat._batched.taken}


def measure() -> dict[str, Any]:
    from hpx.forks import batched

    torch.set_num_threads(1)
    x, y = _data()
    rows = torch.arange(TRAIN_ROWS, TRAIN_ROWS + PROBE_ROWS)
    probe = [(x[r], y[r]) for r in rows.split(200)]
    low, batched.MIN_FORKS = batched.MIN_FORKS, 2  # the batched path at every count
    try:
        cases = [per_step(w, b, x, y, probe) for w, b in CASES]
        counts = [per_step(48, 32, x, y, probe, n) for n in COUNTS]
    finally:
        batched.MIN_FORKS = low
    return {"cases": cases, "counts": counts, "min_forks": low, "run": whole_run(x, y, probe)}


def machine() -> str:
    return (f"{platform.machine()}, 1 torch thread; Python {platform.python_version()}, "
            f"torch {torch.__version__}")


def section(res: dict[str, Any], command: str, wall: float, on: str) -> str:
    lines = ["## hpx.Forks(batched=True): a small model's forks as one computation", "",
             f"Command: `{command}` ({wall:.0f} s) on {on}. What is measured: the docstring of "
             "`benchmarks/forks_batched.py` (AdamW under OneCycleLR, CPU time per step of five forks, "
             f"{ROUNDS} blocks of {BLOCK} steps each way, alternating).", "",
             "| MLP | parameters per fork | batch | sequential ms/step (min / median) | batched ms/step "
             "(min / median) | sequential / batched (min / median) |",
             "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for c in res["cases"]:
        lines.append(f"| 64 -> {c['width']} -> {c['width']} -> 10 | {c['params'] / 1e3:.1f} k | "
                     f"{c['batch']} | {_times(c)}")
    lines += ["", f"By forks trained (the 6.0 k MLP, batch 32; the batched path taken at every count). Below "
              f"`hpx.forks.batched.MIN_FORKS` = {res['min_forks']} a step of `batched=True` is the "
              "sequential path: one vmap costs about what two or three forks' steps do.", "",
              "| forks | sequential ms/step (min / median) | batched ms/step (min / median) | sequential / "
              "batched (min / median) |", "| ---: | ---: | ---: | ---: |"]
    lines += [f"| {c['forks']} | {_times(c)}" for c in res["counts"]]
    run = res["run"]
    (s0, s1), (b0, b1) = run["sequential"], run["batched"]
    lines += ["", f"A whole run of the 6.0 k MLP ({run['steps']} steps at the defaults: both cuts, their "
              f"annealed copies, the probe at each, the end; {REPEATS} runs each way; {run['taken']} steps "
              f"batched, those of {res['min_forks']} forks or more): sequential "
              f"{s0:.2f} s / {s1:.2f} s (min / median), batched {b0:.2f} s / {b1:.2f} s, "
              f"{s0 / b0:.2f}x / {s1 / b1:.2f}x. Its final weights (your model, holding the winner at "
              f"{run['factor']:.3g}x) differ by at most {run['gap']:.1e}; the {run['decisions']} decisions "
              f"were {'the same' if run['same'] else 'NOT the same'} both ways.", "",
              _where(res)]
    return "\n".join(lines)


def _where(res: dict[str, Any]) -> str:
    """Where the time goes, in the store's own figures."""
    counts = {c["forks"]: c["sequential"][0] / c["batched"][0] for c in res["counts"]}
    big = max(res["cases"], key=lambda c: c["params"])
    mid = [c for c in res["cases"] if 1e4 < c["params"] < big["params"]]
    lo, hi = min(counts), max(counts)
    return ("Where the time goes: a batched step costs one vmap of the loss and one backward, whose calls "
            "cost about what a few forks' sequential steps do at these sizes, plus the forks' arithmetic, "
            "which is the same either way; the sequential step pays each fork's calls (its forward's and "
            "backward's, its optimizer's per-parameter loop, its scheduler) once per fork. So the gain grows "
            f"with the forks trained ({lo} forks: {counts[lo]:.2f}x, {hi}: {counts[hi]:.2f}x, min over "
            "blocks) and fades as a fork's matrices grow, where the batched form's own work (the forks' "
            "weights and optimizer state copied into stacks and back at every step, batched matrix "
            "products) makes it slower: "
            + ", ".join(f"{c['sequential'][0] / c['batched'][0]:.2f}x at {c['params'] / 1e3:.0f} k parameters"
                        for c in [*mid, big])
            + ". `batched=True` is for models of some thousands of parameters; not measured on a GPU here "
            "(`python -m benchmarks.gpu` has the case).")


def _times(c: dict[str, Any]) -> str:
    (s0, s1), (b0, b1) = c["sequential"], c["batched"]
    return (f"{1e3 * s0:.2f} / {1e3 * s1:.2f} | {1e3 * b0:.2f} / {1e3 * b1:.2f} | "
            f"{s0 / b0:.2f}x / {s1 / b1:.2f}x |")


def stored_section(store: dict) -> str:
    """The section as written from ``store`` (what :data:`STORE` holds)."""
    return section(store["res"], store["command"], store["wall"], store["on"])


def main(argv: list[str] | None = None) -> dict[str, Any]:
    store = _store.measured(argv, __doc__.split("\n")[0], measure, stored_section, STORE, COMMAND, MARKER,
                            "about 2 min", machine)
    return store["res"]


if __name__ == "__main__":
    main()
