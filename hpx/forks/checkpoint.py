"""What ``hpx.save_checkpoint`` checks before it writes a :class:`hpx.Forks` run: that the forks
it would save are finite (a NaN run is never saved, so pruning never leaves only NaN steps)."""

from __future__ import annotations

from typing import Any

import torch

from hpx._loading import _device, _processes
from hpx.history import _fork_label


def unsaveable(forks: Any) -> str | None:
    """The warning when this step must not be saved (:func:`_unsound_forks`; in one process, a run
    left part changed by a ``forks.step()`` or ``each()`` that failed part way), else ``None``."""
    if forks._half is not None and forks.collective.world_size == 1:
        return f"step {forks.step_count} not saved: {forks._half}"
    blown = _unsound_forks(forks)
    if not blown:
        return None
    return (f"step {forks.step_count} not saved: the trainable weights or optimizer state of "
            f"{', '.join(blown)} are non-finite, and a checkpoint must not resume from them (nothing was "
            "written, so the previous checkpoints stay): resume from the newest with load_checkpoint, at a "
            "lower learning rate or with the batches since it checked for NaN/inf")


def _unsound_forks(forks: Any) -> list[str]:
    """The non-finite forks and annealed copies (their labels: lr multiple and knobs) when the save
    must be skipped, else ``[]``; the same on every rank (a host read per fork and one gather: a
    save, not a step). Skipped: your run's trainable weights or optimizer state are non-finite, or,
    once your run is lost (non-finite at a cut, kept only for the end's comparison, no longer
    trained), every other fork's are (nothing finite is left to go on from). A challenger or a copy
    that blew up while your run is finite is saved as it is: the search drops it at the next cut
    (or your run beats it at the end), and a resume does the same; skipping for it would leave the
    run unsaved until then, to its end after the last cut."""
    everyone = [*forks._forks, *forks._clones]
    device = _device(forks)
    flags = torch.stack([_finite_state(f.model, f.optimizer).to(device) for f in everyone]).to(torch.float32)
    finite = (_processes(forks).all_gather(flags).reshape(-1, len(everyone)) > 0).all(0).tolist()
    start = forks._forks[0]
    others = finite[1:len(forks._forks)]
    if not start.lost and finite[0]:
        return []
    if start.lost and any(others):  # a finite challenger goes on
        return []
    labels = []
    for i, f in enumerate(everyone):
        if finite[i]:
            continue
        label = _fork_label(f.setting(), forks._bases)
        labels.append(f"your run ({label}{', lost at a cut' if f.lost else ''})" if i == 0
                      else f"the annealed copy of {label}" if f.ramp is not None else f"the fork at {label}")
    return labels


@torch.no_grad()
def _finite_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> torch.Tensor:
    """Whether this process's part of the trainable parameters and of the optimizer's floating state
    is all finite (a 0-dim bool tensor, read by the caller after the ranks' gather)."""
    from hpx.averaging import local

    tensors = [local(p) for p in model.parameters() if p.requires_grad]
    tensors += [local(v) for st in optimizer.state.values() for v in st.values()
                if torch.is_tensor(v) and v.is_floating_point()]
    if not tensors:
        return torch.ones((), dtype=torch.bool)
    device = tensors[0].device
    return torch.stack([torch.isfinite(t).all().to(device) for t in tensors]).all()
