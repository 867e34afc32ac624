"""A memlab report written as a snapshot reads back as the device it was measured on.

PyTorch's format numbers devices as GPUs only, so a CPU region's timeline, a ``cuda:1`` region's
or an estimate's, written with ``to_snapshot``, read back as ``cuda:0`` measured by the caching
allocator. memlab keeps the report's device and source beside the trace (torch's viewer ignores
the keys), and `load_snapshot` uses them; torch's own files and values no report holds are read
as before."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
import torch
from torch import nn

import memlab
from memlab.core.choices import Source
from memlab.snapshot import from_dict, load_snapshot
from memlab.snapshot.synthetic import training_snapshot


def cpu_report() -> memlab.MemoryReport:
    with memlab.track("cpu", timeline=True) as t:
        x = torch.ones(4096)
        y = x * 2
        del x
    del y
    return t.report


def test_a_cpu_regions_snapshot_reads_back_as_the_cpu(tmp_path: Path) -> None:
    r = cpu_report()
    s = load_snapshot(r.to_snapshot(tmp_path / "cpu.pickle"))
    assert s.where == "cpu" and s.report.device == "cpu"
    assert s.report.source == r.source != Source.CUDA_ALLOCATOR
    assert "cuda" not in s.text().splitlines()[0]
    assert s.to_dict()["where"] == "cpu"
    assert s.report.peak_allocated == r.peak_allocated  # (the figures as before)
    again = load_snapshot(s.to_snapshot(tmp_path / "again.pickle"))  # kept through a rewrite
    assert (again.where, again.report.source) == ("cpu", r.source)


def test_an_estimates_snapshot_names_the_predicted_gpu(tmp_path: Path) -> None:
    from memlab.estimate import estimate

    e = estimate(
        lambda: nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64)),
        lambda n: torch.randn(n, 64),
        config={"batch_size": 16},
        gpu="T4",
    )
    s = load_snapshot(e.to_snapshot(tmp_path / "predicted.pickle"))
    assert s.where == e.report.device and "T4" in s.where
    assert s.report.source == Source.ESTIMATE


def test_torchs_own_files_still_read_as_their_gpu(tmp_path: Path) -> None:
    data, _ = training_snapshot(steps=1)
    assert from_dict(data, "torch's").where == "cuda:0"
    s = from_dict(data, "torch's")
    assert s.report.source == Source.CUDA_ALLOCATOR and s.origin is None


@pytest.mark.parametrize(
    "device, source",
    [
        (["cpu"], "tensor-accounting"),  # not a str
        ("", "tensor-accounting"),
        ("x" * 81, "tensor-accounting"),
        ("cpu\n<b>", "tensor-accounting"),  # not printable
        ("cpu", "made-up"),
        ("cpu", ["tensor-accounting"]),  # unhashable
        ("cpu", None),
    ],
)
def test_values_no_report_holds_are_ignored(tmp_path: Path, device: object, source: object) -> None:
    r = cpu_report()
    p = r.to_snapshot(tmp_path / "cpu.pickle")
    data = pickle.loads(p.read_bytes())
    data["memlab_device"], data["memlab_source"] = device, source
    p.write_bytes(pickle.dumps(data, protocol=4))
    s = load_snapshot(p)
    assert s.origin is None and s.where == "cuda:0"


def test_an_origin_claimed_by_another_writer_is_ignored(tmp_path: Path) -> None:
    data, _ = training_snapshot(steps=1)
    data = {**data, "memlab_device": "cpu", "memlab_source": "tensor-accounting"}
    assert from_dict(data, "not memlab's").where == "cuda:0"
    data["written_by"] = "memlab"
    assert from_dict(data, "memlab's").where == "cpu"


def test_the_device_is_escaped_in_html(tmp_path: Path) -> None:
    data, _ = training_snapshot(steps=1)
    data = {**data, "written_by": "memlab", "memlab_source": "estimate"}
    data["memlab_device"] = "predicted <script>alert(1)</script>"
    html = from_dict(data, "x").html()
    assert "<script>" not in html and "&lt;script&gt;" in html
