"""The seam, continued: PyTorch's own record of tensor allocations (the profiler's memory events).

Like ``_torch.py``, the one place these private names are used (tests/test_layers.py allows the
two files). The profiler reports every allocation and free its CPU allocator makes, from C++,
inside compiled code too, where a Python dispatch mode sees nothing. Enabled with a record scope
that no op uses, it records no op at all: the step runs at nearly its own speed and the cost
moves to reading the record when it stops (a few microseconds an allocation).
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from typing import Any

import torch

from memlab.core.warn import quiet_compile_hooks

_missing: str | None = None
_p: Any = None
_autograd: Any = torch.autograd
try:  # Checked 2.4.1, 2.11, 2.13.
    from torch._C import _profiler as _p

    for _name in ("ProfilerConfig", "ProfilerState", "RecordScope", "_ExperimentalConfig"):
        getattr(_p, _name)
    for _name in ("_prepare_profiler", "_enable_profiler", "_disable_profiler"):
        getattr(_autograd, _name)
except (ImportError, AttributeError) as err:  # a PyTorch that moved them: said where used
    _missing = str(err)


def allocation_record_available() -> str | None:
    """None where this PyTorch can record allocations, else why not. Checked 2.4.1, 2.11, 2.13."""
    return _missing


@contextlib.contextmanager
def _quiet_stderr() -> Iterator[None]:
    """The profiler's C++ side prints a line to the process's stderr as it starts and stops
    ("profiler_start", "profiler_stop"), which a notebook shows under the cell: for the length
    of those calls, file descriptor 2 points at /dev/null, then back where it was."""
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError, AttributeError):  # no usable stderr: nothing to quiet
        yield
        return
    try:
        null = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(null, 2)
        finally:
            os.close(null)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def _config() -> Any:
    # state, report_input_shapes, profile_memory, with_stack, with_flops, with_modules, experimental
    return _p.ProfilerConfig(
        _p.ProfilerState.KINETO, False, True, False, False, False, _p._ExperimentalConfig()
    )


def start_allocation_record() -> None:
    """Starts the profiler with memory events on and no op records (the scope it records is one
    no op runs in). Raises RuntimeError where a profiler is already running on this thread.
    Checked 2.4.1, 2.11, 2.13."""
    if _missing is not None:
        raise RuntimeError(f"this PyTorch cannot record allocations ({_missing})")
    if _autograd._profiler_enabled():
        raise RuntimeError(
            "a PyTorch profiler is already running; the allocation record uses the profiler "
            "too, so it cannot start inside one (stop the profiler first)"
        )
    activities = {_p.ProfilerActivity.CPU}
    with _quiet_stderr():
        _autograd._prepare_profiler(_config(), activities)
        _autograd._enable_profiler(_config(), activities, {_p.RecordScope.LITE_INTERPRETER})


def stop_allocation_record() -> list[tuple[int, int, int]]:
    """Stops the record started above and returns its allocations in order: (time in ns, bytes
    (negative for a free), address). Raises RuntimeError where a profiler started inside the
    record has ended it (the record then holds nothing). Checked 2.4.1, 2.11, 2.13."""
    if not _autograd._profiler_enabled():
        raise RuntimeError(
            "the allocation record was ended by a PyTorch profiler started inside it, so it "
            "holds no allocation: profile outside the measured code, or measure without the "
            "profiler"
        )
    with _quiet_stderr():
        result = _autograd._disable_profiler()
    events: list[tuple[int, int, int]] = []
    stack = list(result.experimental_event_tree())
    while stack:
        node = stack.pop()
        stack.extend(node.children)
        if node.tag == _p._EventType.Allocation:
            extra: Any = node.extra_fields
            events.append((int(node.start_time_ns), int(extra.alloc_size), int(extra.ptr)))
    events.sort(key=lambda e: e[0])
    return events


def cxx11_abi() -> bool:
    """Whether this PyTorch was built with the C++11 string ABI: memlab's native record
    (`memlab.core.native`) is compiled to match. Checked 2.13."""
    return bool(getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", True))


def storage_from_weak(weak: int) -> torch.UntypedStorage | None:
    """The storage behind a weak reference to a C++ ``StorageImpl`` (an address the native
    record handed out, holding one weak count), or None if the storage has died; the weak
    count is released either way. PyTorch keeps one Python object per live storage, so this is
    the object ``tensor.untyped_storage()`` gives. Checked 2.13."""
    try:
        found: torch.UntypedStorage | None = torch.UntypedStorage._new_with_weak_ptr(weak)
        return found
    finally:
        torch.UntypedStorage._free_weak_ref(weak)


def can_force_eager() -> bool:
    """Whether torch.compile has stances (``torch.compiler.set_stance``, PyTorch 2.6 on).
    Checked 2.13."""
    return callable(getattr(torch.compiler, "set_stance", None))


def force_eager() -> Any:
    """Compiled functions run eagerly from now (the "force_eager" stance), as they do under a
    dispatch mode: a region measured without one (the native record) then gets the figures
    the dispatch mode's accounting gets. Returns the stance it replaced, for
    ``restore_stance``; raises RuntimeError inside a compiled region. Does what torch._dynamo's
    private setter does (refuse inside a compiled region, swap the module's stance) without
    its per-call import: ``torch.compiler.set_stance`` costs several times more, and this runs
    at every native region. Checked 2.13."""
    if "module" not in _FORCED:
        from memlab.core.warmup import warm_up

        warm_up()  # imports torch._dynamo on a thread of its own, after any other thread's
        import torch._dynamo.eval_frame as module
        from torch._C._dynamo.eval_frame import get_eval_frame_callback

        _FORCED["module"], _FORCED["callback"] = module, get_eval_frame_callback
        _FORCED["stance"] = module.DynamoStance("force_eager")
    ef: Any = _FORCED["module"]
    if _FORCED["callback"]() not in (False, None):
        raise RuntimeError("attempted to set_stance in a torch.compile region")
    prior = ef._stance
    ef._stance = _FORCED["stance"]
    return prior


def restore_stance(prior: Any) -> None:
    """Puts back the stance ``force_eager`` replaced. Checked 2.13."""
    _FORCED["module"]._stance = prior


_FORCED: dict[str, Any] = {}


def unseen() -> Any:
    """A block in which torch functions skip ``__torch_function__`` (the program's function
    modes, a subclass's override): memlab's own reads of the program's tensors. Checked 2.13."""
    return torch._C.DisableTorchFunction()


def dispatch_modes_on() -> bool:
    """Whether any dispatch mode is on (without building the list of them). Checked 2.13."""
    return bool(torch._C._len_torch_dispatch_stack())


def _nothing() -> None:
    pass


class GlobalHooks:
    """Module and optimizer hooks for the whole process (forward pre, forward always called,
    step pre, step post), put in and taken out at every region: written straight into the
    dicts PyTorch keeps them in, under ids taken once from ``RemovableHandle`` (so no other
    hook's id is reused), where registering through the public functions makes two handles a
    hook each time. Where the dicts are not there, the public functions are used. The forward
    hook may be left out at `install` and put in later (`install_post`), and the pre-hook taken
    out for a while (`pause_pre`): any global module hook costs every module call PyTorch's
    slow path. Checked 2.4.1, 2.13."""

    def __init__(self, pre: Any, post: Any, step_pre: Any, step_post: Any) -> None:
        from torch.nn.modules import module as mm
        from torch.optim import optimizer as om
        from torch.utils.hooks import RemovableHandle

        self._hooks = (pre, post, step_pre, step_post)
        self._quiet: Any = _nothing  # takes out the warning filter `install` put in
        self._handles: list[Any] = []
        self._post_handle: Any = None
        self._paused = False  # (the pre-hook taken out by `pause_pre`)
        try:
            dicts = (
                mm._global_forward_pre_hooks,
                mm._global_forward_hooks,
                om._global_optimizer_pre_hooks,
                om._global_optimizer_post_hooks,
            )
            self._always = mm._global_forward_hooks_always_called
            self._ids = [RemovableHandle(d).id for d in dicts]
            self._dicts: tuple[Any, ...] | None = dicts
        except AttributeError:
            self._dicts = None

    def install(self, post: bool = True) -> None:
        self._quiet = quiet_compile_hooks()
        if self._dicts is None:
            from torch.nn.modules import module as mm
            from torch.optim import optimizer as om

            pre, _, step_pre, step_post = self._hooks
            self._handles = [
                mm.register_module_forward_pre_hook(pre),
                om.register_optimizer_step_pre_hook(step_pre),
                om.register_optimizer_step_post_hook(step_post),
            ]
        else:
            for i in (0, 2, 3):
                self._dicts[i][self._ids[i]] = self._hooks[i]
        if post:
            self.install_post()

    def install_post(self) -> None:
        """The forward hook (called always, also where the forward raises) in too."""
        if self._dicts is None:
            if self._post_handle is None:
                from torch.nn.modules import module as mm

                self._post_handle = mm.register_module_forward_hook(
                    self._hooks[1], always_call=True
                )
            return
        self._dicts[1][self._ids[1]] = self._hooks[1]
        self._always[self._ids[1]] = True

    def pause_pre(self) -> bool:
        """Takes the forward pre-hook out until `resume_pre` (while the outermost module call
        runs, so that the calls inside it keep PyTorch's fast path); False where it cannot."""
        if self._dicts is None or self._ids[0] not in self._dicts[0]:
            return False
        del self._dicts[0][self._ids[0]]
        self._paused = True
        return True

    def resume_pre(self) -> None:
        """Puts the pre-hook `pause_pre` took out back (nothing once `remove` ran)."""
        if self._paused and self._dicts is not None:
            self._paused = False
            self._dicts[0][self._ids[0]] = self._hooks[0]

    def remove(self) -> None:
        self._paused = False
        self._quiet()
        self._quiet = _nothing
        if self._dicts is None:
            for handle in (*self._handles, self._post_handle):
                if handle is not None:
                    handle.remove()
            self._handles, self._post_handle = [], None
            return
        for d, key in zip(self._dicts, self._ids, strict=True):
            d.pop(key, None)
        self._always.pop(self._ids[1], None)


def storage_address(storage: torch.UntypedStorage) -> int:
    """The C++ ``StorageImpl`` behind a storage object: how the native record names it.
    Checked 2.13."""
    return int(storage._cdata)


def tensor_address(t: torch.Tensor) -> int:
    """The C++ ``TensorImpl`` behind a tensor: how the native record names it. Checked 2.13."""
    return int(t._cdata)


def raw_op(overload: Any) -> Any:
    """The C++ callable behind an ``OpOverload`` (called without the Python wrapper's frame:
    a saved-tensor hook runs once per saved tensor). Checked 2.13."""
    return overload._op


def saved_hooks_module() -> Any:
    """``torch._C._autograd``, whose push and pop of saved-tensor hooks memlab follows where
    the pair in force cannot be read (`memlab.core.transforms`). Checked 2.4.1, 2.11, 2.13."""
    return torch._C._autograd
