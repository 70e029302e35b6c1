"""python -m benchmarks.gpu in its CPU tiny form: the methods run in interleaved rounds, every
(model, method) row comes out with min / median / max times a step and ratios of medians to plain
training, a CPU run is never written into the GPU section of the docs, and the command fails loudly
(asking for CUDA where there is none, a non-finite loss). The GPU numbers themselves come from
running the command on a GPU; this checks the plumbing."""

from __future__ import annotations

import contextlib
import io
import math

import pytest
import torch

from benchmarks import gpu

MODELS = ("lm", "cnn", "mlp")
METHODS = {m: gpu.METHODS_OF.get(m, gpu.METHODS) for m in MODELS}  # the mlp's adds Forks' batched path
ROUNDS = 2  # the tiny form's run here (the default is 3): enough to interleave, half the time


def _rows(text: str) -> dict[tuple[str, str], list[str]]:
    rows = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == len(gpu.COLUMNS) and cells[0] in MODELS:
            assert (cells[0], cells[1]) not in rows, f"a second row for {cells[:2]}"
            rows[(cells[0], cells[1])] = cells
    return rows


def _num(cell: str) -> float:
    return float(cell.replace(",", ""))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """One run of ``--device cpu --tiny`` (without --no-write: it must refuse on its own), with the
    runners wrapped to record the order they ran in and the docs pointed at a copy."""
    doc = tmp_path_factory.mktemp("docs") / "benchmarks.md"
    doc.write_text(gpu.DOC.read_text())
    calls: list[tuple[str, str]] = []
    writes: list[object] = []

    def recorded(method, runner):
        def run(setup, model):
            calls.append((setup.name, method))
            return runner(setup, model)
        return run

    out, err = io.StringIO(), io.StringIO()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gpu, "DOC", doc)
        mp.setattr(gpu.report, "write_section", lambda *a, **k: writes.append(a))
        for method, runner in list(gpu.RUNNERS.items()):
            mp.setitem(gpu.RUNNERS, method, recorded(method, runner))
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            assert gpu.main(["--device", "cpu", "--tiny", "--rounds", str(ROUNDS)]) == 0
    return {"out": out.getvalue(), "err": err.getvalue(), "calls": calls, "writes": writes,
            "doc": doc.read_text(), "original": gpu.DOC.read_text()}


def test_the_table_has_min_median_max_and_the_ratio_of_medians(tiny):
    text = tiny["out"]
    header = next(line for line in text.splitlines() if line.startswith("| model |"))
    for column in ("ms/step min", "ms/step median", "ms/step max", "x plain (medians)",
                   "peak allocated MB", "peak reserved MB"):
        assert f"| {column} |" in header, header
    rows = _rows(text)
    assert set(rows) == {(m, k) for m in MODELS for k in METHODS[m]}, text
    for model in MODELS:
        plain_median = _num(rows[(model, "plain")][3])
        for method in METHODS[model]:
            cells = rows[(model, method)]
            lo, median, hi, ratio = (_num(c) for c in cells[2:6])
            assert 0 < lo <= median <= hi and math.isfinite(hi), cells
            # the medians' ratio, up to the table's rounding (two decimals on each median and on the
            # ratio): a plain median of 2 ms alone moves the ratio of the shown medians by 0.01
            shown = 0.005 + (median / plain_median) * (0.005 / median + 0.005 / plain_median)
            assert ratio == pytest.approx(median / plain_median, abs=shown), cells
            assert cells[6:10] == ["n/a"] * 4, cells  # a CPU's memory is not measured
            rate, unit = cells[10].split()
            assert _num(rate) > 0 and unit == {"lm": "tokens/s", "cnn": "images/s", "mlp": "rows/s"}[model]
            assert math.isfinite(float(cells[12])), cells
        assert rows[(model, "plain")][5] == "1.00"
    assert "a CPU's memory is not measured" in text and gpu.PLACEHOLDER in text


def test_the_rounds_interleave_the_methods(tiny):
    calls = tiny["calls"]
    for model in MODELS:
        order = [method for name, method in calls if name == model]
        assert order == list(METHODS[model]) * ROUNDS, order  # plain, Forks, Engine, plain, ... not grouped
    # each model's rounds run together, in the order the table lists the models
    assert [name for name, _ in calls] == [m for m in MODELS for _ in range(len(METHODS[m]) * ROUNDS)]


def test_the_section_names_the_command_the_size_and_the_budget(tiny):
    text = tiny["out"]
    assert f"python -m benchmarks.gpu --device cpu --tiny --rounds {ROUNDS}" in text
    assert f"torch {torch.__version__}" in text and f"{ROUNDS} interleaved rounds" in text
    assert "within the 480 s budget" in text and "path (`batched=True`) for the mlp only" in text
    heading = next(line for line in text.splitlines() if line.startswith("## "))
    assert "100 M" not in heading and heading.endswith(" M parameters"), heading  # the size that ran
    assert "steps a run: lm 12, cnn 12, mlp 48" in text
    err = tiny["err"]
    for model in MODELS:
        for i in range(1, ROUNDS + 1):
            assert f"[budget] {model} round {i}/{ROUNDS}: plain " in err, err
        assert f"[budget] {model} done in " in err, err


