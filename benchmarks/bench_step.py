"""The in-process engine against the hand-written shared-gradient loop one would write instead.

    python -m benchmarks.bench_step            # writes the bench_step section of docs/benchmarks.md
    python -m benchmarks.bench_step --no-write
    python -m benchmarks.bench_step --report-only  # the section again from the committed store

The measurement is kept in ``benchmarks/stored/bench_step.json`` (committed, with the machine it
was made on), and the section is written from it alone, so a clone rebuilds it
(``tests/test_stored_sections.py``).

The hand-written loop: N plain copies of the model and N SGD optimizers; per step each copy
runs forward and backward on its chunk of the batch, the gradients are averaged with
``torch._foreach_*`` and copied back, and every optimizer steps. A sync by hand: the copies'
parameters and floating buffers averaged with foreach ops and copied back. hpx: ``Engine.step``
(N replicas, shared mode, one ``LearningRate`` knob with a spread, no sync inside the timed
steps; the replicas keep one gradient and one momentum between them, so hpx does one
optimizer update where the loop does N) and ``Engine.converge()`` (health check, weighted
average of weights and buffers).
Also ``hpx.autolr`` (one model) per step against a plain loop that writes its schedule's learning
rate. CPU time of this process, in alternating blocks so that machine noise hits both alike.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from benchmarks import _store, report
from benchmarks.timing import hand_average, side_by_side

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "benchmarks.md"
STORE = _store.STORED / "bench_step.json"
COMMAND = "python -m benchmarks.bench_step"
REPLICAS = "2,4,8"  # --replicas' default


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(512, 1536), nn.ReLU(), nn.Linear(1536, 1024), nn.ReLU(),
                         nn.Linear(1024, 10))


def _sgd(m: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9)




def measure(n: int, rounds: int, reps: int) -> dict[str, float]:
    import hpx

    engine = hpx.Engine(_model(), _sgd, [hpx.LearningRate(spread=0.3)], replicas=n, sync_every=10 ** 9)
    models = [_model() for _ in range(n)]
    opts = [_sgd(m) for m in models]
    params = [list(m.parameters()) for m in models]
    states = [[t for t in m.state_dict().values() if t.is_floating_point()] for m in models]
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(32 * n, 512, generator=g), torch.randint(0, 10, (32 * n,), generator=g)
    xs, ys = x.tensor_split(n), y.tensor_split(n)

    def loss_fn(rep, b):
        return F.cross_entropy(rep.model(b[0]), b[1])

    def hand_step() -> None:
        for o in opts:
            o.zero_grad(set_to_none=True)
        for m, xx, yy in zip(models, xs, ys):
            F.cross_entropy(m(xx), yy).backward()
        hand_average([[p.grad for p in ps] for ps in params])
        for o in opts:
            o.step()

    @torch.no_grad()
    def hand_sync() -> None:
        hand_average(states)

    step_hpx, step_hand = side_by_side(lambda: engine.step(loss_fn, (x, y)), hand_step, rounds, reps)
    sync_hpx, sync_hand = side_by_side(engine.converge, hand_sync, rounds, reps)
    amort_hpx, amort_hand = 99 * step_hpx + (step_hpx + sync_hpx), 100 * step_hand + sync_hand
    return {"n": n, "params": sum(p.numel() for p in params[0]), "step_hpx": step_hpx, "step_hand": step_hand,
            "sync_hpx": sync_hpx, "sync_hand": sync_hand, "amortised": amort_hpx / amort_hand}


def measure_autolr(rounds: int, reps: int) -> dict[str, float]:
    """``hpx.autolr`` (one model, the one-run search) against the same plain loop writing its
    schedule's learning rate each step: the per-step cost of the one-run search."""
    import hpx

    model, plain = _model(), _model()
    engine = hpx.autolr(model, _sgd(model), total_steps=10 ** 9, schedule=lambda t: 1.0 / (1 + 1e-4 * t),
                        probe=[(torch.zeros(1, 512), torch.zeros(1, dtype=torch.long))])
    opt = _sgd(plain)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(32, 512, generator=g), torch.randint(0, 10, (32,), generator=g)
    step = [0]

    def loss_fn(rep, b):
        return F.cross_entropy(rep.model(b[0]), b[1])

    def hand_step() -> None:
        for grp in opt.param_groups:
            grp["lr"] = 0.01 / (1 + 1e-4 * step[0])
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(plain(x), y).backward()
        opt.step()
        step[0] += 1

    hpx_s, hand_s = side_by_side(lambda: engine.step(loss_fn, (x, y)), hand_step, rounds, reps)
    return {"step_hpx": hpx_s, "step_hand": hand_s}


