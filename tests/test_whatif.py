"""The what-if runner: each technique's effect, measured and checked against hand-computed bytes."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn

from memlab import Category
from memlab.step import blocks
from memlab.whatif import RunConfig, RunResult, WhatIfError, run

WIDTH, BATCH, DEPTH = 256, 64, 8
ONE = BATCH * WIDTH * 4  # one block's output, float32


def stack() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.GELU()) for _ in range(DEPTH)])


def inputs(batch: int) -> torch.Tensor:
    return torch.randn(batch, WIDTH)


BASE = RunConfig(device="cpu", batch_size=BATCH)


def measure(config: RunConfig, model_fn=stack) -> RunResult:  # type: ignore[no-untyped-def]
    result = run(model_fn, inputs, None, config)
    assert result.report is not None and result.report.breakdown is not None
    return result


def highest(result: RunResult, category: Category) -> int:
    return result.report.breakdown.highest.get(category, 0)  # type: ignore[union-attr]


def params_bytes() -> int:
    return sum(p.numel() * 4 for p in stack().parameters())


def test_training_step_activations_and_optimizer_state() -> None:
    r = measure(BASE)
    # Each block saves its Linear's output (for GELU) and its GELU output (for the next
    # Linear); the last GELU output is the loss's input, saved by pow: 16 block outputs.
    assert highest(r, Category.ACTIVATION) == 2 * DEPTH * ONE
    end = r.report.breakdown.at_end  # type: ignore[union-attr]
    assert end[Category.OPTIMIZER_STATE] == 2 * params_bytes() + 4 * 2 * DEPTH  # Adam
    assert end[Category.PARAMETER] == params_bytes()
    assert Category.GRADIENT not in end  # zero_grad(set_to_none=True) ended the step


@pytest.mark.parametrize(
    ("optimizer", "factor"), [("sgd", 0), ("sgd_momentum", 1), ("adam", 2), ("adamw", 2)]
)
def test_optimizer_state_is_a_multiple_of_the_parameters(optimizer: str, factor: int) -> None:
    r = measure(BASE.with_(optimizer=optimizer))
    state = r.report.breakdown.at_end.get(Category.OPTIMIZER_STATE, 0)  # type: ignore[union-attr]
    steps = 4 * 2 * DEPTH if optimizer.startswith("adam") else 0  # a float32 step per parameter
    assert state == factor * params_bytes() + steps


def test_checkpointing_the_blocks_saves_only_their_inputs() -> None:
    plain = highest(measure(BASE), Category.ACTIVATION)
    ck = measure(BASE.with_(checkpoint="auto"))
    assert blocks(stack()) == [str(i) for i in range(DEPTH)]
    # Only the inputs of blocks 2..8 and the final output (saved by the loss) stay saved
    # through the forward; backward recomputes one block at a time.
    forward_saved = (DEPTH - 1) * ONE + ONE
    assert highest(ck, Category.ACTIVATION) <= forward_saved + 2 * ONE
    assert plain / highest(ck, Category.ACTIVATION) >= 1.6


def test_no_grad_and_inference_mode_leave_no_activations() -> None:
    for mode in ("no_grad", "inference_mode"):
        r = measure(BASE.with_(mode=mode))
        assert highest(r, Category.ACTIVATION) == 0
        assert r.report.breakdown.at_end.get(Category.GRADIENT, 0) == 0  # type: ignore[union-attr]


def test_bf16_autocast_on_this_cpu() -> None:
    fp32 = highest(measure(BASE), Category.ACTIVATION)
    bf16 = highest(measure(BASE.with_(amp="bf16")), Category.ACTIVATION)
    # By hand, what bf16 autocast saves on this CPU: a bf16 copy of x (for Linear 1), every
    # Linear's bf16 output (for GELU), the bf16 GELU outputs of blocks 1-7 (for the next
    # Linear), the float32 copy .float() makes of the last one (for the loss's pow), and a bf16
    # copy of each weight whose Linear's input needs grad (blocks 2-8). The weight copies make
    # it more than float32 here, not half.
    half = BATCH * WIDTH * 2
    expected = half + DEPTH * half + (DEPTH - 1) * half + ONE + (DEPTH - 1) * WIDTH * WIDTH * 2
    assert bf16 == expected
    assert fp32 == 2 * DEPTH * ONE and bf16 > fp32


def test_fp16_with_a_gradient_scaler_runs() -> None:
    r = measure(BASE.with_(amp="fp16"))
    assert r.error is None and highest(r, Category.ACTIVATION) > 0


def test_accumulation_cuts_activations_about_k_times() -> None:
    one = highest(measure(BASE), Category.ACTIVATION)
    four = highest(measure(BASE.with_(accumulation=4)), Category.ACTIVATION)
    assert one / four == pytest.approx(4, rel=0.1)


def test_retention_attached_grows_by_a_forward_detached_by_the_output() -> None:
    attached = measure(BASE.with_(retention="attached", iterations=5)).series
    detached = measure(BASE.with_(retention="detached", iterations=5)).series
    grow_a = {b - a for a, b in itertools.pairwise(attached)}
    grow_d = {b - a for a, b in itertools.pairwise(detached)}
    assert grow_d == {ONE}  # only the kept output itself
    # attached: the output, and what its graph keeps: that forward's input and 15 block outputs
    assert grow_a == {ONE + ONE + (2 * DEPTH - 1) * ONE}


def test_budget_reports_out_of_memory() -> None:
    r = run(stack, inputs, None, BASE.with_(budget=1_000_000))
    assert r.oom and "exceeds the budget" in (r.error or "")
    assert r.report is not None and r.report.peak_allocated > 1_000_000
    assert not run(stack, inputs, None, BASE.with_(budget=10**10)).oom


def test_the_users_model_is_left_as_it_was() -> None:
    model = stack()
    model.eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    for config in (BASE, BASE.with_(checkpoint="auto"), BASE.with_(amp="bf16")):
        run(lambda: model, inputs, None, config)
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert not model.training and all(not m.training for m in model.modules())
    assert all("forward" not in m.__dict__ for m in model.modules())
    assert all(p.grad is None for p in model.parameters())


def test_the_model_is_restored_when_the_run_fails() -> None:
    model = stack()

    def bad_loss(out: torch.Tensor) -> torch.Tensor:
        return out  # not a scalar

    with pytest.raises(WhatIfError, match="scalar"):
        run(lambda: model, inputs, bad_loss, BASE.with_(checkpoint="auto"))
    assert all("forward" not in m.__dict__ for m in model.modules())
    assert model.training


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"model_fn": lambda: 1 / 0}, "model_fn raised ZeroDivisionError"),
        ({"model_fn": lambda: "not a model"}, "nn.Module"),
        ({"input_fn": lambda b: torch.randn(b, WIDTH, device="meta")}, "is on meta"),
        ({"model_fn": lambda: stack().requires_grad_(False)}, "no trainable parameters"),
        ({"config": BASE.with_(checkpoint=("nope",))}, "No module 'nope'"),
        ({"loss_fn": lambda out: out}, "scalar tensor"),
    ],
)
def test_bad_input_is_one_clear_error(kwargs: dict, message: str) -> None:  # type: ignore[type-arg]
    args = {"model_fn": stack, "input_fn": inputs, "loss_fn": None, "config": BASE} | kwargs
    with pytest.raises(WhatIfError, match=message) as info:
        run(**args)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"amp": "fp8"}, "amp='fp8'"),
        ({"batch_size": 10, "accumulation": 4}, "divisible"),
        ({"batch_size": 0}, "batch_size"),
        ({"mode": "no_grad", "retention": "attached"}, "mode='train'"),
        ({"checkpoint": "sometimes"}, "checkpoint"),
    ],
)
def test_bad_configuration(changes: dict, message: str) -> None:  # type: ignore[type-arg]
    with pytest.raises(WhatIfError, match=message):
        RunConfig(**changes)


def test_result_to_dict() -> None:
    d = measure(BASE).to_dict()
    assert d["config"] == "train, batch 64, adam" and d["oom"] is False
    assert d["report"]["categories"]["highest"]["activation"] == 2 * DEPTH * ONE


def test_the_first_run_in_a_process_frees_its_model_at_once() -> None:
    # PyTorch's first optimizer imports torch._dynamo, and the import keeps the frames on the
    # stack in a reference cycle: a run must not be one of them, or its model would stay in
    # memory until Python's collector runs (here: never, it is off)
    import subprocess
    import sys

    code = (
        "import gc, weakref, torch\n"
        "from torch import nn\n"
        "from memlab.whatif import RunConfig, run\n"
        "gc.disable()\n"
        "refs = []\n"
        "def model_fn():\n"
        "    m = nn.Linear(64, 64); refs.append(weakref.ref(m)); return m\n"
        "run(model_fn, lambda b: torch.randn(b, 64), None, RunConfig(device='cpu', batch_size=4))\n"
        "print(refs[0]() is None)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "True"


class Dictionary(nn.Module):
    """Returns a mapping, as Hugging Face models do: logits, and a loss when given labels."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> dict:
        logits = self.body(x)
        out = {"logits": logits}
        if labels is not None:
            out["loss"] = (logits * labels).sum()
        return out


