"""An out-of-memory explained, as pure functions of the allocator's state and the accounting.

`explain` reads the cache (segments and their blocks, in the format of
``torch.cuda.memory_snapshot()``, which `CachingAllocator.segments` also writes) and the live
storages, and says why the request failed. `stream_levers` predicts the peak of an allocation
stream under each lever by replaying the changed stream through the allocator model.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from memlab.estimate.allocator import (
    LARGE_BUFFER,
    SMALL_BUFFER,
    SMALL_SIZE,
    CachingAllocator,
    SimulatedOutOfMemoryError,
    round_size,
    segment_size,
)
from memlab.estimate.amp import AMP_HOW
from memlab.estimate.holders import variable_root
from memlab.reports.oom import Lever, LiveTensor, OOMExplanation
from memlab.reports.units import fmt_bytes

#: How many of the biggest tensors and variables an explanation lists.
TOP = 8


def pool_of(requested: int) -> str:
    """The pool a request is served from: "small" (up to 1 MiB) or "large"."""
    return "small" if round_size(requested) <= SMALL_SIZE else "large"


def cache_figures(
    segments: Iterable[Mapping[str, Any]], pool: str = "large"
) -> tuple[int, int, int, int]:
    """(allocated, reserved, largest free block, free bytes) of a cache given as snapshot
    segments; the last two in ``pool`` only: the allocator never serves a request from the
    other pool's blocks."""
    allocated = reserved = largest = free = 0
    for seg in segments:
        reserved += int(seg["total_size"])
        mine = seg.get("segment_type", "large") == pool
        for b in seg["blocks"]:
            if str(b["state"]).startswith("active"):
                allocated += int(b["size"])
            elif mine:
                largest = max(largest, int(b["size"]))
                free += int(b["size"])
    return allocated, reserved, largest, free


def cause_of(
    requested: int, capacity: int | None, allocated: int, reserved: int, largest: int, free: int
) -> tuple[str, bool]:
    """One sentence on why the request failed, and whether fragmentation is the cause.
    ``largest`` and ``free``: the free blocks of the request's pool."""
    cached = reserved - allocated
    pool = pool_of(requested)
    if capacity is not None and segment_size(round_size(requested)) > capacity:
        return (f"the request alone is larger than the {fmt_bytes(capacity)} usable", False)
    outside = None if capacity is None else max(0, capacity - reserved)
    if largest >= requested:
        return (
            f"none in this state: its largest free block ({fmt_bytes(largest)}) would do, so the "
            "cache has changed since the failure (memory freed since, or another stream's)",
            False,
        )
    if free >= requested > largest:
        return (
            f"fragmentation: {fmt_bytes(free)} is free in the {pool} pool's cache but in pieces, "
            f"the largest {fmt_bytes(largest)}"
            + ("" if outside is None else f", and only {fmt_bytes(outside)} is left to reserve"),
            True,
        )
    segment = segment_size(round_size(requested))
    if outside is not None and free + outside >= requested and outside < segment:
        return (
            f"the request needs a new {fmt_bytes(segment)} segment and only {fmt_bytes(outside)} "
            f"is left to reserve ({fmt_bytes(free)} free in the {pool} pool's cache, the "
            f"largest piece {fmt_bytes(largest)})",
            True,
        )
    if outside is not None and cached + outside >= requested:
        return (
            f"the cache is in the other pool: {fmt_bytes(cached - free)} free there, but a "
            f"{pool} request takes {pool}-pool blocks only, and {fmt_bytes(outside)} is left "
            "to reserve",
            False,
        )
    return (
        f"live tensors fill the memory: {fmt_bytes(allocated)} allocated, "
        f"{fmt_bytes(cached)} free in the cache",
        False,
    )


