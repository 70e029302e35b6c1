"""Faults injected into real runs (benchmarks/reliability.py): SIGKILLed ranks under
torchrun --max-restarts, during training and inside a save, and the in-process faults.
The torchrun launches take about 15 s each, so they are marked slow (CI runs them)."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks import reliability


@pytest.mark.slow
def test_a_rank_killed_in_training_or_inside_a_save_resumes_bit_for_bit(tmp_path: Path) -> None:
    faults = [f for f in reliability.DIST_FAULTS if f[0] in ("kill:23:1", "kill-in-save:30:1")]
    rows = reliability.distributed_rows(tmp_path, faults)
    assert [r.survived for r in rows] == [1, 1], [r.detail for r in rows]
    assert all("resumed from step 20" in r.detail for r in rows)  # the newest step both ranks had


def test_in_process_faults_are_survived_or_named(tmp_path: Path) -> None:
    rows = reliability.in_process_rows(tmp_path)
    assert len(rows) == 5
    assert all(r.survived == r.runs for r in rows), [(r.fault, r.detail) for r in rows]
