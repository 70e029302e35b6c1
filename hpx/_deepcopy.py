"""Deep copies of a model that keeps tensors of the autograd graph as attributes: used where hpx.Forks
copies your run into its forks and where the engine copies your model into its replicas."""

from __future__ import annotations

from typing import Any

import torch


def graph_tensors_detached(model: torch.nn.Module) -> dict[int, Any]:
    """A ``copy.deepcopy`` memo in which every tensor of the autograd graph that a module keeps as
    an attribute (``self.last_logits = out`` in a forward; directly or in a list, tuple or dict)
    copies as a detached clone: deepcopy refuses a tensor that is not a graph leaf, and the next
    forward overwrites it anyway."""
    memo: dict[int, Any] = {}

    def visit(v: Any) -> None:
        if torch.is_tensor(v):
            if v.grad_fn is not None and id(v) not in memo:
                memo[id(v)] = v.detach().clone()
        elif isinstance(v, (list, tuple)):
            for x in v:
                visit(x)
        elif isinstance(v, dict):
            for x in v.values():
                visit(x)

    for m in model.modules():
        for v in vars(m).values():
            visit(v)
    return memo
