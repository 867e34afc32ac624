"""`fit_generation`: the largest batch at a context and the longest context at a batch on a
GPU, checked against direct estimates at the edge (fits at N, not at N + 1), and the cache's
bytes against the formula from the model's own config."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch
from torch import nn

from memlab.estimate import estimate, fit_generation
from memlab.estimate.fit_result import GenerationFit
from memlab.step import RunConfig, WhatIfError

transformers = pytest.importorskip("transformers")

MiB = 1024**2
NEW = 2
GPU = 512 * MiB + 160 * MiB  # 160 MiB left after the CUDA context allowance
# many thin layers: the cache (summed over layers) outgrows the prefill's attention (one
# layer's at a time), so the search follows the cache's growth
LAYERS, HEADS, KV_HEADS, HIDDEN = 8, 1, 1, 128


def llama(layers: int = LAYERS) -> nn.Module:
    return transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            num_hidden_layers=layers, hidden_size=HIDDEN, num_attention_heads=HEADS,
            num_key_value_heads=KV_HEADS, intermediate_size=128, vocab_size=1000,
            max_position_embeddings=8192,
        )
    )  # fmt: skip


#: 2 (keys and values) x layers x kv_heads x head_dim x 4 bytes: one token of one sequence
PER_TOKEN = 2 * LAYERS * KV_HEADS * (HIDDEN // HEADS) * 4


def fits(batch: int, context: int, layers: int = LAYERS, gpu: int = GPU) -> bool:
    e = estimate(
        lambda: llama(layers), lambda b: torch.zeros(b, context - NEW, dtype=torch.long), None,
        RunConfig(mode="generate", new_tokens=NEW, batch_size=batch), gpu=gpu,
    )  # fmt: skip
    return e.fits()


def test_the_largest_batch_at_a_context_fits_and_one_more_does_not() -> None:
    fit = fit_generation(llama, gpu=GPU, context=1024, new_tokens=NEW)
    assert fit.searched == "batch" and fit.batch >= 2
    assert fits(fit.batch, 1024) and not fits(fit.batch + 1, 1024)
    assert fit.cache_per_token == PER_TOKEN
    assert fit.cache_bytes == PER_TOKEN * (1024 - 1) * fit.batch  # the last token not fed back
    assert fit.estimates <= 8  # a line and the edge, not a walk
    assert fit.peak is not None and fit.next_peak is not None
    assert fit.peak <= fit.usable < fit.next_peak


def test_a_16_bit_cache_is_modelled_and_leaves_room_for_more_sequences() -> None:
    half = fit_generation(llama, gpu=GPU, context=1024, new_tokens=NEW, cache_dtype="bf16")
    assert half.cache_per_token == PER_TOKEN // 2
    assert half.cache_bytes == PER_TOKEN // 2 * (1024 - 1) * half.batch
    assert not fits(half.batch, 1024)  # with the model's float32 cache it would not fit
    assert half.peak is not None and half.peak <= half.usable
    assert "modelled" in str(half)


def test_the_longest_context_at_a_batch_fits_and_one_more_token_does_not() -> None:
    # four layers (each estimate a quarter of the sixteen's time) on a card they fill at a
    # few hundred tokens
    layers, gpu = 4, 512 * MiB + 64 * MiB
    fit = fit_generation(lambda: llama(layers), gpu=gpu, batch=8, new_tokens=NEW)
    assert fit.searched == "context" and fit.context > 64
    assert fits(8, fit.context, layers, gpu) and not fits(8, fit.context + 1, layers, gpu)
    assert fit.cache_bytes == PER_TOKEN // LAYERS * layers * (fit.context - 1) * 8


def test_fit_generation_says_what_to_pass() -> None:
    with pytest.raises(WhatIfError, match=r"pass context=N .* or batch=B"):
        fit_generation(llama, gpu=GPU)
    with pytest.raises(WhatIfError, match=r"pass context=N .* or batch=B"):
        fit_generation(llama, gpu=GPU, context=64, batch=2)
    with pytest.raises(WhatIfError, match=r"cache_dtype must be one of 'fp32', .*not 'int4'"):
        fit_generation(llama, gpu=GPU, batch=2, cache_dtype="int4")
    with pytest.raises(WhatIfError, match="context=2 leaves no prompt: pass at least 3"):
        fit_generation(llama, gpu=GPU, context=2, new_tokens=NEW)

    class Plain(nn.Module):
        def forward(self, tokens: torch.Tensor, cache: Any) -> Any:
            return tokens.float(), cache

    with pytest.raises(WhatIfError, match="cannot size its cache"):
        fit_generation(Plain, gpu=GPU, batch=2, cache_dtype="bf16")


def a_fit(gpu: str = "L4 (24 GiB)") -> GenerationFit:
    return GenerationFit(
        gpu=gpu, usable=23 * 1024 * MiB, searched="batch", batch=12, context=4096,
        new_tokens=16, peak=22 * 1024 * MiB, next_peak=24 * 1024 * MiB, limit=1 << 16,
        cache_per_token=128 * 1024, cache_bytes=6 * 1024 * MiB, cache_dtype="bf16",
        estimates=5, config="generate 16 tokens, batch 12",
    )  # fmt: skip


def test_the_fit_keeps_the_report_protocol(golden: Any) -> None:
    fit = a_fit()
    assert json.loads(json.dumps(fit.to_dict())) == fit.to_dict()
    assert fit.to_dict()["answer"] == 12
    html = fit._repr_html_()
    assert html.startswith('<div class="memlab memlab-generation-fit" style=')
    assert 'title="6,442,450,944 B"' in html
    golden("generation_fit.txt", str(fit) + "\n")
    golden("generation_fit.html", html + "\n")
    evil = a_fit('<script>alert("x")</script>')._repr_html_()
    assert "<script>" not in evil and "&lt;script&gt;" in evil


def test_cache_dtype_on_a_state_space_model_says_there_is_nothing_to_rescale() -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.MambaConfig(
        vocab_size=100, hidden_size=32, num_hidden_layers=2, state_size=8
    )
    with pytest.raises(
        WhatIfError,
        match=r"cache_dtype: MambaForCausalLM's cache keeps a state of fixed size .* leave "
        r"cache_dtype out",
    ):
        fit_generation(
            lambda: transformers.MambaForCausalLM(config),
            None,
            "24GiB",
            context=16,
            new_tokens=4,
            cache_dtype="bf16",
        )
