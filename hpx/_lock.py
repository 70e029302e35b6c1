"""One live process per rank of a checkpoint directory: a lock file per rank, so that two processes
never save into one directory (or one loads steps the other is still writing) silently.

Each rank of a run holds its own lock (the ranks of one run write their own files into one, often
shared, directory, and never refuse each other): a small JSON file naming the holder (its PID, host,
the start of that process, the run's identity, since when). It lies beside the directory,
``run/.ckpt.hpx-lock-rank-00000`` for rank 0 of ``run/ckpt``, so that the directory holds only the step
folders; inside it (``run/ckpt/.hpx-lock-rank-00000``) where the directory is a mount point (its parent
on another filesystem, which other hosts do not share) or its parent cannot be written. Both places
are looked at by every save and load. The first :func:`hpx.save_checkpoint` or
:func:`hpx.load_checkpoint` of a run object on a directory takes it (a save that writes nothing, or
a call refused, leaves none); the process keeps it, and a save or load there by another process
whose lock is live is refused (:class:`~hpx.ConfigError` naming the directory, the holder and the
fix) before anything is written or loaded, on every rank alike. Only saves and loads look at it: a
training step never does.

Choices, and why:

- **Another run object in the same process takes the lock over** (logged at debug level). The lock
  guards against another *process*: building a new ``Forks``/``Engine`` and loading the directory
  again in the same process (a resume, a second attempt after a refused load, a test) is common and
  cannot race, since one process runs one save or load at a time per rank. Two run objects of one
  process saving into one directory are still refused by the run identities (:mod:`hpx._identity`).
- **Released** when the object that holds it is garbage-collected, or at the interpreter's exit
  (``weakref.finalize``). A process killed (SIGKILL, SIGTERM, a crash) leaves its lock behind, judged
  as follows.
- **Stale on this host** when its PID no longer runs, or runs another program (the PID was reused:
  the process start time in ``/proc`` differs; a zombie counts as dead). It is taken over with an
  info log: a run resumed in a new process after a kill is never blocked by its dead predecessor.
  "This host" is the hostname, the boot and the PID namespace (a container sharing the hostname
  and the directory, or a host rebooted, is another host: its PIDs say nothing here).
- **On another host** (a shared filesystem) a PID cannot be checked. A live holder renews its lock's
  modification time every ``_BEAT`` seconds from a daemon thread (one ``utime`` per held lock, never on
  the training path); a lock not renewed for ``_STALE`` seconds is stale. One renewed more recently is
  watched until it is renewed again (live: refused, after at most about ``_BEAT`` seconds) or
  ``_STALE`` seconds have passed since its last renewal (taken over). So a job requeued on other
  nodes after a kill waits at most ``_STALE`` seconds, and is never refused by its dead predecessor.
  This assumes the hosts' clocks agree to well within ``_STALE`` seconds, and a holder whose
  interpreter is frozen for longer (a debugger, a suspended process) can lose its lock: its next
  save then finds the lock held by the other process and is refused, so the sharing is never silent.
- **A directory where the lock cannot be written** (read-only, for a load): the load goes on without a
  lock (logged at debug level); a live holder's lock there still refuses it.

Two processes that find the same stale lock at the same instant both read it back after writing:
the one that lost sees the winner's lock and is refused; if both wrote within that instant, the
loser is refused at its next save or load, which checks the lock again.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import threading
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hpx._files import _alive
from hpx._identity import run_of

__all__: list[str] = []

log = logging.getLogger("hpx")

_BEAT = 10.0  # seconds between a live holder's renewals of its lock (another host checks them)
_STALE = 30.0  # another host's lock not renewed for this long is stale
_POLL = 0.5  # seconds between looks at another host's lock being watched
_ATTEMPTS = 4  # looks at a lock that changes while this process tries to take it


# --- this process and other processes -------------------------------------------------------


def _proc_stat(pid: int) -> tuple[str, int] | None:
    """``(state, start time in clock ticks since boot)`` of a PID from ``/proc`` (None where there
    is no ``/proc``, the PID does not run, or it cannot be read)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
        fields = text[text.rindex(")") + 2:].split()
        return fields[0], int(fields[19])
    except (OSError, ValueError, IndexError):
        return None


