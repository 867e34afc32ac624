"""Writes a recorded allocator trace (tests/data/trace-*.json.gz, made on a GPU by
benchmarks/record_traces.py) as the pickle ``torch.cuda.memory._dump_snapshot`` writes: the
``segments`` and ``device_traces`` that ``torch.cuda.memory._snapshot()`` returned on that GPU,
unchanged (the recorder kept no stack frames). The pickle holds only dicts, lists, strings and
numbers, as torch's does.

    python scripts/trace_to_snapshot.py tests/data/trace-gpt-adam.json.gz \
        memlab/examples/data/snapshot-h100-gpt-adam.pickle
"""

from __future__ import annotations

import argparse
import gzip
import json
import pickle
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace", type=Path)
    ap.add_argument("out", type=Path)
    args = ap.parse_args()
    d = json.loads(gzip.decompress(args.trace.read_bytes()))
    snapshot = {"segments": d["segments"], "device_traces": d["device_traces"]}
    args.out.write_bytes(pickle.dumps(snapshot, protocol=4))  # torch's own default protocol
    events = len(d["device_traces"][0])
    print(f"{args.out}: {events:,} events on {d['device']} (torch {d['torch']})")


if __name__ == "__main__":
    main()
