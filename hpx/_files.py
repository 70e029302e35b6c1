"""The checkpoint files on disk: step folders, atomic writes with a digest beside each file, which
steps are complete, and pruning. :mod:`hpx.checkpoint` decides what goes into them."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
from pathlib import Path
from typing import Any

log = logging.getLogger("hpx")

_SHARDS = "sharded"  # a step folder's directory of sharded replicas' files
_STEP_DIR = re.compile(r"^step-(\d{9,})$")
_TEMP = re.compile(r"^\.(rank-(\d{5})\.pt(?:\.sha256)?)\.tmp-(\d+)$")  # a write in progress, by PID


def _sidecar_info(path: Path) -> dict[str, Any]:
    try:
        info = json.loads(_sidecar(path).read_text())
    except (OSError, ValueError):
        return {}
    return info if isinstance(info, dict) else {}


def _matches(path: Path) -> bool:
    """Whether the file matches the digest beside it (False when either cannot be read)."""
    try:
        return _digest(path) == _sidecar_info(path).get("sha256")
    except OSError:
        return False


def _intact(path: Path, step: int) -> bool:
    ok = _matches(path)
    if not ok:
        log.warning("checkpoint %s does not match its digest (damaged after it was written): skipping "
                    "step %d", path, step)
    return ok


def _complete_for_all(root: Path) -> list[int]:
    """Steps (newest first) whose rank files 0..k-1 are all complete, for some k >= 1."""
    if not root.is_dir():
        return []
    steps = []
    for d in root.iterdir():
        m = _STEP_DIR.match(d.name)
        if not m:
            continue
        ranks = sorted(int(p.name[5:10]) for p in d.glob("rank-*.pt") if _sidecar(p).is_file())
        world = _sidecar_info(d / "rank-00000.pt").get("world_size")
        if ranks and ranks == list(range(world if isinstance(world, int) else -1)):
            steps.append(int(m.group(1)))
    return sorted(steps, reverse=True)


def _other_world_problems(root: Path, world: int, elastic_hint: str) -> list[str]:
    """The newest step whole for a run of another process count than ``world`` (a run resumed on more
    processes: the extra ranks have no file, so no step is common to every rank)."""
    for step in _complete_for_all(root):
        saved = _sidecar_info(root / f"step-{step:09d}" / "rank-00000.pt").get("world_size")
        if saved != world:
            return [f"{root}: step {step} was saved by a run of {saved} processes, this one has {world}: "
                    f"resume with the saved run's process count{elastic_hint}"]
        return []
    return []


def _sidecar(path: Path) -> Path:
    return path.with_name(path.name + ".sha256")


def _digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def _fsync_dir(folder: Path) -> None:
    """Make the renames in ``folder`` durable (where the platform allows it)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _complete_steps(root: Path, rank: int) -> list[int]:
    """Steps (newest first) for which this rank's payload and digest both exist."""
    if not root.is_dir():
        return []
    steps = []
    for d in root.iterdir():
        m = _STEP_DIR.match(d.name)
        if m and _sidecar(d / f"rank-{rank:05d}.pt").is_file() and (d / f"rank-{rank:05d}.pt").is_file():
            steps.append(int(m.group(1)))
    return sorted(steps, reverse=True)


def _prune(root: Path, rank: int, keep: int, saved: int) -> None:
    """Delete this rank's files of the steps up to ``saved`` older than the newest ``keep`` intact
    ones (complete, and matching their digests: ``saved``, just written and hashed, is), then what
    a save or prune killed part way left of this rank's (:func:`_clean_leftovers`). A damaged step
    is not counted: it never costs an older intact one its place, and stays while it is newer than
    the oldest step kept (once ``keep`` intact steps are newer, it goes with the others). Steps
    after ``saved`` are an earlier run's that went further: not this run's to prune (counting them
    would delete the saves of a run that restarted fresh because those were damaged)."""
    name = f"rank-{rank:05d}.pt"
    kept: list[int] = []
    for step in [s for s in _complete_steps(root, rank) if s <= saved]:
        folder = root / f"step-{step:09d}"
        if len(kept) >= keep:
            for f in (_sidecar(folder / name), folder / name):
                f.unlink(missing_ok=True)  # the digest first: a half-pruned step no longer counts
            _remove_emptied(folder)
        elif step == saved or _matches(folder / name):
            kept.append(step)
        else:
            log.warning("checkpoint %s does not match its digest (damaged after it was written): step %d is "
                        "not counted toward keep=%d, and the older intact steps stay", folder / name, step,
                        keep)
    _clean_leftovers(root, rank, saved, min(kept, default=saved))


def _clean_leftovers(root: Path, rank: int, saved: int, oldest_kept: int) -> None:
    """Delete what a save or a prune of this rank killed part way left, none of which counts as
    complete: a payload without its digest (a prune deletes the digest first; a save writes it
    last), a digest without its payload, in any step folder but ``saved``'s; and a step folder
    older than ``oldest_kept`` left with nothing of any rank's (but a sharded replicas' directory
    whose processes' files are all gone). Emptied folders not older than that are left: another
    rank may be creating one (temporary files: :func:`_clean_stale`)."""
    name = f"rank-{rank:05d}.pt"
    for d in root.iterdir():
        m = _STEP_DIR.match(d.name)
        if not m or not d.is_dir() or int(m.group(1)) == saved:
            continue
        payload, digest = d / name, _sidecar(d / name)
        if payload.is_file() != digest.is_file():
            (payload if payload.is_file() else digest).unlink(missing_ok=True)
        if int(m.group(1)) < oldest_kept:
            _remove_emptied(d)


def _remove_emptied(folder: Path) -> None:
    """Remove a step folder that holds no rank's file any more: the sharded replicas' files first
    (the last process's prune), then the folder (it stays while anything else is in it)."""
    if (folder / _SHARDS).is_dir() and not any(e.name != _SHARDS for e in folder.iterdir()):
        shutil.rmtree(folder / _SHARDS, ignore_errors=True)
    try:
        folder.rmdir()
    except OSError:
        pass


def _clean_stale(root: Path, rank: int, loading: bool = False) -> None:
    """Delete this rank's temporary files left by a process that died while saving (its PID no
    longer runs): payload-sized files no save would ever rename or delete. A live process's (a
    save under way, or a PID on another host that happens to run here) is left alone. Best effort:
    a file that cannot be deleted (a read-only directory, ``loading``) is left, logged."""
    if not root.is_dir():
        return
    for d in root.iterdir():
        if not _STEP_DIR.match(d.name) or not d.is_dir():
            continue
        for f in d.iterdir():
            m = _TEMP.match(f.name)
            if m and int(m.group(2)) == rank and not _alive(int(m.group(3))):
                try:
                    os.remove(f)
                except FileNotFoundError:
                    pass
                except OSError as e:
                    log.log(logging.DEBUG if loading else logging.WARNING, "could not delete %s, a temporary "
                            "file a process killed while saving left (%s): left in place", f, e)


def _alive(pid: int) -> bool:
    """Whether a process with this PID runs on this host (this process counts as alive)."""
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OSError):
        return True  # it exists (another user's), or the platform cannot tell: keep the file
    return True
