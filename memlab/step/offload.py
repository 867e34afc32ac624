"""Offload to host memory: a training step's ``offload="activations" | "optimizer" | "both"``.

Activations: the step runs under ``torch.autograd.graph.save_on_cpu`` (pinned when the device
is CUDA), whose pack hook is wrapped to count each host copy (`HostCopies`) and mark it
``Category.HOST``. A parameter saved for backward (a Linear saves ``weight.t()``) is left where
it is, since the device keeps it anyway; save_on_cpu alone would copy it too.

Optimizer: ZeRO-Offload's split in plain PyTorch (`HostOptimizer`): fp32 master copies of the
trainable parameters on the CPU and the optimizer built over them, so its state is made there;
each step copies the device's gradients into fp32 host buffers, steps on the CPU and copies the
masters back into the device's parameters. The device keeps the parameters and, from backward to
the step, the gradients; never the optimizer's state.

On a CPU run the device is the host: nothing moves, and the copies (save_on_cpu's ``.cpu()`` of
a CPU tensor is the tensor itself) are shown as ``host`` instead of activation or optimizer
state. On ``meta`` (the estimator) nothing can be copied to the CPU: the host copies are meta
tensors made outside every dispatch mode, so the device's accounting never sees them while
`HostCopies` counts their bytes; an unpack makes the tensor anew on the device, as the copy back
would on a GPU.
"""

from __future__ import annotations

import contextlib
import dataclasses
import weakref
from collections.abc import Callable, Iterator, Sequence
from itertools import chain
from typing import Any

import torch
from torch import nn

from memlab.core import _torch
from memlab.core.categories import Category
from memlab.core.host import HostCopies, HostFigures, host_allocator_stats
from memlab.core.roles import state_tensors
from memlab.core.storages import storage_of
from memlab.reports.host import HostMemory
from memlab.reports.report import MemoryReport
from memlab.step.config import Offload, RunConfig
from memlab.step.model import optimizer_over

Mark = Callable[..., None]


def unmarked(t: torch.Tensor, category: Category = Category.INPUT) -> None:
    """Marks where the step has no region (a warm-up, before the step): nothing is measured."""


class HostOffload:
    """One run's offload: what it keeps on the host, and the levers' contexts."""

    def __init__(self, config: RunConfig, device: torch.device, model: nn.Module) -> None:
        self.offload = Offload(config.offload)
        self.device = device
        self.meta = device.type == "meta"
        self.pin = device.type == "cuda"
        self.copies = HostCopies()
        self.mark: Mark = unmarked
        self.figures: HostFigures | None = None
        #: The host-side optimizer, held weakly (it holds this object: no reference cycle).
        self._optimizer: weakref.ref[HostOptimizer] | None = None
        #: Storages that stay on the device when saved: the parameters' and buffers'.
        self._stays = {
            id(s)
            for s in map(storage_of, chain(model.parameters(), model.buffers()))
            if s is not None
        }

    def hidden(self) -> contextlib.AbstractContextManager[Any]:
        """Where host copies are made: outside the device's accounting on meta."""
        return _torch.disable_current_modes() if self.meta else contextlib.nullcontext()

    def make_optimizer(
        self, model: nn.Module, config: RunConfig, foreach: bool | None
    ) -> torch.optim.Optimizer:
        params = [p for p in model.parameters() if p.requires_grad]
        if not self.offload.optimizer:
            return optimizer_over(params, config, foreach)
        opt = HostOptimizer(params, config, self)
        self._optimizer = weakref.ref(opt)
        return opt

    @contextlib.contextmanager
    def step(self, mark: Mark) -> Iterator[None]:
        """One step: its marks go to ``mark``; with activation offload, saved on the host."""
        self.mark = mark
        self.copies.begin()
        self.keep()  # what earlier steps left on the host (the optimizer's side)
        try:
            if not self.offload.activations:
                yield
            else:
                with self._saving():
                    yield
        finally:
            self.mark = unmarked
            self.figures = self.copies.figures()

    def keep(self) -> None:
        """Count and mark the host-side optimizer's tensors (its state appears at a step)."""
        opt = self._optimizer() if self._optimizer is not None else None
        if opt is None:
            return
        for kind, tensors in (
            ("master_weights", opt.masters),
            ("gradients", [g for g in opt.grads if g is not None]),
            ("optimizer_state", state_tensors(opt.inner)),
        ):
            for t in tensors:
                self.copies.add_tensor(t, kind, pinned=False)
                if not self.meta:  # on meta a mark would put the host copy on the device
                    self.mark(t, Category.HOST)

    def _saving(self) -> contextlib.AbstractContextManager[Any]:
        if self.meta:
            return torch.autograd.graph.saved_tensors_hooks(self._pack_meta, _unpack_meta)
        hooks = torch.autograd.graph.save_on_cpu(pin_memory=self.pin)
        pack = hooks.pack_hook

        def counted(t: torch.Tensor) -> Any:
            if self._stays_on_device(t):
                return (t.device, t.detach())  # unpacked by .to(its own device): itself
            device, packed = pack(t)
            if packed is t:  # a CPU tensor's .cpu() is itself: an alias, not tied to its grad_fn
                packed = t.detach()
            self.copies.add_tensor(packed, "activations", pinned=self.pin and packed.is_pinned())
            self.mark(packed, Category.HOST)
            return device, packed

        hooks.pack_hook = counted
        return hooks

    def _stays_on_device(self, t: torch.Tensor) -> bool:
        s = storage_of(t)
        return s is None or id(s) in self._stays

    def _pack_meta(self, t: torch.Tensor) -> Any:
        if self._stays_on_device(t):
            return (None, t.detach())
        with self.hidden():  # as save_on_cpu's pinned copy: contiguous, the tensor's size
            packed = torch.empty(t.size(), dtype=t.dtype, device=t.device)
        self.copies.add_tensor(packed, "activations", pinned=True)
        return (t.device, packed)

    def attach(self, report: MemoryReport) -> MemoryReport:
        """``report`` with the host figures of the last step (unchanged without offload)."""
        f = self.figures
        if self.offload == Offload.OFF or f is None:
            return report
        host = HostMemory(
            before=f.before,
            after=f.after,
            peak=f.peak,
            pinned_peak=f.pinned_peak,
            at_end=f.at_end,
            highest=f.highest,
            allocator=host_allocator_stats() if self.device.type == "cuda" else None,
        )
        return dataclasses.replace(report, host=host)


