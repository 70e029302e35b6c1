"""``Forks.step`` past the first step: each fork's optimizer step taken right after its own backward
(under torch.distributed, and its gradients' mean over the ranks), its gradients then freed, so one
fork's gradients are alive at a time instead of every fork's and annealed copy's (nine at the first
cut's window).

It is the same run, bit for bit, as :meth:`hpx.Forks.backward` then :meth:`hpx.Forks.optimizer_step`:
each fork's update reads only its own gradients, and the random streams are replayed as they were
(every fork's forward from the streams as they were before your run's, :func:`hpx.forks.fork.common_draws`;
the optimizer steps, in the forks' order, from the stream as your run's forward left it, as if every
step came after every backward; the streams then left as the last step left them).

Under torch.distributed (without ``shard=``) each fork's gradients are sent over the ranks as soon as
its backward ends (:func:`hpx.forks.ranks.fork_mean`: an asynchronous all-reduce per dtype, in buckets,
with how many ranks had each parameter's gradient), while the next fork's forward and backward run;
then that reduction is waited on, the fork stepped and its gradients freed, and the next fork's sent.
The sums are those :meth:`~hpx.Forks.optimizer_step` takes, fork after fork in the same buffers, so
the run is the same bit for bit there too; a parameter some ranks' losses reached and others' did
not, and a decision's marker met by the step's first all-reduce, are flagged as there. Two forks'
gradients are alive at a time: one in flight (packed into its buffer, which its gradients then view),
the next one's backward.

Where it is not used (``forks.step`` takes :meth:`~hpx.Forks.backward` then
:meth:`~hpx.Forks.optimizer_step`): the first step, whose checks of ``loss_fn`` (a batch it changes in
place, a loss computed with your model object) refuse it before anything changes and so need every
fork's backward first; with ``shard=`` (FSDP reduces each fork's gradients during its backward);
after a :meth:`~hpx.Forks.backward` of your own (accumulation). A ``GradScaler`` or
``max_grad_norm`` are given to ``optimizer_step`` only, so a loop using them takes that path too.

A failure part way, exact where it can be:

* The forks' steps wait until the first fork other than your run has passed its backward and its check
  that its loss reached its own parameters (a ``loss_fn`` that switched to your model object past the
  first step). A failure up to there (an out-of-memory batch, which fails where memory is highest:
  your run's and that fork's gradients are then both alive) leaves nothing stepped and no gradient
  behind, as before: a loop that catches it and skips the batch is plain training that skipped it
  (under torch.distributed your run's all-reduce was sent: every rank that skips the batch sent it).
* A failure after some forks stepped (an error that only a later fork's backward meets, an interrupt)
  leaves the forks at different steps, which nothing cheap can undo (that would take a copy of every
  fork's weights and optimizer state, more than the gradients this saves). The run is then stopped:
  a :class:`~hpx.ConfigError` names the step, the fork that failed and the forks that had stepped
  (a ``KeyboardInterrupt`` is raised as it is, with that note), and every later step, ``converge()``
  and ``save_checkpoint`` refuse it (under torch.distributed, that rank's later steps) until
  ``load_checkpoint`` restores a saved step. A loop that skips failing batches at any fork calls
  ``backward`` then ``optimizer_step``, which step no fork before every fork's backward is done.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NoReturn

import torch

from hpx.errors import ConfigError
from hpx.forks.fork import _device, _Fork, _forward_backward, _moved, _rng_get, _rng_set
from hpx.forks.misuse import _label, reached
from hpx.forks.ranks import either, fork_mean
from hpx.signals import LossFn


def early_path(forks: Any) -> bool:
    """Whether ``forks.step`` steps each fork right after its own backward (see the module's docstring;
    ``forks._overlap = False`` keeps torch.distributed's steps on the other path, for comparison)."""
    return (forks._fresh and forks.step_count > 0 and forks._sharder is None
            and (forks.collective.world_size == 1 or getattr(forks, "_overlap", True)))


def train_each(forks: Any, trained: list[_Fork], loss_fn: LossFn, batch: Any) -> list[torch.Tensor]:
    """Every fork of ``trained`` (``forks._open()``'s) forward, backward and optimizer step, its
    gradients freed after its step (under torch.distributed, averaged over the ranks before it while
    the next fork's backward runs); returns their losses (detached, in ``trained``'s order)."""
    start = forks._forks[0]
    hold = next((i for i, f in enumerate(trained) if f is not start), len(trained))
    collective = forks.collective
    ranks = collective.world_size > 1
    stepped: list[_Fork] = []
    at: list[_Fork] = []  # the fork whose backward, reduction or step runs now
    flying: list[Any] = []  # under torch.distributed: the reduction in flight (fork_mean)

    def call(i: int) -> torch.Tensor:
        f = trained[i]
        at[:] = [f]
        loss = _forward_backward(f, loss_fn, batch, 1.0, None)
        if f is not start:  # a loss that reached none of its parameters (your model object's, instead)
            ConfigError.check(reached([f], start))
        if ranks and i == 0:  # the step's first all-reduce (a decision's marker meets it)
            flying[:] = [fork_mean(f, collective, first=True, free=True)]
        return loss

    def step(i: int) -> None:
        f = trained[i]
        at[:] = [f]
        if ranks:  # the next fork's backward ran meanwhile
            apart, met = flying.pop().wait()
            forks._apart, forks._crossed = either(forks._apart, apart), either(forks._crossed, met)
        forks._step_one(f, None)
        stepped.append(f)
        f.optimizer.zero_grad(set_to_none=True)
        if forks._zero_model:
            f.model.zero_grad(set_to_none=True)
        if ranks and i + 1 < len(trained):  # sent after this one is checked, as optimizer_step sends them
            at[:] = [trained[i + 1]]
            flying[:] = [fork_mean(trained[i + 1], collective, free=True)]

    forks._note_applied(trained)  # under torch.distributed: a hash of the settings applied (host floats)
    try:
        return stepped_draws(_device(start.model), [lambda i=i: call(i) for i in range(len(trained))],
                             [lambda i=i: step(i) for i in range(len(trained))], hold, forks._streams,
                             lag=int(ranks))
    except BaseException as e:
        flying.clear()  # not waited on: a rank that failed before sending it would leave this one waiting
        for f in trained:  # what the forks that ran took is freed now (an out-of-memory error's loop)
            f.optimizer.zero_grad(set_to_none=True)
            if forks._zero_model:
                f.model.zero_grad(set_to_none=True)
        if not stepped:  # nothing stepped: as a failed backward(), the batch skipped
            raise
        failed = at[0] if at else trained[len(stepped)]
        names = [_label(forks, f) for f in stepped]
        done = " and ".join([", ".join(names[:-1]), names[-1]] if len(names) > 1 else names)
        forks._half = (f"forks.step() failed at step {forks.step_count + 1} on {_label(forks, failed)} "
                       f"({type(e).__name__}: {e}) after {done} had taken that step's optimizer step: "
                       "forks.step() steps each fork right after its own backward (one fork's gradients "
                       "held at a time), so the forks are now at different steps and this run cannot go on. "
                       "Resume from your last checkpoint (hpx.load_checkpoint); a loop that skips a batch "
                       "that fails (an out-of-memory error it catches) calls forks.backward(loss_fn, batch) "
                       "then forks.optimizer_step(), which step no fork before every fork's backward is done")
        halt(forks, e)


def halt(forks: Any, e: BaseException) -> NoReturn:
    """Stop a run whose forks a failure ``e`` left at different steps (``forks._half`` says why:
    every later step, ``converge()`` and ``save_checkpoint`` refuse it): an interrupt is raised as it
    is, with that note; any other failure as a :class:`~hpx.ConfigError`."""
    if not isinstance(e, Exception):  # an interrupt stays one
        e.add_note(f"hpx: {forks._half}")
        raise e
    raise ConfigError([forks._half]) from e


def stepped_draws(device: torch.device, calls: Sequence[Callable[[], Any]],
                  steps: Sequence[Callable[[], Any]], hold: int,
                  others: list[bool | None] | None = None, lag: int = 0) -> list[Any]:
    """Every call's result, each call made from the global random streams as they were before the
    first (as :func:`hpx.forks.fork.common_draws`), and ``steps[i]()`` right after ``calls[i + lag]()``
    (the last steps after the last call) but for the steps up to ``hold``, which wait until
    ``calls[hold]()`` is done. The steps draw, in order, from the streams as the first call left them,
    and the streams are left as the last step left them: every stream as it is when every call is made
    first and every step after."""
    n = len(calls)
    if n < 2:
        out = [c() for c in calls]
        for s in steps:
            s()
        return out
    full = others is None or others[0] is not False
    before = _rng_get(device, full)
    stream = None  # the steps' streams: the first call's, then each step's
    done, out = 0, []
    try:
        for i, c in enumerate(calls):
            if i:
                _rng_set(before, device)
            out.append(c())
            if i == 0:
                stream = _rng_get(device, full)
                if others is not None and others[0] is None:  # a resumed run's first step here
                    others[0] = full = _moved(before, stream)
                    if not full:
                        before = {k: v for k, v in before.items() if k in ("cpu", "cuda")}
                        stream = {k: v for k, v in stream.items() if k in ("cpu", "cuda")}
            if i >= hold and done <= i - lag:
                if i:
                    _rng_set(stream, device)
                while done <= i - lag:
                    steps[done]()
                    done += 1
                stream = _rng_get(device, full)
        if done < n:  # the steps a lag left after the last call
            _rng_set(stream, device)
            while done < n:
                steps[done]()
                done += 1
            stream = _rng_get(device, full)
    finally:
        if stream is not None:
            _rng_set(stream, device)
    return out
