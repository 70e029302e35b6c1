"""hpx: hyperparameter search from the data-parallel replicas of one training run.

An implementation of HDET (Hyperparameter-Divergent Ensemble Training): each of
``N`` replicas trains with its own values of some scalar knobs, spread
symmetrically around shared bases (fan-out); every ``T`` steps the replicas'
weights are averaged (converge) and a zero-order controller moves every base
toward the better-scoring side.

The recommended way to find the learning rate is :class:`hpx.Forks`: whole runs at
several multiples of your learning rate, trained beside yours on the same batches, cut
early, and your run kept unless another beats it on held-out data with confidence.
"""

# Names load on first use (PEP 562), so that ``import hpx`` and the ``hpx`` command do not
# import torch until something needs it (``hpx report`` prints a table in well under a second).
# The public names are listed once, in the stub ``hpx/__init__.pyi`` that static tools read;
# this module reads the same stub for its table of where each name lives.
from __future__ import annotations

import ast
import importlib
import importlib.util
from pathlib import Path
from typing import Any

__version__ = "0.1.0"


def _public() -> dict[str, str]:
    """name -> the module it is imported from, read from ``__init__.pyi``'s import lines."""
    stub = ast.parse(Path(__file__).with_name("__init__.pyi").read_text())
    return {alias.asname or alias.name: (f"hpx.{alias.name}" if node.module == "hpx" else node.module)
            for node in stub.body if isinstance(node, ast.ImportFrom) and node.module
            for alias in node.names}


_LAZY = _public()
__all__ = ["__version__", *sorted(_LAZY)]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        # a subpackage or module not yet imported (hpx.backends, hpx.search, ...): as after an import
        if name.startswith("_") or importlib.util.find_spec(f"hpx.{name}") is None:
            raise AttributeError(f"module 'hpx' has no attribute {name!r}")
        module = f"hpx.{name}"
    loaded = importlib.import_module(module)
    value = loaded if module == f"hpx.{name}" else getattr(loaded, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(__all__) | {k for k in globals() if k.startswith("__")})
