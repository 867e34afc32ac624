"""CUDA's autocast policy, emulated in Python for tensors on the ``meta`` device (`emulated`).

The op tables are PyTorch's own (``ATen/autocast_mode.h``; a test checks them against the
installed release; `SINCE` says when an op joined, and names without a Python entry point are
listed for completeness). Why, how it casts, and where it differs from real autocast:
docs/estimator.md.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812

from memlab.core import _torch
from memlab.core._torch_autograd import checkpoint_patches
from memlab.core.threads import PerThread

LOWER_PRECISION = [
    "_convolution",
    "conv1d",
    "conv2d",
    "conv3d",
    "conv_tbc",
    "conv_transpose1d",
    "conv_transpose2d",
    "conv_transpose3d",
    "convolution",
    "prelu",
    "addmm",
    "addmv",
    "addr",
    "matmul",
    "einsum",
    "mm",
    "mv",
    "linalg_vecdot",
    "linear",
    "addbmm",
    "baddbmm",
    "bmm",
    "chain_matmul",
    "linalg_multi_dot",
    "_thnn_fused_lstm_cell",
    "_thnn_fused_gru_cell",
    "lstm_cell",
    "gru_cell",
    "rnn_tanh_cell",
    "rnn_relu_cell",
    "_scaled_dot_product_flash_attention",
    "scaled_dot_product_attention",
]
FLOAT32 = [
    "acos",
    "asin",
    "cosh",
    "erfinv",
    "exp",
    "expm1",
    "log",
    "log10",
    "log2",
    "log1p",
    "reciprocal",
    "rsqrt",
    "sinh",
    "tan",
    "pow",
    "softplus",
    "layer_norm",
    "native_layer_norm",
    "rms_norm",
    "group_norm",
    "frobenius_norm",
    "nuclear_norm",
    "cosine_similarity",
    "poisson_nll_loss",
    "cosine_embedding_loss",
    "nll_loss",
    "nll_loss2d",
    "hinge_embedding_loss",
    "kl_div",
    "l1_loss",
    "smooth_l1_loss",
    "huber_loss",
    "mse_loss",
    "margin_ranking_loss",
    "multilabel_margin_loss",
    "soft_margin_loss",
    "triplet_margin_loss",
    "multi_margin_loss",
    "binary_cross_entropy_with_logits",
    "dist",
    "pdist",
    "cdist",
    "renorm",
    "logsumexp",
    "upsample_nearest1d",
    "_upsample_nearest_exact1d",
    "upsample_nearest2d",
    "_upsample_nearest_exact2d",
    "upsample_nearest3d",
    "_upsample_nearest_exact3d",
    "upsample_linear1d",
    "upsample_bilinear2d",
    "_upsample_bilinear2d_aa",
    "upsample_trilinear3d",
    "upsample_bicubic2d",
    "_upsample_bicubic2d_aa",
]
#: Operations that joined the lists in a later PyTorch than the oldest memlab supports (2.4),
#: with the release that added them (read from the releases' ``ATen/autocast_mode.h``). Older
#: releases leave them off, so the emulation follows the installed PyTorch's policy.
SINCE = {"rms_norm": (2, 12)}


def _installed() -> tuple[int, int]:
    major, minor = torch.__version__.split(".")[:2]
    return int(major), int(minor)


FLOAT32 = [op for op in FLOAT32 if _installed() >= SINCE.get(op, (0, 0))]
FLOAT32_OUTPUT = [
    "prod",
    "softmax",
    "log_softmax",
    "cumprod",
    "cumsum",
    "linalg_vector_norm",
    "linalg_matrix_norm",
    "sum",
]
PROMOTE = [
    "addcdiv",
    "addcmul",
    "atan2",
    "bilinear",
    "cross",
    "dot",
    "vdot",
    "grid_sampler",
    "index_put",
    "tensordot",
    "scatter_add",
]
#: Python functions that reach listed operations only in C++: cast as the operation they are,
#: or ("composite") run as the C++ composite runs under CUDA's autocast.
COMPOSITES = {"cross_entropy": "composite", "interpolate": "float32"}

#: The 16-bit floating-point types autocast casts to.
HALF = (torch.float16, torch.bfloat16)


class _Region:
    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self.cache: dict[int, tuple[weakref.ref[torch.Tensor], torch.Tensor]] = {}
        self.inside_op = False

    def lower(self, t: torch.Tensor) -> torch.Tensor:
        if not t.is_floating_point() or t.dtype == self.dtype or t.dtype == torch.float64:
            return t
        if t.is_leaf and t.requires_grad:  # a weight: cast once, kept until the region ends
            hit = self.cache.get(id(t))
            if hit is not None and hit[0]() is t:
                return hit[1]
            cast = t.to(self.dtype)
            self.cache[id(t)] = (weakref.ref(t), cast)
            return cast
        return t.to(self.dtype)


_state = threading.local()


def _region() -> _Region | None:
    return getattr(_state, "region", None)


def _map(args: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    if isinstance(args, torch.Tensor):
        return fn(args)
    if isinstance(args, (list, tuple)):
        return type(args)(_map(a, fn) for a in args)
    return args


def _floats(args: Any) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    for a in args if isinstance(args, (list, tuple)) else (args,):
        if isinstance(a, torch.Tensor) and a.is_floating_point():
            found.append(a)
        elif isinstance(a, (list, tuple)):
            found.extend(_floats(a))
    return found


def _cross_entropy(original: Callable[..., Any]) -> Callable[..., Any]:
    """``F.cross_entropy`` as CUDA runs it under autocast: ``aten::cross_entropy_loss`` has no
    autocast kernel on CUDA (it has one on the CPU), so its composite runs: ``log_softmax`` with
    the input's own dtype (an explicit dtype, which autocast keeps: 16-bit log-probabilities),
    then ``nll_loss``, on the float32 list, on a float32 copy of them. Class-index targets
    without label smoothing; other forms cast to float32 first, as before."""

    def cross_entropy(
        input: Any,
        target: Any,
        weight: Any = None,
        size_average: Any = None,
        ignore_index: int = -100,
        reduce: Any = None,
        reduction: str = "mean",
        label_smoothing: float = 0.0,
    ) -> Any:
        region = _region()
        plain = (
            region is None
            or region.inside_op
            or not isinstance(input, torch.Tensor)
            or not isinstance(target, torch.Tensor)
            or input.dtype not in HALF
            or target.is_floating_point()
            or label_smoothing
            or size_average is not None
            or reduce is not None
        )
        if plain:
            as_float32 = _wrap(original, "float32")
            return as_float32(
                input,
                target,
                weight,
                size_average,
                ignore_index,
                reduce,
                reduction,
                label_smoothing,
            )
        log_p = torch.log_softmax(input, 0 if input.dim() == 1 else 1, dtype=input.dtype)
        return F.nll_loss(log_p, target, weight, ignore_index=ignore_index, reduction=reduction)

    cross_entropy.__wrapped__ = original  # type: ignore[attr-defined]
    return cross_entropy


def _wrap(original: Callable[..., Any], policy: str) -> Callable[..., Any]:
    if policy == "composite":
        return _cross_entropy(original)

    def autocast_op(*args: Any, **kwargs: Any) -> Any:
        region = _region()
        if region is None or region.inside_op:
            return original(*args, **kwargs)
        if policy == "lower":
            args, kwargs = (
                _map(args, region.lower),
                {k: _map(v, region.lower) for k, v in kwargs.items()},
            )
        elif policy == "float32":
            up = lambda t: t.float() if t.dtype in HALF else t  # noqa: E731
            args, kwargs = _map(args, up), {k: _map(v, up) for k, v in kwargs.items()}
        elif policy == "float32_output":
            first = args[0] if args else None
            if (
                isinstance(first, torch.Tensor)
                and first.dtype in HALF
                and kwargs.get("dtype") is None
            ):
                kwargs = {**kwargs, "dtype": torch.float32}
        elif policy == "promote":
            floats = _floats(args) + _floats(list(kwargs.values()))
            if floats:
                widest = max((t.dtype for t in floats), key=lambda d: torch.finfo(d).bits)
                to = lambda t: t.to(widest) if t.is_floating_point() else t  # noqa: E731
                args, kwargs = _map(args, to), {k: _map(v, to) for k, v in kwargs.items()}
        region.inside_op = True  # inside an autocast kernel nothing is cast again
        try:
            return original(*args, **kwargs)
        finally:
            region.inside_op = False

    autocast_op.__wrapped__ = original  # type: ignore[attr-defined]
    return autocast_op


def _entry_points() -> list[tuple[Any, str, str]]:
    """(owner, attribute, policy) for every Python entry point of a listed operation."""
    policies = {
        **dict.fromkeys(LOWER_PRECISION, "lower"),
        **dict.fromkeys(FLOAT32, "float32"),
        **dict.fromkeys(FLOAT32_OUTPUT, "float32_output"),
        **dict.fromkeys(PROMOTE, "promote"),
    }
    found = []
    for name, policy in policies.items():
        for owner in (F, torch, torch.Tensor):
            if callable(getattr(owner, name, None)):
                found.append((owner, name, policy))
        short = name.removeprefix("linalg_")
        if name.startswith("linalg_") and callable(getattr(torch.linalg, short, None)):
            found.append((torch.linalg, short, policy))
    found += [(torch.Tensor, "__matmul__", "lower"), (torch.Tensor, "__rmatmul__", "lower")]
    found += [(torch.Tensor, "__pow__", "float32"), (torch.Tensor, "__rpow__", "float32")]
    found += [(F, name, policy) for name, policy in COMPOSITES.items()]
    return found


def _in_region(dtype: torch.dtype) -> Callable[[Any], Any]:
    """Wraps a checkpointed function so that its recomputation in backward runs under the
    emulated autocast as its forward did: to the dtype in force when checkpoint was called,
    or suspended where none was (``torch.autocast(..., enabled=False)``). Real checkpointing
    restores real autocast for the recomputation; it cannot know of the emulation."""

    def wrap(function: Any) -> Any:
        region = _region()
        then = None if region is None else region.dtype

        def under_autocast(*a: Any, **k: Any) -> Any:
            # in forward: the region already as it was; in backward: reopened as it was
            with _suspended() if then is None else emulated(then):
                return function(*a, **k)

        return under_autocast

    return wrap


@contextlib.contextmanager
def emulated(dtype: torch.dtype) -> Iterator[None]:
    """Autocast to ``dtype`` with CUDA's policy, for the code in the block. Not for use while
    other threads run torch code: the entry points are patched for the block's duration."""
    if dtype not in HALF:
        raise ValueError(f"autocast casts to float16 or bfloat16, not {dtype}.")
    if _region() is not None:  # nested: the outer region's cache lives on, as in autocast
        yield
        return
    patches = [
        (owner, name, _wrap(getattr(owner, name), policy))
        for owner, name, policy in _entry_points()
    ]
    patches += checkpoint_patches(_in_region(dtype))  # however the program imported it
    with _torch.patched(patches):  # Tensor methods live on TensorBase: deleted again after
        _state.region = _Region(dtype)
        try:
            yield
        finally:
            _state.region = None


