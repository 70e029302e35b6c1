"""hpx.Forks checkpoints under faults (issue 40, the checkpoint files): a non-finite run is never
saved, pruning never costs the newest intact step, what a killed prune leaves is cleaned, and a
read-only directory loads. Real files in tmp_path, real Forks runs on a tiny model. Each test fails
on the code before the fix, but the one that guards what must still be saved (a blown-up challenger,
a lost run of yours)."""

from __future__ import annotations

import errno
import logging
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hpx
import hpx._files as files


def _data(n: int = 1024) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 8, generator=g)
    w = torch.randn(8, 1, generator=g)
    return x, (x @ w).squeeze(-1) + 0.1 * torch.randn(n, generator=g)


X, Y = _data()
BATCHES = [(X[16 * i:16 * i + 16], Y[16 * i:16 * i + 16]) for i in range(60)]
PROBE = [(X[960:992], Y[960:992]), (X[992:1024], Y[992:1024])]


def _loss(rep, b):
    return F.mse_loss(rep.model(b[0]).squeeze(-1), b[1])


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))


def _adamw_onecycle(total: int = 60) -> hpx.Forks:
    """AdamW + OneCycleLR, the issue's set-up: 5 forks cut to 3 at step 6 (decided at 9) and to 2
    at step 15 (decided at 18) of 60."""
    model = _net()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.01, total_steps=total + 1)
    return hpx.Forks(model, opt, total_steps=total, schedule=sched, probe=PROBE)


def _sgd(total: int = 40) -> hpx.Forks:
    model = _net()
    return hpx.Forks(model, torch.optim.SGD(model.parameters(), lr=0.05), total_steps=total, probe=PROBE,
                     multiples=(0.5, 1.0, 2.0), cuts=())


def _train(forks: hpx.Forks, until: int, nan_at: int | None = None) -> None:
    while forks.step_count < until:
        x, y = BATCHES[forks.step_count]
        if forks.step_count + 1 == nan_at:
            x = x.clone()
            x[3, 2] = math.nan
        forks.step(_loss, (x, y))


def _bits(forks: hpx.Forks) -> list[bytes]:
    """Every tensor of the search's state (every fork's and copy's weights, optimizer and scheduler
    state), as bytes: NaN compares equal to itself here, bit for bit."""
    out: list[bytes] = []

    def visit(v) -> None:
        if torch.is_tensor(v):
            out.append(v.detach().cpu().reshape(-1).view(torch.uint8).numpy().tobytes())
        elif isinstance(v, dict):
            for k in sorted(v, key=str):
                out.append(repr(k).encode())
                visit(v[k])
        elif isinstance(v, (list, tuple)):
            for x in v:
                visit(x)
        else:
            out.append(repr(v).encode())

    state = forks.state_dict()
    state.pop("history")  # records hold wall times: equal objects, compared apart
    visit(state)
    return out


def _disk(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() if p.is_file() else b"<dir>"
            for p in sorted(root.rglob("*"))} if root.exists() else {}


def _steps(root: Path) -> list[int]:
    return sorted(int(d.name[5:]) for d in root.iterdir() if d.name.startswith("step-"))


def _damage(root: Path, step: int) -> None:
    """Flip bytes in the middle of this step's payload (its size unchanged)."""
    path = root / f"step-{step:09d}" / "rank-00000.pt"
    data = bytearray(path.read_bytes())
    for i in range(len(data) // 2, len(data) // 2 + 8):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


def _finite(forks: hpx.Forks) -> bool:
    return all(torch.isfinite(p).all() for f in forks._forks for p in f.model.parameters())


def _dead_pid() -> str:
    return subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True).stdout.strip()


# --- item 1: a non-finite run is not saved --------------------------------------------------


def _blow_up(forks: hpx.Forks) -> None:
    """What a batch holding a NaN leaves (every fork trains on it): NaN in every fork's and annealed
    copy's weights. Written by hand, so that the save is tested whatever a step does on its own."""
    with torch.no_grad():
        for f in [*forks._forks, *forks._clones]:
            f.model[0].weight[0, 0] = math.nan


