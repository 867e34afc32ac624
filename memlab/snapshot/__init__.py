"""PyTorch memory snapshots in and out: `load_snapshot` reads a file written by
``torch.cuda.memory._dump_snapshot`` (safely: no code in it runs) into a `Snapshot` report;
``MemoryReport.to_snapshot`` writes memlab timelines for torch's own viewer; ``chart()`` draws
an interactive timeline that needs no network."""

from typing import Any

from memlab.core.parts import part
from memlab.snapshot.load import from_dict, load_snapshot
from memlab.snapshot.result import Allocation, Snapshot
from memlab.snapshot.unpickle import SafeUnpickler, SnapshotError

__all__ = [
    "Allocation",
    "SafeUnpickler",
    "Snapshot",
    "SnapshotError",
    "from_dict",
    "load_snapshot",
]


def __getattr__(name: str) -> Any:  # (its modules, imported when first asked for)
    return part(__name__, __file__, name)
