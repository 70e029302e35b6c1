"""Markdown tables and PNG plots from the suite's results (nothing here trains)."""

from __future__ import annotations

import math
import os
import platform
import re
from pathlib import Path

import torch

from benchmarks.runs import RunSpec
from benchmarks.suite import STABILITY, START_LABEL, STARTS, SuiteConfig, _key, end_lr, meets, oracle

VARIANT_TEXT = {
    "default": "hpx (ProbeStream signal, hpx defaults otherwise)",
    "interval": "signal: interval training loss (the paper's)",
    "shared-batch": "signal: shared batch (paired, training data)",
    "no-average": "no averaging (average=False)",
    "no-controller": "no controller (controller=False)",
    "one-permutation": "one permutation for all knobs (independent=False)",
    "paper": "paper-faithful (hpx.schedule.OneCyclePlan rule='paper': OneCycle, linear space, sigma 0.1, "
             "decay gamma, controller from the peak, interval loss; its base is the decayed lr)",
    "independent": "independent replicas (local-SGD mode)",
    "independent-no-controller": "independent replicas, no controller",
    "ema-probe": "probe scores an EMA of each replica's weights (annealing proxy)",
    "anneal-probe": "probe after a k = T/4 step cool-down of each replica",
    "significance": "controller: steps sized to the pooled slope's t, from the first sync",
    "paper-momentum": "hpx's controller with the paper's momentum (debias_momentum=False: "
                      "first steps 1 - beta of lambda x D)",
    "narrowing": "spread narrows as the direction's sign grows consistent",
    "stop-half": "controller stops at half the run",
    "fast": "controller without momentum, meta_lr 1 (max step every sync)",
    "fast-short-t": "as fast, and syncs 4x as often (T/4)",
    "warmup-only": "as fast with T/4, the controller acts only during the lr warm-up",
}


STAB_TEXT = {
    "no-controller": "no controller (the paper's \"HDET without auto-LR\")",
    "default": "with its controller (ProbeStream)",
    "independent-no-controller": "independent replicas (local SGD), no controller",
    "independent": "independent replicas (local SGD), with its controller",
}


def _f(x: float, nd: int = 4) -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "diverged" if x == math.inf else "-"
    return f"{x:.{nd}f}"


def _g(x: float) -> str:
    if x is None or not math.isfinite(x):
        return "-"
    return f"{x:.3g}"


def _pct(x: float) -> str:
    return "-" if x is None or not math.isfinite(x) else f"{100 * x:.0f}%"


def _ratio(s: dict) -> str:
    if s is None or s["n"] == 0:
        return "-"
    if not math.isfinite(s["ratio"]):
        return f"diverged ({s['diverged']}/{s['n']})"
    return f"{s['ratio']:.3f}"


def machine() -> str:
    cpu = platform.processor() or "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return (f"{cpu}, {os.cpu_count()} logical cores; Python {platform.python_version()}, "
            f"torch {torch.__version__}, {platform.system()} {platform.release()}; "
            "torch.set_num_threads(1) in every run")


# ----------------------------------------------------------------------------- tables


def grid_md(info: dict) -> str:
    o = info["oracle"]
    lines = ["| max lr | val loss (mean) | per seed | val acc % (mean) | diverged or collapsed |",
             "| ---: | ---: | --- | ---: | ---: |"]
    for r in info["grid"]:
        mark = " **(oracle)**" if r["lr"] == o["lr"] else ""
        mark += " (best acc)" if r["lr"] == o["acc_lr"] and info["metric"] == "acc" else ""
        lines.append(f"| {r['lr']:.4g}{mark} | {_f(r['loss'])} | {', '.join(_f(x) for x in r['losses'])} | "
                     f"{r['acc']:.2f} | {r['diverged']} |")
    return "\n".join(lines)