def explain(
    *,
    where: str,
    requested: int,
    capacity: int | None,
    segments: Iterable[Mapping[str, Any]],
    live: Sequence[LiveTensor] = (),
    levers: Sequence[Lever] = (),
    line: int | None = None,
    source: str = "",
    notes: Sequence[str] = (),
) -> OOMExplanation:
    """Why ``requested`` bytes could not be had: the cache's figures (from ``segments``), what
    was live by category and by variable, the biggest live tensors, and the ``levers``."""
    pool = pool_of(requested)
    allocated, reserved, largest, free = cache_figures(segments, pool)
    cause, fragmented = cause_of(requested, capacity, allocated, reserved, largest, free)
    categories: dict[str, int] = {}
    names: dict[str, int] = {}
    for t in live:
        categories[t.category] = categories.get(t.category, 0) + t.nbytes
        for name in t.names:
            names[name] = names.get(name, 0) + t.nbytes
    biggest = sorted(live, key=lambda t: -t.nbytes)[:TOP]
    return OOMExplanation(
        where=where,
        requested=requested,
        capacity=capacity,
        allocated=allocated,
        reserved=reserved,
        largest_free=largest,
        pool=pool,
        free_in_pool=free,
        cause=cause,
        fragmented=fragmented,
        line=line,
        source=source,
        by_category=_ranked(categories),
        by_name=_ranked(_by_variable(names))[:TOP],
        biggest=tuple(biggest),
        levers=tuple(levers),
        notes=tuple(notes),
    )


def _by_variable(names: Mapping[str, int]) -> dict[str, int]:
    """The names' bytes per variable: a model's 200 weights as one line, ``model (200
    tensors)``, which ``del model`` frees; a variable with one tensor under its full name."""
    groups: dict[str, list[str]] = {}
    for name in names:
        groups.setdefault(variable_root(name), []).append(name)
    return {
        members[0] if len(members) == 1 else f"{root} ({len(members)} tensors)": sum(
            names[m] for m in members
        )
        for root, members in groups.items()
    }


def _ranked(d: Mapping[str, int]) -> tuple[tuple[str, int], ...]:
    return tuple(sorted(((k, v) for k, v in d.items() if v), key=lambda kv: (-kv[1], kv[0])))


# -- levers ------------------------------------------------------------------------------------
#: An allocation stream: (storage serial, bytes) per event, bytes > 0 an allocation and < 0 its
#: free. A storage that grows is freed and allocated again.
Stream = Sequence[tuple[int, int]]


def replay_peak(stream: Stream, size: Callable[[int, int], int], capacity: int | None) -> int:
    """Peak reserved bytes of ``stream`` with each allocation's bytes given by ``size(serial,
    bytes)`` (0 drops it), through the allocator model; -1 if it runs out of ``capacity``."""
    model = CachingAllocator(capacity)
    handles: dict[int, int] = {}
    try:
        for serial, nbytes in stream:
            if nbytes > 0:
                n = size(serial, nbytes)
                if n > 0:
                    handles[serial] = model.malloc(n)
            else:
                handle = handles.pop(serial, None)
                if handle is not None:
                    model.free(handle)
    except SimulatedOutOfMemoryError:
        return -1
    return model.stats.peak_reserved


def expandable_peak(stream: Stream) -> int:
    """Peak reserved with ``expandable_segments:True``, roughly: each pool one segment that
    grows by pages (2 MiB small, 20 MiB large) and so never holds a gap bigger than a page."""
    small = large = peak = 0
    sizes: dict[int, int] = {}
    for serial, nbytes in stream:
        if nbytes > 0:
            n = sizes[serial] = round_size(nbytes)
        else:
            n = -sizes.pop(serial, 0)
        if abs(n) <= SMALL_SIZE:
            small += n
        else:
            large += n
        peak = max(peak, _pages(small, SMALL_BUFFER) + _pages(large, LARGE_BUFFER))
    return peak


