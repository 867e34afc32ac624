"""An optimizer's parameters and state, named at a native region's end (`NativeRoles.finish`)."""

from __future__ import annotations

import weakref
from typing import Any

import torch

from memlab.core.categories import Category


def name_optimizer(
    roles: Any,
    opt: torch.optim.Optimizer,
    named: weakref.WeakKeyDictionary[torch.optim.Optimizer, list[int]],
) -> None:
    """Names ``opt``'s parameters and state tensors through ``roles`` where its groups or its
    state changed since ``named`` last saw it: a state made at a first step, a state_dict
    loaded (a new dict), a state tensor the step replaces (Adafactor's)."""
    groups, state = opt.param_groups, opt.state
    seen = [id(groups), len(groups), id(state), len(state)]
    for group in groups:
        seen.append(len(group["params"]))
    for st in state.values():  # (loops: they run at every region's end, for every parameter)
        if isinstance(st, dict):
            for v in st.values():
                if isinstance(v, torch.Tensor):
                    seen.append(id(v))
    if named.get(opt) == seen:
        return
    for group in groups:
        for p in group["params"]:
            roles._remember_leaf(p)
            roles.mark(p, Category.PARAMETER)
    for st in state.values():
        for v in st.values() if isinstance(st, dict) else ():
            if isinstance(v, torch.Tensor):
                roles.mark(v, Category.OPTIMIZER_STATE)
    named[opt] = seen
