"""The GPU validation script keeps working on machines without a GPU (its --dry-run path)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parent.parent / "benchmarks" / "validate_estimator.py"


@pytest.mark.slow
def test_the_estimator_validation_script_predicts_every_kind_of_case(tmp_path: Path) -> None:
    out, lines = tmp_path / "table.md", tmp_path / "cases.jsonl"
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--dry-run", "--out", str(out), "--json", str(lines),
         "--jobs", "2", "--models", "mlp",
         "--configs", "fp32 adam", "amp bf16 adam", "checkpoint adam", "no_grad"],
        capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    table = out.read_text()
    assert len(lines.read_text().splitlines()) == 4  # a line per case, as each finished
    # the table again, from those lines alone (what a run cut short leaves)
    again = tmp_path / "again.md"
    subprocess.run(
        [sys.executable, str(SCRIPT), "--table-from", str(lines), "--out", str(again)],
        capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    assert again.read_text().splitlines()[4:] == table.splitlines()[4:]
    rows = [line for line in table.splitlines() if line.startswith("| ") and "MiB" in line]
    # one model × 4 configurations (each case is a process of its own, so the script's other
    # models, an LSTM and a ViT among them, run in its full runs only: scripts/gpu_session.sh
    # validate)
    assert len(rows) == 4
    assert "Error" not in table  # every case ran on the estimator
    # PyTorch's MemTracker (under FakeTensorMode, here on the CPU) fills its column where it can
    # (it came with torch 2.5: before, the column stays blank)
    if importlib.util.find_spec("torch.distributed._tools.mem_tracker") is not None:
        adam = next(r for r in rows if r.startswith("| mlp | fp32 adam |"))
        assert "MiB" in adam.split("|")[12], adam  # after the two range columns


def test_the_trace_recorders_cases_run_on_meta() -> None:
    script = SCRIPT.parent / "record_traces.py"
    done = subprocess.run(
        [sys.executable, str(script), "--dry-run"],
        capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("predicted peak") == 8  # every what-if case of the recorder