def test_a_non_finite_run_is_not_saved_naming_the_forks_and_step_and_nothing_changes(tmp_path, caplog):
    """Every fork and copy NaN at step 8 (the first cut's annealed copies in flight): the save returns
    None, writes nothing (the directory bit for bit as before), leaves the search's state and the
    global random stream as they were, and warns naming the step and the forks by their lr
    multiples; the finite step 4 is what a resume finds."""
    forks = _adamw_onecycle()
    _train(forks, 4)
    assert hpx.save_checkpoint(tmp_path, forks) is not None
    _train(forks, 8)
    assert forks._clones  # the first cut's annealed copies are in flight (steps 6 to 9)
    _blow_up(forks)
    disk, state, rng = _disk(tmp_path), _bits(forks), torch.random.get_rng_state()
    with caplog.at_level(logging.WARNING, logger="hpx"):
        assert hpx.save_checkpoint(tmp_path, forks) is None
    assert _disk(tmp_path) == disk and _steps(tmp_path) == [4]
    assert _bits(forks) == state and torch.equal(torch.random.get_rng_state(), rng)
    assert forks.step_count == 8
    msg = caplog.text
    assert "step 8 not saved" in msg and "your run (1x)" in msg
    assert all(f"the fork at {m:.3g}x" in msg for m in (0.1, 0.316, 3.16, 10.0))
    assert "the annealed copy of 3.16x" in msg and "lower learning rate" in msg
    assert hpx.load_checkpoint(tmp_path, _adamw_onecycle()) == 4


def test_non_finite_optimizer_state_alone_skips_the_save(tmp_path, caplog):
    """Finite weights, an inf in your run's AdamW second moment (the next step would make the weights
    NaN): not saved either."""
    forks = _adamw_onecycle()
    _train(forks, 3)
    opt_state = forks._forks[0].optimizer.state
    next(iter(opt_state.values()))["exp_avg_sq"][0] = math.inf
    assert all(torch.isfinite(p).all() for p in forks.model.parameters())
    with caplog.at_level(logging.WARNING, logger="hpx"):
        assert hpx.save_checkpoint(tmp_path, forks) is None
    assert "your run (1x)" in caplog.text and "the fork at" not in caplog.text
    assert not tmp_path.exists() or not any(tmp_path.iterdir())


def test_a_blown_up_challenger_is_saved_as_it_is(tmp_path):
    """A challenger that blew up while your run is finite is a state the search goes on from (the
    next cut drops it, or your run beats it at the end): saved, not skipped."""
    model = _net()
    forks = hpx.Forks(model, torch.optim.SGD(model.parameters(), lr=0.05), total_steps=20, probe=PROBE,
                      multiples=(1.0, 1e30), cuts=())
    _train(forks, 3)
    assert not _finite(forks) and all(torch.isfinite(p).all() for p in forks.model.parameters())
    assert hpx.save_checkpoint(tmp_path, forks) is not None
    resumed = hpx.Forks(_net(), lambda m: torch.optim.SGD(m.parameters(), lr=0.05), total_steps=20,
                        probe=PROBE, multiples=(1.0, 1e30), cuts=())
    assert hpx.load_checkpoint(tmp_path, resumed) == 3 and _bits(resumed) == _bits(forks)


def _lost() -> hpx.Forks:
    model = _net()
    return hpx.Forks(model, torch.optim.SGD(model.parameters(), lr=1e5), total_steps=20, probe=PROBE,
                     multiples=(1e-6, 1e-5, 1.0), cuts=((0.5, 2),), cool=0.0, confidence=1e9)


def test_your_run_lost_at_a_cut_is_saved_and_a_resume_ends_as_the_run_does(tmp_path):
    """Your run lost (its loss non-finite: no longer trained, kept for the end's comparison) beside a
    finite challenger: saved as it is, and a resume from it ends bit for bit as the uninterrupted
    run, the finite challenger winning."""
    torch.manual_seed(3)
    full = _lost()
    _train(full, 12)
    assert full._forks[0].lost  # dropped the step after its loss went non-finite; its weights as they were
    assert hpx.save_checkpoint(tmp_path, full) is not None
    _train(full, 20)
    resumed = _lost()
    assert hpx.load_checkpoint(tmp_path, resumed) == 12
    assert resumed._forks[0].lost
    _train(resumed, 20)
    assert resumed.decided and resumed.factor == full.factor != 1.0
    assert _bits(resumed) == _bits(full) and _finite(resumed)


