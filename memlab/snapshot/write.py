"""Writing memlab timelines as PyTorch memory snapshots, for torch's own viewer
(``torch.cuda._memory_viz``, https://pytorch.org/memory_viz) and for `load_snapshot`.

A snapshot is the dict ``torch.cuda.memory._snapshot()`` returns, pickled: ``device_traces``
(one list of events per device: ``alloc``, ``free_requested``, ``free_completed``, each with an
address, a size, a stream, frames and ``time_us``) and ``segments`` (the allocator's state at
the end: each segment's blocks, active or not).

A memlab timeline holds totals, not allocations, so `timeline_events` makes allocations that add
up to it exactly: a rise is one allocation, a fall frees the most recent ones, and an allocation
that a later fall cuts through is made as two (at the same moment), so that every fall frees
whole allocations. Addresses are made up and never reused; each allocation still live at the
end is a segment of its own. Frames are empty (memlab's timeline has no stacks); each event
carries its ``phase``.
"""

from __future__ import annotations

import os
import pickle
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import numpy as np

from memlab.snapshot.trace import GROUPS, Trace

#: Where the made-up addresses start (a typical CUDA virtual address), and their alignment.
BASE, ALIGN = 0x7F00_0000_0000, 512
#: pickle protocol 4: what torch writes on Python 3.8 to 3.13, and what its viewer reads.
PROTOCOL = 4
#: The device a written timeline is of ("cpu", "cuda:1") and its figures' source ("cpu-allocator").
Origin = tuple[str, str]


@dataclass
class _Block:
    size: int
    made: int  # index of the point that made it; -1: live before the timeline
    phase: str
    freed: int = -1


