"""The experiments: which runs, in what order, and what is computed from them.

Phase 1 runs the plain grid of every task and picks the oracle (the grid point with
the best mean validation loss; for the CNN also the best mean accuracy). Phase 2
runs everything that depends on the oracle: hpx from the oracle's lr, 10x below and
10x above; the stability comparison (Table 1 of the paper); the ablations; the
directions tried against the signal's biases. Analysis reads only the results.
"""

from __future__ import annotations

import math
import os
import statistics
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from benchmarks.runs import RunSpec, run
from benchmarks.tasks import get_task

STARTS = {"low": 0.1, "oracle": 1.0, "high": 10.0}
START_LABEL = {"low": "oracle / 10", "oracle": "oracle", "high": "oracle x 10"}

ABLATIONS = ["interval", "shared-batch", "no-average", "no-controller", "one-permutation", "paper",
             "paper-momentum"]
DIRECTIONS = ["ema-probe", "anneal-probe", "significance", "narrowing", "fast", "fast-short-t", "warmup-only"]
STABILITY = ["no-controller", "default", "independent-no-controller", "independent"]
NOISE = (1e-4, 2e-4)  # the oracle's lr nudged by these relative amounts: the noise floor


@dataclass
class SuiteConfig:
    mode: str = "full"
    tasks: tuple[str, ...] = ("mlp", "charlm", "cnn")
    grid_n: int = 9
    seeds: tuple[int, ...] = (0, 1)
    aux_seeds: dict[str, tuple[int, ...]] = field(default_factory=lambda: {"charlm": (0,), "cnn": (0,)})
    overrides: dict[str, dict[str, Any]] = field(default_factory=dict)
    main_variant: str = "default"
    ablations: tuple[str, ...] = tuple(ABLATIONS)
    directions: tuple[str, ...] = tuple(DIRECTIONS)
    aux_starts: tuple[str, ...] = ("low", "oracle", "high")
    horizon: dict[str, dict[str, Any]] = field(default_factory=lambda: {
        "mlp": {"seeds": (0, 1), "starts": ("low", "oracle")},
        "cnn": {"seeds": (0, 1), "starts": ("low", "oracle")},
        "charlm": {"seeds": (0,), "starts": ("low", "oracle")}})
    jobs: int = 1

    def seeds_aux(self, task: str) -> tuple[int, ...]:
        return self.aux_seeds.get(task, self.seeds)

    def ov(self, task: str) -> tuple:
        return tuple(sorted(self.overrides.get(task, {}).items()))


def quick_config(jobs: int = 1) -> SuiteConfig:
    """The CI smoke test: every stage of the pipeline, tiny runs (checks plumbing, not quality)."""
    return SuiteConfig(
        mode="quick",
        grid_n=3, seeds=(0,), aux_seeds={},
        overrides={"mlp": {"steps": 60, "evals": 2, "sync_every": 10},
                   "charlm": {"steps": 12, "evals": 1, "sync_every": 4, "batch": 8},
                   "cnn": {"steps": 24, "evals": 1, "sync_every": 6, "batch": 32}},
        ablations=("interval", "no-average", "one-permutation", "paper"),
        directions=("anneal-probe", "significance"),
        aux_starts=("low",),
        horizon={"mlp": {"seeds": (0,), "starts": ("oracle",)}},
        jobs=jobs,
    )


# ----------------------------------------------------------------------------- execution


def _key(spec: RunSpec) -> str:
    return f"{spec.task}|{spec.kind}|{spec.lr:.6g}|{spec.seed}|{spec.variant if spec.kind == 'hpx' else ''}"