# --- item 2: pruning counts only intact steps ----------------------------------------------


def test_damaged_steps_do_not_count_toward_keep_and_never_cost_the_intact_one(tmp_path, caplog):
    """Steps 5, 10, 15 saved; 10 and 15 damaged. The save of 20 with keep=2 keeps 20 and 5 (the damaged
    two are not counted, and stay while newer than the oldest kept): with 20 damaged too, step 5 is
    still there to load, as saved. Once two intact steps are newer, the damaged ones go."""
    forks = _sgd()
    snapshots = {}
    for s in (5, 10, 15):
        _train(forks, s)
        hpx.save_checkpoint(tmp_path, forks, keep=3)
        snapshots[s] = _bits(forks)
    _damage(tmp_path, 10)
    _damage(tmp_path, 15)
    _train(forks, 20)
    with caplog.at_level(logging.WARNING, logger="hpx"):
        hpx.save_checkpoint(tmp_path, forks, keep=2)
    assert _steps(tmp_path) == [5, 10, 15, 20]
    assert "step 15 is not counted toward keep=2" in caplog.text
    _damage(tmp_path, 20)
    fresh = _sgd()
    assert hpx.load_checkpoint(tmp_path, fresh) == 5
    assert _bits(fresh) == snapshots[5]
    for s in (25, 30):
        _train(forks, s)
        hpx.save_checkpoint(tmp_path, forks, keep=2)
    assert _steps(tmp_path) == [25, 30]


# --- item 3: what a killed prune leaves -----------------------------------------------------


def test_what_a_killed_prune_or_save_left_is_never_counted_and_is_cleaned_at_the_next_save(tmp_path):
    """By hand, the leftovers of prunes and saves killed part way: a payload whose digest a prune had
    deleted (step 4), a digest whose payload is gone (step 2), a temporary file of a dead process, an
    emptied step folder (step 1), one holding only a sharded replicas' directory (step 3), a payload
    never given its digest at a step beyond the run (99). None counts as a step; the next save deletes
    them all and keeps the two newest steps."""
    forks = _sgd()
    for s in (8, 12):
        _train(forks, s)
        hpx.save_checkpoint(tmp_path, forks, keep=2)
    payload = (tmp_path / "step-000000012" / "rank-00000.pt").read_bytes()
    leftovers = [tmp_path / f for f in ("step-000000004/rank-00000.pt", "step-000000002/rank-00000.pt.sha256",
                                        f"step-000000004/.rank-00000.pt.tmp-{_dead_pid()}",
                                        "step-000000003/sharded/.metadata", "step-000000099/rank-00000.pt")]
    for f in leftovers:
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_bytes(payload)
    (tmp_path / "step-000000002" / "rank-00000.pt.sha256").write_text('{"sha256": "0", "world_size": 1}\n')
    (tmp_path / "step-000000001").mkdir()
    assert files._complete_steps(tmp_path, 0) == [12, 8]
    assert hpx.load_checkpoint(tmp_path, _sgd()) == 12
    _train(forks, 16)
    hpx.save_checkpoint(tmp_path, forks, keep=2)
    assert not any(f.exists() for f in leftovers)
    assert _steps(tmp_path) == [12, 16, 99]  # 99 emptied: a folder newer than the run's is not its to remove
    assert not any((tmp_path / "step-000000099").iterdir())
    assert hpx.load_checkpoint(tmp_path, _sgd()) == 16


# --- item 4: a read-only directory loads ------------------------------------------------------


def _with_stale_temp(root: Path) -> tuple[hpx.Forks, Path]:
    forks = _sgd()
    _train(forks, 4)
    hpx.save_checkpoint(root, forks)
    stale = root / "step-000000004" / f".rank-00000.pt.tmp-{_dead_pid()}"  # a save killed later
    stale.write_bytes(b"x" * 100)
    return forks, stale


