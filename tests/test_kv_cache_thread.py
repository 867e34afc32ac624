"""A key/value cache filled on a thread the region started (``model.generate`` run beside a
streamer, the README's pattern) is named kv_cache, as on the region's own thread; a thread that
was not started inside the region names nothing for it."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch
from conftest import TINY_DECODER

import memlab
from memlab import Category
from memlab.core import kv_caches

transformers = pytest.importorskip("transformers")


def model_and_prompt() -> tuple[Any, torch.Tensor]:
    config = transformers.LlamaConfig(vocab_size=100, **TINY_DECODER, max_position_embeddings=64)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval(), torch.randint(0, 100, (2, 8))


def generate_kept(model: Any, prompt: torch.Tensor, box: dict[str, Any]) -> None:
    with torch.no_grad():
        out = model.generate(
            input_ids=prompt,
            attention_mask=torch.ones_like(prompt),
            max_new_tokens=4,
            min_new_tokens=4,
            do_sample=False,
            return_dict_in_generate=True,
        )
    box["cache"] = out.past_key_values


def cache_bytes(cache: Any) -> int:
    return sum(
        t.untyped_storage().nbytes() for layer in cache.layers for t in (layer.keys, layer.values)
    )


def test_a_cache_filled_on_a_thread_started_in_the_region_is_a_kv_cache(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("MEMLAB_NATIVE", "1")
    model, prompt = model_and_prompt()
    box: dict[str, Any] = {}
    with memlab.track("cpu", breakdown=True) as t:
        worker = threading.Thread(target=generate_kept, args=(model, prompt, box))
        worker.start()
        worker.join()
    assert t._native is not None  # (the native record follows the thread it started)
    held = cache_bytes(box["cache"])
    # layers · (keys, values) · KV heads · head dim · fp32 · tokens (8 + 4 - 1) · batch
    assert held == 2 * 2 * 2 * 8 * 4 * 11 * 2
    b = t.report.breakdown
    assert b is not None and b.at_end[Category.KV_CACHE] == held
    assert kv_caches._MARKS._by == {}  # (nothing left for the thread once the region closed)


def test_a_thread_started_before_the_region_names_nothing_for_it() -> None:
    model, prompt = model_and_prompt()
    box: dict[str, Any] = {}
    go, done = threading.Event(), threading.Event()

    def worker() -> None:
        go.wait(30)
        generate_kept(model, prompt, box)
        done.set()

    thread = threading.Thread(target=worker)
    thread.start()  # before the region: not part of it
    with memlab.track("cpu", breakdown=True) as t:
        go.set()
        assert done.wait(60)
    thread.join()
    b = t.report.breakdown
    assert b is not None and b.at_end.get(Category.KV_CACHE, 0) == 0