def execute(specs: Iterable[RunSpec], results: dict[str, dict], jobs: int,
            log: Callable[[str], None] = print) -> None:
    """Run every spec not yet in ``results`` (in a process pool when ``jobs > 1``)."""
    todo, seen = [], set()
    for s in specs:
        k = _key(s)
        if k not in results and k not in seen:
            todo.append(s)
            seen.add(k)
    if not todo:
        return
    t0 = time.perf_counter()

    def note(i, r):
        f = r["final"]
        v = r["variant"] if r["kind"] == "hpx" else ""
        log(f"  [{i}/{len(todo)}] {r['task']:6s} {r['kind']:5s} {v:22s} "
            f"lr={r['lr']:<9.4g} seed={r['seed']} val={f['loss']:.4f} acc={f['acc']:.1f} "
            f"{'DIVERGED ' if r['diverged'] else ''}({r['wall']:.1f}s, {time.perf_counter() - t0:.0f}s)")

    if jobs <= 1:
        for i, s in enumerate(todo, 1):
            r = run(s)
            results[_key(s)] = r
            note(i, r)
        return
    import multiprocessing as mp

    # the longest runs first, so the pool's tail is short
    todo.sort(key=lambda s: -(get_task(s.task, **dict(s.overrides)).steps
                              * (3 if s.task == "charlm" else 1) * (2 if s.kind == "hpx" else 1)))
    from concurrent.futures import as_completed

    pool = ProcessPoolExecutor(max_workers=jobs, mp_context=mp.get_context("spawn"))
    try:
        futs = {pool.submit(run, s): s for s in todo}
        for i, fut in enumerate(as_completed(futs), 1):
            s = futs[fut]
            r = fut.result()
            results[_key(s)] = r
            note(i, r)
    except BaseException:
        _kill_pool(pool)
        raise
    pool.shutdown()


def _kill_pool(pool: ProcessPoolExecutor) -> None:
    """Stop the pool's workers (ours, by their pids) so none outlives an interrupted run."""
    for p in list(getattr(pool, "_processes", {}).values()):
        p.terminate()
    pool.shutdown(wait=False, cancel_futures=True)


def get(results: dict, task: str, kind: str, lr: float, seed: int, variant: str = "") -> dict:
    spec = RunSpec(task, kind, lr, seed=seed, variant=variant or "default")
    return results[_key(spec)]


# ----------------------------------------------------------------------------- planning


def plan_grid(cfg: SuiteConfig) -> list[RunSpec]:
    out = []
    for t in cfg.tasks:
        task = get_task(t, **dict(cfg.ov(t)))
        for lr in task.grid(cfg.grid_n):
            for s in cfg.seeds:
                out.append(RunSpec(t, "plain", lr, seed=s, overrides=cfg.ov(t), tag="grid"))
    return out


def failed(r: dict) -> bool:
    """Diverged (a non-finite loss) or collapsed: a final validation loss no better than
    predicting the uniform distribution (ln of the number of classes), e.g. dead ReLUs."""
    if r["diverged"] or not math.isfinite(r["final"]["loss"]):
        return True
    return r["final"]["loss"] >= 0.98 * get_task(r["task"]).chance_loss()


def _val(r: dict, metric: str = "loss") -> float:
    v = r["final"][metric]
    if r["diverged"] or not math.isfinite(v):
        return math.inf if metric == "loss" else 0.0
    return v


def grid_table(cfg: SuiteConfig, results: dict, t: str) -> list[dict]:
    task = get_task(t, **dict(cfg.ov(t)))
    rows = []
    for lr in task.grid(cfg.grid_n):
        rs = [results[_key(RunSpec(t, "plain", lr, seed=s, overrides=cfg.ov(t)))] for s in cfg.seeds]
        losses = [_val(r) for r in rs]
        accs = [_val(r, "acc") for r in rs]
        rows.append({"lr": lr, "loss": statistics.fmean(losses), "losses": losses,
                     "acc": statistics.fmean(accs), "accs": accs,
                     "diverged": sum(failed(r) for r in rs),
                     "wall": statistics.fmean(r["wall"] for r in rs),
                     "samples": rs[0]["train_samples"]})
    return rows


def oracle(cfg: SuiteConfig, results: dict, t: str) -> dict:
    rows = grid_table(cfg, results, t)
    best = min(rows, key=lambda r: r["loss"])
    best_acc = max(rows, key=lambda r: r["acc"])
    return {"lr": best["lr"], "loss": best["loss"], "acc": best["acc"],
            "acc_lr": best_acc["lr"], "acc_best": best_acc["acc"], "acc_best_loss": best_acc["loss"],
            "seed_ratios": [x / best["loss"] for x in best["losses"]],
            "grid_samples": sum(r["samples"] for r in rows) * len(cfg.seeds),
            "grid_wall": sum(r["wall"] for r in rows) * len(cfg.seeds)}


def stability_lr(cfg: SuiteConfig, results: dict, t: str) -> float:
    """The smallest grid lr above the oracle at which plain training diverges or ends at
    1.5x the oracle's loss or more; the largest grid lr if none does."""
    rows = grid_table(cfg, results, t)
    orc = oracle(cfg, results, t)
    for r in rows:
        if r["lr"] > orc["lr"] and (r["diverged"] or r["loss"] >= 1.5 * orc["loss"]):
            return r["lr"]
    return rows[-1]["lr"]


