"""Which of the panel's controls apply to the step the others describe: a control that does not
apply is hidden, and the configuration reads it as its neutral value, so that a choice made for
another mode (an offload, a lever, ranks) neither shows nor turns a run into an error.

- a training step (mode "train", keep outputs "off"): accumulation, the optimizer, offload,
  ranks (GPUs) and sharding, and the optimizer's levers;
- "keep outputs" (the retention experiment) is a train-mode experiment;
- checkpointing needs a forward with grad: not under no_grad, inference_mode or generate;
- "checkpoints keep matmuls" needs checkpointing on; "8-bit optimizer state" needs Adam or
  AdamW; "sharding" needs 2 ranks or more; "new tokens" needs generate;
- "torch.compile" measures one plain step: not with generate, the retention experiment,
  offload or ranks (compiled code escapes the tensor accounting those read);
- the optimizer's levers stay on the device: not with the optimizer offloaded to the host;
  "optimizer step in backward" steps each gradient as it comes: not with accumulation or fp16
  (the checks of `memlab.step.config`, as the panel's choices rather than an error after Run).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from memlab.step import Mode, Retention, WhatIfError

#: Each control that may not apply, and the value the configuration reads while it is hidden
#: (None: its own value, passed as it is: only the mode it belongs to reads it).
NEUTRAL: dict[str, Any] = {
    "new_tokens": None,
    "retention": str(Retention.OFF),
    "checkpoint": "off",
    "accumulation": 1,
    "optimizer": None,
    "offload": "off",
    "world_size": 1,
    "sharding": "none",  # read by the Explorer's config from world_size
    "optimizer_in_backward": False,
    "optimizer_state_bits": 32,
    "checkpoint_saves": "nothing",
    "compile": False,
}
#: The controls whose value changes which others apply.
DRIVERS = (
    "mode",
    "retention",
    "checkpoint",
    "optimizer",
    "world_size",
    "offload",
    "accumulation",
    "amp",
)
#: Modes whose forward runs without grad: nothing to checkpoint.
NO_GRAD = (Mode.NO_GRAD, Mode.INFERENCE_MODE, Mode.GENERATE)


def applying(self: Any) -> dict[str, bool]:
    """Whether each control in `NEUTRAL` applies, given the Explorer ``self``'s controls."""
    mode = self.mode.value
    train = mode == Mode.TRAIN
    training = train and self.retention.value == Retention.OFF
    checkpoint = mode not in NO_GRAD
    # the optimizer's levers, on the device: not when offload steps the optimizer on the host
    device_optimizer = training and self.offload.value not in ("optimizer", "both")
    one_pass = self.accumulation.value == 1 and self.amp.value != "fp16"
    # one plain step, to compile: not a generation, the experiment, offload or ranks
    spread = training and (self.offload.value != "off" or self.world_size.value > 1)
    plain = mode != Mode.GENERATE and training == train and not spread
    return {
        "new_tokens": mode == Mode.GENERATE,
        "retention": train,
        "checkpoint": checkpoint,
        "accumulation": training,
        "optimizer": training,
        "offload": training,
        "world_size": training,
        "sharding": training and self.world_size.value > 1,
        "optimizer_in_backward": device_optimizer and one_pass,
        "optimizer_state_bits": device_optimizer and self.optimizer.value in ("adam", "adamw"),
        "checkpoint_saves": checkpoint and self.checkpoint.value != "off",
        "compile": plain,
    }


def neutral(self: Any) -> dict[str, Any]:
    """The configuration's fields for the hidden controls: their neutral values, so that a run
    is the same step whatever a hidden control holds."""
    return {
        name: NEUTRAL[name]
        for name, applies in applying(self).items()
        if not applies and NEUTRAL[name] is not None and name != "sharding"
    }


def show_applicable(self: Any) -> None:
    """Shows the controls that apply, hides the rest."""
    for name, applies in applying(self).items():
        getattr(self, name).layout.display = "" if applies else "none"


def follow(self: Any) -> None:
    """Shows what applies now, and again whenever a control it depends on changes."""
    show_applicable(self)
    for name in DRIVERS:
        getattr(self, name).observe(lambda _: show_applicable(self), names="value")


def refuse_unshown(self: Any, given: Any) -> None:
    """A WhatIfError naming the settings of ``given`` the panel's controls cannot hold (its
    widgets closed first: the panel is not made)."""
    lost = unshown(self, given)
    if lost:
        close_all(self.widget)
        raise WhatIfError(
            f"Explorer's controls cannot hold {'; '.join(lost)}: measure that with "
            "memlab.whatif.run(..., config) or estimate, or leave it out of config."
        )


def close_all(widget: Any) -> None:
    """``widget`` and those inside it closed (ipywidgets keeps each until it is)."""
    for child in getattr(widget, "children", ()):
        close_all(child)
    widget.close()


def unshown(self: Any, given: Any) -> list[str]:
    """The settings of ``given`` (the RunConfig the panel was built with) that its controls
    cannot hold, each as "name=given (the panel shows shown)": a run would use other values
    without a word. Settings of hidden controls (they do not apply) aside."""
    shown = self.config
    hidden = {name for name, applies in applying(self).items() if not applies}
    return [
        f"{f.name}={getattr(given, f.name)!r} (the panel shows {getattr(shown, f.name)!r})"
        for f in dataclasses.fields(given)
        if f.name not in hidden and getattr(given, f.name) != getattr(shown, f.name)
    ]
