"""The levers of a step that change how it runs (RunConfig fields named after what they do),
applied for a run and taken away after it.

- ``expandable_segments``: the CUDA caching allocator's setting. It is read once, when CUDA
  starts (``PYTORCH_CUDA_ALLOC_CONF``), and memlab never changes the environment: a measured run
  says so in its notes; the estimator models it (`memlab.estimate.expandable`).
"""

from __future__ import annotations

import torch

from memlab.step.config import RunConfig


def lever_notes(config: RunConfig, device: torch.device) -> list[str]:
    """What a measured run on ``device`` says about the levers it cannot apply itself."""
    notes = []
    if config.expandable_segments and device.type != "meta":
        where = (
            "this run measures the allocator as PYTORCH_CUDA_ALLOC_CONF set it when CUDA started"
            if device.type == "cuda"
            else f"nothing changes on {device.type}"
        )
        notes.append(
            "expandable_segments changes the CUDA caching allocator's reserved memory: "
            f"{where}; simulate a GPU to predict it"
        )
    return notes
