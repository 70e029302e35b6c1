"""One live process per rank of a checkpoint directory (fault audit: two processes on one directory,
neither refused, the directory keeping whichever renamed last). A second live process that saves or
loads there is refused naming the holder and the fix, before anything is written or loaded; a killed
process's lock is taken over (a resume is never blocked by its dead predecessor), one released at
exit or when its run object is collected; another host's lock is judged by its renewals; the ranks
of one torch.distributed run never refuse each other, and a refusal on one rank is one on every rank;
a directory where no lock can be written still loads. Real processes and files."""

from __future__ import annotations

import errno
import gc
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hpx
import hpx._lock as lock
from tests._dist import run_distributed

ROOT = Path(__file__).resolve().parents[1]


def _data(n: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 8, generator=g)
    return x, (x @ torch.randn(8, 1, generator=g)).squeeze(-1)


X, Y = _data()
BATCHES = [(X[16 * i:16 * i + 16], Y[16 * i:16 * i + 16]) for i in range(12)]
PROBE = [(X[224:256], Y[224:256])]


def _loss(rep, b):
    return F.mse_loss(rep.model(b[0]).squeeze(-1), b[1])


def _forks() -> hpx.Forks:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    return hpx.Forks(model, torch.optim.SGD(model.parameters(), lr=0.05), total_steps=12, probe=PROBE,
                     multiples=(0.5, 1.0, 2.0), cuts=())


def _train(forks: hpx.Forks, until: int) -> None:
    while forks.step_count < until:
        forks.step(_loss, BATCHES[forks.step_count])


def _bits(forks: hpx.Forks) -> list[bytes]:
    """Every fork's weights and optimizer state, and the step, as bytes."""
    return [forks.step_count.to_bytes(8, "little")] + [
        t.detach().reshape(-1).view(torch.uint8).numpy().tobytes()
        for f in forks._forks for t in [*f.model.state_dict().values(),
                                        *[v for s in f.optimizer.state.values() for v in s.values()
                                          if torch.is_tensor(v)]]]


def _disk(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() if p.is_file() else b"<dir>"
            for p in sorted(root.rglob("*"))}


def _locks(root: Path) -> list[Path]:
    """Every lock of ``root``, beside it and inside it."""
    return sorted([*root.parent.glob(f".{root.name}.hpx-lock-rank-*"), *root.glob(".hpx-lock-rank-*")])


def _held_by(root: Path) -> list[int]:
    return [json.loads(p.read_text())["pid"] for p in _locks(root)]


# --- a second process -----------------------------------------------------------------------


def _child_saves(root: str, then: str) -> None:
    """A run in another process: trains 4 steps, saves into ``root``, then waits (alive), kills
    itself, or exits."""
    forks = _forks()
    _train(forks, 4)
    hpx.save_checkpoint(root, forks)
    print("saved", flush=True)
    if then == "wait":
        sys.stdin.readline()
    elif then == "kill":
        os.kill(os.getpid(), signal.SIGKILL)


def _launch(root: Path, then: str) -> subprocess.Popen:
    """The other process started; :func:`_saved` waits for its save."""
    code = f"from tests.test_checkpoint_lock import _child_saves; _child_saves({str(root)!r}, {then!r})"
    return subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})


def _saved(proc: subprocess.Popen) -> subprocess.Popen:
    line = proc.stdout.readline()
    if line.strip() != "saved":
        proc.kill()
        raise AssertionError(f"the other process did not save: {proc.communicate()[1][-3000:]}")
    return proc


def _start(root: Path, then: str) -> subprocess.Popen:
    return _saved(_launch(root, then))


