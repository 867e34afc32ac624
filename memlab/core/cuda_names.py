"""What names a block in the CUDA allocator's log (`memlab.core.cuda_log`): (address, moment,
role) for each tensor a hook or the end's objects say something about.

While the region is open: each tensor autograd saves (the pack hook; a saved parameter is a
parameter, and a saved block from before the region is one of its inputs), the gradients an
optimizer is about to use, the tensors a module called at the top is given (inputs), and what
`memlab.track.mark` and Hugging Face's caches name. At the end (moment None): the parameters,
buffers and gradients of the modules called at the top and of those watched, and the parameters,
gradients and state of the optimizers watched or stepped. Each hook guards itself: what cannot
be read is counted in ``lost`` and never breaks the user's code.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.nn.modules import module as nn_module

from memlab.core.categories import Category
from memlab.core.roles import state_tensors
from memlab.core.storages import storage_of

#: A moment that means "now" (None means the region's end).
_NOW = -1.0
#: Names kept at most (each list): twice the events the allocator keeps for a region.
LIMIT = 1_000_000
_PLAIN = (torch.Tensor, torch.nn.Parameter)


def now_us() -> float:
    """The hooks' clock, in the allocator log's unit (Unix microseconds)."""
    return time.time_ns() / 1000


class Names:
    def __init__(self) -> None:
        self.named: list[tuple[int, float | None, Category]] = []
        self.lost = 0
        #: The optimizers that stepped and the modules called at the top (none of theirs
        #: running), held weakly (`_met`): theirs are named at the end, where they still are.
        self._optimizers: dict[int, Callable[[], Any]] = {}
        self._modules: dict[int, Callable[[], Any]] = {}
        self._pre: Any = None
        self._post: Any = None
        self._armed = False
        #: The thread the region runs on: another thread's module calls are left alone.
        self._thread = threading.get_ident()
        #: (address, moment) of the tensors a module called at the top was given.
        self.args: list[tuple[int, float]] = []
        #: (address, moment saved, moment the saving ended: its alias died).
        self.unsaved: list[tuple[int, float, float]] = []
        #: Each saving's alias (weakly), with its block's address and the moment it was saved.
        self._aliases: dict[weakref.ref[torch.Tensor], tuple[int, float]] = {}
        #: Whether the oldest names were let go (a region longer than the log keeps).
        self.trimmed = False
        self._died = self._alias_died  # (one bound method, made once: the weak references' call)
        #: Names tensors on any device, not only CUDA ones (the tests' CPU tensors).
        self.any_device = False
        #: What makes a saved tensor's alias: a detached one (``t`` itself would tie a saved
        #: output to its own grad_fn in a cycle that even gc cannot free), or the pack hook of
        #: memlab's region open around this one.
        self.alias: Any = torch.Tensor.detach

    def mark(self, t: torch.Tensor, category: Category, when: float | None = _NOW) -> None:
        """Names the block behind ``t`` (now, or at the end where ``when`` is None)."""
        try:
            if type(t) in _PLAIN:
                if not (t.is_cuda or self.any_device):
                    return
                ptr = t.untyped_storage().data_ptr()
            else:  # a subclass: its storage found as the ledger finds it (a DTensor's shard)
                st = storage_of(t)
                if st is None or not (st.device.type == "cuda" or self.any_device):
                    return
                ptr = st.data_ptr()
            self.named.append((ptr, now_us() if when == _NOW else when, category))
        except Exception:  # a tensor that cannot say: its bytes stay unnamed
            self.lost += 1

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        alias = self.alias(t)
        try:
            kind = type(t)
            if kind is torch.Tensor:
                if t.is_cuda or self.any_device:
                    ptr, now = t.untyped_storage().data_ptr(), now_us()
                    named = self.named
                    named.append((ptr, now, Category.ACTIVATION))
                    # the alias dies when autograd lets the saving go (backward, or the graph)
                    self._aliases[weakref.ref(alias, self._died)] = (ptr, now)
                    if len(named) > LIMIT:
                        self._trim()
            elif kind is torch.nn.Parameter:  # a weight saved for backward is a parameter
                self.mark(t, Category.PARAMETER)
            else:
                self.mark(t, Category.ACTIVATION)
        except Exception:  # never the user's backward's problem: its bytes stay unnamed
            self.lost += 1
        return alias  # type: ignore[no-any-return]

    def _alias_died(self, ref: weakref.ref[torch.Tensor]) -> None:
        saved = self._aliases.pop(ref, None)
        if saved is not None:
            self.unsaved.append((saved[0], saved[1], now_us()))
            if len(self.unsaved) > LIMIT:
                self._trim()

    def _trim(self) -> None:
        """Lets the older half of the names go: the allocator keeps only its last events too
        (`memlab.core.cuda_log.MAX_EVENTS`), and names older than those are of no use."""
        self.trimmed = True
        for names in (self.named, self.unsaved, self.args):
            del names[: len(names) // 2]

    def clear(self) -> None:
        """Lets go of everything: the names, the savings followed, the objects met."""
        self.forget_savings()
        self.named, self.args, self.unsaved = [], [], []
        self._modules, self._optimizers = {}, {}

    def forget_savings(self) -> None:
        """Stops following the savings (their weak references go, and with them the calls)."""
        self._aliases = {}

    # -- modules: a global hook for the call at the top only --------------------------------------
    def arm(self) -> None:
        """Waits for the next module called at the top. A global module hook sends every
        module call through PyTorch's slower path (+0.5 ms a ResNet-18 step on an H200), so
        it is taken off at that call and a hook on that module alone puts it back after."""
        self._armed = True
        if self._pre is None:
            self._pre = nn_module.register_module_forward_pre_hook(self._top_pre)

    def disarm(self) -> None:
        self._armed = False
        for handle in (self._pre, self._post):
            if handle is not None:
                handle.remove()
        self._pre = self._post = None

    def _top_pre(self, module: torch.nn.Module, args: Any) -> None:
        if threading.get_ident() != self._thread:
            return  # (another thread's module: it stays armed for the region's own)
        try:
            if self._pre is not None:
                self._pre.remove()
                self._pre = None
            _met(self._modules, module)
            self._post = module.register_forward_hook(self._top_post, always_call=True)
            now = now_us()
            for a in args if isinstance(args, tuple) else (args,):
                if type(a) is torch.Tensor and (a.is_cuda or self.any_device):
                    self.args.append((a.untyped_storage().data_ptr(), now))
        except Exception:  # never the user's forward's problem
            self.lost += 1

    def _top_post(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        try:
            if self._post is not None:
                self._post.remove()
                self._post = None
            if self._armed:
                self.arm()
        except Exception:
            self.lost += 1

    def optimizer_pre(self, opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        """The gradients an optimizer is about to use, now (``zero_grad`` may free them before
        the end); its parameters and state are named at the end, where they still are."""
        _met(self._optimizers, opt)
        now, add = now_us(), self.named.append
        try:
            for group in opt.param_groups:
                for p in group["params"]:
                    g = p.grad
                    if g is None:
                        continue
                    if type(g) is torch.Tensor and (g.is_cuda or self.any_device):
                        add((g.untyped_storage().data_ptr(), now, Category.GRADIENT))
                    else:
                        self.mark(g, Category.GRADIENT)
        except Exception:  # an optimizer whose own code raises: its bytes stay unnamed
            self.lost += 1

    def _name_optimizer(self, opt: torch.optim.Optimizer, named: set[int]) -> None:
        """Names an optimizer's parameters, their gradients and its state at the end (the
        parameters in ``named``, their modules', are named already)."""
        try:
            for group in opt.param_groups:
                for p in group["params"]:
                    if id(p) in named:
                        continue
                    self.mark(p, Category.PARAMETER, None)
                    if p.grad is not None:
                        self.mark(p.grad, Category.GRADIENT, None)
            for value in state_tensors(opt):
                self.mark(value, Category.OPTIMIZER_STATE, None)
        except Exception:  # an optimizer whose own code raises: its bytes stay unnamed
            self.lost += 1

    def _name_module(self, module: torch.nn.Module, named: set[int]) -> None:
        """Names a module's parameters, their gradients and its buffers at the end, and adds
        the parameters to ``named``."""
        try:
            for p in module.parameters():
                if id(p) in named:
                    continue
                named.add(id(p))
                self.mark(p, Category.PARAMETER, None)
                if p.grad is not None:
                    self.mark(p.grad, Category.GRADIENT, None)
            for b in module.buffers():
                self.mark(b, Category.BUFFER, None)
        except Exception:
            self.lost += 1

    def at_end(self, watched: Iterable[Any]) -> None:
        """Names what the modules called at the top, the optimizers that stepped and
        ``watched`` hold (each object once)."""
        modules, optimizers = _alive(self._modules), _alive(self._optimizers)
        for obj in watched:
            kind = type(obj)
            if issubclass(kind, torch.nn.Module):
                modules.setdefault(id(obj), obj)
            elif issubclass(kind, torch.optim.Optimizer):
                optimizers.setdefault(id(obj), obj)
            elif issubclass(kind, torch.Tensor):
                try:
                    grad = obj.grad if obj.is_leaf and obj.requires_grad else None
                except Exception:
                    continue
                if grad is not None:
                    self.mark(grad, Category.GRADIENT, None)
        named: set[int] = set()  # (the parameters named: a model's and its optimizer's once)
        for m in modules.values():
            self._name_module(m, named)
        for o in optimizers.values():
            self._name_optimizer(o, named)
        self._modules, self._optimizers = {}, {}  # (after: a Ctrl-C above leaves them to a retry)


def _met(held: dict[int, Callable[[], Any]], obj: Any) -> None:
    """``obj`` in ``held``, weakly: a model or optimizer the program drops inside the region
    must be freed there, as without memlab (the allocator's "after" counts what is alive)."""
    ref = held.get(id(obj))
    if ref is None or ref() is not obj:
        try:
            held[id(obj)] = weakref.ref(obj)
        except TypeError:  # (a class without weak references: held to the end)
            held[id(obj)] = lambda: obj


def _alive(held: dict[int, Callable[[], Any]]) -> dict[int, Any]:
    return {k: obj for k, ref in held.items() if (obj := ref()) is not None}


def log_unpack(t: torch.Tensor) -> torch.Tensor:
    """The log's unpack hook: the saved alias as it is. Not older_graphs' own (``unpack``): a
    graph built under the log is walked by later regions, since no ledger follows its
    savings."""
    return t


def is_log_pack(hook: Any) -> bool:
    """Whether ``hook`` is a CUDA log's pack hook (a breakdown nested in such a region makes
    its aliases with it, so that the log names what is saved there too)."""
    return isinstance(getattr(hook, "__self__", None), Names)