def plan_phase2(cfg: SuiteConfig, results: dict) -> list[RunSpec]:
    out = []
    for t in cfg.tasks:
        ov = cfg.ov(t)
        o = oracle(cfg, results, t)["lr"]
        for f in STARTS.values():
            for s in cfg.seeds:
                out.append(RunSpec(t, "hpx", o * f, seed=s, variant=cfg.main_variant, overrides=ov,
                                   tag="main"))
        for d in NOISE:
            for s in cfg.seeds:
                out.append(RunSpec(t, "plain", o * (1 + d), seed=s, overrides=ov, tag="noise"))
        hi = stability_lr(cfg, results, t)
        for v in STABILITY:
            for s in cfg.seeds_aux(t):
                out.append(RunSpec(t, "hpx", hi, seed=s, variant=v, overrides=ov, tag="stability"))
        n_knobs = len(get_task(t).knobs(1.0, 0.5, lambda _: 1.0))
        for v in (*cfg.ablations, *cfg.directions):
            if v == "one-permutation" and n_knobs == 1:
                continue
            for start in cfg.aux_starts:
                for s in cfg.seeds_aux(t):
                    out.append(RunSpec(t, "hpx", o * STARTS[start], seed=s, variant=v, overrides=ov,
                                       tag="aux"))
    return out


# ----------------------------------------------------------------------------- analysis


def hpx_runs(cfg: SuiteConfig, results: dict, t: str, variant: str, start: str,
             seeds: Iterable[int] | None = None) -> list[dict]:
    o = oracle(cfg, results, t)["lr"]
    out = []
    for s in (cfg.seeds if seeds is None else seeds):
        k = _key(RunSpec(t, "hpx", o * STARTS[start], seed=s, variant=variant, overrides=cfg.ov(t)))
        if k in results:
            out.append(results[k])
    return out


def lr_knobs(r: dict) -> list[str]:
    return [k for k in r["end_lr"] if k == "lr" or k.startswith("lr/")]


def end_lr(r: dict) -> float:
    """The geometric mean of the lr bases at the end (one lr knob except on the char LM)."""
    ks = lr_knobs(r)
    return math.exp(statistics.fmean(math.log(r["end_lr"][k]) for k in ks))


def summarize(rs: list[dict], orc: dict, metric: str) -> dict:
    """Mean final loss/acc of runs, ratios to the oracle, ending lr, compute."""
    losses = [_val(r) for r in rs]
    accs = [_val(r, "acc") for r in rs]
    mean_loss = statistics.fmean(losses)
    return {
        "n": len(rs), "loss": mean_loss, "losses": losses, "ratio": mean_loss / orc["loss"],
        "ratios": [x / orc["loss"] for x in losses],
        "acc": statistics.fmean(accs), "accs": accs,
        "acc_gap": statistics.fmean(accs) - orc["acc_best"],
        "end_lr": statistics.fmean(end_lr(r) for r in rs) if rs else math.nan,
        "end_lrs": [end_lr(r) for r in rs],
        "train_samples": rs[0]["train_samples"] if rs else 0,
        "signal_samples": rs[0]["signal_samples"] if rs else 0,
        "wall": statistics.fmean(r["wall"] for r in rs) if rs else math.nan,
        "diverged": sum(failed(r) for r in rs),
    }


def meets(task_metric: str, s: dict) -> bool:
    if task_metric == "acc":
        return s["acc_gap"] >= -0.5
    return s["ratio"] <= 1.02


def _slope_t(z: list[float], y: list[float]) -> float:
    """t statistic of the least-squares slope of y on z (n - 2 degrees of freedom)."""
    n = len(z)
    zm, ym = statistics.fmean(z), statistics.fmean(y)
    szz = sum((a - zm) ** 2 for a in z)
    if n < 3 or szz <= 0:
        return 0.0
    b = sum((a - zm) * (c - ym) for a, c in zip(z, y)) / szz
    res = sum((c - ym - b * (a - zm)) ** 2 for a, c in zip(z, y))
    se = math.sqrt(res / (n - 2) / szz) if res > 0 else 0.0
    return b / se if se > 0 else (math.copysign(math.inf, b) if b else 0.0)