def test_a_second_live_process_is_refused_naming_the_holder_and_nothing_changes(tmp_path, caplog):
    """The issue's two processes: A saves step 4 and keeps running; B's load and B's save there are
    refused naming the directory, A's pid and host and the fix, before anything is loaded or
    written (B's run and the directory bit for bit as before). Once A is SIGKILLed (a zombie not yet
    reaped, then reaped), B's load takes the dead process's lock over and resumes from step 4."""
    root = tmp_path / "ckpt"
    holder = _start(root, "wait")
    try:
        assert _held_by(root) == [holder.pid]
        fresh, mine = _forks(), _forks()
        _train(mine, 2)
        before, fresh_before, disk = _bits(mine), _bits(fresh), _disk(root)
        for verb, call in (("loaded", lambda: hpx.load_checkpoint(root, fresh)),
                           ("saved", lambda: hpx.save_checkpoint(root, mine))):
            with pytest.raises(hpx.ConfigError) as err:
                call()
            text = str(err.value)
            assert str(root) in text and f"pid {holder.pid} on host {socket.gethostname()}" in text
            assert "another live process" in text and "a directory of its own" in text
            assert "Wait for that process to end" in text and f"Nothing was {verb}" in text
        assert _bits(mine) == before and _bits(fresh) == fresh_before and _disk(root) == disk
        assert _held_by(root) == [holder.pid]

        holder.kill()  # SIGKILL: its lock stays behind; not reaped yet, a zombie
        deadline = time.monotonic() + 10
        while (stat := lock._proc_stat(holder.pid)) is not None and stat[0] != "Z":
            assert time.monotonic() < deadline
            time.sleep(0.02)
        with caplog.at_level(logging.INFO, logger="hpx"):
            assert hpx.load_checkpoint(root, fresh) == 4
        assert f"pid {holder.pid}" in caplog.text and "no longer runs" in caplog.text
        assert _held_by(root) == [os.getpid()]
    finally:
        holder.kill()
        holder.communicate()
    _train(fresh, 6)
    assert hpx.save_checkpoint(root, fresh) is not None  # this process's run goes on


def test_a_killed_process_lock_is_taken_over_and_an_exited_one_released(tmp_path, caplog):
    """A run SIGKILLed after its save leaves its lock: a new process resumes (its load and save take
    the lock over, logged at info); a run that ends normally leaves none. A lock naming a live PID
    that runs another program (the PID reused: another start time) is stale too."""
    killed, ended = tmp_path / "killed", tmp_path / "ended"
    # both other processes started at once (each imports torch and hpx: seconds), into directories of
    # their own; the second is read only after the first's lock is taken over
    proc, exiting = _launch(killed, "kill"), _launch(ended, "exit")
    _saved(proc)
    proc.communicate()
    assert proc.returncode == -signal.SIGKILL and _held_by(killed) == [proc.pid]
    resumed = _forks()
    with caplog.at_level(logging.INFO, logger="hpx"):
        assert hpx.load_checkpoint(killed, resumed) == 4
    assert f"taking over the lock {_locks(killed)[0]} of pid {proc.pid}" in caplog.text
    _train(resumed, 6)
    assert hpx.save_checkpoint(killed, resumed) is not None and _held_by(killed) == [os.getpid()]

    proc = _saved(exiting)
    proc.communicate()
    assert proc.returncode == 0 and (ended / "step-000000004").is_dir() and _locks(ended) == []

    reused = tmp_path / "reused"
    mine = _forks()
    _train(mine, 2)
    assert hpx.save_checkpoint(reused, mine) is not None
    path = _locks(reused)[0]
    other = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.readline()"],
                             stdin=subprocess.PIPE)
    try:
        info = json.loads(path.read_text())
        start = lock._proc_stat(other.pid)[1]
        path.write_text(json.dumps({**info, "pid": other.pid, "start": start}))
        with pytest.raises(hpx.ConfigError, match=f"pid {other.pid}"):  # that process runs: live
            hpx.load_checkpoint(reused, _forks())
        path.write_text(json.dumps({**info, "pid": other.pid, "start": start + 1}))  # another program now
        assert hpx.load_checkpoint(reused, _forks()) == 2 and _held_by(reused) == [os.getpid()]
    finally:
        other.kill()
        other.wait()


