"""A key/value cache kept from one region is a key/value cache in the next (its role lasts, as a
parameter's does): a Hugging Face model built from a config generates in one region, and a
later region that never touches the cache still names its bytes kv_cache."""

from __future__ import annotations

import pytest
import torch
from conftest import TINY_DECODER

import memlab

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("native_on", [True, False])
def test_a_cache_from_an_earlier_region_is_still_a_kv_cache(
    native_on: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MEMLAB_NATIVE", "1" if native_on else "0")
    config = transformers.LlamaConfig(
        vocab_size=100,
        **TINY_DECODER,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    prompt = torch.randint(0, 100, (2, 8))
    with memlab.track("cpu", breakdown=True) as first, torch.no_grad():
        out = model(input_ids=prompt, use_cache=True)
        cache = out.past_key_values
        for _ in range(3):
            tok = out.logits[:, -1:].argmax(-1)
            out = model(input_ids=tok, past_key_values=cache, use_cache=True)
    del out
    # the cache's bytes as the model holds them: 2 layers, keys and values, 2 KV heads of 8
    held = sum(
        t.untyped_storage().nbytes() for layer in cache.layers for t in (layer.keys, layer.values)
    )
    # layers · (keys, values) · KV heads · head dim · fp32 · tokens · batch
    assert held == 2 * 2 * 2 * 8 * 4 * 11 * 2
    assert first.report.breakdown is not None
    assert first.report.breakdown.at_end[memlab.Category.KV_CACHE] == held
    with memlab.track("cpu", breakdown=True) as later:
        torch.ones(10)
    assert later.report.breakdown is not None
    assert later.report.breakdown.at_end.get(memlab.Category.KV_CACHE, 0) == held