def signal_stats(rs: list[dict], oracle_lr: float, warm_step: int, far: float = 1.5) -> dict:
    """For every sync where the controller acted, on every lr knob:

    * toward: does ``D`` point toward the oracle's lr (only where the interval's lr
      base is more than ``far`` x away from it, so the answer is not ambiguous);
    * |t|: the t statistic of the replicas' score-vs-log(lr) slope (how clearly the
      replicas' scores separate along the lr, whatever the direction);
    * down: the share of syncs where ``D`` pointed to a lower lr.
    Split into the lr warm-up and after the schedule's peak.
    """
    out = {"warm": {"toward": [], "t": [], "down": []}, "after": {"toward": [], "t": [], "down": []}}
    for r in rs:
        for knob in lr_knobs(r):
            for h in r["history"]:
                if h["direction"] is None:
                    continue
                vals = h["values"][knob]
                scores = h["scores"]
                ok = [i for i, s in enumerate(scores) if s is not None and math.isfinite(s)]
                if len(ok) < 3:
                    continue
                base = math.exp(statistics.fmean(math.log(vals[i]) for i in ok))
                d = h["direction"][knob]
                part = out["warm" if h["step"] <= warm_step else "after"]
                t = _slope_t([math.log(vals[i]) for i in ok], [scores[i] for i in ok])
                if math.isfinite(t):
                    part["t"].append(abs(t))
                if d != 0:
                    part["down"].append(d < 0)
                    gap = math.log(oracle_lr / base)
                    if abs(gap) > math.log(far):
                        part["toward"].append((d > 0) == (gap > 0))
    res = {}
    for ph, p in out.items():
        res[ph] = {"n": len(p["down"]),
                   "toward": (sum(p["toward"]) / len(p["toward"])) if p["toward"] else math.nan,
                   "n_toward": len(p["toward"]),
                   "t": statistics.median(p["t"]) if p["t"] else math.nan,
                   "down": (sum(p["down"]) / len(p["down"])) if p["down"] else math.nan}
    return res


def analyse(cfg: SuiteConfig, results: dict) -> dict:
    """Everything the report needs, as plain data."""
    out: dict[str, Any] = {"tasks": {}, "horizon": results.get("__horizon_summary__", {}),
                           "collinearity": results.get("__collinearity__", {})}
    for t in cfg.tasks:
        task = get_task(t, **dict(cfg.ov(t)))
        orc = oracle(cfg, results, t)
        warm = round(0.1 * task.steps)
        info: dict[str, Any] = {"title": task.title, "metric": task.metric, "oracle": orc,
                                "grid": grid_table(cfg, results, t), "steps": task.steps,
                                "batch": task.batch, "T": task.sync_every}
        info["main"] = {st: summarize(hpx_runs(cfg, results, t, cfg.main_variant, st), orc, task.metric)
                        for st in STARTS}
        # plain runs at the same starting lrs (on the grid only when the grid spans them)
        info["plain_at_start"] = {}
        for st, f in STARTS.items():
            lr = orc["lr"] * f
            rs = [results.get(_key(RunSpec(t, "plain", lr, seed=s, overrides=cfg.ov(t)))) for s in cfg.seeds]
            if all(rs):
                info["plain_at_start"][st] = summarize(rs, orc, task.metric)
        nudged = [RunSpec(t, "plain", orc["lr"] * (1 + d), seed=s, overrides=cfg.ov(t))
                  for d in (0.0, *NOISE) for s in cfg.seeds]
        nz = [results[_key(sp)] for sp in nudged if _key(sp) in results]
        if len(nz) > 1:
            rl = [_val(r) / orc["loss"] for r in nz]
            ra = [_val(r, "acc") for r in nz]
            info["noise"] = {"n": len(nz), "ratios": rl, "sd": statistics.stdev(rl),
                             "range": max(rl) - min(rl), "acc_sd": statistics.stdev(ra),
                             "acc_range": max(ra) - min(ra)}
        hi = stability_lr(cfg, results, t)
        stab = {"lr": hi}
        plain_hi = [results[_key(RunSpec(t, "plain", hi, seed=s, overrides=cfg.ov(t)))] for s in cfg.seeds]
        stab["plain"] = summarize(plain_hi, orc, task.metric)
        for v in STABILITY:
            rs = [results[k] for s in cfg.seeds_aux(t)
                  if (k := _key(RunSpec(t, "hpx", hi, seed=s, variant=v, overrides=cfg.ov(t)))) in results]
            stab[v] = summarize(rs, orc, task.metric) if rs else None
        info["stability"] = stab
        aux = {}
        for v in ("default", *cfg.ablations, *cfg.directions):
            aux[v] = {}
            for st in cfg.aux_starts:
                rs = hpx_runs(cfg, results, t, v, st, cfg.seeds_aux(t))
                if rs:
                    aux[v][st] = summarize(rs, orc, task.metric)
        info["aux"] = aux
        sig = {}
        for v in ("default", *cfg.ablations, *cfg.directions):
            rs = []
            for st in STARTS:
                rs += hpx_runs(cfg, results, t, v, st)
            rs = [r for r in rs if any(h["direction"] is not None for h in r["history"])]
            if rs:
                s = signal_stats(rs, orc["lr"], warm)
                at = [r for r in hpx_runs(cfg, results, t, v, "oracle")]
                s["end_at_oracle"] = (statistics.fmean(end_lr(r) for r in at) / orc["lr"]) if at else math.nan
                sig[v] = s
        info["signal"] = sig
        out["tasks"][t] = info
    return out


