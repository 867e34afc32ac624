"""The cuBLAS workspaces a predicted step takes (one per handle, at the first product that
needs it, kept for the process's life), and the note that lists them."""

from __future__ import annotations

from memlab.core.ledger import default_ledger
from memlab.estimate.listener import AllocatorListener
from memlab.reports.units import fmt_bytes


class Workspaces:
    """The cuBLAS workspaces a step takes, each once, kept for the process's life."""

    def __init__(self, listener: AllocatorListener, size: int, lt_size: int) -> None:
        self.listener, self.size, self.lt_size = listener, size, lt_size
        self.taken: list[tuple[str, int]] = []

    def take(self, key: str) -> None:
        size = self.lt_size if key.endswith(" lt") else self.size
        if size:
            default_ledger().settle()  # the frees before it first, as on a GPU
            self.listener.malloc(-1 - len(self.taken), size)
            self.taken.append((key, size))


def workspace_note(workspaces: tuple[tuple[str, int], ...]) -> str:
    """ "includes cuBLAS workspaces: 32 MiB (forward), 1 MiB (cuBLASLt), 32 MiB (backward)"."""
    if not workspaces:
        return ""
    parts = [
        f"{fmt_bytes(size)} ({'cuBLASLt' if key.endswith(' lt') else key})"
        for key, size in workspaces
    ]
    return f"includes cuBLAS workspaces: {', '.join(parts)}"