def main_md(analysis: dict, cfg: SuiteConfig) -> str:
    lines = ["| task | run | start lr | final val loss | ratio to oracle | per seed | val acc % (vs best) "
             "| ended lr (x oracle) | fwd-bwd samples | signal fwd samples | wall s | target met |",
             "| --- | --- | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | :---: |"]
    for t, info in analysis["tasks"].items():
        o = info["oracle"]
        nseeds = len(cfg.seeds)
        spread = ", ".join(_g(x) for x in o.get("seed_ratios", []))
        lines.append(f"| {t} | grid: {len(info['grid'])} lrs x {nseeds} seeds | oracle {o['lr']:.4g} | "
                     f"{_f(o['loss'])} | 1 | {spread or '-'} | {o['acc']:.2f} (best {o['acc_best']:.2f}) "
                     "| 1 | "
                     f"{o['grid_samples']:,} | 0 | {o['grid_wall']:.1f} | |")
        for st in STARTS:
            s = info["main"][st]
            if not s["n"]:
                continue
            ok = "yes" if meets(info["metric"], s) else "**no**"
            el = s["end_lr"] / o["lr"]
            lines.append(
                f"| {t} | hpx from {START_LABEL[st]} | {o['lr'] * STARTS[st]:.4g} | {_f(s['loss'])} | "
                f"{_ratio(s)} | {', '.join(_g(x) for x in s['ratios'])} | "
                f"{s['acc']:.2f} ({s['acc_gap']:+.2f}) | "
                f"{_g(el)} | {s['train_samples']:,} | {s['signal_samples']:,} | {s['wall']:.1f} | {ok} |")
            p = info["plain_at_start"].get(st)
            if p and st != "oracle":
                lines.append(f"| {t} | plain at the same lr (grid) | {o['lr'] * STARTS[st]:.4g} | "
                             f"{_f(p['loss'])} | "
                             f"{_ratio(p)} | {', '.join(_g(x) for x in p['ratios'])} | {p['acc']:.2f} "
                             f"({p['acc_gap']:+.2f}) | {STARTS[st]:g} | {p['train_samples']:,} | 0 | "
                             f"{p['wall']:.1f} | |")
    return "\n".join(lines)


