"""Quantized base weights (``RunConfig(base_weights=...)``): the frozen base Linear layers hold
bitsandbytes' storage bytes, counted from the test's own formula over the model's parameters;
the forward dequantizes (its temporary counted), the model is put back after the run."""

from __future__ import annotations

import math
import time

import pytest
import torch
from torch import nn

from memlab.core.categories import Category
from memlab.estimate import estimate
from memlab.region import track
from memlab.step import RunConfig, WhatIfError, run
from memlab.step.quantized import CHUNK, QuantizedLinear

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

VOCAB = 500
KINDS = ("int8", "nf4", "nf4_double")


def llama(layers: int = 2, hidden: int = 64, inter: int = 128, vocab: int = VOCAB) -> nn.Module:
    return transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            num_hidden_layers=layers, hidden_size=hidden, num_attention_heads=4,
            num_key_value_heads=2, intermediate_size=inter, vocab_size=vocab,
            max_position_embeddings=64, attn_implementation="eager",
        )
    )  # fmt: skip


def adapted() -> nn.Module:
    config = peft.LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"])
    return peft.get_peft_model(llama(), config)


def tokens(batch: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, VOCAB, (batch, 32))
    return {"input_ids": ids, "labels": ids}


def expected_bytes(model: nn.Module, kind: str) -> int:
    """Parameter bytes with the frozen base Linear layers (not lm_head) in bitsandbytes'
    layout: NF4 two codes a byte, a float32 absmax per 64 and 16 float32 code values a layer;
    double quantization a byte per 64 and a float32 per 256 of those, one 256-entry map;
    LLM.int8 a byte an element and a float32 per output row."""
    total, shared = 0, 0
    quantized = set()
    for name, m in model.named_modules():
        if type(m) is nn.Linear and not m.weight.requires_grad and not name.endswith("lm_head"):
            quantized.add(id(m.weight))
            n, rows = m.weight.numel(), m.weight.shape[0]
            blocks = -(-n // 64)
            if kind == "int8":
                total += n + 4 * rows
            elif kind == "nf4":
                total += -(-n // 2) + 4 * blocks + 64
            else:
                total += -(-n // 2) + blocks + 4 * -(-blocks // 256) + 64
                shared = 1024
    rest = sum(p.numel() * p.element_size() for p in model.parameters() if id(p) not in quantized)
    assert quantized
    return total + shared + rest


@pytest.mark.parametrize("kind", KINDS)
def test_the_base_weights_take_bitsandbytes_bytes_measured_and_predicted(kind: str) -> None:
    model = adapted()
    want = expected_bytes(model, kind)
    adapters = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    config = RunConfig(batch_size=2, optimizer="sgd", base_weights=kind)
    real = run(lambda: model, tokens, None, config.with_(device="cpu"))
    assert real.report is not None and real.report.breakdown is not None
    b = real.report.breakdown
    assert b.at_end[Category.PARAMETER] == want
    assert b.highest[Category.GRADIENT] == adapters  # the quantized base has none
    assert any("modelled" in n and kind in n for n in real.report.notes)
    predicted = estimate(adapted, tokens, None, config, gpu=None, workspace=0, cuda_kernels=False)
    assert predicted.tensors.breakdown is not None
    assert predicted.tensors.breakdown.at_end[Category.PARAMETER] == want
    assert "modelled" in predicted.text()  # the display says so


def test_the_model_is_put_back_after_the_run() -> None:
    model = adapted()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    kinds = {name: type(m) for name, m in model.named_modules()}
    run(lambda: model, tokens, None, RunConfig(batch_size=2, device="cpu", base_weights="nf4"))
    assert {name: type(m) for name, m in model.named_modules()} == kinds
    after = model.state_dict()
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)


@pytest.mark.parametrize(
    ("kind", "tolerance"), [("int8", 0.02), ("nf4", 0.15), ("nf4_double", 0.15)]
)
def test_the_quantized_layer_computes_what_the_linear_did(kind: str, tolerance: float) -> None:
    torch.manual_seed(0)
    linear = nn.Linear(256, 96).requires_grad_(False)
    q = QuantizedLinear(linear, kind, nn.Parameter(_map(), requires_grad=False))
    x = torch.randn(8, 256, requires_grad=True)
    want, got = linear(x), q(x)
    assert ((got - want).norm() / want.norm()).item() < tolerance
    got.sum().backward()  # the input's gradient through the dequantized weight
    assert x.grad is not None
    ref = linear.weight.sum(0).expand(8, -1)
    assert ((x.grad - ref).norm() / ref.norm()).item() < tolerance


def _map() -> torch.Tensor:
    from memlab.step.quantized import linear_map

    return linear_map(torch.device("cpu"))


@pytest.mark.parametrize("kind", ["nf4", "int8"])
def test_the_forward_holds_the_dequantized_weight_for_a_while(kind: str) -> None:
    linear = nn.Linear(512, 384).requires_grad_(False)
    q = QuantizedLinear(linear, kind)
    x = torch.randn(1, 512)
    n = 512 * 384
    with torch.no_grad(), track("cpu") as region:
        y = q(x)
    rise = region.report.peak_allocated - region.report.allocated_before
    assert rise >= n * 4  # the float32 weight, dequantized
    # and little besides: the output, the index of one chunk, the code table
    assert rise <= n * 4 + y.numel() * 4 + 4 * min(CHUNK, n // 2) + 8192


def test_a_model_with_nothing_frozen_is_refused_in_training() -> None:
    with pytest.raises(WhatIfError, match=r"base_weights='nf4'.*freeze the base"):
        run(llama, tokens, None, RunConfig(batch_size=2, device="cpu", base_weights="nf4"))


def test_a_forward_quantizes_every_linear_but_the_head() -> None:
    model = llama()
    want = expected_bytes(model.requires_grad_(False), "nf4")
    model.requires_grad_(True)  # nothing frozen: in a forward, every Linear is the base
    config = RunConfig(batch_size=2, device="cpu", mode="no_grad", base_weights="nf4")
    real = run(lambda: model, lambda b: torch.randint(0, VOCAB, (b, 32)), None, config)
    assert real.report is not None and real.report.breakdown is not None
    assert real.report.breakdown.at_end[Category.PARAMETER] == want


def test_a_bad_value_names_the_argument() -> None:
    with pytest.raises(WhatIfError, match="base_weights='fp8' is not one of"):
        RunConfig(base_weights="fp8")
    assert RunConfig(base_weights="nf4").to_dict()["base_weights"] == "nf4"
    assert "base weights nf4" in RunConfig(base_weights="nf4").describe()


@pytest.mark.slow
def test_an_8b_qlora_step_estimates_on_a_laptop() -> None:
    """Its time is a benchmark's (benchmarks/bench_llm.py: 16 s on the 2-core CPU, against a
    minute); here a bound only against a hang, loose enough for a loaded CI machine."""
    config = transformers.LlamaConfig(
        num_hidden_layers=32, hidden_size=4096, num_attention_heads=32, num_key_value_heads=8,
        intermediate_size=14336, vocab_size=128_256, max_position_embeddings=8192,
    )  # fmt: skip

    def model_fn() -> nn.Module:
        base = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
        lora = peft.LoraConfig(r=16, lora_alpha=32, target_modules=["q_proj", "v_proj"])
        return peft.get_peft_model(base, lora)

    def batch(b: int) -> dict[str, torch.Tensor]:
        ids = torch.randint(0, 128_256, (b, 1024))
        return {"input_ids": ids, "labels": ids}

    step = RunConfig(batch_size=1, optimizer="adamw", checkpoint="auto", base_weights="nf4")
    t0 = time.perf_counter()
    e = estimate(model_fn, batch, None, step, gpu="H100 80GB")
    assert time.perf_counter() - t0 < 300
    with torch.device("meta"):
        want = expected_bytes(model_fn(), "nf4")
    assert e.tensors.breakdown is not None
    assert e.tensors.breakdown.at_end[Category.PARAMETER] == want
    assert want < 8 * 2**30 * 0.75  # well under the bf16 model's 15 GiB
    assert math.isfinite(e.peak_allocated) and e.peak_allocated > want


def test_the_panel_toggle() -> None:
    pytest.importorskip("ipywidgets")
    import memlab

    model = adapted()
    want = expected_bytes(model, "nf4_double")
    ex = memlab.Explorer(lambda: model, tokens, config=RunConfig(device="cpu", batch_size=2))
    ex.base_weights.value = True
    r = ex.run()
    assert r is not None and str(r.config.base_weights) == "nf4_double" and r.report is not None
    assert r.report.breakdown is not None
    assert r.report.breakdown.at_end[Category.PARAMETER] == want
