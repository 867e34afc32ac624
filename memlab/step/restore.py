"""Leaving the user's model as it was after a run: its values, gradients, modes and bindings,
put back part by part, so that one part that cannot be put back leaves the others done."""

from __future__ import annotations

import contextlib
import functools
import importlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from memlab.core.frames import memlabs
from memlab.step.leftovers import Leftovers, left_behind


@contextlib.contextmanager
def restored(model: nn.Module, weights: bool) -> Iterator[Leftovers]:
    """Leave ``model`` as it was: modes, gradients, its parameters' and buffers' objects (a
    forward that rebinds a buffer, ``self.n = self.n + 1``, gets the original back),
    ``requires_grad``, the storage each of them holds (a step_fn's ``model.half()`` or
    ``.to(device)`` swaps their ``.data``: the original storage, its dtype and device come
    back), and the buffers' values (a forward may update them in any mode); with ``weights``
    (a training step), the parameters' values too. The gradients are taken off the parameters
    for the block (a backward would add into them in place) and put back as they were. Values
    are kept as copies on the CPU: a copy on the GPU would double what the run measures (a
    swapped-out storage stays alive until it is put back, as the user's model holds it).
    Yields the models of earlier runs still alive beside it (`memlab.step.leftovers`)."""
    shapes = [(m, _shape(m)) for m in model.modules()]  # train/eval flags, bindings, hooks
    held = [
        (m, name, t, isinstance(t, nn.Parameter))
        for m in model.modules()
        for name, t in (*m.named_parameters(recurse=False), *m.named_buffers(recurse=False))
    ]
    storages = list({id(t): (t, t.data) for _, _, t, _ in held}.values())
    hooked = [(t, name, _hooks_of(t, name)) for t, _ in storages for name in TENSOR_HOOKS]
    grads = [(p, p.grad, p.requires_grad) for _, _, p, param in held if param]
    for p, _, _ in grads:
        p.grad = None
    state = _torch_state()  # the step_fn's set_default_dtype(...), set_grad_enabled(False)
    kept = {id(t): t for _, _, t, param in held if (weights or not param) and not t.is_meta}
    with torch.no_grad():  # a tied weight once; meta tensors hold no values
        values = [(t, t.detach().to("cpu", copy=True)) for t in kept.values()]
    try:
        with own_global_hooks():  # (a step_fn's register_module_forward_hook, say: removed)
            yield left_behind(model)
    finally:  # each part, even if one before it failed: the values first, as the user sees them
        _each(
            functools.partial(_rebind, storages),
            functools.partial(_put_back, values),
            functools.partial(_regrad, grads),
            *(functools.partial(_unhook, t, name, was) for t, name, was in hooked),
            *(functools.partial(_reshape, m, shape) for m, shape in shapes),
            functools.partial(_torch_state_back, state),
        )


def _torch_state() -> tuple[torch.dtype, bool, Any]:
    """torch's default dtype, this thread's grad mode and torch's default device (2.3 on)."""
    device = getattr(torch, "get_default_device", None)
    return torch.get_default_dtype(), torch.is_grad_enabled(), device() if device else None


def _torch_state_back(state: tuple[torch.dtype, bool, Any]) -> None:
    """What the run changed of `_torch_state`, put back (what it left alone, left alone)."""
    dtype, grad, device = state
    now = _torch_state()
    if now[0] != dtype:
        torch.set_default_dtype(dtype)
    if now[1] != grad:
        torch.set_grad_enabled(grad)
    if device is not None and now[2] != device:
        torch.set_default_device(None if device == torch.device("cpu") else device)


def _each(*steps: Callable[[], None]) -> None:
    """Every step, then the first error any of them raised (a restore that fails halfway
    would leave the user's model half as it was)."""
    first: BaseException | None = None
    for step in steps:
        try:
            step()
        except BaseException as e:
            first = first or e
    if first is not None:
        raise first