def test_another_run_object_of_this_process_takes_the_lock_over_and_it_goes_with_the_object(tmp_path):
    """A new Forks resuming in the same process (the old one still referenced) is not refused; the lock
    is released when the run object holding it is collected."""
    first = _forks()
    _train(first, 2)
    hpx.save_checkpoint(tmp_path, first)
    assert _held_by(tmp_path) == [os.getpid()] and _locks(tmp_path)[0].parent == tmp_path.parent
    second = _forks()
    assert hpx.load_checkpoint(tmp_path, second) == 2
    _train(second, 4)
    assert hpx.save_checkpoint(tmp_path, second) is not None
    del first
    gc.collect()
    assert _held_by(tmp_path) == [os.getpid()]  # the second holds it
    del second
    gc.collect()
    assert _locks(tmp_path) == []


def _foreign(root: Path, rank: int = 0) -> Path:
    """A lock of another host's process at ``root``'s preferred place."""
    path = lock._places(root, rank)[0]
    path.write_text(json.dumps({"pid": 4242, "host": "node-b", "machine": "node-b|boot|pid:[1]", "start": 7,
                                "rank": rank, "run": "0123456789abcdef", "since": "earlier"}))
    return path


def test_another_hosts_lock_is_live_while_renewed_and_taken_over_when_not(tmp_path, monkeypatch):
    """Another host's PIDs cannot be checked: a lock renewed every _BEAT seconds is live (refused,
    naming that host); one not renewed for _STALE seconds, or not renewed again while watched, is
    taken over."""
    monkeypatch.setattr(lock, "_BEAT", 0.2)
    monkeypatch.setattr(lock, "_STALE", 1.0)
    monkeypatch.setattr(lock, "_POLL", 0.05)
    saved = _forks()
    _train(saved, 2)
    hpx.save_checkpoint(tmp_path, saved)
    del saved
    gc.collect()

    path = _foreign(tmp_path)
    stop = threading.Event()

    def renew() -> None:
        while not stop.wait(0.2):
            os.utime(path)

    beat = threading.Thread(target=renew)
    beat.start()
    try:
        fresh = _forks()
        with pytest.raises(hpx.ConfigError) as err:
            hpx.load_checkpoint(tmp_path, fresh)
        assert "pid 4242 on host node-b" in str(err.value) and "another host" in str(err.value)
        assert fresh.step_count == 0 and json.loads(path.read_text())["pid"] == 4242
    finally:
        stop.set()
        beat.join()
    t0 = time.monotonic()  # not renewed any more: taken over once _STALE has passed
    assert hpx.load_checkpoint(tmp_path, fresh) == 2 and _held_by(tmp_path) == [os.getpid()]
    assert time.monotonic() - t0 < 3
    del fresh
    gc.collect()

    path = _foreign(tmp_path)  # renewed long ago: taken over at once
    os.utime(path, (time.time() - 60, time.time() - 60))
    t0 = time.monotonic()
    assert hpx.load_checkpoint(tmp_path, _forks()) == 2 and _held_by(tmp_path) == [os.getpid()]
    assert time.monotonic() - t0 < 0.5


def test_a_holder_renews_its_lock(tmp_path, monkeypatch):
    """What another host judges by: the holder's lock's modification time moves on while it runs."""
    monkeypatch.setattr(lock, "_BEAT", 0.1)
    forks = _forks()
    _train(forks, 2)
    hpx.save_checkpoint(tmp_path, forks)
    path = _locks(tmp_path)[0]
    os.utime(path, (time.time() - 60, time.time() - 60))
    deadline = time.monotonic() + 5
    while time.time() - path.stat().st_mtime > 30:
        assert time.monotonic() < deadline, "the lock was not renewed"
        time.sleep(0.05)


