"""The pre-flight's AMP lever: a cell's allocation stream as ``torch.autocast`` (bfloat16) would
change it, op by op, instead of every activation halved.

While the cell runs, each allocation is judged from the op that made it (read off memlab's
dispatch mode on the stack, as `memlab.core.accounting` runs it):

* a matrix product or convolution (CUDA's lower-precision list) makes a bfloat16 output, and
  takes bfloat16 copies of its float32 inputs: a parameter's once, kept (autograd saves it), an
  activation's for as long as the activation lives;
* softmax, norms, losses, exp and the like (CUDA's float32 list) make a float32 output, and a
  float32 copy of each bfloat16 input for the op's duration (a language model's logits: a
  bfloat16 tensor and its float32 copy, more than the float32 logits alone);
* any other op follows its inputs: bfloat16 where every floating input with elements is (type
  promotion);
* in backward (outside autocast) nothing is cast; a product's output is bfloat16 (its operands
  were saved so), any other op's where any input is: a gradient has its tensor's type (the
  backward of autocast's cast casts it back);
* what the cell did not make (weights, the batch) and integer tensors stay as they are.

Only activations and temporaries shrink: gradients, optimizer state and parameters keep their
type (autocast leaves them in float32). Checked against the same cell run under autocast: equal
for a language model's loss; high by about a sixth for a stack of Linear, GELU and LayerNorm,
where autograd saves the cast copy and lets the original go, and both are counted here (so the
lever errs towards "still too big", never towards a false "fits"). Not modelled: autocast regions
the cell opens itself, the kernels' own workspaces, ops the policy lists only under a Python name.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Mapping
from types import FrameType
from typing import Any

import torch

from memlab.core import _torch
from memlab.core.accounting import Accountant, _Mode
from memlab.core.ledger import Ledger
from memlab.core.storages import op_tensors
from memlab.estimate.autocast import FLOAT32, FLOAT32_OUTPUT, LOWER_PRECISION

#: How the pre-flight's AMP lever says what to change.
AMP_HOW = (
    "`with torch.autocast('cuda', dtype=torch.bfloat16):` around the forward (this cell's ops "
    "replayed as autocast types them: products in bfloat16, softmax, norms and losses in float32)"
)
#: aten's names of CUDA's lower-precision and float32 ops (the policy lists Python names).
_LOWER = {*LOWER_PRECISION, "convolution", "_convolution", "cudnn_convolution", "addmm", "mm"}
_LOWER |= {n for n in ("_scaled_dot_product_efficient_attention", "_flash_attention_forward")}
_FP32 = {*FLOAT32, "softmax", "log_softmax", "nll_loss_forward", "nll_loss2d_forward"}
_FP32 |= {"native_group_norm", "_fused_rms_norm", "norm"}
#: Ops autocast gives ``dtype=float32`` instead of casting: a float32 output, and no copy of the
#: input but where the kernel makes one itself (softmax's converts its input first).
_FP32_OUTPUT = set(FLOAT32_OUTPUT) - {"softmax", "log_softmax"}
_CASTS = {"_to_copy", "to", "copy", "copy_"}
_NAMED = _FP32 | _LOWER | _FP32_OUTPUT
_SCALED = ("activation", "temporary")
#: The mark of a transient copy's free: after the op's next allocation (its output).
_AFTER = "after"
_DISPATCH = inspect.unwrap(_Mode.__torch_dispatch__).__code__  # (PyTorch wraps it)
_OUTPUTS = inspect.unwrap(Accountant.see_outputs).__code__


def _name(func: Any) -> str:
    packet = getattr(func, "overloadpacket", None)
    name = str(getattr(packet, "__name__", "") or getattr(func, "__name__", ""))
    return name[1:] if name.startswith("_") and name[1:] in _NAMED else name


class AmpStream:
    """The cell's stream as autocast would make it (see the module's text)."""

    def __init__(self, ledger: Ledger) -> None:
        self.ledger = ledger
        #: (serial, bytes, mark): the cell's events, with the copies autocast would add
        #: (negative serials), in order. A malloc's mark: whether its output would be bfloat16;
        #: a free (negative bytes): None, or `_AFTER` for a copy freed after the op's output.
        self.events: list[tuple[int, int, bool | str | None]] = []
        self.half: dict[int, bool] = {}
        self._cast: dict[int, int] = {}  # a float32 storage's serial -> its bfloat16 copy's
        self._kept: set[int] = set()  # copies of parameters: kept to the end
        self._copies = 0
        self._op: tuple[int, Any] = (0, None)  # the op whose inputs were cast (once an op)
        self.lost = 0

    def malloc(self, serial: int, nbytes: int) -> None:
        try:
            self.half[serial] = self._judge()
        except Exception:  # never break the cell for a lever
            self.lost += 1
        self.events.append((serial, nbytes, self.half.get(serial)))

    def free(self, serial: int, nbytes: int) -> None:
        self.events.append((serial, -nbytes, None))
        copy = self._cast.pop(serial, None)
        if copy is not None and copy not in self._kept:
            self.events.append((copy, -1, None))  # an activation's copy: freed with it
            # (replay_peak frees by serial: the bytes of a free are not read)

    def _judge(self) -> bool:
        frame: FrameType | None = sys._getframe(2)
        out, op = None, None
        while frame is not None and op is None:
            if frame.f_code is _OUTPUTS:
                out = frame.f_locals.get("t")
            elif frame.f_code is _DISPATCH:
                op = frame.f_locals
            frame = frame.f_back
        if op is None or not isinstance(out, torch.Tensor) or out.dtype != torch.float32:
            return False  # made outside an op, or not float32 (autocast casts only float32)
        name, args, kwargs = _name(op.get("func")), op.get("args", ()), op.get("kwargs")
        inputs = op_tensors(args) + (op_tensors(kwargs.values()) if kwargs else [])
        floats = [t for t in inputs if t.dtype == torch.float32]
        halves = [self.half.get(self.ledger.serial_of(t) or 0) for t in floats if t.dim() > 0]
        if _torch.current_autograd_node() is not None:  # backward, outside autocast: no casts;
            # a product's operands were saved in bfloat16, and a gradient has its tensor's type
            return name in _LOWER or any(halves)  # (the backward of a cast casts it back)
        key = (id(args), op.get("started"))  # (the time it started tells two ops apart)
        first, self._op = self._op != key, key
        if name in _LOWER:
            if first:
                for t in floats:
                    self._lower(t)
            return True
        if name in _CASTS or name in _FP32_OUTPUT:  # the program's own cast; a float32 output
            return False
        if name in _FP32:
            if first:  # float32 copies of the bfloat16 inputs, while the op runs
                for t in floats:
                    s = self.ledger.serial_of(t)
                    if s is not None and self.half.get(s):
                        self._copy(_bytes(t), transient=True)
            return False
        return bool(halves) and all(halves)

    @property
    def changes(self) -> bool:
        """Whether autocast would change anything: some output judged bfloat16, every op read
        (a cell in bfloat16 already, or under autocast already, has nothing to offer)."""
        return not self.lost and any(self.half.values())

    def _lower(self, t: torch.Tensor) -> None:
        s = self.ledger.serial_of(t)
        if s is None or self.half.get(s) or s in self._cast:
            return
        self._cast[s] = self._copy(_bytes(t) // 2, transient=False)
        if isinstance(t, torch.nn.Parameter) or (t.is_leaf and t.requires_grad):
            self._kept.add(self._cast[s])  # the cast cache's copy, saved by the product

    def _copy(self, nbytes: int, transient: bool) -> int:
        self._copies += 1
        serial = -self._copies
        self.events.append((serial, nbytes, None))
        if transient:
            self.events.append((serial, -nbytes, _AFTER))
        return serial

    def stream(self, roles: Mapping[int, str]) -> list[tuple[int, int]]:
        """The events as (serial, bytes) for `memlab.estimate.oom.replay_peak`: the judged
        activations and temporaries at half their bytes, the copies as made."""
        out: list[tuple[int, int]] = []
        pending: list[tuple[int, int]] = []  # transient copies: freed after the op's output
        for serial, nbytes, mark in self.events:
            if mark is _AFTER:
                pending.append((serial, nbytes))
                continue
            if nbytes > 0 and mark is True and serial >= 0 and roles.get(serial) in _SCALED:
                nbytes = max(nbytes // 2, 1)
            out.append((serial, nbytes))
            if nbytes > 0 and serial >= 0 and pending:  # the op's output: its copies go now
                out.extend(pending)
                pending.clear()
        return out + pending


def _bytes(t: torch.Tensor) -> int:
    """What a cast of ``t`` copies: its elements (a view's, not its whole storage's)."""
    return t.numel() * t.element_size()
