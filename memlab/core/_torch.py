"""The seam: every private PyTorch name memlab uses is used here and nowhere else.

Each entry says why memlab needs it and the torch releases it was checked on (2.4.1, the oldest
memlab supports; 2.11 on the GPU machine; 2.13 here). A test fails when a module outside this
file names a private torch attribute; when PyTorch moves one, this is the one file to change.
Monkey-patches of torch made by memlab go through `patched`, which holds one lock for all.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

# The dispatch-level hook that sees every op's outputs (tensor accounting, the estimator's
# kernel emulations). Public in use and in PyTorch's own tools, private in its module path.
# Checked 2.4.1, 2.11, 2.13.
from torch.utils._python_dispatch import TorchDispatchMode as TorchDispatchMode
from torch.utils._python_dispatch import _disable_current_modes

#: Functions ``torch._VF`` exposes (the recurrent layers call ``_VF.lstm``). Checked 2.4.1-2.13.
VF: Any = torch._VF
aten = torch.ops.aten


def disable_current_modes() -> contextlib.AbstractContextManager[Any]:
    """Runs the block outside every dispatch mode (the estimator builds the model there, out of
    its own accounting). Checked 2.4.1, 2.11, 2.13."""
    return _disable_current_modes()


def current_autograd_node() -> Any:
    """The autograd node being run by backward on this thread, None outside backward: how the
    accounting tells backward from forward. Checked 2.4.1, 2.11, 2.13."""
    return torch._C._current_autograd_node()


def queue_backward_callback(callback: Callable[[], None]) -> None:
    """Runs ``callback`` when the current backward pass ends (where gradients are known to be
    final). Only valid inside backward. Checked 2.4.1, 2.11, 2.13."""
    torch.autograd.Variable._execution_engine.queue_callback(callback)


def sequence_nr(node: Any) -> int:
    """An autograd node's creation number (increases with creation, per thread): how graphs
    order nodes and charge a saved storage to the earliest. Checked 2.4.1, 2.11, 2.13."""
    return int(node._sequence_nr())


_peek = getattr(torch._C._autograd, "_get_sequence_nr", None)


def next_sequence_nr() -> int | None:
    """The sequence number the next node created on this thread will get (None where this
    PyTorch lacks the call): a module's watermark for the nodes it creates. Checked 2.4.1-2.13."""
    return None if _peek is None else int(_peek())


#: Autograd nodes expose what they saved for backward as ``_saved_<name>`` attributes (reading
#: one after backward raises). Checked 2.4.1, 2.11, 2.13.
SAVED_PREFIX = "_saved_"


def saved_attribute_names(node: Any) -> tuple[str, ...]:
    """The names of the attributes through which ``node`` exposes its saved tensors."""
    return tuple(n for n in dir(node) if n.startswith(SAVED_PREFIX))


def apply_to_tensors(module: torch.nn.Module, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """``module._apply(fn)``: replaces every parameter and buffer by ``fn`` of it, in the order
    ``.to()`` moves them (the estimator places a model on the simulated GPU this way). Checked
    2.4.1, 2.11, 2.13."""
    module._apply(fn)


def has_meta_kernel(op_name: str) -> bool:
    """Whether ``aten::<op_name>`` has a meta kernel (before 2.5 the attention kernels' forwards
    had none). Checked 2.4.1, 2.11, 2.13."""
    return bool(torch._C._dispatch_has_kernel_for_dispatch_key(f"aten::{op_name}", "Meta"))


def destroy_library(library: torch.library.Library) -> None:
    """Removes the kernels a ``torch.library.Library`` registered (there is no public call).
    Checked 2.4.1, 2.11, 2.13."""
    library._destroy()


def memory_snapshot() -> dict[str, Any]:
    """``torch.cuda.memory._snapshot()``: the CUDA caching allocator's segments and, while its
    history is recorded, every event (the allocator-trace tools). Checked 2.4.1, 2.11."""
    return torch.cuda.memory._snapshot()  # type: ignore[no-any-return]


def record_memory_history(on: bool = True, max_entries: int = 1_000_000) -> None:
    """``torch.cuda.memory._record_memory_history``: starts (without stack frames, so traces
    stay small) or stops the CUDA caching allocator's event log. Checked 2.4.1, 2.11."""
    if on:
        torch.cuda.memory._record_memory_history(context=None, max_entries=max_entries)
    else:
        torch.cuda.memory._record_memory_history(enabled=None)


# The native fused ops the estimator emulates on meta as a GPU runs them. Checked 2.4.1-2.13.
native_multi_head_attention: Any = torch._native_multi_head_attention
transformer_encoder_layer_fwd: Any = torch._transformer_encoder_layer_fwd
cudnn_rnn: Any = torch._cudnn_rnn
flash_attention: Any = aten._scaled_dot_product_flash_attention
efficient_attention: Any = aten._scaled_dot_product_efficient_attention
addmm_activation: Any = aten._addmm_activation
#: Op names (as dispatch sees them) of the attention kernels' forwards.
FLASH_ATTENTION = "_scaled_dot_product_flash_attention"
EFFICIENT_ATTENTION = "_scaled_dot_product_efficient_attention"
EFFICIENT_ATTENTION_FORWARD = "_efficient_attention_forward"


@contextlib.contextmanager
def privateuse1_named(name: str) -> Iterator[None]:
    """For the block, PyTorch's private-backend name is ``name``: the transformer layers' fast
    paths run only on the devices they list, that name among them (the estimator lets ``meta``
    take them). Checked 2.4.1, 2.11, 2.13."""
    import torch.utils.backend_registration as registration

    before = registration._privateuse1_backend_name
    registration._privateuse1_backend_name = name
    try:
        yield
    finally:
        registration._privateuse1_backend_name = before


#: One lock for every patch memlab makes to torch (the autocast emulation, the estimator's
#: kernels): re-entrant, so one patcher may run inside another on the same thread.
PATCH_LOCK = threading.RLock()
_MISSING = object()


@contextlib.contextmanager
def patched(patches: Sequence[tuple[Any, str, Any]]) -> Iterator[None]:
    """For the block, ``setattr(owner, name, new)`` for each patch, under `PATCH_LOCK`; on exit,
    also on an exception, each attribute is as it was (deleted where it was inherited or found
    through ``__getattr__``, as ``torch._VF``'s functions are)."""
    with PATCH_LOCK:
        before: list[tuple[Any, str, Any]] = []
        try:
            for owner, name, new in patches:
                before.append((owner, name, owner.__dict__.get(name, _MISSING)))
                setattr(owner, name, new)
            yield
        finally:
            for owner, name, old in reversed(before):
                if old is _MISSING:
                    delattr(owner, name)
                else:
                    setattr(owner, name, old)


def fused_op_patches(mha: Any, encoder_layer: Any, lstm: Any) -> list[tuple[Any, str, Any]]:
    """Patches (for `patched`) that replace the fused native ops the estimator emulates:
    ``torch._native_multi_head_attention``, ``torch._transformer_encoder_layer_fwd`` and
    ``torch._VF.lstm``, which PyTorch's modules look up at each call. Checked 2.4.1-2.13."""
    return [
        (torch, "_native_multi_head_attention", mha),
        (torch, "_transformer_encoder_layer_fwd", encoder_layer),
        (VF, "lstm", lstm),
    ]
