"""``nn.LSTM``, ``nn.GRU`` and ``nn.RNN`` as cuDNN runs them on a GPU: one call per layer stack
(``aten._cudnn_rnn``), in training and out of it, with cuDNN's workspace and reserve space.

On ``meta`` the layers would run cell by cell and, with grad on, keep every step's gates. On a
GPU, cuDNN's call allocates, in order: a sequence-first contiguous copy of the input, the output,
the final hidden (and cell) state, a workspace for the call's duration, and in training a
reserve space kept for the backward. Its backward takes the input and the output's gradient
sequence first again, the input's and the states' gradients and a workspace (backward data),
then the input again, one flat buffer for every weight's gradient and a workspace (backward
weights). Under autocast, cuDNN's call casts its weights to one flat 16-bit buffer, kept for the
backward, and the gradients are cast back to each weight's type.

The sizes (`cudnn_sizes`) were read from the allocator traces of LSTMs on an H100 with cuDNN 9
(tests/data/validation/lstm-*, tests/data/trace-lstm-sgd): the reserve space is, per step and
batch row, 5 hidden vectors per layer and direction (4 gates and the cell) and one more per
layer below the top, and 256 B; the workspace is 16 MiB and 4 hidden vectors per step, row,
layer and direction, up to 9 % more (the traces: +1.3 % to +8.5 %), a range. GRU and plain RNN
have no trace: their sizes follow the same rule with 3 and 1 gates, a wider range (±15 %).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from memlab.core import _torch
from memlab.estimate.autocast import _region
from memlab.estimate.spread import uncertain_empty

MiB = 1024**2

#: Per mode: the name `_VF` gives it, its gates, and whether it has a cell state.
MODES = {"lstm": (4, True), "gru": (3, False), "rnn_tanh": (1, False), "rnn_relu": (1, False)}
#: The workspace's share above its predicted floor seen in the traces (LSTM), and the share
#: allowed either way for the modes without a trace.
LSTM_WORKSPACE_ABOVE = 0.09
UNTRACED = 0.15


class Sizes(NamedTuple):
    """cuDNN's workspace and reserve space for one call: (predicted, smallest, largest) each."""

    workspace: tuple[int, int, int]
    reserve: tuple[int, int, int]


