"""Knob trajectories: save, load and plot an engine's sync history."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from hpx.sync_record import SyncRecord

__all__ = ["format_history", "load_history", "plot_history", "save_history"]


def _records_problem(history: object, who: str) -> None:
    """A history that is not a sequence of records: the engine or Forks itself (``.history``
    holds them), or a file's path (:func:`load_history` reads it)."""
    if hasattr(history, "history") and not isinstance(history, (list, tuple)):
        raise TypeError(f"{who} takes the records, not the {type(history).__name__}: pass its .history")
    if isinstance(history, (str, Path)):
        raise TypeError(f"{who} takes the records, not a path: pass hpx.load_history({str(history)!r})")


def save_history(history: Sequence[SyncRecord], path: str | Path) -> Path:
    """Write the records as JSON (NaN scores as ``null``)."""
    _records_problem(history, "save_history")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = [asdict(r) for r in history]
    for row in rows:
        row["scores"] = [None if math.isnan(s) else s for s in row["scores"]]
    path.write_text(json.dumps({"format": 1, "history": rows}, indent=1))
    return path


def load_history(path: str | Path) -> list[SyncRecord]:
    """Read records written by :func:`save_history`, or an engine's ``history_file``
    (one JSON record per line)."""
    text = Path(path).read_text()
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        data = None
    rows = data["history"] if isinstance(data, dict) and "history" in data else [
        json.loads(line) for line in text.splitlines() if line.strip()]
    out = []
    for row in rows:
        row["scores"] = [math.nan if s is None else s for s in row["scores"]]
        out.append(SyncRecord(**row))
    return out


def _record_line(rec: SyncRecord) -> str:
    """One record as a JSON line (NaN scores as ``null``)."""
    row = asdict(rec)
    row["scores"] = [None if math.isnan(s) else s for s in row["scores"]]
    return json.dumps(row)


def _truncate_file(path: str | Path, step: int) -> None:
    """Drop the records after ``step`` from a history file (atomically)."""
    path = Path(path)
    if not path.is_file():
        return
    keep = [line for line in path.read_text().splitlines()
            if line.strip() and json.loads(line)["step"] <= step]
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text("".join(line + "\n" for line in keep))
    os.replace(tmp, path)


def format_history(history: Sequence[SyncRecord], every: int = 1) -> str:
    """A plain-text table of the bases at each sync (every ``every``-th row and the last).

    Under :func:`~hpx.autolr` (a knob that is a factor on the learning rates) its first column
    is the learning rate the optimizer used (``lr``, mean over the replicas) and the knob's
    column is headed ``lr factor``."""
    if not history:
        return "(no syncs yet)"
    names = list(history[0].bases)
    label = _labeller(history)
    if _from_forks(history):
        return _forks_table(history, names, label)
    with_lr = any(r.lr for r in history)
    head = (f"{'step':>7}  " + (f"{'lr':>12}  " if with_lr else "")
            + "  ".join(f"{label(n):>12}" for n in names) + f"  {'best score':>11}")
    lines = [head]
    for i, r in enumerate(history):
        if i % every and i != len(history) - 1:
            continue
        finite = [s for s in r.scores if not math.isnan(s)]
        best = f"{min(finite):11.4f}" if finite else f"{'nan':>11}"
        lr = (f"{_mean(r.lr):>12.5g}  " if r.lr else f"{'-':>12}  ") if with_lr else ""
        what = " (training loss)" if r.searched is False and finite else ""  # the search read no score
        lines.append(f"{r.step:>7}  " + lr + "  ".join(f"{r.bases[n]:>12.5g}" for n in names) + f"  {best}"
                     + what)
    return "\n".join(lines)


def _from_forks(history: Sequence[SyncRecord]) -> bool:
    """Whether ``history`` is :class:`hpx.Forks`' decisions (its cuts and its end), not an
    engine's whose strategy names its phases alike (an engine's records give ``applied``)."""
    return all(r.phase in ("cut", "end") and r.applied is None and "lr" in r.values for r in history)


def _fork_label(setting: dict[str, float], yours: dict[str, float] | None = None) -> str:
    """A fork's setting as hpx shows it: ``"0.316x"`` (its lr multiple), or ``"1x, dropout 0.3"``
    for a knob away from your value (``yours``; every knob when it is not given)."""
    moved = [f"{k} {v:.3g}" for k, v in setting.items() if k != "lr" and (yours is None or yours.get(k) != v)]
    return ", ".join([f"{setting['lr']:.3g}x", *moved])


def _fork_labels(r: SyncRecord) -> list[str]:
    """The label of every fork a decision scored, in its record's order (your run's first, whose
    knob values the others are shown against)."""
    yours = {k: r.values[k][0] for k in r.values}
    return [_fork_label({k: r.values[k][i] for k in r.values}, yours) for i in range(len(r.scores))]