def _rebind(storages: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Each tensor on the storage it held before, where the run set another under it
    (``Module.half()``, ``.double()``, ``.to(device)`` keep the Parameter and swap its
    ``.data``): copying the saved values into the new one would cast them, and round them."""

    def one(t: torch.Tensor, data: torch.Tensor) -> Callable[[], None]:
        def put() -> None:
            with torch.inference_mode() if t.is_inference() else torch.no_grad():
                t.data = data

        return put

    _each(*(one(t, d) for t, d in storages if not _same(t, d)))


def _same(t: torch.Tensor, d: torch.Tensor) -> bool:
    """Whether ``t`` still holds ``d``'s storage, as ``d`` does (``is_set_to`` has no meta
    kernel: a meta tensor's storage has no address, and its layout alone is compared)."""
    if t.layout != torch.strided:  # (a sparse tensor's layout has no strides: left as it is)
        return True
    if (t.dtype, t.device, t.shape, t.stride()) != (d.dtype, d.device, d.shape, d.stride()):
        return False
    if t.storage_offset() != d.storage_offset():
        return False
    return t.is_meta or t.untyped_storage().data_ptr() == d.untyped_storage().data_ptr()


def _put_back(values: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Each value back, every one of them even where one fails (a buffer a forward resized in
    place no longer takes its old shape: the rest of the model still goes back)."""

    def one(t: torch.Tensor, v: torch.Tensor) -> Callable[[], None]:
        def put() -> None:  # a model made under inference_mode: its tensors written in one
            with torch.inference_mode() if t.is_inference() else torch.no_grad():
                t.copy_(v)

        return put

    _each(*(one(t, v) for t, v in values))


#: A tensor's own hooks (``p.register_hook``, ``p.register_post_accumulate_grad_hook``).
TENSOR_HOOKS = ("_backward_hooks", "_post_accumulate_grad_hooks")


def _hooks_of(t: torch.Tensor, name: str) -> tuple[Any, dict[Any, Any] | None]:
    """The dict of hooks ``name`` (None until a first hook is registered), and its contents."""
    d = getattr(t, name, None)
    return d, dict(d) if isinstance(d, dict) else None


def _unhook(t: torch.Tensor, name: str, was: tuple[Any, dict[Any, Any] | None]) -> None:
    """The hooks ``name`` of ``t`` as they were: those the run registered, removed. Emptied in
    place, since autograd calls the dict it was handed; a dict set in place of the first, the
    first set back (None, for ``_backward_hooks``, also unregisters autograd's own)."""
    d, (first, kept) = getattr(t, name, None), was
    if not isinstance(d, dict) or (d is first and d == kept):
        return
    d.clear()
    if d is first and kept is not None:
        d.update(kept)
    else:
        setattr(t, name, first)


def _regrad(grads: list[tuple[torch.Tensor, torch.Tensor | None, bool]]) -> None:
    for p, g, requires_grad in grads:
        p.grad = g
        if p.requires_grad != requires_grad:  # an inference tensor's may not be set again
            p.requires_grad_(requires_grad)


def _shape(m: nn.Module) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """The names ``m`` binds and the object bound to each: its attributes, parameters,
    buffers and children (a forward may add or rebind any of them). Only plain dicts: a
    TorchScript module's are views of its C++ object (``OrderedDictWrapper``), which a forward
    cannot rebind and which cannot be cleared. And its hooks' dicts, whose contents a step_fn's
    ``register_forward_hook`` changes without rebinding them."""
    hooks = [d for name, d in vars(m).items() if "hooks" in name and isinstance(d, dict)]
    own = [vars(m), m._parameters, m._buffers, m._modules, *hooks]
    return [(d, dict(d)) for d in own if isinstance(d, dict)]


def _reshape(m: nn.Module, shape: list[tuple[dict[str, Any], dict[str, Any]]]) -> None:
    """Each name of ``m`` bound as `_shape` saw it: what a run added, removed; what it
    rebound, back (a forward's ``self.register_buffer(...)`` or ``self.calls += 1``)."""
    for live, kept in shape:
        if live.keys() != kept.keys() or any(live[k] is not v for k, v in kept.items()):
            live.clear()
            live.update(kept)
    buffers, names = m._buffers, getattr(m, "_non_persistent_buffers_set", None)
    if isinstance(buffers, dict) and isinstance(names, set):  # (not a TorchScript module's)
        names &= set(buffers)


#: The functions that register a hook on every module or every optimizer, by module.
_REGISTERS = {
    "torch.nn.modules.module": (
        "register_module_forward_pre_hook",
        "register_module_forward_hook",
        "register_module_backward_hook",
        "register_module_full_backward_pre_hook",
        "register_module_full_backward_hook",
        "register_module_buffer_registration_hook",
        "register_module_module_registration_hook",
        "register_module_parameter_registration_hook",
    ),
    "torch.optim.optimizer": (
        "register_optimizer_step_pre_hook",
        "register_optimizer_step_post_hook",
    ),
}
_lock = threading.Lock()
_users = 0
_installed: list[tuple[Any, str, Any, Any]] = []  # (module, name, torch's, memlab's)
_mine = threading.local()  # this thread's list of handles, while a block of it runs


@contextlib.contextmanager
def own_global_hooks() -> Iterator[None]:
    """Within the block, the global module and optimizer hooks this thread registers (through
    torch's ``register_module_*_hook`` and ``register_optimizer_step_*_hook``) are taken out at
    its end; those other threads register meanwhile (the user's cell beside the panel's run),
    and memlab's own, stay. A program that kept a reference to a register function from before
    the block registers through it unseen, and its hook stays too."""
    global _users
    with _lock:
        if _users == 0:
            _install()
        _users += 1
    outer = getattr(_mine, "handles", None)
    handles: list[Any] = []
    _mine.handles = handles
    try:
        yield
    finally:
        _mine.handles = outer
        try:
            _each(*(h.remove for h in handles))
        finally:
            with _lock:
                _users -= 1
                if _users == 0:
                    _uninstall()


def _install() -> None:
    for module_name, names in _REGISTERS.items():
        module = importlib.import_module(module_name)
        for name in names:
            torchs = getattr(module, name, None)
            if callable(torchs):
                ours = _recording(torchs)
                setattr(module, name, ours)
                _installed.append((module, name, torchs, ours))


def _uninstall() -> None:
    while _installed:
        module, name, torchs, ours = _installed.pop()
        if getattr(module, name, None) is ours:  # (replaced by the program since: left as it is)
            setattr(module, name, torchs)


def _recording(register: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(register)
    def recorded(hook: Any, *args: Any, **kwargs: Any) -> Any:
        handle = register(hook, *args, **kwargs)
        handles = getattr(_mine, "handles", None)
        if handles is not None and not memlabs(hook):
            handles.append(handle)
        return handle

    return recorded
