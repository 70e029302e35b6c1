"""hpx's exceptions: one base class, and a configuration error that lists every problem at once."""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["BackendError", "ConfigError", "ConsistencyError", "HpxError", "NonFiniteError"]


class HpxError(Exception):
    """Base class of every error hpx raises on purpose."""


class ConfigError(HpxError, ValueError):
    """Invalid settings. Lists every problem found, not only the first.

    ``problems`` holds one plain sentence per problem, each naming the setting,
    the value given and what is allowed.
    """

    def __init__(self, problems: Iterable[str]):
        self.problems = [str(p) for p in problems]
        if not self.problems:
            raise ValueError("ConfigError needs at least one problem")
        n = len(self.problems)
        head = "1 problem" if n == 1 else f"{n} problems"
        super().__init__(f"{head}: " + "; ".join(self.problems))

    def __reduce__(self) -> tuple[type, tuple[list[str]]]:
        # pickled with its problems (a process pool, torch.multiprocessing): Exception's default
        # would rebuild it from the message, one problem per character
        return type(self), (self.problems,)

    @staticmethod
    def check(problems: Iterable[str]) -> None:
        """Raise a ConfigError listing ``problems`` if there are any."""
        problems = list(problems)
        if problems:
            raise ConfigError(problems)


class BackendError(HpxError, RuntimeError):
    """A backend cannot run as asked (for example, no process group is initialised)."""


class NonFiniteError(HpxError, FloatingPointError):
    """Every replica's loss (or weights) became NaN or infinite, so nothing is left to average."""


class ConsistencyError(HpxError, RuntimeError):
    """Ranks disagree on state that must be identical on all of them."""