def test_a_read_only_directory_with_a_stale_temp_file_loads(tmp_path, caplog):
    forks, stale = _with_stale_temp(tmp_path)
    folders = [tmp_path, stale.parent]
    for d in folders:
        os.chmod(d, 0o555)
    try:
        if os.access(stale.parent, os.W_OK):
            pytest.skip("chmod does not make the directory read-only here (running as root)")
        fresh = _sgd()
        with caplog.at_level(logging.DEBUG, logger="hpx"):
            assert hpx.load_checkpoint(tmp_path, fresh) == 4
        assert _bits(fresh) == _bits(forks) and stale.exists()
        assert f"could not delete {stale}" in caplog.text
    finally:
        for d in folders:
            os.chmod(d, 0o755)


def test_a_stale_temp_file_that_cannot_be_deleted_is_left_and_the_load_goes_on(tmp_path, caplog, monkeypatch):
    """The same as on a read-only mount (EROFS), testable as root: the cleanup's os.remove raises."""
    forks, stale = _with_stale_temp(tmp_path)

    def read_only(path, *a, **k):
        raise OSError(errno.EROFS, "Read-only file system", str(path))

    monkeypatch.setattr(files.os, "remove", read_only)
    fresh = _sgd()
    with caplog.at_level(logging.DEBUG, logger="hpx"):
        assert hpx.load_checkpoint(tmp_path, fresh) == 4
    assert _bits(fresh) == _bits(forks) and stale.exists()
    assert f"could not delete {stale}" in caplog.text and "Read-only file system" in caplog.text
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    monkeypatch.undo()
    assert hpx.load_checkpoint(tmp_path, _sgd()) == 4 and not stale.exists()  # deleted once it can be


# --- item 5: the run ----------------------------------------------------------------


def test_a_nan_batch_at_step_21_of_60_leaves_the_finite_step_20_to_resume_from(tmp_path, caplog):
    """The issue's run: AdamW + OneCycleLR, 60 steps, a checkpoint every 4 (keep=2), one batch with a
    NaN at step 21. The run ends in NonFiniteError; every save after step 21 wrote nothing, so the
    finite steps 16 and 20 are on disk, and a fresh Forks resumes from 20, finite, and with the bad
    batch replaced trains to the end and decides with finite weights."""
    forks = _adamw_onecycle()
    saved = {}
    with caplog.at_level(logging.WARNING, logger="hpx"), pytest.raises(hpx.NonFiniteError):
        while forks.step_count < 60:
            _train(forks, forks.step_count + 1, nan_at=21)
            if forks.step_count % 4 == 0:
                saved[forks.step_count] = hpx.save_checkpoint(tmp_path, forks, keep=2)
    assert forks.step_count >= 20  # at 60 today; a step that stops at the NaN itself is as good
    assert all(p is not None for s, p in saved.items() if s <= 20)
    assert all(p is None for s, p in saved.items() if s > 20)
    assert _steps(tmp_path) == [16, 20]
    if 24 in saved:
        assert "step 24 not saved" in caplog.text and "your run (1x)" in caplog.text
    resumed = _adamw_onecycle()
    assert hpx.load_checkpoint(tmp_path, resumed) == 20
    assert resumed.step_count == 20 and _finite(resumed)
    _train(resumed, 60)  # the bad batch left out this time
    assert resumed.decided and all(torch.isfinite(p).all() for p in resumed.model.parameters())


# --- item 3: a run's identity; another run's steps are refused ------------------------------


def _saved_run(root: Path, seed: int, until: int, every: int = 4, keep: int = 5) -> hpx.Forks:
    """A run of ``_sgd`` from the weights of ``seed``, saved every ``every`` steps into ``root``."""
    forks = _sgd()
    if seed:
        with torch.no_grad():
            g = torch.Generator().manual_seed(seed)
            for p in forks.model.parameters():  # another run: other initial weights, same settings
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
        forks = hpx.Forks(forks.model, torch.optim.SGD(forks.model.parameters(), lr=0.05), total_steps=40,
                          probe=PROBE, multiples=(0.5, 1.0, 2.0), cuts=())
    while forks.step_count < until:
        _train(forks, forks.step_count + every)
        hpx.save_checkpoint(root, forks, keep=keep)
    return forks


def _run_of(root: Path, step: int) -> str:
    return files._sidecar_info(root / f"step-{step:09d}" / "rank-00000.pt")["run"]


