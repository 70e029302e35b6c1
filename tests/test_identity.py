"""The same runs, bit for bit, with the code as it was at ``BEFORE`` and as it is now.

``tests/_identity_run.py`` trains a fixed set of scenarios (shared and independent mode with two
knobs, accumulation, clipping, a NaN on one replica, a resume from a checkpoint, an elastic
resume, and ``autolr``'s placed points) in one process and on 2 gloo processes. This test runs it
with ``hpx/`` taken from commit ``BEFORE`` and with the working tree's, and compares every
tensor. It guards changes that move code without meaning to change behaviour (the engine's split
into rooms, issue 22). A commit that changes behaviour on purpose moves ``BEFORE`` to itself and
says so.
"""

from __future__ import annotations

import io
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import torch

BEFORE = "ce20c7f"
ROOT = Path(__file__).resolve().parents[1]
SCRIPT = Path(__file__).with_name("_identity_run.py")


def _old_tree(tmp: Path) -> Path:
    git = shutil.which("git")
    if git is None or not (ROOT / ".git").exists():
        pytest.skip("needs the repository's git history (a clone, not an installed copy)")
    blob = subprocess.run([git, "archive", BEFORE, "hpx"], cwd=ROOT, capture_output=True, check=True).stdout
    with tarfile.open(fileobj=io.BytesIO(blob)) as tar:
        tar.extractall(tmp, filter="data")
    return tmp


def _runs(worlds: tuple[int, ...], *runs: tuple[Path, Path]) -> list[dict]:
    """Each ``(code, out)`` run started at once, side by side (each in its own processes), then waited for;
    each run trains every world of ``worlds`` in one launch (its ranks forked from it: one import of torch
    and hpx per run). One thread per process (the gloo ranks forked from the run have the one thread it
    set; two ranks of two threads each on two cores took twice as long): both runs alike, so still
    comparable."""
    procs = [subprocess.Popen([sys.executable, str(SCRIPT), str(out), *map(str, worlds)],
                              env={**os.environ, "PYTHONPATH": str(code), "OMP_NUM_THREADS": "1"},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=code)
             for code, out in runs]
    try:
        done = [proc.communicate(timeout=300) for proc in procs]
    finally:
        for proc in procs:
            proc.kill()
    outs = []
    for (code, out), proc, (stdout, stderr) in zip(runs, procs, done):
        assert proc.returncode == 0, f"the run with {code / 'hpx'} failed:\n{stderr[-3000:]}"
        assert Path(stdout.splitlines()[0]).resolve() == (code / "hpx" / "__init__.py").resolve()
        outs.append(torch.load(out))
    return outs


def _flat(x: object, at: str = "") -> dict[str, torch.Tensor]:
    if isinstance(x, dict):
        return {k: v for key, val in x.items() for k, v in _flat(val, f"{at}/{key}").items()}
    if isinstance(x, (list, tuple)):
        return {k: v for i, val in enumerate(x) for k, v in _flat(val, f"{at}[{i}]").items()}
    return {at: x}


def test_the_runs_match_the_code_before_bit_for_bit(tmp_path: Path) -> None:
    """In one process, and on 2 gloo processes: one launch of each code does both."""
    old, new = _runs((1, 2), (_old_tree(tmp_path / "old"), tmp_path / "old.pt"), (ROOT, tmp_path / "new.pt"))
    assert sorted(old) == sorted(new) == [1, 2]
    for world in (1, 2):
        a, b = _flat(old[world]), _flat(new[world])
        assert a.keys() == b.keys() and len(a) > 50, world
        differ = [k for k in a if not torch.equal(a[k], b[k])]
        assert not differ, (f"world {world}: {len(differ)} tensors differ from {BEFORE}'s run, "
                            f"the first: {differ[:3]}")
        # the scenarios did what they are there for: the search moved the knobs' bases
        first = old[world] if world == 1 else old[world][0]
        bases = first["shared/final"][-1]
        assert bases.shape == (2,) and bases[0] != 3e-3 and bases[1] != 0.1, world
        assert first["autolr"][-1][0] != 1.0, world  # autolr's lr factor
