"""Faults injected into real runs, and what survived: the table in docs/reliability.md.

    python -m benchmarks.reliability             # every scenario; rewrites docs/reliability.md
    python -m benchmarks.reliability --no-write  # print the table only

The distributed scenarios start ``torchrun --nproc_per_node=2 --max-restarts=1`` on this
file: 2 gloo ranks train a digits MLP with hpx (one replica per rank, hpx's own gradient
mean), save a checkpoint every 10 steps with ``hpx.save_checkpoint`` and resume with
``hpx.load_checkpoint`` when torchrun restarts them. A fault is a SIGKILL of one rank,
during training or inside a save (after the file is written, before it is renamed into
place), on the first attempt only. A run survived when it finished and its final weights
are bit for bit those of the run without a fault. The in-process scenarios inject NaN
losses, NaN held-out data and a damaged checkpoint file.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "reliability.md"
STEPS, SAVE_EVERY, SYNC_EVERY, BATCH = 60, 10, 5, 64


# --- the training run (a torchrun worker, or in process) ---------------------------------------


def _digits() -> tuple[torch.Tensor, torch.Tensor]:
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    return torch.tensor(x / 16.0, dtype=torch.float32), torch.tensor(y, dtype=torch.long)


def _batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    x, y = _digits()
    g = torch.Generator().manual_seed(0)
    return [(x[i], y[i]) for i in (torch.randint(0, 1400, (BATCH,), generator=g) for _ in range(n))]


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Dropout(0.1), nn.Linear(64, 10))


def _digest(model: nn.Module) -> str:
    h = hashlib.sha256()
    for t in model.state_dict().values():
        h.update(t.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def _worker(args: argparse.Namespace) -> None:
    import torch.distributed as dist

    import hpx
    import hpx.checkpoint
    from hpx.backends import TorchDistributed

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    kind, at, victim = [*args.fault.split(":"), "", "", ""][:3] if args.fault else ("", "", "")
    armed = attempt == 0 and kind and int(victim) == rank
    engine = hpx.Engine(_model(), lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9),
                        [hpx.LearningRate(spread=0.3)], backend=TorchDistributed(), replicas=1,
                        sync_every=SYNC_EVERY, seed=0)
    torch.manual_seed(100 + rank)  # dropout masks: each rank its own stream (a resume restores it)
    resumed = hpx.load_checkpoint(args.ckpt, engine)
    batches = _batches(STEPS)

    def loss_fn(rep: hpx.Replica, b: Any) -> torch.Tensor:
        return F.cross_entropy(rep.model(b[0]), b[1])

    while engine.step_count < STEPS:
        t = engine.step_count
        if armed and kind == "kill" and t == int(at):
            os.kill(os.getpid(), signal.SIGKILL)
        x, y = batches[t]
        engine.step(loss_fn, (x.tensor_split(world)[rank], y.tensor_split(world)[rank]))
        if engine.step_count % SAVE_EVERY == 0:
            if armed and kind == "kill-in-save" and engine.step_count == int(at):
                def die(*_: Any) -> None:  # the payload is on disk under its temporary name
                    os.kill(os.getpid(), signal.SIGKILL)
                hpx.checkpoint.os.replace = die  # type: ignore[attr-defined]
            hpx.save_checkpoint(args.ckpt, engine)
    if rank == 0:
        Path(args.out).write_text(json.dumps({"digest": _digest(engine.model), "attempt": attempt,
                                              "resumed_from": resumed, "bases": engine.bases}))
    dist.destroy_process_group()


def _launch(fault: str, tmp: Path) -> dict[str, Any]:
    """One torchrun run of 2 ranks (restarted once on a failure); what rank 0 reported."""
    ckpt, out = tmp / f"ckpt-{fault or 'none'}", tmp / f"out-{fault or 'none'}.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           "--max-restarts=1", str(Path(__file__).resolve()), "--worker", "--ckpt", str(ckpt),
           "--out", str(out), "--fault", fault]
    # restarted gloo workers re-initialise only with this (torch 2.13; pytorch#135712)
    env = dict(os.environ, TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", OMP_NUM_THREADS="1")
    start = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    wall = time.perf_counter() - start
    result = json.loads(out.read_text()) if out.exists() else {}
    return {"returncode": proc.returncode, "wall": wall, **result,
            "log": proc.stderr[-2000:] if proc.returncode else ""}


@dataclass
class Row:
    fault: str
    where: str
    runs: int
    survived: int
    detail: str


def distributed_rows(tmp: Path, faults: list[tuple[str, str, str]]) -> list[Row]:
    ref = _launch("", tmp)
    if ref.get("returncode") != 0 or "digest" not in ref:
        raise RuntimeError(f"the run without a fault failed:\n{ref.get('log')}")
    rows = []
    for fault, label, where in faults:
        r = _launch(fault, tmp)
        ok = r.get("returncode") == 0 and r.get("digest") == ref["digest"] and r.get("attempt") == 1
        detail = (f"restarted once, resumed from step {r.get('resumed_from')}, final weights bit for bit "
                  f"those of the run without a fault" if ok else f"FAILED: {r}")
        rows.append(Row(label, where, 1, int(ok), detail))
    return rows


# --- in-process scenarios ----------------------------------------------------------------------


def _engine(**kw: Any):
    import hpx

    return hpx.Engine(_model(), lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9),
                      kw.pop("knobs", [hpx.LearningRate(spread=0.3)]), replicas=4, sync_every=SYNC_EVERY,
                      **kw)


def _finite(engine) -> bool:
    return all(bool(torch.isfinite(p).all()) for r in engine.replicas for p in r.model.parameters())


def in_process_rows(tmp: Path) -> list[Row]:
    import hpx

    rows = []
    batches = _batches(STEPS)

    def ce(rep, b):
        return F.cross_entropy(rep.model(b[0]), b[1])

    # 1. every replica's loss NaN at one step (a bad batch), at each of 10 steps in turn
    ok = 0
    for bad in range(3, STEPS, 6):
        e = _engine()
        try:
            for t, b in enumerate(batches):
                e.step((lambda r, b, t=t: ce(r, b) * math.nan) if t == bad else ce, b)
            ok += _finite(e) and e.step_count == STEPS and len(e.history) == STEPS // SYNC_EVERY
        except hpx.HpxError:
            pass
    rows.append(Row("every replica's loss NaN for one step", "in process, 4 replicas", 10, ok,
                    "the run goes on: the step blames no replica, no sync is skipped, weights stay finite"))

    # 2. one replica NaN in every interval (its lr too high for the data, say)
    e = _engine()
    nan_syncs = 0
    for t, b in enumerate(batches):
        e.step(lambda r, b, t=t: ce(r, b) * (math.nan if r.index == t // SYNC_EVERY % 4 else 1.0), b)
    nan_syncs = sum(bool(r.nonfinite) for r in e.history)
    rows.append(Row("one replica's loss NaN in every interval", "in process, 4 replicas", 1,
                    int(_finite(e) and nan_syncs == len(e.history)),
                    f"{nan_syncs} of {len(e.history)} syncs left the NaN replica out, counted it as the "
                    "worst and reset it from the others"))

    # 3. NaN in the held-out data: named at construction
    x, y = batches[0]
    bad = x.clone()
    bad[0, 0] = math.nan
    try:
        hpx.ProbeStream([(x, y), (bad, y)])
        named = False
    except hpx.ConfigError as exc:
        named = "probe batch 1 holds NaN" in str(exc)
    rows.append(Row("NaN in the held-out (probe) data", "in process", 1, int(named),
                    "refused when the signal is built, naming the batch (not reported as every replica "
                    "blowing up)"))

    # 4. a flipped byte in the newest checkpoint
    e = _engine()
    d = tmp / "flip"
    for b in batches[:20]:
        e.step(ce, b)
        if e.step_count % SAVE_EVERY == 0:
            hpx.save_checkpoint(d, e)
    f = d / "step-000000020" / "rank-00000.pt"
    raw = bytearray(f.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    f.write_bytes(bytes(raw))
    fresh = _engine()
    step = hpx.load_checkpoint(d, fresh)
    rows.append(Row("one flipped byte in the newest checkpoint", "in process", 1, int(step == 10),
                    f"its digest no longer matches: skipped with a warning, resumed from step {step}"))

    # 5. a checkpoint that does not fit the engine
    other = _engine(knobs=[hpx.LearningRate(spread=0.3), hpx.WeightDecay("wd", base=1e-4)])
    before = _digest(other.model)
    try:
        hpx.load_checkpoint(d, other)
        refused = False
    except hpx.ConfigError:
        refused = _digest(other.model) == before and other.step_count == 0
    rows.append(Row("a checkpoint from another run (other knobs)", "in process", 1, int(refused),
                    "refused with a ConfigError naming the difference; the engine is left as it was"))
    return rows


# --- the report ---------------------------------------------------------------------------------

DIST_FAULTS = [
    ("kill:23:1", "rank 1 SIGKILLed mid-interval (step 23)", "torchrun, 2 gloo ranks"),
    ("kill:41:0", "rank 0 SIGKILLed (step 41)", "torchrun, 2 gloo ranks"),
    ("kill-in-save:30:1", "rank 1 SIGKILLed inside the save of step 30", "torchrun, 2 gloo ranks"),
    ("kill-in-save:50:0", "rank 0 SIGKILLed inside the save of step 50", "torchrun, 2 gloo ranks"),
]


def _table(rows: list[Row], wall: float, command: str) -> str:
    lines = [
        "# Reliability: faults injected, and what survived",
        "",
        f"Produced by `{command}` in {wall:.0f} s on {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} CPUs; Python {platform.python_version()}, torch {torch.__version__}. What each "
        "scenario does: the docstring of `benchmarks/reliability.py`.",
        "",
        "| fault injected | where | runs | survived | what happened |",
        "| --- | --- | ---: | ---: | --- |",
    ]
    lines += [f"| {r.fault} | {r.where} | {r.runs} | {r.survived} | {r.detail} |" for r in rows]
    lost = sum(r.runs - r.survived for r in rows)
    lines += ["", f"Runs lost: {lost} of {sum(r.runs for r in rows)}.", "",
              "Also tested (`tests/test_engine_dist.py`, 4 gloo ranks): ranks built with different "
              "settings, knobs or modes, or resumed from different steps, raise a `ConsistencyError` "
              "naming the disagreement within one collective instead of hanging; a rank that lost "
              "its newest checkpoint makes every rank resume from the newest common one.", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--ckpt", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--fault", default="", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        _worker(args)
        return
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="hpx-faults-") as tmp:
        rows = distributed_rows(Path(tmp), DIST_FAULTS) + in_process_rows(Path(tmp))
    text = _table(rows, time.perf_counter() - start, "python -m benchmarks.reliability")
    print(text)
    if not args.no_write:
        DOC.write_text(text)
        print(f"wrote {DOC.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