def test_a_model_that_returns_a_mapping_trains_on_its_own_loss_or_its_first_tensor() -> None:
    config = RunConfig(batch_size=8, optimizer="sgd", device="cpu")
    plain = run(Dictionary, lambda b: torch.randn(b, 16), None, config)
    assert plain.report is not None and plain.error is None  # the logits' mean square
    given = run(Dictionary, lambda b: (torch.randn(b, 16), torch.randn(b, 16)), None, config)
    assert given.report is not None and given.error is None
    # the mean square saves the logits for backward; the model's own loss saves the labels,
    # which are the run's input, not an activation
    acts = [r.report.breakdown.highest.get(Category.ACTIVATION, 0) for r in (plain, given)]  # type: ignore[union-attr]
    assert acts == [8 * 16 * 4, 0]
    # a mapping from input_fn is the model's keyword arguments, as for a Hugging Face model
    by_name = run(
        Dictionary, lambda b: {"x": torch.randn(b, 16), "labels": torch.randn(b, 16)}, None, config
    )
    assert by_name.report is not None and by_name.error is None
    assert by_name.report.breakdown.highest.get(Category.ACTIVATION, 0) == 0  # type: ignore[union-attr]
    assert by_name.report.breakdown.highest[Category.INPUT] == 2 * 8 * 16 * 4  # type: ignore[union-attr]
    # outputs kept detached: a mapping of detached tensors, no graph
    kept = run(Dictionary, lambda b: torch.randn(b, 16), None, config.with_(retention="detached"))
    assert kept.report is not None and kept.error is None


def test_an_fp16_warm_up_that_overflows_is_repeated_until_the_optimizer_steps() -> None:
    # at the scaler's initial scale (65536) these gradients overflow float16: the scaler skips
    # the optimizer's step, which would leave the measured step without the optimizer's state
    def model_fn() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1))

    def loss_fn(out: torch.Tensor) -> torch.Tensor:
        return out.float().pow(2).mean() * 64

    config = RunConfig(batch_size=8, amp="fp16", device="cpu")
    r = run(model_fn, lambda b: torch.ones(b, 64), loss_fn, config)
    assert r.report is not None and r.report.breakdown is not None
    state = r.report.breakdown.highest.get(Category.OPTIMIZER_STATE, 0)
    params = list(model_fn().parameters())
    # Adam's two moments, and a float32 step counter per parameter
    assert state == 2 * sum(p.numel() * 4 for p in params) + 4 * len(params)
