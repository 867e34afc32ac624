"""A step of a model wrapped in ``torch.compile`` (``RunConfig(compile=...)``): compiled in
warm-up steps, then one step measured by what sees inside compiled code.

memlab's tensor accounting is a dispatch mode, and dynamo runs a frame eagerly while one is on:
measured under it, a compiled model would report its eager figures. The compiled step is
measured without it: on CUDA by the caching allocator's counters (`memlab.track` without a
breakdown), on a CPU by the CPU allocator's own record (`memlab.core.allocations`). Neither says
what a block is for, so there is no breakdown by category inside compiled code. What is known is
kept: the parameters, buffers and optimizer state alive before the step and still the same
storages after it were alive at its peak too (`Known`); the rest is "unattributed".
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import time
import weakref
from collections.abc import Iterator
from types import TracebackType
from typing import Any

import torch
from torch import nn

from memlab.core.allocations import AllocationRecord
from memlab.core.categories import Category
from memlab.core.choices import Source, TimelineSource
from memlab.core.devices import Target, resolve
from memlab.core.frames import message_of
from memlab.core.recorder import Phase
from memlab.region import track
from memlab.region.assemble import thin
from memlab.reports.report import Breakdown, MemoryReport, Timeline
from memlab.step.config import RunConfig, WhatIfError
from memlab.step.options import CUDA_GRAPH_MODES

#: Categories memlab can name from the model and the optimizer without tensor accounting.
NAMED = (Category.PARAMETER, Category.BUFFER, Category.OPTIMIZER_STATE, Category.GRADIENT)
#: What every compiled run says in its notes.
NOTE = (
    "torch.compile ({mode}, inductor): the model compiled in {n} warm-up steps before the "
    "measured one, so compilation's own memory is not the step's; measured by {meter}, which "
    "sees inside compiled code; no breakdown by category inside compiled code: parameters, "
    "buffers and optimizer state are the tensors alive before and after the step, gradients "
    "those alive after it, everything else unattributed"
)


def warmups(config: RunConfig) -> int:
    """Warm-up steps: compiled on the first call, guards settled by the second; a CUDA-graph
    mode records its graph on a later call."""
    if not config.compile:
        return 1
    return 3 if config.compile in CUDA_GRAPH_MODES else 2


def mode_of(config: RunConfig) -> str:
    return "default" if config.compile is True else str(config.compile)


def compiled(model: nn.Module, config: RunConfig, device: torch.device) -> nn.Module:
    """The module the step calls: ``model`` itself, or ``torch.compile(model, mode=...)``."""
    if not config.compile:
        return model
    if device.type not in ("cpu", "cuda"):
        raise WhatIfError(
            f"compile={config.compile!r} runs on 'cpu' or 'cuda', not {device.type!r}: choose one "
            "of those devices, or pass compile=False."
        )
    why = AllocationRecord.available() if device.type == "cpu" else None
    if why is not None:
        raise WhatIfError(
            f"compile={config.compile!r} on the CPU is measured by PyTorch's allocation record, "
            f"which this PyTorch lacks ({why}): pass compile=False, or run on a GPU."
        )
    return torch.compile(model, mode=mode_of(config))  # type: ignore[return-value]


@contextlib.contextmanager
def compiling(config: RunConfig, device: torch.device) -> Iterator[None]:
    """Around the warm-up steps: a failure of dynamo or inductor becomes a WhatIfError that
    names the field (a CPU without a C++ compiler, a GPU without Triton)."""
    if not config.compile:
        yield
        return
    try:
        yield
    except Exception as e:
        if not type(e).__module__.startswith(("torch._dynamo", "torch._inductor")):
            raise
        name, text = type(e).__name__, message_of(e).strip()
        first = text.splitlines()[0] if text else ""
        # the backend failed (no compiler, no Triton), or dynamo could not trace the model
        backend = type(e).__module__.startswith("torch._inductor") or "Backend" in name
        needs = "a C++ compiler (g++ or clang++, or CXX)" if device.type == "cpu" else "Triton"
        hint = f"Inductor needs {needs} there; " if backend else ""
        raise WhatIfError(
            f"compile={config.compile!r}: torch.compile could not compile the model on "
            f"{device.type} ({name}: {first:.300}). {hint}pass compile=False to measure the "
            "eager step."
        ) from e


@dataclasses.dataclass(frozen=True)
class Known:
    """The storages memlab can name at one moment: {(device, address): (category, bytes)}."""

    storages: dict[tuple[str, int], tuple[Category, int]]
    refs: dict[tuple[str, int], weakref.ref[torch.Tensor]]

    @staticmethod
    def of(model: nn.Module, opt: torch.optim.Optimizer | None) -> Known:
        storages: dict[tuple[str, int], tuple[Category, int]] = {}
        refs: dict[tuple[str, int], weakref.ref[torch.Tensor]] = {}

        def add(t: Any, category: Category) -> None:
            if not isinstance(t, torch.Tensor) or t.device.type == "meta":
                return
            s = t.untyped_storage()
            key = (str(t.device), s.data_ptr())
            if s.data_ptr() and key not in storages:  # shared storages once, the first role
                storages[key] = (category, s.nbytes())
                refs[key] = weakref.ref(t)

        params = list(model.parameters())
        for p in params:
            add(p, Category.PARAMETER)
        for b in model.buffers():
            add(b, Category.BUFFER)
        for o in _optimizers(opt):
            for state in o.state.values():
                for v in state.values():
                    add(v, Category.OPTIMIZER_STATE)
        for p in params:
            add(p.grad, Category.GRADIENT)
        return Known(storages, refs)

    def total(self) -> int:
        return sum(size for _, size in self.storages.values())

    def by_category(self, keys: Any = None) -> dict[Category, int]:
        out = dict.fromkeys(NAMED, 0)
        for key, (category, size) in self.storages.items():
            if keys is None or key in keys:
                out[category] += size
        return {c: v for c, v in out.items() if v}

    def throughout(self, after: Known) -> set[tuple[str, int]]:
        """The storages alive from this moment to ``after``: the same tensor still alive, on
        the same storage of the same size (held all along, so alive at any peak between)."""
        kept = set()
        for key, ref in self.refs.items():
            t = ref()
            if t is None or after.storages.get(key, (None, -1))[1] != self.storages[key][1]:
                continue
            if (str(t.device), t.untyped_storage().data_ptr()) == key:
                kept.add(key)
        return kept


def _optimizers(opt: torch.optim.Optimizer | None) -> list[torch.optim.Optimizer]:
    """The optimizer, or those it steps (`StepInBackward` keeps one per parameter)."""
    if opt is None:
        return []
    inner = getattr(opt, "inner", None)
    return [opt, *inner.values()] if isinstance(inner, dict) else [opt]


class CompiledRegion:
    """Stands in for `memlab.track` around the measured step of a compiled model: the same
    ``mark``, ``phase``, ``targets`` and ``report``, measured without a dispatch mode."""

    def __init__(
        self,
        device: torch.device,
        config: RunConfig,
        model: nn.Module,
        opt: torch.optim.Optimizer | None,
    ) -> None:
        self.device, self.config, self.model, self.opt = device, config, model, opt
        self.targets: list[Target] = resolve(str(device))
        self._cuda = track(device) if device.type == "cuda" else None
        self._record = AllocationRecord() if device.type == "cpu" else None
        self._before: Known | None = None
        self._t0 = self._seconds = 0.0
        self._t0_ns = 0
        self._report: MemoryReport | None = None

    def mark(self, t: torch.Tensor, category: Category = Category.INPUT) -> None:
        """Nothing to tell: the step's own tensors are not followed."""

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        yield

    def __enter__(self) -> CompiledRegion:
        self._before = Known.of(self.model, self.opt)
        if self._cuda is not None:
            self._cuda.__enter__()
        try:
            if self._record is not None:
                self._record.__enter__()
        except RuntimeError as e:  # a profiler of the user's is running
            raise WhatIfError(
                f"compile={self.config.compile!r} on the CPU is measured by PyTorch's profiler, "
                f"and {e}; or pass compile=False."
            ) from e
        self._t0, self._t0_ns = time.perf_counter(), time.time_ns()  # the record's clock
        return self

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._seconds = time.perf_counter() - self._t0
        if self._record is not None:
            self._record.__exit__(et, ev, tb)
        if self._cuda is not None:
            self._cuda.__exit__(et, ev, tb)
        if et is None:
            self._report = self._build(Known.of(self.model, self.opt))

    @property
    def report(self) -> MemoryReport:
        if self._report is None:
            raise RuntimeError("the compiled step was not measured to its end")
        return self._report

    def _timeline(self, events: tuple[tuple[int, int, int], ...], start: int) -> Timeline | None:
        """Every allocation and free of the record (thinned, the peak kept), its phases not
        known: "other" throughout."""
        totals = list(itertools.accumulate(size for _, size, _ in events))
        if not totals:
            return None
        keep = thin(totals)
        return Timeline(
            seconds=tuple(max(0.0, (events[i][0] - self._t0_ns) / 1e9) for i in keep),
            allocated=tuple(start + totals[i] for i in keep),
            phases=(Phase.NAMES[Phase.OTHER],) * len(keep),
            source=TimelineSource.ALLOCATION_RECORD,
        )

    def _build(self, after: Known) -> MemoryReport:
        before = self._before
        assert before is not None
        if self._cuda is not None:
            measured = self._cuda.report
            meter = "the CUDA caching allocator's counters"
        else:
            assert self._record is not None and self._record.result is not None
            rec, start = self._record.result, before.total()
            measured = MemoryReport(
                device=self.targets[0].name,
                source=Source.CPU_ALLOCATOR,
                allocated_before=start,
                allocated_after=start + rec.net,
                peak_allocated=start + rec.peak,
                seconds=self._seconds,
                timeline=self._timeline(rec.events, start),
            )
            meter = (
                "the CPU allocator's own record (PyTorch's profiler memory events; before the "
                "step: the parameters, buffers, gradients and optimizer state alive then)"
            )
        alive = before.throughout(after)
        at_peak = before.by_category(alive)
        at_end = after.by_category()
        at_peak[Category.UNATTRIBUTED] = measured.peak_allocated - sum(at_peak.values())
        at_end[Category.UNATTRIBUTED] = max(0, measured.allocated_after - sum(at_end.values()))
        # the named categories that held still: their highest is their value (gradients come
        # and go inside the step, unseen)
        still = {c: v for c, v in at_peak.items() if c in NAMED[:3] and at_end.get(c) == v}
        note = NOTE.format(mode=mode_of(self.config), n=warmups(self.config), meter=meter)
        return dataclasses.replace(
            measured,
            breakdown=Breakdown(at_peak, at_end, still),
            notes=(*measured.notes, note),
        )
