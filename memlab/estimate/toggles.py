"""What a step's levers (`memlab.step.levers`) change in a prediction that the step on ``meta``
cannot show by itself: the allocator model (``expandable_segments``), and the notes that say
how each lever was modelled (or, for ``compile``, that it was not)."""

from __future__ import annotations

from memlab.estimate.allocator import CachingAllocator
from memlab.estimate.expandable import ExpandableAllocator
from memlab.estimate.gpus import GPU
from memlab.step.config import RunConfig


def allocator_for(config: RunConfig, card: GPU | None) -> CachingAllocator:
    """The allocator model the step's allocations are replayed through."""
    capacity = None if card is None else card.usable
    if config.expandable_segments:
        return ExpandableAllocator(capacity)
    return CachingAllocator(capacity)


def lever_notes(config: RunConfig) -> list[str]:
    """One line per lever the prediction models in its own way."""
    notes = []
    if config.expandable_segments:
        notes.append(
            "allocator modelled with expandable_segments:True (pages of 2 MiB and 20 MiB "
            "mapped as needed): reserved changes, allocated does not"
        )
    if config.compile:
        notes.append(
            "torch.compile is not modelled: inductor's fused kernels and what its partitioner "
            "saves for backward do not run on meta, so these are the eager step's figures, "
            "usually an upper bound of the compiled step's (it tends to keep fewer "
            "intermediates) but not a guaranteed one; measure it on the GPU "
            f"(RunConfig(compile={config.compile!r})) for its own figures"
        )
    return notes
