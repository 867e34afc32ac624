"""The what-if panel: controls over the runner, a table and charts that compare the runs.

``Explorer(model_fn, input_fn, loss_fn)`` shows itself in a notebook. ``explorer.run()`` and
``explorer.largest_batch()`` are what the buttons call, so programs and tests drive the same path;
``explorer.results`` holds every run.
"""

from __future__ import annotations

from collections.abc import Callable
from html import escape
from typing import Any, TypeVar

import ipywidgets as w

from memlab.core import cuda
from memlab.estimate import estimate
from memlab.estimate.gpus import GPU, GPUS
from memlab.estimate.gpus import gpu as find_gpu
from memlab.panel.search import MAX_BATCH, largest_batch
from memlab.panel.views import bars, png, runs_table
from memlab.reports.units import fmt_bytes
from memlab.step import Amp, Mode, Optimizer, Retention, RunConfig, RunResult, WhatIfError, run
from memlab.step.model import resolve_device
from memlab.step.user import InputFn, LossFn, ModelFn, StepFn

T = TypeVar("T")
MiB = 1024**2
#: The "simulate a GPU" choice that measures on this machine instead.
HERE = "no: measure here"
#: The "simulate a GPU" choice of a card of any size (the "custom GPU (GiB)" field).
CUSTOM = "custom size"


