"""The configuration of a step, validated once, with errors that say what to do.

Every choice is a string enum (`Amp`, `Mode`, `Retention`, `Optimizer`) that also accepts its
string: ``RunConfig(amp="bf16")`` and ``RunConfig(amp=Amp.BF16)`` are the same configuration.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, replace
from typing import Any

from memlab.core.frames import users_init
from memlab.step.options import (
    AMP,
    AMP_DTYPES,
    LEVER_FLAGS,
    MODES,
    OPTIMIZERS,
    RETENTION,
    Amp,
    BaseWeights,
    Mode,
    Offload,
    Optimizer,
    Retention,
    Sharding,
    check_compile,
    check_generation,
    check_levers,
    compile_of,
)

#: The choices are re-exported: users import them from here.
__all__ = [
    "AMP",
    "AMP_DTYPES",
    "LEVER_FLAGS",
    "MODES",
    "OPTIMIZERS",
    "RETENTION",
    "Amp",
    "BaseWeights",
    "Mode",
    "Offload",
    "Optimizer",
    "Retention",
    "RunConfig",
    "Sharding",
    "WhatIfError",
]


class WhatIfError(ValueError):
    """A run could not be set up or failed because of its inputs; the message says what to do."""


@users_init  # (a setting refused: said without the generated __init__ or __post_init__)
@dataclass(frozen=True)
class RunConfig:
    """One step's configuration.

    amp: "off", "fp16" (autocast with a gradient scaler) or "bf16" (`Amp`).
    checkpoint: "off", "auto" (each block of a ModuleList or Sequential of identical layers), or
        a tuple of module paths to checkpoint.
    mode: "train" (forward, backward, optimizer step), "no_grad" or "inference_mode" (a forward),
        or "eval_with_grad" (eval(), a forward with grad on, the output kept with its graph),
        or "generate" (the prompt from input_fn, then ``new_tokens`` tokens with a KV cache).
    new_tokens: tokens generated after the prompt (mode "generate").
    logits: "last" (the prompt's last position only, as Hugging Face's generate asks) or "all"
        (logits for every prompt position) in the prefill (mode "generate").
    retention: "off", or the graph-retention experiment: ``iterations`` evaluation forwards with
        grad enabled whose outputs are kept "attached" (memory grows) or "detached" (flat).
    batch_size: the effective batch; with ``accumulation`` k, k micro-batches of batch_size / k.
    optimizer: "sgd", "sgd_momentum", "adam" or "adamw".
    device: where the model and inputs are expected (None: CUDA if available, else the CPU).
    budget: bytes; a run whose peak exceeds it is reported as out of memory.
    world_size: data-parallel ranks (GPUs); ``batch_size`` is then each rank's batch.
    sharding: how the ranks share the model's state: "none" (one rank), "ddp", "zero1",
        "zero2", "zero3", "fsdp" or "fsdp_no_reshard" (`Sharding`). The run's per-rank figures
        are this process's step divided by `memlab.step.ranks`'s rule, not measured on N ranks.
    expandable_segments: the CUDA caching allocator with ``expandable_segments:True``: changes
        reserved memory, not allocated; estimated (`memlab.estimate.expandable`), not measured.
    offload: "off", "activations" (saved for backward, to the CPU), "optimizer" (state and fp32
        master weights on the CPU, stepped there) or "both" (a training step; `Offload`).
    base_weights: "as_built", or the frozen base Linear layers stored in bitsandbytes' layout:
        "int8", "nf4" or "nf4_double" (`BaseWeights`); their bytes modelled, not bitsandbytes.
    cache: "dynamic" (grown a token at a time) or "static" (Hugging Face's StaticCache: room
        for the prompt and every new token taken up front; mode "generate").
    compile: the model wrapped in ``torch.compile`` (inductor), compiled in warm-up steps and
        then measured: True (mode "default"), or a mode: "reduce-overhead", "max-autotune",
        "max-autotune-no-cudagraphs" (`memlab.step.compiled`). Predictions do not model it.
    """

    amp: Amp = Amp.OFF
    checkpoint: str | tuple[str, ...] = "off"
    mode: Mode = Mode.TRAIN
    retention: Retention = Retention.OFF
    iterations: int = 4
    batch_size: int = 8
    accumulation: int = 1
    optimizer: Optimizer = Optimizer.ADAM
    lr: float = 1e-3
    device: str | None = None
    budget: int | None = None
    warmup: bool = True
    new_tokens: int = 16
    logits: str = "last"
    world_size: int = 1
    sharding: Sharding = Sharding.NONE
    # levers (memlab.step.levers): each changes one thing, named after it
    expandable_segments: bool = False
    optimizer_in_backward: bool = False
    optimizer_state_bits: int = 32
    checkpoint_saves: str = "nothing"
    offload: Offload = Offload.OFF
    base_weights: BaseWeights = BaseWeights.AS_BUILT
    # generation (memlab.step.kvcache): Hugging Face's cache class
    cache: str = "dynamic"
    # torch.compile (memlab.step.compiled): False, True ("default") or a mode
    compile: bool | str = False

    def __post_init__(self) -> None:
        for name, kind in (
            ("amp", Amp),
            ("mode", Mode),
            ("retention", Retention),
            ("optimizer", Optimizer),
            ("sharding", Sharding),
            ("offload", Offload),
            ("base_weights", BaseWeights),
        ):
            object.__setattr__(self, name, kind.parse(name, getattr(self, name), WhatIfError))
        if isinstance(self.checkpoint, str):
            if self.checkpoint not in ("off", "auto"):
                raise WhatIfError(
                    f"checkpoint={self.checkpoint!r} is not one of 'off', 'auto': pass one of "
                    "those, or a tuple of module paths."
                )
        elif not isinstance(self.checkpoint, tuple) or not all(
            isinstance(p, str) for p in self.checkpoint
        ):
            raise WhatIfError(
                f"checkpoint={self.checkpoint!r}: pass 'off', 'auto' or a tuple of module paths."
            )
        if self.logits not in ("last", "all"):
            raise WhatIfError(f"logits must be 'last' or 'all', not {self.logits!r}.")
        for name in ("batch_size", "accumulation", "iterations", "new_tokens", "world_size"):
            value = _whole(getattr(self, name))
            if value is None or value < 1:
                raise WhatIfError(
                    f"{name} must be a whole number ≥ 1, not {getattr(self, name)!r}."
                )
            object.__setattr__(self, name, value)  # (a numpy integer: kept as an int, JSON-safe)
        if self.batch_size % self.accumulation:
            raise WhatIfError(
                f"batch_size {self.batch_size} does not split into {self.accumulation} equal "
                "micro-batches: choose a batch size divisible by the accumulation steps."
            )
        if not _learning_rate(self.lr):
            raise WhatIfError(f"lr must be a learning rate ≥ 0 (e.g. 1e-3), not {self.lr!r}.")
        object.__setattr__(self, "lr", float(self.lr))  # (a numpy float or 0-d tensor: JSON-safe)
        budget = None if self.budget is None else _whole(self.budget)
        if self.budget is not None and (budget is None or budget <= 0):
            raise WhatIfError(f"budget must be a positive number of bytes, not {self.budget!r}.")
        object.__setattr__(self, "budget", budget)
        object.__setattr__(self, "compile", compile_of(self.compile, WhatIfError))
        check_levers(self, WhatIfError)
        check_compile(self, WhatIfError)
        if self.retention != Retention.OFF and self.mode != Mode.TRAIN:
            raise WhatIfError("the retention experiment runs with grad enabled: use mode='train'.")
        _check_ranks(self)
        check_generation(self, WhatIfError)
        if self.offload != Offload.OFF and not self.training:
            raise WhatIfError(
                f"offload={str(self.offload)!r} moves a training step's memory to the host: use "
                "mode='train' (without retention), or offload='off'."
            )

    @property
    def training(self) -> bool:
        """Whether the step trains: forward, backward and an optimizer step."""
        return self.mode == Mode.TRAIN and self.retention == Retention.OFF

    def with_(self, **changes: Any) -> RunConfig:
        return replace(self, **changes)

    def describe(self) -> str:
        parts = [str(self.mode) if self.retention == Retention.OFF else f"{self.retention} outputs"]
        if self.amp != Amp.OFF:
            parts.append(f"amp {self.amp}")
        if self.checkpoint != "off":
            ck = self.checkpoint
            parts.append(f"checkpoint {ck if isinstance(ck, str) else ','.join(ck)}")
        if self.mode == Mode.GENERATE:
            parts[0] = f"generate {self.new_tokens} tokens"
            parts += [] if self.logits == "last" else ["all logits"]
        parts.append(f"batch {self.batch_size}")
        if self.accumulation > 1:
            parts.append(f"accumulate {self.accumulation}")
        if self.training:
            parts.append(str(self.optimizer))
        if self.world_size > 1:
            parts[parts.index(f"batch {self.batch_size}")] += " a rank"
            parts.append(f"{self.sharding} over {self.world_size} ranks")
        parts += [name.replace("_", " ") for name in LEVER_FLAGS if getattr(self, name)]
        parts += ["8-bit optimizer state"] if self.optimizer_state_bits == 8 else []
        if self.checkpoint_saves != "nothing":
            parts.append(f"checkpoints keep {self.checkpoint_saves}")
        if self.offload != Offload.OFF:
            parts.append(f"offload {self.offload}")
        if self.base_weights != BaseWeights.AS_BUILT:
            parts.append(f"base weights {self.base_weights}")
        parts += ["static cache"] if self.cache == "static" else []
        if self.compile:
            parts.append("torch.compile" + ("" if self.compile is True else f" {self.compile}"))
        return ", ".join(parts)

    def to_dict(self) -> dict[str, Any]:
        """Plain data (JSON-safe): every field, choices as their strings."""
        ck = self.checkpoint
        return {
            "amp": str(self.amp),
            "checkpoint": ck if isinstance(ck, str) else list(ck),
            "mode": str(self.mode),
            "retention": str(self.retention),
            "iterations": self.iterations,
            "batch_size": self.batch_size,
            "accumulation": self.accumulation,
            "optimizer": str(self.optimizer),
            "lr": self.lr,
            "device": self.device,
            "budget": self.budget,
            "warmup": self.warmup,
            "new_tokens": self.new_tokens,
            "logits": self.logits,
            "world_size": self.world_size,
            "sharding": str(self.sharding),
            **{name: getattr(self, name) for name in LEVER_FLAGS},
            "optimizer_state_bits": self.optimizer_state_bits,
            "checkpoint_saves": self.checkpoint_saves,
            "offload": str(self.offload),
            "base_weights": str(self.base_weights),
            "cache": self.cache,
            "compile": self.compile,
        }


def _check_ranks(c: RunConfig) -> None:
    """world_size and sharding agree, and the step is one the per-rank rule divides."""
    n, s = c.world_size, c.sharding
    if n == 1 and s != Sharding.NONE:
        raise WhatIfError(
            f"sharding={str(s)!r} needs ranks to shard over, and world_size is 1: pass "
            "world_size=2 or more, or sharding='none'."
        )
    if n > 1 and s == Sharding.NONE:
        raise WhatIfError(
            f"world_size={n} with sharding='none': pass how the ranks share the model, "
            "sharding='ddp' (every rank holds everything), 'zero1', 'zero2', 'zero3', 'fsdp' or "
            "'fsdp_no_reshard', or world_size=1."
        )
    if n > 1 and not c.training:
        what = f"mode={str(c.mode)!r}" if c.retention == Retention.OFF else "the retention run"
        raise WhatIfError(
            f"world_size={n} divides a training step's state among ranks, and {what} is not "
            "one: use mode='train' (and retention='off'), or world_size=1 (a forward alone is "
            "the same on every rank)."
        )


def _whole(value: Any) -> int | None:
    """``value`` as an int where it is a whole number: an int, a numpy integer (a sweep over
    ``np.arange``), anything with ``__index__``; None for anything else, a bool too."""
    if isinstance(value, bool) or "bool" in str(getattr(value, "dtype", "")):
        return None
    try:
        return operator.index(value)
    except (TypeError, ValueError, RuntimeError):  # (a float, a tensor of many elements)
        return None


def _learning_rate(lr: Any) -> bool:
    """A number ≥ 0 and finite, as PyTorch's optimizers take it (a numpy float, a 0-d tensor)."""
    if isinstance(lr, (bool, str, bytes)):
        return False
    try:
        return 0 <= float(lr) < float("inf")
    except (TypeError, ValueError, RuntimeError):
        return False