@contextlib.contextmanager
def _suspended() -> Iterator[None]:
    """No emulated autocast inside (``torch.autocast(..., enabled=False)`` in the program)."""
    region = _region()
    _state.region = None
    try:
        yield
    finally:
        _state.region = region


#: The devices whose ``torch.autocast`` the estimate runs as the emulation: code written for a
#: GPU names "cuda"; code that asks its tensors' device (on meta while estimating) names "meta".
_EMULATED_DEVICES = ("cuda", "meta")


#: The emulated autocast objects made in `own_autocast` (device, dtype, enabled), and the
#: emulations each has entered (one object may be entered again inside).
_OWN: weakref.WeakKeyDictionary[Any, tuple[str, torch.dtype, bool]] = weakref.WeakKeyDictionary()
_ENTERED: weakref.WeakKeyDictionary[Any, list[Any]] = weakref.WeakKeyDictionary()
_AUTOCAST = torch.amp.autocast_mode.autocast
_ORIGINAL = {name: _AUTOCAST.__dict__[name] for name in ("__init__", "__enter__", "__exit__")}


class _Block:
    """One `own_autocast` block: its notes, and the emulations entered in it still open."""

    def __init__(self, seen: list[str]) -> None:
        self.seen = seen
        self.opened: list[Any] = []


