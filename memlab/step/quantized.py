"""A frozen Linear layer whose weight is stored as bitsandbytes stores it (NF4 or LLM.int8), in
plain torch, so that the weight's bytes are bitsandbytes' on any device (bitsandbytes itself
needs a GPU) and the forward's dequantization is seen by the tensor accounting.

The layouts (bitsandbytes ``functional.quantize_4bit`` and ``nn.Int8Params._quantize``; cited
in docs/levers.md), for a weight of n = out x in elements:

- ``nf4``: ``weight`` uint8 of ceil(n / 2) bytes (two 4-bit codes a byte); ``absmax`` float32,
  one per block of 64 elements; ``code``, the 16 NF4 values in float32, per layer.
- ``nf4_double`` (``compress_statistics=True``, QLoRA's double quantization): ``absmax`` as uint8
  codes (one byte per block of 64) with ``absmax2`` float32 per 256 of those blocks, their mean
  (a Python float) and bitsandbytes' 256-entry float32 "dynamic" map, shared by every layer.
- ``int8`` (``Linear8bitLt``, ``has_fp16_weights=False``): ``weight`` int8, out x in, and
  ``SCB`` float32, one scale per output row.

The forward dequantizes to the layer's compute dtype and multiplies, as bitsandbytes'
``matmul_4bit`` does; backward dequantizes again (nothing of the input is saved: the weight has no
gradient). The 4-bit dequantization allocates what bitsandbytes' does (the float32 absmax of a
double-quantized layer, then the dequantized weight) plus an int32 index of ``CHUNK`` codes at a
time; on ``meta`` only the first and the last chunk run (each allocates and frees the same).
The int8 forward is modelled the same way (dequantized weight, then a matmul); bitsandbytes'
own int8 matmul makes other temporaries (the input quantized to int8, an int32 product).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn
from torch.nn import functional

#: bitsandbytes' defaults: elements per 4-bit block, absmax values per double-quantized block.
BLOCK, BLOCK2 = 64, 256
#: Packed bytes dequantized at once (a multiple of BLOCK / 2): bounds the index temporary.
CHUNK = 1 << 20
#: The NF4 values (bitsandbytes ``get_4bit_type("nf4")``, from the QLoRA paper).
NF4 = (
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
    -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
    0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
    0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0,
)  # fmt: skip
KINDS = ("int8", "nf4", "nf4_double")


def weight_bytes(kind: str, out_features: int, in_features: int) -> int:
    """The bytes one layer's quantized weight takes in bitsandbytes' layout (the shared
    256-entry map of ``nf4_double`` not included: `shared_bytes`)."""
    n = out_features * in_features
    if kind == "int8":
        return n + 4 * out_features
    blocks = math.ceil(n / BLOCK)
    packed, code = (n + 1) // 2, 16 * 4
    if kind == "nf4":
        return packed + 4 * blocks + code
    return packed + blocks + 4 * math.ceil(blocks / BLOCK2) + code


def shared_bytes(kind: str) -> int:
    """Bytes every layer of a model shares: the double quantization's 256-entry map."""
    return 256 * 4 if kind == "nf4_double" else 0


def _frozen(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t, requires_grad=False)


