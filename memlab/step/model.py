"""Model housekeeping around a step: the device, the user's functions, the optimizer, the
checkpointed blocks, and leaving the user's model as it was."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import threading
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.utils.checkpoint
from torch import nn

from memlab.core import cuda
from memlab.core.devices import DeviceError, resolve
from memlab.core.frames import (
    message_of,
    raised_by_memlab,
    through_torch_alone,
    users_unless_memlab_s,
)
from memlab.core.ledger import default_ledger, device_key
from memlab.core.native.region import hand_over_open
from memlab.step.checkpoint import blocks as blocks  # their home is memlab.step.checkpoint
from memlab.step.checkpoint import checkpointed as checkpointed
from memlab.step.config import Amp, Optimizer, RunConfig, WhatIfError
from memlab.step.options import check_flags as check_flags  # for estimate's own switches
from memlab.step.restore import restored as restored  # its home: memlab.step.restore


def resolve_device(spec: str | None) -> torch.device:
    """One device, resolved and checked by the core (``None``: the current GPU, else the CPU)."""
    try:
        targets = resolve(spec)
    except DeviceError as e:
        raise WhatIfError(str(e)) from e
    if len(targets) != 1:
        raise WhatIfError(f"a run uses one device, not {spec!r}: name one, e.g. 'cuda:0'.")
    return torch.device(targets[0].name)


def config_of(config: Any, overrides: dict[str, Any]) -> RunConfig:
    """``config`` (a RunConfig, a mapping of its fields, or None) with ``overrides`` applied;
    a WhatIfError names what is wrong."""
    fields = set(RunConfig.__dataclass_fields__)
    unknown = sorted(set(overrides) - fields) + (
        sorted(set(config) - fields) if isinstance(config, Mapping) else []
    )
    if unknown:
        raise WhatIfError(
            f"{unknown[0]!r} is not a setting of a step: pass one of {', '.join(sorted(fields))}."
        )
    if config is None:
        base = RunConfig()
    elif isinstance(config, RunConfig):
        base = config
    elif isinstance(config, Mapping):
        base = RunConfig(**config)
    else:
        raise WhatIfError(
            f"config must be a memlab.whatif.RunConfig (or a dict of its fields), not "
            f"{type(config).__name__} {config!r:.60}: e.g. config=RunConfig(amp='bf16')."
        )
    return base.with_(**overrides) if overrides else base


#: What each of the user's functions is, as an example of what to pass.
_EXAMPLES = {"model_fn": "lambda: MyModel(config)", "input_fn": "lambda n: torch.randn(n, 512)",
             "loss_fn": "lambda output: output.logits.mean()",
             "step_fn": "lambda model, b: F.cross_entropy(model(b[0]), b[1])"}  # fmt: skip


def check_callable(name: str, fn: Any) -> None:
    """A WhatIfError naming ``name``, what it got and what to pass where ``fn`` is no function."""
    if not callable(fn):
        got = f"a tensor of shape {tuple(fn.shape)}" if isinstance(fn, torch.Tensor) else None
        raise WhatIfError(
            f"{name} must be a function, not {got or f'{type(fn).__name__} {fn!r:.60}'}: e.g. "
            f"{name}={_EXAMPLES.get(name, '...')}."
        )


def call(name: str, fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)``; what it raises becomes a WhatIfError naming ``name`` (OOM passes)."""
    check_callable(name, fn)
    try:
        return fn(*args)
    except (WhatIfError, torch.cuda.OutOfMemoryError):
        raise
    except Exception as e:
        raise WhatIfError(f"{name} raised {type(e).__name__}: {message_of(e)}") from e