def _machine() -> str:
    """This host as far as PIDs go: the hostname, the boot and the PID namespace."""
    parts = [socket.gethostname()]
    try:
        parts.append(Path("/proc/sys/kernel/random/boot_id").read_text().strip())
    except OSError:
        parts.append("")
    try:
        parts.append(os.readlink("/proc/self/ns/pid"))
    except OSError:
        parts.append("")
    return "|".join(parts)


_ME: dict[int, dict[str, Any]] = {}  # by PID (a forked child is another process)


def _me() -> dict[str, Any]:
    """What a lock records of this process."""
    pid = os.getpid()
    if pid not in _ME:
        stat = _proc_stat(pid)
        _ME.clear()
        _ME[pid] = {"pid": pid, "host": socket.gethostname(), "machine": _machine(),
                    "start": stat[1] if stat else None}
    return _ME[pid]


def _record(rank: int, run: str | None) -> dict[str, Any]:
    return {**_me(), "rank": rank, "run": run, "since": time.strftime("%Y-%m-%d %H:%M:%S %Z")}


def _ours(info: dict[str, Any] | None) -> bool:
    me = _me()
    return info is not None and all(info.get(k) == me[k] for k in ("pid", "machine", "start"))


def _runs(pid: Any, start: Any) -> bool:
    """Whether the process that wrote a lock on this host still runs (its PID, not reused)."""
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
        return False
    stat = _proc_stat(pid)
    if stat is None:  # no /proc here, or one that hides other users' processes: ask the kernel
        return _alive(pid)
    state, ticks = stat
    if state in ("Z", "X"):  # killed, not yet reaped by its parent
        return False
    return start is None or ticks == start


# --- the lock file --------------------------------------------------------------------------


_UNREADABLE = "unreadable"


def _look(path: Path) -> tuple[dict[str, Any] | None, float, bool]:
    """``(content, mtime, exists)``; content None when missing or not a lock's (damaged). Opened
    before its status is read, so that a network filesystem revalidates it."""
    try:
        with open(path, "rb") as f:
            mtime = os.fstat(f.fileno()).st_mtime
            raw = f.read(1 << 16)
    except FileNotFoundError:
        return None, 0.0, False
    except OSError as e:  # another user's, not readable here: never judged stale
        return {_UNREADABLE: f"{type(e).__name__}: {e.strerror or e}"}, 0.0, True
    try:
        info = json.loads(raw)
    except ValueError:
        return None, mtime, True
    return (info if isinstance(info, dict) else None), mtime, True


def _create(path: Path, info: dict[str, Any]) -> bool:
    """Write the lock where there is none, atomically with its content (a hard link of a written
    temporary file; ``O_EXCL`` where links are not supported). False when one appeared meanwhile."""
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    _write(tmp, info)
    try:
        try:
            os.link(tmp, path)
            return True
        except FileExistsError:
            return False
        except OSError:  # no hard links on this filesystem
            pass
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w") as f:
            os.fchmod(f.fileno(), 0o644)
            f.write(json.dumps(info) + "\n")
        return True
    finally:
        tmp.unlink(missing_ok=True)


def _write(path: Path, info: dict[str, Any]) -> None:
    """A lock's content, readable by every user (another user's process judges it)."""
    with open(path, "w") as f:
        os.fchmod(f.fileno(), 0o644)
        f.write(json.dumps(info) + "\n")


def _replace(path: Path, info: dict[str, Any]) -> None:
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    try:
        _write(tmp, info)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _holder(info: dict[str, Any], age: float | None = None) -> str:
    where = f"pid {info.get('pid')} on host {info.get('host')}"
    run = info.get("run")
    extra = [f"run {run}"] if run else []
    extra.append(f"since {info.get('since')}")
    if age is not None:
        extra.append(f"another host: its lock renewed {age:.0f} s ago, as a live holder does every "
                     f"{_BEAT:g} s; one not renewed for {_STALE:g} s is taken over")
    return f"{where} ({', '.join(extra)})"


_RETRY = "retry"