def test_forks_take_more_optimizer_steps_than_plain_training(tiny):
    rows = _rows(tiny["out"])
    for model, plain in (("lm", 12), ("cnn", 12), ("mlp", 12 * gpu.MLP_STEPS)):
        assert int(rows[(model, "plain")][11]) == plain
        assert int(rows[(model, "hpx.Forks")][11]) > plain
        assert int(rows[(model, "hpx.Engine")][11]) == gpu.REPLICAS * plain
    assert tiny["out"].count("cuts (to 3, then 2 forks) decided at steps [2, 4]") == 2, tiny["out"]
    # the same steps on Forks' batched path, the steps of four forks or more batched, none fallen back
    assert rows[("mlp", gpu.BATCHED)][11] == rows[("mlp", "hpx.Forks")][11]
    assert "steps batched" in tiny["out"] and "fell back" not in tiny["out"], tiny["out"]


def test_a_cpu_run_is_not_written_into_the_gpu_section(tiny):
    assert tiny["writes"] == [] and tiny["doc"] == tiny["original"]
    assert "section <!-- gpu --> (--tiny)" in tiny["err"] and "not written to" in tiny["err"]


def test_publish_refuses_anything_but_a_full_size_cuda_run(tmp_path):
    doc = tmp_path / "benchmarks.md"
    before = "# Benchmarks\n\n<!-- gpu -->\nold\n<!-- /gpu -->\n"
    doc.write_text(before)
    cpu, cuda = torch.device("cpu"), torch.device("cuda")  # a device object needs no CUDA
    for device, tiny in ((cpu, False), (cpu, True), (cuda, True)):
        with pytest.raises(ValueError, match="only a full-size CUDA run is written"):
            gpu.publish("## new", device, tiny, doc)
        assert doc.read_text() == before
    assert gpu.publish("## new", cuda, False, doc) == doc  # the one that is written
    assert doc.read_text() == "# Benchmarks\n\n<!-- gpu -->\n## new\n<!-- /gpu -->\n"


def test_the_table_reads_the_rounds_and_the_cuda_peaks():
    """Made-up runs with known times and CUDA memory: min / median / max, the ratio of medians and
    the largest peaks' ratio, each model's plain training the reference."""
    setups = [gpu.mlp_setup(True, 10, torch.device("cpu"))]
    mb = 2.0**20
    walls = {"plain": [1.0, 3.0, 2.0], "hpx.Forks": [9.0, 4.0, 5.0], "hpx.Engine": [3.0, 3.0, 3.0]}
    peaks = {"plain": (100 * mb, 200 * mb), "hpx.Forks": (300 * mb, 500 * mb),
             "hpx.Engine": (150 * mb, 200 * mb)}
    runs = [gpu.Run("mlp", m, i, walls[m][i], 10, 10, 1.0 + i, "",
                    (5 * mb, peaks[m][0] * (1 if i else 0.5), peaks[m][1]))
            for i in range(3) for m in gpu.METHODS]
    rows = _rows(gpu.table(runs, setups))
    assert rows[("mlp", "plain")][2:6] == ["100.00", "200.00", "300.00", "1.00"]
    assert rows[("mlp", "hpx.Forks")][2:10] == ["400.00", "500.00", "900.00", "2.50",
                                                "300.0", "3.00", "500.0", "2.50"]
    assert rows[("mlp", "hpx.Engine")][5:10] == ["1.50", "150.0", "1.50", "200.0", "1.00"]
    assert rows[("mlp", "plain")][10] == "320 rows/s" and rows[("mlp", "plain")][12] == "2.0000"
    text = gpu.section(runs, setups, torch.device("cpu"), 3, 500.0, "python -m benchmarks.gpu")
    assert "OVER the 480 s budget" in text and "allocated at a run's start" in text


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available here")
@pytest.mark.parametrize("argv", [["--no-write"], ["--device", "cuda", "--tiny"]])
def test_cuda_without_cuda_exits_non_zero_naming_the_cpu_form(argv):
    with pytest.raises(SystemExit) as exc:
        gpu.main(argv)
    message = exc.value.code
    assert isinstance(message, str)  # printed to stderr, exit status 1
    assert "CUDA is not available" in message and "--device cpu --tiny" in message


def test_a_non_finite_loss_stops_the_run_naming_it():
    setup = gpu.lm_setup(True, 10, torch.device("cpu"))
    loss = setup.loss
    setup.loss = lambda model, b: loss(model, b) * float("nan")
    failed = r"lm / plain failed: FloatingPointError: non-finite training loss at step 0"
    with pytest.raises(RuntimeError, match=failed):
        gpu.run_one(setup, "plain", torch.device("cpu"))
    with pytest.raises(FloatingPointError, match="step 2"):
        gpu.check_finite(torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, math.inf]]))


def test_the_docs_hold_the_section_to_replace():
    doc = gpu.DOC.read_text()
    assert doc.count(f"<!-- {gpu.MARKER} -->") == 1 and f"<!-- /{gpu.MARKER} -->" in doc
    section = doc.split(f"<!-- {gpu.MARKER} -->", 1)[1].split(f"<!-- /{gpu.MARKER} -->", 1)[0]
    assert "python -m benchmarks.gpu" in section
    if "| hpx.Forks |" not in section:  # not yet measured: the placeholder says so, with no numbers
        assert gpu.PLACEHOLDER.lower() in section.lower()
