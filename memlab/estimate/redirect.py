"""Running code written for a GPU on the ``meta`` device: tensors it puts anywhere go to
``meta`` instead, and the model is built there as ``.to("cuda")`` would move it."""

from __future__ import annotations

import contextlib
import importlib
import sys
import types
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from memlab.core import _torch
from memlab.step import WhatIfError
from memlab.step.user import check_materialised

META = torch.device("meta")


#: The largest result a ``device="cpu"`` factory may have to stay on the CPU while a model is
#: built (`Redirect`'s ``keep_cpu``): values to read are small; a layer's weights go to meta.
KEEP_CPU_BYTES = 64 * 1024


class Redirect(TorchFunctionMode):
    """Sends tensors the user's code puts on a GPU (or the CPU) to ``target`` instead, so code
    written for CUDA runs unchanged on a machine without one. With ``keep_cpu`` (a model's
    construction), a factory told ``device="cpu"`` whose result is small (`KEEP_CPU_BYTES`)
    stays there: libraries build values to read that way under a meta default device
    (transformers' drop-path rates: ``torch.linspace(..., device="cpu").tolist()``); a big one
    (a layer built with ``device="cpu"``) still goes to ``target``, costing no memory.
    ``made_on_cpu``: the storages of the CPU tensors made in the block (`build_on_meta` tells
    them from those of a model that already existed)."""

    def __init__(self, target: torch.device, keep_cpu: bool = False) -> None:
        super().__init__()
        self.target, self.keep_cpu = target, keep_cpu
        self.made_on_cpu: set[int] = set()

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kwargs = dict(kwargs or {})
        asked = kwargs.get("device")
        if asked is not None:
            kwargs["device"] = self.target
        if func in (torch.Tensor.cuda, torch.Tensor.cpu):
            return args[0].to(self.target)
        if func is torch.Tensor.to:
            args = tuple(self.target if _is_device(a) else a for a in args)
        if not self.keep_cpu:
            return func(*args, **kwargs)
        if asked is not None and _is_cpu(asked) and func is not torch.Tensor.to:
            out = self._small_on_cpu(func, args, kwargs)
        else:
            out = func(*args, **kwargs)
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if (ptr := _host_storage(t)) is not None:
                self.made_on_cpu.add(ptr)
        return out

    def _small_on_cpu(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """``func`` told ``device="cpu"``: made on the CPU where its result is small, else on
        ``target`` (made there first to learn its size; where that fails, on the CPU)."""
        try:
            out = func(*args, **kwargs)
        except Exception:
            return func(*args, **{**kwargs, "device": "cpu"})
        if isinstance(out, torch.Tensor) and out.nbytes > KEEP_CPU_BYTES:
            return out
        return func(*args, **{**kwargs, "device": "cpu"})


def _host_storage(t: Any) -> int | None:
    """Where a (non-empty, strided) CPU tensor's storage is; None for anything else."""
    if not isinstance(t, torch.Tensor) or t.device.type != "cpu" or t.layout != torch.strided:
        return None
    try:
        return t.untyped_storage().data_ptr() or None
    except Exception:  # a subclass without a storage of its own
        return None


def _is_cpu(value: Any) -> bool:
    return _is_device(value) and torch.device(value).type == "cpu"


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
def meta_device_module() -> Iterator[None]:
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
def redirected(device: str | torch.device = META, keep_cpu: bool = False) -> Iterator[Redirect]:
    """Within the block, tensors are created on ``device`` (default ``meta``), also where the
    code names another device: ``.to("cuda")``, ``.cuda()``, ``device="cuda"`` (with
    ``keep_cpu``, not ``device="cpu"``: `Redirect`)."""
    target = torch.device(device)
    with torch.device(target), Redirect(target, keep_cpu) as mode:
        yield mode


def build_on_meta(model_fn: Callable[[], Any]) -> Any:
    """``model_fn()`` built on ``meta`` outside the accounting, then given fresh storage within
    it, as ``.to("cuda")`` moves a model built on the CPU: one allocation per parameter and
    buffer, in module order (a tied weight once), and none of what the construction allocated
    and freed on the way. What is not a Module is returned as it is (the step says what is
    wrong with it)."""
    if isinstance(model_fn, torch.nn.Module):
        what = type(model_fn).__name__
        raise WhatIfError(
            f"model_fn got a model already built ({what}): pass a function that builds it, "
            f"e.g. model_fn=lambda: {what}(...), so that it is built on the meta device."
        )
    if not callable(model_fn):
        raise WhatIfError(
            f"model_fn got {type(model_fn).__name__} {model_fn!r:.60}: pass a function that "
            "builds the model, e.g. model_fn=lambda: MyModel(config)."
        )
    with _torch.disable_current_modes(), redirected(keep_cpu=True) as mode:
        model = model_fn()
    if not isinstance(model, torch.nn.Module):
        return model
    check_materialised(model)  # a lazy module's parameters have no size to move yet
    made = mode.made_on_cpu  # what model_fn made on the CPU itself (small; to meta below)
    real = {
        str(p.device)
        for p in model.parameters()
        if p.device != META and _host_storage(p) not in made
    }
    if real:
        raise WhatIfError(
            f"model_fn returned a model that already exists (on {', '.join(sorted(real))}):"
            " for an estimate, model_fn must build the model, so that it can be built on "
            "the meta device without memory, e.g. model_fn=lambda: MyModel(config)."
        )
    # a tied weight moves once; the new storage is held weakly, so that what replaces it at
    # once (the recurrent layers' weights, moved into one flat buffer by flatten_parameters
    # as each layer arrives) is freed then, before the next module's parameters arrive
    moved: dict[int, tuple[torch.Tensor, weakref.ref[torch.Tensor]]] = {}

    def materialize(t: torch.Tensor) -> torch.Tensor:
        if id(t) in moved:
            new = moved[id(t)][1]()
            return t if new is None else new  # a parameter holds its new storage itself
        new = torch.empty_like(t, device=META)  # a buffer made on the CPU goes too
        moved[id(t)] = (t, weakref.ref(new))  # t kept: its id stays its own
        return new

    _torch.apply_to_tensors(model, materialize)
    return model


def _none(original: Callable[..., Any], args: tuple[Any, ...], kw: dict[str, Any]) -> Any:
    return None


def _unpadded(original: Callable[..., Any], args: tuple[Any, ...], kw: dict[str, Any]) -> Any:
    """The library's own answer for the same call without a padding mask (no token padded)."""
    if "padding_mask" in kw:
        return original(*args, **{**kw, "padding_mask": None})
    return original(None, *args[1:], **kw)


#: Library functions that read a tensor's values only to spot an unusual input, each with how
#: it answers for an ordinary one and what that assumes. On ``meta`` they would stop the
#: step; the libraries themselves skip them the same way while tracing (``torch.compile``).
_VALUE_CHECKS: tuple[tuple[str, str, Callable[..., Any], str], ...] = (
    # transformers >= 4.53: called when a model runs without a KV cache (training, or under
    # gradient checkpointing) and with position ids; None means "the sequences are not packed"
    (
        "transformers.masking_utils",
        "find_packed_sequence_indices",
        _none,
        "sequences are not packed",
    ),
    # transformers >= 4.53: whether SDPA can skip the attention mask (is_causal instead), read
    # from the 2D attention mask's values: any model given an attention_mask (BART, T5, ...)
    *(
        ("transformers.masking_utils", name, _unpadded, "the attention mask pads no token")
        for name in ("_ignore_causal_mask_sdpa", "_ignore_bidirectional_mask_sdpa")
    ),
    # a model given input_ids without an attention mask looks for padding in them, to warn
    (
        "transformers.modeling_utils",
        "PreTrainedModel.warn_if_padding_and_no_attention_mask",
        _none,
        "input_ids without an attention mask hold no padding",
    ),
)


class OrdinaryInputs:
    """Within the block, the `_VALUE_CHECKS` of the libraries imported so far answer as for
    ordinary input when given ``meta`` tensors; each assumption made is appended to ``assumed``
    (once). `refresh` patches those of libraries imported since (by ``model_fn``)."""

    def __init__(self, assumed: list[str]) -> None:
        self.assumed = assumed
        self._stack = contextlib.ExitStack()
        self._done: set[tuple[str, str]] = set()

    def __enter__(self) -> OrdinaryInputs:
        self.refresh()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()  # each patch undone, the last first

    def refresh(self) -> None:
        for module_name, name, answer, assumption in _VALUE_CHECKS:
            library = module_name.partition(".")[0]
            if (module_name, name) in self._done or library not in sys.modules:
                continue
            module = sys.modules.get(module_name)
            if module is None:  # the library is imported, but not this part of it yet
                with contextlib.suppress(Exception):
                    module = importlib.import_module(module_name)
            path, _, attribute = name.rpartition(".")  # a class's method: "Class.method"
            owner = module
            for part in path.split(".") if path else ():
                owner = getattr(owner, part, None)
            original = getattr(owner, attribute, None)
            if owner is None or not callable(original):
                continue
            self._done.add((module_name, name))
            check = self._answering(original, answer, assumption)
            self._stack.enter_context(_torch.patched([(owner, attribute, check)]))

    def _answering(
        self, original: Callable[..., Any], answer: Callable[..., Any], assumption: str
    ) -> Callable[..., Any]:
        def check(*args: Any, **kw: Any) -> Any:
            if any(isinstance(v, torch.Tensor) and v.is_meta for v in [*args, *kw.values()]):
                if assumption not in self.assumed:
                    self.assumed.append(assumption)
                return answer(original, args, kw)
            return original(*args, **kw)

        return check


def redirecting(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn``, whose tensors go to ``meta`` wherever it puts them (a loss that names "cuda")."""
    if not callable(fn):  # the step says what is wrong with it
        return fn  # type: ignore[unreachable]

    def call(*args: Any) -> Any:
        with redirected():
            return fn(*args)

    return call
