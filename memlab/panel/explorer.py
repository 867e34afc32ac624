"""The what-if panel: controls over the runner, a table and charts that compare the runs.

``Explorer(model_fn, input_fn, loss_fn)`` shows itself in a notebook. ``explorer.run()`` and
``explorer.largest_batch()`` are what the buttons call, so programs and tests drive the same path;
``explorer.results`` holds every run.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from html import escape
from typing import Any, TypeVar

import ipywidgets as w

from memlab.core import cuda
from memlab.core.frames import described, users_traceback
from memlab.estimate import estimate
from memlab.estimate.gpus import GPU, GPUS
from memlab.estimate.gpus import gpu as find_gpu
from memlab.panel.applies import neutral, refuse_unshown
from memlab.panel.controls import CUSTOM, HERE, build_controls, controls
from memlab.panel.levers import lever_values
from memlab.panel.limit import LINE, MUTED, BudgetLimit, mib
from memlab.panel.ranks import predicted
from memlab.panel.search import MAX_BATCH, Tries, predicted_batch
from memlab.panel.views import bars, load_charts, png, runs_table
from memlab.panel.work import Work
from memlab.reports.frame import GROW
from memlab.reports.units import fmt_bytes
from memlab.step import RunConfig, RunResult, WhatIfError, run
from memlab.step.model import config_of, resolve_device
from memlab.step.user import InputFn, LossFn, ModelFn, StepFn, check_model_fn

T = TypeVar("T")
MiB = 1024**2


class Explorer(BudgetLimit):
    """The what-if panel: change AMP, checkpointing, no_grad, the batch size, accumulation and
    the optimizer, press Run, and compare what each step peaks at and what it is made of;
    "Largest batch that fits" searches the batch size under a budget; "simulate a GPU" predicts
    for a GPU you do not have (`memlab.estimate`) instead of measuring here. "ranks (GPUs)" and
    "sharding" show one rank's figures under DDP, ZeRO or FSDP: this process's step divided by
    the strategy's rule (`memlab.step.ranks`), labelled as derived, not measured on N ranks.

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

    # the controls (memlab.panel.controls), reachable for programs and tests
    amp: w.ToggleButtons
    checkpoint: w.ToggleButtons
    mode: w.Dropdown
    new_tokens: w.BoundedIntText
    retention: w.ToggleButtons
    batch_size: w.BoundedIntText
    accumulation: w.BoundedIntText
    optimizer: w.Dropdown
    offload: w.Dropdown
    budget: w.BoundedFloatText
    simulate: w.Dropdown
    custom_gib: w.BoundedFloatText
    world_size: w.BoundedIntText
    sharding: w.Dropdown
    limit: w.HTML
    run_button: w.Button
    fit_button: w.Button
    clear_button: w.Button
    cancel_button: w.Button
    status: w.HTML
    table: w.HTML
    chart: w.Image
    timeline: w.Image

    @users_traceback()
    def __init__(
        self,
        model_fn: ModelFn,
        input_fn: InputFn,
        loss_fn: LossFn | None = None,
        *,
        step_fn: StepFn | None = None,
        config: RunConfig | None = None,
    ) -> None:
        check_model_fn(model_fn)  # at once, not at the first run's status line
        self.model_fn, self.input_fn, self.loss_fn = model_fn, input_fn, loss_fn
        self.step_fn = step_fn
        self.results: list[RunResult] = []
        c = config_of(config, {})  # a RunConfig, a dict of its fields, or None
        self._base = c
        self.widget = build_controls(self, c)
        if config is not None:
            refuse_unshown(self, c)  # a run would use other values without a word
        self._work = Work(controls(self), self.cancel_button, self._write)
        self._show_limit()
        load_charts()  # (matplotlib, once a process: not inside the first run or search)

    # -- what the buttons do ----------------------------------------------------------------------
    @property
    def config(self) -> RunConfig:
        """The configuration the controls describe (raises WhatIfError if it is not valid)."""
        given = self._base.budget  # its bytes while the field still shows them (in 0.1 MiB)
        same = given is not None and self.budget.value == mib(given)
        budget = given if same else int(self.budget.value * MiB) or None
        fields = dict(
            amp=self.amp.value,
            checkpoint=self.checkpoint.value,
            mode=self.mode.value,
            new_tokens=int(self.new_tokens.value),
            retention=self.retention.value,
            batch_size=int(self.batch_size.value),
            accumulation=int(self.accumulation.value),
            optimizer=self.optimizer.value,
            budget=budget,
            world_size=int(self.world_size.value),
            **lever_values(self),
            offload=self.offload.value,
        )
        fields.update(neutral(self))  # a hidden control (one that does not apply) reads neutral
        ranks = fields["world_size"] > 1
        return self._base.with_(**fields, sharding=self.sharding.value if ranks else "none")

    def run(self) -> RunResult | None:
        """Run the current configuration (or predict it for the GPU chosen under "simulate a
        GPU"), add it to the comparison, and redraw."""
        result = self._attempt(lambda: self._step(self.config))
        if result is not None:
            self._add(result)
        return result

    def _add(self, result: RunResult) -> None:
        """A run joins the comparison, and the charts are redrawn."""
        self.results.append(result)
        done = f"ran {result.config.describe()}"
        if result.predicted_for:
            done = f"predicted {result.config.describe()} on {result.predicted_for}"
        if result.ranks is not None:  # derived by the rule, not measured on N ranks
            done += f" · one rank peaks at {fmt_bytes(result.ranks.total)} (derived)"
        self._progress(f"drawing {result.config.describe()}")
        self._redraw()  # the charts first: "ran" means everything is there
        self._say(result.error or done, bool(result.oom))

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
        whole = config.with_(world_size=1, sharding="none")  # the step, then one rank's share
        e = estimate(
            self.model_fn, self.input_fn, self.loss_fn, whole, step_fn=self.step_fn, gpu=card
        )
        return predicted(e, config, card)  # over several ranks: one rank's figures

    def largest_batch(self) -> int | None:
        """The largest batch size whose step fits the budget (or the simulated GPU's memory, or
        this GPU's free memory). Two small batches draw the line of peak against batch; the batch
        where it meets the budget is tried, then the next one (``search.predicted_batch``; runs
        out of memory are expected). Cancel keeps the largest batch found to fit so far."""
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
        step, limit_bytes = config.accumulation, config.budget
        assert limit_bytes is not None  # (set above, or the search returned)
        budget = fmt_bytes(config.budget)

        def trying(batch: int, fits_so_far: int, too_big: int | None) -> None:
            known = f"fits: {fits_so_far:,}" if fits_so_far else "none fits yet"
            if too_big is not None:
                known += f"; too big: {too_big:,}"
            self._progress(f"largest batch under {budget}: trying {batch:,} ({known})")

        # each try the same step as a run, warm-up included: with the optimizer's state
        # already in place, a step peaks higher than the very first one
        tries = Tries(lambda b: self._step(config.with_(batch_size=b)), step, config.batch_size)
        tries.on_try, stop = trying, lambda: self._work.cancelled
        best = self._attempt(
            lambda: predicted_batch(
                tries.measure, limit_bytes, step, on_try=trying, stop=stop, first=tries.first()
            )
        )
        cancelled = " (cancelled: the largest found so far)" if self._work.cancelled else ""
        if best is None:
            return None
        if cancelled:  # (the tries made before the search's first step count too)
            best = max([best, *(b for b in tries.done if tries.measure(b)[0])])
        why = f" ({tries.skipped}: the search started at {tries.floor:,})" if tries.skipped else ""
        if best == 0:
            self._say(f"not even a batch of {tries.floor} fits in {budget}{why}{cancelled}", True)
            return 0
        if not self._work.cancelled:  # a cancelled search leaves the batch size as it was
            self.batch_size.value = best
            if tries.done[best].config == self._attempt(lambda: self.config):
                self._add(tries.done[best])  # the search ran this very step: not run again
            else:
                self.run()
        limit = f" (the search stops at {MAX_BATCH:,})" if best * 2 > MAX_BATCH else ""
        self._say(f"largest batch that fits in {budget}: {best:,}{limit}{why}{cancelled}")
        return best

    def wait(self, timeout: float | None = None) -> None:
        """Until the work a button started is done (for programs that press the buttons)."""
        self._work.wait(timeout)

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
            self._say(described(e), True)
        except BaseException as e:  # SystemExit, GeneratorExit, the user's own: on its thread
            if threading.current_thread() is threading.main_thread():
                self._say(f"stopped: {described(e)}", True)  # (not "trying ..." any more)
                raise
            self._say(f"the step raised {described(e)}", True)
        return None

    def _say(self, text: str, problem: bool = False) -> None:
        """A message that stays (a result, an error), also while work runs."""
        self._work.said()
        self._write(text, problem)

    @property
    def message(self) -> str:
        """What the status line says now, as plain text."""
        return self._message

    _message = ""

    def _write(self, text: str, problem: bool = False) -> None:
        self._message = text
        style = f"color:{GROW};{LINE}" if problem else MUTED
        self.status.value = f'<div style="{style}">{escape(text)}</div>'

    def _progress(self, text: str) -> None:
        if self._work.running:
            self._work.progress(text)
        else:
            self._say(text)

    def _redraw(self) -> None:
        self.table.value = runs_table(self.results)
        done = [r for r in self.results if r.report is not None]
        self.chart.value = png(bars(done)) if done else b""
        latest = done[-1].report if done else None
        timeline = latest is not None and latest.timeline is not None and len(latest.timeline)
        self.timeline.value = png(latest.plot()) if timeline and latest else b""
        for image in (self.chart, self.timeline):  # no broken-image icon where nothing is drawn
            image.layout.display = "" if image.value else "none"


def _device_limit(config: RunConfig) -> int | None:
    """On a GPU without a budget: what is allocated now plus what the driver has free."""
    device = resolve_device(config.device)  # a WhatIfError for a bad device, shown in the panel
    if device.type != "cuda":
        return None
    return cuda.headroom(device)
