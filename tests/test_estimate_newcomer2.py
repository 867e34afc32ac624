"""Estimates that follow the CPU's attention kernel, refuse positions past a learned position
table, and take a float number of bytes for ``gpu``."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

from memlab import whatif
from memlab.estimate import estimate
from memlab.estimate.gpus import GiB, gpu
from memlab.step import WhatIfError

transformers = pytest.importorskip("transformers")

B, T, D, H = 4, 32, 64, 4


class Attention(nn.Module):
    """One causal SDPA layer: 4 query heads of 16, and as many key/value heads or (GQA) half."""

    def __init__(self, gqa: bool, mask: bool) -> None:
        super().__init__()
        self.gqa, self.mask = gqa, mask
        self.q = nn.Linear(D, D)
        self.kv = nn.Linear(D, D if gqa else 2 * D)
        self.o = nn.Linear(D, 8)

    def forward(self, x: torch.Tensor) -> Any:
        q = self.q(x).view(B, T, H, D // H).transpose(1, 2)
        k, v = self.kv(x).view(B, T, 2, H // 2 if self.gqa else H, D // H).permute(2, 0, 3, 1, 4)
        if self.mask:  # a boolean mask, which SDPA turns into a float one of the query's dtype
            keep = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
            a = F.scaled_dot_product_attention(q, k, v, attn_mask=keep, enable_gqa=self.gqa)
        else:
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.gqa)
        return self.o(a.transpose(1, 2).reshape(B, T, D))


def _activations(report: Any) -> int:
    return int(report.to_dict()["categories"]["highest"]["activation"])


def _estimate_and_cpu_run(model_fn: Any, input_fn: Any, **kw: Any) -> tuple[int, int]:
    real = whatif.run(model_fn, input_fn, batch_size=B, **kw).report
    predicted = estimate(
        model_fn, input_fn, batch_size=B, gpu=None, workspace=0, cuda_kernels=False, **kw
    )
    return _activations(predicted.report), _activations(real)


@pytest.mark.parametrize(("gqa", "mask"), [(False, False), (True, False), (False, True)])
def test_cpu_kernels_take_the_cpus_attention_kernel(gqa: bool, mask: bool) -> None:
    # the CPU's flash kernel keeps q, k, v (unrepeated with GQA), the output and a log-sum-exp;
    # meta's math path kept the (B, H, T, T) scores and softmax as well
    predicted, real = _estimate_and_cpu_run(
        lambda: Attention(gqa, mask), lambda n: torch.randn(n, T, D)
    )
    assert predicted == real


def _ids(n: int, seq: int = 16, vocab: int = 1000) -> dict[str, torch.Tensor]:
    x = torch.randint(0, vocab, (n, seq))
    return {"input_ids": x, "labels": x}


def _llama(positions: int = 128) -> Any:
    config = transformers.LlamaConfig(
        num_hidden_layers=1,
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=1000,
        max_position_embeddings=positions,
        attn_implementation="sdpa",
    )
    return transformers.LlamaForCausalLM(config)


def test_cpu_kernels_match_a_cpu_run_of_a_hugging_face_sdpa_model() -> None:
    predicted, real = _estimate_and_cpu_run(_llama, _ids)
    assert predicted == real


def _gpt2(positions: int = 128, vocab: int = 1000) -> Any:
    config = transformers.GPT2Config(
        n_layer=1, n_embd=64, n_head=2, n_positions=positions, vocab_size=vocab
    )
    return transformers.GPT2LMHeadModel(config)


@pytest.mark.parametrize("vocab", [1000, 128])  # 128: as many tokens as positions
def test_a_sequence_past_a_learned_position_table_is_refused(vocab: int) -> None:
    with pytest.raises(WhatIfError) as e:
        estimate(lambda: _gpt2(128, vocab), lambda n: _ids(n, 256, vocab), batch_size=1, gpu="T4")
    said = str(e.value)
    assert "256 tokens" in said and "128 rows" in said and "config.n_positions=128" in said
    assert "transformer.wpe" in said and "at most 128 tokens" in said


def test_sequences_within_the_tables_run_and_say_indices_are_unchecked() -> None:
    # as many tokens as positions: the token table is not taken for the position table
    e = estimate(lambda: _gpt2(128, 128), lambda n: _ids(n, 128, 128), batch_size=1, gpu="T4")
    assert e.fits()
    notes = " ".join(e.report.notes)
    assert "every embedding index within its table's rows" in notes
    assert "(not checked on meta)" in notes


def test_rope_models_are_not_refused_past_max_position_embeddings() -> None:
    # Llama computes its positions (RoPE): a longer sequence runs on a CPU, and is estimated
    real = whatif.run(lambda: _llama(64), lambda n: _ids(n, 96), batch_size=1)
    assert real.error is None
    e = estimate(lambda: _llama(64), lambda n: _ids(n, 96), batch_size=1, gpu="T4")
    assert e.fits()


def test_a_plain_embedding_lookup_gets_the_note() -> None:
    e = estimate(
        lambda: nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 1)),
        lambda n: torch.full((n, 3), 50),
        batch_size=2,
        gpu="T4",
    )
    assert any("embedding index" in n for n in e.report.notes)


def test_gpu_takes_a_float_that_is_a_whole_number_of_bytes() -> None:
    size = 16.5 * 2**30
    card = gpu(size)
    assert card is not None and card.memory == 33 * GiB // 2
    assert isinstance(card.memory, int)
    e = estimate(lambda: nn.Linear(8, 8), lambda n: torch.randn(n, 8), batch_size=2, gpu=size)
    assert e.gpu is not None and e.gpu.memory == 33 * GiB // 2
    for bad in (size + 0.5, float("inf"), float("nan")):
        with pytest.raises(ValueError, match=r"not a whole number of bytes.*'16\.5GiB'"):
            gpu(bad)


def _prompt(n: int, tokens: int = 20) -> torch.Tensor:
    return torch.randint(0, 100, (n, tokens))


@pytest.mark.parametrize("how", ["estimate", "cpu"])
def test_a_generation_past_a_learned_position_table_is_refused_alike(how: str) -> None:
    # 20 tokens of prompt and 20 new ones feed 39 positions to a table of 32: the CPU's lookup
    # fails (explained); on meta nothing fails, and the estimate refuses it before it runs
    kw: dict[str, Any] = {"mode": "generate", "new_tokens": 20, "batch_size": 2}
    with pytest.raises(WhatIfError) as e:
        if how == "estimate":
            estimate(lambda: _gpt2(32).eval(), _prompt, gpu="T4", **kw)
        else:
            whatif.run(lambda: _gpt2(32).eval(), _prompt, **kw)
    said = str(e.value)
    assert "feeds the model 39 tokens" in said and "past the 32 positions" in said
    assert "new_tokens ≤ 13" in said
    within = estimate(lambda: _gpt2(32).eval(), _prompt, gpu="T4", **{**kw, "new_tokens": 13})
    assert within.fits()


def test_a_rope_model_generates_past_max_position_embeddings_in_an_estimate() -> None:
    kw: dict[str, Any] = {"mode": "generate", "new_tokens": 20, "batch_size": 2}
    assert whatif.run(lambda: _llama(32).eval(), _prompt, **kw).error is None
    assert estimate(lambda: _llama(32).eval(), _prompt, gpu="T4", **kw).fits()


def test_whispers_position_tables_are_found() -> None:
    from memlab.step.tables import position_tables

    config = transformers.WhisperConfig(
        d_model=32,
        encoder_layers=1,
        decoder_layers=1,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=32,
        decoder_ffn_dim=32,
        num_mel_bins=8,
        max_source_positions=16,
        max_target_positions=24,
        vocab_size=100,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        decoder_start_token_id=1,
    )
    found = {
        (field, n)
        for _, field, n in position_tables(
            transformers.WhisperForConditionalGeneration(config)
        ).values()
    }
    assert found == {("max_source_positions", 16), ("max_target_positions", 24)}
