"""The estimator: a step on the meta device, replayed through the allocator model.

The truths here are independent of the estimator: a real run of the same step on this CPU (the
tensor bytes must be the same, category by category), byte sums of tensors the tests size
themselves, and the allocator's rounding rules applied by hand to tensors that small.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import memlab
from memlab import Category
from memlab.estimate import GPUS, estimate
from memlab.estimate.allocator import SMALL_BUFFER, round_size
from memlab.estimate.gpus import HOPPER_WORKSPACE, PRE_HOPPER_WORKSPACE, GiB
from memlab.examples import GPT
from memlab.whatif import RunConfig, StepHooks, WhatIfError, run

WIDTH = 64


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH))


def rows(batch: int) -> torch.Tensor:
    return torch.randn(batch, WIDTH)


def gpt() -> nn.Module:
    torch.manual_seed(0)
    return GPT(vocab=500, ctx=32, width=64, layers=2)


def tokens(batch: int) -> torch.Tensor:
    return torch.randint(0, 500, (batch, 32))


@pytest.mark.parametrize(
    "changes",
    [
        {"optimizer": "sgd"},
        {"optimizer": "sgd_momentum", "accumulation": 2},
        {"optimizer": "sgd", "checkpoint": "auto"},
    ],
    ids=["sgd", "momentum-accumulate", "checkpoint"],
)
def test_the_meta_run_counts_the_same_tensor_bytes_as_a_real_cpu_run(changes: dict) -> None:
    config = RunConfig(batch_size=8, **changes)
    # meta's own attention kernel is the CPU's: the comparison is exact
    predicted = estimate(gpt, tokens, None, config, gpu=None, workspace=0, cuda_kernels=False)
    real = run(gpt, tokens, None, config.with_(device="cpu"), hooks=StepHooks(foreach=True)).report
    assert real is not None and real.breakdown is not None
    assert predicted.tensors.breakdown is not None
    assert predicted.tensors.peak_allocated == real.peak_allocated
    assert predicted.tensors.breakdown.highest == real.breakdown.highest
    assert predicted.tensors.breakdown.at_peak == real.breakdown.at_peak


def test_adam_runs_foreach_as_on_cuda_and_differs_from_the_cpu_only_by_step_counters() -> None:
    # The estimate runs Adam's foreach implementation (CUDA's default): compare with a real CPU
    # run of the same implementation. On a CPU, Adam keeps each parameter's step counter (a
    # float32 scalar) on the parameters' device, so it is counted; on CUDA (and on meta) the
    # counters stay on the CPU, off the device.
    config = RunConfig(batch_size=8, optimizer="adam")
    predicted = estimate(mlp, rows, None, config, gpu=None, workspace=0).tensors
    real = run(mlp, rows, None, config.with_(device="cpu"), hooks=StepHooks(foreach=True)).report
    single = run(mlp, rows, None, config.with_(device="cpu"), hooks=StepHooks(foreach=False)).report
    assert predicted.breakdown is not None and real is not None and real.breakdown is not None
    assert single is not None and single.breakdown is not None
    n_params = sum(p.numel() for p in mlp().parameters())
    tensors = len(list(mlp().parameters()))
    assert predicted.breakdown.highest[Category.OPTIMIZER_STATE] == 2 * 4 * n_params
    assert real.breakdown.highest[Category.OPTIMIZER_STATE] == 2 * 4 * n_params + 4 * tensors
    temporaries = Category.TEMPORARY
    assert predicted.breakdown.highest[temporaries] == real.breakdown.highest[temporaries]
    assert predicted.peak_allocated == real.peak_allocated - 4 * tensors
    # and the two implementations do differ, so the choice matters
    assert single.breakdown.highest[temporaries] != real.breakdown.highest[temporaries]


def test_small_tensors_take_512_byte_blocks_from_2_mib_segments() -> None:
    # Every tensor of this step is under 1 MiB: the small pool, blocks rounded up to 512 B and
    # always split, so after the step exactly the parameters' and momenta's blocks are allocated.
    config = RunConfig(batch_size=4, optimizer="sgd_momentum")
    e = estimate(mlp, rows, None, config, gpu=None, workspace=0)
    params = [p.numel() * 4 for p in mlp().parameters()]
    assert max(params) < 2**20
    expected = 2 * sum(round_size(n) for n in params)  # weights and momentum buffers
    assert e.report.allocated_after == expected
    assert e.report.reserved_after is not None
    assert e.report.reserved_after % SMALL_BUFFER == 0
    assert e.report.reserved_after >= e.report.allocated_after
    assert e.peak_allocated >= e.report.allocated_after


def test_each_cublas_handle_takes_its_workspace_once_and_keeps_it() -> None:
    # forward and backward run on different threads on a GPU, each with its cuBLAS handle; the
    # first product with a bias (nn.Linear's addmm) takes cuBLASLt's workspace too
    config = RunConfig(batch_size=4, optimizer="sgd")
    without = estimate(mlp, rows, None, config, gpu=None, workspace=0)
    hopper = estimate(mlp, rows, None, config, gpu="H100 80GB")
    older = estimate(mlp, rows, None, config, gpu="A100 80GB")
    assert without.workspaces == () and without.workspace == 0
    lt = GPUS["H100 80GB"].lt_workspace
    assert lt == 2**20 and HOPPER_WORKSPACE == 32 * 2**20
    assert hopper.workspaces == (
        ("forward", HOPPER_WORKSPACE),
        ("forward lt", lt),
        ("backward", HOPPER_WORKSPACE),
    )
    # what an H100 with torch 2.11 showed after a training step: 2 × 32 MiB + 1 MiB
    assert hopper.workspace == 65 * 2**20
    assert hopper.report.allocated_after - without.report.allocated_after == 65 * 2**20
    assert older.report.allocated_after - without.report.allocated_after == (
        2 * PRE_HOPPER_WORKSPACE + lt
    )
    assert older.peak_reserved - without.peak_reserved >= 2 * PRE_HOPPER_WORKSPACE + lt
    assert "32.0 MiB (forward), 1.00 MiB (cuBLASLt), 32.0 MiB (backward)" in hopper.notes[0]


def test_inference_takes_only_the_forward_handles_workspaces() -> None:
    e = estimate(mlp, rows, None, RunConfig(batch_size=4, mode="no_grad"), gpu="H100 80GB")
    assert [key for key, _ in e.workspaces] == ["forward", "forward lt"]
    # products without a bias (mm, bmm) take no cuBLASLt workspace
    e = estimate(
        lambda: nn.Linear(WIDTH, WIDTH, bias=False),
        rows,
        None,
        RunConfig(batch_size=4, optimizer="sgd"),
        gpu="H100 80GB",
    )
    assert [key for key, _ in e.workspaces] == ["forward", "backward"]


def test_a_model_without_matrix_products_takes_no_workspace() -> None:
    def convs() -> nn.Module:
        return nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Conv2d(8, 4, 3))

    e = estimate(convs, lambda b: torch.randn(b, 3, 16, 16), None, RunConfig(batch_size=2))
    assert e.workspaces == () and not any("cuBLAS" in n for n in e.notes)


def test_code_written_for_cuda_runs_on_meta_and_allocates_nothing_real() -> None:
    def model_fn() -> nn.Module:
        return nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.ReLU()).to("cuda")

    def input_fn(batch: int) -> torch.Tensor:
        x = torch.ones(batch, WIDTH, device="cuda")
        return x.cuda() * torch.ones(WIDTH).to("cuda:0")

    with memlab.track("cpu") as cpu:
        e = estimate(model_fn, input_fn, None, RunConfig(batch_size=2048, optimizer="sgd"))
    assert cpu.report.peak_delta == 0  # not one byte of real memory for the model or the batch
    assert e.tensors.breakdown is not None
    assert e.tensors.breakdown.highest[Category.INPUT] == 2048 * WIDTH * 4
    assert e.tensors.breakdown.highest[Category.PARAMETER] == (WIDTH * WIDTH + WIDTH) * 4


def test_a_model_too_large_for_the_gpu_does_not_fit() -> None:
    def huge() -> nn.Module:
        return nn.Linear(32_768, 32_768)  # 4 GiB of weights; Adam needs 4 × that

    e = estimate(huge, lambda b: torch.randn(b, 32_768), None, RunConfig(batch_size=2), gpu="T4")
    assert e.oom and not e.fits()
    assert "predicted for T4 (16 GiB) · does NOT fit" in e._repr_html_()  # in a notebook too
    assert "out of memory" in e.notes[0]
    big = estimate(
        huge, lambda b: torch.randn(b, 32_768), None, RunConfig(batch_size=2), gpu="A100 80GB"
    )
    assert not big.oom and big.fits()
    assert 16 * GiB < big.peak_reserved < 80 * GiB
    assert not big.fits(budget=big.peak_reserved - 1)
    assert big.fits(budget=big.peak_reserved)


def test_amp_on_meta_saves_what_autocast_saves_on_a_real_cpu() -> None:
    # For Linear, GELU and the runner's loss (square, mean), CPU autocast and CUDA's policy,
    # which the estimate emulates, agree; so the real CPU run is the truth, category by category.
    for amp in ("bf16", "fp16"):
        config = RunConfig(batch_size=32, amp=amp, optimizer="sgd")
        predicted = estimate(mlp, rows, None, config, gpu=None, workspace=0).tensors
        real = run(
            mlp, rows, None, config.with_(device="cpu"), hooks=StepHooks(foreach=True)
        ).report
        assert real is not None and real.breakdown is not None
        assert predicted.breakdown is not None
        ours, truth = dict(predicted.breakdown.highest), dict(real.breakdown.highest)
        if amp == "fp16":  # the CPU run's GradScaler keeps a scale and a counter: 8 B or so
            for c in (Category.INPUT, Category.TEMPORARY):
                assert 0 < truth.pop(c) - ours.pop(c) <= 16
        assert ours == truth
        assert abs(predicted.peak_allocated - real.peak_allocated) <= 0.005 * real.peak_allocated
    fp32 = estimate(mlp, rows, None, RunConfig(batch_size=32, optimizer="sgd"), gpu=None)
    bf16 = estimate(mlp, rows, None, RunConfig(batch_size=32, amp="bf16", optimizer="sgd"))
    assert fp32.tensors.breakdown is not None and bf16.tensors.breakdown is not None
    acts = Category.ACTIVATION
    assert bf16.tensors.breakdown.highest[acts] != fp32.tensors.breakdown.highest[acts]
    assert "autocast emulated" in " ".join(bf16.notes)


def test_amp_with_checkpointing_recomputes_under_the_same_autocast() -> None:
    # Checkpointing recomputes each block in backward; real autocast re-enters for it, and the
    # emulation must too, or the recomputed tensors come out float32 and checkpoint refuses them.
    def blocks() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(*[mlp() for _ in range(3)])

    config = RunConfig(batch_size=32, amp="bf16", checkpoint="auto", optimizer="sgd")
    predicted = estimate(blocks, rows, None, config, gpu=None, workspace=0).tensors
    real = run(blocks, rows, None, config.with_(device="cpu"), hooks=StepHooks(foreach=True)).report
    assert real is not None and real.breakdown is not None and predicted.breakdown is not None
    assert predicted.breakdown.highest == real.breakdown.highest
    assert abs(predicted.peak_allocated - real.peak_allocated) <= 0.005 * real.peak_allocated
    assert torch.utils.checkpoint.checkpoint.__name__ == "checkpoint"  # restored


def test_the_autocast_emulation_casts_a_shared_weight_once_and_restores_torch() -> None:
    from memlab.estimate.autocast import emulated

    layer = nn.Linear(WIDTH, WIDTH, device="meta")
    x = torch.empty(8, WIDTH, device="meta")
    with memlab.track("meta") as t, emulated(torch.bfloat16):
        y = layer(layer(x))  # the weight's bf16 copy is made once and reused
        z = torch.softmax(y, -1)
        assert y.dtype == torch.bfloat16 and z.dtype == torch.float32  # softmax: float32 out
        assert F_layer_norm(y).dtype == torch.float32  # layer_norm runs in float32
        del y, z
    weight_copy = (WIDTH * WIDTH + WIDTH) * 2  # one bf16 copy of weight and bias, not two
    rows_bf16, rows_fp32 = 8 * WIDTH * 2, 8 * WIDTH * 4
    # x's copy and two outputs in bf16; softmax's output, layer_norm's float32 input copy and
    # output; layer_norm's mean and 1/std (8 floats each)
    assert t.report.peak_delta == weight_copy + 3 * rows_bf16 + 3 * rows_fp32 + 2 * 8 * 4
    assert t.report.allocated_delta == 0  # the cache went when the region ended
    assert "matmul" not in torch.Tensor.__dict__  # every patched entry point restored
    assert torch.nn.functional.linear is torch._C._nn.linear


def F_layer_norm(t: torch.Tensor) -> torch.Tensor:  # noqa: N802
    return torch.nn.functional.layer_norm(t, t.shape[-1:])


def test_the_emulated_policy_is_the_installed_pytorchs() -> None:
    import re
    from pathlib import Path

    from memlab.estimate import autocast

    header = Path(torch.__file__).parent / "include" / "ATen" / "autocast_mode.h"
    text = header.read_text()

    def listed(macro: str) -> set[str]:
        body = text.split(f"#define {macro}(_)", 1)[1].split("\n\n", 1)[0]
        return set(re.findall(r"_\((\w+)", body))

    assert listed("AT_FORALL_LOWER_PRECISION_FP") == set(autocast.LOWER_PRECISION)
    assert listed("AT_FORALL_FP32") == set(autocast.FLOAT32)
    assert listed("AT_FORALL_FP32_SET_OPT_DTYPE") == set(autocast.FLOAT32_OUTPUT)
    assert listed("AT_FORALL_PROMOTE") == set(autocast.PROMOTE)


def test_bad_requests_get_errors_that_say_what_to_do() -> None:
    existing = mlp()
    with pytest.raises(WhatIfError, match=r"already exists \(on cpu\).*must build the model"):
        estimate(lambda: existing, rows, None, RunConfig(optimizer="sgd"))
    with pytest.raises(ValueError, match=r"gpu got 'V100', an unknown GPU: pass one of.*H100 80GB"):
        estimate(mlp, rows, None, RunConfig(), gpu="V100")
    with pytest.raises(ValueError, match="pass a budget"):
        estimate(mlp, rows, None, RunConfig(optimizer="sgd"), gpu=None).fits()
    assert (
        estimate(mlp, rows, None, RunConfig(optimizer="sgd"), gpu="h100 80gb").gpu
        is GPUS["H100 80GB"]
    )


def test_the_report_says_it_is_a_prediction() -> None:
    e = estimate(mlp, rows, None, RunConfig(batch_size=4, optimizer="sgd"), gpu="L4")
    text = str(e)
    assert text.startswith("predicted for L4 (24 GiB) · fits")
    assert "PREDICTED" in text and "cuBLAS workspace" in text
    html = e._repr_html_()
    assert "PREDICTED" in html and "predicted for L4 (24 GiB) · fits" in html
    d = e.to_dict()
    assert d["gpu"] == "L4" and d["fits"] is True and d["report"]["source"] == "estimate"
    assert d["peak_reserved"] >= d["peak_allocated"] > 0


def test_data_parallel_strategies_divide_the_state_on_paper() -> None:
    from memlab.estimate import per_rank, strategies

    def blocks() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(4)])

    e = estimate(blocks, rows, None, RunConfig(batch_size=8, optimizer="adam"), gpu=None)
    layer = (WIDTH * WIDTH + WIDTH) * 4
    assert e.fsdp_units == (layer,) * 4  # each repeated block's parameters
    assert e.tensors.breakdown is not None
    at_peak = e.tensors.breakdown.at_peak
    n = 4
    ddp, z1, z2, fsdp = (per_rank(e, n, s) for s in ("ddp", "zero1", "zero2", "fsdp"))
    assert ddp.by_category == {c: b for c, b in at_peak.items() if b}
    assert ddp.extra == e.tensors.breakdown.highest[Category.GRADIENT] == 4 * layer  # buckets
    assert per_rank(e, n, "ddp", bucket_view=True).extra == 0
    state = at_peak.get(Category.OPTIMIZER_STATE, 0)
    assert z1.by_category.get(Category.OPTIMIZER_STATE, 0) == -(-state // n)
    assert z1.extra == ddp.extra and z1.total < ddp.total  # ZeroRedundancyOptimizer keeps DDP
    # the estimate's peak is in the optimizer step: its temporaries shrink with the state
    assert ddp.moment == z1.moment == "optimizer step"
    temporary = at_peak[Category.TEMPORARY]
    assert z1.by_category[Category.TEMPORARY] == -(-temporary // n)
    assert ddp.by_category[Category.TEMPORARY] == temporary
    params = at_peak[Category.PARAMETER]
    assert fsdp.by_category[Category.PARAMETER] == params // n
    # sharded, the state is small beside the activations: the peak is while they are held, with
    # two units gathered and two all-gather buffers
    assert fsdp.moment == "forward and backward" and fsdp.extra == 4 * layer
    assert z2.total <= z1.total
    keep = per_rank(e, n, "fsdp", reshard_after_forward=False)
    assert keep.moment == "forward and backward" and keep.extra == params + 2 * layer
    assert per_rank(e, 1, "fsdp").total == sum(b for b in at_peak.values())
    table = str(strategies(e, n))
    assert "ddp" in table and "fsdp" in table and table.count("\n") >= 4
    with pytest.raises(ValueError, match="not one of"):
        per_rank(e, n, "pipeline")
    with pytest.raises(ValueError, match="world_size"):
        per_rank(e, 0)


def test_attention_runs_the_kernel_cuda_would_pick_and_saves_no_attention_matrix() -> None:
    from memlab.estimate.kernels import cuda_functions

    b, h, n, d = 2, 4, 256, 32
    q, k, v = (torch.empty(b, h, n, d, device="meta", requires_grad=True) for _ in range(3))
    mask = torch.ones(n, n, dtype=torch.bool, device="meta").tril()
    sdpa = torch.nn.functional.scaled_dot_product_attention
    plain = memlab.graph_of(sdpa(q, k, v, attn_mask=mask)).activation_bytes
    with cuda_functions():
        efficient = memlab.graph_of(
            torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        )
        half = [
            torch.empty(b, h, n, d, device="meta", dtype=torch.float16, requires_grad=True)
            for _ in range(3)
        ]
        flash = memlab.graph_of(
            torch.nn.functional.scaled_dot_product_attention(*half, is_causal=True)
        )
    assert torch.nn.functional.scaled_dot_product_attention is sdpa  # restored
    assert plain >= b * h * n * n * 4  # math: the attention matrix itself is saved
    # the memory-efficient kernel: its output, a log-sum-exp per row, the float mask it was
    # given, and the dropout generator's seed and offset
    expected = b * h * n * d * 4 + b * h * n * 4 + n * n * 4 + 2 * 8
    assert efficient.activation_bytes == expected
    ops = [node.op for node in efficient.nodes]
    assert "ScaledDotProductEfficientAttentionBackward0" in ops
    assert "ScaledDotProductFlashAttentionBackward0" in [node.op for node in flash.nodes]
    # FlashAttention (float16, causal, no mask): its output, the log-sum-exp, the RNG state
    assert flash.activation_bytes == b * h * n * d * 2 + b * h * n * 4 + 2 * 8 + 8


def test_a_transformer_estimate_saves_far_less_than_the_math_attention_would() -> None:
    def long() -> nn.Module:
        torch.manual_seed(0)
        return GPT(vocab=500, ctx=512, width=64, layers=2)

    def ids(batch: int) -> torch.Tensor:
        return torch.randint(0, 500, (batch, 512))

    config = RunConfig(batch_size=2, optimizer="sgd")
    predicted = estimate(long, ids, None, config, gpu=None, workspace=0).tensors
    math = run(long, ids, None, config.with_(device="cpu")).report  # the CPU runs math attention
    assert predicted.breakdown is not None and math is not None and math.breakdown is not None
    acts = Category.ACTIVATION
    matrices = 2 * 2 * 1 * 512 * 512 * 4  # layers × batch × heads × L × L floats, at least
    assert math.breakdown.highest[acts] - predicted.breakdown.highest[acts] >= matrices


def test_the_predicted_timeline_is_the_allocator_models_and_says_so() -> None:
    e = estimate(mlp, rows, None, RunConfig(batch_size=64, optimizer="adam"), gpu="H100 80GB")
    tl = e.report.timeline
    assert tl is not None and tl.source == "allocator model"
    # one point per allocation and free the model saw in the measured step, in order
    assert list(tl.seconds) == sorted(tl.seconds)
    assert {"forward", "backward", "optimizer"} <= set(tl.phases)
    assert max(tl.allocated) == e.peak_allocated  # its peak is the predicted peak
    assert min(tl.allocated) >= e.workspace  # the workspaces are held throughout
    ax = e.report.plot().axes[0]
    assert "meta-device run, not GPU time" in ax.get_xlabel()


def test_a_thinned_predicted_timeline_keeps_the_peak() -> None:
    from memlab.region.assemble import MAX_TIMELINE_POINTS

    def deep() -> torch.nn.Module:  # thousands of allocations in one step
        return torch.nn.Sequential(*(torch.nn.Linear(16, 16) for _ in range(400)))

    e = estimate(deep, lambda b: torch.randn(b, 16), gpu="T4", batch_size=8, optimizer="adam")
    tl = e.report.timeline
    assert tl is not None and len(tl) <= MAX_TIMELINE_POINTS + 2
    events = e.report.to_dict()["timeline"]["allocated"]
    assert len(events) == len(tl)
    assert max(tl.allocated) == e.peak_allocated  # thinning never drops the maximum
    measured = memlab.whatif.run(deep, lambda b: torch.randn(b, 16), device="cpu", batch_size=8)
    assert measured.report is not None and measured.report.timeline is not None
    assert max(measured.report.timeline.allocated) == measured.report.peak_allocated


def test_dropout_saves_a_one_byte_mask_as_on_a_gpu() -> None:
    from memlab.estimate.kernels import cuda_functions

    x = torch.empty(64, 128, device="meta", requires_grad=True)
    cpu_like = memlab.graph_of(torch.nn.functional.dropout(x, 0.1)).activation_bytes
    with cuda_functions():
        fused = memlab.graph_of(torch.nn.functional.dropout(x, 0.1)).activation_bytes
        assert torch.nn.functional.dropout(x, 0.1, training=False) is x  # eval: untouched
    assert cpu_like == 64 * 128 * 4  # a float32 mask
    assert fused == 64 * 128  # CUDA's fused kernel: a bool mask


def test_a_transformer_layer_without_grad_takes_the_fused_path_a_gpu_takes() -> None:
    import memlab.estimate.kernels as kernels

    calls: list[int] = []
    fast = kernels._encoder_layer_fast

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return fast(*args, **kwargs)

    def model_fn() -> torch.nn.Module:
        return torch.nn.TransformerEncoderLayer(256, 4, 1024, batch_first=True, norm_first=True)

    def input_fn(b: int) -> torch.Tensor:
        return torch.randn(b, 128, 256)

    config = RunConfig(batch_size=8, mode="no_grad")
    kernels._encoder_layer_fast = counted
    try:
        fused = estimate(model_fn, input_fn, None, config)
    finally:
        kernels._encoder_layer_fast = fast
    separate = estimate(model_fn, input_fn, None, config, cuda_kernels=False)
    assert len(calls) == 2  # the warm-up step and the measured one
    # the separate ops copy the heads out of the packed projection; the fused path does not
    assert fused.peak_allocated < separate.peak_allocated


def test_an_lstm_out_of_training_runs_as_cudnns_single_call() -> None:
    from memlab.estimate.kernels import cuda_functions

    with torch.device("meta"):
        lstm = nn.LSTM(64, 64, 2, batch_first=True).eval()
        x = torch.empty(4, 32, 64)
    cell_by_cell = memlab.graph_of(lstm(x)[0]).activation_bytes  # every step's gates
    with cuda_functions():
        out, (h, c) = lstm(x)
        single = memlab.graph_of(out).activation_bytes
    assert out.shape == (4, 32, 64) and h.shape == c.shape == (2, 4, 64)
    assert not out.is_contiguous()  # cuDNN's output is sequence first: a transposed view
    assert single < cell_by_cell / 4


def test_the_model_reaches_the_gpu_as_moved_there_a_tied_weight_once() -> None:
    from memlab.estimate.trace import events_of

    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(1000, 48)
            self.head = nn.Linear(48, 1000, bias=False)
            self.head.weight = self.emb.weight
            scratch = torch.empty(1000, 48) * 2  # built and dropped: never on the GPU
            del scratch

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            out: torch.Tensor = self.head(self.emb(ids))
            return out

    config = RunConfig(batch_size=4, mode="no_grad")
    e = estimate(Tied, lambda b: torch.randint(0, 1000, (b, 16)), None, config, trace=True)
    assert e.trace is not None
    sizes = [ev["size"] for ev in events_of(e.trace) if ev["action"] == "alloc"]
    assert sizes.count(1000 * 48 * 4) == 1  # one copy of the shared weight, and no scratch


def test_the_fused_attention_path_is_emulated_only_where_a_gpu_takes_it_without_weights() -> None:
    from memlab.estimate.kernels import _fast_path_allowed, cuda_functions

    with torch.device("meta"):
        attn = nn.MultiheadAttention(64, 4, batch_first=True).eval()
        x = torch.empty(4, 32, 64)

        class Layer(nn.TransformerEncoderLayer):  # a forward of its own, calling the class's
            def forward(self, h: torch.Tensor, scale: float = 1.0) -> torch.Tensor:  # type: ignore[override]
                out: torch.Tensor = super().forward(h) * scale
                return out

        layer = Layer(64, 4, 128, batch_first=True).eval()
    forward = nn.MultiheadAttention.forward
    mask = torch.ones(32, 32, dtype=torch.bool, device="meta")
    assert not _fast_path_allowed(forward, attn, (x, x, x), {})  # need_weights=True by default
    assert _fast_path_allowed(forward, attn, (x, x, x), {"need_weights": False})
    assert not _fast_path_allowed(
        forward, attn, (x, x, x), {"need_weights": False, "attn_mask": mask}
    )
    with cuda_functions(), torch.no_grad():
        assert layer(x, scale=2.0).shape == x.shape


def test_an_estimate_shows_its_timeline_in_a_notebook(ip: Any) -> None:
    ip.push({"estimate": estimate, "mlp": mlp, "rows": rows})
    ip.rec.clear()
    r = ip.run_cell("estimate(mlp, rows, gpu='T4', batch_size=8)", store_history=True)
    assert r.success
    kinds = [sorted(d) for _, d in ip.rec.items]
    assert ["text/html", "text/plain"] in kinds and any("image/png" in k for k in kinds)
    html = next(d["text/html"] for _, d in ip.rec.items if "text/html" in d)
    assert "predicted for T4" in html


@pytest.mark.parametrize(
    ("spec", "name"),
    [
        ("H100", "H100 80GB"),
        ("h100-80gb", "H100 80GB"),
        ("4090", "RTX 4090"),
        ("a100_40GB", "A100 40GB"),
        ("t4", "T4"),
    ],
)
def test_a_gpu_is_found_by_the_name_people_type(spec: str, name: str) -> None:
    from memlab.estimate.gpus import gpu, parse

    assert gpu(spec).name == name  # type: ignore[union-attr]
    assert parse(spec, "--gpu").name == name


def test_a_gpu_name_that_means_several_names_them_and_a_size_string_is_a_size() -> None:
    from memlab.estimate.gpus import GiB, gpu

    with pytest.raises(
        ValueError, match=r"gpu got 'A100', which could be 'A100 40GB' or 'A100 80GB'"
    ):
        estimate(mlp, rows, None, RunConfig(), gpu="A100")
    assert gpu("24GiB").memory == 24 * GiB  # type: ignore[union-attr]
