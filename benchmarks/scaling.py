"""How hpx's costs grow: a sync against parameters, replicas and knobs, and memory against N.

    python -m benchmarks.scaling             # writes the scaling section of docs/benchmarks.md
    python -m benchmarks.scaling --no-write
    python -m benchmarks.scaling --report-only  # the section again from the committed store

The measurement is kept in ``benchmarks/stored/scaling.json`` (committed, with the machine it was
made on), and the section is written from it alone, so a clone rebuilds it
(``tests/test_stored_sections.py``).

Sync cost (in one process, CPU time, medians of alternating blocks): ``Engine.converge()`` (the
weighted average of weights and buffers, with the check that they are finite) against a
hand-written foreach average of the same tensors, for MLPs of 0.22 M to 12.7 M parameters at
N = 4 and for N = 2, 4, 8 at 3.2 M; and a whole sync (scores gathered, the HDET controller's
decision, the knobs written, the average) with K = 1, 4 or 16 knobs on a small model, where
the host-side work shows: measured as a run syncing every step minus one never syncing.

Memory (Linux): each configuration runs in a fresh process (an MLP of 12.7 M parameters, SGD
with momentum or AdamW, 5 training steps and a sync); its peak resident memory minus the peak
before the model was built. One model; N plain copies (models and optimizers, as a
hand-written loop holds them); hpx with N replicas in shared mode, with one optimizer state
for all (the default) and with one per replica (``shared_optimizer_state=False``);
``hpx.autolr`` (one model and its starting point). And a sync's transient memory: 4 replicas
of that MLP in float32 and in bfloat16: the peak resident memory during ``Engine.converge()``
after a step, at the first sync and at the next, over the resident memory before it (the
peak reset through ``/proc/self/clear_refs``), against one replica's parameter bytes.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from benchmarks import _store, report
from benchmarks.timing import hand_average, side_by_side

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "benchmarks.md"
STORE = _store.STORED / "scaling.json"
COMMAND = "python -m benchmarks.scaling"
WIDTHS = {0.22: 256, 0.83: 512, 3.2: 1024, 12.7: 2048}  # about this many M parameters -> hidden width


def _mlp(width: int, depth: int = 4) -> nn.Module:
    """64 -> width x depth -> 10: about (depth - 1) width^2 parameters."""
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Linear(64, width), nn.ReLU()]
    for _ in range(depth - 1):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(width, 10))


def _sgd(m: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9)


def _adamw(m: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(m.parameters(), lr=1e-3, weight_decay=0.01)


OPTIMIZERS = {"SGD with momentum": _sgd, "AdamW": _adamw}




def sync_cost(width: int, n: int, rounds: int, reps: int) -> dict[str, float]:
    import hpx

    engine = hpx.Engine(_mlp(width), _sgd, [hpx.LearningRate(spread=0.3)], replicas=n, sync_every=10 ** 9)
    copies = [_mlp(width) for _ in range(n)]
    states = [[t for t in m.state_dict().values() if t.is_floating_point()] for m in copies]
    hpx_s, hand_s = side_by_side(engine.converge, lambda: hand_average(states), rounds, reps)
    return {"params": sum(p.numel() for p in copies[0].parameters()), "n": n, "hpx": hpx_s, "hand": hand_s}


def knob_cost(k: int, rounds: int) -> dict[str, float]:
    """A whole sync's CPU time with ``k`` knobs (the 4 replicas of a small MLP)."""
    import hpx

    def build(sync_every: int) -> hpx.Engine:
        sink: dict[str, float] = {}
        def setter(i: int) -> Callable[[hpx.Replica, float], None]:
            return lambda r, v: sink.__setitem__(f"{r.index}/{i}", v)

        knobs = [hpx.LearningRate(spread=0.3)] + [
            hpx.Custom(f"c{i}", base=1.0, spread=0.2, set=setter(i)) for i in range(k - 1)]
        return hpx.Engine(_mlp(64, depth=2), _sgd, knobs, replicas=4, sync_every=sync_every, seed=0)

    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(64, 64, generator=g), torch.randint(0, 10, (64,), generator=g)

    def loss_fn(rep, b):
        return F.cross_entropy(rep.model(b[0]), b[1])

    every, never = build(1), build(10 ** 9)
    steps = 20
    t_every, t_never = side_by_side(lambda: [every.step(loss_fn, (x, y)) for _ in range(steps)],
                                     lambda: [never.step(loss_fn, (x, y)) for _ in range(steps)], rounds, 1)
    return {"k": k, "sync": (t_every - t_never) / steps, "step": t_never / steps}


