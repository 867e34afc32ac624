"""Activation checkpointing as a what-if lever: which parts of a model to recompute in
backward (named by the user, or found: repeated blocks, or repeated runs of layers in an
``nn.Sequential``), wrapped for the run and unwrapped after."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.utils.checkpoint
from torch import nn

from memlab.core.frames import users_traceback
from memlab.step.config import WhatIfError


@users_traceback()
def blocks(model: nn.Module) -> list[str]:
    """Module paths of repeated blocks: the children of each ModuleList or Sequential whose
    children (two or more) are all of one type, or of one family (`_one_family`: a hybrid
    stack's attention and Mamba layers). Nested repeats inside a block are left alone."""
    if not isinstance(model, nn.Module):
        raise WhatIfError(
            f"blocks: model is a {type(model).__name__}: pass the nn.Module whose repeated "
            "blocks to list (the model itself, not its class or output)."
        )
    found: list[str] = []
    inside: set[str] = set()  # (each path's ancestors looked up: linear in the model's size)
    for path, module in model.named_modules():
        parts = path.split(".")
        if any(".".join(parts[:i]) in inside for i in range(1, len(parts))):
            continue
        if isinstance(module, (nn.ModuleList, nn.Sequential)):
            children = list(module.named_children())
            if len(children) >= 2 and _one_family([c for _, c in children]):
                made = [f"{path}.{n}" if path else n for n, _ in children]
                found += made
                inside.update(made)
    return found


def _one_family(modules: list[nn.Module]) -> bool:
    """Whether the modules are of one type, or share a base class of their own beyond torch's
    (Hugging Face's ``GradientCheckpointingLayer`` under Jamba's or Qwen3-Next's Mamba and
    attention layers; a user's ``Block`` under its kinds of block)."""
    kinds = {type(m) for m in modules}
    if len(kinds) == 1:
        return True
    shared = set.intersection(*(set(k.__mro__) for k in kinds))
    return any(
        issubclass(c, nn.Module) and c.__module__.partition(".")[0] != "torch" for c in shared
    )


@dataclass(frozen=True)
class Runs:
    """In the ``nn.Sequential`` at ``path``, ``count`` runs of ``length`` layers from ``start``
    that repeat one pattern of layer types (e.g. Linear, ReLU), each run one checkpoint."""

    path: str
    start: int
    length: int
    count: int
    pattern: tuple[str, ...]

    @property
    def per_segment(self) -> int:
        """Runs recomputed together: about the square root of their number (fewer inputs kept
        and a shorter recomputation at once), at least two segments."""
        per = math.ceil(math.sqrt(self.count))
        return per if math.ceil(self.count / per) > 1 else 1

    def describe(self) -> str:
        where = f"`{self.path}`" if self.path else "the model"
        return (
            f"{self.count} runs of ({', '.join(self.pattern)}) in {where}, layers "
            f"{self.start}-{self.start + self.length * self.count - 1}, recomputed "
            f"{self.per_segment} run{'s' if self.per_segment > 1 else ''} at a time (all but "
            "the last segment, which backward needs first)"
        )


def repeated_runs(model: nn.Module) -> list[Runs]:
    """Each ``nn.Sequential`` (outermost first, none inside another found) whose layers repeat
    a pattern of types at least twice with parameters in it: the longest such stretch, the
    shortest pattern on a tie, the earliest start on a tie."""
    found: list[Runs] = []
    for path, module in model.named_modules():
        if type(module) is not nn.Sequential or any(
            path.startswith(f.path + ".") or not f.path for f in found
        ):
            continue
        layers = list(module)
        best = _longest_repeat(layers)
        if best is not None:
            length, start, count = -best[1], -best[2], best[3]
            names = tuple(type(m).__name__ for m in layers[start : start + length])
            found.append(Runs(path, start, length, count, names))
    return found


def _longest_repeat(layers: list[nn.Module]) -> tuple[int, int, int, int] | None:
    """(covered, -length, -start, count) of the longest stretch of ``layers`` that repeats a
    pattern of types at least twice with a trainable parameter in it (the shortest pattern
    on a tie, then the earliest start). For each pattern length, whether each layer's type
    equals the one a length further, and from each start how far that holds, in numpy: about
    n²/2 element steps in C (8,000 layers in a fraction of a second; a search that compared
    slices took minutes)."""
    n = len(layers)
    kinds: dict[type, int] = {}
    codes = np.array([kinds.setdefault(type(m), len(kinds)) for m in layers], dtype=np.int64)
    trains = [any(p.requires_grad for p in m.parameters()) for m in layers]
    trainable = np.concatenate([[0], np.cumsum(np.array(trains, dtype=np.int64))])
    best: tuple[int, int, int, int] | None = None
    for length in range(1, n // 2 + 1):
        m = n - length
        same = codes[:m] == codes[length:]  # layer i's type is the one a length further
        at = np.arange(m)
        stop = np.minimum.accumulate(np.where(same, m, at)[::-1])[::-1]  # next mismatch
        starts = np.arange(n - 2 * length + 1)
        count = 1 + (stop[starts] - starts) // length  # repeats of the pattern at each start
        ok = (count >= 2) & (trainable[starts + length] > trainable[starts])
        if not ok.any():
            continue
        covered = np.where(ok, count * length, -1)
        start = int(np.argmax(covered))  # the earliest of the longest
        key = (int(covered[start]), -length, -start, int(count[start]))
        best = key if best is None or key > best else best
    return best


@contextlib.contextmanager
def checkpointed(
    model: nn.Module, spec: str | tuple[str, ...], context_fn: Callable[[], Any] | None = None
) -> Iterator[list[str]]:
    """Within the block, the modules ``spec`` names run checkpointed; ``"auto"`` finds them:
    the repeated `blocks`, else the `repeated_runs` of a Sequential. Yields notes saying what
    was chosen (and that a Hugging Face model's ``use_cache`` is off, as it turns it off itself
    under checkpointing). ``context_fn``: checkpoint's, for selective checkpointing
    (`memlab.step.levers.selective`)."""
    extra = {} if context_fn is None else {"context_fn": context_fn}
    notes: list[str] = []
    if spec == "off":
        yield notes
        return
    named = dict(model.named_modules())
    paths = blocks(model) if spec == "auto" else _called(named, list(spec))
    runs = repeated_runs(model) if spec == "auto" and not paths else []
    missing = [p for p in paths if p not in named]
    if missing:
        top = ", ".join(list(named)[1:8])
        raise WhatIfError(
            f"No module {missing[0]!r} in the model, named by checkpoint: pass 'auto', 'off' "
            f"or paths from model.named_modules() (its modules: {top}, ...)."
        )
    if not paths and not runs:
        raise WhatIfError(
            "checkpoint='auto' found nothing to checkpoint (a ModuleList or Sequential of "
            "layers of one type or one base class of their own, or a Sequential whose layers "
            "repeat a pattern such as Linear, ReLU): name the modules to checkpoint instead, "
            "e.g. checkpoint=('encoder',)."
        )
    if spec == "auto":
        shown = paths[:2] + (["...", paths[-1]] if len(paths) > 3 else paths[2:])
        chosen = [f"{len(paths)} blocks ({', '.join(shown)})"] if paths else []
        notes.append("checkpoint='auto' chose " + "; ".join(chosen + [r.describe() for r in runs]))
    wrapped: list[tuple[nn.Module, Any]] = []  # each module with its own forward, or None
    caching = _caching_configs(model)
    ran: dict[str, int] = dict.fromkeys(paths, 0)
    try:
        for p in paths:
            module = named[p]
            wrapped.append((module, module.__dict__.get("forward")))
            module.forward = _checkpointing(module.forward, extra, ran, p)
        for r in runs:
            sequential = named[r.path]
            wrapped.append((sequential, sequential.__dict__.get("forward")))
            sequential.forward = _in_runs(sequential, r, extra)
        for config, _ in caching:
            config.use_cache = False
        if caching:
            notes.append("use_cache off while checkpointing, as Hugging Face does in training")
        yield notes
        idle = [p for p, n in ran.items() if not n]
        if idle and spec != "auto":  # named, but the model calls its layers, not it
            notes.append(
                f"checkpoint named {', '.join(map(repr, idle[:3]))}, whose forward the step "
                "never called (the model calls its layers directly): nothing was checkpointed "
                "there; name the modules the forward calls"
            )
    finally:
        for config, value in caching:  # each its own value back (True, or a truthy one)
            config.use_cache = value
        for module, own in reversed(wrapped):  # a forward set on the module itself (an
            if own is not None:  # accelerate hook, the user's) is put back; else the class's
                module.forward = own  # shows through again
            else:
                module.__dict__.pop("forward", None)


def _caching_configs(model: nn.Module) -> list[tuple[Any, Any]]:
    """The Hugging Face configs with ``use_cache`` on (True or 1), each with its value and
    once (a config several modules share), the model's and its modules' own (an
    encoder-decoder's decoder stack holds a copy of it: T5's; a multimodal model's language
    model its ``text_config``): a cache filled in the forward and read again in the
    recomputation would save different tensors."""
    found = {id(c): c for m in model.modules() if (c := getattr(m, "config", None)) is not None}
    on = [(c, getattr(c, "use_cache", None)) for c in found.values()]
    return [(c, value) for c, value in on if isinstance(value, int) and value]  # bool or 1


def _called(named: dict[str, nn.Module], paths: list[str]) -> list[str]:
    """The modules named, a container (ModuleList, ModuleDict: never called itself, its
    layers are) standing for each of its children."""
    found: list[str] = []
    for p in paths:
        module = named.get(p)
        if isinstance(module, (nn.ModuleList, nn.ModuleDict)):
            found += [f"{p}.{n}" if p else n for n, _ in module.named_children()]
        else:
            found.append(p)
    return found


def _checkpointing(
    original: Callable[..., Any], extra: dict[str, Any], ran: dict[str, int], path: str
) -> Callable[..., Any]:
    def forward(*args: Any, **kw: Any) -> Any:
        ran[path] += 1
        # the original is looked up at each call: the estimator's autocast emulation wraps it
        return torch.utils.checkpoint.checkpoint(
            original, *args, use_reentrant=False, **extra, **kw
        )

    return forward


def _in_runs(sequential: nn.Sequential, runs: Runs, extra: dict[str, Any]) -> Callable[[Any], Any]:
    layers = list(sequential)
    end = runs.start + runs.length * runs.count
    step = runs.length * runs.per_segment
    starts = list(range(runs.start, end, step))
    pieces = [(layers[: runs.start], False)]
    pieces += [(layers[i : min(i + step, end)], i != starts[-1]) for i in starts]
    pieces.append((layers[end:], False))

    def forward(x: Any) -> Any:
        for group, recompute in pieces:
            if recompute:
                x = torch.utils.checkpoint.checkpoint(
                    _chain, group, x, use_reentrant=False, **extra
                )
            else:
                x = _chain(group, x)
        return x

    return forward


def _chain(layers: list[nn.Module], x: Any) -> Any:
    for layer in layers:
        x = layer(x)
    return x
