"""``RunConfig(base_weights="int8" | "nf4" | "nf4_double")``: the frozen base Linear layers of a
model replaced, for one run, by `QuantizedLinear` layers holding bitsandbytes' storage bytes, and
put back after it.

Which layers: in a training step, the ``nn.Linear`` layers whose weight is frozen (the base of a
LoRA model: peft's adapters stay as they are); in a forward or a generation, every
``nn.Linear`` when none is frozen. The output embedding (Hugging Face's
``get_output_embeddings()``, the ``lm_head``) is left alone, as transformers leaves it when it
quantizes with bitsandbytes; so is a layer whose weight another module shares.

On ``meta`` (the estimator) the original weights are dropped while the run lasts, as a GPU
loading a quantized model never holds them; they are made again (meta holds no values) when
the run ends. On a real device the originals are kept, to be put back: they stay in memory
beside the quantized copies, and the run's notes say so.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch import nn

from memlab.reports.units import fmt_bytes
from memlab.step.config import RunConfig, WhatIfError
from memlab.step.quantized import QuantizedLinear, linear_map, shared_bytes, weight_bytes

LABELS = {
    "int8": "LLM.int8 (int8 weights, a float32 scale per row)",
    "nf4": "NF4 (4-bit codes, a float32 absmax per 64)",
    "nf4_double": "NF4 with double quantization (4-bit codes, 8-bit absmax per 64, "
    "a float32 scale per 256 blocks)",
}


@dataclass
class Swapped:
    """What one run replaced: (parent, attribute, original layer) and the notes to show."""

    layers: list[tuple[nn.Module, str, nn.Linear]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def targets(model: nn.Module, training: bool) -> list[tuple[nn.Module, str, nn.Linear]]:
    """The Linear layers ``base_weights`` quantizes, with their parents and attribute names."""
    skip: set[int] = set()
    out_emb = getattr(model, "get_output_embeddings", None)
    if callable(out_emb):
        try:
            head = out_emb()
        except (AttributeError, NotImplementedError):
            head = None
        if isinstance(head, nn.Module):
            skip.add(id(head))
    owners: dict[int, int] = {}
    for m in model.modules():
        for p in m.parameters(recurse=False):
            owners[id(p)] = owners.get(id(p), 0) + 1
    found = []
    for parent in model.modules():
        for name, child in parent.named_children():
            if type(child) is nn.Linear and id(child) not in skip and owners[id(child.weight)] == 1:
                found.append((parent, name, child))
    frozen = [t for t in found if not t[2].weight.requires_grad]
    return frozen if frozen or training else found


@contextlib.contextmanager
def quantized_base(model: nn.Module, config: RunConfig) -> Iterator[Swapped]:
    """``model`` with its base Linear layers quantized as ``config.base_weights`` says, for the
    block; put back as they were after it, also when the run fails."""
    swapped = Swapped()
    kind = str(config.base_weights)
    if kind == "as_built":
        yield swapped
        return
    found = targets(model, config.training)
    if not found:
        raise WhatIfError(
            f"base_weights={kind!r} quantizes the frozen base Linear layers, and this model has "
            "none to quantize: freeze the base (e.g. a peft LoRA model), or pass "
            "base_weights='as_built'."
        )
    device = found[0][2].weight.device
    meta = device.type == "meta"
    dynamic = None
    if kind == "nf4_double":
        dynamic = nn.Parameter(linear_map(device), requires_grad=False)
    dropped: list[tuple[nn.Linear, torch.Size, torch.dtype, bool]] = []
    before = 0
    try:
        for parent, name, linear in found:
            w = linear.weight
            before += w.numel() * w.element_size()
            with torch.no_grad():
                setattr(parent, name, QuantizedLinear(linear, kind, dynamic))
            swapped.layers.append((parent, name, linear))
            if meta:  # the original's storage goes, as it never reaches a GPU
                dropped.append((linear, w.shape, w.dtype, w.requires_grad))
                del linear._parameters["weight"]
                linear.register_parameter("weight", None)
            del w
        after = sum(weight_bytes(kind, lin.out_features, lin.in_features) for *_, lin in found)
        after += shared_bytes(kind)
        swapped.notes.append(
            f"base weights {kind}: {len(found)} frozen Linear layers stored in bitsandbytes' "
            f"{LABELS[kind]} layout, {fmt_bytes(after)} instead of {fmt_bytes(before)}; the "
            "bytes are modelled in torch (bitsandbytes needs a GPU), each forward dequantizes "
            "to the compute dtype"
            + ("" if meta else "; the original weights are kept aside to restore the model")
        )
        yield swapped
    finally:
        for linear, shape, dtype, grad in dropped:
            empty = torch.empty(shape, dtype=dtype, device=device)
            linear.weight = nn.Parameter(empty, requires_grad=grad)
        for parent, name, linear in reversed(swapped.layers):
            setattr(parent, name, linear)