#: The open blocks, by thread (innermost last); the class is patched while there is one.
_BLOCKS = PerThread()


def _block() -> _Block | None:
    blocks = _BLOCKS.mine()
    return blocks[-1] if blocks else None


def _own_init(
    self: Any,
    device_type: str,
    dtype: torch.dtype | None = None,
    enabled: bool = True,
    cache_enabled: bool | None = None,
) -> None:
    init = _ORIGINAL["__init__"]
    if device_type not in _EMULATED_DEVICES or _block() is None:
        init(self, device_type, dtype=dtype, enabled=enabled, cache_enabled=cache_enabled)
        return
    init(self, "cpu", dtype=torch.bfloat16, enabled=False, cache_enabled=cache_enabled)
    _OWN[self] = (device_type, torch.float16 if dtype is None else dtype, bool(enabled))


def _own_enter(self: Any) -> Any:
    own, block = _OWN.get(self), _block()
    if own is None or block is None:
        return _ORIGINAL["__enter__"](self)
    device, dtype, enabled = own
    if enabled and dtype in HALF:
        context: Any = emulated(dtype)
        said = f"the step's own torch.autocast({device!r}, {dtype}): emulated"
        if device == "cuda" and said not in block.seen:
            block.seen.append(said)
    else:
        context = _suspended()
    _ENTERED.setdefault(self, []).append(context)  # (first: a Ctrl-C leaves it to be closed)
    block.opened.append(context)
    context.__enter__()
    return None


