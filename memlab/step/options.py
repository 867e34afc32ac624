"""The choices of a step's configuration: string enums that also accept their strings
(``RunConfig(amp="bf16")`` and ``RunConfig(amp=Amp.BF16)`` are the same configuration).
`memlab.step.config` re-exports them. Also the checks of the fields that take a mode or a
combination of their own (``compile``, the generation's ``cache``)."""

from __future__ import annotations

from typing import Any

import torch

from memlab.core.choices import Choice


class Amp(Choice):
    """Automatic mixed precision: off, or autocast to a 16-bit type."""

    OFF = "off"
    FP16 = "fp16"  # with a gradient scaler
    BF16 = "bf16"

    @property
    def dtype(self) -> torch.dtype | None:
        """The 16-bit type autocast computes in (None for "off"): the one AMP table."""
        return {Amp.FP16: torch.float16, Amp.BF16: torch.bfloat16}.get(self)


class Mode(Choice):
    TRAIN = "train"  # forward, backward, optimizer step
    NO_GRAD = "no_grad"  # a forward under torch.no_grad()
    INFERENCE_MODE = "inference_mode"  # a forward under torch.inference_mode()
    # model.eval() and a forward with grad on, its output kept with its graph: a validation
    # loop that forgot torch.no_grad()
    EVAL_WITH_GRAD = "eval_with_grad"
    # a prompt, then new_tokens tokens one at a time with a key/value cache (memlab.step.generate)
    GENERATE = "generate"


class Retention(Choice):
    """The graph-retention experiment: evaluation forwards with grad on, outputs kept."""

    OFF = "off"
    ATTACHED = "attached"  # kept with their graphs: memory grows
    DETACHED = "detached"  # kept detached: flat


class Optimizer(Choice):
    SGD = "sgd"
    SGD_MOMENTUM = "sgd_momentum"
    ADAM = "adam"
    ADAMW = "adamw"


class Sharding(Choice):
    """How ``world_size`` data-parallel ranks share the model's state (`memlab.step.ranks`)."""

    NONE = "none"  # one rank
    DDP = "ddp"  # every rank holds everything, and DDP's gradient buckets
    ZERO1 = "zero1"  # optimizer state sharded
    ZERO2 = "zero2"  # gradients too
    ZERO3 = "zero3"  # parameters too
    FSDP = "fsdp"  # FSDP2's fully_shard: parameters, gradients, state; reshard after forward
    FSDP_NO_RESHARD = "fsdp_no_reshard"  # fully_shard(reshard_after_forward=False)


#: The levers that are switched on or off (RunConfig fields, True or False).
LEVER_FLAGS = ("expandable_segments", "optimizer_in_backward")


class Offload(Choice):
    """What a training step keeps in host memory (`memlab.step.offload`)."""

    OFF = "off"
    ACTIVATIONS = "activations"  # saved for backward: packed to the CPU by save_on_cpu
    OPTIMIZER = "optimizer"  # optimizer state and fp32 master weights on the CPU, stepped there
    BOTH = "both"

    @property
    def activations(self) -> bool:
        return self in (Offload.ACTIVATIONS, Offload.BOTH)

    @property
    def optimizer(self) -> bool:
        return self in (Offload.OPTIMIZER, Offload.BOTH)


class BaseWeights(Choice):
    """How the frozen base Linear layers' weights are stored (`memlab.step.base_weights`)."""

    AS_BUILT = "as_built"  # as the model was built
    INT8 = "int8"  # bitsandbytes' LLM.int8: int8, a float32 scale per row
    NF4 = "nf4"  # bitsandbytes' 4-bit NormalFloat: packed codes, a float32 absmax per 64
    NF4_DOUBLE = "nf4_double"  # the same, the absmax double-quantized (QLoRA)


#: ``torch.compile``'s modes (``RunConfig(compile=...)``; True is "default"). Those that use
#: CUDA graphs keep a graph's memory pool of their own: a real difference on a GPU, none on a CPU.
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")


def compile_of(value: Any, error: type[Exception]) -> bool | str:
    """``RunConfig.compile`` as it is kept: False, True (mode "default") or another mode."""
    if value is True or value is False:
        return value
    if isinstance(value, str) and value in COMPILE_MODES:
        return True if value == "default" else value
    modes = ", ".join(map(repr, COMPILE_MODES))
    raise error(f"compile must be True, False or a torch.compile mode ({modes}), not {value!r}.")


