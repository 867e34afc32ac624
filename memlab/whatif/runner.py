"""Run one step under a configuration, measured, and leave the user's model as it was."""

from __future__ import annotations

import contextlib
import functools
import traceback
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils.checkpoint
from torch import nn

from memlab.core.accounting import warm_up
from memlab.core.categories import Category
from memlab.core.devices import DeviceError, resolve
from memlab.core.ledger import default_ledger, device_key
from memlab.region import track
from memlab.reports.report import MemoryReport
from memlab.whatif.config import RunConfig, WhatIfError

#: The 16-bit type of each AMP setting ("off" has none).
AMP_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}

ModelFn = Callable[[], nn.Module]
InputFn = Callable[[int], Any]
LossFn = Callable[[Any], torch.Tensor]


@dataclass(frozen=True)
class RunResult:
    config: RunConfig
    report: MemoryReport | None
    oom: bool = False
    error: str | None = None
    #: The retention experiment: memory allocated after each iteration, in bytes.
    series: tuple[int, ...] = ()
    #: Not measured but predicted by `memlab.estimate` for this GPU (its name).
    predicted_for: str | None = None

    @property
    def peak(self) -> int | None:
        return None if self.report is None else self.report.peak_allocated

    def to_dict(self) -> dict[str, Any]:
        return {
            "config": self.config.describe(),
            "oom": self.oom,
            "error": self.error,
            "series": list(self.series),
            "predicted_for": self.predicted_for,
            "report": None if self.report is None else self.report.to_dict(),
        }


def run(
    model_fn: ModelFn,
    input_fn: InputFn,
    loss_fn: LossFn | None = None,
    config: RunConfig | None = None,
    *,
    on_measure: Callable[[str], None] | None = None,
    foreach: bool | None = None,
) -> RunResult:
    """A warm-up step, then one measured step under ``config``.

    model_fn(): the model, on the run's device. A new one each call keeps runs isolated; if it
        returns your existing model, memlab restores its weights, buffers, gradients, train/eval
        modes and forwards afterwards, also when the run fails.
    input_fn(batch_size): the model's input: a tensor, a tuple (the arguments) or a mapping (the
        keyword arguments, e.g. ``input_ids`` and ``labels`` for a Hugging Face model).
    loss_fn(output): a scalar loss (default: the model's own ``loss`` where the output is a
        mapping that has one, as a Hugging Face model given labels returns; otherwise the mean
        square of the output's first tensor).
    on_measure("start") / on_measure("end"): called just before and just after the measured step
        (the estimator uses them).
    foreach: the optimizer's ``foreach`` option (None: PyTorch's default for the device; the
        estimator asks for True, CUDA's default, when it runs on ``meta``).
    Raises WhatIfError for inputs it cannot run; an out-of-memory run is a result (oom=True).
    """
    config = config or RunConfig()
    device = resolve_device(config.device)
    # PyTorch imports torch._dynamo on the first optimizer or dispatch mode, and the import keeps
    # the frames on its stack in a reference cycle: warm_up() does it on a thread of its own, and
    # must come before this run builds its optimizer, which would do it here otherwise.
    warm_up()
    model = _call("model_fn", model_fn)
    if not isinstance(model, nn.Module):
        raise WhatIfError(f"model_fn must return a torch.nn.Module, not {type(model).__name__}.")
    _check_device("the model", [*model.parameters(), *model.buffers()], device)
    training = config.mode == "train" and config.retention == "off"
    if training and not any(p.requires_grad for p in model.parameters()):
        raise WhatIfError(
            "The model has no trainable parameters, so a training step has nothing to do: use "
            "mode='no_grad', or unfreeze some parameters."
        )
    with _restored(model, weights=training), _checkpointed(model, config.checkpoint):
        opt = _optimizer(model, config, foreach) if training else None
        # (on meta, the estimator's device, a scaler cannot run; its state is a few bytes)
        fp16 = training and config.amp == "fp16" and device.type != "meta"
        scaler = torch.amp.GradScaler(device.type) if fp16 else None
        step = functools.partial(_step, model, input_fn, loss_fn, config, device, opt, scaler)
        region = track(device, breakdown=True, timeline=True, watch=[model])
        try:
            if config.warmup:
                step(lambda t: None)
                # with fp16, the scaler skips the optimizer's step while the scaled gradients
                # overflow (often the first steps, at its initial scale): warm up again until
                # one is taken, so the measured step finds the optimizer's state in place
                for _ in range(SCALER_RETRIES if scaler is not None else 0):
                    if not _skipped(opt):
                        break
                    step(lambda t: None)
            if on_measure is not None:
                on_measure("start")
            with region:
                kept, series = step(lambda t: region.mark(t, Category.INPUT))
            del kept
            if on_measure is not None:
                on_measure("end")
        except torch.cuda.OutOfMemoryError as e:
            traceback.clear_frames(e.__traceback__)  # the frames hold the step's tensors
            message = str(e).splitlines()[0]
            del e
            try:  # an OOM in the measured step still has its report; one in the warm-up has none
                report: MemoryReport | None = region.report
            except RuntimeError:
                report = None
            return RunResult(config, report, oom=True, error=f"CUDA out of memory: {message}")
    report = region.report
    over = config.budget is not None and report.peak_allocated > config.budget
    error = (
        f"the peak ({report.peak_allocated:,} B) exceeds the budget ({config.budget:,} B)"
        if over
        else None
    )
    return RunResult(config, report, oom=over, error=error, series=tuple(series))


