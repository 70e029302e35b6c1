"""Faults injected into real runs (benchmarks/reliability.py): SIGKILLed ranks under
torchrun --max-restarts, during training and inside a save, and the in-process faults.
The torchrun launches take about 15 s each, so they are marked slow (CI runs them)."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest

from benchmarks import reliability

KILLS = [f for f in reliability.DIST_FAULTS if f[0] in ("kill:23:1", "kill-in-save:30:1")]
FORKS_KILL = [f for f in reliability.DIST_FAULTS if f[0] == "kill:23:1"]


@pytest.fixture(scope="module")
def launched(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
             ) -> Iterator[dict[str, Future]]:
    """The two tests' torchrun runs, started together: each test's runs follow one another as
    ``distributed_rows`` launches them, beside the other test's (a launch mostly waits on imports,
    a restart and a rendezvous, so two side by side take far less than one after the other). Only
    the selected tests' runs are started."""
    wanted = {item.name for item in request.session.items}
    with ThreadPoolExecutor(2) as pool:
        runs = {}
        if test_a_rank_killed_in_training_or_inside_a_save_resumes_bit_for_bit.__name__ in wanted:
            runs["plain"] = pool.submit(reliability.distributed_rows, tmp_path_factory.mktemp("plain"), KILLS)
        if test_a_rank_killed_in_a_forks_run_resumes_bit_for_bit.__name__ in wanted:
            runs["forks"] = pool.submit(reliability.distributed_rows, tmp_path_factory.mktemp("forks"),
                                        FORKS_KILL, forks=True)
        yield runs


@pytest.mark.slow
def test_a_rank_killed_in_training_or_inside_a_save_resumes_bit_for_bit(launched: dict[str, Future]) -> None:
    rows = launched["plain"].result()
    assert [r.survived for r in rows] == [1, 1], [r.detail for r in rows]
    assert all("resumed from step 20" in r.detail for r in rows)  # the newest step both ranks had


@pytest.mark.slow
def test_a_rank_killed_in_a_forks_run_resumes_bit_for_bit(launched: dict[str, Future]) -> None:
    """The same kill in an hpx.Forks run (5 forks cut to 2 by step 18 of 60, each data-parallel over
    the 2 ranks, saved with hpx.save_checkpoint): torchrun restarts both ranks, they resume from
    step 20 and end bit for bit as the run without a fault, the end's decision included."""
    rows = launched["forks"].result()
    assert [r.survived for r in rows] == [1], [r.detail for r in rows]
    assert "resumed from step 20" in rows[0].detail


def test_in_process_faults_are_survived_or_named(tmp_path: Path) -> None:
    rows = reliability.in_process_rows(tmp_path)
    assert len(rows) == 5
    assert all(r.survived == r.runs for r in rows), [(r.fault, r.detail) for r in rows]