def timeline_events(
    before: int, seconds: Sequence[float], totals: Sequence[int], phases: Sequence[str]
) -> tuple[list[dict[str, Any]], list[tuple[int, int]]]:
    """Events whose running total goes from ``before`` through ``totals``; and the (address,
    size) of each allocation live at the end, pre-existing ones included."""
    blocks = [_Block(before, -1, "before")] if before else []
    stack = list(range(len(blocks)))
    level = before
    for i, (v, ph) in enumerate(zip(totals, phases, strict=True)):
        if v > level:
            stack.append(len(blocks))
            blocks.append(_Block(v - level, i, ph))
        need = level - v
        while need > 0:
            b = blocks[stack[-1]]
            if b.size <= need:
                stack.pop()
                b.freed, need = i, need - b.size
            else:  # split: the upper part, made with the block, is what this fall frees
                blocks.append(_Block(need, b.made, b.phase, freed=i))
                b.size, need = b.size - need, 0
        level = v
    addr, at = BASE, []
    for b in blocks:
        at.append(addr)
        addr += -(-b.size // ALIGN) * ALIGN or ALIGN
    events: list[tuple[int, int, dict[str, Any]]] = []
    for k, (b, a) in enumerate(zip(blocks, at, strict=True)):
        common = {"addr": a, "size": b.size, "stream": 0, "frames": [], "phase": b.phase}
        if b.made >= 0:
            t = seconds[b.made] * 1e6
            events.append((b.made, k, {"action": "alloc", "time_us": t, **common}))
        if b.freed >= 0:
            t = seconds[b.freed] * 1e6
            for action in ("free_requested", "free_completed"):
                events.append((b.freed, k, {"action": action, "time_us": t, **common}))
    events.sort(key=lambda e: (e[0], e[1]))
    live = [(a, b.size) for b, a in zip(blocks, at, strict=True) if b.freed < 0]
    return [e for _, _, e in events], live


def snapshot_dict(
    events: list[dict[str, Any]], live: list[tuple[int, int]], origin: Origin | None = None
) -> dict[str, Any]:
    """The snapshot dict: the events on device 0, each live allocation a segment of its own.
    ``origin``, the device the figures are of and where they came from, is kept beside them
    (torch's viewer ignores it; `load_snapshot` reads it back)."""
    segments = [
        {
            "device": 0,
            "address": addr,
            "total_size": size,
            "allocated_size": size,
            "active_size": size,
            "requested_size": size,
            "stream": 0,
            "segment_type": "large",
            "segment_pool_id": (0, 0),
            "is_expandable": False,
            "frames": [],
            "blocks": [
                {
                    "address": addr,
                    "size": size,
                    "requested_size": size,
                    "state": "active_allocated",
                    "frames": [],
                }
            ],
        }
        for addr, size in live
    ]
    data = {"segments": segments, "device_traces": [events], "written_by": "memlab"}
    if origin is not None:
        data["memlab_device"], data["memlab_source"] = origin
    return data


def dump(data: dict[str, Any], path: str | os.PathLike[str]) -> Path:
    p = writable(path, "step.pickle")
    with opened(p) as f:
        pickle.dump(data, f, protocol=PROTOCOL)
    return p


def writable(path: Any, example: str) -> Path:
    """``path`` (a str or os.PathLike) as a Path a file can be written at, or an error that names
    it and says what to pass (a directory, a folder that does not exist, not a path at all)."""
    name = os.fspath(path) if isinstance(path, os.PathLike) else path
    if not isinstance(name, str):
        raise TypeError(
            f"path={path!r} is a {type(path).__name__}: pass a file name (str or pathlib.Path) "
            f"such as {example!r}."
        )
    p = Path(name)
    if p.is_dir():
        raise IsADirectoryError(
            f"path={name!r} is a directory: pass a file name in it, such as {str(p / example)!r}."
        )
    if not p.parent.is_dir():
        raise FileNotFoundError(
            f"path={name!r}: the folder {str(p.parent)!r} does not exist. Create it first "
            f"(os.makedirs), or pass a file name in a folder that exists, such as {example!r}."
        )
    return p


def opened(p: Path, binary: bool = True) -> IO[Any]:
    """``p`` open for writing, or the system's refusal said about the path (no permission, a
    read-only disk), as the same kind of OSError."""
    try:
        return p.open("wb") if binary else p.open("w", encoding="utf-8")
    except OSError as e:
        raise type(e)(
            f"path={str(p)!r}: the file cannot be written ({e.strerror or e}): pass a file "
            "name in a folder you can write to."
        ) from None


def write_timeline(
    path: str | os.PathLike[str],
    before: int,
    seconds: Sequence[float],
    totals: Sequence[int],
    phases: Sequence[str],
    origin: Origin | None = None,
) -> Path:
    """A memlab timeline (``before``, then ``totals`` at ``seconds``) as a snapshot file."""
    return dump(snapshot_dict(*timeline_events(before, seconds, totals, phases), origin), path)


def write_trace(t: Trace, path: str | os.PathLike[str], origin: Origin | None = None) -> Path:
    """A `Trace` (a snapshot as memlab read it) back as a snapshot file: the same events in the
    same order, each with its source line as its one frame."""
    addr = BASE + np.cumsum(np.maximum(-(-t.a_size // ALIGN) * ALIGN, ALIGN)) - t.a_size
    events: list[dict[str, Any]] = []
    spare = int(addr[-1] + t.a_size[-1] + ALIGN) if len(addr) else BASE
    for j in range(len(t.times)):
        k, size = int(t.owner[j]), abs(int(t.deltas[j]))
        if k >= 0:
            a, phase = int(addr[k]), GROUPS[int(t.a_group[k])]
            file, _, rest = t.lines[int(t.a_line[k])].rpartition(":")
            line, _, name = rest.partition(" in ")
            number = int(line) if line.isdigit() else 0
            frames = [{"filename": file, "line": number, "name": name}] if file else []
        else:
            a, phase, frames, spare = spare, GROUPS[0], [], spare + size + ALIGN
        common = {"addr": a, "size": size, "stream": 0, "frames": frames, "phase": phase}
        when = float(t.times[j]) * 1e6
        if t.deltas[j] > 0:
            events.append({"action": "alloc", "time_us": when, **common})
        else:
            for action in ("free_requested", "free_completed"):
                events.append({"action": action, "time_us": when, **common})
    live = [(int(addr[k]), int(t.a_size[k])) for k in np.flatnonzero(np.isnan(t.a_end))]
    untraced = t.before + int(t.deltas[t.owner < 0].sum())  # what no event freed
    if untraced > 0:
        live.append((spare, untraced))
    return dump(snapshot_dict(events, live, origin), path)
