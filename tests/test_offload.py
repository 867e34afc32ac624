"""Offload to host memory (issue 21, part 3): ``RunConfig(offload=...)`` measured on the CPU and
predicted for a GPU, each figure against bytes the test counts itself."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

from memlab.core.categories import Category
from memlab.core.host import HostCopies
from memlab.estimate import estimate
from memlab.reports.host import HostMemory
from memlab.reports.report import MemoryReport
from memlab.step import RunConfig, WhatIfError, run
from memlab.step.offload import HostOffload

WIDTH, BATCH = 64, 32


def mlp(device: str = "cpu") -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(3):
        layers += [nn.Linear(WIDTH, WIDTH), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(WIDTH, 8)).to(device)


def batch(n: int) -> torch.Tensor:
    return torch.randn(n, WIDTH)


def saved_bytes(model: nn.Module, x: torch.Tensor) -> tuple[int, int]:
    """What the step's forward saves for backward, by the test's own hooks, parameters left
    out: (bytes of the distinct storages, bytes of every save as a contiguous copy)."""
    params = [p.untyped_storage() for p in model.parameters()]
    distinct: dict[int, int] = {}
    copies = [0]

    def pack(t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        if not any(s is p for p in params):
            distinct[id(s)] = s.nbytes()
            copies[0] += t.numel() * t.element_size()
        return t.detach()

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(x).float().pow(2).mean()  # the runner's default loss
    del loss
    return sum(distinct.values()), copies[0]


def adam_state_bytes(model: nn.Module) -> int:
    """The bytes of the tensors in an Adam's state after one step, by the test's own Adam."""
    own = copy.deepcopy(model)
    opt = torch.optim.Adam(own.parameters(), lr=1e-3)
    for p in own.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    return sum(
        v.untyped_storage().nbytes()
        for state in opt.state.values()
        for v in state.values()
        if isinstance(v, torch.Tensor)
    )


def param_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def test_activation_offload_shows_the_saved_bytes_on_the_host() -> None:
    distinct, _ = saved_bytes(mlp(), batch(BATCH))
    plain = run(mlp, batch, batch_size=BATCH, device="cpu")
    moved = run(mlp, batch, batch_size=BATCH, device="cpu", offload="activations")
    assert plain.report is not None and moved.report is not None
    host = moved.report.host
    assert host is not None and plain.report.host is None
    # on a CPU the device is the host: save_on_cpu keeps each saved storage where it is, once
    assert host.highest == {"activations": distinct}
    assert host.peak - host.before == distinct and host.after == host.before == 0
    before, after = plain.report.breakdown, moved.report.breakdown
    assert before is not None and after is not None
    assert before.highest.get(Category.ACTIVATION, 0) > 0
    assert after.highest.get(Category.ACTIVATION, 0) == 0  # shown as host instead
    assert after.highest.get(Category.HOST, 0) > 0


def test_optimizer_offload_keeps_the_state_on_the_host() -> None:
    model = mlp()
    r = run(mlp, batch, batch_size=BATCH, device="cpu", offload="optimizer")
    assert r.report is not None and r.report.breakdown is not None and r.report.host is not None
    assert r.report.breakdown.at_end.get(Category.OPTIMIZER_STATE, 0) == 0
    assert r.report.breakdown.at_peak.get(Category.OPTIMIZER_STATE, 0) == 0
    assert dict(r.report.host.at_end) == {
        "optimizer_state": adam_state_bytes(model),
        "master_weights": param_bytes(model),  # fp32 already: a copy each
        "gradients": param_bytes(model),
    }
    assert r.report.breakdown.at_end[Category.HOST] == r.report.host.after


def test_the_host_optimizer_steps_as_the_device_optimizer_would() -> None:
    model, ref = mlp(), mlp()
    off = HostOffload(RunConfig(offload="optimizer"), torch.device("cpu"), model)
    opt = off.make_optimizer(model, RunConfig(optimizer="adamw", lr=0.1), None)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.1)
    x = batch(4)
    for _ in range(2):
        for m, o in ((model, opt), (ref, ref_opt)):
            m(x).pow(2).mean().backward()
            o.step()
            o.zero_grad(set_to_none=True)
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, q)
    assert all(p.grad is None for p in model.parameters())


def test_offload_is_a_training_lever() -> None:
    with pytest.raises(WhatIfError, match=r"offload='optimizer'.*mode='train'"):
        RunConfig(mode="no_grad", offload="optimizer")
    with pytest.raises(WhatIfError, match="offload='disk' is not one of"):
        RunConfig(offload="disk")
    for lever in ({"optimizer_in_backward": True}, {"optimizer_state_bits": 8}):
        with pytest.raises(WhatIfError, match=r"offload='both'.*cannot go with"):
            RunConfig(offload="both", **lever)
        assert RunConfig(offload="activations", **lever).offload == "activations"
    assert RunConfig(offload="both").to_dict()["offload"] == "both"
    assert "offload both" in RunConfig(offload="both").describe()


def wide(b: int) -> torch.Tensor:
    return torch.randn(b, WIDTH, device="cuda")


def gpu_mlp() -> nn.Module:
    return mlp().to("cuda")


def test_estimate_moves_the_saved_activations_off_the_gpu() -> None:
    n = 4096
    distinct, copies = saved_bytes(mlp("meta"), torch.empty(n, WIDTH, device="meta"))
    plain = estimate(gpu_mlp, wide, batch_size=n, gpu=None)
    moved = estimate(gpu_mlp, wide, batch_size=n, gpu=None, offload="activations")
    assert plain.host is None and plain.host_peak == 0
    # on a GPU save_on_cpu copies every save to pinned host memory, a storage saved twice twice
    assert moved.host is not None and moved.host.highest == {"activations": copies}
    assert moved.host_peak == copies and moved.host.pinned_peak == copies
    fall = plain.peak_allocated - moved.peak_allocated
    assert 0.5 * distinct <= fall <= distinct
    at_peak = moved.tensors.breakdown.at_peak  # type: ignore[union-attr]
    assert at_peak.get(Category.ACTIVATION, 0) == 0 and at_peak.get(Category.HOST, 0) == 0


def test_estimate_keeps_the_optimizer_state_off_the_gpu() -> None:
    model = mlp()
    plain = estimate(gpu_mlp, wide, batch_size=BATCH, gpu=None)
    moved = estimate(gpu_mlp, wide, batch_size=BATCH, gpu=None, offload="optimizer")
    assert moved.host is not None
    assert moved.host.at_end["optimizer_state"] == adam_state_bytes(model)
    assert moved.host.at_end["master_weights"] == param_bytes(model)
    end = moved.tensors.breakdown.at_end  # type: ignore[union-attr]
    assert end.get(Category.OPTIMIZER_STATE, 0) == 0
    assert plain.peak_allocated - moved.peak_allocated >= adam_state_bytes(model)
    assert moved.to_dict()["host_peak"] == moved.host.peak


def test_host_copies_count_each_storage_once_until_it_is_freed() -> None:
    copies = HostCopies()
    t = torch.zeros(256)
    copies.add_tensor(t, "activations")
    copies.add_tensor(t[:10], "activations")  # a view: the same storage
    copies.begin()
    u = torch.zeros(1024)
    copies.add_tensor(u, "gradients", pinned=True)
    del u
    f = copies.figures()
    assert (f.before, f.peak, f.after, f.pinned_peak) == (1024, 1024 + 4096, 1024, 4096)
    assert f.highest == {"activations": 1024, "gradients": 4096}
    with pytest.raises(ValueError, match="kind='disk' is not one of"):
        copies.add_tensor(t, "disk")


def host_report() -> MemoryReport:
    return MemoryReport(
        device="cuda:0",
        source="cuda-allocator",
        allocated_before=64 << 20,
        allocated_after=64 << 20,
        peak_allocated=200 << 20,
        seconds=0.25,
        label="train, batch 32, adam, offload both",
        reserved_before=96 << 20,
        reserved_after=224 << 20,
        peak_reserved=224 << 20,
        host=HostMemory(
            before=192 << 20,
            after=192 << 20,
            peak=240 << 20,
            pinned_peak=48 << 20,
            at_end={"optimizer_state": 128 << 20, "master_weights": 64 << 20},
            highest={"activations": 48 << 20, "optimizer_state": 128 << 20},
            allocator={"active_bytes.current": 0, "allocated_bytes.current": 64 << 20},
        ),
    )


def test_the_report_shows_the_host_beside_the_device(golden: Any) -> None:
    r = host_report()
    golden("report_host.txt", r.text() + "\n")
    golden("report_host.html", r._repr_html_() + "\n")
    d = r.to_dict()
    assert d["host"]["peak"] == 240 << 20 and d["host"]["highest"]["activations"] == 48 << 20
    assert "host allocator (pinned memory, whole process): 0 B in use, 64.0 MiB held" in r.text()
    assert "host" not in MemoryReport("cpu", "tensor-accounting", 0, 0, 0, 0.0).to_dict()


@pytest.mark.cuda
def test_on_a_gpu_the_saved_activations_leave_the_device_for_pinned_host_memory() -> None:
    n = 4096
    _, copies = saved_bytes(mlp("cuda"), torch.randn(n, WIDTH, device="cuda"))
    plain = run(gpu_mlp, wide, batch_size=n)
    moved = run(gpu_mlp, wide, batch_size=n, offload="activations")
    assert plain.report is not None and moved.report is not None
    host = moved.report.host
    assert host is not None
    assert (host.allocator is not None) == hasattr(torch.cuda, "host_memory_stats")
    assert host.highest == {"activations": copies} and host.pinned_peak == copies
    assert moved.report.peak_allocated < plain.report.peak_allocated  # the allocator's own


def test_offload_is_one_of_the_levers_of_a_step_that_does_not_fit() -> None:
    from memlab.estimate.levers import config_levers

    config = RunConfig(batch_size=4096)
    levers = {lv.name: lv for lv in config_levers(gpu_mlp, wide, config=config, gpu="T4")}
    truth = estimate(gpu_mlp, wide, config=config.with_(offload="both"), gpu="T4")
    assert levers["offload to host"].peak_reserved == truth.peak_reserved
    assert truth.peak_reserved < estimate(gpu_mlp, wide, config=config, gpu="T4").peak_reserved
