"""Drop-in learning-rate schedulers that run HDET: an exact OneCycleLR, and exploration on top
of any torch scheduler.

Two schedulers, both torch ``LRScheduler`` subclasses, stepped once per optimizer step with the
step's loss::

    sched = hpx.OneCycleLR(opt, max_lr=0.1, total_steps=10_000,            # torch's arguments
                           model=model, spread=0.2, sync_every=100)       # HDET's, keyword-only
    sched = hpx.ExploreLR(torch.optim.lr_scheduler.CosineAnnealingLR(opt, 10_000),
                          model=model, spread=0.2, sync_every=100)
    ...
    loss.backward(); opt.step(); sched.step(loss)

How the numbers come about (the paper's symbols, mapped in docs/method.md). Every parameter group ``g`` is one
:class:`~hpx.LearningRate` knob with base ``b_g`` and schedule ``f_g``; replica ``r`` trains at

    lr_r,g(t) = b_g * rho_pi(r) * f_g(t)

* ``rule="hpx"`` (the default): ``f_g(t)`` is the user's schedule itself (OneCycle's lr, or the
  wrapped scheduler's) and ``b_g`` starts at exactly 1: the controller learns a multiplicative
  *correction* of the schedule, in log space, so the schedule's shape is kept. With a zero
  spread (or one replica) ``b_g = rho = 1`` and the written lr is the schedule's own float, bit
  for bit.
* ``rule="paper"`` (OneCycleLR only): the paper's controller. Until the handover ``H`` (the
  first sync at or after ``warmup``) the lr follows OneCycle; from ``H`` on the controller's
  linear rule *replaces* the base, ``lr_base <- lr_m (1 - gamma) + lambda v`` at every sync, with
  ``gamma`` chosen so that the base decays from OneCycle's lr at ``H`` to OneCycle's floor
  ``min_lr`` by ``total_steps``. See :class:`OneCyclePlan` for how ``b`` and ``f`` are set so
  that nothing jumps at ``H`` and the lr decays smoothly between syncs.

OneCycle's momentum (SGD ``momentum`` or Adam ``beta1``) keeps cycling exactly as torch cycles
it, under either rule; it is written every step by a knob that does not explore.

Who runs the method. With more than one replica (one per process under torch.distributed) and
a ``model``, an :class:`~hpx.Engine` does: it writes the values, averages parameters and
floating buffers every ``sync_every`` steps and moves the bases. With one replica there is
nothing to compare or average, and the scheduler writes the same numbers itself, without the
engine (and without its collectives, host reads or NaN checks): it is then plain OneCycleLR.

For ``N`` replicas inside one process, use :class:`~hpx.Engine` directly with the knobs of
:class:`OneCyclePlan` or :func:`explore_knobs`: the schedulers drive one optimizer.
"""

from hpx._onecycle import OneCycleShape
from hpx.schedule._plan import PAPER_META_LR, PAPER_MOMENTUM, PAPER_TEMPERATURE, OneCyclePlan, Rule
from hpx.schedule._schedulers import ExploreLR, OneCycleLR
from hpx.schedule._shadow import explore_knobs

__all__ = ["PAPER_META_LR", "PAPER_MOMENTUM", "PAPER_TEMPERATURE", "ExploreLR", "OneCycleLR", "OneCyclePlan",
           "OneCycleShape", "Rule", "explore_knobs"]
