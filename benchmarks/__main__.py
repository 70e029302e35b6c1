"""hpx benchmarks on real data: quality against a grid-search oracle, stability, ablations,
the signal, overhead.

    python -m benchmarks --quick              # the CI smoke test: every stage, tiny runs (< 1 min)
    python -m benchmarks --full               # the real thing (about 10-11 min on 2 quiet cores);
                                              # writes docs/benchmarks.md and docs/img/bench_*.png
    python -m benchmarks --full --report-only # rebuild the docs from runs/benchmarks/full.json
    python -m benchmarks --overhead-only      # only the overhead section

Raw results go to runs/benchmarks/<mode>.json; a rerun resumes from it (delete it to start over).
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
    ap.add_argument("--tasks", default=None, help="comma-separated subset of mlp,charlm,cnn")
    ap.add_argument("--out", default=None, help="where to write the markdown and PNGs "
                    "(full default: docs/benchmarks.md and docs/img; quick default: runs/benchmarks/quick)")
    ap.add_argument("--results", default=None, help="raw results JSON (default runs/benchmarks/<mode>.json)")
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
    res_path = Path(args.results) if args.results else ROOT / "runs" / "benchmarks" / f"{cfg.mode}.json"
    if full:
        doc = ROOT / "docs" / "benchmarks.md" if args.out is None else Path(args.out) / "benchmarks.md"
    else:
        doc = (Path(args.out) if args.out else ROOT / "runs" / "benchmarks" / "quick") / "benchmarks.md"
    img = doc.parent / "img"
    saved = {} if args.fresh else load_results(res_path)
    command = "python -m benchmarks --full" if full else "python -m benchmarks --quick"

    if args.report_only:  # from the stored results only: refused, naming the command, without them
        results = _store.load(res_path, command, doc, "about 10-11 min on two cores" if full else "",
                              read=load_results)
        analysis = analyse(cfg, results)
        analysis["wall"] = saved.get("__meta__", {}).get("wall", math.nan)
        analysis["jobs"] = saved.get("__meta__", {}).get("jobs", cfg.jobs)
    else:
        results = {k: v for k, v in saved.items() if k not in ("__meta__", "__horizon_summary__")}

        def log(msg: str) -> None:
            print(msg, flush=True)

        before = set(results)
        results, analysis = run_suite(cfg, log=log, results=results)
        meta = saved.get("__meta__", {}) if not args.fresh else {}
        if set(results) - before - {"__horizon_summary__"} or not meta:  # something new ran
            # a resumed run adds its time to the time already spent
            meta = {"wall": meta.get("wall", 0.0) + analysis["wall"], "jobs": cfg.jobs}
        analysis["wall"], analysis["jobs"] = meta["wall"], meta["jobs"]
        results["__meta__"] = meta
        save_results(res_path, results)
    results_only = {k: v for k, v in results.items() if not k.startswith("__")}

    overhead = None
    if not args.no_overhead and not args.report_only:
        print("overhead (in-process engine step vs 4 plain replica steps)", flush=True)
        if full:
            overhead = run_overhead()
        else:
            overhead = run_overhead(tasks=("mlp",), block=20, blocks=2)
        results["__overhead__"] = overhead
        save_results(res_path, results)
    elif args.report_only:
        overhead = saved.get("__overhead__")

    img_rel = "img" if doc.parent == img.parent else str(img)
    findings = FINDINGS.read_text() if (full and FINDINGS.exists()) else ""
    report.plot_all(cfg, results_only, analysis, img)
    report.write_section(doc, "bench_quality",
                         report.quality_section(cfg, results_only, analysis, command, img_rel, findings))
    if overhead:
        cmd = command if not full else "python -m benchmarks --full (or --overhead-only)"
        report.write_section(doc, "bench_overhead", report.overhead_section(overhead, cmd))
    for line in report.summary_lines(analysis):
        print(line)
    print(f"wrote {doc} and {img}/bench_*.png; results in {res_path}; {time.perf_counter() - t0:.0f} s total")
    return 0


def _overhead_only(args) -> int:
    res_path = Path(args.results) if args.results else ROOT / "runs" / "benchmarks" / "full.json"
    doc = (ROOT / "docs" if args.out is None else Path(args.out)) / "benchmarks.md"
    overhead = run_overhead(tasks=tuple(args.tasks.split(",")) if args.tasks else ("mlp", "cnn", "charlm"))
    saved = load_results(res_path)
    if saved:
        saved["__overhead__"] = overhead
        save_results(res_path, saved)
    report.write_section(doc, "bench_overhead",
                         report.overhead_section(overhead, "python -m benchmarks --overhead-only"))
    print(f"wrote the overhead section of {doc}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