def _judge(path: Path, info: dict[str, Any], mtime: float) -> str | None:
    """Whether a lock not this process's is live: the holder described (live), None (stale), or
    ``_RETRY`` (it changed while watched)."""
    if info.get("machine") == _me()["machine"]:
        return _holder(info) if _runs(info.get("pid"), info.get("start")) else None
    age = time.time() - mtime
    if age > _STALE:
        return None
    deadline = time.monotonic() + min(_STALE, max(_STALE - age, 2 * _BEAT + _POLL))
    while time.monotonic() < deadline:
        time.sleep(min(_POLL, max(0.0, deadline - time.monotonic())))
        again, later, exists = _look(path)
        if again != info or not exists:
            return _RETRY
        if later != mtime:
            return _holder(info, max(0.0, time.time() - later))
    return None


@dataclass
class Claim:
    """What :func:`acquire` found: the lock this process holds for the call (``path``; None when
    it goes on without one), whether the call wrote it (undone when the call is refused), and the
    refusal (``problems``)."""

    path: Path | None = None
    wrote: bool = False
    problems: list[str] = field(default_factory=list)
    made_dir: Path | None = None

    def undo(self) -> None:
        """The call was refused (on some rank): leave the directory as it was found."""
        if self.wrote and self.path is not None and _ours(_look(self.path)[0]):
            self.path.unlink(missing_ok=True)
        if self.made_dir is not None:
            try:
                self.made_dir.rmdir()
            except OSError:
                pass

    def keep(self, engine: Any) -> None:
        """The call goes on: ``engine`` holds the lock from now on (released with it)."""
        if self.path is not None:
            _keep(self.path, engine)


def _places(root: Path, rank: int) -> list[Path]:
    """Where rank ``rank``'s lock of ``root`` may be, the first preferred: beside the directory (on the
    filesystem the directory is on), else inside it."""
    inside = root / f".hpx-lock-rank-{rank:05d}"
    try:
        real = root.resolve()
        if real.name and os.stat(real).st_dev == os.stat(real.parent).st_dev:
            return [real.parent / f".{real.name}.hpx-lock-rank-{rank:05d}", inside]
    except OSError:
        pass
    return [inside]


def _refusal(root: Path, rank: int, path: Path, holder: str, verb: str) -> str:
    return (f"{root} is in use by another live process: {holder} holds rank {rank}'s lock {path}. Two "
            "processes saving into one checkpoint directory overwrite each other's steps, and a load there "
            "reads steps that process is still writing and pruning. Wait for that process to end (its lock "
            "is released at its exit, and a killed process's is taken over), or give this run a directory "
            f"of its own. Nothing was {verb}")


def acquire(root: Path, rank: int, engine: Any, *, saving: bool) -> Claim:
    """Take rank ``rank``'s lock of ``root`` for ``engine``'s process, or say who holds it (nothing
    else is written; a save creates the directory, removed by :meth:`Claim.undo`)."""
    made = None
    if not root.is_dir():
        if not saving:
            return Claim()  # a first run: nothing to load, nothing taken
        try:
            made = root if root.parent.is_dir() else None
            root.mkdir(parents=True, exist_ok=True)
        except OSError:
            return Claim()  # the save raises its own error where it writes
    places = _places(root, rank)
    verb = "saved" if saving else "loaded"
    for _ in range(_ATTEMPTS):
        found: dict[Path, dict[str, Any] | None] = {}  # the locks there, each judged stale
        retry = False
        for path in places:
            info, mtime, exists = _look(path)
            if not exists:
                continue
            if _ours(info):
                return Claim(path, made_dir=made)
            if info is not None and _UNREADABLE in info:
                return Claim(problems=[
                    f"{root}: rank {rank}'s lock {path} cannot be read ({info[_UNREADABLE]}): another "
                    "user's process may be using this directory. Give this run a directory of its own, or "
                    f"delete that file if no process uses the directory. Nothing was {verb}"], made_dir=made)
            holder = None if info is None else _judge(path, info, mtime)
            if holder == _RETRY:
                retry = True
                break
            if holder is not None:
                return Claim(problems=[_refusal(root, rank, path, holder, verb)], made_dir=made)
            found[path] = info
        if retry:
            continue
        took, retry = _take(root, places, found, _record(rank, run_of(engine)))
        if retry:
            continue
        if took is None:
            return Claim(made_dir=made)
        if not _ours(_look(took)[0]):  # read back: another process taking the same stale lock won
            continue
        for path in found:  # a stale lock left where this one is not
            if path != took:
                with contextlib.suppress(OSError):
                    path.unlink()
        return Claim(took, wrote=True, made_dir=made)
    return Claim(problems=[f"{root}: rank {rank}'s lock kept changing while this process tried to take it: "
                           "another process is starting on this directory. Give each run a directory of its "
                           f"own. Nothing was {verb}"], made_dir=made)


