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

from memlab.core._torch_record import storage_address
from memlab.step.config import RunConfig, WhatIfError


def cache_shape(c: Any) -> tuple[int, int, int]:
    """(layers, key/value heads, head size) from a Hugging Face model config; an encoder-
    decoder's are its decoder's (BART's, Whisper's ``decoder_layers``, T5's ``d_kv``)."""
    two = ("decoder_layers", "num_decoder_layers") if getattr(c, "is_encoder_decoder", 0) else ()
    layers = _first(c, *two, "num_hidden_layers", "n_layer", "num_layers")
    heads = _first(
        c, *(("decoder_attention_heads",) if two else ()), "num_attention_heads", "n_head"
    )
    kv_heads = _kv_heads(c) or heads
    head_dim = getattr(c, "head_dim", None) or getattr(c, "d_kv", None)
    head_dim = head_dim or _first(c, "hidden_size", "n_embd") // heads
    return layers, kv_heads, head_dim


def _kv_heads(c: Any) -> int | None:
    """The key/value heads a config declares: ``num_key_value_heads``; Falcon's one shared
    head (``multi_query`` without ``new_decoder_architecture``), else its ``num_kv_heads``."""
    named = getattr(c, "num_key_value_heads", None)
    if isinstance(named, int) and named > 0:
        return named
    if getattr(c, "multi_query", False) is True and not getattr(c, "new_decoder_architecture", 0):
        return 1
    falcon = getattr(c, "num_kv_heads", None)
    return falcon if isinstance(falcon, int) and falcon > 0 else None


def attends(c: Any) -> list[bool]:
    """Whether each layer keeps keys and values a token at a time: every layer, except those
    ``layer_types`` names otherwise (a hybrid model's ``"linear_attention"`` or Mamba layers,
    which keep a state of fixed size: Jamba, Qwen3-Next)."""
    layers = cache_shape(c)[0]
    types = getattr(c, "layer_types", None)
    if not isinstance(types, (list, tuple)) or len(types) != layers:
        return [True] * layers
    return [isinstance(t, str) and "attention" in t and t != "linear_attention" for t in types]


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
    a layer with a sliding window counts ``min(window, tokens)`` tokens; a layer that keeps a
    state instead (`attends`) counts none."""
    _, kv_heads, head_dim = cache_shape(model_config)
    size = torch.empty((), dtype=dtype).element_size()
    kept = sum(
        (tokens if w is None or not sliding else min(w, tokens)) * a
        for w, a in zip(windows(model_config), attends(model_config), strict=True)
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


def _own(cache: Any) -> tuple[list[torch.Tensor], dict[int, torch.Tensor]]:
    """The cache's own tensors (each once), and an encoder-decoder's cross-attention ones."""
    cross = getattr(cache, "cross_attention_cache", None) if _two_caches(cache) else None
    across = {id(t): t for t in cache_tensors(cross)}
    tensors = [t for i, t in {id(t): t for t in cache_tensors(cache)}.items() if i not in across]
    return tensors, across


def held_bytes(cache: Any) -> int:
    """Bytes of the cache's storages, each once, an encoder-decoder's cross-attention part left
    out. A key that is a view of a larger storage (a fused qkv projection's output, queries
    included) keeps all of it alive, so the whole storage is what the cache holds."""
    return _storage_bytes(_own(cache)[0])


def viewed_bytes(cache: Any) -> int:
    """Bytes of the keys and values themselves (elements x size, each storage's views at most
    its size), an encoder-decoder's cross-attention part left out: what grows a token at a
    time, even where the storages around them hold more (`held_bytes`)."""
    seen: dict[int, tuple[int, set[tuple[Any, ...]]]] = {}
    for t in _own(cache)[0]:
        s = t.untyped_storage()
        _, views = seen.setdefault(storage_address(s), (s.nbytes(), set()))
        views.add((t.data_ptr(), tuple(t.shape), t.stride(), t.dtype))
    return sum(
        min(size, sum(_prod(shape) * torch.empty((), dtype=dtype).element_size()
                      for _, shape, _, dtype in views))
        for size, views in seen.values()
    )  # fmt: skip


def _prod(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _storage_bytes(tensors: Any) -> int:
    """Bytes of the tensors' storages, a storage shared by several tensors counted once."""
    sizes = {storage_address(s): s.nbytes() for s in (t.untyped_storage() for t in tensors)}
    return sum(sizes.values())