def cudnn_sizes(
    mode: str, layers: int, hidden: int, seq: int, batch: int, dirs: int, itemsize: int
) -> Sizes:
    """What cuDNN allocates for an RNN call of that shape (see the module's docstring)."""
    gates, cell = MODES[mode]
    vector = seq * batch * hidden * itemsize  # one hidden vector per step and row
    floor = 16 * MiB + 4 * layers * dirs * vector if mode == "lstm" else 16 * MiB
    if mode != "lstm":
        floor += gates * layers * dirs * vector
    reserve = ((gates + cell) * layers * dirs + (layers - 1) * dirs) * vector + 256
    if mode == "lstm":
        high = int(floor * (1 + LSTM_WORKSPACE_ABOVE))
        work = (floor + (floor + high) // 2) // 2  # nearer the floor, where two of three lay
        return Sizes((work, floor, high), (reserve, reserve, reserve + reserve // 100))
    spread = (int(floor * (1 - UNTRACED)), int(floor * (1 + UNTRACED)))
    rspread = (int(reserve * (1 - UNTRACED)), int(reserve * (1 + UNTRACED)))
    return Sizes((floor, *spread), (reserve, *rspread))


def _buffer(sizes: tuple[int, int, int], what: str, like: torch.Tensor) -> torch.Tensor:
    return uncertain_empty(*sizes, f"aten._cudnn_rnn: cuDNN {what}", like)


class _Call(NamedTuple):
    mode: str
    layers: int
    hidden: int
    dirs: int
    train: bool


def _forward(call: _Call, x: torch.Tensor, hx: torch.Tensor, cx: torch.Tensor | None) -> Any:
    """cuDNN's forward on ``x`` (sequence first, maybe strided): output, states, reserve."""
    seq, batch = x.shape[:2]
    sizes = cudnn_sizes(call.mode, call.layers, call.hidden, seq, batch, call.dirs, x.itemsize)
    what = call.mode.split("_")[0].upper()
    xc = x.contiguous()
    y = x.new_empty((seq, batch, call.hidden * call.dirs))
    hy = hx.new_empty(hx.shape)
    cy = None if cx is None else cx.new_empty(cx.shape)
    # the workspace for the call only; the reserve space is taken while it is held (traces)
    workspace = _buffer(sizes.workspace, f"{what} workspace", x)
    reserve = _buffer(sizes.reserve, f"{what} reserve space", x) if call.train else None
    del workspace, xc
    return y, hy, cy, reserve


class _CudnnRnn(torch.autograd.Function):
    """cuDNN's call in training, with its backward's allocations; ``weights`` are the layer's
    parameters, ``flat`` (under autocast) their 16-bit flat copy."""

    @staticmethod
    def forward(ctx: Any, call: _Call, x: Any, hx: Any, cx: Any, flat: Any, *weights: Any) -> Any:
        y, hy, cy, reserve = _forward(call, x, hx, cx)
        ctx.call = call
        ctx.save_for_backward(x, hx, cx, y, reserve, flat, *weights)
        return (y, hy) if cx is None else (y, hy, cy)

    @staticmethod
    def backward(ctx: Any, dy: Any, dhy: Any, dcy: Any = None) -> Any:
        x, hx, cx, _, _, flat, *weights = ctx.saved_tensors
        xc, dyc = x.contiguous(), dy.contiguous()
        dx = torch.empty(xc.shape, dtype=xc.dtype, device=xc.device)
        dhx = hx.new_empty(hx.shape)
        dcx = None if cx is None else cx.new_empty(cx.shape)
        seq, batch = x.shape[:2]
        call = ctx.call
        sizes = cudnn_sizes(call.mode, call.layers, call.hidden, seq, batch, call.dirs, x.itemsize)
        what = call.mode.split("_")[0].upper()
        _buffer(sizes.workspace, f"{what} workspace", x)  # backward data, freed at once
        del dyc, xc
        xc = x.contiguous()
        dtype = x.dtype if flat is None else flat.dtype
        dw = torch.empty(sum(w.numel() for w in weights), dtype=dtype, device=x.device)
        _buffer(sizes.workspace, f"{what} workspace", x)  # backward weights, freed at once
        del xc
        grads, at = [], 0
        for w in weights:  # views of the flat buffer, or cast back to each weight's type
            g = dw[at : at + w.numel()].view(w.shape)
            grads.append(g if g.dtype == w.dtype else g.to(w.dtype))
            at += w.numel()
        del dw, g
        return (None, dx, dhx, dcx, None, *grads)


def _cudnn(mode: str, args: tuple[Any, ...]) -> Any:
    """``_VF.<mode>(input, hx, params, has_biases, layers, dropout, train, bidirectional,
    batch_first)`` on ``meta`` as cuDNN runs it."""
    input, hx, weights, _, layers, _, train, bidirectional, batch_first = args
    lstm = mode == "lstm"
    h0, c0 = (hx[0], hx[1]) if lstm else (hx, None)
    region = _region()
    flat = None
    if region is not None and input.is_floating_point():  # cuDNN's call under autocast
        flat = torch.empty(sum(w.numel() for w in weights), dtype=region.dtype, device="meta")
        h0 = h0.to(region.dtype)
        c0 = None if c0 is None else c0.to(region.dtype)
        input = input.to(region.dtype)
    x = input.transpose(0, 1) if batch_first else input  # sequence first: a view
    call = _Call(mode, layers, h0.shape[-1], 2 if bidirectional else 1, bool(train))
    needs_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (x, h0, c0, *weights)
    )
    if needs_grad:
        out = _CudnnRnn.apply(call, x, h0, c0, flat, *weights)
        y, hy, cy = (*out, None) if len(out) == 2 else out
    else:
        y, hy, cy, reserve = _forward(call, x, h0, c0)
        del reserve, flat
    output = y.transpose(0, 1) if batch_first else y
    return (output, hy, cy) if lstm else (output, hy)


def _emulated(mode: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether the call is one cuDNN would take and this module emulates: on ``meta``, an
    unpacked input, no LSTM projection."""
    if len(args) != 9 or kwargs or not isinstance(args[0], torch.Tensor):
        return False
    hx = args[1]
    if mode == "lstm" and (not isinstance(hx, (tuple, list)) or hx[0].shape[-1] != hx[1].shape[-1]):
        return False  # (an LSTM with proj_size: cell-by-cell on meta, as before)
    return bool(args[0].device.type == "meta" and args[0].dim() == 3)


def _patched(mode: str) -> Any:
    original = getattr(_torch.VF, mode)

    def call(*args: Any, **kwargs: Any) -> Any:
        if _emulated(mode, args, kwargs):
            return _cudnn(mode, args)
        return original(*args, **kwargs)

    return call


def patches() -> list[tuple[Any, str, Any]]:
    """(``_torch.VF``, name, emulation) for each recurrent mode, for `_torch.patched`."""
    return [(_torch.VF, mode, _patched(mode)) for mode in MODES]


_ORIGINAL_FLATTEN = torch.nn.RNNBase.flatten_parameters


def _flatten(module: torch.nn.RNNBase) -> None:
    """``flatten_parameters`` as on a GPU, for a layer on ``meta``: its weights copied into one
    flat buffer, the separate ones freed. ``.to("cuda")`` calls it as it moves each recurrent
    layer, before the layers after it."""
    weights = [w for layer in module.all_weights for w in layer]  # cuDNN's order
    kinds = {w.dtype for w in weights}
    on_meta = weights and all(w.device.type == "meta" for w in weights)
    if not on_meta or module.proj_size or len(kinds) != 1:
        _ORIGINAL_FLATTEN(module)
        return
    flat = torch.empty(sum(w.numel() for w in weights), dtype=kinds.pop(), device="meta")
    at = 0
    with torch.no_grad():
        for w in weights:
            w.data = flat[at : at + w.numel()].view(w.shape)
            at += w.numel()


def flatten_patch() -> tuple[Any, str, Any]:
    """(``nn.RNNBase``, "flatten_parameters", `_flatten`), for `_torch.patched` while the
    estimator gives the model its storage."""
    return (torch.nn.RNNBase, "flatten_parameters", _flatten)