def _memory_child(kind: str, n: int, width: int, optimizer: str) -> None:
    """Run one configuration and print its peak resident memory over the baseline, in bytes."""
    import hpx

    make = OPTIMIZERS[optimizer]
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(32 * max(n, 1), 64, generator=g), torch.randint(0, 10, (32 * max(n, 1),), generator=g)
    # the baseline: torch imported, the batch built, the allocator warmed by a small model's step
    warm = _mlp(64)
    F.cross_entropy(warm(x), y).backward()
    del warm
    base = _status("VmHWM")

    def loss_fn(rep, b):
        return F.cross_entropy(rep.model(b[0]), b[1])

    if kind == "one model":
        m = _mlp(width)
        opt = make(m)
        for _ in range(5):
            opt.zero_grad()
            F.cross_entropy(m(x), y).backward()
            opt.step()
    elif kind == "plain copies":
        models = [_mlp(width) for _ in range(n)]
        opts = [make(m) for m in models]
        for _ in range(5):
            for m, o, xx, yy in zip(models, opts, x.tensor_split(n), y.tensor_split(n)):
                o.zero_grad()
                F.cross_entropy(m(xx), yy).backward()
                o.step()
        hand_average([list(m.parameters()) for m in models])
    elif kind in ("hpx", "hpx per replica"):
        engine = hpx.Engine(_mlp(width), make, [hpx.LearningRate(spread=0.3)], replicas=n, sync_every=5,
                            signal=hpx.IntervalLoss(), shared_optimizer_state=kind == "hpx")
        assert (engine.unshared_reason is None) == (kind == "hpx"), engine.unshared_reason
        for _ in range(5):
            engine.step(loss_fn, (x, y))
    else:  # autolr
        m = _mlp(width)
        engine = hpx.autolr(m, make(m), total_steps=100, probe=[(x[:32], y[:32])])
        for _ in range(5):
            engine.step(loss_fn, (x, y))
    print(json.dumps({"bytes": _status("VmHWM") - base}))


def _transient_child(dtype: str, n: int, width: int) -> None:
    """Print the resident memory a sync adds at its peak, and one replica's parameter bytes."""
    import hpx

    torch.set_num_threads(1)
    dt = getattr(torch, dtype)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(32 * n, 64, generator=g).to(dt), torch.randint(0, 10, (32 * n,), generator=g)
    engine = hpx.Engine(_mlp(width).to(dt), _sgd, [hpx.LearningRate(spread=0.3)], replicas=n,
                        sync_every=10 ** 9)
    peaks = []
    for _ in range(2):  # the first sync, and a later one (the allocator has kept what it freed)
        engine.step(lambda rep, b: F.cross_entropy(rep.model(b[0]).float(), b[1]), (x, y))
        Path("/proc/self/clear_refs").write_text("5")  # the peak starts again from here
        before = _status("VmRSS")
        engine.converge()
        peaks.append(_status("VmHWM") - before)
    nbytes = sum(p.numel() * p.element_size() for p in engine.model.parameters())
    print(json.dumps({"first": peaks[0], "later": peaks[1], "param_bytes": nbytes}))


