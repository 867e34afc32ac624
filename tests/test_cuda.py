"""On a GPU: every figure against the CUDA allocator's own counters (run on the GPU machine)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from conftest import run

import memlab
from memlab import Category

pytestmark = pytest.mark.cuda
MiB = 1024**2


def sync_stats() -> dict[str, int]:
    torch.cuda.synchronize()
    return dict(torch.cuda.memory_stats())


def test_figures_equal_memory_stats() -> None:
    keep = torch.empty(MiB, device="cuda")  # noqa: F841  (CUDA initialised, something allocated)
    s0 = sync_stats()
    with memlab.track("cuda") as t:
        x = torch.empty(MiB, device="cuda")  # 4 MiB: a multiple of 512 B, a block of its own
        y = torch.empty(8 * MiB, device="cuda")  # 32 MiB transient
        del y
    s1 = sync_stats()
    r = t.report
    assert r.source == "cuda-allocator" and r.device == f"cuda:{torch.cuda.current_device()}"
    assert r.allocated_before == s0["allocated_bytes.all.current"]
    assert r.allocated_after == s1["allocated_bytes.all.current"]
    assert r.peak_allocated == s1["allocated_bytes.all.peak"]  # reset at the region's start
    assert r.reserved_before == s0["reserved_bytes.all.current"]
    assert r.reserved_after == s1["reserved_bytes.all.current"]
    assert r.peak_reserved == s1["reserved_bytes.all.peak"]
    assert r.active_after == s1["active_bytes.all.current"]
    assert r.allocated_delta == 4 * MiB
    assert r.peak_delta == 4 * MiB + 32 * MiB
    assert r.peak_scope == "region"
    del x


def test_no_reset_leaves_the_peak_counter_alone() -> None:
    big = torch.empty(64 * MiB, device="cuda")
    del big
    peak_before = sync_stats()["allocated_bytes.all.peak"]
    with memlab.track("cuda", reset_peak=False) as t:
        x = torch.empty(MiB, device="cuda")
    r = t.report
    assert r.peak_scope == "since-reset"
    assert r.peak_allocated == max(peak_before, sync_stats()["allocated_bytes.all.peak"])
    assert r.peak_allocated >= 256 * MiB  # the earlier 256 MiB tensor still counts
    del x


def test_nested_regions_keep_the_outer_peak() -> None:
    torch.empty(1, device="cuda")
    with memlab.track("cuda") as outer:
        t1 = torch.empty(16 * MiB, device="cuda")  # 64 MiB, freed before the inner region
        del t1
        with memlab.track("cuda") as inner:
            t2 = torch.empty(MiB, device="cuda")
        del t2
    assert inner.report.peak_delta == 4 * MiB
    assert outer.report.peak_delta >= 64 * MiB  # not lost to the inner reset


def test_oom_is_counted_and_memory_returns() -> None:
    s0 = sync_stats()
    with memlab.track("cuda") as t, pytest.raises(torch.cuda.OutOfMemoryError):
        torch.empty(1 << 50, dtype=torch.uint8, device="cuda")
    assert t.report.ooms == 1
    assert t.report.allocated_after == s0["allocated_bytes.all.current"]


def test_breakdown_on_cuda_is_exact_and_the_rest_is_unattributed() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(1024, 4096), torch.nn.ReLU(), torch.nn.Linear(4096, 1024)
    ).cuda()
    opt = torch.optim.Adam(model.parameters())
    x = torch.randn(64, 1024, device="cuda")
    with memlab.track("cuda", breakdown=True) as t:
        model(x).sum().backward()
        opt.step()
    r = t.report
    end = r.breakdown.at_end  # type: ignore[union-attr]
    params = sum(p.numel() * 4 for p in model.parameters())
    assert end[Category.PARAMETER] == params
    assert end[Category.GRADIENT] == params
    # Adam's moments live on the GPU; its `step` counters stay on the CPU unless capturable
    states = [v for s in opt.state.values() for v in s.values() if torch.is_tensor(v)]
    on_gpu = sum(v.numel() * v.element_size() for v in states if v.is_cuda)
    assert on_gpu == 2 * params
    assert end[Category.OPTIMIZER_STATE] == on_gpu
    # Tensor bytes never exceed the allocator's figures (it rounds blocks up and holds the
    # cuBLAS workspace); the difference is what the report calls unattributed.
    for part, total in ((end, r.allocated_after), (r.breakdown.at_peak, r.peak_allocated)):  # type: ignore[union-attr]
        accounted = sum(v for c, v in part.items() if c is not Category.UNATTRIBUTED)
        assert 0 <= total - accounted == part.get(Category.UNATTRIBUTED, 0)


def test_driver_view_matches_mem_get_info() -> None:
    torch.empty(1, device="cuda")
    with memlab.track("cuda", driver=True) as t:
        pass
    d = t.report.driver
    assert d is not None
    free, total = torch.cuda.mem_get_info()
    assert d.total == total and abs(d.free - free) <= 64 * MiB


def test_all_devices() -> None:
    torch.empty(1, device="cuda")
    with memlab.track("all") as t:
        pass
    assert [r.device for r in t.reports] == [f"cuda:{i}" for i in range(torch.cuda.device_count())]


def test_magic_on_cuda(ip: Any) -> None:
    run(ip, "x0 = torch.empty(1, device='cuda')")
    cell = "x = torch.empty(2**20, device='cuda')\ny = torch.empty(2**23, device='cuda')\ndel y"
    run(ip, "%%gpumem -o r\n" + cell)
    r = ip.user_ns["r"]
    assert r.source == "cuda-allocator"
    assert r.allocated_delta == 4 * MiB and r.peak_delta == 36 * MiB
    assert "CUDA caching allocator" in ip.rec.reports()[0]
    run(ip, "%%gpumem -b -o rb\nw = torch.empty(2**20, device='cuda')")
    assert ip.user_ns["rb"].breakdown is not None
    run(ip, "%%gpumem -d cpu -o rc\nz = torch.empty(1000)")
    assert ip.user_ns["rc"].allocated_delta == 4000


def test_a_cell_that_does_not_use_the_gpu_does_not_initialise_cuda() -> None:
    import subprocess
    import sys

    code = (
        "import torch\n"
        "from IPython.core.interactiveshell import InteractiveShell\n"
        "ip = InteractiveShell.instance(); ip.run_line_magic('load_ext', 'memlab')\n"
        "ip.run_cell('%%gpumem -q\\nx = 1', store_history=True)\n"
        "print(torch.cuda.is_initialized())"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip().endswith("False")


def test_graph_bytes_against_the_allocators_growth_over_the_forward() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(1024, 4096), torch.nn.GELU(), torch.nn.Linear(4096, 1024)
    ).cuda()
    x = torch.randn(256, 1024, device="cuda")
    model(x).sum().backward()  # warm-up: cuBLAS workspace allocated before we measure
    model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    g = memlab.graph(model, x)  # the graph is freed when it returns: compare with the peak
    torch.cuda.synchronize()
    growth = torch.cuda.max_memory_allocated() - before
    output = 256 * 1024 * 4
    # At the end of the forward, what it allocated is what the graph saved plus the output,
    # rounded up by the allocator (512 B blocks): the graph accounts for all of it.
    assert g.activation_bytes + output <= growth <= g.activation_bytes + output + 1024**2
    print(f"graph {g.activation_bytes:,} B + output {output:,} B; allocator peak +{growth:,} B")


def test_whatif_oom_is_a_result_and_memory_returns_to_the_byte() -> None:
    from memlab.whatif import RunConfig, run

    width = 4096
    torch.empty(1, device="cuda")
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    free, _ = torch.cuda.mem_get_info()
    huge = int(2 * free // (width * 4))  # the input alone is twice the free memory

    def model_fn() -> torch.nn.Module:
        return torch.nn.Linear(width, width).cuda()

    def input_fn(batch: int) -> torch.Tensor:
        return torch.randn(batch, width, device="cuda")

    r = run(model_fn, input_fn, None, RunConfig(device="cuda", batch_size=huge))
    assert r.oom and r.error is not None and "CUDA out of memory" in r.error
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == before  # nothing of the failed run is left
    ok = run(model_fn, input_fn, None, RunConfig(device="cuda", batch_size=64))
    assert not ok.oom and ok.report is not None and ok.report.source == "cuda-allocator"


def test_panel_largest_batch_uses_free_gpu_memory_without_a_budget() -> None:
    from memlab.whatif import RunConfig

    def model_fn() -> torch.nn.Module:
        return torch.nn.Sequential(torch.nn.Linear(4096, 4096), torch.nn.GELU()).cuda()

    ex = memlab.Explorer(
        model_fn, lambda b: torch.randn(b, 4096, device="cuda"), config=RunConfig(device="cuda")
    )
    best = ex.largest_batch()
    assert best is not None and best > 1024  # 80 GB hold far more than a thousand rows
    assert not ex.results[-1].oom


def test_a_recorded_trace_replays_exactly_through_the_allocator_model() -> None:
    # in a fresh process: the allocator must start empty, as the model does
    import subprocess
    import sys

    code = """
import torch
from memlab.core import _torch
from memlab.estimate.trace import compact, recorded, replay
MiB = 2**20
torch.cuda.init()
_torch.record_memory_history()
start = recorded()
keep = [torch.empty(n, dtype=torch.uint8, device="cuda") for n in (1000, 3 * MiB, 30 * MiB)]
del keep[1]
grew = recorded() > start
snapshot = compact(_torch.memory_snapshot())
_torch.record_memory_history(False)
r = replay(snapshot, start)
print(grew, r.first_divergence is None, r.real_peak_reserved == r.model_peak_reserved)
print(r)
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.splitlines()[0] == "True True True", done.stdout
