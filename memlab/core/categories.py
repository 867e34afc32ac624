"""Memory categories: what a block of tensor memory is for."""

from __future__ import annotations

from enum import Enum


class Category(str, Enum):
    """The role of a tensor storage during a measured region.

    Categories are ordered by priority: when one storage plays several roles (a Linear layer
    saves ``weight.t()``, which shares the parameter's storage), the role listed first wins;
    ``HOST`` wins over every other.
    """

    PARAMETER = "parameter"
    BUFFER = "buffer"
    OPTIMIZER_STATE = "optimizer_state"
    GRADIENT = "gradient"
    KV_CACHE = "kv_cache"
    COMMUNICATION = "communication"
    INPUT = "input"
    ACTIVATION = "activation"
    HOST = "host"
    TEMPORARY = "temporary"
    OTHER = "other"
    UNATTRIBUTED = "unattributed"

    def __str__(self) -> str:
        return self.value


#: Highest priority first. ``TEMPORARY``, ``OTHER`` and ``UNATTRIBUTED`` are never assigned by a
#: hook: they are derived when a report is built (see ``memlab.core.recorder``).
#: ``HOST`` comes first: an offloaded copy is in host memory whatever else it is (the host-side
#: optimizer's state, its master weights and their gradients; see ``memlab.step.offload``).
PRIORITY: dict[Category, int] = {
    c: i for i, c in enumerate([Category.HOST, *(c for c in Category if c is not Category.HOST)])
}

#: Roles a storage keeps from one region to the next (a key/value cache kept from a generating
#: cell is one in the next cell too). Being saved for backward (activation) or being a region's
#: input is a role within one region only.
STICKY = frozenset(
    {
        Category.PARAMETER,
        Category.BUFFER,
        Category.OPTIMIZER_STATE,
        Category.GRADIENT,
        Category.KV_CACHE,
        Category.COMMUNICATION,
    }
)

DESCRIPTIONS: dict[Category, str] = {
    Category.PARAMETER: "nn.Parameter storages, and tensors an optimizer updates",
    Category.BUFFER: "module buffers (e.g. BatchNorm running statistics)",
    Category.OPTIMIZER_STATE: "tensors in optimizer.state (momentum, Adam moments, step)",
    Category.GRADIENT: "the .grad of parameters and other leaf tensors",
    Category.KV_CACHE: "the key/value cache of a language model generating tokens (its keys "
    "and values for every token so far, in each layer)",
    Category.COMMUNICATION: "buffers a collective (all-gather, reduce-scatter, all-reduce) "
    "read or wrote that hold no parameter or gradient: DDP's gradient buckets, FSDP's gathered "
    "and reduce-scattered flat buffers",
    Category.INPUT: "tensors passed to track(inputs=...)",
    Category.ACTIVATION: "tensors saved for backward by autograd",
    Category.HOST: "copies an offload lever keeps in host memory: activations saved for backward "
    "packed to the CPU (save_on_cpu), the host-side optimizer's state, master weights and "
    "gradients",
    Category.TEMPORARY: "created in the region and freed before it ended",
    Category.OTHER: "alive, with none of the roles above: results the region kept, and tensors "
    "from before it that it never used (your own tensors, earlier outputs, other models)",
    Category.UNATTRIBUTED: "allocator bytes no tensor accounts for (rounding, cuBLAS workspace, "
    "tensors created outside the region that it never touched)",
}


def stronger(a: Category | None, b: Category | None) -> Category | None:
    """The higher-priority of two categories (``None`` means unknown)."""
    if a is None:
        return b
    if b is None:
        return a
    return a if PRIORITY[a] <= PRIORITY[b] else b
