"""In-process overhead: one Engine.step (4 replicas, shared gradients, T = 100) against
the same work done by hand: 4 plain model + optimizer steps, each on its replica's
chunk of the batch (zero_grad, forward, backward, step, and the schedule's lr written).

Blocks of ``block`` steps alternate between the two (the order flips every block),
so machine noise hits both alike; the ratio reported is total hpx time over total
plain time, with the median of the per-block ratios beside it. Each hpx block
contains exactly one sync (averaging + controller + permutation draw), so the
per-sync cost is amortised as in a real run.
"""

from __future__ import annotations

import copy
import cProfile
import pstats
import statistics
import time
from typing import Any

import torch

import hpx
from benchmarks.tasks import get_task
from hpx._batch import _split


def _setup(task_name: str, sync_every: int):
    task = get_task(task_name)
    task.data()
    f = task.schedule()
    model = task.model(0)
    knobs = task.knobs(task.grid_center, 0.5, f)
    engine = hpx.Engine(copy.deepcopy(model), task.optimizer, knobs, replicas=4, sync_every=sync_every,
                        seed=0, signal=hpx.IntervalLoss())
    plain = [copy.deepcopy(model) for _ in range(4)]
    opts = [task.optimizer(m) for m in plain]
    fixed = task.set_fixed(plain[0], opts[0])
    gen = torch.Generator().manual_seed(0)
    batches = [task.sample(gen, task.batch) for _ in range(64)]

    def loss_fn(rep, b):
        return task.loss(rep.model, b, rep._values)

    state = {"t_hpx": 0, "t_plain": 0}

    def hpx_steps(n: int) -> None:
        for _ in range(n):
            engine.step(loss_fn, batches[state["t_hpx"] % len(batches)])
            state["t_hpx"] += 1

    def plain_steps(n: int) -> None:
        for _ in range(n):
            t = state["t_plain"]
            # hpx._batch._split is private, with no public equivalent: it is how Engine.step
            # splits a batch among replicas, used here so the plain steps get the same chunks
            parts = _split(batches[t % len(batches)], 4)
            lr = task.grid_center * f(t % task.steps)
            for m, o, b in zip(plain, opts, parts):
                for g in o.param_groups:
                    g["lr"] = lr
                o.zero_grad(set_to_none=True)
                task.loss(m, b, fixed).backward()
                o.step()
            state["t_plain"] += 1

    return hpx_steps, plain_steps, engine


def measure(task_name: str, *, block: int = 100, blocks: int = 10, sync_every: int = 100) -> dict[str, Any]:
    """The engine as it is (no patching) against the plain replica steps."""
    torch.set_num_threads(1)
    hpx_steps, plain_steps, _ = _setup(task_name, sync_every)
    hpx_steps(block)  # warm up both paths (allocations, first sync)
    plain_steps(block)
    th, tp, ratios = 0.0, 0.0, []
    for i in range(blocks):
        order = [(hpx_steps, "h"), (plain_steps, "p")]
        if i % 2:
            order.reverse()
        took = {}
        for fn, name in order:
            s = time.perf_counter()
            fn(block)
            took[name] = time.perf_counter() - s
        th += took["h"]
        tp += took["p"]
        ratios.append(took["h"] / took["p"])
    return {"task": task_name, "block": block, "blocks": blocks, "sync_every": sync_every,
            "hpx_ms": 1000 * th / (blocks * block), "plain_ms": 1000 * tp / (blocks * block),
            "ratio": th / tp, "median_ratio": statistics.median(ratios),
            "min_ratio": min(ratios), "max_ratio": max(ratios)}


def parts(task_name: str, sync_every: int = 100, n: int = 2000) -> dict[str, float]:
    """Microseconds per call of the engine's per-step parts (timed directly, no profiler).

    There is no public API for these: they call the engine's private per-step helpers,
    each documented in hpx/engine/facade.py (``_GradBuckets.average_``/``zero_``: the shared
    gradient's mean and reset; ``Engine._write``: the schedule's values written;
    ``_split``: the batch split among replicas), as they are, without patching anything.
    """
    torch.set_num_threads(1)
    hpx_steps, _, engine = _setup(task_name, sync_every)
    hpx_steps(20)
    lt = torch.zeros(engine.n_local)
    batch = get_task(task_name).sample(torch.Generator().manual_seed(1), get_task(task_name).batch)

    def tm(f):
        for _ in range(50):
            f()
        s = time.perf_counter()
        for _ in range(n):
            f()
        return 1e6 * (time.perf_counter() - s) / n

    grads, health = engine._grads, engine._grad_health
    return {"gradient mean (_GradBuckets.average_)":
            tm(lambda: grads.average_(lt, engine.collective, health)),
            "gradient zero (_GradBuckets.zero_)": tm(grads.zero_),
            "schedule values written (Engine._write)": tm(engine._write),
            "batch split (_split)": tm(lambda: _split(batch, engine.n_local))}


def profile(task_name: str, steps: int = 200, sync_every: int = 100, top: int = 10) -> str:
    """cProfile of ``steps`` engine steps: hpx's own functions by cumulative time per step."""
    torch.set_num_threads(1)
    hpx_steps, _, _ = _setup(task_name, sync_every)
    hpx_steps(20)
    pr = cProfile.Profile()
    pr.enable()
    hpx_steps(steps)
    pr.disable()
    st = pstats.Stats(pr)
    total = st.total_tt
    rows = []
    for (fn, line, name), (_, nc, tt, ct, _) in st.stats.items():
        if "/hpx/" in fn:
            rows.append((ct, tt, nc, f"{fn.split('/hpx/')[-1]}:{line}({name})"))
    rows.sort(reverse=True)
    lines = [f"total profiled time {1e6 * total / steps:.0f} us/step (cProfile inflates small calls)",
             f"{'cum us/step':>12} {'own us/step':>12} {'calls':>7}  function"]
    for ct, tt, nc, name in rows[:top]:
        lines.append(f"{1e6 * ct / steps:12.1f} {1e6 * tt / steps:12.1f} {nc:7d}  hpx/{name}")
    return "\n".join(lines)


def run_overhead(tasks=("mlp", "cnn", "charlm"), *, block=100, blocks=10, log=print) -> dict[str, Any]:
    out = {"rows": [], "profiles": {}, "parts": {}}
    for t in tasks:
        r = measure(t, block=block, blocks=blocks)
        log(f"  overhead {t}: hpx {r['hpx_ms']:.3f} ms/step, plain x4 {r['plain_ms']:.3f} ms/step, "
            f"ratio {r['ratio']:.3f} (median {r['median_ratio']:.3f})")
        out["rows"].append(r)
        if r["ratio"] > 1.05:
            out["profiles"][t] = profile(t, steps=2 * block)
            out["parts"][t] = parts(t, n=max(100, 20 * block))
    return out