def _unpack_meta(packed: tuple[torch.device | None, torch.Tensor]) -> torch.Tensor:
    device, tensor = packed
    if device is None:
        return tensor
    # the copy back, made anew on meta; from sizes alone: an op that read the host copy would
    # show it to the device's accounting
    return torch.empty(tensor.size(), dtype=tensor.dtype, device=device)


def _unhooked_step(opt: torch.optim.Optimizer) -> None:
    """``opt.step()`` without the global optimizer hooks: the accounting learns the host
    tensors' role from `HostOffload.keep`, and on meta must not see them at all. (torch wraps
    each optimizer class's ``step`` with functools.wraps, which keeps ``__wrapped__``.)"""
    step = type(opt).step
    getattr(step, "__wrapped__", step)(opt)


class HostOptimizer(torch.optim.Optimizer):
    """The optimizer ``config`` names, stepped on the host over fp32 master copies of the
    device's parameters (ZeRO-Offload's split). Its ``param_groups`` are the device's
    parameters (a gradient scaler unscales their gradients there); its ``state`` is the host
    optimizer's."""

    def __init__(self, params: Sequence[torch.Tensor], config: RunConfig, off: HostOffload) -> None:
        self.off = off
        self.device_params = list(params)
        host = "meta" if off.meta else "cpu"
        with off.hidden(), torch.no_grad():
            self.masters = [p.detach().to(host, torch.float32, copy=True) for p in params]
        self.grads: list[torch.Tensor | None] = [None] * len(params)
        self.inner = optimizer_over(list(self.masters), config)
        super().__init__(params, dict(self.inner.defaults))
        if not off.meta:  # (the accounting watches an optimizer's state: on meta, the device's)
            self.state = self.inner.state

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        with self.off.hidden():
            for i, (p, m) in enumerate(zip(self.device_params, self.masters, strict=True)):
                if p.grad is None:
                    m.grad = None
                    continue
                g = self.grads[i]
                if g is None:
                    g = self.grads[i] = torch.empty_like(m)
                g.copy_(p.grad)
                m.grad = g
            _unhooked_step(self.inner)
            for p, m in zip(self.device_params, self.masters, strict=True):
                if m.grad is not None:
                    p.copy_(m)
        self.off.keep()
        return None
