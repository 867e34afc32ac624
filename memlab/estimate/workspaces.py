"""The cuBLAS workspaces a predicted step takes (one per handle, at the first product that
needs it, kept for the process's life), and the note that lists them."""

from __future__ import annotations

from memlab.core.categories import Category
from memlab.core.ledger import default_ledger
from memlab.estimate.gpus import GPU, HOPPER_WORKSPACE, LARGEST, grouped
from memlab.estimate.listener import AllocatorListener
from memlab.reports.report import Breakdown
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


def workspace_of(workspace: object, card: GPU | None) -> int:
    """The workspace an estimate takes: ``workspace`` (bytes) checked, or the card's own."""
    if workspace is None:
        return 0 if card is None else card.workspace
    if isinstance(workspace, bool) or not isinstance(workspace, int):
        raise TypeError(
            f"workspace takes the cuBLAS workspace in bytes (an int, 0 for none), not "
            f"{workspace!r:.60}: e.g. workspace={HOPPER_WORKSPACE}, or leave it out for the "
            "GPU's own."
        )
    if not 0 <= workspace <= (LARGEST if card is None else card.memory):
        raise ValueError(
            f"workspace got {grouped(workspace)}: pass 0 (no cuBLAS workspace) up to the GPU's "
            f"memory in bytes, e.g. workspace={HOPPER_WORKSPACE}, or leave it out for the GPU's "
            "own."
        )
    return workspace


def with_remainder(breakdown: Breakdown | None, peak: int, end: int) -> Breakdown | None:
    """The tensors' breakdown with what the allocator model holds beyond them (cuBLAS
    workspaces, rounding) as ``unattributed``, as a GPU's breakdown has it: its rows add up to
    the predicted allocated bytes."""
    if breakdown is None:
        return None
    at_peak, at_end = dict(breakdown.at_peak), dict(breakdown.at_end)
    for held, total in ((at_peak, peak), (at_end, end)):
        held.pop(Category.UNATTRIBUTED, None)  # (the remainder, made again)
        rest = total - sum(held.values())
        if rest > 0:  # (none where the model's rounding moved the moment of the peak)
            held[Category.UNATTRIBUTED] = rest
    return Breakdown(at_peak, at_end, breakdown.highest)