def cache_note(
    model: Any, config: RunConfig, cache: Any, tokens: int, prefilled: int | None = None
) -> str:
    """What the finished cache holds per token (of the ``tokens`` the run read and made),
    beside the formula where the model's config gives its shape (a Hugging Face model). Keys
    and values may differ in type: under autocast, rotary embeddings leave the keys in float32
    and the values in 16 bits. An encoder-decoder's cross-attention keys and values (the
    encoder's positions, made once) are said apart from the per-token figure. ``prefilled``:
    the keys' and values' bytes after the prefill (`viewed_bytes`); where the decode grew them
    by less than the per-token figure would say (a recurrent or linear-attention layer's state:
    Mamba, Jamba), the state of fixed size is said apart and the per-token figure is the
    growth's. Keys and values that are views of larger storages (a fused qkv output) are
    counted per token by their own bytes, and the rest of those storages said apart."""
    tensors, across = _own(cache)
    held = held_bytes(cache)
    if not held or not tokens:
        return "KV cache: none found in what the model returned"
    batch, model_config = config.batch_size, getattr(model, "config", None)
    try:
        layers, kv_heads, head_dim = cache_shape(model_config)
        slid, attending = [w for w in windows(model_config) if w is not None], attends(model_config)
    except WhatIfError:
        layers, slid, attending = 0, [], []
    # a sliding layer's window is a view of a storage one token longer: said by its own note
    own = held if slid or config.cache == "static" else viewed_bytes(cache)
    state, per_token = _state(config, own, tokens, prefilled, bool(slid))
    kind = "static " if config.cache == "static" else ""
    if state and not per_token:
        text = (
            f"KV cache: {held:,} B for {batch} sequences, a state of fixed size: it did not grow "
            f"over the {config.new_tokens - 1} decode steps ({held // batch:,} B per sequence: a "
            "recurrent or linear-attention layer's state, as Mamba's convolution and SSM "
            "states, not keys and values a token)"
        )
    else:  # (once a sliding window is full, the bytes over all the tokens say nothing a token)
        bounded = bool(slid) and tokens > min(slid)
        text = (
            f"KV cache{' (' + kind.strip() + ')' if kind else ''}: {held:,} B for {tokens} tokens "
            f"x {batch} sequences, "
            + ("bounded by sliding windows" if bounded else f"{per_token:,} B per token")
        )
        if state:
            text += f", and {state:,} B of state that does not grow with tokens (recurrent or "
            text += "linear-attention layers)"
    if held > own:
        text += (
            f"; {held - own:,} B of it are no keys or values: the rest of larger storages that "
            "the cache's tensors are views of (a fused qkv projection's output), alive whole"
        )
    if not layers or not any(attending):
        return text
    k, v = tensors[0].element_size(), tensors[min(1, len(tensors) - 1)].element_size()
    sizes = f"2 x {k} B" if k == v else f"({k} B keys + {v} B values)"
    kept = sum(attending)
    formula = kept * kv_heads * head_dim * (k + v)
    counted = f"{layers} layers" if kept == layers else f"{kept} of {layers} layers"
    text += f" (formula: {counted} x {kv_heads} KV heads x {head_dim} x {sizes} = {formula:,} B"
    text += " a token)" if slid and tokens > min(slid) else ")"
    if across:
        made = _storage_bytes(across.values())
        text += f"; cross-attention (the encoder's positions, made once): {made:,} B more"
    if slid and k == v:
        want = kv_cache_bytes(model_config, tokens, batch, tensors[0].dtype)
        text += (
            f"; {len(slid)} of {layers} layers keep a sliding window of {slid[0]} tokens: "
            f"{want:,} B by the formula with min(window, tokens)"
        )
    return text


def _state(
    config: RunConfig, own: int, tokens: int, prefilled: int | None, sliding: bool
) -> tuple[int, int]:
    """(bytes of state that did not grow with tokens, bytes per token), of ``own`` bytes of
    keys, values and states. A dynamic cache without sliding windows grows by the same bytes
    for every token: what the new_tokens - 1 decode steps added per token (the last token is
    never fed back, as in Hugging Face's generate()), times the tokens, is the per-token
    part; the rest, if any, is a state. Otherwise (static, sliding, no decode step: one new
    token) everything counts per token."""
    per_token = own // (tokens * config.batch_size)
    steps = config.new_tokens - 1
    if prefilled is None or sliding or config.cache == "static" or steps < 1:
        return 0, per_token
    grown = max(own - prefilled, 0) // (steps * config.batch_size)
    state = own - grown * tokens * config.batch_size
    return (state, grown) if state > 0 else (0, per_token)