def _take(root: Path, places: list[Path], stale: dict[Path, dict[str, Any] | None], mine: dict[str, Any],
          ) -> tuple[Path | None, bool]:
    """Write this process's lock at the first place that takes it (over a stale lock there):
    ``(where, False)``; ``(None, False)`` where none can be written (going on without a lock);
    ``(None, True)`` when a lock appeared or changed meanwhile (judge again)."""
    for path in places:
        try:
            if path not in stale:
                if not _create(path, mine):
                    return None, True
            else:
                if _look(path)[0] != stale[path]:
                    return None, True
                info = stale[path]
                log.info("%s: taking over the lock %s of %s: that process no longer runs", root, path,
                         _holder(info) if info is not None else "an unreadable lock file")
                _replace(path, mine)
            return path, False
        except OSError as e:
            log.debug("%s: cannot write the lock %s (%s)", root, path, e)
    log.debug("%s: no lock could be written (a read-only directory): going on without one", root)
    return None, False


# --- what this process holds ----------------------------------------------------------------


@dataclass
class _Held:
    owner: weakref.ref
    token: object
    pid: int
    run: str | None


_held: dict[str, _Held] = {}
_mutex = threading.Lock()
_beater: threading.Thread | None = None
_wake = threading.Event()  # a lock newly held: renew now, and wait _BEAT (as it is now) from there


def _keep(path: Path, engine: Any) -> None:
    key = str(path)
    run = run_of(engine)
    with _mutex:
        held = _held.get(key)
        new = held is None or held.pid != os.getpid() or held.owner() is not engine
        if new:
            if held is not None and held.owner() is not None:
                log.debug("%s: another run object of this process takes the lock over", path)
            token = object()
            try:
                ref = weakref.ref(engine)
                weakref.finalize(engine, _release, key, token)
            except TypeError:  # not weakly referable: held until the process ends
                ref = weakref.ref(_keep)
            held = _held[key] = _Held(ref, token, os.getpid(), run)
            _start_beat()
    if new or held.run != run:  # the holder's run named (given at its first save, or taken at a load)
        held.run = run
        info = _look(path)[0]
        if _ours(info) and info is not None and info.get("run") != run:
            try:
                _replace(path, {**info, "run": run})
            except OSError as e:
                log.debug("%s: cannot rewrite the lock (%s)", path, e)


def _release(key: str, token: object) -> None:
    """The holder was collected, or the interpreter exits: delete the lock if it is still its own."""
    with _mutex:
        held = _held.get(key)
        if held is None or held.token is not token or held.pid != os.getpid():
            return
        del _held[key]
    path = Path(key)
    try:
        if _ours(_look(path)[0]):
            path.unlink(missing_ok=True)
    except OSError:
        pass


def _start_beat() -> None:
    """Start the renewals (``_mutex`` held)."""
    global _beater
    if _beater is None or not _beater.is_alive():
        _beater = threading.Thread(target=_beat, name="hpx-checkpoint-lock", daemon=True)
        _beater.start()
    else:
        _wake.set()


def _beat() -> None:
    """Renew this process's locks every ``_BEAT`` seconds, while it holds any."""
    global _beater
    while True:
        _wake.wait(_BEAT)
        _wake.clear()
        with _mutex:
            mine = [k for k, h in _held.items() if h.pid == os.getpid()]
            if not mine:
                _beater = None
                return
        for key in mine:
            try:
                if _ours(_look(Path(key))[0]):
                    os.utime(key)
            except OSError:
                pass


def _after_fork() -> None:
    """A forked child holds none of its parent's locks, nor its mutex or thread."""
    global _mutex, _beater, _wake
    _mutex = threading.Lock()
    _beater = None
    _wake = threading.Event()
    _held.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork)