def users_call(name: str, how: str, fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)``, a function of the user's that memlab calls as ``how`` says: what it
    raises is the user's (`memlab.core.frames.users_unless_memlab_s`); one that takes other
    arguments gets a WhatIfError saying how it is called."""
    try:
        return fn(*args)
    except TypeError as e:
        tb = e.__traceback__
        if tb is not None and tb.tb_next is None:  # raised by the call itself: not entered
            raise WhatIfError(
                f"{name} is called as {how}, and refused that: {message_of(e)}."
            ) from e
        users_unless_memlab_s(e)
        raise
    except Exception as e:
        users_unless_memlab_s(e)
        raise


def check_input(value: Any, tensors: list[torch.Tensor], device: torch.device, own: bool) -> None:
    """input_fn's result: its tensors on ``device``; without a step_fn of the user's (``own``),
    something the model can be called with."""
    if not own and value is None:  # (a string may be a model's input: one that tokenizes)
        raise WhatIfError(
            "input_fn returned None: return the model's input: a tensor, a tuple of its "
            "forward's arguments, or a dict of its keyword arguments (or give "
            "step_fn=lambda model, batch: ... to use it)."
        )
    if not own:
        check_keywords(value)
    check_device("input_fn's result", tensors, device)


def check_keywords(value: Any) -> None:
    """A WhatIfError for a mapping from input_fn whose keys are not all strings: it is the
    forward's keyword arguments, and Python's own error would come from inside the call."""
    bad = [k for k in value if not isinstance(k, str)] if isinstance(value, Mapping) else []
    if bad:
        raise WhatIfError(
            f"input_fn returned a {type(value).__name__} with keys that are not strings "
            f"({bad[0]!r} first): a mapping is the forward's keyword arguments, so its keys are "
            "their names, e.g. {'input_ids': ..., 'attention_mask': ...}. Return a tuple for "
            "positional arguments (or, outside mode='generate', give step_fn=lambda model, "
            "batch: ... to use it as it is)."
        )


def check_device(what: str, tensors: list[torch.Tensor], device: torch.device) -> None:
    """A WhatIfError naming ``what`` if a tensor is not on ``device``."""
    for t in tensors:
        if device_key(t.device) != device_key(device):
            raise WhatIfError(
                f"{what} is on {device_key(t.device)}, but the run is on {device}: create it on "
                f"{device}, or choose that device for the run."
            )


def cpu_to(value: Any, device: torch.device, depth: int = 0) -> Any:
    """``value`` with its CPU tensors (itself, or inside its tuples, lists, mappings and
    dataclasses) copied to ``device``: an estimate's input read from a dataset held on the CPU
    is on the GPU in the step it predicts. A container whose type cannot be rebuilt from its
    items is left as it is (`check_device` then says what to pass)."""
    if isinstance(value, torch.Tensor):
        return value.to(device) if value.device.type == "cpu" else value
    if depth > 4:
        return value
    try:
        if _is_dataclass(value):  # a dataclass instance: its fields moved (`step.outputs`)
            fields = {
                f.name: cpu_to(getattr(value, f.name), device, depth + 1) for f in _init(value)
            }
            return dataclasses.replace(value, **fields)
        if not isinstance(value, (Mapping, tuple, list)):
            return value
        if isinstance(value, Mapping):
            items = {k: cpu_to(v, device, depth + 1) for k, v in value.items()}
            kind: Any = type(value)  # (a dict subclass: BatchEncoding, OrderedDict)
            return items if kind is dict else kind(items)
        moved = [cpu_to(v, device, depth + 1) for v in value]
        if type(value) in (tuple, list):
            return type(value)(moved)
        return type(value)(*moved)  # a namedtuple
    except Exception:  # a container of the user's that its items do not rebuild
        return value


def _is_dataclass(value: Any) -> bool:
    return dataclasses.is_dataclass(value) and not isinstance(value, (type, Mapping))


def _init(value: Any) -> list[dataclasses.Field[Any]]:
    return [f for f in dataclasses.fields(value) if f.init]


def forward_error(e: Exception, batch: int, tensors: Sequence[torch.Tensor]) -> Exception | None:
    """What a model built of PyTorch's own layers raised on input_fn's batch (a shape or dtype
    it does not take): a WhatIfError naming input_fn and what it returned. None where the
    user's own code raised (its frames say where), memlab's did, or it is an out-of-memory."""
    kinds = (RuntimeError, ValueError, IndexError, TypeError)
    if not isinstance(e, kinds) or isinstance(e, (WhatIfError, torch.cuda.OutOfMemoryError)):
        return None
    # (a user's own code among its frames, or a library model's, explains itself)
    if raised_by_memlab(e) or not through_torch_alone(e):
        return None
    shown = ", ".join(f"{tuple(t.shape)} {str(t.dtype)[6:]}" for t in tensors[:4])
    more = ", ..." if len(tensors) > 4 else ""
    return WhatIfError(
        f"the model's forward raised {type(e).__name__}: {message_of(e)[:300]}; on what "
        f"input_fn({batch}) returned ({len(tensors)} tensor(s): {shown}{more}): make input_fn "
        "return the shapes and dtypes the model takes."
    )


#: The optimizers memlab made for its runs (a user's step_fn may not step one of its own).
OWN_OPTIMIZERS: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()


def optimizer(
    model: nn.Module, config: RunConfig, foreach: bool | None = None
) -> torch.optim.Optimizer:
    """The optimizer ``config`` names, over the model's trainable parameters."""
    return optimizer_over([p for p in model.parameters() if p.requires_grad], config, foreach)


