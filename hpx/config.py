"""The engine's settings, validated with pydantic; every problem reported at once."""

from __future__ import annotations

import numbers
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError

from hpx.errors import ConfigError

__all__ = ["EngineConfig"]

_Positive = Annotated[float, Field(gt=0, allow_inf_nan=False)]


def _integer(v: Any) -> Any:
    """Integers only: pydantic would take ``True`` as 1, ``"3"`` as 3 and ``5.0`` as 5."""
    if v is None:
        return v
    if isinstance(v, bool) or not isinstance(v, numbers.Integral):
        raise ValueError("must be an integer")
    return int(v)


_Int = Annotated[int, BeforeValidator(_integer)]


class EngineConfig(BaseModel):
    """Settings of :class:`~hpx.Engine`. Symbols are the paper's (docs/method.md maps them).

    Attributes:
        replicas: replicas per process. ``None``: 4 in one process, 1 per rank
            under torch.distributed. ``N`` = replicas x world size.
        sync_every: ``T``, optimizer steps between syncs (converge + controller).
        warmup: steps before the controller starts moving bases (syncs before
            then still average weights and redraw permutations).
        mode: ``"shared"``: every replica applies the mean gradient with its own
            values (Eq. 2). ``"independent"``: each replica its own gradient
            between syncs (local-SGD style).
        seed: seeds hpx's own random streams (permutations, warm-init noise).
        controller: move bases from the replicas' scores (the auto-update).
        average: average weights at every sync (the converge step). Off is an
            ablation; poisoned replicas are still reset from the consensus.
        average_optimizer_state: also average the optimizer's state (momenta,
            Adam moments) at syncs. They are equal across replicas in shared
            mode; in independent mode this is a choice.
        shared_optimizer_state: in shared mode, keep one optimizer state for all the
            replicas of a process where it is provably the same for each (SGD with
            momentum, Adam, AdamW, NAdam, RAdam, Adamax, RMSprop, Adagrad, with weight
            decay only decoupled, and knobs on lr and weight decay only): stored and
            updated once instead of once per replica. ``False``: one per replica.
        meta_lr, momentum: ``lambda`` and ``beta`` of the controller.
        debias_momentum: correct the controller's velocity for its start at 0
            (as Adam does), so the first syncs take full steps; ``False`` is the
            paper's Eq. 7.
        temperature: ``sigma``: ``"auto"`` (scaled std of the replicas' scores)
            or a fixed positive number (the paper's 0.1).
        temperature_scale: multiplies the automatic sigma.
        space: the controller's coordinates: ``"auto"`` (log for multiplicative
            knobs, linear for additive), ``"log"`` or ``"linear"`` (the paper's).
        decay: ``gamma`` in ``[0, 1)``: each sync multiplies multiplicative
            knobs' bases by ``1 - gamma`` (the paper's decay toward a floor). 0
            by default: decay belongs to the schedule.
        warm_init: ``nu`` of warm noisy initialisation (paper 0.01), or ``None``.
        bucket_cap_mb: largest flat bucket when averaging.
        history_limit: sync records kept in :attr:`Engine.history <hpx.Engine.history>`
            and in checkpoints (the newest ones; ``None``: all). Give ``history_file``
            to keep the full record on disk.
        history_file: a JSON-lines file to which every sync record is appended as it
            happens (by rank 0 only under torch.distributed); read it back with
            :func:`hpx.load_history`. Records past a resumed checkpoint's step are
            dropped from it on load, so it holds one line per sync of the run.
        check_consistency: after every sync, compare the knob bases across ranks
            and raise if they differ (a debug check; costs one all-gather).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    replicas: Annotated[_Int, Field(ge=1, le=4096)] | None = None
    sync_every: Annotated[_Int, Field(ge=1)] = 50
    warmup: Annotated[_Int, Field(ge=0)] = 0
    mode: Literal["shared", "independent"] = "shared"
    seed: _Int = 0
    controller: bool = True
    average: bool = True
    average_optimizer_state: bool = False
    shared_optimizer_state: bool = True
    meta_lr: Annotated[float, Field(ge=0, allow_inf_nan=False)] = 0.5
    momentum: Annotated[float, Field(ge=0, lt=1)] = 0.9
    debias_momentum: bool = True
    temperature: Union[Literal["auto"], _Positive] = "auto"
    temperature_scale: _Positive = 1.0
    space: Literal["auto", "log", "linear"] = "auto"
    decay: Annotated[float, Field(ge=0, lt=1)] = 0.0
    warm_init: Annotated[float, Field(ge=0, allow_inf_nan=False)] | None = None
    bucket_cap_mb: _Positive = 25.0
    history_limit: Annotated[_Int, Field(ge=1)] | None = 1000
    history_file: str | None = None
    check_consistency: bool = False

    @classmethod
    def build(cls, **settings: Any) -> EngineConfig:
        """Validate ``settings``; raise :class:`ConfigError` listing every problem."""
        try:
            return cls(**settings)
        except ValidationError as exc:
            raise ConfigError(_describe(e) for e in _dedupe(exc.errors())) from None


def _dedupe(errors: list[dict]) -> list[dict]:
    """One message per field: a union type reports one error per branch."""
    seen: dict[str, dict] = {}
    for e in errors:
        field = str(e["loc"][0]) if e["loc"] else ""
        seen.setdefault(field, e)
    return list(seen.values())


def _describe(e: dict) -> str:
    field = str(e["loc"][0]) if e["loc"] else "settings"
    if e["type"] == "extra_forbidden":
        known = ", ".join(EngineConfig.model_fields)
        return f"unknown setting {field!r} (known settings: {known})"
    msg = e["msg"].removeprefix("Value error, ")
    msg = msg[0].lower() + msg[1:] if msg else msg
    if field == "temperature":
        msg = "must be 'auto' or a number > 0"
    return f"{field} {msg.replace('input should be', 'must be')} (got {e.get('input')!r})"
