"""``RunConfig(compile=...)``: a torch.compile'd step, measured by what sees inside compiled code.

The meter (the CPU allocator's record, `memlab.core.allocations`) is checked first against the
tensor accounting on eager steps and against tensors the test makes on compiled functions; then
a compiled training step runs through `memlab.whatif.run`, its figures checked against the bytes
of the model's own tensors and against the eager step. Compiling takes seconds: one tiny model,
compiled once for the module.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch import nn

import memlab
from memlab.core import ledger
from memlab.core.allocations import AllocationRecord
from memlab.core.categories import Category
from memlab.estimate import estimate
from memlab.examples import GPT, mlp, small_cnn
from memlab.whatif import Comparison, RunConfig, RunResult, WhatIfError, run

BASE = RunConfig(device="cpu", batch_size=256, optimizer="sgd")
WIDTH = 128


class Block(nn.Module):
    """Pointwise work between two matrix products: what inductor fuses, and recomputes in
    backward rather than keep."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        return x + torch.tanh(self.b(nn.functional.gelu(h) * torch.sigmoid(h)))


def blocks() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[Block() for _ in range(3)])


def rows(batch: int) -> torch.Tensor:
    return torch.randn(batch, WIDTH)


def nbytes(tensors: Any) -> int:
    return sum(t.untyped_storage().nbytes() for t in tensors)


@pytest.fixture(scope="module")
def runs() -> Iterator[tuple[RunResult, RunResult]]:
    """The eager and the compiled training step of `blocks`, each run once for the module (on
    a ledger of their own: tensors other tests left alive are not in their figures)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ledger, "_DEFAULT", ledger.Ledger())
        yield run(blocks, rows, None, BASE), run(blocks, rows, None, BASE.with_(compile=True))


# -- the configuration ----------------------------------------------------------------------------


def test_the_field_takes_a_flag_or_a_mode_and_refuses_what_it_cannot_measure() -> None:
    assert RunConfig(compile="default") == RunConfig(compile=True)  # one spelling of one step
    assert RunConfig(compile="max-autotune").compile == "max-autotune"
    assert RunConfig(compile=True).describe().endswith("torch.compile")
    assert RunConfig(compile="reduce-overhead").to_dict()["compile"] == "reduce-overhead"
    with pytest.raises(WhatIfError, match=r"compile must be True, False or a torch.compile mode"):
        RunConfig(compile="fast")
    refused = {
        "mode='generate'": {"mode": "generate"},
        "offload='activations'": {"offload": "activations"},
        "world_size=2": {"world_size": 2, "sharding": "ddp"},
        "retention='attached'": {"retention": "attached"},
        "warmup=False": {"warmup": False},
    }
    for what, fields in refused.items():
        with pytest.raises(
            WhatIfError, match=rf"compile=True cannot go with {what}.*compile=False"
        ):
            RunConfig(compile=True, **fields)


# -- the meter: against the tensor accounting, then against tensors the test makes ---------------


def _sgd_step(model: nn.Module, x: torch.Tensor) -> Callable[[], None]:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def step() -> None:
        model(x).float().square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()  # PyTorch's one-time costs outside both measurements
    return step


EAGER = {
    "mlp": (lambda: mlp(64), lambda: torch.randn(16, 64)),
    "transformer": (
        lambda: GPT(vocab=97, ctx=16, width=64, layers=2),
        lambda: torch.randint(0, 97, (4, 16)),
    ),
}


@pytest.mark.parametrize("name", EAGER)
def test_the_meter_equals_tensor_accounting_on_eager_steps(name: str) -> None:
    """An MLP and a small transformer: the allocator's record and the tensor accounting give the
    same peak and the same end, to the byte, on the same training step."""
    build, make = EAGER[name]
    torch.manual_seed(0)
    step = _sgd_step(build(), make())
    with AllocationRecord() as rec:
        step()
    with memlab.track("cpu") as t:
        step()
    assert rec.result is not None
    assert (rec.result.peak, rec.result.net) == (t.report.peak_delta, t.report.allocated_delta)
    assert rec.result.peak > 0


def test_the_meter_also_sees_what_a_convolution_allocates_inside_itself() -> None:
    """The small CNN: the same end to the byte, and a higher peak: the CPU convolution computes
    into buffers of its own (oneDNN: a buffer the size of its output, copied out), which no op
    returns, so a dispatch mode never sees them. The allocator's record is the truth here."""
    torch.manual_seed(0)
    step = _sgd_step(small_cnn(), torch.randn(8, 3, 16, 16))
    with AllocationRecord() as rec:
        step()
    with memlab.track("cpu") as t:
        step()
    assert rec.result is not None
    assert rec.result.net == t.report.allocated_delta == 0
    assert rec.result.peak > t.report.peak_delta
    conv, x = nn.Conv2d(3, 32, 3, padding=1), torch.randn(8, 3, 16, 16)
    with torch.no_grad():
        conv(x)
        with AllocationRecord() as one, memlab.track("cpu") as seen:
            y = conv(x)
    assert one.result is not None
    assert seen.report.peak_delta == nbytes([y])  # the accounting: the output alone
    assert one.result.peak >= 2 * nbytes([y])  # the allocator: another buffer as large


