"""The seam: every private PyTorch name memlab uses is used here and nowhere else.

Each entry says why memlab needs it and the torch releases it was checked on (2.4.1, the oldest
memlab supports; 2.11 on the GPU machine; 2.13 here). A test fails when a module outside this
file names a private torch attribute; when PyTorch moves one, this is the one file to change.
Monkey-patches of torch made by memlab go through `patched`, which holds one lock for all.
The profiler's allocation record, the seam's other file, is in `_torch_record.py`.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch.utils import _python_dispatch as _pd

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


def has_kernel(op_name: str, key: str) -> bool:
    """Whether ``aten::<op_name>`` (an overload as ``name.overload``) has a kernel for the
    dispatch key ``key`` ("AutocastCUDA": whether CUDA's autocast casts at that op, or lets
    the op's composite run). Checked 2.13."""
    return bool(torch._C._dispatch_has_kernel_for_dispatch_key(f"aten::{op_name}", key))


def destroy_library(library: torch.library.Library) -> None:
    """Removes the kernels a ``torch.library.Library`` registered (no public call). 2.4.1-2.13."""
    library._destroy()


def impl_over_composite(library: torch.library.Library, name: str, fn: Any, key: str) -> None:
    """``library.impl``, also over a composite or Python meta kernel (refused). 2.11, 2.13."""
    library.m.impl(name, key, fn, False)  # type: ignore[union-attr]


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


# Ops the estimator runs on meta as GPUs do (fused ones; log_softmax's backward). 2.4.1-2.13.
native_multi_head_attention: Any = torch._native_multi_head_attention
transformer_encoder_layer_fwd: Any = torch._transformer_encoder_layer_fwd
flash_attention: Any = aten._scaled_dot_product_flash_attention
efficient_attention: Any = aten._scaled_dot_product_efficient_attention
efficient_attention_backward: Any = aten._scaled_dot_product_efficient_attention_backward
addmm_activation: Any = aten._addmm_activation
log_softmax_backward: Any = aten._log_softmax_backward_data
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


# -- the dispatch-mode stack ------------------------------------------------------------------
# A mode's ``__exit__`` pops whatever mode is on top of the stack, not itself. memlab's modes
# (`OwnedMode`) go in beneath the modes a program already has on (so that the program's
# ``__exit__`` of its own mode, even in a later cell, pops its own) and leave by removing
# exactly themselves. Uses the stack's private push, pop and listing, and the module's "in a
# mode" flags. Checked 2.4.1, 2.11, 2.13.


def dispatch_mode_stack() -> list[Any]:
    """The dispatch modes on now, innermost (processed last) first."""
    return list(_pd._get_current_dispatch_mode_stack())


def _infra(mode: Any) -> bool:
    is_infra = getattr(mode, "is_infra_mode", None)
    return bool(is_infra()) if callable(is_infra) else "_mode_key" in vars(mode)


def _sync_mode_flags() -> None:
    """The module's "in a mode" flags, from the stack as it is (after memlab moved modes)."""
    stack = dispatch_mode_stack()
    _pd._is_in_torch_dispatch_mode = bool(stack)
    if hasattr(_pd, "_is_in_non_infra_torch_dispatch_mode"):
        _pd._is_in_non_infra_torch_dispatch_mode = any(not _infra(m) for m in stack)
    if hasattr(_pd, "set_is_in_mode_without_ignore_compile_internals"):
        flag = any(not getattr(m, "ignore_compile_internals", lambda: False)() for m in stack)
        _pd._is_in_any_mode_without_ignore_compile_internals = flag
        _pd.set_is_in_mode_without_ignore_compile_internals(flag)


class OwnedMode(TorchDispatchMode):
    """A dispatch mode of memlab's. Enters beneath the program's modes that sit above memlab's
    own (or all of them), and exits by removing itself wherever it is. ``misplaced`` then says
    what it found, when it was not on top."""

    misplaced: str | None = None
    _beneath: list[Any] = []  # noqa: RUF012  (set per instance on entering)

    def __enter__(self) -> OwnedMode:
        stack = dispatch_mode_stack()
        k = len(stack)
        while k and not isinstance(stack[k - 1], OwnedMode) and not _infra(stack[k - 1]):
            k -= 1
        above = stack[k:]
        self._beneath = above  # the program's modes memlab went in under
        for _ in above:
            _pd._pop_mode()
        try:
            super().__enter__()
        finally:
            for mode in above:
                _pd._push_mode(mode)
        if above:
            _sync_mode_flags()
        return self

    def __exit__(self, *exc: Any) -> None:
        stack = dispatch_mode_stack()
        if stack and stack[-1] is self:
            super().__exit__(*exc)
            return
        if not any(m is self for m in stack):
            self.misplaced = (
                "memlab's dispatch mode was removed by other code (a mode's __exit__ removes "
                "the mode on top, whichever it is)"
            )
            return
        above = []
        while dispatch_mode_stack()[-1] is not self:
            above.append(_pd._pop_mode())
        super().__exit__(*exc)
        for mode in reversed(above):
            _pd._push_mode(mode)
        _sync_mode_flags()
        new = [m for m in reversed(above) if not isinstance(m, OwnedMode)]  # another region's
        names = ", ".join(type(m).__name__ for m in new if all(m is not b for b in self._beneath))
        if names:
            self.misplaced = (
                f"dispatch mode(s) the code entered and left on: {names}; memlab removed only "
                "its own and left them on"
            )


# -- saved-tensor hooks -----------------------------------------------------------------------
# Only the top (pack, unpack) pair applies. Reading the top pair is private (it was added
# after 2.4: where it is missing, memlab cannot see the program's hooks). Checked 2.11, 2.13.
_top_hooks = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)


def saved_tensors_hooks_on() -> tuple[Any, Any] | None:
    """The (pack, unpack) pair in force now, or None (none, or this torch cannot tell)."""
    return None if _top_hooks is None else _top_hooks(True)


def push_saved_tensors_hooks(pack: Any, unpack: Any) -> None:
    """Puts (pack, unpack) in force, as ``saved_tensors_hooks.__enter__`` does."""
    torch._C._autograd._push_saved_tensors_default_hooks(pack, unpack)


def remove_saved_tensors_hooks(pack: Any) -> bool:
    """Removes the pair whose pack hook is ``pack``, wherever it is, and puts back the pairs
    pushed after it, in order. False (and nothing changed) where it is not found."""
    if _top_hooks is None:  # cannot look: assume it is on top, as a context manager would
        torch._C._autograd._pop_saved_tensors_default_hooks()
        return True
    above = []
    found = False
    while (top := _top_hooks(True)) is not None:
        torch._C._autograd._pop_saved_tensors_default_hooks()
        if top[0] == pack:
            found = True
            break
        above.append(top)
    for pair in reversed(above):
        push_saved_tensors_hooks(*pair)
    return found