#: Warm-up steps tried again at most, while an fp16 scaler skips the optimizer's step.
SCALER_RETRIES = 8


def _skipped(opt: torch.optim.Optimizer | None) -> bool:
    """Whether the optimizer has not stepped yet: no state (the stateless SGD without momentum
    counts as stepped)."""
    if opt is None or not any(opt.defaults.get(k) for k in ("momentum", "betas")):
        return False
    return not any(opt.state.values())


# -- the step ---------------------------------------------------------------------------------
def _step(
    model: nn.Module,
    input_fn: InputFn,
    loss_fn: LossFn | None,
    config: RunConfig,
    device: torch.device,
    opt: torch.optim.Optimizer | None,
    scaler: torch.amp.GradScaler | None,
    mark: Callable[[torch.Tensor], None],
) -> tuple[list[Any], list[int]]:
    amp = AMP_DTYPES.get(config.amp)
    # a disabled torch.autocast still asks for the device's autocast type, which "meta" lacks
    autocast: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext
    if amp is not None and device.type == "meta":  # the estimator: CUDA's policy, emulated
        from memlab.estimate.autocast import emulated

        autocast = functools.partial(emulated, amp)
    elif amp is not None:
        autocast = functools.partial(torch.autocast, device.type, dtype=amp)
    if config.retention != "off":  # evaluation with grad enabled, outputs kept
        model.eval()
        kept, series = [], []
        for _ in range(config.iterations):
            with autocast():
                out = _forward(model, input_fn, config.batch_size, device, mark)
            kept.append(out if config.retention == "attached" else _detach(out))
            series.append(_allocated(device))
        return kept, series
    if config.mode != "train":
        model.eval()
        grad = torch.no_grad() if config.mode == "no_grad" else torch.inference_mode()
        with grad, autocast():
            out = _forward(model, input_fn, config.batch_size, device, mark)
        return [out], []
    assert opt is not None
    model.train()
    micro = config.batch_size // config.accumulation
    for _ in range(config.accumulation):
        with autocast():
            out = _forward(model, input_fn, micro, device, mark)
            loss = _loss(loss_fn, out) / config.accumulation
        (scaler.scale(loss) if scaler is not None else loss).backward()
        del out, loss
    if scaler is not None:
        scaler.step(opt)
        scaler.update()
    else:
        opt.step()
    opt.zero_grad(set_to_none=True)
    return [], []


def _forward(
    model: nn.Module,
    input_fn: InputFn,
    batch: int,
    device: torch.device,
    mark: Callable[[torch.Tensor], None],
) -> Any:
    """The model on input_fn(batch): a tuple is its arguments, a mapping its keyword arguments
    (``{"input_ids": ..., "labels": ...}`` for a Hugging Face model), anything else the one
    argument."""
    value = _call("input_fn", input_fn, batch)
    args: tuple[Any, ...] = value if isinstance(value, tuple) else (value,)
    kwargs: dict[str, Any] = {}
    if isinstance(value, Mapping):
        args, kwargs = (), dict(value)
    tensors = [t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)]
    _check_device("input_fn's result", tensors, device)
    for t in tensors:
        mark(t)
    return model(*args, **kwargs)


def _loss(loss_fn: LossFn | None, out: Any) -> torch.Tensor:
    if loss_fn is None:
        if isinstance(out, Mapping):  # e.g. a Hugging Face ModelOutput
            own = out.get("loss")
            if isinstance(own, torch.Tensor) and own.numel() == 1:
                return own  # the model computed its loss (it was given labels)
            out = list(out.values())
        first = (
            out
            if isinstance(out, torch.Tensor)
            else next((t for t in out if isinstance(t, torch.Tensor)), None)
        )
        if first is None:
            raise WhatIfError("The model's output holds no tensor: give a loss_fn.")
        return first.float().pow(2).mean()
    loss = _call("loss_fn", loss_fn, out)
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise WhatIfError(
            f"loss_fn must return a scalar tensor (e.g. end it with .mean()), not {shape}."
        )
    return loss


