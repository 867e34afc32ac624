"""Autograd graphs: what they keep alive (and, with issue 3's drawing, what each node saved)."""

from typing import Any

from memlab.core.parts import part


def __getattr__(name: str) -> Any:  # (its modules, imported when first asked for)
    return part(__name__, __file__, name)
