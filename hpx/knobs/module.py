"""Knobs that live as attributes of modules: dropout rates, attention temperatures, any float attribute."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Union

import torch
from torch import nn

from hpx.errors import ConfigError
from hpx.knobs.base import Kind, Knob, Setter, _is_real

if TYPE_CHECKING:
    from hpx.replica import Replica

__all__ = ["AttentionTemperature", "Dropout", "ModuleAttribute", "ModuleSelector"]

ModuleSelector = Union[
    str,
    Sequence[str],
    type,
    tuple,
    Callable[[nn.Module], Iterable[nn.Module]],
    None,
]
"""Which modules of a replica's model a knob sets: a qualified submodule name or a
list of them (``"encoder.layers.0.dropout"``), a module class or tuple of classes
(every instance), a function ``model -> modules``, or ``None`` for the knob's
default class."""


def _is_number(value: object) -> bool:
    """A plain number (``nn.Dropout(0)`` keeps an int): not a tensor, buffer or parameter."""
    return _is_real(value) and not isinstance(value, torch.Tensor)


class ModuleAttribute(Knob):
    """A float attribute set on selected modules of each replica's model.

    Args:
        attribute: the attribute's name (``"p"`` for dropout).
        modules: a :data:`ModuleSelector`; ``None`` means every module that is an
            instance of ``default_types``.
        base, spread, kind, bounds, explore, span, from_zero: as for :class:`~hpx.Knob`
            (``from_zero``: the value a multiplicative attribute's upper fork takes in
            :class:`hpx.Forks` when it is 0).
    """

    default_types: tuple[type, ...] = ()

    def __init__(
        self,
        name: str,
        *,
        attribute: str,
        modules: ModuleSelector = None,
        base: float | None = None,
        spread: float = 0.0,
        kind: Kind = "mul",
        bounds: tuple[float, float] | None = None,
        explore: bool = True,
        span: float | None = None,
        from_zero: float | None = None,
    ) -> None:
        if not isinstance(attribute, str) or not attribute.isidentifier():
            raise ConfigError([f"attribute of knob {name!r} must be an identifier (got {attribute!r})"])
        if modules is None and not self.default_types:
            raise ConfigError([f"knob {name!r} needs modules=... (names, a class or a function)"])
        super().__init__(name, base=base, spread=spread, kind=kind, bounds=bounds, explore=explore,
                         span=span, from_zero=from_zero)
        self.attribute = attribute
        self.modules = modules

    def select(self, model: nn.Module) -> list[nn.Module]:
        """The modules of ``model`` this knob sets (at least one, or ConfigError)."""
        sel = self.modules
        if sel is None:
            sel = self.default_types
        if isinstance(sel, str):
            sel = [sel]
        is_types = isinstance(sel, tuple) and sel and all(isinstance(t, type) for t in sel)
        if isinstance(sel, type) or is_types:
            found = [m for m in model.modules() if isinstance(m, sel)]
        elif callable(sel):
            found = list(sel(model))
        else:
            found = []
            for qualified in sel:
                try:
                    found.append(model.get_submodule(qualified))
                except AttributeError:
                    raise ConfigError(
                        [f"knob {self.name!r}: the model has no submodule {qualified!r}"]
                    ) from None
        if not found:
            kinds = (" or ".join(f"{t.__module__}.{t.__qualname__}" for t in self.default_types)
                     + " instances" if self.modules is None else f"modules={self.modules!r}")
            raise ConfigError(
                [f"knob {self.name!r} found no modules to set {self.attribute!r} on in "
                 f"{type(model).__name__} (it looked for {kinds}): point it at the modules that hold the "
                 f"value with modules= (their names as model.named_modules() gives them, a class, or a "
                 f"function model -> modules), or drop the knob if the model has none"]
            )
        missing = [type(m).__name__ for m in found if not hasattr(m, self.attribute)]
        if missing:
            raise ConfigError(
                [f"knob {self.name!r}: module(s) {sorted(set(missing))} have no attribute "
                 f"{self.attribute!r}"]
            )
        odd = {type(getattr(m, self.attribute)).__name__ for m in found
               if not _is_number(getattr(m, self.attribute))}
        if odd:
            raise ConfigError(
                [f"knob {self.name!r}: the modules' {self.attribute!r} is a {', '.join(sorted(odd))}, and "
                 f"the knob writes a Python float into it: store it as a float (self.{self.attribute} = "
                 f"1.0), or, for a tensor, declare hpx.Custom({self.name!r}, set=lambda r, v: ..., ...)"]
            )
        return found

    def bind(self, replica: Replica) -> Setter:
        mods, attr = self.select(replica.model), self.attribute

        def setter(value: float) -> None:
            for m in mods:
                setattr(m, attr, value)

        return setter

    def targets(self, replica: Replica) -> list[str]:
        names = {id(m): n or "the model" for n, m in replica.model.named_modules()}
        return [f"{self.attribute} of module {names.get(id(m), type(m).__name__)}"
                for m in self.select(replica.model)]

    def read(self, replica: Replica) -> float:
        vals = {float(getattr(m, self.attribute)) for m in self.select(replica.model)}
        if len(vals) != 1:
            raise ConfigError(
                [f"knob {self.name!r}: the selected modules start with different values "
                 f"{sorted(vals)}; pass base=... to set them all"]
            )
        return vals.pop()


class Dropout(ModuleAttribute):
    """The drop probability ``p`` of dropout modules (additive spread, kept in ``bounds``).

    By default every ``nn.Dropout``/``Dropout1d/2d/3d``/``AlphaDropout`` in the model.
    Note that some modules keep a dropout rate as a plain float of their own (for
    example ``nn.MultiheadAttention.dropout``); explore those with a knob of their own,
    ``hpx.ModuleAttribute("attn_dropout", attribute="dropout", modules=nn.MultiheadAttention,
    kind="add", bounds=(0, 0.99), spread=0.1)``.
    """

    default_types = (nn.modules.dropout._DropoutNd,)

    def __init__(
        self,
        name: str = "dropout",
        *,
        modules: ModuleSelector = None,
        base: float | None = None,
        spread: float = 0.0,
        bounds: tuple[float, float] = (0.0, 0.99),
        explore: bool = True,
    ) -> None:
        super().__init__(name, attribute="p", modules=modules, base=base, spread=spread,
                         kind="add", bounds=bounds, explore=explore)


class AttentionTemperature(ModuleAttribute):
    """A positive scale the model reads, e.g. a temperature on attention logits.

    The model must read the attribute in ``forward`` (``scores / self.temperature``);
    ``modules`` picks which modules carry it (a class, names or a function).
    """

    def __init__(
        self,
        name: str = "temperature",
        *,
        modules: ModuleSelector,
        attribute: str = "temperature",
        base: float | None = None,
        spread: float = 0.0,
        bounds: tuple[float, float] | None = None,
        explore: bool = True,
        span: float | None = None,
        from_zero: float | None = None,
    ) -> None:
        super().__init__(name, attribute=attribute, modules=modules, base=base, spread=spread,
                         kind="mul", bounds=bounds, explore=explore, span=span, from_zero=from_zero)