def optimizer_over(
    params: Sequence[torch.Tensor], config: RunConfig, foreach: bool | None = None
) -> torch.optim.Optimizer:
    """The optimizer ``config`` names, over ``params`` (one of `OWN_OPTIMIZERS`)."""
    params = list(params)
    opt: torch.optim.Optimizer
    if config.optimizer == Optimizer.SGD:
        opt = torch.optim.SGD(params, lr=config.lr, foreach=foreach)
    elif config.optimizer == Optimizer.SGD_MOMENTUM:
        opt = torch.optim.SGD(params, lr=config.lr, momentum=0.9, foreach=foreach)
    elif config.optimizer == Optimizer.ADAM:
        opt = torch.optim.Adam(params, lr=config.lr, foreach=foreach)
    else:
        opt = torch.optim.AdamW(params, lr=config.lr, foreach=foreach)
    OWN_OPTIMIZERS.add(opt)
    return opt


@contextlib.contextmanager
def random_kept(device: torch.device) -> Iterator[None]:
    """torch's random state (the CPU's, and the run's GPU's) as it was before the block: the
    random numbers a run draws (its inputs, dropout, a new model's initialisation) leave the
    notebook's own sequence where it was. Only on the main thread: on another (the panel's
    buttons) the kernel stays free, and numbers a cell drew meanwhile would be drawn again."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    gpus = []
    if device.type == "cuda":
        gpus = [device.index if device.index is not None else torch.cuda.current_device()]
    with torch.random.fork_rng(devices=gpus, device_type="cuda"):
        yield


def autocast_of(
    amp: Amp, device: torch.device, make: Callable[[torch.dtype], Any] | None
) -> Callable[[], contextlib.AbstractContextManager[Any]]:
    """The AMP context of the step (a null context with AMP off: a disabled ``torch.autocast``
    still asks for the device's autocast type, which ``meta`` lacks)."""
    dtype = amp.dtype
    if dtype is None:
        return contextlib.nullcontext
    if make is not None:
        return functools.partial(make, dtype)
    return functools.partial(torch.autocast, device.type, dtype=dtype)


def skipped(opt: torch.optim.Optimizer | None) -> bool:
    """Whether the optimizer has not stepped yet: no state (the stateless SGD without momentum
    counts as stepped)."""
    if opt is None or not any(opt.defaults.get(k) for k in ("momentum", "betas")):
        return False
    return not any(opt.state.values())


def check_scalable(model: nn.Module, config: RunConfig, own_backward: bool) -> None:
    """A WhatIfError where amp='fp16' would unscale fp16 gradients, which torch's GradScaler
    refuses deep in its step. Checked where the scaler steps, so an estimate, which runs
    without one, says the same; a step_fn that ran backward itself is stepped without it."""
    if config.amp != Amp.FP16 or own_backward:
        return
    half = [n for n, p in model.named_parameters() if p.requires_grad and p.dtype == torch.float16]
    if half:
        raise WhatIfError(
            f"amp='fp16' unscales the gradients with torch's GradScaler, which refuses fp16 "
            f"gradients, and {len(half)} trainable parameter(s) are fp16 themselves "
            f"({half[0]!r} first: a model made with .half() or torch_dtype=torch.float16). "
            "Pass amp='bf16' (no scaler), amp='off' (a step in the parameters' own fp16), or "
            "keep fp32 master weights: build the model in fp32, and autocast computes in fp16."
        )


def allocated(device: torch.device) -> int:
    """What is allocated on ``device`` now (a series' point, in eval with outputs kept)."""
    if device.type == "cuda":
        return cuda.allocated(device)
    if device.type == "cpu":  # a native region hands the ledger what it holds so far
        hand_over_open()
    return default_ledger().total(str(device))
