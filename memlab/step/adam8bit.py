"""Adam and AdamW with 8-bit state in bitsandbytes' layout, in plain torch, so that a step's
optimizer state has the bytes bitsandbytes' ``Adam8bit`` / ``AdamW8bit`` would give it on any
device (bitsandbytes itself needs CUDA).

The layout (bitsandbytes ``Optimizer2State.init_state``, ``block_wise=True``, the default):
for a parameter of n >= ``min_8bit_size`` (4,096, documented) elements, ``state1`` and
``state2`` of n bytes each (uint8 codes), ``absmax1`` and ``absmax2`` of ceil(n / 256) float32
(one scale per block of 256 elements); smaller parameters keep two float32 states of n
elements; ``qmap1`` and ``qmap2`` (256 float32 each) are shared by all parameters; ``step`` is a
Python int. `state_bytes` is that count.

The update is Adam's, computed in float32 a chunk at a time and stored back as codes scaled by
each block's largest magnitude (square-root codes: bitsandbytes uses its "dynamic" map, so the
values differ a little, the bytes do not). Its temporaries (a few float32 copies of one chunk,
``CHUNK`` elements) are not what bitsandbytes' fused CUDA kernel allocates (nothing).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch

#: bitsandbytes' defaults: elements per block of the block-wise quantization, and the smallest
#: parameter whose state is 8-bit.
BLOCK, MIN_8BIT_SIZE = 256, 4096
#: Elements updated at once (a multiple of BLOCK): bounds the update's float32 temporaries.
CHUNK = 1 << 20


def state_bytes(numels: Iterable[int]) -> int:
    """The optimizer state's bytes for parameters of these sizes, in bitsandbytes' layout."""
    total, any8 = 0, False
    for n in numels:
        if n >= MIN_8BIT_SIZE:
            total += 2 * n + 2 * 4 * math.ceil(n / BLOCK)
            any8 = True
        else:
            total += 2 * 4 * n
    return total + (2 * 256 * 4 if any8 else 0)


class Adam8bit(torch.optim.Optimizer):
    """Adam (``decoupled=False``) or AdamW with bitsandbytes' 8-bit state layout."""

    def __init__(
        self,
        params: Iterable[torch.Tensor],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        decoupled: bool = False,
    ) -> None:
        defaults = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay}
        super().__init__(params, defaults)
        self.decoupled = decoupled
        self._qmaps: tuple[torch.Tensor, torch.Tensor] | None = None

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self._update(p, group)

    def _init(self, p: torch.Tensor) -> dict[str, Any]:
        state: dict[str, Any] = self.state[p]
        n = p.numel()
        state["step"] = 0
        if n < MIN_8BIT_SIZE:
            state["state1"] = torch.zeros(n, dtype=torch.float32, device=p.device)
            state["state2"] = torch.zeros(n, dtype=torch.float32, device=p.device)
            return state
        if self._qmaps is None:  # the two 256-entry code books, shared
            self._qmaps = tuple(  # type: ignore[assignment]
                torch.zeros(256, dtype=torch.float32, device=p.device) for _ in range(2)
            )
        assert self._qmaps is not None
        blocks = math.ceil(n / BLOCK)
        state["state1"] = torch.full((n,), 128, dtype=torch.uint8, device=p.device)
        state["state2"] = torch.zeros(n, dtype=torch.uint8, device=p.device)
        state["qmap1"], state["qmap2"] = self._qmaps
        state["absmax1"] = torch.zeros(blocks, dtype=torch.float32, device=p.device)
        state["absmax2"] = torch.zeros(blocks, dtype=torch.float32, device=p.device)
        return state

    def _update(self, p: torch.Tensor, group: dict[str, Any]) -> None:
        state = self.state[p] if self.state[p] else self._init(p)
        state["step"] += 1
        lr, (b1, b2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
        t = state["step"]
        size = lr / (1 - b1**t)
        root = math.sqrt(1 - b2**t)
        flat, grads = p.detach().view(-1), p.grad.detach().view(-1)  # type: ignore[union-attr]
        eight = state["state1"].dtype == torch.uint8
        starts = list(range(0, flat.numel(), CHUNK))
        if flat.is_meta:  # no values: each whole chunk allocates and frees the same, run one
            starts = sorted({starts[0], starts[-1]})
        for start in starts:
            end = min(start + CHUNK, flat.numel())
            g = grads[start:end].float()
            if wd and not self.decoupled:
                g = g.add(flat[start:end].float(), alpha=wd)
            if eight:
                m = _decode(state["state1"][start:end], state["absmax1"], start, signed=True)
                v = _decode(state["state2"][start:end], state["absmax2"], start, signed=False)
            else:
                m, v = state["state1"][start:end], state["state2"][start:end]
            m.mul_(b1).add_(g, alpha=1 - b1)
            v.mul_(b2).addcmul_(g, g, value=1 - b2)
            denom = v.sqrt().div_(root).add_(eps)
            if wd and self.decoupled:
                flat[start:end].mul_(1 - lr * wd)
            flat[start:end].addcdiv_(m.to(flat.dtype), denom.to(flat.dtype), value=-size)
            del g, denom  # before the codes are made: fewer chunks alive at once
            if eight:
                _encode(m, state["state1"][start:end], state["absmax1"], start, signed=True)
                _encode(v, state["state2"][start:end], state["absmax2"], start, signed=False)
            del m, v


def _blocks(x: torch.Tensor) -> list[torch.Tensor]:
    """``x`` as (blocks, 256) for its whole blocks, and (1, rest) for a last partial one."""
    full = x.numel() // BLOCK * BLOCK
    parts = [x[:full].view(-1, BLOCK)] if full else []
    return parts + ([x[full:].view(1, -1)] if full < x.numel() else [])


def _decode(codes: torch.Tensor, absmax: torch.Tensor, start: int, signed: bool) -> torch.Tensor:
    out = codes.float()
    first = start // BLOCK
    for part in _blocks(out):
        scale = absmax[first : first + part.shape[0]].unsqueeze(1)
        if signed:  # square-root companding: code = 128 + 127 * sign(x) * sqrt(|x| / absmax)
            part.sub_(128).div_(127)
            part.mul_(part.abs()).mul_(scale)
        else:  # code = 255 * sqrt(x / absmax)
            part.div_(255).square_().mul_(scale)
        first += part.shape[0]
    return out


def _encode(
    x: torch.Tensor, codes: torch.Tensor, absmax: torch.Tensor, start: int, signed: bool
) -> None:
    first = start // BLOCK
    done = 0
    for part in _blocks(x):
        rows = part.shape[0]
        scale = part.abs().amax(dim=1)
        absmax[first : first + rows] = scale
        q = part / scale.clamp_min(1e-30).unsqueeze(1)
        if signed:
            sign = q.sign()
            q.abs_().sqrt_().mul_(sign)
            del sign
        else:
            q.sqrt_()
        q = q.mul_(127).round_().add_(128) if signed else q.mul_(255).round_()
        codes[done : done + part.numel()] = q.view(-1).to(torch.uint8)
        first, done = first + rows, done + part.numel()
