"""An optimizer's parameters and state, named at a native region's end (`NativeRoles.finish`)."""

from __future__ import annotations

import weakref
from itertools import chain
from operator import itemgetter
from typing import Any

import torch

from memlab.core.categories import Category

_PARAMS = itemgetter("params")


def name_optimizer(
    roles: Any,
    opt: torch.optim.Optimizer,
    named: weakref.WeakKeyDictionary[torch.optim.Optimizer, list[int]],
) -> None:
    """Names ``opt``'s parameters and state tensors through ``roles`` where its groups or its
    state changed since ``named`` last saw it: a state made at a first step, a state_dict
    loaded (a new dict), a state tensor the step replaces (Adafactor's). A failure is one of
    ``roles``' errors (the report's notes), never the program's."""
    try:
        _name(roles, opt, named)
    except Exception as e:
        roles._error(e, "an optimizer's roles not read")


def _name(
    roles: Any,
    opt: torch.optim.Optimizer,
    named: weakref.WeakKeyDictionary[torch.optim.Optimizer, list[int]],
) -> None:
    groups, state = opt.param_groups, opt.state
    try:  # (in C, for every parameter: this runs at every region's end)
        values = list(chain.from_iterable(map(dict.values, state.values())))
    except TypeError:  # a state that is not a dict
        values = [v for st in state.values() if isinstance(st, dict) for v in st.values()]
    seen = [id(groups), len(groups), id(state), len(state)]
    seen += map(len, map(_PARAMS, groups))
    seen += map(id, values)  # (a number's too: a new one named again, as a new tensor is)
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