def stability_md(analysis: dict) -> str:
    lines = ["| task | run | mean lr | final val loss | ratio to oracle | val acc % "
             "| diverged or collapsed |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    for t, info in analysis["tasks"].items():
        st, o = info["stability"], info["oracle"]
        lines.append(f"| {t} | plain at the oracle lr | {o['lr']:.4g} | {_f(o['loss'])} | 1 | "
                     f"{o['acc']:.2f} | 0 |")
        p = st["plain"]
        lines.append(f"| {t} | plain at the high lr | {st['lr']:.4g} | {_f(p['loss'])} | {_ratio(p)} | "
                     f"{p['acc']:.2f} | {p['diverged']}/{p['n']} |")
        for v in STABILITY:
            s = st.get(v)
            if not s:
                continue
            lines.append(f"| {t} | hpx: {STAB_TEXT.get(v, v)} | {st['lr']:.4g} | {_f(s['loss'])} | "
                         f"{_ratio(s)} | "
                         f"{s['acc']:.2f} | {s['diverged']}/{s['n']} |")
    return "\n".join(lines)


def variants_md(analysis: dict, cfg: SuiteConfig, variants: list[str]) -> str:
    starts = list(cfg.aux_starts)
    head = " | ".join(f"from {START_LABEL[s]}: ratio (ended lr x oracle)" for s in starts)
    lines = [f"| task | variant | {head} |", "| --- | --- |" + " ---: |" * len(starts)]
    for t, info in analysis["tasks"].items():
        o = info["oracle"]
        for v in variants:
            row = info["aux"].get(v, {})
            if not row:
                continue
            cells = []
            for s in starts:
                x = row.get(s)
                if not x:
                    cells.append("-")
                    continue
                extra = f", acc {x['acc_gap']:+.2f}" if info["metric"] == "acc" else ""
                cells.append(f"{_ratio(x)} ({_g(x['end_lr'] / o['lr'])}{extra})")
            lines.append(f"| {t} | {VARIANT_TEXT.get(v, v)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def signal_md(analysis: dict, variants: list[str]) -> str:
    lines = ["| task | variant | warm-up: syncs, toward oracle, median abs t | after the peak: syncs, toward "
             "oracle, median abs t, share pointing down | from the oracle start: ended lr x oracle |",
             "| --- | --- | --- | --- | ---: |"]
    for t, info in analysis["tasks"].items():
        for v in variants:
            s = info["signal"].get(v)
            if not s:
                continue
            w, a = s["warm"], s["after"]
            lines.append(
                f"| {t} | {v} | {w['n']}, {_pct(w['toward'])} (of {w['n_toward']}), {_g(w['t'])} | "
                f"{a['n']}, {_pct(a['toward'])} (of {a['n_toward']}), {_g(a['t'])}, {_pct(a['down'])} | "
                f"{_g(s['end_at_oracle'])} |")
    return "\n".join(lines)


def noise_md(analysis: dict) -> str:
    lines = ["| task | runs | final-loss ratios: sd | max - min | accuracy: sd (points) | max - min |",
             "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for t, info in analysis["tasks"].items():
        nz = info.get("noise")
        if nz:
            lines.append(f"| {t} | {nz['n']} | {100 * nz['sd']:.1f}% | {100 * nz['range']:.1f}% | "
                         f"{nz['acc_sd']:.2f} | {nz['acc_range']:.2f} |")
    return "\n".join(lines)


def horizon_md(analysis: dict) -> str:
    lines = ["| task | run's max lr | branch at step | short horizon (probe, T steps later): better, "
             "L(up) - L(down) | long horizon (final val loss): better, L(up) - L(down) | signs agree |",
             "| --- | --- | ---: | --- | --- | ---: |"]
    for key, h in analysis.get("horizon", {}).items():
        t, st = key.split("|")
        for r in h["rows"]:
            lines.append(f"| {t} | {START_LABEL[st]} ({h['lr']:.3g}) | {r['t0']} | {r['short_best']}, "
                         f"{r['short_diff']:+.4f} | {r['long_best']}, {r['long_diff']:+.4f} | "
                         f"{r['agree']}/{r['n']} |")
    return "\n".join(lines)


def horizon_agreement(analysis: dict, after: bool = True) -> tuple[int, int]:
    agree = total = 0
    for key, h in analysis.get("horizon", {}).items():
        t = key.split("|")[0]
        peak = 0.1 * analysis["tasks"][t]["steps"]
        for r in h["rows"]:
            if (r["t0"] > peak) == after:
                agree += r["agree"]
                total += r["n"]
    return agree, total


def overhead_md(ov: dict) -> str:
    lines = ["| task | engine | hpx engine step (4 replicas) ms | 4 plain replica steps ms | ratio (total) | "
             "median block ratio | min..max | overhead |",
             "| --- | --- | ---: | ---: | ---: | ---: | --- | ---: |"]
    for r in ov["rows"]:
        lines.append(f"| {r['task']} | as is | {r['hpx_ms']:.3f} | {r['plain_ms']:.3f} | "
                     f"{r['ratio']:.3f} | "
                     f"{r['median_ratio']:.3f} | {r['min_ratio']:.3f}..{r['max_ratio']:.3f} | "
                     f"{100 * (r['ratio'] - 1):+.1f}% |")
    out = "\n".join(lines)
    for t, prof in ov.get("profiles", {}).items():
        parts = ov.get("parts", {}).get(t, {})
        if parts:
            out += (f"\n\nWhere the time goes on {t} (each part timed directly, microseconds per call; one "
                    "call per step):\n\n| part | us |\n| --- | ---: |\n"
                    + "\n".join(f"| {k} | {v:.1f} |" for k, v in parts.items()))
        out += f"\n\ncProfile of 200 engine steps on {t}, hpx's functions:\n\n```\n{prof}\n```"
    return out


# ----------------------------------------------------------------------------- plots


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_all(cfg: SuiteConfig, results: dict, analysis: dict, img: Path, prefix: str = "bench") -> list[Path]:
    plt = _plt()
    img.mkdir(parents=True, exist_ok=True)
    paths = []
    colors = {"low": "C0", "oracle": "C2", "high": "C3"}
    for t, info in analysis["tasks"].items():
        o = info["oracle"]
        ov = cfg.ov(t)
        # 1. quality against the grid (and accuracy beside it where the target is accuracy)
        acc_panel = info["metric"] == "acc"
        fig, axs = plt.subplots(1, 2 if acc_panel else 1, figsize=(11 if acc_panel else 6.4, 4),
                                squeeze=False)
        ax = axs[0, 0]
        g = info["grid"]
        ys = [r["loss"] if math.isfinite(r["loss"]) else math.nan for r in g]
        ax.plot([r["lr"] for r in g], ys, "k-o", ms=4, label="plain grid (mean of seeds)")
        ax.axhspan(o["loss"], 1.02 * o["loss"], color="0.85", label="within 2% of the oracle")
        for st in STARTS:
            for s in cfg.seeds:
                r = results.get(_key(RunSpec(t, "hpx", o["lr"] * STARTS[st], seed=s, variant=cfg.main_variant,
                                             overrides=ov)))
                if not r:
                    continue
                y = r["final"]["loss"]
                if not math.isfinite(y):
                    continue
                ax.annotate("", xy=(end_lr(r), y), xytext=(o["lr"] * STARTS[st], y),
                            arrowprops={"arrowstyle": "->", "color": colors[st], "alpha": 0.6})
                ax.plot(end_lr(r), y, "o", color=colors[st], ms=6,
                        label=f"hpx from {START_LABEL[st]} (start -> end lr)" if s == cfg.seeds[0] else None)
        finite = [y for y in ys if math.isfinite(y)]
        if finite:
            lo, hi = min(finite), sorted(finite)[min(len(finite) - 1, int(0.75 * len(finite)))]
            top = max(hi, 1.3 * lo)
            ax.set_ylim(0.9 * lo, top)
            # hpx runs that ended above the plotted range: a triangle at the top edge
            for st in STARTS:
                for s in cfg.seeds:
                    r = results.get(_key(RunSpec(t, "hpx", o["lr"] * STARTS[st], seed=s,
                                                 variant=cfg.main_variant, overrides=ov)))
                    if r and not (r["final"]["loss"] <= top):
                        ax.plot(end_lr(r), 0.985 * top, "^", color=colors[st], ms=7)
        ax.set_xscale("log")
        ax.set_xlabel("max learning rate (plain) / lr base (hpx)")
        ax.set_ylabel("final validation loss")
        ax.set_title(f"{info['title']}: hpx against the grid", fontsize=9)
        ax.legend(fontsize=7)
        if acc_panel:
            ax2 = axs[0, 1]
            ax2.plot([r["lr"] for r in g], [r["acc"] for r in g], "k-o", ms=4,
                     label="plain grid (mean of seeds)")
            ax2.axhspan(o["acc_best"] - 0.5, o["acc_best"], color="0.85",
                        label="within 0.5 points of the best")
            bottom = min(r["acc"] for r in g if r["acc"] > 50) - 1
            for st in STARTS:
                for s in cfg.seeds:
                    r = results.get(_key(RunSpec(t, "hpx", o["lr"] * STARTS[st], seed=s,
                                                 variant=cfg.main_variant, overrides=ov)))
                    if r:
                        a = r["final"]["acc"]
                        ax2.plot(end_lr(r), max(a, bottom + 0.1), "o" if a > bottom else "v",
                                 color=colors[st], ms=6,
                                 label=f"hpx from {START_LABEL[st]}" if s == cfg.seeds[0] else None)
            ax2.set_ylim(bottom, 100)
            ax2.set_xscale("log")
            ax2.set_xlabel("max learning rate (plain) / lr base at the end (hpx)")
            ax2.set_ylabel("final validation accuracy % (v: below the axis)")
            ax2.legend(fontsize=7)
        fig.tight_layout()
        p = img / f"{prefix}_{t}_quality.png"
        fig.savefig(p, dpi=100)
        plt.close(fig)
        paths.append(p)

        # 2. knob trajectories of the main runs (seed 0), every knob
        r0 = {st: results.get(_key(RunSpec(t, "hpx", o["lr"] * STARTS[st], seed=cfg.seeds[0],
                                           variant=cfg.main_variant, overrides=ov))) for st in STARTS}
        any_r = next((r for r in r0.values() if r and r["history"]), None)
        if any_r:
            names = list(any_r["history"][0]["bases"])
            fig, axes = plt.subplots(len(names), 1, figsize=(6.4, 1.9 * len(names) + 0.6), sharex=True,
                                     squeeze=False)
            for ax, name in zip(axes[:, 0], names):
                for st, r in r0.items():
                    if not r or not r["history"]:
                        continue
                    steps = [0] + [h["step"] for h in r["history"]]
                    first = r["history"][0]["values"][name]
                    b0 = sum(first) / len(first)
                    ax.plot(steps, [b0] + [h["bases"][name] for h in r["history"]], color=colors[st],
                            label=f"from {START_LABEL[st]}")
                if name == "lr" or name.startswith("lr/"):
                    ax.axhline(o["lr"], color="k", ls="--", lw=1, label="oracle lr")
                    ax.set_yscale("log")
                ax.set_ylabel(name, fontsize=8)
            axes[0, 0].legend(fontsize=7)
            axes[-1, 0].set_xlabel("step")
            fig.suptitle(f"{info['title']}: knob bases (seed {cfg.seeds[0]})", fontsize=9)
            fig.tight_layout()
            p = img / f"{prefix}_{t}_trajectories.png"
            fig.savefig(p, dpi=100)
            plt.close(fig)
            paths.append(p)

        # 3. validation curves: plain at the oracle lr, hpx from each start, directions from low
        fig, ax = plt.subplots(figsize=(6.4, 4))
        pl = results.get(_key(RunSpec(t, "plain", o["lr"], seed=cfg.seeds[0], overrides=ov)))
        if pl:
            c = [pt for pt in pl["curve"] if math.isfinite(pt["loss"])]
            ax.plot([pt["step"] for pt in c], [pt["loss"] for pt in c], "k-", lw=2,
                    label="plain at the oracle lr")
        for st, r in r0.items():
            if r:
                c = [pt for pt in r["curve"] if math.isfinite(pt["loss"])]
                ax.plot([pt["step"] for pt in c], [pt["loss"] for pt in c], color=colors[st],
                        label=f"hpx from {START_LABEL[st]}")
            pp = results.get(_key(RunSpec(t, "plain", o["lr"] * STARTS[st], seed=cfg.seeds[0], overrides=ov)))
            if pp and st != "oracle":
                c = [pt for pt in pp["curve"] if math.isfinite(pt["loss"])]
                ax.plot([pt["step"] for pt in c], [pt["loss"] for pt in c], color=colors[st], ls=":",
                        label=f"plain at {START_LABEL[st]}")
        ax.set_yscale("log")
        ax.set_xlabel("step")
        ax.set_ylabel("validation loss")
        ax.set_title(f"{info['title']}: validation loss", fontsize=9)
        ax.legend(fontsize=7)
        fig.tight_layout()
        p = img / f"{prefix}_{t}_curves.png"
        fig.savefig(p, dpi=100)
        plt.close(fig)
        paths.append(p)

    # 4. stability: loss curves at the high lr, one panel per task
    tasks = list(analysis["tasks"])
    fig, axes = plt.subplots(1, len(tasks), figsize=(4.2 * len(tasks), 3.6), squeeze=False)
    for ax, t in zip(axes[0], tasks):
        info = analysis["tasks"][t]
        hi = info["stability"]["lr"]
        ov = cfg.ov(t)
        s0 = cfg.seeds_aux(t)[0]
        runs = [("plain", RunSpec(t, "plain", hi, seed=s0, overrides=ov), "k")]
        runs += [(v, RunSpec(t, "hpx", hi, seed=s0, variant=v, overrides=ov), f"C{i}")
                 for i, v in enumerate(STABILITY)]
        for name, spec, col in runs:
            r = results.get(_key(spec))
            if not r:
                continue
            c = [pt for pt in r["curve"] if math.isfinite(pt["loss"])]
            from benchmarks.suite import failed

            lab = name + (" (diverged/collapsed)" if failed(r) else "")
            ax.plot([pt["step"] for pt in c] or [0], [pt["loss"] for pt in c] or [math.nan], color=col,
                    label=lab)
        ax.axhline(info["oracle"]["loss"], color="k", ls="--", lw=1, label="oracle (grid best)")
        ax.set_yscale("log")
        ax.set_title(f"{t}: mean lr {hi:.3g}", fontsize=9)
        ax.set_xlabel("step")
        ax.legend(fontsize=6)
    axes[0, 0].set_ylabel("validation loss")
    fig.tight_layout()
    p = img / f"{prefix}_stability.png"
    fig.savefig(p, dpi=100)
    plt.close(fig)
    paths.append(p)

    # 5. lr trajectories of the directions, from each aux start (seed 0)
    variants = ["default", *cfg.directions]
    fig, axes = plt.subplots(1, len(tasks), figsize=(4.2 * len(tasks), 3.6), squeeze=False)
    for ax, t in zip(axes[0], tasks):
        o = analysis["tasks"][t]["oracle"]["lr"]
        s0 = cfg.seeds_aux(t)[0]
        for i, v in enumerate(variants):
            for j, st in enumerate(cfg.aux_starts):
                spec = RunSpec(t, "hpx", o * STARTS[st], seed=s0, variant=v, overrides=cfg.ov(t))
                r = results.get(_key(spec))
                if not r or not r["history"]:
                    continue
                from benchmarks.suite import lr_knobs

                k = lr_knobs(r)[min(1, len(lr_knobs(r)) - 1)]
                ax.plot([0] + [h["step"] for h in r["history"]],
                        [o * STARTS[st]] + [h["bases"][k] for h in r["history"]], color=f"C{i}",
                        lw=2 if v == "default" else 1, label=v if j == 0 else None)
        ax.axhline(o, color="k", ls="--", lw=1)
        ax.set_yscale("log")
        ax.set_title(f"{t}: lr base by variant", fontsize=9)
        ax.set_xlabel("step")
        ax.legend(fontsize=6)
    fig.tight_layout()
    p = img / f"{prefix}_directions.png"
    fig.savefig(p, dpi=100)
    plt.close(fig)
    paths.append(p)
    return paths


# ----------------------------------------------------------------------------- the document


def quality_section(cfg: SuiteConfig, results: dict, analysis: dict, command: str, img_rel: str,
                    findings: str = "", on: str | None = None, stored: str | None = None) -> str:
    """The section's text; ``on``: the machine the runs were made on (default: this one);
    ``stored``: where the raw results are kept (default ``runs/benchmarks/<mode>.json``)."""
    tasks = analysis["tasks"]
    stored = stored or f"runs/benchmarks/{cfg.mode}.json"
    settings = []
    for t, info in tasks.items():
        grid = ", ".join(f"{r['lr']:.3g}" for r in info["grid"])
        from benchmarks.tasks import get_task

        knobs = ", ".join(
            f"{k.name} ({'x' if k.kind == 'mul' else '+-'}"
            f"{f'[{1 - k.spread:g}, {1 + k.spread:g}]' if k.kind == 'mul' else f'{k.spread:g}'})"
            for k in get_task(t).knobs(1.0, 0.5, lambda _: 1.0))
        settings.append(f"- **{t}**: {info['title']}; {info['steps']} steps, global batch {info['batch']} "
                        f"(hpx: 4 replicas x {info['batch'] // 4}), T = {info['T']}; grid {grid}; "
                        f"hpx's knobs (spread): {knobs}.")
    col = analysis.get("collinearity", {})
    col_text = ", ".join(f"{c['min_abs_cos']:.4f} on {t} ({c['knobs']} knob{'s' if c['knobs'] > 1 else ''})"
                         for t, c in col.items()) or "-"
    col_steps = ", ".join(f"{c['step']}" for c in col.values()) or "-"
    aux_seeds = "; ".join(f"{t}: {', '.join(str(s) for s in cfg.seeds_aux(t))}" for t in tasks)
    ag_after, n_after = horizon_agreement(analysis, after=True)
    ag_warm, n_warm = horizon_agreement(analysis, after=False)
    horizon_summary = (f"Over all branch points after the schedule's peak the two horizons agree on the "
                       f"direction in {ag_after} of {n_after} cases (in the warm-up: {ag_warm} of {n_warm})."
                       if n_after or n_warm else "")
    n_ok = sum(meets(info["metric"], info["main"][st]) for info in tasks.values() for st in STARTS
               if info["main"][st]["n"])
    n_all = sum(1 for info in tasks.values() for st in STARTS if info["main"][st]["n"])
    out = f"""## Quality against a grid-search oracle, stability, ablations, the signal

Produced by `{command}` ({cfg.mode} mode) in {analysis['wall'] / 60:.1f} min with {analysis['jobs']} worker
process(es), on {on or machine()}. Raw results: `{stored}` (regenerate this section
from them with `python -m benchmarks --{cfg.mode} --report-only`).

**Setup.** Data ships with installed packages (scikit-learn's digits; CPython's `pydoc_data.topics`):
nothing is downloaded. Each task has a fixed train / probe / validation split; plain training
never sees the probe split, hpx scores replicas on it (`ProbeStream`), and the validation split is
used only to report and to pick the oracle. Every learning rate follows one shape: linear warm-up
over the first 10% of the steps, then cosine to 0; the "max lr" is the factor in front of it
(plain) or hpx's lr base (`LearningRate(schedule=...)`, the controller moves that factor). The
oracle is the grid point with the best validation loss averaged over seeds (on the CNN the target is
stated on accuracy, against the grid's best mean accuracy). hpx runs: 4 replicas in one process,
shared gradients, the same global batch split among them (so the forward-backward samples equal
one plain run's), lr spread 0.5 (multipliers 0.5..1.5), engine defaults otherwise (log-space
controller, `temperature="auto"`, `meta_lr` 0.5, momentum 0.9 with a bias-corrected velocity
(`debias_momentum=True`), no decay, `warmup=0`), and the `ProbeStream` signal on the probe split;
the ablations change one thing each.
"Signal fwd samples" counts the forward-only samples the signal spends (and, for the anneal
probe, its extra forward-backward samples at 3 forward-equivalents each).

{chr(10).join(settings)}

hpx met the target (loss within 2% of the oracle; CNN: accuracy within 0.5 points) in
**{n_ok} of {n_all}** task x start cells.

**The noise floor.** Plain training at the oracle's lr nudged by 0.01% and 0.02% (same seeds,
same batches) ends at final validation losses whose ratio to the oracle's has this spread; a
difference smaller than it is not a difference:

{noise_md(analysis)}

### Quality: one hpx run against the grid

{main_md(analysis, cfg)}

"ratio to oracle": the mean over seeds of the final validation loss over the oracle's mean
("per seed": each seed's; on the grid's row, the oracle's own seeds over their mean, a measure of
the seed-to-seed noise the 2% target sits in);
"ended lr": the lr base at the end (geometric mean over the char LM's three groups) over the
oracle's max lr. The grid's row counts the whole grid's compute. "Collapsed": a final validation
loss no better than predicting the uniform distribution (the digits models at too high an lr
end with dead units at ln 10 = 2.303, a finite loss that hpx's NaN/inf guard does not catch).

"""
    for t in tasks:
        out += "".join(f"![{t} {what}]({img_rel}/bench_{t}_{what}.png)\n"
                       for what in ("quality", "trajectories", "curves")) + "\n"
    for t, info in tasks.items():
        out += f"<details><summary>{t}: the grid</summary>\n\n{grid_md(info)}\n\n</details>\n\n"
    out += f"""### Stability: the paper's Table 1 on these tasks

Plain training at the smallest grid lr above the oracle where it diverges or ends 1.5x above the
oracle's loss, against hpx at the same mean lr (its base starts there; "no controller" keeps it there).

{stability_md(analysis)}

![stability]({img_rel}/bench_stability.png)

### Ablations

Each row changes one thing from the hpx row of the quality table (same seeds:
{aux_seeds}). "one permutation" is left out where a
task has one knob. Cells: ratio of the final validation loss to the oracle's (ended lr x oracle).

{variants_md(analysis, cfg, ['default', *cfg.ablations])}

### The signal, measured

At every sync where the controller acted, on every lr knob: does its direction `D` point toward
the oracle's lr (counted only where the interval's lr base is more than 1.5x from the oracle, so
the answer is not ambiguous), how clearly the replicas' scores separate along the lr (the median
absolute t statistic of the score-vs-log(lr) slope over the 4 replicas, 2 degrees of freedom: about
4.3 is the 5% level of one sync), and after the schedule's peak, the share of syncs pointing to a
lower lr. The last column is where the runs started at the oracle's lr ended. All hpx runs of each
variant (all starts) are pooled.

{signal_md(analysis, ['default', *cfg.ablations, *cfg.directions])}

### The short-horizon bias, measured directly

Plain training at a run's max lr is branched at a step: from there to the end the lr is
multiplied by 1.5 ("up") or 1/1.5 ("down") or kept ("same"), on the same batches (so branches
differ only in the lr). What a sync can see is the probe loss T steps later (short horizon);
what the oracle is chosen on is the validation loss at the end (long horizon). Means over the
seeds listed; "signs agree" counts seeds where both horizons prefer the same direction.
{horizon_summary}

{horizon_md(analysis)}

Why a sync sees the short horizon, in shared-gradient mode: every replica applies the same mean
gradient, each with its own multipliers, so after an interval replica `r` sits at
`theta_0 + rho_r U` (`U` the interval's common update) when the lr is the only knob, and
comparing replicas is a line search along `U`: "was this interval's step too long?", not "which
lr is best for the run". With more knobs the deviations span one such direction per knob.
Measured one step before a sync (hpx, no controller, at the oracle's lr, after {col_steps} steps),
the smallest absolute cosine between two replicas' deviations from their mean (1 = one line):
{col_text}.

### Directions tried against the biases

{variants_md(analysis, cfg, ['default', *cfg.directions])}

![directions]({img_rel}/bench_directions.png)
"""
    if findings:
        out += "\n### Findings\n\n" + findings.strip() + "\n"
    return out


def overhead_section(ov: dict, command: str, on: str | None = None) -> str:
    """The section's text; ``on``: the machine it was measured on (default: this one)."""
    block = ov["rows"][0]["block"] if ov["rows"] else "?"
    blocks = ov["rows"][0]["blocks"] if ov["rows"] else "?"
    return f"""## Overhead of the in-process engine

Produced by `{command}` on {on or machine()}. One `Engine.step` (4 replicas, shared gradients,
T = 100, `IntervalLoss`, the task's knobs with a schedule) against 4 plain model + optimizer steps
on the same chunks (zero_grad, forward, backward, step, lr written), in alternating blocks of
{block} steps ({blocks} blocks each, measured side by side in one process).
The engine is measured as it is (nothing patched). Its extra work per step: the
shared-gradient mean of the replicas' gradients (flat buckets that autograd writes into) with
the gradient-health check (their norms), the schedule's values written, the loss accumulated
on device; per sync: averaging, the controller and new permutations. Target: at most 5%.

{overhead_md(ov)}

The distributed backend's overhead (torch.distributed, gloo) is measured in the `bench_dist`
section of this page, when present.
"""


def write_section(doc: Path, marker: str, body: str) -> None:
    """Replace the text between ``<!-- marker -->`` and ``<!-- /marker -->`` (or append it)."""
    doc.parent.mkdir(parents=True, exist_ok=True)
    text = doc.read_text() if doc.exists() else "# Benchmarks\n\n"
    block = f"<!-- {marker} -->\n{body.strip()}\n<!-- /{marker} -->"
    pat = re.compile(rf"<!-- {re.escape(marker)} -->.*?<!-- /{re.escape(marker)} -->", re.S)
    if pat.search(text):
        text = pat.sub(lambda _: block, text)
    else:
        text = text.rstrip() + "\n\n" + block + "\n"
    doc.write_text(text)


def summary_lines(analysis: dict) -> list[str]:
    out = []
    for t, info in analysis["tasks"].items():
        o = info["oracle"]
        cells = []
        for st in STARTS:
            s = info["main"][st]
            if s["n"]:
                cells.append(f"{st}: ratio {s['ratio']:.3f} acc {s['acc_gap']:+.2f} "
                             f"end {s['end_lr'] / o['lr']:.3g}x")
        out.append(f"{t}: oracle {o['lr']:.4g} loss {o['loss']:.4f}; " + "; ".join(cells))
    return out


__all__ = ["oracle", "overhead_section", "plot_all", "quality_section", "summary_lines", "write_section"]