def _pages(n: int, page: int) -> int:
    return -(-max(n, 0) // page) * page


def stream_levers(
    stream: Stream,
    roles: Mapping[int, str],
    capacity: int | None,
    held: Mapping[str, tuple[Sequence[int], str]] = {},
    fragmented: bool = False,
    amp: Stream | None = None,
) -> list[Lever]:
    """The levers for a recorded stream, each predicted by replaying the stream changed as the
    lever would change it. ``roles``: each serial's category (a quarter batch quarters
    activations, temporaries and inputs); ``amp``: the stream as autocast would make it
    (`memlab.estimate.amp`; no AMP lever without it); ``held``: storages behind the
    user's variables and when to drop them (a `del` lever for each of the largest two)."""
    scaled = ("activation", "temporary")
    # AMP and smaller batches shrink a step's activations: offered where autograd saved some
    shrinking = any(roles.get(s) == "activation" for s, n in stream if n > 0)

    def fit(name: str, how: str, size: Callable[[int, int], int], events: Stream = stream) -> Lever:
        limited = replay_peak(events, size, capacity)
        peak = limited if limited >= 0 else replay_peak(events, size, None)
        return Lever(name, how, peak, None if capacity is None else limited >= 0)

    def times(f: float, also: tuple[str, ...] = ()) -> Callable[[int, int], int]:
        return lambda s, n: int(n * f) if roles.get(s) in scaled + also else n

    found = []
    if shrinking and amp is not None:  # the stream as autocast would make it (estimate.amp)
        found.append(fit("AMP (bf16)", AMP_HOW, lambda s, n: n, amp))
    if shrinking:
        found.append(
            fit(
                "batch ÷ 4, accumulate 4",
                "a quarter of the batch per step and `loss / 4` backward 4 times before "
                "`optimizer.step()` (activations, temporaries and input batches ÷ 4)",
                times(0.25, ("input",)),
            )
        )
    if fragmented:
        peak = expandable_peak(stream)
        fits = None if capacity is None else peak <= capacity
        how = "`PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True` before the first CUDA call"
        found.append(Lever("expandable_segments", how, peak, fits))
    first = {s: n for s, n in reversed(stream) if n > 0}

    def weight(serials: Sequence[int]) -> int:
        return sum(first.get(s, 0) for s in set(serials))

    # the two largest that would lower the peak (a small tensor's `del` changes nothing)
    base = replay_peak(stream, lambda s, n: n, None)
    useful = 0
    for name, (serials, when) in sorted(held.items(), key=lambda kv: -weight(kv[1][0]))[:4]:
        lever = fit(f"del {name}", f"`del {name}` {when}", _without(set(serials)))
        if lever.fits or lever.peak_reserved < base:  # (not fitting: its unlimited peak)
            found.append(lever)
            useful += 1
            if useful == 2:
                break
    return found


def _without(gone: set[int]) -> Callable[[int, int], int]:
    return lambda s, n: 0 if s in gone else n


def state_levers(e: OOMExplanation, activations: int, held: Mapping[str, int]) -> list[Lever]:
    """Levers judged at the moment of the failure, from the cache's figures alone: what the
    allocator would need then (allocated + the request), less what each lever removes."""
    need = e.allocated + round_size(e.requested)

    def lever(name: str, how: str, bytes_needed: int, page: int = SMALL_BUFFER) -> Lever:
        peak = _pages(bytes_needed, page)
        return Lever(name, how, peak, None if e.capacity is None else peak <= e.capacity)

    found = []
    if activations:
        how = "`with torch.autocast('cuda', dtype=torch.bfloat16):` around the forward"
        found.append(lever("AMP (bf16)", how + " (activations halved)", need - activations // 2))
        how = "a quarter of the batch per step, `loss / 4` backward 4 times, then the step"
        found.append(lever("batch ÷ 4, accumulate 4", how, need - activations * 3 // 4))
    if e.fragmented:
        how = "`PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True` before the first CUDA call"
        found.append(lever("expandable_segments", how, need, LARGE_BUFFER))
    for name, nbytes in sorted(held.items(), key=lambda kv: -kv[1])[:2]:
        found.append(lever(f"del {name}", f"`del {name}` before the step", need - nbytes))
    return found