@pytest.fixture(scope="module")
def functions() -> dict[str, Callable[..., torch.Tensor]]:
    def chain(x: torch.Tensor) -> torch.Tensor:
        return x.sin().cos().exp()

    def product(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return torch.mm(x.sin(), w).cos()

    return {"chain": chain, "product": product, "compiled chain": torch.compile(chain)} | {
        "compiled product": torch.compile(product)
    }


def _recorded(fn: Callable[..., torch.Tensor], *args: torch.Tensor) -> tuple[Any, torch.Tensor]:
    with torch.no_grad():
        fn(*args)  # compiled on the first call
        with AllocationRecord() as rec:
            y = fn(*args)
    return rec.result, y


def test_the_meter_sees_a_compiled_function_keep_only_its_output(functions: Any) -> None:
    """``x.sin().cos().exp()``: eagerly two intermediates at once; inductor fuses the three ops
    into one kernel that writes the output and nothing else."""
    x = torch.randn(256, 512)
    eager, y = _recorded(functions["chain"], x)
    assert (eager.peak, eager.net) == (2 * nbytes([y]), nbytes([y]))
    compiled, y = _recorded(functions["compiled chain"], x)
    assert (compiled.peak, compiled.net, compiled.count) == (nbytes([y]), nbytes([y]), 1)


def test_under_the_tensor_accounting_a_compiled_function_runs_eagerly(functions: Any) -> None:
    """Why a compiled step is not measured under memlab's dispatch mode: dynamo runs the frame
    eagerly while one is active, so it would report the eager figures."""
    x = torch.randn(256, 512)
    with torch.no_grad():
        functions["compiled chain"](x)
        with memlab.track("cpu"), AllocationRecord() as rec:
            functions["compiled chain"](x)
    assert rec.result is not None and rec.result.count == 3  # the eager sin, cos and exp


def test_the_meter_sees_a_compiled_functions_own_buffer(functions: Any) -> None:
    """``mm(x.sin(), w).cos()``: the sine must exist for the product (an external kernel), so
    inductor allocates it, then takes the cosine in place in the product's output: two
    allocations where eager makes three, the same peak (the sine and the product)."""
    x, w = torch.randn(256, 512), torch.randn(512, 128)
    eager, y = _recorded(functions["product"], x, w)
    compiled, y2 = _recorded(functions["compiled product"], x, w)
    torch.testing.assert_close(y, y2)
    sine = nbytes([x])  # the same shape and type as x
    assert (compiled.peak, compiled.net, compiled.count) == (sine + nbytes([y]), nbytes([y]), 2)
    assert (eager.peak, eager.net, eager.count) == (sine + nbytes([y]), nbytes([y]), 3)


# -- a compiled training step through the what-if runner ------------------------------------------


def test_a_compiled_step_is_measured_by_the_allocator(runs: Any) -> None:
    """Before and after: the parameters (SGD keeps no state; the gradients are set to None);
    at the peak at least the parameters and all their gradients (SGD's step holds both)."""
    eager, compiled = runs
    r = compiled.report
    params = nbytes(blocks().parameters())
    assert r.source == "cpu-allocator" and compiled.config.compile is True
    assert (r.allocated_before, r.allocated_after) == (params, params)
    assert r.peak_allocated >= 2 * params
    assert eager.report.allocated_before == params  # the eager step starts from the same


def test_a_compiled_step_keeps_fewer_intermediates_than_the_eager_one(runs: Any) -> None:
    """The step peaks where backward starts, with what the forward kept: inductor keeps fewer
    (it recomputes the gelu, sigmoid and product in backward)."""
    eager, compiled = runs
    assert compiled.peak < eager.peak
    saved = eager.report.breakdown.highest[Category.ACTIVATION]
    assert eager.peak - compiled.peak <= saved  # what it saves is at most what eager keeps


def test_the_compiled_step_equals_the_same_step_compiled_by_hand(runs: Any) -> None:
    """The runner adds nothing: the same model compiled and stepped by the test, measured by the
    allocator's record, climbs exactly as high above where it started."""
    _, compiled = runs
    model = torch.compile(blocks())
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)

    def step() -> None:  # as the runner steps: the input made inside, its default loss
        out = model(rows(BASE.batch_size))
        loss = out.float().pow(2).mean() / 1
        loss.backward()
        del out, loss
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()
    step()
    with AllocationRecord() as rec:
        step()
    r = compiled.report
    assert rec.result is not None
    assert r.peak_allocated - r.allocated_before == rec.result.peak
    assert r.allocated_after - r.allocated_before == rec.result.net == 0


