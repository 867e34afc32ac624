"""The key/value cache's bytes against the formula 2 x layers x kv_heads x head_dim x bytes x
tokens x batch, worked out here from each model's own config: Hugging Face's static cache
(room for the prompt and every new token from the prefill on) and layers with a sliding window
(at most ``window`` tokens kept)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from memlab.core.categories import Category
from memlab.estimate import estimate
from memlab.step import RunConfig, StepHooks, WhatIfError, run

transformers = pytest.importorskip("transformers")

VOCAB, PROMPT, NEW, BATCH = 500, 20, 6, 3
TOKENS = PROMPT + NEW - 1  # the last new token is never fed back (generate()'s max_length - 1)
GENERATE = RunConfig(mode="generate", new_tokens=NEW, batch_size=BATCH, device="cpu")
SMALL = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128)


def llama() -> nn.Module:
    return transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            num_hidden_layers=3, vocab_size=VOCAB, max_position_embeddings=64,
            attn_implementation="eager", **SMALL,
        )
    )  # fmt: skip


def mistral() -> nn.Module:  # every layer slides over 8 tokens
    return transformers.MistralForCausalLM(
        transformers.MistralConfig(
            num_hidden_layers=2, vocab_size=VOCAB, max_position_embeddings=64, sliding_window=8,
            attn_implementation="eager", **SMALL,
        )
    )  # fmt: skip


def qwen2() -> nn.Module:  # the first two layers see every token, the last two slide over 8
    return transformers.Qwen2ForCausalLM(
        transformers.Qwen2Config(
            num_hidden_layers=4, vocab_size=VOCAB, max_position_embeddings=64, sliding_window=8,
            use_sliding_window=True, max_window_layers=2, attn_implementation="eager", **SMALL,
        )
    )  # fmt: skip


def prompt(batch: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, PROMPT))


def per_token_layer(model: nn.Module) -> int:
    """2 x kv_heads x head_dim x 4 bytes (float32): one token of one layer, keys and values."""
    c: Any = model.config
    return 2 * c.num_key_value_heads * (c.hidden_size // c.num_attention_heads) * 4


def kv_at_end(config: RunConfig, build: Any) -> tuple[int, int]:
    report = run(build, prompt, None, config).report
    assert report is not None and report.breakdown is not None
    b = report.breakdown
    return b.at_end[Category.KV_CACHE], b.highest[Category.KV_CACHE]


def test_a_static_cache_takes_every_token_s_room_up_front() -> None:
    model = llama()
    want = model.config.num_hidden_layers * per_token_layer(model) * TOKENS * BATCH
    config = GENERATE.with_(cache="static")
    report = run(llama, prompt, None, config).report
    assert report is not None and report.breakdown is not None
    assert report.breakdown.at_end[Category.KV_CACHE] == want
    # allocated whole in the prefill, never grown nor copied: its highest is its size
    assert report.breakdown.highest[Category.KV_CACHE] == want
    assert "static cache" in config.describe()
    note = next(n for n in report.notes if n.startswith("KV cache (static):"))
    assert f"{want:,} B for {TOKENS} tokens x {BATCH} sequences" in note
    # a dynamic cache ends the same size, copied as it grows (its highest holds two copies)
    at_end, highest = kv_at_end(GENERATE, llama)
    assert at_end == want and highest > want


def test_a_static_cache_estimates_as_a_cpu_run_measures() -> None:
    config = GENERATE.with_(cache="static")
    predicted = estimate(
        llama, prompt, None, config.with_(device=None), gpu=None, workspace=0,
        cuda_kernels=False,
    )  # fmt: skip
    real = run(llama, prompt, None, config, hooks=StepHooks(foreach=True)).report
    assert real is not None and predicted.tensors.breakdown is not None
    assert real.breakdown is not None
    assert predicted.tensors.peak_allocated == real.peak_allocated
    kv = Category.KV_CACHE
    assert predicted.tensors.breakdown.at_end[kv] == real.breakdown.at_end[kv]


SLIDING = pytest.mark.skipif(
    not hasattr(transformers.cache_utils, "DynamicSlidingWindowLayer"),
    reason="transformers before 4.56 keep every token in a dynamic cache",
)


@SLIDING
@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_sliding_window_layers_keep_at_most_the_window(cache: str) -> None:
    window = 8
    model = mistral()
    want = model.config.num_hidden_layers * per_token_layer(model) * min(window, TOKENS) * BATCH
    at_end, _ = kv_at_end(GENERATE.with_(cache=cache), mistral)
    assert at_end == want
    # grouped layers: two see every token, two keep the window
    model = qwen2()
    want = per_token_layer(model) * (2 * TOKENS + 2 * min(window, TOKENS)) * BATCH
    report = run(qwen2, prompt, None, GENERATE.with_(cache=cache)).report
    assert report is not None and report.breakdown is not None
    assert report.breakdown.at_end[Category.KV_CACHE] == want
    note = next(n for n in report.notes if n.startswith("KV cache"))
    assert f"2 of 4 layers keep a sliding window of 8 tokens: {want:,} B by the formula" in note
    # no bytes per token from the total: the windows bound it (the formula's is a token's)
    assert "bounded by sliding windows" in note and " B per token" not in note
    assert f"= {per_token_layer(model) * 4:,} B a token)" in note  # (4 layers)


def test_cache_settings_say_what_to_pass() -> None:
    with pytest.raises(WhatIfError, match="cache must be 'dynamic' or 'static', not 'paged'"):
        RunConfig(mode="generate", cache="paged")
    with pytest.raises(WhatIfError, match="cache='static' is the key/value cache of a generation"):
        RunConfig(cache="static")

    class Plain(nn.Module):
        def forward(self, tokens: torch.Tensor, cache: Any) -> Any:
            return tokens.float(), cache

    with pytest.raises(WhatIfError, match="not a Hugging Face one"):
        run(Plain, prompt, None, GENERATE.with_(cache="static"))
