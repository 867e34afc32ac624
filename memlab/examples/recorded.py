"""Files recorded on a GPU and shipped with memlab, for the notebooks and tests to read where no
GPU is at hand."""

from __future__ import annotations

from pathlib import Path

DATA = Path(__file__).parent / "data"


def gpu_snapshot() -> Path:
    """A memory snapshot recorded on an H100 (torch 2.11) around one training step of a small
    GPT with Adam: what ``torch.cuda.memory._snapshot()`` returned, written as
    ``torch.cuda.memory._dump_snapshot`` writes it (no stack frames were recorded). Made by
    scripts/trace_to_snapshot.py from tests/data/trace-gpt-adam.json.gz."""
    return DATA / "snapshot-h100-gpt-adam.pickle"
