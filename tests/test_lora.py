"""Fine-tuning with LoRA adapters through ``peft``: the frozen base weights get no gradients
and no optimizer state; the adapters get both. Checked against the adapters' own sizes."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from memlab.core.categories import Category
from memlab.estimate import estimate
from memlab.step import RunConfig, StepHooks, run

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

VOCAB = 500


def adapted() -> nn.Module:
    base = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=128, vocab_size=VOCAB, max_position_embeddings=64,
            attn_implementation="eager",
        )
    )  # fmt: skip
    config = peft.LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"])
    return peft.get_peft_model(base, config)


def tokens(batch: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, VOCAB, (batch, 32))
    return {"input_ids": ids, "labels": ids}


def test_only_the_adapters_have_gradients_and_optimizer_state() -> None:
    model = adapted()
    trainable = [p for p in model.parameters() if p.requires_grad]
    frozen = [p for p in model.parameters() if not p.requires_grad]
    assert trainable and frozen
    adapter_bytes = sum(p.numel() * p.element_size() for p in trainable)
    all_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    result = run(lambda: model, tokens, None, RunConfig(batch_size=2, device="cpu"))
    assert result.report is not None and result.report.breakdown is not None
    b = result.report.breakdown
    # Adam: two moments per adapter tensor, and its step counter (a float32 scalar on the CPU)
    assert b.at_end[Category.OPTIMIZER_STATE] == 2 * adapter_bytes + 4 * len(trainable)
    assert b.highest[Category.GRADIENT] == adapter_bytes  # none for the frozen base
    assert b.at_end[Category.PARAMETER] == all_bytes


def test_an_adapted_model_estimates_on_meta_as_a_cpu_run_measures() -> None:
    config = RunConfig(batch_size=2, optimizer="sgd_momentum")
    predicted = estimate(adapted, tokens, None, config, gpu=None, workspace=0, cuda_kernels=False)
    real = run(adapted, tokens, None, config.with_(device="cpu"), hooks=StepHooks(foreach=True))
    assert real.report is not None
    # the CPU run also makes transformers' packed-sequence check's few integer tensors
    assert 0 <= real.report.peak_allocated - predicted.tensors.peak_allocated <= 3 * 2 * 32 * 8
    assert predicted.tensors.breakdown is not None and real.report.breakdown is not None
    got: Any = predicted.tensors.breakdown.at_end
    assert got[Category.OPTIMIZER_STATE] == real.report.breakdown.at_end[Category.OPTIMIZER_STATE]