def _detach(out: Any) -> Any:
    if isinstance(out, torch.Tensor):
        return out.detach()
    if isinstance(out, Mapping):
        return {k: _detach(v) for k, v in out.items()}
    return type(out)(_detach(o) for o in out) if isinstance(out, (list, tuple)) else out


def _allocated(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.memory_allocated(device))
    return default_ledger().total(str(device))


# -- set-up and restoring -----------------------------------------------------------------------
def resolve_device(spec: str | None) -> torch.device:
    """One device, resolved and checked by the core (``None``: the current GPU, else the CPU)."""
    try:
        targets = resolve(spec)
    except DeviceError as e:
        raise WhatIfError(str(e)) from e
    if len(targets) != 1:
        raise WhatIfError(f"a run uses one device, not {spec!r}: name one, e.g. 'cuda:0'.")
    return torch.device(targets[0].name)


def _call(name: str, fn: Callable[..., Any], *args: Any) -> Any:
    if not callable(fn):
        raise WhatIfError(f"{name} must be a function, not {type(fn).__name__}.")
    try:
        return fn(*args)
    except (WhatIfError, torch.cuda.OutOfMemoryError):
        raise
    except Exception as e:
        raise WhatIfError(f"{name} raised {type(e).__name__}: {e}") from e


def _check_device(what: str, tensors: list[torch.Tensor], device: torch.device) -> None:
    for t in tensors:
        if device_key(t.device) != device_key(device):
            raise WhatIfError(
                f"{what} is on {device_key(t.device)}, but the run is on {device}: create it on "
                f"{device}, or choose that device for the run."
            )


def _optimizer(
    model: nn.Module, config: RunConfig, foreach: bool | None = None
) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]
    if config.optimizer == "sgd":
        return torch.optim.SGD(params, lr=config.lr, foreach=foreach)
    if config.optimizer == "sgd_momentum":
        return torch.optim.SGD(params, lr=config.lr, momentum=0.9, foreach=foreach)
    if config.optimizer == "adam":
        return torch.optim.Adam(params, lr=config.lr, foreach=foreach)
    return torch.optim.AdamW(params, lr=config.lr, foreach=foreach)


def blocks(model: nn.Module) -> list[str]:
    """Module paths of repeated blocks: the children of each ModuleList or Sequential whose
    children (two or more) are all of one type. Nested repeats inside a block are left alone."""
    found: list[str] = []
    for path, module in model.named_modules():
        if any(path.startswith(f + ".") for f in found):
            continue
        if isinstance(module, (nn.ModuleList, nn.Sequential)):
            children = list(module.named_children())
            if len(children) >= 2 and len({type(c) for _, c in children}) == 1:
                found += [f"{path}.{n}" if path else n for n, _ in children]
    return found


@contextlib.contextmanager
def _checkpointed(model: nn.Module, spec: str | tuple[str, ...]) -> Iterator[None]:
    if spec == "off":
        yield
        return
    named = dict(model.named_modules())
    paths = blocks(model) if spec == "auto" else list(spec)
    missing = [p for p in paths if p not in named]
    if missing:
        top = ", ".join(list(named)[1:8])
        raise WhatIfError(f"No module {missing[0]!r} in the model (its modules: {top}, ...).")
    if not paths:
        raise WhatIfError(
            "checkpoint='auto' found no repeated blocks (a ModuleList or Sequential of identical "
            "layers): name the modules to checkpoint instead."
        )
    wrapped: list[nn.Module] = []
    try:
        for p in paths:
            module = named[p]
            original = module.forward

            def forward(*args: Any, _f: Callable[..., Any] = original, **kw: Any) -> Any:
                # looked up at each call: the estimator's autocast emulation wraps it
                return torch.utils.checkpoint.checkpoint(_f, *args, use_reentrant=False, **kw)

            module.forward = forward
            wrapped.append(module)
        yield
    finally:
        for module in wrapped:
            del module.forward  # the class's forward shows through again


@contextlib.contextmanager
def _restored(model: nn.Module, weights: bool) -> Iterator[None]:
    """Leave ``model`` as it was: modes, gradients and (after a training step) its values."""
    modes = [(m, m.training) for m in model.modules()]
    grads = [(p, p.grad) for p in model.parameters()]
    values = {}
    if weights:  # copies on the CPU: a copy on the GPU would double what the run measures
        with torch.no_grad():
            values = {
                k: v.detach().to("cpu", copy=True)
                for k, v in model.state_dict(keep_vars=True).items()
                if v.device.type != "meta"  # meta tensors hold no values
            }
    try:
        yield
    finally:
        for m, training in modes:
            m.training = training
        for p, g in grads:
            p.grad = g
        if values:
            with torch.no_grad():
                for k, v in model.state_dict(keep_vars=True).items():
                    if k in values:
                        v.copy_(values[k])