def run_horizon(cfg: SuiteConfig, results: dict, log: Callable[[str], None] = print) -> None:
    """Phase 3: the short- vs long-horizon branches (benchmarks.horizon), into results["__horizon__"]."""
    from benchmarks.horizon import horizon_job, summarize_horizon, t0_points

    done = results.setdefault("__horizon__", {})
    jobs = []
    for t, c in cfg.horizon.items():
        if t not in cfg.tasks:
            continue
        o = oracle(cfg, results, t)["lr"]
        t0s = tuple(t0_points(t, dict(cfg.ov(t))))
        for st in c["starts"]:
            for s in c["seeds"]:
                if f"{t}|{st}|{s}" not in done:
                    jobs.append((t, st, o * STARTS[st], s, t0s, cfg.ov(t)))
    if jobs:
        log(f"phase 3: short- vs long-horizon branches ({len(jobs)} series)")
        pool = None
        if cfg.jobs <= 1:
            outs = map(horizon_job, jobs)
        else:
            import multiprocessing as mp

            pool = ProcessPoolExecutor(max_workers=cfg.jobs, mp_context=mp.get_context("spawn"))
            outs = pool.map(horizon_job, jobs)
        try:
            for (t, st, s), rows in outs:
                done[f"{t}|{st}|{s}"] = rows
                log(f"  horizon {t} from {st} seed {s}: done")
        except BaseException:
            if pool is not None:
                _kill_pool(pool)
            raise
        if pool is not None:
            pool.shutdown()
    from benchmarks.horizon import collinearity

    col = results.setdefault("__collinearity__", {})
    for t in cfg.tasks:
        if t not in col:
            col[t] = collinearity(t, oracle(cfg, results, t)["lr"], overrides=dict(cfg.ov(t)))
            log(f"  collinearity {t}: min |cos| {col[t]['min_abs_cos']:.4f}")
    summary = {}
    for t, c in cfg.horizon.items():
        if t not in cfg.tasks:
            continue
        for st in c["starts"]:
            per_seed = [done[f"{t}|{st}|{s}"] for s in c["seeds"] if f"{t}|{st}|{s}" in done]
            if per_seed:
                summary[f"{t}|{st}"] = {"rows": summarize_horizon(per_seed), "seeds": list(c["seeds"]),
                                        "lr": oracle(cfg, results, t)["lr"] * STARTS[st]}
    results["__horizon_summary__"] = summary


def run_suite(cfg: SuiteConfig, log: Callable[[str], None] = print,
              results: dict | None = None) -> tuple[dict, dict]:
    """Run (or complete) every experiment; return (results, analysis)."""
    results = {} if results is None else results
    t0 = time.perf_counter()
    log(f"phase 1: plain grids ({cfg.mode}, jobs={cfg.jobs})")
    execute(plan_grid(cfg), results, cfg.jobs, log)
    for t in cfg.tasks:
        o = oracle(cfg, results, t)
        log(f"  {t}: oracle lr {o['lr']:.4g}, val loss {o['loss']:.4f}, acc {o['acc']:.2f}")
    log("phase 2: hpx runs")
    execute(plan_phase2(cfg, results), results, cfg.jobs, log)
    run_horizon(cfg, results, log)
    analysis = analyse(cfg, results)
    analysis["wall"] = time.perf_counter() - t0
    analysis["jobs"] = cfg.jobs
    return results, analysis


def default_jobs() -> int:
    return max(1, min(2, os.cpu_count() or 1))
