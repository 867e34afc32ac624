"""The panel's lever toggles, one per RunConfig lever field (`memlab.step.levers`), in one box:
built onto the Explorer as attributes (``explorer.expandable_segments``), read back into the
configuration by `lever_values`."""

from __future__ import annotations

from typing import Any

import ipywidgets as w

from memlab.panel.limit import MUTED
from memlab.step import RunConfig

#: (RunConfig field, the toggle's label, its tooltip); a field that is not True or False has
#: its (on, off) values in `VALUES`.
TOGGLES = (
    (
        "expandable_segments",
        "expandable segments",
        "CUDA's allocator maps pages into one growing segment: changes reserved memory, "
        "not allocated (predicted when a GPU is simulated)",
    ),
    (
        "optimizer_in_backward",
        "optimizer step in backward",
        "each parameter is stepped as soon as its gradient is ready, and the gradient freed: "
        "no moment holds all the gradients",
    ),
    (
        "optimizer_state_bits",
        "8-bit optimizer state",
        "Adam's two states in bitsandbytes' 8-bit layout (a byte per element, a scale per 256): "
        "its bytes are modelled, not bitsandbytes itself, which needs CUDA",
    ),
    (
        "checkpoint_saves",
        "checkpoints keep matmuls",
        "selective checkpointing: checkpointed blocks keep their matrix products' outputs and "
        "recompute the rest (with checkpointing on; torch >= 2.4)",
    ),
    (
        "base_weights",
        "4-bit base weights (QLoRA)",
        "the frozen base Linear layers in bitsandbytes' NF4 layout with double quantization: "
        "their bytes are modelled, not bitsandbytes itself, which needs CUDA",
    ),
    (
        "compile",
        "torch.compile",
        "the model compiled by torch.compile (inductor) in warm-up steps, then measured by the "
        "allocator (no breakdown inside compiled code); a simulated GPU shows the eager step",
    ),
)
VALUES: dict[str, tuple[Any, Any]] = {
    "optimizer_state_bits": (8, 32),
    "checkpoint_saves": ("matmuls", "nothing"),
    "base_weights": ("nf4_double", "as_built"),
}


def build_levers(self: Any, c: RunConfig) -> w.VBox:
    """The toggles, as attributes of the Explorer ``self``; returns their box: headed "levers"
    where the other controls have their labels, the boxes in line with their fields."""
    style = {"description_width": "110px"}
    boxes = []
    for name, label, tip in TOGGLES:
        on, _ = VALUES.get(name, (True, False))
        box = w.Checkbox(
            value=getattr(c, name) == on,
            description=label,
            style=style,
            layout=w.Layout(width="auto"),  # the whole label, however long
        )
        box.tooltip = tip
        setattr(self, name, box)
        boxes.append(box)
    hint = f'<span style="{MUTED}">hover one for what it changes</span>'
    return w.VBox([w.HTML(hint, description="levers", style=style), *boxes])


def lever_values(self: Any) -> dict[str, Any]:
    """The RunConfig fields the toggles set."""
    return {
        name: VALUES.get(name, (True, False))[0 if getattr(self, name).value else 1]
        for name, _, _ in TOGGLES
    }


def lever_controls(self: Any) -> list[Any]:
    """The toggles, disabled while work runs."""
    return [getattr(self, name) for name, _, _ in TOGGLES]
