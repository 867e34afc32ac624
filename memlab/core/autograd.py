"""Walking autograd graphs: iteratively (deep graphs would overflow recursion), each node once."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any


def iter_nodes(roots: Iterable[Any]) -> Iterator[Any]:
    """Every node reachable from ``roots`` (``grad_fn`` objects; ``None`` is skipped), once.

    The nodes are held until the walk ends, so that no ``id`` is reused while it runs."""
    seen: dict[int, Any] = {}
    stack = [r for r in roots if r is not None]
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen[id(node)] = node
        yield node
        stack.extend(f for f, _ in getattr(node, "next_functions", ()) if f is not None)
