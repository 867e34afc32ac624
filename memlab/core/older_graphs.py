"""What the graphs built before a region hold saved for backward.

A model's output kept in a variable keeps its autograd graph alive, and with it every tensor
the graph saved: activations. A graph built inside a region with a breakdown is followed by
memlab's saved-tensor hooks: the ledger counts each storage saved until backward lets it go.
One built elsewhere (a cell without ``-b``, code before memlab was loaded) is found here, at a
breakdown's look at the namespace: the graph behind a tensor is walked once, reading what each
node saved without running a program's unpack hook (a checkpointed forward would be computed
again, an offloaded activation copied back), and the ledger counts its saved storages as saved
while a token of the walk lives (`memlab.core.ledger.Ledger.saved_by`). The token goes when
the output dies, when a later look finds the graph released by backward, or when it finds
another graph behind the output (an in-place op): then the new one is walked.

A later look costs one check per graph: the root is of the same node type, and the first node
found holding a tensor still holds the same storage (backward releases it). Reading what a node
saved without its hooks needs PyTorch 2.11 or later; before, nothing is read, and such a
graph's storages stay "other", as they were.
"""

from __future__ import annotations

import contextlib
import os
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.weak import WeakIdKeyDictionary

from memlab.core._torch_autograd import (
    HOOKED,
    raw_saved_readable,
    saved_hook,
    saved_names,
    saved_value,
)
from memlab.core.storages import storage_of

if TYPE_CHECKING:
    from memlab.core.ledger import Ledger

#: The most autograd nodes one walk reads, and the most one look starts walks for (a list of
#: losses kept with their graphs: one walk each); the report's notes say when either stopped.
MAX_NODES = 20_000


def unpack(t: torch.Tensor) -> torch.Tensor:
    """memlab's regions' unpack hook in Python: what they pack is the tensor's alias."""
    return t


#: memlab's own unpack hooks (the one in C joins once built): a graph whose first saved
#: tensor has one was built under them, and the ledger follows it already.
OWN_UNPACK: list[Any] = [unpack]


class _Token:
    """Lives as long as one walk's saved storages count as saved (the ledger's weak
    reference to it ends the saving)."""

    __slots__ = ("__weakref__",)


class _Walk:
    """What one output's graph saved, as found when it was walked."""

    __slots__ = ("cut", "path", "probe", "root", "storages", "token")

    def __init__(self, root: type) -> None:
        self.root = root  # the type of the output's grad_fn then (an in-place op changes it)
        #: next_functions indices from the root to the first node found holding a tensor, and
        #: that node's attribute and storage (None: nothing saved, or released)
        self.path: tuple[int, ...] | None = None
        self.probe: tuple[str, weakref.ref[Any]] | None = None
        self.token: _Token | None = _Token()
        self.storages: list[weakref.ref[Any]] = []  # those the ledger counts as saved
        self.cut = False  # stopped at MAX_NODES


_WALKS: WeakIdKeyDictionary = WeakIdKeyDictionary()


def _released(e: BaseException) -> bool:
    """Whether ``e`` is autograd's "backward through the graph a second time" (released)."""
    return isinstance(e, RuntimeError) and (
        "a second time" in str(e) or "already been freed" in str(e)
    )


