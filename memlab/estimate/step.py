"""What a training or inference step would need on a GPU, computed without one.

`estimate` runs the what-if step (`memlab.whatif.run`: a warm-up step, then the measured one) on
the ``meta`` device, where tensors have shapes and dtypes but no memory, through memlab's tensor
accounting. Every storage the step creates and frees, in order, is replayed through
`CachingAllocator`, the model of PyTorch's CUDA caching allocator, which turns requested bytes
into the blocks ``memory_allocated`` counts and the segments ``memory_reserved`` counts. The
cuBLAS and cuBLASLt workspaces, which a CUDA run allocates and a meta run does not, are added
where the allocator would see them: after the first matrix product of the forward and of the
backward (`memlab.estimate.kernels.CublasHandles`).

The optimizer runs its ``foreach`` implementation, CUDA's default (on ``meta`` PyTorch would pick
the single-tensor one, whose temporaries differ).

AMP configurations run under `memlab.estimate.autocast.emulated`, CUDA's autocast policy applied
in Python (real autocast does not run on ``meta``); the gradient scaler's few bytes are left out.

``F.scaled_dot_product_attention`` runs the kernel CUDA would pick (`memlab.estimate.kernels`):
FlashAttention or the memory-efficient kernel, which save no attention matrix. Dropout runs
CUDA's fused kernel (a one-byte mask), the transformer layers take their fused path without grad
as on a GPU, and an LSTM out of training runs as cuDNN's single call.

What is not modelled, and said so in every estimate's notes: cuDNN's workspaces (convolutions,
and an RNN's workspace and reserve space in training), the staging buffers of CUDA's reductions,
and other kernels whose CUDA versions allocate differently from their meta ones.
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import time
import types
from collections.abc import Iterator
from dataclasses import dataclass
from html import escape
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import _disable_current_modes

from memlab.core.categories import Category
from memlab.core.ledger import default_ledger
from memlab.estimate.allocator import CachingAllocator, SimulatedOutOfMemoryError
from memlab.estimate.gpus import GPU
from memlab.estimate.gpus import gpu as find_gpu
from memlab.estimate.kernels import (
    CublasHandles,
    CudaAllocations,
    HostRandomState,
    cuda_functions,
)
from memlab.region import track
from memlab.reports.report import MemoryReport, Timeline
from memlab.reports.units import fmt_bytes
from memlab.whatif.config import RunConfig, WhatIfError
from memlab.whatif.runner import InputFn, LossFn, ModelFn, blocks, run

META = torch.device("meta")


@dataclass(frozen=True)
class Estimate:
    """A predicted step on a GPU. Byte figures are what ``torch.cuda`` would report."""

    config: RunConfig
    gpu: GPU | None
    #: The measured step's tensor accounting on ``meta``: breakdown, timeline, tensor bytes.
    tensors: MemoryReport
    #: The prediction, as a report: allocated (blocks) and reserved (segments), before, after
    #: and at the peak of the measured step, with the breakdown and timeline of ``tensors``.
    report: MemoryReport
    #: The simulated allocator ran out of the GPU's usable memory (``gpu.usable``).
    oom: bool = False
    #: Parameter bytes of each repeated block of the model (what sharded data parallelism
    #: would gather one at a time; see `memlab.estimate.distributed`).
    units: tuple[int, ...] = ()
    #: Each workspace the step took, in order: ("forward", bytes), ("forward lt", bytes), ...
    workspaces: tuple[tuple[str, int], ...] = ()
    #: With ``estimate(..., trace=True)``: the predicted allocation stream of the whole run
    #: (warm-up step included), as a snapshot: ``{"device_traces": [events], "measured":
    #: [first, end]}``, the measured step's events being ``events[first:end]``. Compare it with a
    #: real one with `memlab.estimate.trace.compare`.
    trace: dict[str, Any] | None = None

    @property
    def notes(self) -> tuple[str, ...]:
        """What the prediction includes and leaves out (the report's notes)."""
        return self.report.notes

    @property
    def peak_allocated(self) -> int:
        return self.report.peak_allocated

    @property
    def peak_reserved(self) -> int:
        assert self.report.peak_reserved is not None
        return self.report.peak_reserved

    @property
    def workspace(self) -> int:
        """Bytes of cuBLAS and cuBLASLt workspace the step took (see `workspaces`)."""
        return sum(size for _, size in self.workspaces)

    def fits(self, budget: int | None = None) -> bool:
        """Whether the step's peak *reserved* memory fits in ``budget`` bytes (default: the GPU's
        memory less the CUDA context allowance). Reserved, not allocated: the cache and
        fragmentation are memory the process holds too."""
        if budget is None:
            if self.gpu is None:
                raise ValueError("no GPU was given to estimate(): pass a budget in bytes.")
            budget = self.gpu.usable
        return not self.oom and self.peak_reserved <= budget

    def to_dict(self) -> dict[str, Any]:
        return {
            "config": self.config.describe(),
            "gpu": None if self.gpu is None else self.gpu.name,
            "peak_allocated": self.peak_allocated,
            "peak_reserved": self.peak_reserved,
            "workspace": self.workspace,
            "oom": self.oom,
            "fits": None if self.gpu is None else self.fits(),
            "report": self.report.to_dict(),
            "notes": list(self.notes),
        }

    def headline(self) -> str:
        """ "predicted for <GPU> · fits" (or "· does NOT fit"), as text and HTML show it."""
        where = "no particular GPU" if self.gpu is None else self.gpu.describe()
        verdict = ""
        if self.gpu is not None:
            verdict = " · fits" if self.fits() else " · does NOT fit"
        return f"predicted for {where}{verdict}"

    def __str__(self) -> str:
        return f"{self.headline()}\n{self.report}"

    __repr__ = __str__

    def _repr_html_(self) -> str:
        # the verdict first: the report itself has no room for it
        head = f'<div style="font-weight:bold;margin-bottom:4px">{escape(self.headline())}</div>'
        return head + self.report._repr_html_()


class _Replay:
    """A ledger listener that replays one device's allocations through the allocator model."""

    def __init__(self, device: str, allocator: CachingAllocator, keep_events: bool) -> None:
        self.device = device
        self.keep_events = keep_events
        self.allocator = allocator
        self.handles: dict[int, int] = {}
        self.failed: str | None = None
        #: The allocator's (allocated, reserved) after every event, and where the measured step
        #: began in that list.
        self.trace: list[tuple[int, int]] = []
        self.measured_from: int | None = None
        self.measured_to: int | None = None
        #: With ``keep_events``: the allocation stream, in the format of a CUDA snapshot's
        #: ``device_traces`` (requested sizes; ``addr`` is the storage's serial), to compare
        #: with a real trace.
        self.events: list[dict[str, Any]] = []
        self.events_from = self.events_to = 0
        #: perf_counter time of each entry of ``trace``, and when the measured step ended.
        self.stamps: list[float] = []
        self._when: float | None = None
        self.ended = 0.0
        self.sizes: dict[int, int] = {}

    def _note(self) -> None:
        s = self.allocator.stats
        self.trace.append((s.allocated, s.reserved))
        # stamped as the tensor accounting stamps its timeline: an allocation when its op
        # started, a free when it happens, never before the previous event
        self.stamps.append(
            max(self._when or time.perf_counter(), self.stamps[-1] if self.stamps else 0.0)
        )
        self._when = None

    def malloc(self, key: int, nbytes: int) -> None:
        if self.failed is not None:
            return
        try:
            self.handles[key] = self.allocator.malloc(nbytes)
        except SimulatedOutOfMemoryError as e:
            self.failed = str(e)
        if self.keep_events:
            self.events.append({"action": "alloc", "addr": key, "size": nbytes, "stream": 0})
            self.sizes[key] = nbytes
        self._note()

    def _freed(self, key: int) -> None:
        if self.keep_events:
            size = self.sizes.pop(key, 0)
            event = {"action": "free_completed", "addr": key, "size": size, "stream": 0}
            self.events.append(event)

    def on_alloc(self, serial: int, delta: int, when: float) -> None:
        self._when = when
        old = self.handles.pop(serial, None)
        if old is not None:  # a storage that grew: the allocator sees a new block
            size = self.allocator.block_size(old)
            self.allocator.free(old)
            self._freed(serial)
            self.malloc(serial, size + delta)
        elif delta > 0:
            self.malloc(serial, delta)
        self._when = None

    def on_free(self, serial: int, nbytes: int, category: Category | None) -> None:
        handle = self.handles.pop(serial, None)
        if handle is not None:
            self.allocator.free(handle)
            self._freed(serial)
            self._note()

    def on_discovered(self, serial: int, nbytes: int) -> None:
        pass  # storages from before the estimate are not on the simulated GPU

    def on_mark(self, serial: int, category: Category) -> None:
        pass

    def on_saved(self, serial: int, saved: bool) -> None:
        pass


class _Redirect(TorchFunctionMode):
    """Sends tensors the user's code puts on a GPU (or the CPU) to ``target`` instead, so code
    written for CUDA runs unchanged on a machine without one."""

    def __init__(self, target: torch.device) -> None:
        super().__init__()
        self.target = target

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kwargs = dict(kwargs or {})
        if "device" in kwargs and kwargs["device"] is not None:
            kwargs["device"] = self.target
        if func in (torch.Tensor.cuda, torch.Tensor.cpu):
            return args[0].to(self.target)
        if func is torch.Tensor.to:
            args = tuple(self.target if _is_device(a) else a for a in args)
        return func(*args, **kwargs)


def _is_device(value: Any) -> bool:
    if isinstance(value, torch.device):
        return True
    if isinstance(value, str):
        try:
            torch.device(value)
        except RuntimeError:
            return False
        return True
    return isinstance(value, int) and not isinstance(value, bool)  # .to(0): GPU 0


@contextlib.contextmanager
def _meta_device_module() -> Iterator[None]:
    """``torch.utils.checkpoint`` looks up a device module by the tensors' device type
    (``torch.cuda`` for CUDA). PyTorch before 2.5 has no ``torch.meta``: give it an empty one
    for the block, so checkpointing runs on meta (with no device random state to save)."""
    if hasattr(torch, "meta"):
        yield
        return
    torch.meta = types.ModuleType("torch.meta")  # type: ignore[attr-defined]
    try:
        yield
    finally:
        del torch.meta  # type: ignore[attr-defined]


@contextlib.contextmanager
def redirected(device: str | torch.device = META) -> Iterator[None]:
    """Within the block, tensors are created on ``device`` (default ``meta``), also where the
    code names another device: ``.to("cuda")``, ``.cuda()``, ``device="cuda"``."""
    target = torch.device(device)
    with torch.device(target), _Redirect(target):
        yield


def estimate(
    model_fn: ModelFn,
    input_fn: InputFn,
    loss_fn: LossFn | None = None,
    config: RunConfig | None = None,
    *,
    gpu: str | GPU | int | None = "H100 80GB",
    workspace: int | None = None,
    cuda_kernels: bool = True,
    trace: bool = False,
) -> Estimate:
    """Predict one step of ``config`` on a GPU, without a GPU.

    model_fn, input_fn, loss_fn: as for `memlab.whatif.run`; they run with ``meta`` as the default
        device, and a device they name (``.to("cuda")``, ``device=...``) becomes ``meta`` too, so
        code written for a GPU runs unchanged and allocates nothing.
    config: the step (``config.device`` is ignored; ``config.budget`` too: see `Estimate.fits`).
    gpu: a name from `memlab.estimate.GPUS` ("T4", "A100 80GB", "H100 80GB", ...), a size in
        bytes, or None. It sets the memory the simulated allocator may reserve and the cuBLAS
        workspace.
    workspace: the cuBLAS workspace of each handle in bytes, overriding the GPU's default (0: no
        cuBLAS or cuBLASLt workspace).
    cuda_kernels: run attention, dropout and the transformer layers' fast paths as CUDA does
        (`memlab.estimate.kernels`); False: as meta's own kernels, which are the CPU's (useful to
        compare an estimate with a CPU run).
    trace: keep the predicted allocation stream (`Estimate.trace`).
    """
    config = (config or RunConfig()).with_(device="meta", budget=None)
    card = find_gpu(gpu)
    if workspace is None:
        workspace = 0 if card is None else card.workspace
    allocator = CachingAllocator(capacity=None if card is None else card.usable)
    replay = _Replay(str(META), allocator, keep_events=trace)
    lt = 0 if card is None or not workspace else card.lt_workspace
    taken: list[tuple[str, int]] = []

    def take_workspace(key: str) -> None:  # kept for the process's life: never freed
        size = lt if key.endswith(" lt") else workspace
        if size:
            replay.malloc(-1 - len(taken), size)
            taken.append((key, size))

    units: list[int] = []

    def on_meta_model() -> Any:
        # built outside the accounting, then given fresh storage within it, as `.to("cuda")`
        # moves a model built on the CPU: one allocation per parameter and buffer, in module
        # order, and none of what the construction allocated and freed on the way
        with _disable_current_modes(), redirected():
            model: Any = model_fn()  # not always a Module: run() says what is wrong then
        if not isinstance(model, torch.nn.Module):
            return model
        real = {str(p.device) for p in model.parameters() if p.device != META}
        if real:
            raise WhatIfError(
                f"model_fn returned a model that already exists (on {', '.join(sorted(real))}):"
                " for an estimate, model_fn must build the model, so that it can be built on "
                "the meta device without memory, e.g. model_fn=lambda: MyModel(config)."
            )
        fresh: dict[int, torch.Tensor] = {}

        def materialize(t: torch.Tensor) -> torch.Tensor:  # a tied weight moves once
            if id(t) not in fresh:
                fresh[id(t)] = torch.empty_like(t)
            return fresh[id(t)]

        model._apply(materialize)
        fresh.clear()
        if not units:
            named = dict(model.named_modules())
            units.extend(
                sum(p.numel() * p.element_size() for p in named[path].parameters())
                for path in blocks(model)
            )
        return model

    def on_meta_input(batch: int) -> Any:
        with redirected():
            return input_fn(batch)

    def measuring(moment: str) -> None:
        if moment == "start":
            replay.measured_from = len(replay.trace)
            replay.events_from = len(replay.events)
        else:
            replay.measured_to = len(replay.trace)
            replay.events_to = len(replay.events)
            replay.ended = time.perf_counter()

    ledger = default_ledger()
    ledger.attach(replay)
    try:
        # accounting for the whole run, warm-up included, for the replay; attention, dropout and
        # the transformer layers' fast paths as CUDA runs them (the seed and offset of the
        # attention kernels' generator on the CPU: the accounting's mode, entered after, sees
        # them there)
        null = contextlib.nullcontext
        kernels, host = (cuda_functions(), HostRandomState()) if cuda_kernels else (null(), null())
        copies = CudaAllocations() if cuda_kernels else null()
        handles = CublasHandles(take_workspace)
        with host, track(META), kernels, copies, handles, _meta_device_module():
            result = run(
                on_meta_model, on_meta_input, loss_fn, config, on_measure=measuring, foreach=True
            )
    finally:
        ledger.detach(replay)
    tensors = result.report
    if tensors is None or replay.measured_from is None:
        raise WhatIfError(f"the step did not run: {result.error}")
    e = _prediction(config, card, tensors, replay, tuple(taken), tuple(units))
    if trace:
        stream = {
            "device_traces": [replay.events],
            "measured": [replay.events_from, replay.events_to],
        }
        e = dataclasses.replace(e, trace=stream)
    return e


def _prediction(
    config: RunConfig,
    card: GPU | None,
    tensors: MemoryReport,
    replay: _Replay,
    workspaces: tuple[tuple[str, int], ...],
    units: tuple[int, ...],
) -> Estimate:
    assert replay.measured_from is not None
    start, end = replay.measured_from, replay.measured_to
    trace = replay.trace
    before = trace[start - 1] if start > 0 else (0, 0)
    during = trace[start:end] or [before]
    after = during[-1]
    notes = [
        _workspace_note(workspaces),
        "not modelled: cuDNN workspaces, reductions' staging buffers, other CUDA-only buffers",
        "autocast emulated with CUDA's policy" if config.amp != "off" else "",
    ]
    if replay.failed is not None:
        notes.insert(0, f"out of memory on the simulated GPU: {replay.failed}")
    timeline = tensors.timeline
    if timeline is not None and len(timeline):
        # the allocator model's allocated bytes at each point of the accounting's timeline
        origin = replay.ended - tensors.seconds  # when the measured region started
        stamps = replay.stamps[start:end]
        values = [a for a, _ in trace[start:end]]

        def at(seconds: float) -> int:
            i = bisect.bisect_right(stamps, origin + seconds) - 1
            return values[i] if i >= 0 else before[0]

        timeline = Timeline(
            seconds=timeline.seconds,
            allocated=tuple(at(x) for x in timeline.seconds),
            phases=timeline.phases,
            source="allocator model",
        )
    report = MemoryReport(
        device=f"predicted {card.describe()}" if card is not None else "predicted GPU",
        source="estimate",
        allocated_before=before[0],
        allocated_after=after[0],
        peak_allocated=max(a for a, _ in [before, *during]),
        seconds=tensors.seconds,
        label=config.describe(),
        reserved_before=before[1],
        reserved_after=after[1],
        peak_reserved=max(r for _, r in [before, *during]),
        breakdown=tensors.breakdown,
        timeline=timeline,
        notes=tuple(n for n in notes if n),
    )
    return Estimate(
        config,
        card,
        tensors,
        report,
        oom=replay.failed is not None,
        units=units,
        workspaces=workspaces,
    )


def _workspace_note(workspaces: tuple[tuple[str, int], ...]) -> str:
    """ "includes cuBLAS workspaces: 32 MiB (forward), 1 MiB (cuBLASLt), 32 MiB (backward)"."""
    if not workspaces:
        return ""
    parts = [
        f"{fmt_bytes(size)} ({'cuBLASLt' if key.endswith(' lt') else key})"
        for key, size in workspaces
    ]
    return f"includes cuBLAS workspaces: {', '.join(parts)}"
