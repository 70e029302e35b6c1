"""The benchmark pipeline end to end in quick mode: tiny runs of every stage.

This checks the plumbing (every task trains, every experiment runs, the tables and
plots come out with the expected rows), not the numbers: quick runs are far too
short for the quality targets. The real results come from ``python -m benchmarks --full``.
"""

from __future__ import annotations

import json
import math
import re

import pytest

pytest.importorskip("sklearn")
pytest.importorskip("matplotlib")
pytest.importorskip("pydoc_data.topics")  # CPython's own text; a few distributions strip it

from benchmarks.__main__ import load_results, main
from benchmarks.suite import STARTS, analyse, quick_config


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    res = out / "quick.json"
    assert main(["--quick", "--fresh", "--out", str(out), "--results", str(res)]) == 0
    return out, load_results(res)


def test_every_run_finished_with_a_number(quick):
    _, results = quick
    runs = {k: v for k, v in results.items() if not k.startswith("__")}
    cfg = quick_config()
    assert len(runs) >= len(cfg.tasks) * (cfg.grid_n + 3 + 4)
    for key, r in runs.items():
        f = r["final"]
        assert r["diverged"] or (math.isfinite(f["loss"]) and 0 <= f["acc"] <= 100), key
        assert r["train_samples"] > 0 and r["wall"] > 0, key
        if r["kind"] == "hpx" and not r["diverged"]:
            assert r["history"], f"{key}: no sync recorded"
            lr_knobs = [k for k in r["end_lr"] if k == "lr" or k.startswith("lr/")]
            assert lr_knobs and all(r["end_lr"][k] > 0 for k in lr_knobs), key


def test_analysis_has_every_table_row(quick):
    _, results = quick
    cfg = quick_config()
    a = analyse(cfg, results)
    assert set(a["tasks"]) == set(cfg.tasks)
    for t, info in a["tasks"].items():
        assert len(info["grid"]) == cfg.grid_n
        assert info["oracle"]["lr"] in [r["lr"] for r in info["grid"]]
        assert math.isfinite(info["oracle"]["loss"])
        for st in STARTS:
            s = info["main"][st]
            assert s["n"] == len(cfg.seeds), (t, st)
            assert s["train_samples"] > 0
        assert info["stability"]["plain"]["n"] == len(cfg.seeds)
        assert info["signal"]["default"]["warm"]["n"] + info["signal"]["default"]["after"]["n"] > 0
        assert a["horizon"], "no short- vs long-horizon branches"
        for v in cfg.ablations:
            if v == "one-permutation" and t == "mlp":
                continue
            assert info["aux"][v], (t, v)


def test_markdown_and_plots(quick):
    out, results = quick
    doc = (out / "benchmarks.md").read_text()
    assert doc.count("<!-- bench_quality -->") == 1 and "<!-- /bench_quality -->" in doc
    assert "<!-- bench_overhead -->" in doc
    table = doc.split("### Quality: one hpx run against the grid", 1)[1].split("###", 1)[0]
    for t in quick_config().tasks:
        rows = [ln for ln in table.splitlines() if ln.startswith(f"| {t} | hpx from")]
        assert len(rows) == 3, t
    assert "python -m benchmarks --quick" in doc
    pngs = sorted(p.name for p in (out / "img").glob("bench_*.png"))
    assert len(pngs) >= 3 * 3 + 2, pngs
    assert all((out / "img" / p).stat().st_size > 5000 for p in pngs)
    ratio = re.search(r"\| mlp \| as is \| [\d.]+ \| [\d.]+ \| ([\d.]+) \|", doc)
    assert ratio and math.isfinite(float(ratio.group(1)))
    assert json.dumps(results["__overhead__"])  # stored with the results


def test_rewriting_keeps_other_sections(tmp_path):
    from benchmarks.report import write_section

    doc = tmp_path / "b.md"
    doc.write_text("# Benchmarks\n\n<!-- bench_dist -->\nkeep me\n<!-- /bench_dist -->\n")
    write_section(doc, "bench_quality", "one")
    write_section(doc, "bench_quality", "two")
    text = doc.read_text()
    assert "keep me" in text and "two" in text and "one" not in text
    assert text.count("<!-- bench_quality -->") == 1


def test_reliability_in_process_scenarios_of_this_round_survive(tmp_path):
    """The cheap in-process rows of python -m benchmarks.reliability (the torchrun and longer
    scenarios run only with the benchmark itself)."""
    import torch

    from benchmarks import reliability

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        rows = reliability.mask_rows() + reliability.half_finished_rows()
    finally:
        torch.set_num_threads(threads)
    assert [r.runs for r in rows] == [2, 2, 1]
    assert all(r.survived == r.runs and r.criterion for r in rows), rows
    table = reliability._table(rows, 1.0, "python -m benchmarks.reliability")
    assert "Runs: 5, survived: 5, lost: 0." in table and "| survived when |" in table


@pytest.mark.parametrize("variant", ["warmup-only", "fast-stop-half"])
def test_a_variant_with_a_controller_of_its_own_and_controller_settings_trains(variant):
    """Its controller is built from the settings (meta_lr, momentum); the engine was handed them as
    well and refuses them beside a controller of one's own, so `python -m benchmarks --full` stopped
    at warmup-only."""
    from benchmarks.runs import RunSpec, run
    from benchmarks.variants import VARIANTS

    assert VARIANTS[variant]["engine"]["meta_lr"] == 1.0 and isinstance(VARIANTS[variant]["controller"], dict)
    out = run(RunSpec(task="mlp", kind="hpx", lr=0.3, seed=0, variant=variant, overrides=(("steps", 40),)))
    assert math.isfinite(out["final"]["loss"]) and out["history"]