def _saved(node: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """(attribute, tensor) for each tensor ``node`` holds saved, never through a hook; raises
    RuntimeError where backward released them. An attribute that cannot be read otherwise is
    passed over."""
    for name in saved_names(node):
        try:
            value = saved_value(node, name, strict=True)
        except RuntimeError as e:
            if _released(e):
                raise
            continue
        for t in value if isinstance(value, (tuple, list)) else (value,):
            if t is not HOOKED and isinstance(t, torch.Tensor):
                yield name, t


def _own(node: Any, name: str) -> bool:
    hook = saved_hook(node, name)
    return hook is not None and any(hook is own for own in OWN_UNPACK)


def _walk(root: Any) -> tuple[_Walk, list[torch.Tensor], int]:
    """Walks ``root``'s graph: each node once, a released node's inputs not followed (backward
    ran through them too). Returns the walk, the saved tensors (none for a graph built under
    memlab's own hooks, as its first node holding a tensor says) and the nodes read."""
    walk = _Walk(type(root))
    found: list[torch.Tensor] = []
    held: dict[int, Any] = {}  # each node once, alive until the walk ends (ids stay unique)
    stack: list[tuple[Any, tuple[int, ...]]] = [(root, ())]
    while stack:
        node, path = stack.pop()
        if id(node) in held:
            continue
        held[id(node)] = node
        if len(held) > MAX_NODES:
            walk.cut = True
            break
        try:
            saved = [(n, t, s) for n, t in _saved(node) if (s := storage_of(t)) is not None]
        except RuntimeError:  # "backward through the graph a second time": released
            continue
        if saved and walk.path is None:
            name, _, storage = saved[0]
            walk.path, walk.probe = path, (name, weakref.ref(storage))
            if _own(node, name):
                return walk, [], len(held)
        found.extend(t for _, t, _ in saved)
        nexts = getattr(node, "next_functions", ())
        if walk.path is None:  # the way to the first node holding a tensor, kept for it alone
            stack.extend((f, (*path, i)) for i, (f, _) in enumerate(nexts) if f is not None)
        else:
            stack.extend((f, ()) for f, _ in nexts if f is not None)
    return walk, found, len(held)


def _still(walk: _Walk, root: Any) -> bool | None:
    """Whether ``walk`` still holds for the graph at ``root``: True where it does, False where
    backward released it, None where it must be walked again (another graph now)."""
    if type(root) is not walk.root:
        return None
    if walk.path is None or walk.probe is None:
        return True  # nothing saved was found: nothing to check
    node: Any = root
    try:
        for i in walk.path:
            node = node.next_functions[i][0]
        name, ref = walk.probe
        value = saved_value(node, name, strict=True)
    except Exception as e:  # released, or (an index gone) another graph
        return False if _released(e) else None
    values = value if isinstance(value, (tuple, list)) else (value,)
    storage = ref()
    if storage is None or not any(
        isinstance(t, torch.Tensor) and storage_of(t) is storage for t in values
    ):
        return None
    return True


def saved_by_older_graphs(outputs: list[torch.Tensor], ledger: Ledger) -> list[str]:
    """Tells ``ledger`` what the graphs behind ``outputs`` hold saved (each graph walked once,
    then checked at each call). Returns notes for the report: a walk cut at MAX_NODES, graphs
    left for the next look, graphs that could not be read."""
    if not raw_saved_readable():
        return []  # (before 2.11 nothing can be read without running a hook)
    cut = False
    read = left = failed = 0
    with _LOCK:
        for out in outputs:
            if read >= MAX_NODES and out not in _WALKS:
                left += 1
                continue
            try:
                walk, nodes = _look(out, ledger)
            except Exception:  # a subclass or node that raises when read: its storages "other"
                failed += 1
                continue
            read += nodes
            cut = cut or (walk is not None and walk.cut)
    notes = []
    if cut:
        notes.append(
            f"activations of a graph from before the region: its first {MAX_NODES:,} "
            "autograd nodes read"
        )
    if left:
        notes.append(
            f"activations of {left} graph(s) from before the region not read yet (at most "
            f"{MAX_NODES:,} autograd nodes are read at each look: the next regions read on)"
        )
    if failed:
        notes.append(f"what {failed} graph(s) from before the region saved: not read")
    return notes


def storages_saved_by(outputs: list[torch.Tensor]) -> list[Any]:
    """The storages the walks of ``outputs``' graphs found saved, still alive (after
    `saved_by_older_graphs`; a graph backward released counts no more)."""
    found: list[Any] = []
    with _LOCK:
        for out in outputs:
            walk = _WALKS.get(out)
            if walk is not None and walk.token is not None:
                found.extend(s for s in (r() for r in walk.storages) if s is not None)
    return found


def _look(out: torch.Tensor, ledger: Ledger) -> tuple[_Walk | None, int]:
    """One output's graph: checked against its walk, else walked; the walk and the nodes read."""
    root = out.grad_fn
    if root is None:
        return None, 0
    walk = _WALKS.get(out)
    if walk is not None:
        state = _still(walk, root)
        if state is not None:
            if not state:  # released by backward: what it saved counts no more
                _forget(walk)
            return walk, 0
    walk, found, nodes = _walk(root)
    for t in found:  # counted saved before the walk it replaces lets go of them
        ledger.saved_by(t, walk.token)  # type: ignore[arg-type]
        walk.storages.append(weakref.ref(storage_of(t)))
    _WALKS[out] = walk  # (the walk it replaces, and its token, go: its storages counted no more)
    return walk, nodes


#: Told each storage of a graph found released while a region is open (the native record logs
#: it then: `memlab.core.native.region`).
LISTENERS: list[Callable[[Any], None]] = []
_LOCK = threading.RLock()


def released() -> None:
    """At a region's end: each walked graph that backward released since counts no more (one
    that is another graph now, after an in-place op, is walked again at the next look). Never
    raises but KeyboardInterrupt."""
    with _LOCK:
        for ref, walk in list(_WALKS.data.items()):
            out = ref()
            if out is None or walk.token is None:
                continue
            try:
                if _still(walk, out.grad_fn) is False:
                    _forget(walk)
            except Exception:  # a subclass whose grad_fn raises: left for the next look
                continue


def _forget(walk: _Walk) -> None:
    """What ``walk`` found counts no more (its token goes: the ledger hears it at its next
    settling; the listeners now); nothing is left to check."""
    storages = [s for s in (r() for r in walk.storages) if s is not None]
    walk.token = None
    walk.storages = []
    walk.path = walk.probe = None
    for listener in list(LISTENERS):
        for storage in storages:
            with contextlib.suppress(Exception):
                listener(storage)


def _after_fork() -> None:
    """The child's ledger starts empty (`memlab.core.fork`): its graphs are walked again, for
    it; no lock another thread held at the fork stays held."""
    global _LOCK, _WALKS
    _LOCK = threading.RLock()
    _WALKS = WeakIdKeyDictionary()
    LISTENERS.clear()


if hasattr(os, "register_at_fork"):  # (POSIX)
    os.register_at_fork(after_in_child=_after_fork)
