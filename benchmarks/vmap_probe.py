"""N small replicas as one batched model (torch.func) against N separate models, per training step.

    python -m benchmarks.vmap_probe            # writes the vmap_probe section of docs/benchmarks.md
    python -m benchmarks.vmap_probe --no-write
    python -m benchmarks.vmap_probe --report-only  # the section again from the committed store

The measurement is kept in ``benchmarks/stored/vmap_probe.json`` (committed, with the machine it
was made on), and the section is written from it alone, so a clone rebuilds it
(``tests/test_stored_sections.py``).

What hpx's in-process engine does today for N replicas: N forward and backward passes, one per
model, on each replica's share of the batch (Python and kernel-launch overheads paid N times).
The alternative measured here: the N replicas' parameters stacked along a leading dim and one
``torch.func.vmap`` over ``torch.func.grad`` of ``functional_call``: one batched forward and
backward. Both compute the same gradients (checked); the optimizer step is left out of both.
MLPs of digits' shape (64 inputs, 10 classes), a batch of 16 per replica, CPU time of this
process (1 thread), medians of alternating blocks. Engine integration is not done; this measures
what it would give.
"""

from __future__ import annotations

import argparse
import platform
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad, stack_module_state, vmap

from benchmarks import _store, report
from benchmarks.timing import side_by_side

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "benchmarks.md"
STORE = _store.STORED / "vmap_probe.json"
COMMAND = "python -m benchmarks.vmap_probe"


def _mlp(width: int, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                         nn.Linear(width, 10))



def measure(width: int, n: int, rounds: int, reps: int) -> dict[str, float]:
    models = [_mlp(width, s) for s in range(n)]
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(n, 16, 64, generator=g), torch.randint(0, 10, (n, 16), generator=g)

    def separate() -> list[list[torch.Tensor]]:
        out = []
        for m, xx, yy in zip(models, x, y):
            m.zero_grad(set_to_none=True)
            F.cross_entropy(m(xx), yy).backward()
            out.append([p.grad for p in m.parameters()])
        return out

    params, buffers = stack_module_state(models)
    base = _mlp(width, 0).to("meta")

    def loss(p: dict[str, torch.Tensor], b: dict[str, torch.Tensor], xx: torch.Tensor,
             yy: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(functional_call(base, (p, b), (xx,)), yy)

    batched_grad = vmap(grad(loss), in_dims=(0, 0, 0, 0))

    def batched() -> dict[str, torch.Tensor]:
        return batched_grad(params, buffers, x, y)

    want, got = separate(), batched()
    for i, name in enumerate(params):  # the same gradients
        torch.testing.assert_close(got[name], torch.stack([w[i] for w in want]), rtol=1e-4, atol=1e-6)
    t_sep, t_vmap = side_by_side(separate, batched, rounds, reps)
    return {"width": width, "n": n, "params": sum(p.numel() for p in models[0].parameters()),
            "separate": t_sep, "vmap": t_vmap}


def machine() -> str:
    """This machine, as the section names the one it was measured on."""
    return (f"{platform.machine()}, 1 torch thread; Python {platform.python_version()}, "
            f"torch {torch.__version__}")


def section(rows: list[dict[str, float]], wall: float, command: str, on: str | None = None) -> str:
    """The section's text; ``on``: the machine it was measured on (default: this one)."""
    lines = ["## N small replicas as one batched model (torch.func), measured", "",
             f"Command: `{command}` ({wall:.0f} s) on {on or machine()}. What is compared: the docstring of "
             "`benchmarks/vmap_probe.py` (forward and backward of N replicas, a batch of 16 each; the same "
             "gradients, checked).", "",
             "| parameters per replica | replicas | N models ms | one vmap ms | N models / vmap |",
             "| ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        lines.append(f"| {r['params'] / 1e3:.1f} k | {r['n']} | {1e3 * r['separate']:.2f} | "
                     f"{1e3 * r['vmap']:.2f} | {r['separate'] / r['vmap']:.2f} |")
    ratios = [r["separate"] / r["vmap"] for r in rows]
    wins = [r for r, q in zip(rows, ratios) if q > 1.05]
    lines += ["", f"Ratios from {min(ratios):.2f} to {max(ratios):.2f} (above 1: the batched form is "
              "faster). "
              "vmap has a fixed cost of its own per step; it pays off where N separate passes cost more "
              "in per-call overheads than that"
              + (": here at " + ", ".join(f"{r['n']} replicas of {r['params'] / 1e3:.1f} k" for r in wins)
                 if wins else ": nowhere in this run")
              + ". Once a replica's matrices keep a core busy, the same arithmetic costs the same "
              "either way. "
              "On a GPU the per-call overheads are kernel launches (several per layer and replica, each a "
              "few microseconds), larger relative to small replicas' arithmetic than on a CPU, so the "
              "gain for small replicas should be larger there; not measured (no GPU here). Engine "
              "integration (training N replicas through one vmap) is not done."]
    return "\n".join(lines)



def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--no-write", action="store_true", help="print only: neither the store nor the docs")
    ap.add_argument("--report-only", action="store_true",
                    help="measure nothing: the section from the committed store")
    args = ap.parse_args(argv)
    if args.report_only:
        store = _store.load(STORE, COMMAND, DOC, "about 10 s")
    else:
        torch.set_num_threads(1)
        start = time.perf_counter()
        rows = [measure(w, n, args.rounds, 20 if w <= 64 else 5) for w in (32, 128, 512) for n in (4, 8)]
        shown = " ".join(a for a in (argv or []) if a != "--no-write")
        store = {"rows": rows, "wall": time.perf_counter() - start, "command": f"{COMMAND} {shown}".strip(),
                 "on": machine()}
        if not args.no_write:
            _store.save(STORE, store)
    text = stored_section(store)
    print(text)
    if not args.no_write:
        report.write_section(DOC, "vmap_probe", text)


def stored_section(store: dict) -> str:
    """The section as written from ``store`` (what :data:`STORE` holds)."""
    return section(store["rows"], store["wall"], store["command"], store["on"])


if __name__ == "__main__":
    main()