def test_a_compiled_step_says_what_it_knows_and_what_not(runs: Any) -> None:
    eager, compiled = runs
    b = compiled.report.breakdown
    params = nbytes(blocks().parameters())
    assert b.at_peak[Category.PARAMETER] == params and Category.ACTIVATION not in b.at_peak
    assert sum(b.at_peak.values()) == compiled.peak
    assert b.at_peak[Category.UNATTRIBUTED] == compiled.peak - params
    text, html = compiled.text(), compiled.html()
    for shown in (text, html):
        assert "no breakdown by category inside compiled code" in shown
        assert "compiled in 2 warm-up steps" in shown and "not the step&#x27;s" not in text
    assert "CPU allocator&#x27;s own record" in html or "CPU allocator's own record" in html
    timeline = compiled.report.timeline  # every allocation of the record, the peak kept
    assert timeline is not None and timeline.source == "cpu allocator record"
    assert max(timeline.allocated) == compiled.peak and set(timeline.phases) == {"other"}
    assert timeline.allocated[-1] == compiled.report.allocated_after
    assert list(timeline.seconds) == sorted(timeline.seconds)
    assert timeline.seconds[-1] <= compiled.report.seconds
    table = Comparison([eager, compiled])
    row = table.rows()[1]
    assert row.activations is None and row.vs_baseline == compiled.peak - eager.peak
    assert "activations n/a: a compiled step" in table.text()
    assert table.to_dict()["runs"][1]["activations"] is None


def test_a_compiler_that_cannot_run_is_an_error_naming_the_field() -> None:
    import torch._inductor.config as inductor

    # torch's own patch: pytest's monkeypatch leaves the setting deleted (hidden) on its undo,
    # and every later compile in the process fails for want of it
    with inductor.patch({"cpp.cxx": ("/nonexistent/c++",)}):
        _a_compiler_that_cannot_run()
    assert inductor.cpp.cxx != ("/nonexistent/c++",)


def _a_compiler_that_cannot_run() -> None:

    class Odd(nn.Module):  # a class no other test compiled: nothing cached to reuse
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.ones(3, 5))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return (x @ self.w).cosh() * 3

    with pytest.raises(WhatIfError, match=r"compile=True: torch.compile could not compile.*C\+\+"):
        run(Odd, lambda b: torch.ones(b, 3), None, BASE.with_(batch_size=2, compile=True))


def test_a_running_profiler_is_an_error_naming_the_field(runs: Any) -> None:
    with (
        torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]),
        pytest.raises(WhatIfError, match=r"compile=True on the CPU is measured by PyTorch's prof"),
    ):
        run(blocks, rows, None, BASE.with_(compile=True))


# -- the estimator and the panel ------------------------------------------------------------------


def test_an_estimate_of_a_compiled_step_is_the_eager_one_and_says_so() -> None:
    eager = estimate(blocks, rows, None, BASE, gpu="T4")
    compiled = estimate(blocks, rows, None, BASE.with_(compile=True), gpu="T4")
    assert compiled.config.compile is True and "torch.compile" in compiled.headline() + str(
        compiled.config.describe()
    )
    assert (compiled.peak_allocated, compiled.peak_reserved) == (
        eager.peak_allocated,
        eager.peak_reserved,
    )
    assert any(n.startswith("torch.compile is not modelled") for n in compiled.notes)
    assert not any("torch.compile" in n for n in eager.notes)


def test_the_panel_offers_the_toggle_where_one_plain_step_runs() -> None:
    ex = memlab.Explorer(blocks, rows, config=BASE)

    def shown() -> bool:
        return bool(ex.compile.layout.display != "none")

    ex.compile.value = True
    assert shown() and ex.config.compile is True
    for control, value in (("mode", "generate"), ("offload", "both"), ("retention", "attached")):
        was = getattr(ex, control).value
        getattr(ex, control).value = value
        assert not shown() and ex.config.compile is False, control
        getattr(ex, control).value = was
    ex.mode.value = "no_grad"  # a forward compiles too, offload left on for training hidden
    ex.offload.value = "both"
    assert shown() and ex.config.compile is True


@pytest.mark.cuda
def test_on_a_gpu_a_compiled_step_is_the_allocators_peak() -> None:
    """On CUDA the caching allocator's counters measure the compiled step: the same model
    compiled and stepped by the test peaks as high above where it started (not yet run on a
    GPU: this machine has none)."""

    def on_gpu() -> nn.Module:
        return blocks().cuda()

    def gpu_rows(batch: int) -> torch.Tensor:
        return rows(batch).cuda()

    config = BASE.with_(device="cuda", compile=True)
    eager = run(on_gpu, gpu_rows, None, config.with_(compile=False))
    compiled = run(on_gpu, gpu_rows, None, config)
    r = compiled.report
    assert r is not None and r.source == "cuda-allocator"
    assert r.breakdown is not None
    assert r.breakdown.at_peak[Category.PARAMETER] == nbytes(blocks().parameters())
    assert compiled.peak is not None and eager.peak is not None and compiled.peak <= eager.peak
    model = torch.compile(on_gpu())
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)

    def step() -> None:
        out = model(gpu_rows(BASE.batch_size))
        loss = out.float().pow(2).mean() / 1
        loss.backward()
        del out, loss
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()
    step()
    torch.cuda.synchronize()
    start = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    assert r.peak_allocated - r.allocated_before == torch.cuda.max_memory_allocated() - start