def _kept(r: SyncRecord) -> int:
    """The fork whose setting a decision leaves your run at (the record's bases): yours at a cut."""
    return r.kept() or 0


def _forks_table(history: Sequence[SyncRecord], names: list[str], label: Callable[[str], str]) -> str:
    """:func:`format_history` for :class:`hpx.Forks`: per decision, the learning rate and setting
    your run trains at after it, and every fork's probe loss (the challenger's gain at the end)."""
    head = (f"{'step':>7}  {'phase':>5}  {'lr':>12}  " + "  ".join(f"{label(n):>12}" for n in names)
            + "  probe loss per fork")
    lines = [head]
    for r in history:
        k = _kept(r)
        lr = f"{r.lr[k]:>12.5g}" if r.lr else f"{'-':>12}"
        scores = ", ".join(f"{name} {s:.4g}" for name, s in zip(_fork_labels(r), r.scores))
        gain = _test_shown(r.metrics or {})
        lines.append(f"{r.step:>7}  {r.phase:>5}  {lr}  " + "  ".join(f"{r.bases[n]:>12.5g}" for n in names)
                     + f"  {scores}{gain}")
    return "\n".join(lines)


def _test_shown(metrics: dict[str, Any]) -> str:
    """The end's test as a row shows it: the challenger's gain, and the bar it had to clear (records
    written before the bar was kept show the gain alone)."""
    if "gain" not in metrics:
        return ""
    bar = f"; bar {metrics['bar']:.3g}" if "bar" in metrics else ""
    return f" (gain {metrics['gain']:.3g} standard errors{bar})"


def _labeller(history: Sequence[SyncRecord]) -> Callable[[str], str]:
    """How the knobs of ``history`` are shown (``"lr factor"`` for a factor on the learning
    rates, as the records that know it say)."""
    known = next((r for r in history if r.lr_factor is not None), None)
    return known.label if known is not None else str


def _mean(values: Sequence[float]) -> float:
    return math.fsum(values) / len(values)


def _log_scale(values: list[float]) -> bool:
    """A log axis when every value is positive and they span more than a factor of 3."""
    return bool(values) and min(values) > 0 and max(values) > 3 * min(values)


def _score_series(history: Sequence[SyncRecord]) -> dict[str, tuple[list[int], list[float]]]:
    """The score panel's lines: the best and mean score where the search read the signal's
    scores, and apart, the mean training loss recorded while it did not (another quantity:
    one line through both would show a jump that is not the run's). A line is broken (nan)
    where the other kind of record sits."""
    def finite(r: SyncRecord) -> list[float]:
        return [s for s in r.scores if not math.isnan(s)]

    xs = [r.step for r in history]
    scored = [r.searched is not False for r in history]
    best = [min(finite(r), default=math.nan) if ok else math.nan for r, ok in zip(history, scored)]
    mean = [math.fsum(f) / len(f) if ok and (f := finite(r)) else math.nan for r, ok in zip(history, scored)]
    out = {"best": (xs, best), "mean": (xs, mean)}
    if not all(scored):
        out["training loss"] = (xs, [math.fsum(f) / len(f) if not ok and (f := finite(r)) else math.nan
                                     for r, ok in zip(history, scored)])
    return out