def check_compile(c: Any, error: type[Exception]) -> None:
    """What ``compile`` cannot go with (``c``: the RunConfig)."""
    if not c.compile:
        return
    refused = {
        "mode='generate'": (
            c.mode == Mode.GENERATE,
            "a generation compiles its decode step its own way (a static cache)",
        ),
        f"retention={str(c.retention)!r}": (
            c.retention != Retention.OFF,
            "the experiment's series is read from tensor accounting, which compiled code escapes",
        ),
        f"offload={str(c.offload)!r}": (
            c.offload != Offload.OFF,
            "offload's saved-tensor hooks do not run inside a compiled graph",
        ),
        f"world_size={c.world_size}": (
            c.world_size > 1,
            "the per-rank rule divides the step's categories, which compiled code does not show",
        ),
        "warmup=False": (
            not c.warmup,
            "compiling happens in the warm-up steps, and would otherwise be measured as the step",
        ),
    }
    for what, (bad, why) in refused.items():
        if bad:
            raise error(
                f"compile={c.compile!r} cannot go with {what}: {why}. Pass compile=False, or "
                "change that setting."
            )


def check_generation(c: Any, error: type[Exception]) -> None:
    """The generation fields (`memlab.step.kvcache`; ``c``: the RunConfig)."""
    if c.cache not in ("dynamic", "static"):
        raise error(f"cache must be 'dynamic' or 'static', not {c.cache!r}.")
    if c.cache == "static" and c.mode != Mode.GENERATE:
        raise error(
            "cache='static' is the key/value cache of a generation: use mode='generate', or "
            "cache='dynamic'."
        )


#: Kept for one release: the choices as tuples of strings.
AMP, MODES, RETENTION, OPTIMIZERS = (c.values() for c in (Amp, Mode, Retention, Optimizer))
#: Kept for one release: the 16-bit type of each AMP setting (use ``Amp(x).dtype``).
AMP_DTYPES = {a.value: a.dtype for a in Amp if a.dtype is not None}


def check_flags(error: type[Exception], **flags: Any) -> None:
    """Each of ``flags`` True or False (``estimate(cuda_kernels=..., trace=...)``): a string
    such as 'no' is truthy, and would switch on what it meant to switch off."""
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise error(f"{name} must be True or False, not {value!r}.")


def check_levers(c: Any, error: type[Exception]) -> None:
    """The lever fields (`memlab.step.levers`): each value, and what it cannot go with."""
    for name in LEVER_FLAGS:
        if not isinstance(getattr(c, name), bool):
            raise error(f"{name} must be True or False, not {getattr(c, name)!r}.")
    if type(c.optimizer_state_bits) is not int or c.optimizer_state_bits not in (32, 8):
        raise error(f"optimizer_state_bits must be 32 or 8, not {c.optimizer_state_bits!r}.")
    for name, on in (
        ("optimizer_in_backward", c.optimizer_in_backward),
        ("optimizer_state_bits=8", c.optimizer_state_bits == 8),
    ):
        if on and c.mode != Mode.TRAIN:
            raise error(
                f"{name} changes the optimizer, and mode={str(c.mode)!r} has no optimizer step: "
                "use mode='train', or leave it off."
            )
    if c.optimizer_state_bits == 8 and c.optimizer not in (Optimizer.ADAM, Optimizer.ADAMW):
        raise error(
            f"optimizer_state_bits=8 is bitsandbytes' Adam8bit / AdamW8bit layout: use "
            f"optimizer 'adam' or 'adamw', not {str(c.optimizer)!r}."
        )
    if c.optimizer_in_backward and c.mode == Mode.TRAIN and (c.accumulation > 1 or c.amp == "fp16"):
        raise error(
            "optimizer_in_backward steps each parameter as soon as its gradient is ready: "
            "it cannot accumulate micro-batches or unscale fp16 gradients first; use "
            "accumulation=1 and amp 'off' or 'bf16'."
        )
    if str(c.offload) in ("optimizer", "both") and (
        c.optimizer_in_backward or c.optimizer_state_bits == 8
    ):
        raise error(
            f"offload={str(c.offload)!r} steps 32-bit optimizer state on the host, after the "
            "backward: it cannot go with optimizer_in_backward or optimizer_state_bits=8; pass "
            "offload='activations' or 'off', or leave those levers off."
        )
    if c.checkpoint_saves not in ("nothing", "matmuls"):
        raise error(
            f"checkpoint_saves must be 'nothing' (recompute all) or 'matmuls', not "
            f"{c.checkpoint_saves!r}."
        )
    if c.checkpoint_saves != "nothing" and c.checkpoint == "off":
        raise error(
            "checkpoint_saves chooses what checkpointed blocks keep: also pass "
            "checkpoint='auto' or the module paths to checkpoint."
        )
