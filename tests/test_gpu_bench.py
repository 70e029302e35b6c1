"""python -m benchmarks.gpu in its CPU tiny form: every (model, method) row comes out with usable
numbers, the forks cost more optimizer steps than plain training, and the command fails loudly
(asking for CUDA where there is none, a non-finite loss). The GPU numbers themselves come from
running the command on a GPU; this checks the plumbing."""

from __future__ import annotations

import contextlib
import io
import math

import pytest
import torch

from benchmarks import gpu


def _rows(text: str) -> dict[tuple[str, str], list[str]]:
    rows = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 9 and cells[0] in ("lm", "cnn"):
            assert (cells[0], cells[1]) not in rows, f"a second row for {cells[:2]}"
            rows[(cells[0], cells[1])] = cells
    return rows


@pytest.fixture(scope="module")
def tiny():
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert gpu.main(["--device", "cpu", "--tiny", "--no-write"]) == 0
    return out.getvalue()


def test_a_row_per_model_and_method(tiny):
    rows = _rows(tiny)
    assert set(rows) == {(m, k) for m in ("lm", "cnn") for k in gpu.METHODS}, tiny
    assert "python -m benchmarks.gpu --device cpu --tiny" in tiny
    assert gpu.PLACEHOLDER in tiny  # a CPU run says it was not a GPU's
    assert f"torch {torch.__version__}" in tiny
    heading = next(line for line in tiny.splitlines() if line.startswith("## "))
    assert "100 M" not in heading and heading.endswith(" M parameters"), heading  # the size that ran


def test_ratios_and_rates_are_positive_finite_numbers(tiny):
    for (model, method), cells in _rows(tiny).items():
        wall, ratio, mem_ratio = float(cells[2]), float(cells[3]), cells[5]
        assert wall > 0 and math.isfinite(ratio) and ratio > 0, cells
        if method == "plain":
            assert ratio == 1.0, cells
        if mem_ratio != "n/a":
            assert math.isfinite(float(mem_ratio)) and float(mem_ratio) > 0, cells
        rate, unit = cells[6].split()
        assert float(rate.replace(",", "")) > 0 and unit == ("tokens/s" if model == "lm" else "images/s")
        assert math.isfinite(float(cells[8])), cells


def test_forks_take_more_optimizer_steps_than_plain_training(tiny):
    rows = _rows(tiny)
    for model in ("lm", "cnn"):
        plain = int(rows[(model, "plain")][7])
        assert plain == 12
        assert int(rows[(model, "hpx.Forks")][7]) > plain
        assert int(rows[(model, "hpx.Engine")][7]) == gpu.REPLICAS * plain
    assert tiny.count("cuts (to 3, then 2 forks) decided at steps [2, 4]") == 2, tiny


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
        gpu.run_one(setup, "plain", torch.device("cpu"), 10)
    with pytest.raises(FloatingPointError, match="step 2"):
        gpu.check_finite(torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, math.inf]]))


def test_the_docs_hold_the_section_to_replace():
    doc = gpu.DOC.read_text()
    assert doc.count(f"<!-- {gpu.MARKER} -->") == 1 and f"<!-- /{gpu.MARKER} -->" in doc
    section = doc.split(f"<!-- {gpu.MARKER} -->", 1)[1].split(f"<!-- /{gpu.MARKER} -->", 1)[0]
    assert "python -m benchmarks.gpu" in section
    if "| hpx.Forks |" not in section:  # not yet measured: the placeholder says so, with no numbers
        assert gpu.PLACEHOLDER.lower() in section.lower()