def plot_history(history: Sequence[SyncRecord], path: str | Path, title: str | None = None) -> Path:
    """Plot each knob's base and the replicas' values per sync, and the scores, to a PNG.

    Under :func:`~hpx.autolr` the first panel is the learning rate the optimizer used and the
    ``"lr"`` knob's panel is labelled ``lr factor`` (a factor on that learning rate).

    Needs matplotlib (``pip install 'hpx-hdet[plot]'``).
    """
    _records_problem(history, "plot_history")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError("plot_history needs matplotlib: pip install 'hpx-hdet[plot]' (or pip install "
                          "matplotlib)") from exc
    if not history:
        raise ValueError("history is empty: nothing to plot (did the run reach a sync?)")
    names = list(history[0].bases)
    shown_as = _labeller(history)
    # under autolr, first a panel of the learning rate the optimizer used (the knob is a factor)
    panels: list[tuple[str, list[int], list[float], list[list[float]]]] = []
    forks = _from_forks(history)  # hpx.Forks: the line is your run, after each decision
    used = [r for r in history if r.lr]
    if used:
        line = [(r.lr or [])[_kept(r)] if forks else _mean(r.lr or []) for r in used]
        panels.append(("lr", [r.step for r in used], line, [r.lr or [] for r in used]))
    steps = [r.step for r in history]
    for name in names:
        panels.append((shown_as(name), steps, [r.bases[name] for r in history],
                       [r.values[name] for r in history]))
    fig, axes = plt.subplots(len(panels) + 1, 1, figsize=(7, 2.2 * (len(panels) + 1)), sharex=True)
    axes = list(axes) if panels else [axes]
    for i, (ax, (ylabel, xs, line, points)) in enumerate(zip(axes, panels)):
        # every replica's value (the count may change from record to record: hpx.Forks cuts forks)
        ax.plot([x for x, p in zip(xs, points) for _ in p], [v for p in points for v in p], ".", ms=2,
                color="0.6")
        name = "your run" if forks else "mean" if i == 0 and used else "base"
        ax.plot(xs, line, "-", color="C0", lw=2, label=name,  # a fork's value holds until the next decision
                drawstyle="steps-post" if forks else "default")
        ax.set_ylabel(ylabel)
        shown = line + [v for p in points for v in p]
        if _log_scale(shown):  # never when a replica sits at 0: it would vanish from a log axis
            ax.set_yscale("log")
    ax = axes[-1]
    names_span = None
    if forks:  # every fork's probe loss at each decision, named, and your run's
        names_span = _plot_fork_scores(ax, history)
        series = {}
    else:
        series = _score_series(history)
    style = {"best": ("-", "C0"), "mean": ("-", "C1"), "training loss": (":", "0.5")}
    for label, (xs, ys) in series.items():
        ax.plot(xs, ys, style[label][0], color=style[label][1],
                label=label if label != "training loss" else "training loss (search not acting)")
    shown = [v for _, ys in series.values() for v in ys if not math.isnan(v)]
    shown += [s for r in history for s in r.scores if forks and math.isfinite(s)]
    if _log_scale(shown):  # early scores dwarf the late ones
        ax.set_yscale("log")
    if names_span is not None:  # room for every fork's name
        lo, hi = ax.get_ylim()
        ax.set_ylim(min(lo, names_span[0]), max(hi, names_span[1]))
    ax.set_ylabel("probe loss" if forks else "score")
    ax.set_xlabel("step")
    ax.legend(fontsize=8)
    axes[0].legend(fontsize=8, loc="best")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path if path.suffix else path.with_suffix(".png")  # matplotlib adds it to a bare name


def _spread(ys: list[float], gap: float) -> list[float]:
    """Positions for labels at the ascending ``ys``, at least ``gap`` apart: each run of labels too
    close together is centred on its points' mean, then pushed apart upward where runs meet."""
    groups: list[list[float]] = []
    for y in ys:
        if groups and y - groups[-1][-1] < gap:
            groups[-1].append(y)
        else:
            groups.append([y])
    out: list[float] = []
    for g in groups:
        mid = sum(g) / len(g)
        out += [mid + (k - (len(g) - 1) / 2) * gap for k in range(len(g))]
    for i in range(1, len(out)):
        out[i] = max(out[i], out[i - 1] + gap)
    return [y if abs(y - y0) > 1e-12 else y0 for y, y0 in zip(out, ys)]


def _plot_fork_scores(ax: object, history: Sequence[SyncRecord]) -> tuple[float, float] | None:
    """The score panel of a :class:`hpx.Forks` history: each fork's probe loss at each decision as
    a point named by its setting (names of close points stacked a twentieth of the panel apart, so
    they stay readable), and your run's as a line with a marker at each decision."""
    finite = [s for r in history for s in r.scores if math.isfinite(s)]
    log = _log_scale(finite)  # the panel's own choice of scale (below): space the names in it

    def f(v: float) -> float:
        return math.log10(v) if log else v

    lo, hi = (min(map(f, finite)), max(map(f, finite))) if finite else (0.0, 1.0)
    gap = (hi - lo) / 20 or 1e-3
    span = (max(r.step for r in history) - min(r.step for r in history)) or 1
    shown: list[float] = []
    for r in history:
        pts = sorted(((n, s) for n, s in zip(_fork_labels(r), r.scores) if math.isfinite(s)),
                     key=lambda p: p[1])
        ys = _spread([f(s) for _, s in pts], gap)
        shown += ys
        for (name, s), y in zip(pts, ys):
            ax.plot([r.step], [s], ".", color="0.5", ms=4)  # type: ignore[attr-defined]
            ax.annotate(name, (r.step, s), xytext=(r.step + 0.012 * span, 10 ** y if log else y),  # type: ignore[attr-defined]
                        textcoords="data", fontsize=6, va="center", color="0.35",
                        arrowprops={"arrowstyle": "-", "lw": 0.3, "color": "0.7"} if y != f(s) else None)
    ax.plot([r.step for r in history], [r.scores[0] for r in history], "-o", ms=3, color="C1",  # type: ignore[attr-defined]
            label="your run")
    if not shown:
        return None
    ends = (min(shown) - gap, max(shown) + gap)  # the names' extent, for the panel's limits
    return (10 ** ends[0], 10 ** ends[1]) if log else ends
