"""The sync (HDET's converge and controller, every ``T`` steps): score the replicas (one host
read), let the search strategy decide, merge the replicas' weights or land them on the point
it picked, move the bases, record the sync. A part of :class:`hpx.Engine`.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import numbers
import time
from collections.abc import Collection
from typing import Any

import torch

from hpx.averaging import average_, float_state, optimizer_state_tensors
from hpx.averaging import params as _params
from hpx.errors import ConfigError, ConsistencyError, NonFiniteError
from hpx.search.base import Decision, SyncView
from hpx.signals import IntervalLoss, LossFn, SyncContext
from hpx.sync_record import SyncRecord

log = logging.getLogger("hpx")


class _Syncing:
    """The engine's sync: scores, the strategy's decision, merge or land, the record."""

    def _sync(self, batch: Any, loss_fn: LossFn | None) -> None:
        cfg = self.config
        self._check_aligned("syncing")
        # a placement: score points on the run's displacement (the replicas are first averaged)
        placed = self._placement if self._placement is not None and self._controls_now() else None
        reset: list[int] = []
        if placed is not None:
            reset = self._consensus()
        # Weight health: when the replicas are averaged, a finite mean shows they are all finite
        # (checked after the merge, one pass over the mean); otherwise replica by replica now.
        eager = placed is None and not cfg.average
        scores, health, bad_steps = self._gather_scores(batch, loss_fn, placed, health=eager)
        sound = torch.isfinite(health)  # all True unless checked eagerly
        if not sound.any():
            self._sound()  # raises NonFiniteError
        if placed is None:
            # A replica with more non-finite losses than the best one, or a non-finite score, is
            # evidence against its values: the search sees it as the worst, the merge leaves it
            # out. Steps at which every replica's loss was non-finite blame no one (bad data).
            finite = sound & torch.isfinite(scores) & (bad_steps <= bad_steps.min())
        else:  # every point is a sound consensus moved along a line: each score counts as it is
            finite = torch.isfinite(scores)
        if not finite.any():  # weights fine, no comparison possible: merge the sound ones, move nothing
            log.warning("step %d: no replica has a finite score (scores %s); check the signal's data "
                        "(the training batches or the probe) for NaN/inf. The replicas are averaged "
                        "and the search sees no preference", self.step_count, scores.tolist())
            finite = sound if placed is None else finite
            scores = torch.full_like(scores, math.nan)
        bad = reset if placed is not None else (~finite).nonzero().reshape(-1).tolist()
        if bad:
            log.warning("step %d: replica(s) %s non-finite; left out and reset from the mean of the rest",
                        self.step_count, bad)
        scores = torch.where(finite, scores, math.nan)
        names = self.knobs.names
        rec = SyncRecord(
            step=self.step_count, bases={}, values={n: self._values[i].tolist() for i, n in enumerate(names)},
            scores=scores.tolist(), nonfinite=bad, spreads={k.name: k.spread for k in self.knobs},
            points=None if placed is None else placed.tolist(), searched=self._controls_now(),
            applied={k.name: [v * self._scales[i] for v in self._values[i].tolist()]  # the last step's
                     for i, k in enumerate(self.knobs)},
            wall=time.perf_counter() - self._t0,
            metrics={k: float(v) for k, v in self._metrics.items()} or None,  # read here, at the sync
        )
        self._metrics = {}
        decision = self._checked(self.search.decide(self._view(self._values, scores, placed)), "decide")
        if placed is None:
            if decision.land is not None:
                raise ValueError(f"the search gave land={decision.land!r} at a sync that scored no placed "
                                 "points (land picks a point on the displacement a placement scored)")
            if not self._converge(self._merge_weights(decision, finite), average=cfg.average,
                                  check=not eager):
                # a replica's weights went non-finite though its score and losses did not show it
                sound = self._sound()
                finite &= sound
                if not finite.any():
                    finite = sound
                unsound = (~sound).nonzero().reshape(-1).tolist()
                log.warning("step %d: replica(s) %s have non-finite weights; left out and reset from "
                            "the mean of the rest", self.step_count, unsound)
                rec.nonfinite = sorted(set(rec.nonfinite) | set(unsound))
                rec.scores = [math.nan if i in unsound else v for i, v in enumerate(rec.scores)]
                self._converge(self._merge_weights(decision, finite), average=cfg.average)
        else:
            self._land(decision, placed)
        self._apply(decision)
        try:  # from here on the sync is made: whatever raises below, it is finished
            info = {k: _plain(v) for k, v in (decision.info or {}).items()}  # tensors: not for a JSON line
            rec.weights, rec.sigma = info.get("weights"), info.get("sigma")
            rec.direction = info.get("direction")
            rec.phase = info.get("phase")
            rec.bases = {k.name: k.base for k in self.knobs}
            self.knobs.label_lr(rec)
            self._keep(rec)
            if log.isEnabledFor(logging.INFO) and self.collective.rank == 0:  # one line per sync
                log.info("sync at step %d: %s", self.step_count, rec.summary())
            for callback in self._on_sync:
                callback(rec)
        finally:  # a callback that raises still leaves the sync finished (and the ranks in step)
            self._acc.zero_()
            self._bad.zero_()
            self._acc_n = [0] * self.n_local
            self._draw()
            self._write(force=True)
            if cfg.check_consistency and self.collective.world_size > 1:
                state = torch.cat([torch.tensor([k.base for k in self.knobs], dtype=torch.float64),
                                   self._slots.reshape(-1).to(torch.float64)])
                self.collective.check_same(
                    state, f"knob bases and permutations after the sync at step {self.step_count}")

    def _warn_past_end(self) -> None:
        """Once, at the first step past the run's length the search was built for (autolr's
        ``total_steps``): the run goes on, but what was planned over that length is over."""
        log.warning("step %d is past total_steps=%d, the run's length %s was built for: the schedule "
                    "stays at its last value and the search holds the learning rate it found. Give the "
                    "run's real length as total_steps to plan over all of it", self.step_count,
                    self._past_end - 1, type(self.search).__name__)

    def _controls_now(self, ahead: int = 0) -> bool:
        """Whether the search reads the scores at a sync ``ahead`` steps from now (the signal
        is only asked for scores then)."""
        return self.search.acts_at(self.step_count + ahead) and any(k.explore for k in self.knobs)

    def _gather_scores(self, batch: Any, loss_fn: LossFn | None, placed: torch.Tensor | None = None,
                       health: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``[N]`` scores, weight health (finite iff the weights are) and non-finite loss
        counts of every replica, in one gather. With ``placed`` (``[P]`` multipliers, ``P`` a
        multiple of ``N``), the scores are the ``P`` points' instead, scored in ``P / N`` rounds
        (point ``p`` by replica ``p % N`` in round ``p // N``)."""
        counts = torch.tensor(self._acc_n, dtype=self._acc.dtype, device=self._acc.device) - self._bad
        # the mean over the interval's finite losses; nan for a replica that had none
        interval = torch.where(counts > 0, self._acc / counts.clamp_min(1), math.nan)
        if isinstance(self.signal, IntervalLoss) and 0 in self._acc_n and self._controls_now():
            raise ConfigError(
                [f"no loss recorded for local replica {self._acc_n.index(0)} since the last sync, and "
                 "replicas are compared on their training loss: use Engine.step, or call "
                 "Engine.record(loss) every step (or pass the loss to the scheduler's step(loss)); "
                 "where a framework calls scheduler.step() with no loss, compare replicas on held-out "
                 "data instead: signal=hpx.ProbeStream(val_batches, loss_fn=...)"]
            )
        rounds = 1 if placed is None else placed.numel() // self.n_replicas
        measured = []
        for j in range(rounds):
            if placed is not None:
                self._move_to(placed[j * self.n_replicas:(j + 1) * self.n_replicas],
                              None if j == 0 else placed[(j - 1) * self.n_replicas:j * self.n_replicas])
            if self._controls_now():
                ctx = SyncContext(self.replicas, interval, batch, loss_fn, self.collective,
                                  self.step_count, round=j)
                scores = self.signal.measure(ctx)
                if not isinstance(scores, torch.Tensor):
                    raise TypeError(f"the signal's measure() ({type(self.signal).__name__}) must return a "
                                    f"tensor of {self.n_local} scores, one per local replica (got "
                                    f"{type(scores).__name__}): torch.tensor(scores) or torch.stack(losses)")
                scores = scores.detach().reshape(-1).to(self._acc.device, torch.float32)
            else:  # the search will not read them: the interval's loss (free) stands in, for the record
                scores = interval.to(torch.float32)
            if scores.numel() != self.n_local:
                raise ValueError(f"signal returned {scores.numel()} scores for {self.n_local} local replicas")
            measured.append(scores)
        fine = self._health().to(scores) if health else torch.zeros_like(scores)  # else checked later
        rows = [*measured, fine, self._bad.to(scores)]
        world = self.collective.world_size
        if world > 1:  # what the ranks must share at every sync, in the same gather (exact in float32)
            digest = getattr(self.signal, "_sync_digest", None)
            header = [self.step_count, self._optimizer_digest(),
                      digest() if digest is not None and self._controls_now() else 0]
            halves = [float(h) for v in header for h in divmod(v % 2**32, 65536)]
            rows += [torch.full_like(scores, h) for h in halves]
        rows = self.collective.all_gather(torch.stack(rows)).to("cpu", torch.float64)  # the host read
        if world > 1:
            self._check_header(rows[:, rounds + 2:, 0].reshape(world, -1, 2))
        # point p = j N + g sits at [rank of g, round j, local index of g]
        scores = rows[:, :rounds, :].transpose(0, 1).reshape(-1)
        return scores, rows[:, rounds, :].reshape(-1), rows[:, rounds + 1, :].reshape(-1)

    def _check_header(self, halves: torch.Tensor) -> None:
        """Raise :class:`ConsistencyError` on every rank (all see the same gathered ``[W, 3, 2]``
        halves) unless every rank is at the same step, with the same optimizer settings, and
        scored on the same probe data."""
        values = (halves[..., 0] * 65536 + halves[..., 1]).to(torch.int64).tolist()
        problems = []
        steps = [v[0] for v in values]
        if len(set(steps)) > 1:
            have = ", ".join(f"rank {r} is at step {s}" for r, s in enumerate(steps))
            problems.append(f"the ranks sync at different steps ({have}): every rank must run the same "
                            "number of optimizer steps (engine.step / engine.advance) between syncs, so "
                            "give every rank as many batches (drop_last=True, one length per rank)")
        for j, what, fix in ((1, "optimizer settings (other than what knobs write)",
                              "build every rank's optimizer with the same settings"),
                             (2, "probe data (the batches the signal scored on at this sync)",
                              "give every rank the same probe batches, in the same order (no "
                              "DistributedSampler on the probe loader)")):
            odd = [r for r, v in enumerate(values) if v[j] != values[0][j]]
            if odd:
                problems.append(f"rank(s) {odd} differ from rank 0 in their {what}: {fix}")
        if problems:
            raise ConsistencyError(f"at the sync of step {self.step_count} the ranks disagree, so their "
                                   f"scores and collectives no longer pair up: {'; '.join(problems)}")

    def _health(self) -> torch.Tensor:
        """``[L]``: finite iff the local replica's weights and buffers all are."""
        return torch.stack([_weights_norm(r.model, self._constants) for r in self.replicas]).to(self._acc)

    def _sound(self) -> torch.Tensor:
        """``[N]`` bool: replicas whose weights and buffers are all finite (one pass over every
        replica and a gather; only when a mean turned out non-finite, or to reset replicas
        without averaging). Raises :class:`NonFiniteError` when none is."""
        health = self.collective.all_gather(self._health()).to("cpu", torch.float64).reshape(-1)
        sound = torch.isfinite(health)
        if not sound.any():
            raise NonFiniteError(
                f"at step {self.step_count} the weights of all {self.n_replicas} replicas are non-finite; "
                "nothing is left to reset them from. Lower the learning rate or its spread, or check "
                "the data for NaN/inf"
            )
        return sound

    def _view(self, values: torch.Tensor, scores: torch.Tensor,
              placed: torch.Tensor | None = None) -> SyncView:
        knobs = list(self.knobs)
        f64 = torch.float64
        return SyncView(
            step=self.step_count, n_replicas=self.n_replicas, names=tuple(self.knobs.names),
            kinds=tuple(k.kind for k in knobs),
            explore=torch.tensor([k.explore for k in knobs], dtype=torch.bool),
            spacing=tuple(k.spacing for k in knobs),
            spreads=torch.tensor([k.spread for k in knobs], dtype=f64),
            bases=torch.tensor([k.base for k in knobs], dtype=f64),
            bounds=torch.tensor([[k.low, k.high] for k in knobs], dtype=f64).reshape(len(knobs), 2),
            values=values, scores=scores, placement=placed,
        )

    def _merge_weights(self, decision: Decision, finite: torch.Tensor) -> torch.Tensor:
        """``[N]`` float64 weights of the consensus: the strategy's, never on a non-finite replica."""
        w = finite.to(torch.float64)
        if decision.merge is not None:
            m = torch.as_tensor(decision.merge, dtype=torch.float64).reshape(-1)
            if m.numel() != self.n_replicas or not torch.isfinite(m).all() or (m < 0).any():
                raise ValueError(f"the search's merge weights must be {self.n_replicas} finite numbers "
                                 f">= 0 (got {m.tolist()})")
            w = torch.where(finite, m, 0.0)
            if not (w > 0).any():  # the strategy kept only non-finite replicas: fall back to the rest
                w = finite.to(torch.float64)
        return w

    def _converge(self, weights: torch.Tensor, *, average: bool, check: bool = False) -> bool:
        """Set replicas to the ``weights``-weighted mean of all replicas (``[N]``, >= 0; a
        replica with weight 0 is left out and always reset). ``average=False`` resets only
        those. ``check``: change nothing and return False if the mean is not finite (a
        replica's weights went NaN or inf: the caller finds which, replica by replica)."""
        cfg = self.config
        finite = weights > 0
        local_w = weights[self._first : self._first + self.n_local].tolist()
        bad_local = [w == 0 for w in local_w]
        write = [True] * self.n_local if average else bad_local
        if not any(write) and not (~finite).any():
            return True
        w = [float(x) for x in local_w]
        total = float(weights.sum())
        states = [float_state(r.model, self._constants) for r in self.replicas]
        if not average_(states, w, total, self.collective,
                        write=write, bucket_cap_mb=cfg.bucket_cap_mb, check_finite=check):
            return False
        opt_states = [optimizer_state_tensors(r.optimizer) for r in self.replicas]
        if opt_states[0] and (cfg.average_optimizer_state or (~finite).any()):
            write_opt = [True] * self.n_local if cfg.average_optimizer_state else bad_local
            average_(opt_states, w, total, self.collective, write=write_opt,
                     bucket_cap_mb=cfg.bucket_cap_mb)
        return True

    def _consensus(self) -> list[int]:
        """Average the replicas whose weights are finite into every replica (before points
        are placed); the global indices of those left out."""
        if self._converge(torch.ones(self.n_replicas, dtype=torch.float64), average=True, check=True):
            return []
        sound = self._sound()
        self._converge(sound.to(torch.float64), average=True)
        return (~sound).nonzero().reshape(-1).tolist()

    @torch.no_grad()
    def _move_to(self, rho: torch.Tensor, were: torch.Tensor | None) -> None:
        """Move local replica ``i``'s parameters from ``anchor + were[g] (theta - anchor)`` (the
        consensus ``theta`` when ``were`` is None) to ``anchor + rho[g] (theta - anchor)``,
        ``g`` its global index (``rho``, ``were``: ``[N]``). Buffers stay where they are."""
        assert self._anchor is not None
        for i, rep in enumerate(self.replicas):
            g = self._first + i
            f = float(rho[g]) / (1.0 if were is None else float(were[g]))
            if f != 1.0:  # p <- anchor + f (p - anchor) = lerp(p, anchor, 1 - f)
                torch._foreach_lerp_(_params(rep.model), self._anchor, 1.0 - f)

    def _land(self, decision: Decision, placed: torch.Tensor) -> None:
        """After a placed sync: every replica to ``anchor + land (theta - anchor)``, identical."""
        if decision.merge is not None:
            raise ValueError("the search gave merge weights at a sync that scored placed points: give "
                             "land=, the multiplier of the displacement the consensus moves to")
        land = 1.0 if decision.land is None else decision.land
        if not (isinstance(land, (int, float)) and not isinstance(land, bool) and 0 < land < math.inf):
            raise ValueError(f"the search's land must be a finite number > 0 (got {land!r})")
        n = self.n_replicas
        self._move_to(torch.full((n,), float(land), dtype=torch.float64), placed[-n:])
        if n > 1:  # one lerp per replica from its own point: average so that they agree to the bit
            self._converge(torch.ones(n, dtype=torch.float64), average=True)

    def _checked(self, decision: Any, where: str) -> Decision:
        """``decision`` as the engine applies it, or a ``TypeError``/``ValueError`` naming the
        strategy and what it returned, raised before anything of the sync is changed."""
        who = f"the search's {where}() ({type(self.search).__name__})"
        if not isinstance(decision, Decision):
            raise TypeError(f"{who} must return a hpx.search.Decision (got {type(decision).__name__}); "
                            "return Decision() to leave everything as it is")
        knobs = list(self.knobs)
        problems = []
        for field in ("bases", "spreads"):
            given = getattr(decision, field)
            if given is None:
                continue
            try:
                row = torch.as_tensor(given, dtype=torch.float64).reshape(-1)
            except (TypeError, ValueError, RuntimeError):
                problems.append(f"{field} must be {len(knobs)} numbers, one per knob (got {given!r})")
                continue
            if row.numel() != len(knobs):
                problems.append(f"{field} must be {len(knobs)} numbers, one per knob {self.knobs.names} "
                                f"(got {row.numel()}: {row.tolist()})")
            elif field == "bases":
                bad = [f"{k.name}={b!r}" for k, b in zip(knobs, row.tolist()) if k.explore and math.isinf(b)]
                if bad:
                    problems.append(f"bases must be finite (got {bad})")
        if decision.spacing is not None and len(decision.spacing) != len(knobs):
            problems.append(f"spacing must name one spacing per knob {self.knobs.names} "
                            f"(got {decision.spacing!r})")
        nxt = decision.next_sync
        if nxt is not None and isinstance(nxt, numbers.Integral) and not isinstance(nxt, bool):
            decision = dataclasses.replace(decision, next_sync=int(nxt))  # a NumPy integer, say
        if problems:
            raise ValueError(f"{who} returned a decision the engine cannot apply: {'; '.join(problems)}")
        return decision

    def _apply(self, decision: Decision, starting: bool = False) -> None:
        """Write a decision's bases, spreads, placement and next sync into the knobs and the
        schedule."""
        knobs = list(self.knobs)
        placement = decision.placement
        if placement is not None:
            rho = torch.as_tensor(placement, dtype=torch.float64).reshape(-1)
            n = self.n_replicas
            if (rho.numel() < n or rho.numel() % n or not torch.isfinite(rho).all()
                    or (rho <= 0).any()):
                raise ValueError(f"the search's placement must be finite numbers > 0, as many as the "
                                 f"{n} replicas or a multiple (got {rho.tolist()})")
            if not starting and self._anchor is None:
                raise ValueError("the search asked for a placement, but its start decision (or a later "
                                 "one) did not: the engine no longer holds the run's starting parameters")
            placement = rho
        elif not starting:
            self._anchor = None  # no strategy asks again: free the copy
        if decision.bases is not None:
            for k, b in zip(knobs, torch.as_tensor(decision.bases, dtype=torch.float64).tolist()):
                if k.explore:
                    k.base = k.clamp(b)
                    if k.kind == "mul" and b <= 0 and k.name not in self._floored:  # once per knob
                        self._floored.add(k.name)
                        log.warning("step %d: the search (%s) moved knob %r to %g, at or below 0; it is kept "
                                    "at its bound %g, where it barely acts (give the knob bounds=(low, high) "
                                    "with low > 0 for a floor)", self.step_count, type(self.search).__name__,
                                    k.name, b, k.base)
        if decision.spreads is not None or decision.spacing is not None:
            spreads = ([k.spread for k in knobs] if decision.spreads is None
                       else torch.as_tensor(decision.spreads, dtype=torch.float64).tolist())
            spacing = decision.spacing or tuple(k.spacing for k in knobs)
            for k, a, sp in zip(knobs, spreads, spacing):
                if k.explore:
                    k.set_spread(a, sp)
        nxt = decision.next_sync if decision.next_sync is not None else self.config.sync_every
        if not (isinstance(nxt, int) and not isinstance(nxt, bool) and nxt >= 1):
            raise ValueError(f"the search's next_sync must be an integer >= 1 (got {nxt!r})")
        self._next_sync = self.step_count + nxt
        self._placement = placement

    def _keep(self, rec: SyncRecord) -> None:
        """Append ``rec`` to the history (the newest ``history_limit`` stay in memory) and to
        the history file."""
        self.history.append(rec)
        limit = self.config.history_limit
        if limit is not None and len(self.history) > limit:
            del self.history[: len(self.history) - limit]
        path = self.config.history_file
        if path is not None and self._writes_files:
            from hpx.history import _record_line

            with open(path, "a" if self._history_appends else "w") as f:  # not a former run's lines
                f.write(_record_line(rec) + "\n")
            self._history_appends = True


def _plain(value: Any) -> Any:
    """A strategy's ``info`` value as the record keeps it: tensors and NumPy values as Python
    numbers and lists, containers walked."""
    if isinstance(value, torch.Tensor) or type(value).__module__ == "numpy":
        return value.tolist() if hasattr(value, "tolist") else value
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _weights_norm(model: torch.nn.Module, constants: Collection[str] = ()) -> torch.Tensor:
    """A scalar that is finite iff every floating weight and buffer is, the ``constants``
    aside (stays on device)."""
    ts = [t.detach() for t in float_state(model, constants)]
    if not ts:
        return torch.zeros(())
    return torch.stack([n.float() for n in torch._foreach_norm(ts)]).sum()