class Explorer:
    """The what-if panel: change AMP, checkpointing, no_grad, the batch size, accumulation and
    the optimizer, press Run, and compare what each step peaks at and what it is made of;
    "Largest batch that fits" searches the batch size under a budget; "simulate a GPU" predicts
    for a GPU you do not have (`memlab.estimate`) instead of measuring here.

    model_fn(): builds the model on the device to measure (a new one each run keeps runs apart).
    input_fn(batch_size): one batch: a tensor, a tuple of arguments, or a dict of keyword
        arguments (a Hugging Face batch).
    loss_fn(output) or step_fn(model, batch): the loss, as for `memlab.whatif.run` (step_fn for
        a loss that needs targets: your own forward and loss).
    config: the controls' starting values (`memlab.whatif.RunConfig`).

    >>> def batch(n):
    ...     x = torch.randn(n, 512, device="cuda")
    ...     return x, torch.randint(0, 10, (n,), device="cuda")
    >>> memlab.Explorer(lambda: Net().to("cuda"), batch,
    ...                 step_fn=lambda model, b: F.cross_entropy(model(b[0]), b[1]))
    """

    def __init__(
        self,
        model_fn: ModelFn,
        input_fn: InputFn,
        loss_fn: LossFn | None = None,
        *,
        step_fn: StepFn | None = None,
        config: RunConfig | None = None,
    ) -> None:
        self.model_fn, self.input_fn, self.loss_fn = model_fn, input_fn, loss_fn
        self.step_fn = step_fn
        self.results: list[RunResult] = []
        c = config or RunConfig()
        self._base = c
        style = {"description_width": "110px"}
        self.amp = w.ToggleButtons(
            options=Amp.values(), value=str(c.amp), description="AMP", style=style
        )
        self.checkpoint = w.ToggleButtons(
            options=("off", "auto"),
            value=c.checkpoint if isinstance(c.checkpoint, str) else "off",
            description="checkpointing",
            style=style,
        )
        self.mode = w.ToggleButtons(
            options=Mode.values(), value=str(c.mode), description="mode", style=style
        )
        self.retention = w.ToggleButtons(
            options=Retention.values(),
            value=str(c.retention),
            description="keep outputs",
            style=style,
        )
        self.batch_size = w.BoundedIntText(
            value=c.batch_size, min=1, max=MAX_BATCH, description="batch size", style=style
        )
        self.accumulation = w.BoundedIntText(
            value=c.accumulation, min=1, max=1024, description="accumulation", style=style
        )
        self.optimizer = w.Dropdown(
            options=Optimizer.values(), value=str(c.optimizer), description="optimizer", style=style
        )
        self.budget = w.BoundedFloatText(
            value=(c.budget or 0) / MiB, min=0, max=1e9, description="budget (MiB)", style=style
        )
        self.simulate = w.Dropdown(
            options=(HERE, *GPUS, CUSTOM), value=HERE, description="simulate a GPU", style=style
        )
        self.custom_gib = w.BoundedFloatText(
            value=16, min=1, max=4096, description="custom GPU (GiB)", style=style
        )
        self.custom_gib.layout.display = "none"  # shown when "custom size" is chosen

        def show_custom(change: dict[str, Any]) -> None:
            self.custom_gib.layout.display = "" if change["new"] == CUSTOM else "none"

        self.simulate.observe(show_custom, names="value")
        fit = w.Layout(width="auto")  # buttons as wide as their labels
        self.run_button = w.Button(
            description="Run", button_style="primary", icon="play", layout=fit
        )
        self.fit_button = w.Button(description="Largest batch that fits", icon="search", layout=fit)
        self.clear_button = w.Button(description="Clear", icon="trash", layout=fit)
        self.run_button.on_click(lambda _: self.run())
        self.fit_button.on_click(lambda _: self.largest_batch())
        self.clear_button.on_click(lambda _: self.clear())
        self.status = w.HTML()
        self.table = w.HTML()
        self.chart = w.Image(format="png")
        self.timeline = w.Image(format="png")
        self.widget = w.VBox(
            [
                w.HBox(
                    [
                        w.VBox([self.amp, self.checkpoint, self.mode, self.retention]),
                        w.VBox(
                            [
                                self.batch_size,
                                self.accumulation,
                                self.optimizer,
                                self.budget,
                                self.simulate,
                                self.custom_gib,
                            ]
                        ),
                    ]
                ),
                w.HBox([self.run_button, self.fit_button, self.clear_button]),
                self.status,
                self.table,
                w.HBox([self.chart, self.timeline]),
            ]
        )

    # -- what the buttons do ----------------------------------------------------------------------
    @property
    def config(self) -> RunConfig:
        """The configuration the controls describe (raises WhatIfError if it is not valid)."""
        budget = int(self.budget.value * MiB) or None
        return self._base.with_(
            amp=self.amp.value,
            checkpoint=self.checkpoint.value,
            mode=self.mode.value,
            retention=self.retention.value,
            batch_size=int(self.batch_size.value),
            accumulation=int(self.accumulation.value),
            optimizer=self.optimizer.value,
            budget=budget,
        )

    def run(self) -> RunResult | None:
        """Run the current configuration (or predict it for the GPU chosen under "simulate a
        GPU"), add it to the comparison, and redraw."""
        result = self._attempt(lambda: self._step(self.config))
        if result is not None:
            self.results.append(result)
            done = f"ran {result.config.describe()}"
            if result.predicted_for:
                done = f"predicted {result.config.describe()} on {result.predicted_for}"
            self._say(result.error or done, bool(result.oom))
            self._redraw()
        return result

    @property
    def card(self) -> GPU | None:
        """The GPU chosen under "simulate a GPU" (None: measure on this machine)."""
        if self.simulate.value == HERE:
            return None
        if self.simulate.value == CUSTOM:  # a card of that size, with Hopper's workspace
            card = find_gpu(int(self.custom_gib.value * 1024**3))
            assert card is not None
            return card
        return GPUS[self.simulate.value]

    def _step(self, config: RunConfig) -> RunResult:
        card = self.card
        if card is None:
            return run(self.model_fn, self.input_fn, self.loss_fn, config, step_fn=self.step_fn)
        e = estimate(
            self.model_fn, self.input_fn, self.loss_fn, config, step_fn=self.step_fn, gpu=card
        )
        budget = config.budget or card.usable
        fits = e.fits(budget)
        error = None
        if not fits:
            error = (
                f"predicted not to fit on {card.name}: {e.notes[0]}"
                if e.oom
                else f"predicted peak reserved {fmt_bytes(e.peak_reserved)} exceeds "
                f"{fmt_bytes(budget)}"
            )
        return RunResult(config, e.report, oom=not fits, error=error, predicted_for=card.name)

    def largest_batch(self) -> int | None:
        """The largest batch size whose step fits the budget (or the GPU's free memory), found by
        doubling and then halving the interval; out-of-memory runs are expected along the way."""
        config = self._attempt(lambda: self.config)
        if config is None:
            return None
        card = self.card
        if config.budget is None and card is not None:
            config = config.with_(budget=card.usable)
        if config.budget is None:
            chosen = config  # narrowed to RunConfig, and never reassigned
            found = self._attempt(lambda: (_device_limit(chosen),))
            if found is None:  # the device was bad: the status says why
                return None
            if found[0] is None:
                self._say("set a budget (MiB) first: the search needs a limit to fit under", True)
                return None
            config = config.with_(budget=found[0])
        step = config.accumulation

        def fits(batch: int) -> bool:
            # the same step as a run, warm-up included: with the optimizer's state already in
            # place, a step peaks higher than the very first one
            return not self._step(config.with_(batch_size=batch)).oom

        best = self._attempt(lambda: largest_batch(fits, step))
        if best is None:
            return None
        if best == 0:
            self._say(f"not even a batch of {step} fits in {fmt_bytes(config.budget)}", True)
            return 0
        self.batch_size.value = best
        self.run()
        limit = f" (the search stops at {MAX_BATCH:,})" if best * 2 > MAX_BATCH else ""
        self._say(f"largest batch that fits in {fmt_bytes(config.budget)}: {best}{limit}")
        return best

    def clear(self) -> None:
        self.results.clear()
        self._redraw()
        self._say("cleared")

    # -- display --------------------------------------------------------------------------------
    def _repr_mimebundle_(self, **kwargs: Any) -> Any:
        return self.widget._repr_mimebundle_(**kwargs)

    def _attempt(self, fn: Callable[[], T]) -> T | None:
        try:
            return fn()
        except WhatIfError as e:
            self._say(str(e), True)
        except Exception as e:  # the panel stays usable whatever the user's code raises
            self._say(f"{type(e).__name__}: {e}", True)
        return None

    def _say(self, text: str, problem: bool = False) -> None:
        colour = "#b03a2e" if problem else "#555"
        self.status.value = f'<div style="color:{colour};font-size:12px">{escape(text)}</div>'

    def _redraw(self) -> None:
        self.table.value = runs_table(self.results)
        done = [r for r in self.results if r.report is not None]
        self.chart.value = png(bars(done)) if done else b""
        latest = done[-1].report if done else None
        timeline = latest is not None and latest.timeline is not None and len(latest.timeline)
        self.timeline.value = png(latest.plot()) if timeline and latest else b""


def _device_limit(config: RunConfig) -> int | None:
    """On a GPU without a budget: what is allocated now plus what the driver has free."""
    device = resolve_device(config.device)  # a WhatIfError for a bad device, shown in the panel
    if device.type != "cuda":
        return None
    return cuda.headroom(device)