def _status(field: str) -> int:
    """A memory figure of this process from /proc/self/status, in bytes (Linux). VmHWM, the peak
    resident size, belongs to this program alone (getrusage's maxrss would carry the peak of the
    process that started it)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field} (the memory part needs Linux)")


def transient(dtype: str, n: int, width: int) -> dict:
    out = subprocess.run([sys.executable, "-m", "benchmarks.scaling", "--transient", dtype, str(n),
                          str(width)], cwd=ROOT, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def memory(kind: str, n: int, width: int, optimizer: str) -> float:
    out = subprocess.run([sys.executable, "-m", "benchmarks.scaling", "--child", kind, str(n), str(width),
                          optimizer], cwd=ROOT, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])["bytes"]


def machine() -> str:
    """This machine, as the section names the one it was measured on."""
    return (f"{platform.machine()}, 1 torch thread; Python {platform.python_version()}, "
            f"torch {torch.__version__}")


def section(res: dict, wall: float, command: str, on: str | None = None) -> str:
    """The section's text; ``on``: the machine it was measured on (default: this one)."""
    mib = 2 ** 20
    lines = ["## How costs grow: parameters, replicas, knobs, memory", "",
             f"Command: `{command}` ({wall:.0f} s) on {on or machine()}. What is measured: the docstring of "
             "`benchmarks/scaling.py`. Sync: `Engine.converge()` against a hand-written foreach average of "
             "the same tensors, CPU time.", "",
             "| parameters | replicas | sync: hpx ms | by hand ms | ratio "
             "| hpx ms per M parameters and replica |",
             "| ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in res["sync"]:
        per = 1e3 * r["hpx"] / (r["params"] / 1e6 * r["n"])
        lines.append(f"| {r['params'] / 1e6:.2f} M | {r['n']} | {1e3 * r['hpx']:.2f} | "
                     f"{1e3 * r['hand']:.2f} | {r['hpx'] / r['hand']:.2f} | {per:.3f} |")
    lines += ["", "A whole sync (4 replicas of a 6.5 k-parameter MLP; the host-side work of the search "
              "dominates there) against the number of knobs:", "",
              "| knobs | sync ms | a step without a sync, ms |", "| ---: | ---: | ---: |"]
    for r in res["knobs"]:
        lines.append(f"| {r['k']} | {1e3 * r['sync']:.2f} | {1e3 * r['step']:.2f} |")
    weights = res["mem_params"] * 4 / mib
    lines += ["", f"Peak memory (resident, over the process's own baseline), MLP of "
              f"{res['mem_params'] / 1e6:.1f} M parameters ({weights:.0f} MiB of weights):", "",
              "| optimizer | configuration | replicas | MiB | x one model | x N plain copies |",
              "| --- | --- | ---: | ---: | ---: | ---: |"]
    for opt in OPTIMIZERS:
        mem = res["memory"][opt]
        one = mem["one model"]
        lines.append(f"| {opt} | one model | 1 | {one / mib:.0f} | 1.00 | |")
        auto = mem["autolr"]
        lines.append(f"| {opt} | hpx.autolr (one model + its starting point) | 1 | {auto / mib:.0f} | "
                     f"{auto / one:.2f} | |")
        for n in res["mem_n"]:
            plain = mem[f"plain copies/{n}"]
            lines.append(f"| {opt} | N plain copies | {n} | {plain / mib:.0f} | {plain / one:.2f} | 1.00 |")
            for kind, label in (("hpx", "hpx.Engine, shared mode, one optimizer state"),
                                ("hpx per replica", "... with a state per replica")):
                b = mem[f"{kind}/{n}"]
                lines.append(f"| {opt} | {label} | {n} | {b / mib:.0f} | {b / one:.2f} | {b / plain:.2f} |")
    lines += ["", f"A sync's transient memory ({res['transient_n']} replicas of that MLP, "
              "`Engine.converge()`; peak resident memory over the memory before it):", "",
              "| dtype | first sync MiB | x one replica's parameters | a later sync MiB | x |",
              "| --- | ---: | ---: | ---: | ---: |"]
    for dtype, t in res["transient"].items():
        pb = t["param_bytes"]
        lines.append(f"| {dtype} | {t['first'] / mib:.0f} | {t['first'] / pb:.2f} | {t['later'] / mib:.0f} | "
                     f"{t['later'] / pb:.2f} |")
    lines += ["", "Reading it: a sync's cost is linear in parameters x replicas and stays within a small "
              "factor of the hand-written average; the knobs add host-side work per sync that does not "
              "depend on the model's size; on small models a fixed cost (about half a millisecond) shows. "
              "In shared mode the replicas keep one optimizer state and one gradient between them (stored "
              "once, the state updated once per step; each replica applies the update with its own "
              "learning rate), so N replicas cost N copies of the weights plus one gradient and one "
              "optimizer state; with a state per replica (and a gradient each) about N plain copies. "
              "A sync needs one copy of a replica's weights in their own dtype (bfloat16 is summed in "
              "float32 one bucket at a time); a first sync's peak can also carry the allocator "
              "growing its heap (bfloat16 here), which later syncs reuse. Resident-memory peaks carry "
              "some allocator noise. `hpx.autolr` costs one model plus one copy of its parameters "
              "(the starting point) and the probe's forward."]
    return "\n".join(lines)



def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--transient"]:
        _transient_child(argv[1], int(argv[2]), int(argv[3]))
        return
    if argv[:1] == ["--child"]:
        _memory_child(argv[1], int(argv[2]), int(argv[3]), argv[4])
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--no-write", action="store_true", help="print only: neither the store nor the docs")
    ap.add_argument("--report-only", action="store_true",
                    help="measure nothing: the section from the committed store")
    args = ap.parse_args(argv)
    if args.report_only:
        _write(_store.load(STORE, COMMAND, DOC, "about 5 min"), write=True)
        return
    torch.set_num_threads(1)
    start = time.perf_counter()
    res: dict = {"sync": [], "knobs": [], "memory": {}}
    for size, width in WIDTHS.items():
        res["sync"].append(sync_cost(width, 4, args.rounds, 3 if size < 10 else 1))
    for n in (2, 8):
        res["sync"].append(sync_cost(WIDTHS[3.2], n, args.rounds, 3))
    for k in (1, 4, 16):
        res["knobs"].append(knob_cost(k, args.rounds))
    width = WIDTHS[12.7]
    res["mem_params"] = sum(p.numel() for p in _mlp(width).parameters())
    res["mem_n"] = (2, 4, 8)
    for opt in OPTIMIZERS:
        mem = res["memory"][opt] = {"one model": memory("one model", 1, width, opt),
                                    "autolr": memory("autolr", 1, width, opt)}
        for n in res["mem_n"]:
            for kind in ("plain copies", "hpx", "hpx per replica"):
                mem[f"{kind}/{n}"] = memory(kind, n, width, opt)
    res["transient_n"] = 4
    res["transient"] = {d: transient(d, 4, width) for d in ("float32", "bfloat16")}
    shown = " ".join(a for a in argv if a != "--no-write")
    store = {"res": res, "wall": time.perf_counter() - start, "command": f"{COMMAND} {shown}".strip(),
             "on": machine()}
    if not args.no_write:
        _store.save(STORE, store)
    _write(store, write=not args.no_write)


def stored_section(store: dict) -> str:
    """The section as written from ``store`` (what :data:`STORE` holds)."""
    return section(store["res"], store["wall"], store["command"], store["on"])


def _write(store: dict, write: bool) -> None:
    text = stored_section(store)
    print(text)
    if write:
        report.write_section(DOC, "scaling", text)


if __name__ == "__main__":
    main()
