"""Which devices a region measures, validated once, with errors that say what to do."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from memlab.core.choices import Source


class DeviceError(ValueError):
    """A device that cannot be measured on this machine."""


@dataclass(frozen=True)
class Target:
    """One device to measure: CUDA devices through the allocator, others through accounting."""

    name: str
    index: int | None = None

    @property
    def is_cuda(self) -> bool:
        return self.index is not None

    @property
    def source(self) -> Source:
        return Source.CUDA_ALLOCATOR if self.is_cuda else Source.TENSOR_ACCOUNTING


_CPU = Target("cpu")


def _cuda_count() -> int:
    # is_available() and device_count() do not create a CUDA context.
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _current() -> int:
    """The current CUDA device, without initialising CUDA to ask (before initialisation it is
    always 0: the first visible device)."""
    return torch.cuda.current_device() if torch.cuda.is_initialized() else 0


def _module_name(kind: str) -> str:
    return "torch.backends.mps" if kind == "mps" else f"torch.{kind}"


def _available(kind: str) -> bool:
    """Whether this machine has a device of ``kind`` (``mps``, ``xpu``, a backend registered
    under its own name): where PyTorch's module for it says so."""
    module = getattr(torch.backends, kind, None) if kind == "mps" else getattr(torch, kind, None)
    is_available = getattr(module, "is_available", None)
    try:
        return callable(is_available) and bool(is_available())
    except Exception:  # (a backend that cannot tell: not there)
        return False


def resolve(spec: str | torch.device | None) -> list[Target]:
    """``None``/``"auto"``: the current CUDA device if there is one, else the CPU.
    ``"all"``: every CUDA device. Any other torch device string names one device."""
    if type(spec) is str and spec == "cpu":  # (the magics' device on a CPU: every cell)
        return [_CPU]
    if spec is None or spec == "auto":
        if _cuda_count():
            return [Target(f"cuda:{_current()}", _current())]
        return [Target("cpu")]
    if spec == "all":
        n = _cuda_count()
        if not n:
            raise DeviceError(
                "'all' means every CUDA device, and this machine has none "
                "(torch.cuda.is_available() is False). Use 'cpu' for tensor accounting, "
                "or leave the device out."
            )
        return [Target(f"cuda:{i}", i) for i in range(n)]
    try:
        dev = torch.device(spec)
    except (RuntimeError, TypeError) as e:
        raise DeviceError(
            f"{spec!r} is not a device. Use 'cpu', 'cuda', 'cuda:N', 'meta', or 'all'."
        ) from e
    if dev.type in ("cpu", "meta"):  # one of each: "cpu:0" is the CPU its tensors say "cpu" of
        return [Target(dev.type)]
    if dev.type != "cuda":
        if not _available(dev.type):
            raise DeviceError(
                f"{spec!r}: no {dev.type} device is available here ({_module_name(dev.type)} "
                "says none, or PyTorch has no module for it). Use 'cpu' to measure with tensor "
                "accounting, 'cuda' / 'cuda:N' / 'all' on a GPU, 'meta', or leave the device out."
            )
        return [Target(str(dev))]
    n = _cuda_count()
    if not n:
        raise DeviceError(
            f"{spec!r}: no CUDA device is available here (torch.cuda.is_available() is False). "
            "Use 'cpu' to measure with tensor accounting, or leave the device out."
        )
    index = _current() if dev.index is None else dev.index
    if index >= n:
        names = ", ".join(f"cuda:{i}" for i in range(n))
        raise DeviceError(
            f"{spec!r} does not exist: this machine has {n} CUDA device(s) ({names}). "
            "Use one of those, 'all', or 'cpu'."
        )
    return [Target(f"cuda:{index}", index)]