class QuantizedLinear(nn.Module):
    """``linear``'s weight quantized (``kind`` one of `KINDS`); its bias is kept as it is.
    ``dynamic``: the shared 256-entry map, for ``nf4_double``."""

    def __init__(self, linear: nn.Linear, kind: str, dynamic: nn.Parameter | None = None) -> None:
        super().__init__()
        w = linear.weight
        self.kind, self.in_features, self.out_features = (
            kind,
            linear.in_features,
            linear.out_features,
        )
        self.compute_dtype = w.dtype
        self.bias = linear.bias
        self.offset = 0.0
        values = not w.is_meta
        n, dev = w.numel(), w.device
        if kind == "int8":
            if values:
                scb = w.detach().float().abs().amax(dim=1)
                q = w.detach().float() * (127 / scb.clamp_min(1e-30)).unsqueeze(1)
                self.weight = _frozen(q.round_().clamp_(-127, 127).to(torch.int8))
                self.SCB = _frozen(scb)
            else:
                self.weight = _frozen(torch.empty(w.shape, dtype=torch.int8, device=dev))
                self.SCB = _frozen(torch.empty(w.shape[0], dtype=torch.float32, device=dev))
            return
        blocks = math.ceil(n / BLOCK)
        self.code = _frozen(torch.tensor(NF4, dtype=torch.float32, device=dev))
        if values:
            packed, absmax = _quantize_nf4(w.detach().reshape(-1).float(), self.code)
        else:
            packed = torch.empty(((n + 1) // 2, 1), dtype=torch.uint8, device=dev)
            absmax = torch.empty(blocks, dtype=torch.float32, device=dev)
        self.weight = _frozen(packed)
        if kind == "nf4":
            self.absmax = _frozen(absmax)
            return
        assert dynamic is not None
        self.dynamic = dynamic
        blocks2 = math.ceil(blocks / BLOCK2)
        if values:
            self.offset = float(absmax.mean())
            qabs, absmax2 = _quantize_linear8(absmax - self.offset)
            self.absmax, self.absmax2 = _frozen(qabs), _frozen(absmax2)
        else:
            self.absmax = _frozen(torch.empty(blocks, dtype=torch.uint8, device=dev))
            self.absmax2 = _frozen(torch.empty(blocks2, dtype=torch.float32, device=dev))

    def extra_repr(self) -> str:
        return f"{self.in_features}, {self.out_features}, {self.kind} (bitsandbytes' layout)"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = _Dequantized.apply(x, self)
        return out

    def dequantized(self) -> torch.Tensor:
        """The weight in the compute dtype, out x in (a new tensor)."""
        if self.kind == "int8":
            w = self.weight.to(self.compute_dtype)
            return w.mul_((self.SCB / 127).to(self.compute_dtype).unsqueeze(1))
        n = self.in_features * self.out_features
        absmax = self._absmax()  # float32: a double-quantized layer's is a new tensor
        out = torch.empty(
            2 * self.weight.numel(), dtype=self.compute_dtype, device=self.weight.device
        )
        pairs, packed = out.view(-1, 2), self.weight.view(-1)
        table = _pairs(self.code, self.compute_dtype)
        starts = list(range(0, packed.numel(), CHUNK))
        if packed.is_meta:  # no values: every whole chunk allocates and frees the same
            starts = sorted({starts[0], starts[-1]})
        for start in starts:
            end = min(start + CHUNK, packed.numel())
            index = packed[start:end].int()
            torch.index_select(table, 0, index, out=pairs[start:end])
            del index
        if not packed.is_meta:
            _scale(out[:n], absmax)
        del absmax
        return out[:n].view(self.out_features, self.in_features)

    def _absmax(self) -> torch.Tensor:
        if self.kind == "nf4":
            return self.absmax
        # bitsandbytes' dequantize_blockwise: a float32 absmax, then + offset
        values = self.dynamic.index_select(0, self.absmax.int())
        if not values.is_meta:
            _scale(values, self.absmax2, BLOCK2)
        return values.add_(self.offset)


class _Dequantized(torch.autograd.Function):
    """A linear product with the weight dequantized for it and freed after it, in forward
    and again in backward (bitsandbytes' ``MatMul4Bit``)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, layer: QuantizedLinear) -> torch.Tensor:
        ctx.layer = layer
        w = layer.dequantized()
        if w.dtype != x.dtype:  # as bitsandbytes: the weight takes the input's dtype
            w = w.to(x.dtype)
        bias = layer.bias
        return functional.linear(x, w, None if bias is None else bias.to(w.dtype))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, None]:
        if not ctx.needs_input_grad[0]:
            return None, None
        w = ctx.layer.dequantized()
        return grad.matmul(w.to(grad.dtype)), None


def _pairs(code: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The 256 byte values as their two 4-bit codes' values (high nibble first), (256, 2)."""
    byte = torch.arange(256, device=code.device)
    return torch.stack([code[byte >> 4], code[byte & 15]], dim=1).to(dtype)


def _scale(flat: torch.Tensor, absmax: torch.Tensor, block: int = BLOCK) -> None:
    """``flat`` multiplied in place by each block's absmax (a last partial block too)."""
    full = flat.numel() // block
    if full:
        flat[: full * block].view(full, block).mul_(absmax[:full].unsqueeze(1))
    if full * block < flat.numel():
        flat[full * block :].mul_(absmax[full])


def _quantize_nf4(flat: torch.Tensor, code: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``flat`` (float32) as packed NF4 codes ((ceil(n / 2), 1) uint8) and absmax per block."""
    n = flat.numel()
    blocks = math.ceil(n / BLOCK)
    padded = torch.zeros(blocks * BLOCK + BLOCK, dtype=torch.float32, device=flat.device)
    padded[:n] = flat
    rows = padded[: blocks * BLOCK].view(blocks, BLOCK)
    absmax = rows.abs().amax(dim=1)
    normal = rows / absmax.clamp_min(1e-30).unsqueeze(1)
    middles = (code[1:] + code[:-1]) / 2  # nearest NF4 value: between which midpoints
    index = torch.bucketize(normal.reshape(-1), middles).to(torch.uint8)
    pairs = index[: 2 * ((n + 1) // 2)].view(-1, 2)
    packed = (pairs[:, 0] << 4) | pairs[:, 1]
    return packed.view(-1, 1).contiguous(), absmax


def _quantize_linear8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Centred absmax values as 8-bit codes of a linear map over [-1, 1] (bitsandbytes' dynamic
    map differs in values, not bytes) and a float32 scale per block of 256."""
    n = x.numel()
    blocks = math.ceil(n / BLOCK2)
    padded = torch.zeros(blocks * BLOCK2, dtype=torch.float32, device=x.device)
    padded[:n] = x
    rows = padded.view(blocks, BLOCK2)
    scale = rows.abs().amax(dim=1)
    q = (rows / scale.clamp_min(1e-30).unsqueeze(1) * 127.5 + 127.5).round_().clamp_(0, 255)
    return q.reshape(-1)[:n].to(torch.uint8), scale


def linear_map(device: torch.device) -> torch.Tensor:
    """The 256 values the 8-bit absmax codes stand for (see `_quantize_linear8`)."""
    return (torch.arange(256, dtype=torch.float32, device=device) - 127.5) / 127.5
