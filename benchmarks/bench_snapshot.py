"""Reading big memory snapshots: file size, seconds to the report, and the peak memory of the
process that reads it, for made-up snapshots in torch's format (no GPU here records one).

Each size is written once, then read by a fresh Python process (so that its peak RSS is the
reading's alone): ``python benchmarks/bench_snapshot.py 20000 100000 300000`` (training steps;
about 54 events each). Prints a Markdown table for RESULTS.md.
"""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
import tempfile
import time
from pathlib import Path

READ = """
import json, resource, sys, time
t = time.perf_counter()
import memlab
s = memlab.load_snapshot(sys.argv[1])
read = time.perf_counter() - t
t = time.perf_counter()
s.text(); s.chart().html()
shown = time.perf_counter() - t
print(json.dumps({"events": s.events, "peak": s.peak, "read_s": read, "view_s": shown,
                  "rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


def measure(steps: int, folder: Path) -> dict[str, float]:
    from memlab.snapshot.synthetic import training_snapshot

    data, truth = training_snapshot(steps=steps, depth=20)
    path = folder / f"snapshot-{steps}.pickle"
    with path.open("wb") as f:
        pickle.dump(data, f)  # as torch.cuda.memory._dump_snapshot writes it
    del data
    out = subprocess.run(
        [sys.executable, "-c", READ, str(path)], capture_output=True, text=True, check=True
    )
    row = json.loads(out.stdout)
    assert row["peak"] == truth.peak and row["events"] == truth.events
    row["file_mib"] = path.stat().st_size / 2**20
    path.unlink()
    return row


def main() -> None:
    steps = [int(a) for a in sys.argv[1:]] or [20_000, 100_000]
    print(f"<!-- {time.strftime('%Y-%m-%d')} · Python {sys.version.split()[0]} -->")
    print("| events | file | read | report + chart | peak RSS | RSS / file |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: |")
    with tempfile.TemporaryDirectory() as tmp:
        for n in steps:
            r = measure(n, Path(tmp))
            print(
                f"| {r['events']:,} | {r['file_mib']:.0f} MiB | {r['read_s']:.1f} s | "
                f"{r['view_s']:.1f} s | {r['rss_mib']:.0f} MiB | {r['rss_mib'] / r['file_mib']:.1f}× |",
                flush=True,
            )


if __name__ == "__main__":
    main()
