"""`estimate`: one step of a configuration, predicted for a GPU without one.

The step (`memlab.step.run`) runs on ``meta`` through memlab's tensor accounting, with the
kernels that allocate differently on CUDA emulated (`memlab.estimate.kernels`) and CUDA's
autocast policy emulated (`memlab.estimate.autocast`); every allocation and free is replayed
through the model of the caching allocator (`AllocatorListener`). The design and its known
limitations: docs/estimator.md.
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
from typing import Any

from memlab.core import _torch
from memlab.core.choices import Source, TimelineSource
from memlab.core.frames import users_traceback
from memlab.core.ledger import default_ledger
from memlab.estimate.autocast import emulated, own_autocast
from memlab.estimate.gpus import GPU
from memlab.estimate.gpus import gpu as find_gpu
from memlab.estimate.kernels import (
    CublasHandles,
    CudaAllocations,
    HostRandomState,
    cuda_functions,
)
from memlab.estimate.kernels.cpu_attention import cpu_functions
from memlab.estimate.kernels.device import device_kernels
from memlab.estimate.kernels.plain import STATE as UNMEASURED
from memlab.estimate.kernels.reduce import sms_of
from memlab.estimate.kernels.rnn import flatten_patch
from memlab.estimate.listener import AllocatorListener
from memlab.estimate.meta_errors import on_meta
from memlab.estimate.positions import LookupChecks
from memlab.estimate.redirect import (
    META,
    OrdinaryInputs,
    build_on_meta,
    meta_device_module,
    redirected,
    redirecting,
)
from memlab.estimate.result import Estimate
from memlab.estimate.spread import summarise
from memlab.estimate.toggles import allocator_for, lever_notes
from memlab.estimate.workspaces import Workspaces, with_remainder, workspace_note, workspace_of
from memlab.region import track
from memlab.region.assemble import thin
from memlab.reports.report import MemoryReport, Timeline
from memlab.step import RunConfig, StepHooks, WhatIfError, blocks, run
from memlab.step.model import check_callable, check_flags, config_of
from memlab.step.ranks import one_process
from memlab.step.user import InputFn, LossFn, ModelFn, StepFn

NOT_MODELLED = "not modelled: other CUDA-only buffers (docs/estimator.md)"  # in every note


@users_traceback(own=(WhatIfError,))
def estimate(
    model_fn: ModelFn,
    input_fn: InputFn,
    loss_fn: LossFn | None = None,
    config: RunConfig | None = None,
    *,
    step_fn: StepFn | None = None,
    gpu: str | GPU | int | float | None = "H100 80GB",
    workspace: int | None = None,
    cuda_kernels: bool = True,
    trace: bool = False,
    **settings: Any,
) -> Estimate:
    """Predict one step of ``config`` on a GPU, without a GPU.

    model_fn, input_fn, loss_fn, step_fn: as for `memlab.whatif.run`; they run with ``meta`` as
        the default device, and a device they name (``.to("cuda")``, ``device=...``) becomes
        ``meta`` too, so code written for a GPU runs unchanged and allocates nothing.
    config: the step (``config.device`` is ignored; ``config.budget`` too: see `Estimate.fits`;
        ``config.compile`` is not modelled: the eager step's figures, which the notes say).
    gpu: a name from `memlab.estimate.GPUS` ("T4", "A100 80GB", "H100 80GB", ...), a size in
        bytes, or None. It sets the memory the simulated allocator may reserve and the cuBLAS
        workspace.
    workspace: the cuBLAS workspace of each handle in bytes, overriding the GPU's default (0: no
        cuBLAS or cuBLASLt workspace).
    cuda_kernels: run attention, dropout and the transformer layers' fast paths as CUDA does
        (`memlab.estimate.kernels`); False: as the CPU does, to compare an estimate with a CPU
        run (attention through the CPU's kernel choice, the rest through meta's own kernels,
        which are the CPU's; ``amp`` still follows CUDA's autocast policy).
    trace: keep the predicted allocation stream (`Estimate.trace`).
    settings: RunConfig fields that override ``config`` (``estimate(m, x, batch_size=32)``).

    >>> e = estimate(lambda: GPT(), lambda b: torch.randint(0, 50257, (b, 512)), gpu="T4")
    >>> e.fits(), e.peak_allocated, e.peak_reserved
    """
    check_flags(WhatIfError, cuda_kernels=cuda_kernels, trace=trace)
    for name, fn in (("input_fn", input_fn), ("loss_fn", loss_fn), ("step_fn", step_fn)):
        if fn is not None or name == "input_fn":
            check_callable(name, fn)
    config = config_of(config, settings).with_(device="meta", budget=None)
    since = default_ledger().next_serial()
    one_process(config)  # one rank's share: per_rank(estimate, ...) divides this estimate
    card = find_gpu(gpu)
    workspace = workspace_of(workspace, card)
    listener = AllocatorListener(str(META), allocator_for(config, card), keep_events=trace)
    lt = 0 if card is None or not workspace else card.lt_workspace
    workspaces = Workspaces(listener, workspace, lt)
    units: list[int] = []

    def model_on_meta() -> Any:
        # cuDNN's flat recurrent weights, made as .to("cuda") makes them
        with _torch.patched([flatten_patch()] if cuda_kernels else []):
            model = build_on_meta(model_fn)
        checks.refresh()  # libraries model_fn imported
        lookups.learn(model)  # its learned position tables
        if not units and hasattr(model, "named_modules"):
            named = dict(model.named_modules())
            units.extend(_parameter_bytes(named[path]) for path in blocks(model))
        return model

    def input_on_meta(batch: int) -> Any:
        with redirected():
            return input_fn(batch)

    loss_on_meta = None if loss_fn is None else redirecting(loss_fn)
    step_on_meta = None if step_fn is None else redirecting(step_fn)

    ledger = default_ledger()
    assumed: list[str] = []  # what library value checks took for granted on meta
    own: list[str] = []  # the program's own autocast regions, emulated

    def measuring(moment: str) -> None:
        if moment != "opened":  # inside the region, nothing to settle
            ledger.settle()  # the frees so far belong before the mark
        UNMEASURED.active = False  # measured: under memlab's dispatch mode on a GPU too
        listener.measuring(moment)

    # what the ledger knew before (an earlier estimate's model kept by a reference cycle) is
    # on no simulated GPU: left out of the breakdown, as the allocator model leaves it out
    hooks = StepHooks(
        autocast=emulated, foreach=True, grad_scaler=False, on_measure=measuring, since=since
    )
    ledger.attach(listener)
    try:
        sms = sms_of(card.name if card else None)
        with (
            _cuda_like(cuda_kernels, workspaces.take, sms, own),
            OrdinaryInputs(assumed) as checks,
            LookupChecks(assumed) as lookups,
        ):
            # torch.compile is not modelled: the eager step, said in the notes (toggles.py)
            ran = config.with_(compile=False)
            result = run(
                model_on_meta, input_on_meta, loss_on_meta, ran, step_fn=step_on_meta, hooks=hooks
            )
    except (RuntimeError, NotImplementedError, WhatIfError) as e:
        cause = e.__cause__ if isinstance(e, WhatIfError) else e  # what the user's code raised
        said = on_meta(cause) if cause is not None else None
        if said is None:
            raise
        raise WhatIfError(said) from cause
    finally:
        ledger.detach(listener)
    if result.report is None or listener.measured_from is None:
        raise WhatIfError(f"the step did not run: {result.error}")
    found = _prediction(
        config, card, result.report, listener, tuple(workspaces.taken), tuple(units)
    )
    if assumed or own:
        notes = (
            *found.report.notes,
            *own,
            *(f"assumed {a} (not checked on meta)" for a in assumed),
        )
        found = dataclasses.replace(found, report=dataclasses.replace(found.report, notes=notes))
    if trace:
        stream = {
            "device_traces": [listener.events],
            "measured": [listener.events_from, listener.events_to],
        }
        found = dataclasses.replace(found, trace=stream)
    return found


@contextlib.contextmanager
def _cuda_like(cuda_kernels: bool, take_workspace: Any, sms: int, own: list[str]) -> Any:
    """Accounting for the whole run, warm-up included, on meta; with ``cuda_kernels``,
    attention, dropout, the transformer layers' fast paths and the LSTM as CUDA runs them (the
    attention kernels' seed and offset on the CPU: the accounting's mode, entered after, sees
    them there), and the cuBLAS workspaces where a GPU takes them."""
    null = contextlib.nullcontext
    kernels = cuda_functions() if cuda_kernels else cpu_functions()  # SDPA: as the CPU picks
    host = HostRandomState() if cuda_kernels else null()
    copies = CudaAllocations(sms) if cuda_kernels else null()
    handles = CublasHandles(take_workspace)
    grouped = device_kernels()  # losses, mish's backward, MoE products: as a device runs them
    with (
        host,
        track(META),
        kernels,
        copies,
        handles,
        meta_device_module(),
        own_autocast(own),  # the program's torch.autocast("cuda"), and on meta
        grouped,
    ):
        yield


def _parameter_bytes(module: Any) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def _prediction(
    config: RunConfig,
    card: GPU | None,
    tensors: MemoryReport,
    replay: AllocatorListener,
    workspaces: tuple[tuple[str, int], ...],
    fsdp_units: tuple[int, ...],
) -> Estimate:
    assert replay.measured_from is not None
    start, end = replay.measured_from, replay.measured_to
    trace = replay.trace
    before = trace[start - 1] if start > 0 else (0, 0)
    during = trace[start:end] or [before]
    after = during[-1]
    notes = [
        workspace_note(workspaces),
        NOT_MODELLED,
        "autocast emulated with CUDA's policy" if config.amp != "off" else "",
        *lever_notes(config),
        *tensors.notes,  # the step's own (what checkpoint='auto' chose)
    ]
    if replay.failed is not None:
        notes.insert(0, f"out of memory on the simulated GPU: {replay.failed}")
    timeline = _predicted_timeline(tensors, replay, start, end)
    side = replay.side_trace
    window = side[max(start - 1, 0) : end] if side else []
    peaks = tuple(max(w[i] for w in window) for i in range(4)) if window else None
    peak_allocated = max(a for a, _ in [before, *during])
    report = MemoryReport(
        device=f"predicted {card.describe()}" if card is not None else "predicted GPU",
        source=Source.ESTIMATE,
        allocated_before=before[0],
        allocated_after=after[0],
        peak_allocated=peak_allocated,
        seconds=tensors.seconds,
        label=config.describe(),
        reserved_before=before[1],
        reserved_after=after[1],
        peak_reserved=max(r for _, r in [before, *during]),
        breakdown=with_remainder(tensors.breakdown, peak_allocated, after[0]),
        timeline=timeline,
        notes=tuple(n for n in notes if n),
        host=tensors.host,  # offload: bytes on the host, counted in the meta run
    )
    return Estimate(
        config,
        card,
        tensors,
        report,
        oom=replay.failed is not None,
        fsdp_units=fsdp_units,
        workspaces=workspaces,
        low=None if peaks is None or not replay.spreads else (peaks[0], peaks[1]),
        high=None if peaks is None or not replay.spreads else (peaks[2], peaks[3]),
        causes=summarise(replay.spreads),
    )


def _predicted_timeline(
    tensors: MemoryReport, replay: AllocatorListener, start: int, end: int | None
) -> Timeline | None:
    """The allocator model's allocated bytes after each event of the measured step (thinned,
    the peak kept), with the phase the accounting's timeline had at that moment."""
    accounted = tensors.timeline
    if accounted is None or not len(accounted) or end is None or end <= start:
        return None
    # when the measured region started (its clock's zero): taken at the start, not worked back
    # from the end, where the work after the region (a busy machine's pauses) would shift it
    origin = replay.started
    seconds = [max(0.0, s - origin) for s in replay.stamps[start:end]]
    values = [a for a, _ in replay.trace[start:end]]

    def phase(at: float) -> str:
        i = bisect.bisect_right(accounted.seconds, at) - 1
        return accounted.phases[max(i, 0)]

    keep = thin(values)
    return Timeline(
        seconds=tuple(seconds[i] for i in keep),
        allocated=tuple(values[i] for i in keep),
        phases=tuple(phase(seconds[i]) for i in keep),
        source=TimelineSource.ALLOCATOR_MODEL,
    )
