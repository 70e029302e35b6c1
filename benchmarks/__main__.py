"""hpx benchmarks on real data: quality against a grid-search oracle, stability, ablations,
the signal, overhead.

    python -m benchmarks --quick              # the CI smoke test: every stage, tiny runs (< 1 min)
    python -m benchmarks --full               # the real thing (about 10-11 min on 2 quiet cores);
                                              # writes docs/benchmarks.md and docs/img/bench_*.png
    python -m benchmarks --full --report-only # rebuild the docs from benchmarks/stored/full.json
    python -m benchmarks --overhead-only      # only the overhead section

Raw results go to benchmarks/stored/full.json (committed, with the machine the runs were made on:
the docs' sections are written from it alone, so a clone rebuilds them, which
tests/test_stored_sections.py checks) and runs/benchmarks/quick.json (gitignored); a rerun resumes
from them (delete one, or pass --fresh, to start over).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

from benchmarks import _store, report
from benchmarks.overhead import run_overhead
from benchmarks.suite import SuiteConfig, analyse, default_jobs, quick_config, run_suite

ROOT = Path(__file__).resolve().parent.parent
FINDINGS = Path(__file__).resolve().parent / "findings.md"


def _json_default(o):
    if isinstance(o, float) and not math.isfinite(o):
        return str(o)
    raise TypeError(type(o).__name__)


def _clean(x):
    """JSON has no inf/nan: store them as strings, read them back as floats."""
    if isinstance(x, float) and not math.isfinite(x):
        return {"__float__": repr(x)}
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    return x


def _unclean(x):
    if isinstance(x, dict):
        if set(x) == {"__float__"}:
            return float(x["__float__"])
        return {k: _unclean(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_unclean(v) for v in x]
    return x


def load_results(path: Path) -> dict:
    if not path.exists():
        return {}
    return _unclean(json.loads(path.read_text()))


def save_results(path: Path, results: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(_clean(results)))


def results_path(mode: str) -> Path:
    """Where the raw results of ``mode`` are kept: the full benchmark's committed (the docs'
    sections are written from them), the smoke test's under ``runs/`` (gitignored)."""
    if mode == "full":
        return ROOT / "benchmarks" / "stored" / "full.json"
    return ROOT / "runs" / "benchmarks" / f"{mode}.json"


def sections(cfg: SuiteConfig, results: dict, command: str, img_rel: str, findings: str,
             stored: str) -> tuple[dict[str, str], dict, dict]:
    """The sections written from ``results`` (the whole store: runs, ``__meta__``, ``__overhead__``),
    by marker, and the analysis and runs the plots are drawn from. The machine lines are the ones
    the store records (this machine's for a store from before they were recorded)."""
    meta = results.get("__meta__", {})
    analysis = analyse(cfg, results)
    analysis["wall"] = meta.get("wall", math.nan)
    analysis["jobs"] = meta.get("jobs", cfg.jobs)
    runs_only = {k: v for k, v in results.items() if not k.startswith("__")}
    out = {"bench_quality": report.quality_section(cfg, runs_only, analysis, command, img_rel, findings,
                                                   meta.get("machine"), stored)}
    overhead = results.get("__overhead__")
    if overhead:
        cmd = meta.get("overhead_command") or (
            command if cfg.mode != "full" else "python -m benchmarks --full (or --overhead-only)")
        out["bench_overhead"] = report.overhead_section(overhead, cmd, meta.get("overhead_machine"))
    return out, analysis, runs_only


