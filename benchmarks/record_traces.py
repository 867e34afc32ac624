"""Record small real allocator traces on a GPU, for the simulator's regression tests.

Each case runs in a fresh process, so the caching allocator starts empty, with
``torch.cuda.memory._record_memory_history()`` on (no stack frames: the traces stay small). The
case is a `memlab.whatif.run` step (a warm-up step, then the measured one) or, for ``rules``, a
fixed sequence of allocations that walks the allocator's rules (pools, rounding, splitting,
merging, ``empty_cache``). What is kept, as ``tests/data/trace-<case>.json.gz``:

- ``device_traces``: the allocator's events (action, address, size, stream, time);
- ``stats``: the measured step's peak and final allocated and reserved bytes, from the
  allocator's own counters, and where the step starts and ends in the trace (event indices);
- ``segments``: the allocator's segments at the end, with their blocks' sizes;
- the device, the torch version and the case's configuration.

The ``run`` cases are `memlab.examples.cases.RUNS`. ``tests/test_trace_replay.py`` replays every
stored trace through `memlab.estimate.allocator` (it must make the same segment decisions and
reach the same peaks) and predicts each ``run`` case with `memlab.estimate.estimate` on the CPU
(it must land within the estimator's targets).

    python benchmarks/record_traces.py --out tests/data        # on a GPU machine
    python benchmarks/record_traces.py --dry-run               # anywhere: the cases run on meta
"""

from __future__ import annotations

import argparse
import gzip
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

import memlab  # noqa: F401
from memlab.core import _torch
from memlab.estimate.trace import compact, recorded
from memlab.examples.cases import RUNS
from memlab.step import StepHooks, run

MiB = 2**20
FORMAT = "memlab-trace/1"


CASES = [*RUNS, "rules"]


def rules(device: str = "cuda") -> None:
    """Allocations that walk the caching allocator's rules, in a fixed order."""
    keep = []
    for n in (1, 511, 512, 513, 4096, 100_000, MiB, MiB + 1):  # the small pool, then the large
        keep.append(torch.empty(n, dtype=torch.uint8, device=device))
    big = [torch.empty(s, dtype=torch.uint8, device=device) for s in (3 * MiB, 9 * MiB, 11 * MiB)]
    del big[1]  # a free 9 MiB block inside a 20 MiB segment: a 4 MiB request splits it
    keep.append(torch.empty(4 * MiB, dtype=torch.uint8, device=device))
    del big  # neighbours free: blocks merge
    keep.append(torch.empty(15 * MiB, dtype=torch.uint8, device=device))
    for i in range(64):  # many small tensors, every other one freed: holes in small segments
        t = torch.empty(1000 * (i + 1), dtype=torch.uint8, device=device)
        if i % 2:
            keep.append(t)
    keep.append(torch.empty(30 * MiB + 7, dtype=torch.uint8, device=device))
    del keep[-1]
    if device == "cuda":
        torch.cuda.empty_cache()  # wholly free segments go back
    keep.append(torch.empty(25 * MiB, dtype=torch.uint8, device=device))
    keep.clear()


def record(case: str) -> dict[str, Any]:
    """Run one case on the GPU with the allocator's history on; the trace and its figures."""
    torch.cuda.init()
    _torch.record_memory_history(max_entries=1_000_000)
    moments: dict[str, int] = {}

    def mark(moment: str) -> None:  # where the measured step starts and ends, in events
        moments[moment] = recorded()

    stats: dict[str, Any] = {}
    config = None
    if case == "rules":
        rules()
        torch.cuda.synchronize()
    else:
        model_fn, input_fn, config = RUNS[case]
        result = run(
            lambda: model_fn().cuda(),
            input_fn,
            None,
            config.with_(device="cuda"),
            hooks=StepHooks(on_measure=mark),
        )
        if result.report is None:
            raise RuntimeError(f"{case}: {result.error}")
        r = result.report
        stats = {
            "peak_allocated": r.peak_allocated,
            "peak_reserved": r.peak_reserved,
            "allocated_after": r.allocated_after,
            "reserved_after": r.reserved_after,
            "measured_from": moments["start"],
            "measured_to": moments["end"],
        }
    snapshot = _torch.memory_snapshot()
    _torch.record_memory_history(False)
    counters = torch.cuda.memory_stats()
    stats.update(
        {k: counters[k] for k in ("num_alloc_retries", "num_ooms") if k in counters},
        final_allocated=counters["allocated_bytes.all.current"],
        final_reserved=counters["reserved_bytes.all.current"],
    )
    props = torch.cuda.get_device_properties(0)
    return {
        "format": FORMAT,
        "case": case,
        "config": None if config is None else config.describe(),
        "device": props.name,
        "memory": props.total_memory,
        "capability": f"{props.major}.{props.minor}",
        "torch": torch.__version__,
        "stats": stats,
        **compact(snapshot),
    }


def dry_run() -> None:
    """Every case on meta, through the estimator: the case definitions still work."""
    from memlab.estimate import estimate

    rules("meta")
    for case, (model_fn, input_fn, config) in RUNS.items():
        e = estimate(model_fn, input_fn, None, config, gpu="H100 80GB")
        peaks = f"{e.peak_allocated:,} B allocated, {e.peak_reserved:,} B reserved"
        print(f"{case}: predicted peak {peaks}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="tests/data", help="folder for trace-<case>.json.gz")
    parser.add_argument("--cases", nargs="*", default=CASES)
    parser.add_argument("--dry-run", action="store_true", help="run the cases on meta only")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.dry_run:
        dry_run()
        return
    if args.one:  # the child process of one case: the trace to stdout
        print(json.dumps(record(args.one), separators=(",", ":")))
        return
    if not torch.cuda.is_available():
        parser.error("no GPU here: traces are recorded on a GPU (--dry-run checks the cases)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for case in args.cases:
        child = subprocess.run(
            [sys.executable, __file__, "--one", case], capture_output=True, text=True, check=False
        )
        if child.returncode:
            print(f"{case}: FAILED\n{child.stderr[-3000:]}", flush=True)
            continue
        path = out / f"trace-{case}.json.gz"
        path.write_bytes(gzip.compress(child.stdout.encode(), mtime=0))
        data = json.loads(child.stdout)
        events = sum(len(t) for t in data["device_traces"])
        print(f"{case}: {events:,} events, {path.stat().st_size:,} B → {path}", flush=True)


if __name__ == "__main__":
    main()
