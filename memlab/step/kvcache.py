"""The key/value cache of a generation: its size by the formula, Hugging Face's static cache
made for a run, and the note that sets what the run's cache held beside the formula.

The formula: 2 (keys and values) x layers x key/value heads x head size x tokens x batch x the
dtype's size. A layer with a sliding window (``sliding_window`` in the config: every layer of a
Mistral, the ``"sliding_attention"`` entries of ``layer_types`` in a Qwen2 or a Gemma) holds at
most ``window`` tokens: Hugging Face's static cache allocates ``min(window, tokens)``, and its
dynamic cache keeps the last ``window - 1`` tokens as a view of the ``window`` it concatenated,
the same storage (transformers ≥ 4.56; before, a dynamic cache kept every token)."""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

import torch

from memlab.step.config import RunConfig, WhatIfError


def cache_shape(c: Any) -> tuple[int, int, int]:
    """(layers, key/value heads, head size) from a Hugging Face model config; an encoder-
    decoder's are its decoder's (BART's, Whisper's ``decoder_layers``, T5's ``d_kv``)."""
    two = ("decoder_layers", "num_decoder_layers") if getattr(c, "is_encoder_decoder", 0) else ()
    layers = _first(c, *two, "num_hidden_layers", "n_layer", "num_layers")
    heads = _first(
        c, *(("decoder_attention_heads",) if two else ()), "num_attention_heads", "n_head"
    )
    kv_heads = getattr(c, "num_key_value_heads", None) or heads
    head_dim = getattr(c, "head_dim", None) or getattr(c, "d_kv", None)
    head_dim = head_dim or _first(c, "hidden_size", "n_embd") // heads
    return layers, kv_heads, head_dim


def windows(c: Any) -> list[int | None]:
    """Each layer's sliding window (None: the layer attends to every token), from a Hugging
    Face model config: ``layer_types`` where it names them, else ``sliding_window`` for all."""
    layers = cache_shape(c)[0]
    window = getattr(c, "sliding_window", None)
    if not isinstance(window, int) or isinstance(window, bool) or window < 1:
        return [None] * layers
    types = getattr(c, "layer_types", None)
    if isinstance(types, (list, tuple)) and len(types) == layers:
        return [window if t == "sliding_attention" else None for t in types]
    return [window] * layers


def kv_cache_bytes(
    model_config: Any, tokens: int, batch: int, dtype: torch.dtype, sliding: bool = True
) -> int:
    """Bytes of a full key/value cache: 2 (keys and values) x layers x key/value heads x head
    size x ``tokens`` x ``batch`` x the dtype's size, from a Hugging Face model config (grouped-
    query attention: ``num_key_value_heads`` below ``num_attention_heads``). With ``sliding``,
    a layer with a sliding window counts ``min(window, tokens)`` tokens."""
    _, kv_heads, head_dim = cache_shape(model_config)
    size = torch.empty((), dtype=dtype).element_size()
    kept = sum(
        tokens if w is None or not sliding else min(w, tokens) for w in windows(model_config)
    )
    return 2 * kv_heads * head_dim * kept * batch * size


def _two_caches(cache: Any) -> bool:
    return hasattr(cache, "self_attention_cache") and hasattr(cache, "cross_attention_cache")


def _first(config: Any, *names: str) -> int:
    for name in names:
        value = getattr(config, name, None)
        if isinstance(value, int):
            return value
    raise WhatIfError(f"the model config has none of {', '.join(names)}: cannot size its cache.")


def static_cache(model: Any, batch: int, length: int) -> Any:
    """Hugging Face's `StaticCache` for ``batch`` sequences of ``length`` tokens, as
    ``generate(cache_implementation="static")`` makes it: every token's room taken up front
    (transformers 5 allocates it at the prefill's first write, in the keys' dtype and device;
    4.x here, in the model's)."""
    try:
        from transformers import StaticCache
    except ImportError as e:
        raise WhatIfError(
            "cache='static' is Hugging Face's StaticCache, and transformers is not installed "
            "(or has none): pip install transformers, or use cache='dynamic'."
        ) from e
    config: Any = getattr(model, "config", None)
    names = inspect.signature(StaticCache.__init__).parameters
    if "max_batch_size" in names:  # transformers 4.x: allocated here
        p = next(model.parameters())
        return StaticCache(
            config=config, max_batch_size=batch, max_cache_len=length, device=p.device,
            dtype=p.dtype,
        )  # fmt: skip
    return StaticCache(config=config, max_cache_len=length)


def cache_tensors(cache: Any, depth: int = 0) -> list[torch.Tensor]:
    """The tensors a key/value cache holds: in its lists, tuples, mappings and attributes
    (Hugging Face's cache classes keep them in per-layer objects), a few levels deep. A scalar
    (a static layer's count of tokens written) is bookkeeping, not keys or values."""
    if isinstance(cache, torch.Tensor):
        return [cache] if cache.dim() else []
    if depth > 5 or cache is None or isinstance(cache, (str, bytes, int, float, bool)):
        return []
    if isinstance(cache, Mapping):
        items: Any = cache.values()
    elif isinstance(cache, (list, tuple)):
        items = cache
    else:
        items = list(vars(cache).values()) if hasattr(cache, "__dict__") else []
    return [t for item in items for t in cache_tensors(item, depth + 1)]


def cache_note(model: Any, config: RunConfig, cache: Any, tokens: int) -> str:
    """What the finished cache holds per token (of the ``tokens`` the run read and made),
    beside the formula where the model's config gives its shape (a Hugging Face model). Keys
    and values may differ in type: under autocast, rotary embeddings leave the keys in float32
    and the values in 16 bits. An encoder-decoder's cross-attention keys and values (the
    encoder's positions, made once) are said apart from the per-token figure."""
    cross = getattr(cache, "cross_attention_cache", None) if _two_caches(cache) else None
    across = {id(t): t for t in cache_tensors(cross)}
    tensors = [t for i, t in {id(t): t for t in cache_tensors(cache)}.items() if i not in across]
    held = sum(t.untyped_storage().nbytes() for t in tensors)
    if not held or not tokens:
        return "KV cache: none found in what the model returned"
    per_token = held // (tokens * config.batch_size)
    kind = "static " if config.cache == "static" else ""
    text = (
        f"KV cache{' (' + kind.strip() + ')' if kind else ''}: {held:,} B for {tokens} tokens x "
        f"{config.batch_size} sequences, {per_token:,} B per token"
    )
    model_config = getattr(model, "config", None)
    try:
        layers, kv_heads, head_dim = cache_shape(model_config)
    except WhatIfError:
        return text
    k, v = tensors[0].element_size(), tensors[min(1, len(tensors) - 1)].element_size()
    sizes = f"2 x {k} B" if k == v else f"({k} B keys + {v} B values)"
    formula = layers * kv_heads * head_dim * (k + v)
    shape = f"{layers} layers x {kv_heads} KV heads x {head_dim}"
    text += f" (formula: {shape} x {sizes} = {formula:,} B)"
    if across:
        made = sum(t.untyped_storage().nbytes() for t in across.values())
        text += f"; cross-attention (the encoder's positions, made once): {made:,} B more"
    slid = [w for w in windows(model_config) if w is not None]
    if slid and k == v:
        want = kv_cache_bytes(model_config, tokens, config.batch_size, tensors[0].dtype)
        text += (
            f"; {len(slid)} of {layers} layers keep a sliding window of {slid[0]} tokens: "
            f"{want:,} B by the formula with min(window, tokens)"
        )
    return text
