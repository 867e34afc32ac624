"""The panel shows the controls that apply to the step and hides the rest (memlab.panel.applies):
checked against RunConfig's own validation and against what each control changes."""

from __future__ import annotations

import itertools
from typing import Any

import torch
from torch import nn

import memlab
from memlab.panel.applies import NEUTRAL
from memlab.panel.levers import TOGGLES
from memlab.whatif import RunConfig, run

BASE = RunConfig(device="cpu", batch_size=8)
LEVERS = tuple(name for name, _, _ in TOGGLES)  # every lever, those added later too


def stack() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.GELU()) for _ in range(3)])


def inputs(batch: int) -> torch.Tensor:
    return torch.randn(batch, 64)


def explorer() -> memlab.Explorer:
    return memlab.Explorer(stack, inputs, config=BASE)


def shown(ex: memlab.Explorer, name: str) -> bool:
    return bool(getattr(ex, name).layout.display != "none")


def other(widget: Any) -> Any:
    """A value of ``widget`` other than its present one (a toggle flipped, a number raised)."""
    if hasattr(widget, "options"):
        return next(o for o in widget.options if o != widget.value)
    if isinstance(widget.value, bool):
        return not widget.value
    return widget.value * 2  # batch 8 splits into 2 micro-batches; 2 ranks; 32 new tokens


DRIVEN = {
    "mode": ("train", "no_grad", "inference_mode", "eval_with_grad", "generate"),
    "retention": ("off", "attached", "detached"),
    "checkpoint": ("off", "auto"),
    "optimizer": ("sgd", "sgd_momentum", "adam", "adamw"),
    "world_size": (1, 2),
    "offload": ("off", "activations", "optimizer", "both"),
    "accumulation": (1, 2),
    "amp": ("off", "fp16", "bf16"),
}


def set_all(ex: memlab.Explorer, values: dict[str, Any]) -> None:
    for name, value in values.items():
        getattr(ex, name).value = value


def test_whatever_is_shown_makes_a_valid_step() -> None:
    """Every combination of the controls, each lever ticked: what the panel shows never makes a
    configuration RunConfig refuses (an offload, a lever or ranks left over from another mode
    used to turn Run into an error)."""
    ex = explorer()
    for lever in LEVERS:
        getattr(ex, lever).value = True
    combos = list(itertools.product(*DRIVEN.values()))
    for combo in combos:
        values = dict(zip(DRIVEN, combo, strict=True))
        set_all(ex, values)
        c = ex.config  # RunConfig validates: a WhatIfError fails the test
        if values["mode"] != "train" or values["retention"] != "off":  # not a training step
            assert (c.world_size, str(c.offload), c.accumulation) == (1, "off", 1), values
            assert not c.optimizer_in_backward and c.optimizer_state_bits == 32, values
    assert len(combos) == 5760


def test_a_control_is_shown_exactly_when_it_changes_the_step() -> None:
    """For each control that may be hidden, in every mode and choice that decides it: changing
    its value changes the step (what the run is described as) if and only if the control is on
    show."""
    ex = explorer()
    grid = {k: DRIVEN[k] for k in ("mode", "retention", "checkpoint", "offload")}
    for combo in itertools.product(*grid.values(), ("adam", "sgd"), (1, 2)):
        set_all(ex, dict(zip((*grid, "optimizer", "world_size"), combo, strict=True)))
        for name in NEUTRAL:
            if name in ("world_size", "checkpoint", "retention", "optimizer", "offload"):
                continue  # drivers of this grid: their own visibility is checked below
            widget = getattr(ex, name)
            before, was = ex.config.describe(), widget.value
            widget.value = other(widget)
            try:
                changed = ex.config.describe() != before
            finally:
                widget.value = was
            assert changed == shown(ex, name), (name, combo, shown(ex, name))


def test_the_drivers_show_in_the_modes_they_apply_to() -> None:
    ex = explorer()
    for mode in DRIVEN["mode"]:
        ex.mode.value = mode
        train = mode == "train"
        assert shown(ex, "retention") == train and shown(ex, "offload") == train
        assert shown(ex, "world_size") == shown(ex, "optimizer") == train
        assert shown(ex, "new_tokens") == (mode == "generate")
        assert shown(ex, "checkpoint") == (mode in ("train", "eval_with_grad"))
        assert shown(ex, "expandable_segments")  # the allocator's setting: every mode
    ex.mode.value, ex.retention.value = "train", "attached"  # the experiment: no optimizer step
    assert not shown(ex, "optimizer") and not shown(ex, "world_size")
    assert shown(ex, "checkpoint")


def test_a_hidden_choice_runs_as_its_neutral_value() -> None:
    """Choices made for training, then mode no_grad: the run is the plain no_grad step, the
    same peak as `memlab.whatif.run` of that step, and says nothing of the hidden choices."""
    ex = explorer()
    ex.offload.value, ex.world_size.value, ex.accumulation.value = "optimizer", 4, 2
    ex.checkpoint.value, ex.checkpoint_saves.value = "auto", True
    ex.mode.value = "no_grad"
    got = ex.run()
    want = run(stack, inputs, None, BASE.with_(mode="no_grad"))
    assert got is not None and got.report is not None and want.report is not None
    assert got.config == BASE.with_(mode="no_grad")
    assert got.report.peak_allocated == want.report.peak_allocated
    assert ex.message == "ran no_grad, batch 8"
    ex.mode.value = "train"  # back to training: the choices are there again, and count
    c = ex.config
    assert (c.world_size, str(c.offload), c.accumulation, c.checkpoint_saves) == (
        4,
        "optimizer",
        2,
        "matmuls",
    )