def test_a_step_folder_copied_in_from_another_run_is_refused_and_nothing_changes(tmp_path):
    """Run A saved steps 4 and 8; run B (same settings, other weights) step 12, copied into A's
    directory: it used to be resumed silently as A's newest step."""
    mine, theirs = tmp_path / "a", tmp_path / "b"
    a = _saved_run(mine, 0, 8)
    _saved_run(theirs, 7, 12)
    assert _run_of(mine, 4) == _run_of(mine, 8) != _run_of(theirs, 12)
    shutil.copytree(theirs / "step-000000012", mine / "step-000000012")
    fresh = _sgd()
    before = _bits(fresh)
    with pytest.raises(hpx.ConfigError, match=r"holds checkpoints of two runs.*step-000000012, the newest "
                       r"complete one.*step-000000004, step-000000008 of another.*Nothing was loaded"):
        hpx.load_checkpoint(mine, fresh)
    assert _bits(fresh) == before and fresh.step_count == 0
    shutil.rmtree(mine / "step-000000012")  # the fix the message names
    assert hpx.load_checkpoint(mine, fresh) == 8 and _bits(fresh) == _bits(a)


def test_a_new_run_saving_where_another_run_saved_is_refused_and_writes_nothing(tmp_path):
    """A run that did not resume from the directory's steps would mix its saves with them (a crash
    later resumes whichever is newest); refused before a write, naming the fix. Resuming first, the
    run saves under the saved run's identity."""
    _saved_run(tmp_path, 0, 8)
    disk = _disk(tmp_path)
    new = _sgd()
    _train(new, 2)
    with pytest.raises(hpx.ConfigError, match=r"holds checkpoints of another run \(step-000000004, "
                       r"step-000000008, rank 0's files\), which this run did not resume from.*"
                       r"hpx\.load_checkpoint.*a directory of its own.*Nothing was saved"):
        hpx.save_checkpoint(tmp_path, new)
    assert _disk(tmp_path) == disk
    assert hpx.save_checkpoint(tmp_path / "own", new) is not None  # a directory of its own
    resumed = _sgd()
    assert hpx.load_checkpoint(tmp_path, resumed) == 8
    _train(resumed, 12)
    assert hpx.save_checkpoint(tmp_path, resumed) is not None
    assert _run_of(tmp_path, 12) == _run_of(tmp_path, 8)
    with pytest.raises(hpx.ConfigError, match=r"beside this run's.*two runs are saving into one directory"):
        hpx.save_checkpoint(tmp_path / "own", resumed)  # the other way round: that directory is new's


def test_an_object_that_saved_one_run_refuses_to_load_another(tmp_path):
    a = _saved_run(tmp_path / "a", 0, 4)
    _saved_run(tmp_path / "b", 7, 8)
    before = _bits(a)
    with pytest.raises(hpx.ConfigError, match=r"step-000000008 is a checkpoint of another run \(run "
                       r"[0-9a-f]{16}\) than the one this object has saved or loaded \(run [0-9a-f]{16}\): "
                       r"build a new hpx\.Forks"):
        hpx.load_checkpoint(tmp_path / "b", a)
    assert _bits(a) == before and a.step_count == 4
    assert hpx.load_checkpoint(tmp_path / "a", a) == 4  # its own run's step loads


def test_another_runs_damaged_steps_do_not_block_a_fresh_run_or_its_resume(tmp_path):
    """Steps that cannot be loaded are no run's evidence: a run restarted fresh over them saves, and
    its own step is resumed beside them."""
    _saved_run(tmp_path, 0, 8)
    for step in (4, 8):
        _damage(tmp_path, step)
    new = _sgd()
    assert hpx.load_checkpoint(tmp_path, new) is None
    _train(new, 2)
    assert hpx.save_checkpoint(tmp_path, new) is not None
    assert hpx.load_checkpoint(tmp_path, _sgd()) == 2


def test_the_reliability_doc_names_these_tests_and_holds_their_table():
    from benchmarks import reliability

    named = [t.strip() for *_, tests in reliability.FORKS_CHECKPOINT_ROWS for t in tests.split(",")]
    assert len(named) == 13 and all(callable(globals().get(n)) for n in named)
    doc = (Path(__file__).parents[1] / "docs" / "reliability.md").read_text()
    assert "\n".join(reliability.FORKS_CHECKPOINT_SECTION) in doc
