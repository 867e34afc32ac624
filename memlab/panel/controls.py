"""The panel's controls: built onto the Explorer, so that programs and tests reach each widget
as an attribute (``explorer.batch_size``, ``explorer.run_button``)."""

from __future__ import annotations

import math
from typing import Any

import ipywidgets as w
from traitlets import TraitError, validate

from memlab.estimate.gpus import GPUS
from memlab.panel.applies import follow
from memlab.panel.levers import build_levers, lever_controls
from memlab.panel.limit import mib
from memlab.panel.search import MAX_BATCH
from memlab.step import Amp, Mode, Offload, Optimizer, Retention, RunConfig, Sharding

#: The "simulate a GPU" choice that measures on this machine instead.
HERE = "no: measure here"
#: The "simulate a GPU" choice of a card of any size (the "custom GPU (GiB)" field).
CUSTOM = "custom size"


class NumberField(w.BoundedFloatText):  # type: ignore[misc]
    """A number field that refuses NaN, naming itself and what it takes (its bounds clamp every
    other number; NaN compares with neither, would pass them and break the panel's sums)."""

    @validate("value")
    def _validate_value(self, proposal: Any) -> Any:
        __tracebackhide__ = True
        value = proposal["value"]
        if math.isnan(value):
            low, high = (
                f"{x:,.0f}" if float(x).is_integer() else f"{x:,}" for x in (self.min, self.max)
            )
            raise TraitError(f"{self.description} got nan: type a number from {low} to {high}.")
        return super()._validate_value(proposal)


