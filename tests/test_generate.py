"""``mode="generate"``: a prompt, then new tokens with a key/value cache. The cache's bytes are
checked against the formula 2 x layers x kv_heads x head_dim x tokens x batch x dtype size, and
the estimate (meta device) against a real CPU run of the same generation."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from memlab.core.categories import Category
from memlab.estimate import estimate
from memlab.step import RunConfig, StepHooks, WhatIfError, run
from memlab.step.generate import kv_cache_bytes

transformers = pytest.importorskip("transformers")

VOCAB, PROMPT, NEW, BATCH = 500, 20, 8, 3


def gpt2() -> nn.Module:  # multi-head attention: as many key/value heads as query heads
    return transformers.GPT2LMHeadModel(
        transformers.GPT2Config(
            n_layer=2, n_embd=64, n_head=4, vocab_size=VOCAB, n_positions=64,
            attn_implementation="eager",
        )
    )  # fmt: skip


def llama() -> nn.Module:  # grouped-query attention: 4 query heads share 2 key/value heads
    return transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            num_hidden_layers=3, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=128, vocab_size=VOCAB, max_position_embeddings=64,
            attn_implementation="eager",
        )
    )  # fmt: skip


def prompt(batch: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, PROMPT))


GENERATE = RunConfig(mode="generate", new_tokens=NEW, batch_size=BATCH)


@pytest.mark.parametrize("build", [gpt2, llama], ids=["gpt2-mha", "llama-gqa"])
def test_the_kv_cache_holds_the_formula_s_bytes(build: Any) -> None:
    result = run(build, prompt, None, GENERATE.with_(device="cpu"))
    report = result.report
    assert report is not None and report.breakdown is not None
    config = build().config
    # the prompt's tokens and one per new token fed back: all but the last, as generate() does
    want = kv_cache_bytes(config, PROMPT + NEW - 1, BATCH, torch.float32)
    assert report.breakdown.at_end[Category.KV_CACHE] == want
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    layers, head_dim = config.num_hidden_layers, config.hidden_size // config.num_attention_heads
    assert want == 2 * layers * heads * head_dim * (PROMPT + NEW - 1) * BATCH * 4
    assert "generate 8 tokens" in result.title
    per_token = kv_cache_bytes(config, 1, 1, torch.float32)
    note = next(n for n in report.notes if n.startswith("KV cache:"))
    formula = (
        f"(formula: {layers} layers x {heads} KV heads x {head_dim} x 2 x 4 B = {per_token:,} B)"
    )
    assert f"{per_token:,} B per token {formula}" in note


@pytest.mark.parametrize("build", [gpt2, llama], ids=["gpt2-mha", "llama-gqa"])
def test_a_generation_estimates_as_a_cpu_run_measures(build: Any) -> None:
    predicted = estimate(build, prompt, None, GENERATE, gpu=None, workspace=0, cuda_kernels=False)
    real = run(build, prompt, None, GENERATE.with_(device="cpu"), hooks=StepHooks(foreach=True))
    assert real.report is not None and real.report.breakdown is not None
    assert predicted.tensors.peak_allocated == real.report.peak_allocated
    assert predicted.tensors.breakdown is not None
    assert predicted.tensors.breakdown.at_peak == real.report.breakdown.at_peak


def test_logits_for_every_prompt_position_cost_their_bytes_in_the_prefill() -> None:
    vocab = 5000  # the logits dominate

    def wide() -> nn.Module:
        return transformers.GPT2LMHeadModel(
            transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=vocab)
        )

    tokens = lambda b: torch.randint(0, vocab, (b, PROMPT))  # noqa: E731
    config = GENERATE.with_(device="cpu")
    last = run(wide, tokens, None, config).report
    every = run(wide, tokens, None, config.with_(logits="all")).report
    assert last is not None and every is not None
    logits = BATCH * PROMPT * vocab * 4  # the prefill's float32 logits for every position
    assert every.peak_allocated - every.allocated_before >= logits
    assert last.peak_allocated - last.allocated_before < logits / 2


class TinyDecoder(nn.Module):
    """Not a Hugging Face model: ``model(tokens, cache) -> (logits, cache)``, the cache one
    tensor of every token's hidden state so far."""

    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.embed, self.head = nn.Embedding(VOCAB, width), nn.Linear(width, VOCAB)

    def forward(self, tokens: torch.Tensor, cache: torch.Tensor | None) -> Any:
        h = self.embed(tokens)
        cache = h if cache is None else torch.cat([cache, h], dim=1)
        return self.head(cache.mean(dim=1, keepdim=True)), cache


