"""Reading big memory snapshots: file size, seconds to the report, and the peak memory of the
process that reads it, for made-up snapshots in torch's format (no GPU here records one).

Each size is written by one fresh Python process and read by others, one per way of reading, so
that each peak RSS is the reading's alone (Linux keeps a process's peak RSS across fork and
exec, so the parent stays small): ``python benchmarks/bench_snapshot.py 20000 60000``
(training steps; 54 events each; ``--free-stacks``: each free with a stack of its own;
``--streamed-only``: skip reading whole, for files too big for that). Prints
a Markdown table for RESULTS.md.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

WRITE = """
import pickle, sys
from memlab.snapshot.synthetic import training_snapshot
data, truth = training_snapshot(steps=int(sys.argv[2]), depth=20, free_stacks=sys.argv[3] == "1")
with open(sys.argv[1], "wb") as f:
    pickle.dump(data, f)  # as torch.cuda.memory._dump_snapshot writes it
print(truth.peak)
"""
READ = """
import json, resource, sys, time
import memlab
from memlab.snapshot import from_dict
from memlab.snapshot.unpickle import read
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
t = time.perf_counter()
first = []  # seconds to the first view (the segments' report, shown before the trace)
if sys.argv[2] == "streamed":
    s = memlab.load_snapshot(
        sys.argv[1], first_view=lambda v: first.append((time.perf_counter() - t, v.text()))
    )
else:
    s = from_dict(read(sys.argv[1], check_memory=False), sys.argv[1])
loaded = time.perf_counter() - t
t = time.perf_counter()
s.text(); s.chart().html()
print(json.dumps({"events": s.events, "peak": s.peak, "read_s": loaded,
                  "first_s": first[0][0] if first else None,
                  "view_s": time.perf_counter() - t, "base_mib": base,
                  "rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


def run(code: str, *args: str) -> str:
    done = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(done.stderr)
    return done.stdout


def main() -> None:
    free_stacks = "--free-stacks" in sys.argv  # each free with a stack of its own
    steps = [int(a) for a in sys.argv[1:] if a.isdigit()] or [20_000, 60_000]
    # --streamed-only: a file too big to read whole here
    ways = ("streamed",) if "--streamed-only" in sys.argv else ("streamed", "whole")
    print(f"<!-- {time.strftime('%Y-%m-%d')} · Python {sys.version.split()[0]} -->")
    print(
        "| events | file | reading | first view | read | report + chart | peak RSS above import |"
    )
    print("| ---: | ---: | --- | ---: | ---: | ---: | ---: |")
    with tempfile.TemporaryDirectory() as tmp:
        for n in steps:
            path = Path(tmp) / f"snapshot-{n}.pickle"
            peak = int(run(WRITE, str(path), str(n), "1" if free_stacks else "0"))
            mib = path.stat().st_size / 2**20
            for way in ways:
                r = json.loads(run(READ, str(path), way))
                assert r["peak"] == peak
                above = r["rss_mib"] - r["base_mib"]
                first = "" if r["first_s"] is None else f"{r['first_s']:.2f} s"
                print(
                    f"| {r['events']:,} | {mib:.0f} MiB | {way} | {first} | {r['read_s']:.1f} s | "
                    f"{r['view_s']:.1f} s | {above:,.0f} MiB ({above / mib:.1f}× the file) |",
                    flush=True,
                )
            path.unlink()


if __name__ == "__main__":
    main()
