"""Run a function on W real gloo processes on localhost and collect what each returns.

Each launch starts fresh processes, so write one function that performs many checks
and returns its observations, and launch it once (a module-scoped fixture is a good
home for the call). The processes are forked from a server process that imported torch
and hpx once (multiprocessing's "forkserver"): each rank is a fresh process that has
not run anything, without paying the seconds of a torch import per rank and launch.

``fn`` must be a module-level function (spawned children import it by name) with
the signature ``fn(rank, world_size, *args)``; its return value and ``args`` must
be picklable. Usage::

    def _scenario(rank, world_size, n):
        ...
        return {"sum": t}

    results = run_distributed(_scenario, 3, 10)   # one entry per rank, rank order
"""

from __future__ import annotations

import contextlib
import datetime
import multiprocessing
import os
import pickle
import socket
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["RemoteTraceback", "free_port", "run_distributed"]

# What the fork server imports once, before it forks any rank: the imports every rank pays.
# torch._dynamo: the first optimizer a process builds imports it (torch.optim.Optimizer.__init__ is
# wrapped by torch._compile's disable decorator), about 800 modules and 2.5 s of CPU per rank and
# launch left to the ranks. hpx's routes and checkpoint files are imported lazily by ``import hpx``.
_PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "hpx", "hpx.engine", "hpx.forks", "hpx.checkpoint",
            "pytest", "sklearn.datasets", "tests._dist"]

_POLL_SECONDS = 0.02
# After a first failure, how long to let the other ranks fail too before choosing
# which error to report; ranks that are instead blocked in a collective are killed.
_GRACE_SECONDS = 1.0


class RemoteTraceback(Exception):
    """Carries a child's formatted traceback, shown as the cause of the re-raised error."""

    def __str__(self) -> str:
        return "\n" + self.args[0]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_distributed(
    fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 120.0
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; return results by rank.

    The first child to fail (an exception, or dying without a result) is reported
    at once and the other children are killed, since they are likely blocked in
    a collective waiting for it. Exceptions are re-raised in the parent as the
    child's own exception when it unpickles, chained from a
    :class:`RemoteTraceback` holding the child's traceback text. After
    ``timeout`` seconds (spawning included) every child is killed and
    ``TimeoutError`` is raised naming the ranks that had not finished.
    """
    ctx = _context()
    port = free_port()
    # Each child takes the caller's environment as it is now (a forked child would have the
    # fork server's); one thread each keeps a 2-core machine responsive when ranks compute at once.
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with tempfile.TemporaryDirectory(prefix="hpx-dist-") as tmp:
        result_dir = Path(tmp)
        procs = [
            ctx.Process(
                target=_child,
                args=(rank, world_size, port, result_dir, timeout, fn, args, env),
                name=f"hpx-dist-rank{rank}",
            )
            for rank in range(world_size)
        ]
        try:
            # The fork server starts at the first launch, with the environment as it is then.
            with _environ(OMP_NUM_THREADS="1"):
                for p in procs:
                    p.start()
            return _wait(procs, result_dir, timeout, fn)
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
            for p in procs:
                p.join()


def _context() -> multiprocessing.context.BaseContext:
    """The forkserver context, its server importing ``_PRELOAD`` when it starts (the first launch)."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def _wait(
    procs: list[multiprocessing.process.BaseProcess],
    result_dir: Path,
    timeout: float,
    fn: Callable[..., Any],
) -> list[Any]:
    world_size = len(procs)
    deadline = time.monotonic() + timeout
    results: dict[int, Any] = {}
    while len(results) < world_size:
        for rank, p in enumerate(procs):
            if rank in results or p.is_alive():
                continue
            outcome = _read_result(result_dir, rank)
            if outcome is None or outcome[0] == "error":
                _raise_first_failure(procs, result_dir, fn)
            results[rank] = outcome[1]
        if len(results) == world_size:
            break
        if time.monotonic() > deadline:
            pending = [r for r in range(world_size) if r not in results]
            raise TimeoutError(
                f"{fn.__qualname__} on {world_size} ranks did not finish within {timeout:g} s; "
                f"ranks {pending} were still running and were killed (a rank blocked in a "
                "collective that another rank never entered is the usual cause)"
            )
        time.sleep(_POLL_SECONDS)
    return [results[r] for r in range(world_size)]


def _raise_first_failure(
    procs: list[multiprocessing.process.BaseProcess], result_dir: Path, fn: Callable[..., Any]
) -> None:
    """Raise the failure that happened first, which is the cause of the others.

    When one rank fails, its peers often fail next with a gloo "connection closed"
    error that says nothing useful; they may even be reported first. So wait a
    moment for the peers to exit and pick the error with the earliest timestamp.
    """
    grace_end = time.monotonic() + _GRACE_SECONDS
    while any(p.is_alive() for p in procs) and time.monotonic() < grace_end:
        time.sleep(_POLL_SECONDS)
    world_size = len(procs)
    failures = []
    for rank, p in enumerate(procs):
        if p.is_alive():
            continue
        outcome = _read_result(result_dir, rank)
        if outcome is None:
            failures.append((float("inf"), rank, None))
        elif outcome[0] == "error":
            failures.append((outcome[2], rank, outcome[1]))
    _, rank, payload = min(failures, key=lambda f: f[:2])
    if payload is None:
        raise RuntimeError(
            f"rank {rank} of {world_size} running {fn.__qualname__} exited with code "
            f"{procs[rank].exitcode} without reporting a result"
        )
    pickled_exc, tb_text = payload
    remote = RemoteTraceback(f"Traceback on rank {rank} of {world_size}:\n{tb_text}")
    exc: BaseException | None = None
    if pickled_exc is not None:
        with contextlib.suppress(Exception):
            exc = pickle.loads(pickled_exc)
    if exc is None:
        raise RuntimeError(f"rank {rank} of {world_size} failed") from remote
    exc.add_note(f"(raised on rank {rank} of {world_size}; child traceback above)")
    raise exc from remote


def _read_result(result_dir: Path, rank: int) -> tuple[Any, ...] | None:
    path = _result_path(result_dir, rank)
    return pickle.loads(path.read_bytes()) if path.exists() else None


def _child(
    rank: int,
    world_size: int,
    port: int,
    result_dir: Path,
    timeout: float,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    env: dict[str, str],
) -> None:
    """A rank's entry point: run ``fn`` inside a process group and leave a result file."""
    os.environ.clear()
    os.environ.update(env)
    torch.set_num_threads(1)
    failed_at: float | None = None
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout),
        )
        try:
            outcome: tuple[str, Any] = ("ok", fn(rank, world_size, *args))
        except BaseException:
            # Timestamp before destroy_process_group, which is what makes peers fail.
            failed_at = time.time()
            raise
        finally:
            dist.destroy_process_group()
        data = pickle.dumps(outcome)
    except BaseException as exc:  # everything must reach the parent
        try:
            pickled_exc: bytes | None = pickle.dumps(exc)
        except Exception:  # unpicklable: the traceback text still goes
            pickled_exc = None
        failure = (pickled_exc, traceback.format_exc())
        data = pickle.dumps(("error", failure, failed_at or time.time()))
    # Write then rename, so the parent never reads a half-written file.
    path = _result_path(result_dir, rank)
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _result_path(result_dir: Path, rank: int) -> Path:
    return result_dir / f"rank{rank}.pkl"


@contextlib.contextmanager
def _environ(**values: str) -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