def machine() -> str:
    """This machine, as the section names the one it was measured on."""
    return (f"{platform.machine()}, {torch.get_num_threads()} torch thread(s); Python "
            f"{platform.python_version()}, torch {torch.__version__}")


def section(rows: list[dict[str, float]], wall: float, command: str,
            auto: dict[str, float] | None = None, on: str | None = None) -> str:
    """The section's text; ``on``: the machine it was measured on (default: this one)."""
    lines = [
        "## In-process engine against a hand-written shared-gradient loop",
        "",
        f"Command: `{command}` ({wall:.0f} s) on {on or machine()}. MLP 512-1536-1024-10 "
        f"({rows[0]['params'] / 1e6:.2f} M parameters), a batch of 32 per replica, SGD with momentum. "
        "What each side does: the docstring of `benchmarks/bench_step.py`. CPU time, medians of "
        "alternating blocks. Targets: step <= 1.02x, sync <= 1.2x, amortised at T = 100 <= 1.03x.",
        "",
        "| replicas | step: hpx ms | by hand ms | ratio | sync: hpx ms | by hand ms | ratio "
        "| amortised, T = 100 |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        lines.append(f"| {r['n']} | {1e3 * r['step_hpx']:.2f} | {1e3 * r['step_hand']:.2f} | "
                     f"{r['step_hpx'] / r['step_hand']:.3f} | {1e3 * r['sync_hpx']:.2f} | "
                     f"{1e3 * r['sync_hand']:.2f} | {r['sync_hpx'] / r['sync_hand']:.2f} | "
                     f"{r['amortised']:.3f} |")
    if auto is not None:
        lines += ["", f"The one-run search, `hpx.autolr` (one model; its syncs lie in the first 90% of a "
                  f"run and are not timed here), per step against the same plain loop writing its "
                  f"schedule's learning rate: {1e3 * auto['step_hpx']:.2f} ms against "
                  f"{1e3 * auto['step_hand']:.2f} ms, {auto['step_hpx'] / auto['step_hand']:.3f}x."]
    return "\n".join(lines)



def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--replicas", default=REPLICAS)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--no-write", action="store_true", help="print only: neither the store nor the docs")
    ap.add_argument("--report-only", action="store_true",
                    help="measure nothing: the section from the committed store")
    args = ap.parse_args(argv)
    if args.report_only:
        store = _store.load(STORE, COMMAND, DOC, "about 15 s")
    else:
        if not args.no_write:  # the section's rows are one measurement: fewer would take rows away
            narrower(sorted({int(n) for n in args.replicas.split(",")}))
        torch.set_num_threads(1)
        start = time.perf_counter()
        rows = [measure(int(n), args.rounds, args.reps) for n in args.replicas.split(",")]
        auto = measure_autolr(args.rounds, args.reps)
        shown = " ".join(a for a in (argv or []) if a != "--no-write")
        store = {"rows": rows, "auto": auto, "wall": time.perf_counter() - start,
                 "command": f"{COMMAND} {shown}".strip(), "on": machine()}
        if not args.no_write:
            _store.save(STORE, store)
    text = stored_section(store)
    print(text)
    if not args.no_write:
        report.write_section(DOC, "bench_step", text)


def narrower(replicas: list[int]) -> None:
    """Refuse, before anything is measured, a run of fewer replica counts than the stored section
    shows (it would write the section without the others' rows), naming the run that keeps them."""
    shown = [r["n"] for r in json.loads(STORE.read_text())["rows"]] if STORE.exists() else []
    lacking = [n for n in shown if n not in replicas]
    if lacking:
        every = ",".join(map(str, sorted({*shown, *replicas})))
        command = COMMAND if every == REPLICAS else f"{COMMAND} --replicas {every}"
        _store.refuse_narrower("bench_step", f"the rows of {', '.join(map(str, lacking))} replicas", command,
                               DOC, "or add --no-write to measure these alone")


def stored_section(store: dict) -> str:
    """The section as written from ``store`` (what :data:`STORE` holds)."""
    return section(store["rows"], store["wall"], store["command"], store["auto"], store["on"])


if __name__ == "__main__":
    main()