def build_controls(self: Any, c: RunConfig) -> w.VBox:
    """Creates the controls as attributes of the Explorer ``self``; returns the panel's box."""
    style = {"description_width": "110px"}
    # buttons as wide as their longest label, so each row's choices fit on its one line
    toggles = {**style, "button_width": "84px"}
    self.amp = w.ToggleButtons(
        options=Amp.values(), value=str(c.amp), description="AMP", style=toggles
    )
    self.checkpoint = w.ToggleButtons(
        options=("off", "auto"),
        value=c.checkpoint if isinstance(c.checkpoint, str) else "off",
        description="checkpointing",
        style=toggles,
    )
    self.mode = w.Dropdown(
        options=Mode.values(), value=str(c.mode), description="mode", style=style
    )
    self.new_tokens = w.BoundedIntText(
        value=c.new_tokens, min=1, max=1_000_000, description="new tokens", style=style
    )
    self.retention = w.ToggleButtons(
        options=Retention.values(),
        value=str(c.retention),
        description="keep outputs",
        style=toggles,
    )
    for row in (self.amp, self.checkpoint, self.retention):
        # laid out as the fields are (ipywidgets 8 puts a ToggleButtons' label above its
        # buttons): the label right-aligned in its 110 px, the buttons on the same line
        row.add_class("widget-inline-hbox")
        row.layout.width, row.layout.margin = "auto", "3px 2px"
    self.batch_size = w.BoundedIntText(
        value=c.batch_size, min=1, max=MAX_BATCH, description="batch size", style=style
    )
    self.accumulation = w.BoundedIntText(
        value=c.accumulation, min=1, max=1024, description="accumulation", style=style
    )
    self.optimizer = w.Dropdown(
        options=Optimizer.values(), value=str(c.optimizer), description="optimizer", style=style
    )
    self.offload = w.Dropdown(  # what a training step keeps in host memory (CPU RAM)
        options=Offload.values(), value=str(c.offload), description="offload", style=style
    )
    self.budget = NumberField(
        value=mib(c.budget), min=0, max=1e9, step=1, description="budget (MiB)", style=style
    )
    self.simulate = w.Dropdown(
        options=(HERE, *GPUS, CUSTOM), value=HERE, description="simulate a GPU", style=style
    )
    self.custom_gib = NumberField(
        value=16, min=1, max=4096, description="custom GPU (GiB)", style=style
    )
    self.custom_gib.layout.display = "none"  # shown when "custom size" is chosen

    def show_custom(change: dict[str, Any]) -> None:
        self.custom_gib.layout.display = "" if change["new"] == CUSTOM else "none"

    self.simulate.observe(show_custom, names="value")
    self.simulate.observe(lambda _: self._follow_gpu(), names="value")
    self.custom_gib.observe(lambda _: self._follow_gpu(), names="value")
    self.budget.observe(self._budget_typed, names="value")
    # data parallelism: ranks, and how they share the model (shown from 2 ranks); a run's
    # per-rank figures are its step divided by the sharding's rule (memlab.step.ranks)
    self.world_size = w.BoundedIntText(
        value=c.world_size, min=1, max=65536, description="ranks (GPUs)", style=style
    )
    self.sharding = w.Dropdown(
        options=Sharding.values()[1:],  # "none" is one rank
        value=str(c.sharding) if c.world_size > 1 else str(Sharding.DDP),
        description="sharding",
        style=style,
    )
    self.limit = w.HTML()
    self.limit.add_class("memlab-limit")
    fit = w.Layout(width="auto")  # buttons as wide as their labels
    self.run_button = w.Button(description="Run", button_style="primary", icon="play", layout=fit)
    self.fit_button = w.Button(description="Largest batch that fits", icon="search", layout=fit)
    self.clear_button = w.Button(description="Clear", icon="trash", layout=fit)
    self.cancel_button = w.Button(
        description="Cancel", icon="stop", button_style="warning", layout=w.Layout(width="auto")
    )
    self.cancel_button.layout.display = "none"  # shown while work runs
    self.run_button.on_click(lambda _: self._work.start("running", self.run))
    self.fit_button.on_click(
        lambda _: self._work.start("searching the largest batch", self.largest_batch)
    )
    self.clear_button.on_click(lambda _: self.clear())
    self.status = w.HTML()
    self.status.add_class("memlab-status")  # the line that says what happened
    self.table = w.HTML()
    self.chart = w.Image(
        format="png", layout=w.Layout(display="none", max_width="100%")
    )  # shown when drawn
    self.timeline = w.Image(format="png", layout=w.Layout(display="none", max_width="100%"))
    # mode first: it decides which of the others apply (memlab.panel.applies hides the rest)
    column = w.Layout(margin="0 16px 0 0")
    top = w.HBox(
        [
            w.VBox(
                [
                    self.mode,
                    self.new_tokens,
                    self.retention,
                    self.amp,
                    self.checkpoint,
                    build_levers(self, c),
                ],
                layout=column,
            ),
            w.VBox(
                [
                    self.batch_size,
                    self.accumulation,
                    self.optimizer,
                    self.offload,
                    self.world_size,
                    self.sharding,
                    self.budget,
                    self.simulate,
                    self.custom_gib,
                    self.limit,
                ],
                layout=column,
            ),
        ],
        layout=w.Layout(flex_flow="row wrap"),  # one column under the other where they do not fit
    )
    self.limit.layout.width = "300px"  # as wide as the fields above it: wraps, never widens
    follow(self)  # the controls that apply to the step shown, the rest hidden
    return w.VBox(
        [
            top,
            w.HBox([self.run_button, self.fit_button, self.clear_button, self.cancel_button]),
            self.status,
            self.table,
            # side by side where they fit, one under the other where they do not
            w.Box([self.chart, self.timeline], layout=w.Layout(flex_flow="row wrap")),
        ]
    )


def controls(self: Any) -> list[Any]:
    """The widgets disabled while work runs."""
    return [
        self.run_button,
        self.fit_button,
        self.clear_button,
        self.amp,
        self.checkpoint,
        self.mode,
        self.new_tokens,
        self.retention,
        self.batch_size,
        self.accumulation,
        self.optimizer,
        self.offload,
        self.budget,
        self.simulate,
        self.custom_gib,
        self.world_size,
        self.sharding,
        *lever_controls(self),
    ]
