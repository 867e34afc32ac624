"""Snapshots made up in torch's format, for tests, benchmarks and docs where no GPU can record
one: a training loop's allocations with stack frames shared between events as torch shares
them, consistent segments at the end, and the figures they must give (computed here, by plain
running sums, independently of the reader)."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

#: The made-up user's file, and the line of each of its steps.
USER_FILE = "/home/user/train.py"
LINES = {"forward": 21, "backward": 34, "optimizer": 37, "setup": 12}
BASE = 0x7F00_0000_0000


@dataclass(frozen=True)
class Truth:
    """What a reader must find in the snapshot."""

    before: int  # live before the first event
    peak: int
    end: int  # allocated when the snapshot was taken
    reserved: int
    largest: int  # the biggest allocation of the trace
    largest_line: str
    events: int


def _frames(kind: str, depth: int) -> list[dict[str, Any]]:
    """A stack, innermost first: torch's frames, then the user's line, then the caller's."""
    torch_frames = {
        "forward": [("torch/nn/modules/linear.py", 125, "forward"), ("_call_impl", 0, "")],
        "backward": [("torch/autograd/graph.py", 824, "_engine_run_backward")],
        "optimizer": [("torch/optim/adam.py", 245, "step")],
        "setup": [("torch/nn/modules/module.py", 1340, "to")],
    }[kind]
    out = [
        {"filename": f"/usr/lib/python3.11/site-packages/{f}", "line": n, "name": name or f}
        for f, n, name in torch_frames
    ]
    if kind == "forward":
        out[1] = {"filename": out[0]["filename"], "line": 1773, "name": "_call_impl"}
    out.append({"filename": USER_FILE, "line": LINES[kind], "name": "train"})
    out += [{"filename": "<frozen runpy>", "line": i, "name": "_run_code"} for i in range(depth)]
    return out


def training_snapshot(
    steps: int, layers: int = 6, depth: int = 8, seed: int = 0, free_stacks: bool = False
) -> tuple[dict[str, Any], Truth]:
    """A snapshot of ``steps`` training steps of a ``layers``-layer model (about ``9 * layers``
    events a step), and its `Truth`. Weights are made before the trace begins. A free carries
    its allocation's list of frames (as torch records by default), or with ``free_stacks`` a
    list of its own (``_record_memory_history(stacks="all")``)."""
    rng = random.Random(seed)
    stacks = {k: _frames(k, depth) for k in LINES}
    events: list[dict[str, Any]] = []
    live: dict[int, int] = {}
    made_by: dict[int, list[dict[str, Any]]] = {}  # address -> its allocation's frames
    addr, now, total = BASE, 1_700_000_000_000_000, 0
    weights = [rng.randrange(1, 64) * 65536 for _ in range(layers)]
    for w in weights:  # made before recording began: in the segments, not in the trace
        live[addr] = w
        addr, total = addr + w, total + w
    before = peak = total
    largest, largest_line = 0, ""

    def alloc(size: int, kind: str) -> int:
        nonlocal addr, now, total, peak, largest, largest_line
        a, addr, now = addr, addr + size, now + rng.randrange(1, 50)
        live[a] = size
        total += size
        stack = made_by[a] = list(stacks[kind])
        peak = max(peak, total)
        if size > largest:
            largest, largest_line = size, f"{USER_FILE}:{LINES[kind]} in train"
        events.append(
            {"action": "alloc", "addr": a, "size": size, "stream": 0, "time_us": now,
             "frames": stack}
        )  # fmt: skip
        return a

    def free(a: int) -> None:
        nonlocal now, total
        size = live.pop(a)
        total -= size
        for action in ("free_requested", "free_completed"):
            now += rng.randrange(1, 5)
            # as torch records without free stacks: the allocation's own list, shared
            events.append(
                {"action": action, "addr": a, "size": size, "stream": 0, "time_us": now,
                 "frames": list(stacks["backward"]) if free_stacks
                 else made_by.pop(a) if action == "free_completed" else made_by[a]}
            )  # fmt: skip

    state: list[int] = []
    for step in range(steps):
        acts = [alloc(rng.randrange(1, 256) * 4096, "forward") for _ in range(layers * 2)]
        grads: list[int] = []
        for a in reversed(acts):
            free(a)
            if len(grads) < layers:
                grads.append(alloc(weights[len(grads)], "backward"))
        if step == 0:
            state = [alloc(w, "optimizer") for w in weights for _ in range(2)]
        for g in grads:
            free(g)
    events.append({"action": "snapshot", "addr": 0, "size": 0, "stream": 0, "time_us": now})
    end = sum(live.values())
    size = addr - BASE
    blocks, at = [], BASE
    for a in sorted(live):  # the one segment: live blocks, the gaps between them free
        if a > at:
            blocks.append({"address": at, "size": a - at, "requested_size": 0, "state": "inactive"})
        blocks.append(
            {"address": a, "size": live[a], "requested_size": live[a], "state": "active_allocated",
             "frames": list(stacks["optimizer" if a in state else "setup"])}
        )  # fmt: skip
        at = a + live[a]
    if at < addr:
        blocks.append({"address": at, "size": addr - at, "requested_size": 0, "state": "inactive"})
    segment = {
        "device": 0, "address": BASE, "total_size": size, "allocated_size": end,
        "active_size": end, "requested_size": end, "stream": 0, "segment_type": "large",
        "segment_pool_id": (0, 0), "is_expandable": False, "frames": [], "blocks": blocks,
    }  # fmt: skip
    data = {"segments": [segment], "device_traces": [events], "allocator_settings": {}}
    truth = Truth(before, peak, end, size, largest, largest_line, len(events))
    return data, truth