def _sigterm_as_interrupt():
    """SIGTERM unwinds like Ctrl-C, so the process pool's workers are stopped too.
    Returns the previous handler (to restore), or None."""
    import signal

    def handler(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    try:
        return signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main thread (e.g. called from a test runner thread)
        return None


def main(argv: list[str] | None = None) -> int:
    import signal

    previous = _sigterm_as_interrupt()
    try:
        return _main(argv)
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.splitlines()[0])
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="CI smoke test (default)")
    mode.add_argument("--full", action="store_true", help="the full benchmark; writes docs/")
    mode.add_argument("--overhead-only", action="store_true", help="only the overhead benchmark")
    ap.add_argument("--jobs", type=int, default=None, help="worker processes (full default: 2, quick: 1)")
    ap.add_argument("--tasks", default=None, help="comma-separated subset of mlp,charlm,cnn (with --full or "
                    "--overhead-only only beside --out and --results: the committed docs and store hold "
                    "every task)")
    ap.add_argument("--out", default=None, help="where to write the markdown and PNGs "
                    "(full default: docs/benchmarks.md and docs/img; quick default: runs/benchmarks/quick)")
    ap.add_argument("--results", default=None, help="raw results JSON (default benchmarks/stored/full.json, "
                    "runs/benchmarks/quick.json)")
    ap.add_argument("--report-only", action="store_true", help="no training: rebuild docs from the results")
    ap.add_argument("--no-overhead", action="store_true", help="skip the overhead benchmark")
    ap.add_argument("--fresh", action="store_true", help="ignore saved results")
    args = ap.parse_args(argv)

    t0 = time.perf_counter()
    full = args.full
    if args.overhead_only:
        return _overhead_only(args)
    cfg = SuiteConfig(jobs=args.jobs or default_jobs()) if full else quick_config(jobs=args.jobs or 1)
    if args.tasks:
        cfg.tasks = tuple(args.tasks.split(","))
    res_path = Path(args.results) if args.results else results_path(cfg.mode)
    if full:
        doc = ROOT / "docs" / "benchmarks.md" if args.out is None else Path(args.out) / "benchmarks.md"
    else:
        doc = (Path(args.out) if args.out else ROOT / "runs" / "benchmarks" / "quick") / "benchmarks.md"
    img = doc.parent / "img"
    if full:  # before anything runs
        narrower(cfg.tasks, args, doc, "bench_quality", "python -m benchmarks --full"
                 + (" --report-only" if args.report_only else ""))
    saved = {} if args.fresh else load_results(res_path)
    command = "python -m benchmarks --full" if full else "python -m benchmarks --quick"

    if args.report_only:  # from the stored results only: refused, naming the command, without them
        results = _store.load(res_path, command, doc, "about 10-11 min on two cores" if full else "",
                              read=load_results)
    else:
        results = {k: v for k, v in saved.items() if k not in ("__meta__", "__horizon_summary__")}

        def log(msg: str) -> None:
            print(msg, flush=True)

        before = set(results)
        results, analysis = run_suite(cfg, log=log, results=results)
        meta = saved.get("__meta__", {}) if not args.fresh else {}
        if set(results) - before - {"__horizon_summary__"} or not meta:  # something new ran
            # a resumed run adds its time to the time already spent; the machine is the last run's
            meta = {**meta, "wall": meta.get("wall", 0.0) + analysis["wall"], "jobs": cfg.jobs,
                    "machine": report.machine()}
        meta.setdefault("machine", report.machine())  # a store from before the machine was recorded
        results["__meta__"] = meta
        save_results(res_path, results)

    if not args.no_overhead and not args.report_only:
        print("overhead (in-process engine step vs 4 plain replica steps)", flush=True)
        if full:
            overhead = run_overhead()
        else:
            overhead = run_overhead(tasks=("mlp",), block=20, blocks=2)
        results["__overhead__"] = overhead
        results["__meta__"].update(overhead_machine=report.machine(), overhead_command=None)
        save_results(res_path, results)

    img_rel = "img" if doc.parent == img.parent else str(img)
    findings = FINDINGS.read_text() if (full and FINDINGS.exists()) else ""
    stored = _store.shown(res_path)
    texts, analysis, results_only = sections(cfg, results, command, img_rel, findings, stored)
    report.plot_all(cfg, results_only, analysis, img)
    for marker, text in texts.items():
        report.write_section(doc, marker, text)
    for line in report.summary_lines(analysis):
        print(line)
    print(f"wrote {doc} and {img}/bench_*.png; results in {res_path}; {time.perf_counter() - t0:.0f} s total")
    return 0


def narrower(tasks: tuple[str, ...], args: argparse.Namespace, doc: Path, marker: str, command: str) -> None:
    """Refuse, before anything runs, a run of fewer tasks than the full benchmark's that would write
    the committed docs or store (``--out`` and ``--results`` not both given): the section's figures
    (and the store it is rebuilt from) are over every task, and those of the others would be lost."""
    lacking = [t for t in SuiteConfig().tasks if t not in tasks]
    if lacking and (args.out is None or args.results is None):
        stored = _store.shown(results_path("full"))
        _store.refuse_narrower(marker, f"figures of {', '.join(lacking)} (and {stored} their runs)", command,
                               doc, "or give --out DIR and --results FILE to run these tasks alone")


def _overhead_only(args) -> int:
    res_path = Path(args.results) if args.results else results_path("full")
    doc = (ROOT / "docs" if args.out is None else Path(args.out)) / "benchmarks.md"
    if args.tasks:  # before anything runs
        narrower(tuple(args.tasks.split(",")), args, doc, "bench_overhead",
                 "python -m benchmarks --overhead-only")
    overhead = run_overhead(tasks=tuple(args.tasks.split(",")) if args.tasks else ("mlp", "cnn", "charlm"))
    command = "python -m benchmarks --overhead-only"
    saved = load_results(res_path)
    if saved:  # kept with the full results, the section is rebuilt from them like the others
        saved["__overhead__"] = overhead
        saved.setdefault("__meta__", {}).update(overhead_machine=report.machine(), overhead_command=command)
        save_results(res_path, saved)
    report.write_section(doc, "bench_overhead", report.overhead_section(overhead, command))
    print(f"wrote the overhead section of {doc}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