def test_a_plain_module_that_takes_and_returns_its_cache() -> None:
    report = run(TinyDecoder, prompt, None, GENERATE.with_(device="cpu")).report
    assert report is not None and report.breakdown is not None
    assert report.breakdown.at_end[Category.KV_CACHE] == BATCH * (PROMPT + NEW - 1) * 32 * 4


class Cacheless(nn.Embedding):
    def __init__(self) -> None:
        super().__init__(VOCAB, 8)

    def forward(self, tokens: torch.Tensor, cache: Any = None) -> Any:  # type: ignore[override]
        return super().forward(tokens)


def test_generate_mode_says_what_it_needs() -> None:
    with pytest.raises(WhatIfError, match="cannot take a step_fn"):
        run(gpt2, prompt, step_fn=lambda m, b: m(b), device="cpu", mode="generate")
    with pytest.raises(WhatIfError, match=r"calls model\(tokens, cache\).*this one refused"):
        run(lambda: nn.Embedding(VOCAB, 8), prompt, device="cpu", mode="generate")
    with pytest.raises(WhatIfError, match=r"expects \(logits, cache\) back, not Tensor"):
        run(lambda: Cacheless(), prompt, device="cpu", mode="generate")
    with pytest.raises(WhatIfError, match="logits must be 'last' or 'all', not 'first'"):
        RunConfig(mode="generate", logits="first")
    with pytest.raises(WhatIfError, match="new_tokens must be a whole number"):
        RunConfig(mode="generate", new_tokens=0)


def test_the_panel_offers_generation_with_its_number_of_tokens() -> None:
    from memlab.panel import Explorer

    ex = Explorer(llama, prompt, config=RunConfig(device="cpu", batch_size=BATCH))
    assert ex.new_tokens.layout.display == "none"  # only generating has new tokens
    ex.mode.value, ex.new_tokens.value = "generate", 5
    assert ex.new_tokens.layout.display == ""
    assert (ex.config.mode, ex.config.new_tokens) == ("generate", 5)
    result = ex.run()
    assert result is not None and result.report is not None
    assert result.report.breakdown is not None
    config = llama().config
    want = kv_cache_bytes(config, PROMPT + 5 - 1, BATCH, torch.float32)
    assert result.report.breakdown.at_end[Category.KV_CACHE] == want


def test_under_autocast_the_note_counts_float32_keys_and_16_bit_values() -> None:
    # Llama's rotary embedding is computed in float32 and multiplies the keys: they leave the
    # projection in bfloat16 and enter the cache in float32; the values stay in bfloat16
    config = GENERATE.with_(device="cpu", amp="bf16")
    report = run(llama, prompt, None, config).report
    assert report is not None and report.breakdown is not None
    c = llama().config
    layers, heads, head_dim = c.num_hidden_layers, c.num_key_value_heads, 64 // 4
    per_token = layers * heads * head_dim * (4 + 2)
    assert report.breakdown.at_end[Category.KV_CACHE] == per_token * (PROMPT + NEW - 1) * BATCH
    note = next(n for n in report.notes if n.startswith("KV cache:"))
    assert f"(4 B keys + 2 B values) = {per_token:,} B)" in note
