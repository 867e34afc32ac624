"""The configuration of a what-if run, validated once, with errors that say what to do."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

AMP = ("off", "fp16", "bf16")
MODES = ("train", "no_grad", "inference_mode")
RETENTION = ("off", "attached", "detached")
OPTIMIZERS = ("sgd", "sgd_momentum", "adam", "adamw")


class WhatIfError(ValueError):
    """A run could not be set up or failed because of its inputs; the message says what to do."""


@dataclass(frozen=True)
class RunConfig:
    """One step's configuration.

    amp: "off", "fp16" (autocast with a gradient scaler) or "bf16".
    checkpoint: "off", "auto" (each block of a ModuleList or Sequential of identical layers), or
        a tuple of module paths to checkpoint.
    mode: "train" (forward, backward, optimizer step), "no_grad" or "inference_mode" (a forward).
    retention: "off", or the graph-retention experiment: ``iterations`` evaluation forwards with
        grad enabled whose outputs are kept "attached" (memory grows) or "detached" (flat).
    batch_size: the effective batch; with ``accumulation`` k, k micro-batches of batch_size / k.
    optimizer: "sgd", "sgd_momentum", "adam" or "adamw".
    device: where the model and inputs are expected (None: CUDA if available, else the CPU).
    budget: bytes; a run whose peak exceeds it is reported as out of memory.
    """

    amp: str = "off"
    checkpoint: str | tuple[str, ...] = "off"
    mode: str = "train"
    retention: str = "off"
    iterations: int = 4
    batch_size: int = 8
    accumulation: int = 1
    optimizer: str = "adam"
    lr: float = 1e-3
    device: str | None = None
    budget: int | None = None
    warmup: bool = True

    def __post_init__(self) -> None:
        def one_of(name: str, value: Any, allowed: tuple[str, ...]) -> None:
            if value not in allowed:
                raise WhatIfError(f"{name}={value!r} is not one of {', '.join(allowed)}.")

        one_of("amp", self.amp, AMP)
        one_of("mode", self.mode, MODES)
        one_of("retention", self.retention, RETENTION)
        one_of("optimizer", self.optimizer, OPTIMIZERS)
        if isinstance(self.checkpoint, str):
            one_of("checkpoint", self.checkpoint, ("off", "auto"))
        elif not all(isinstance(p, str) for p in self.checkpoint):
            raise WhatIfError("checkpoint takes 'off', 'auto' or a tuple of module paths.")
        for name in ("batch_size", "accumulation", "iterations"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise WhatIfError(f"{name} must be a whole number ≥ 1, not {value!r}.")
        if self.batch_size % self.accumulation:
            raise WhatIfError(
                f"batch_size {self.batch_size} does not split into {self.accumulation} equal "
                "micro-batches: choose a batch size divisible by the accumulation steps."
            )
        if self.budget is not None and self.budget <= 0:
            raise WhatIfError(f"budget must be a positive number of bytes, not {self.budget!r}.")
        if self.retention != "off" and self.mode != "train":
            raise WhatIfError("the retention experiment runs with grad enabled: use mode='train'.")

    def with_(self, **changes: Any) -> RunConfig:
        return replace(self, **changes)

    def describe(self) -> str:
        parts = [self.mode if self.retention == "off" else f"{self.retention} outputs"]
        if self.amp != "off":
            parts.append(f"amp {self.amp}")
        if self.checkpoint != "off":
            ck = self.checkpoint
            parts.append(f"checkpoint {ck if isinstance(ck, str) else ','.join(ck)}")
        parts.append(f"batch {self.batch_size}")
        if self.accumulation > 1:
            parts.append(f"accumulate {self.accumulation}")
        if self.mode == "train" and self.retention == "off":
            parts.append(self.optimizer)
        return ", ".join(parts)