def test_a_directory_where_no_lock_can_be_written_loads(tmp_path, caplog, monkeypatch):
    """A read-only directory (and parent): the load goes on without a lock, logged at debug level; a
    live holder's lock there still refuses it."""
    saved = _forks()
    _train(saved, 2)
    hpx.save_checkpoint(tmp_path, saved)
    del saved
    gc.collect()

    def read_only(*a, **k):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(lock, "_create", read_only)
    monkeypatch.setattr(lock, "_replace", read_only)
    fresh = _forks()
    with caplog.at_level(logging.DEBUG, logger="hpx"):
        assert hpx.load_checkpoint(tmp_path, fresh) == 2
    assert "Read-only file system" in caplog.text and "going on without one" in caplog.text
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING] and _locks(tmp_path) == []

    path = lock._places(tmp_path, 0)[0]
    path.write_text(json.dumps({"pid": os.getppid(), "host": socket.gethostname(), **{
        k: v for k, v in lock._me().items() if k == "machine"}, "start": lock._proc_stat(os.getppid())[1]}))
    try:
        with pytest.raises(hpx.ConfigError, match=f"pid {os.getppid()}"):
            hpx.load_checkpoint(tmp_path, _forks())
    finally:
        path.unlink()


# --- the ranks of one run -------------------------------------------------------------------


def _engine(backend: hpx.Collective) -> hpx.Engine:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    return hpx.Engine(model, lambda m: torch.optim.SGD(m.parameters(), lr=0.1),
                      [hpx.LearningRate(spread=0.3)], backend=backend, replicas=1, sync_every=4, seed=0)


def _ranks(rank: int, world: int, top: str) -> dict:
    import torch.distributed as dist

    backend = hpx.backends.TorchDistributed()
    root = Path(top) / "c"
    g = torch.Generator().manual_seed(rank)
    engine = _engine(backend)
    out: dict = {}
    for _ in range(8):
        engine.step(lambda rep, b: F.cross_entropy(rep.model(b[0]), b[1]),
                    (torch.randn(8, 8, generator=g), torch.randint(0, 3, (8,), generator=g)))
        if engine.step_count % 4 == 0:
            hpx.save_checkpoint(root, engine)  # both ranks, one directory: neither refused
    dist.barrier()
    out["holders"] = {p.name: json.loads(p.read_text())["pid"] for p in _locks(root)}
    out["pid"] = os.getpid()
    resumed = _engine(backend)
    out["resumed"] = hpx.load_checkpoint(root, resumed)  # this process's lock: a new object takes it
    dist.barrier()
    # rank 1's lock held by another live process of this host (the process that forked the ranks)
    if rank == 1:
        path = lock._places(root, 1)[0]
        path.write_text(json.dumps({**json.loads(path.read_text()), "pid": os.getppid(),
                                    "start": lock._proc_stat(os.getppid())[1]}))
    dist.barrier()
    other = _engine(backend)
    before = [p.detach().clone() for p in other.model.parameters()]
    out["errors"] = []
    for call in (lambda: hpx.load_checkpoint(root, other), lambda: hpx.save_checkpoint(root, other)):
        try:
            call()
            out["errors"].append(None)
        except hpx.ConfigError as e:
            out["errors"].append(str(e))
    out["unchanged"] = other.step_count == 0 and all(torch.equal(a, b) for a, b in
                                                     zip(before, other.model.parameters()))
    dist.barrier()
    out["steps"] = sorted(d.name for d in root.iterdir() if d.name.startswith("step-"))
    return out


def test_the_ranks_of_one_run_do_not_refuse_each_other_and_a_refusal_on_one_rank_is_on_every_rank(tmp_path):
    """Two gloo ranks saving into one directory: each holds its own rank's lock, neither is refused,
    and a resume in the same processes loads. Rank 1's lock then held by another live process: the
    load and the save raise on both ranks (no hang), naming rank 1 and the holder; nothing changed."""
    results = run_distributed(_ranks, 2, str(tmp_path), timeout=180)
    pids = [r["pid"] for r in results]
    holders = results[0]["holders"]
    assert sorted(holders.values()) == sorted(pids) and len(holders) == 2
    assert [r["resumed"] for r in results] == [8, 8]
    for r in results:
        assert all(e is not None and "rank 1:" in e and "another live process" in e and "on all 2 ranks" in e
                   for e in r["errors"]), r["errors"]
        assert "nothing was loaded on any rank" in r["errors"][0] and "nothing was saved" in r["errors"][1]
        assert r["unchanged"] and r["steps"] == ["step-000000004", "step-000000008"]