def _own_exit(self: Any, *exc: Any) -> Any:
    stack = _ENTERED.get(self)
    if self not in _OWN or not stack:
        return _ORIGINAL["__exit__"](self, *exc)
    context = stack.pop()
    block = _block()
    if block is not None and context in block.opened:
        block.opened.remove(context)
    context.__exit__(*exc)
    return False


@contextlib.contextmanager
def own_autocast(seen: list[str]) -> Iterator[None]:
    """While estimating (or a pre-flight runs its cell): the program's own
    ``torch.autocast("cuda", dtype)`` (also ``torch.cuda.amp.autocast``, however imported: the
    class's methods are replaced while any such block is open, on any thread), made on this
    thread, runs as the emulation of CUDA's autocast to that dtype; ``enabled=False`` suspends
    the emulation (a rotary embedding computed in float32), and ``"meta"`` (a device type read
    off a tensor) counts as CUDA's, which PyTorch refuses on meta. What was emulated is added
    to ``seen`` (once each) for the notes. Other devices', and threads without a block, run as
    they are. Such an object is built as a disabled one too, as it would be on a machine
    without CUDA: used after the block, it does nothing; an emulation still open at the end (a
    generator left inside its ``with``) is closed then."""
    block = _Block(seen)
    _BLOCKS.push(block, _patch)
    try:
        yield
    finally:
        try:
            while block.opened:  # left open (a generator suspended inside): the last first
                block.opened.pop().__exit__(None, None, None)
        finally:
            _BLOCKS.pop(block, _restore)


def _patch(first: bool) -> None:
    if first:
        _AUTOCAST.__init__ = _own_init  # type: ignore[method-assign]
        _AUTOCAST.__enter__ = _own_enter  # type: ignore[method-assign]
        _AUTOCAST.__exit__ = _own_exit  # type: ignore[method-assign]


def _restore(last: bool) -> None:
    if last:  # the last block: the class as it was
        for name, method in _ORIGINAL.items():
            setattr(_AUTOCAST, name, method)
