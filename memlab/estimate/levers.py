"""The what-if levers of a step that does not fit, each predicted by the estimator for a GPU:
AMP, activation checkpointing, offload to host memory, a halved batch with gradient
accumulation, a halved batch.

`config_levers` is what a what-if run that meets an out-of-memory adds to its explanation
(`run_levers` makes the `StepHooks.on_oom` that does it); it works on any machine, since each
prediction runs the step on ``meta``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from memlab.estimate.after_oom import after_oom
from memlab.estimate.gpus import CONTEXT, GPU
from memlab.estimate.predict import estimate
from memlab.reports.oom import Lever, OOMExplanation
from memlab.step import RunConfig, WhatIfError
from memlab.step.user import InputFn, LossFn, ModelFn, StepFn


def variations(config: RunConfig) -> list[tuple[str, str, RunConfig]]:
    """(name, how, changed config) for each lever that changes ``config``."""
    found = []
    if config.amp == "off":
        found.append(("AMP (bf16)", "`amp='bf16'`", config.with_(amp="bf16")))
    if config.checkpoint == "off" and config.training:
        found.append(("checkpointing", "`checkpoint='auto'`", config.with_(checkpoint="auto")))
    if config.training and config.offload == "off":
        how = "`offload='both'`: saved activations and the optimizer's state in host memory"
        found.append(("offload to host", how, config.with_(offload="both")))
    k = config.accumulation * 2
    if config.training and config.batch_size % k == 0:
        how = f"`accumulation={k}`: the same batch in {k} micro-batches"
        found.append((f"accumulate {k}", how, config.with_(accumulation=k)))
    if config.batch_size >= 2 and (config.batch_size // 2) % config.accumulation == 0:
        half = config.batch_size // 2
        found.append((f"batch {half}", f"`batch_size={half}`", config.with_(batch_size=half)))
    return found


def config_levers(
    model_fn: ModelFn,
    input_fn: InputFn,
    loss_fn: LossFn | None = None,
    config: RunConfig | None = None,
    *,
    step_fn: StepFn | None = None,
    gpu: str | GPU | int | float | None = "H100 80GB",
) -> list[Lever]:
    """Each lever of ``config`` with its peak reserved bytes predicted for ``gpu`` (and whether
    it fits there). A lever the step cannot take (no repeated blocks to checkpoint) is left out.
    """
    config = config or RunConfig()
    found = []
    for name, how, changed in variations(config):
        try:
            e = estimate(model_fn, input_fn, loss_fn, changed, step_fn=step_fn, gpu=gpu)
        except WhatIfError:
            continue
        found.append(Lever(name, how, e.peak_reserved, None if e.gpu is None else e.fits()))
    return found


def run_levers(
    model_fn: ModelFn,
    input_fn: InputFn,
    loss_fn: LossFn | None = None,
    *,
    step_fn: StepFn | None = None,
    gpu: str | GPU | int | float | None = None,
    state: Any = None,
) -> Callable[[BaseException, RunConfig, str], OOMExplanation | None]:
    """A `StepHooks.on_oom` for a what-if run of these functions: the out-of-memory explained
    from the device's cache (`after_oom`), with the config levers predicted for ``gpu`` (default:
    a card of the device's usable size)."""

    def explain(error: BaseException, config: RunConfig, device: str) -> OOMExplanation | None:
        found = after_oom(error, device, state=state)
        if found is None:
            return None
        # default: a card whose usable memory is what this device's allocator could have
        card = gpu if gpu is not None or found.capacity is None else found.capacity + CONTEXT
        levers = config_levers(model_fn, input_fn, loss_fn, config, step_fn=step_fn, gpu=card)
        # the cache's own levers that the config's do not cover: fragmentation, a variable
        kept = [lv for lv in found.levers if lv.name.startswith(("del ", "expandable"))]
        return dataclasses.replace(found, levers=(*levers, *kept))

    return explain
