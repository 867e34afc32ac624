"""``mode="generate"``: a prompt read at once (prefill), then ``new_tokens`` tokens one at a
time, each step reading the key/value cache the earlier ones filled: what inference with a
language model holds in memory. Greedy decoding (the argmax token), no stopping early, so every
run generates the same number of tokens.

Two kinds of model: one that takes and returns a cache as Hugging Face's do
(``model(input_ids=..., past_key_values=..., use_cache=True)`` returning ``.logits`` and
``.past_key_values``; ``cache`` in newer transformers), or a plain module called
``model(tokens, cache)`` that returns ``(logits, cache)`` (``cache`` None for the prompt)."""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Mapping
from typing import Any

import torch

from memlab.core.categories import Category
from memlab.step.config import RunConfig, WhatIfError
from memlab.step.model import call, check_device
from memlab.step.user import UserStep, refused_arguments, tensors_in

Mark = Callable[[torch.Tensor, Category], None]
#: Labels the timeline's events inside a block ("prefill", "decode"): `memlab.track.phase`.
Stage = Callable[[str], contextlib.AbstractContextManager[Any]]


def unstaged(name: str) -> contextlib.AbstractContextManager[Any]:
    """A `Stage` that labels nothing (a warm-up, which is not measured)."""
    return contextlib.nullcontext()


def generate(user: UserStep, config: RunConfig, mark: Mark, stage: Stage = unstaged) -> list[Any]:
    """Prefill and decode under ``torch.no_grad()``; marks the prompt as input and the cache's
    tensors as ``kv_cache``; returns what stays alive after: the generated tokens and the
    cache (kept as a chat keeps it for its next turn). Each call of the model is labelled in
    the timeline, "prefill" for the prompt's and "decode" for each new token's; picking the
    token between them stays "other", so the decode steps stand apart."""
    if user.step_fn is not None:
        raise WhatIfError(
            "mode='generate' runs its own decoding loop and cannot take a step_fn: pass the "
            "model and an input_fn that returns the prompt (token ids, or a mapping with "
            "input_ids and attention_mask)."
        )
    prompt = call("input_fn", user.input_fn, config.batch_size)
    check_device("input_fn's result", tensors_in(prompt), user.device)
    for t in tensors_in(prompt):
        mark(t, Category.INPUT)
    model = user.model
    with torch.no_grad():
        for name in ("past_key_values", "cache"):  # "cache" in newer transformers
            if hasattr(model, "generate") and _takes(model, name):
                return _hugging_face(model, prompt, config, mark, stage, name)
        return _plain(model, prompt, config, mark, stage)


def _hugging_face(
    model: Any, prompt: Any, config: RunConfig, mark: Mark, stage: Stage, cache_name: str
) -> list[Any]:
    kwargs = dict(prompt) if isinstance(prompt, Mapping) else {"input_ids": prompt}
    kwargs.pop("labels", None)  # a loss is not part of generating
    if config.logits == "last" and _takes(model, "logits_to_keep"):
        kwargs["logits_to_keep"] = 1  # as Hugging Face's generate() asks in its prefill
    mask = kwargs.get("attention_mask")
    with stage("prefill"):
        out = model(**kwargs, use_cache=True)
    tokens = []
    for _ in range(config.new_tokens):
        cache = _cache_of(out)
        _mark_cache(cache, mark)
        token = out.logits[:, -1:].argmax(-1)
        tokens.append(token)
        step: dict[str, Any] = {"input_ids": token, cache_name: cache, "use_cache": True}
        if mask is not None:
            mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=1)
            step["attention_mask"] = mask
        del out  # the last step's logits go before the next step's come
        with stage("decode"):
            out = model(**step)
    cache = _cache_of(out)
    _mark_cache(cache, mark)
    return [tokens, cache]


def _plain(model: Any, prompt: Any, config: RunConfig, mark: Mark, stage: Stage) -> list[Any]:
    if not isinstance(prompt, torch.Tensor):
        raise WhatIfError(
            f"mode='generate' with a model that is not a Hugging Face one needs input_fn to "
            f"return the prompt's token ids as one tensor, not {type(prompt).__name__}."
        )
    try:
        with stage("prefill"):
            first = model(prompt, None)
    except TypeError as e:
        if not refused_arguments(e):
            raise
        raise WhatIfError(
            f"mode='generate' calls model(tokens, cache) for a model that is not a Hugging "
            f"Face one, and this one refused ({e}): give its forward a cache argument (None "
            "for the prompt) and return (logits, cache)."
        ) from e
    out = _pair(first)
    tokens = []
    for _ in range(config.new_tokens):
        _mark_cache(out[1], mark)
        token = out[0][:, -1:].argmax(-1)
        tokens.append(token)
        cache = out[1]
        del out  # the last step's logits go before the next step's come
        with stage("decode"):
            out = _pair(model(token, cache))
        del cache
    _mark_cache(out[1], mark)
    return [tokens, out[1]]


def _pair(out: Any) -> tuple[torch.Tensor, Any]:
    if not (isinstance(out, tuple) and len(out) == 2 and isinstance(out[0], torch.Tensor)):
        got = type(out).__name__ if not isinstance(out, tuple) else f"a tuple of {len(out)}"
        raise WhatIfError(
            f"mode='generate' calls model(tokens, cache) and expects (logits, cache) back, "
            f"not {got}: return the logits and the updated cache (None in, for the prompt)."
        )
    return out[0], out[1]


def _cache_of(out: Any) -> Any:
    # "cache" first: newer transformers warn when the old name, past_key_values, is read
    cache = getattr(out, "cache", None)
    cache = cache if cache is not None else getattr(out, "past_key_values", None)
    if cache is None:
        raise WhatIfError(
            "the model returned no cache (past_key_values) with use_cache=True: "
            "mode='generate' needs a model that keeps a key/value cache."
        )
    return cache


def _mark_cache(cache: Any, mark: Mark) -> None:
    for t in cache_tensors(cache):
        mark(t, Category.KV_CACHE)


def cache_tensors(cache: Any, depth: int = 0) -> list[torch.Tensor]:
    """The tensors a key/value cache holds: in its lists, tuples, mappings and attributes
    (Hugging Face's cache classes keep them in per-layer objects), a few levels deep."""
    if isinstance(cache, torch.Tensor):
        return [cache]
    if depth > 5 or cache is None or isinstance(cache, (str, bytes, int, float, bool)):
        return []
    if isinstance(cache, Mapping):
        items: Any = cache.values()
    elif isinstance(cache, (list, tuple)):
        items = cache
    else:
        items = list(vars(cache).values()) if hasattr(cache, "__dict__") else []
    return [t for item in items for t in cache_tensors(item, depth + 1)]


def _takes(model: Any, name: str) -> bool:
    try:
        return name in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False


def kv_cache_bytes(model_config: Any, tokens: int, batch: int, dtype: torch.dtype) -> int:
    """Bytes of a full key/value cache: 2 (keys and values) x layers x key/value heads x head
    size x ``tokens`` x ``batch`` x the dtype's size, from a Hugging Face model config (grouped-
    query attention: ``num_key_value_heads`` below ``num_attention_heads``)."""
    layers, kv_heads, head_dim = cache_shape(model_config)
    size = torch.empty((), dtype=dtype).element_size()
    return 2 * layers * kv_heads * head_dim * tokens * batch * size


def cache_shape(c: Any) -> tuple[int, int, int]:
    """(layers, key/value heads, head size) from a Hugging Face model config."""
    layers = _first(c, "num_hidden_layers", "n_layer", "num_layers")
    heads = _first(c, "num_attention_heads", "n_head")
    kv_heads = getattr(c, "num_key_value_heads", None) or heads
    head_dim = getattr(c, "head_dim", None) or _first(c, "hidden_size", "n_embd") // heads
    return layers, kv_heads, head_dim


def _first(config: Any, *names: str) -> int:
    for name in names:
        value = getattr(config, name, None)
        if isinstance(value, int):
            return value
    raise WhatIfError(f"the model config has none of {', '.join(names)}: cannot size its cache.")


def cache_note(model: Any, config: RunConfig, kept: list[Any]) -> str:
    """What the finished cache holds per token, beside the formula where the model's config
    gives its shape (a Hugging Face model). Keys and values may differ in type: under autocast,
    rotary embeddings leave the keys in float32 and the values in 16 bits."""
    tensors = cache_tensors(kept[-1]) if kept else []
    held = sum(t.untyped_storage().nbytes() for t in {id(t): t for t in tensors}.values())
    # keys and values: (batch, heads, tokens, head size); a plain cache: (batch, tokens, width)
    tokens = tensors[0].shape[-2] if held and tensors[0].dim() >= 2 else 0
    if not tokens:
        return "KV cache: none found in what the model returned"
    per_token = held // (tokens * config.batch_size)
    text = (
        f"KV cache: {held:,} B for {tokens} tokens x {config.batch_size} sequences, "
        f"{per_token:,} B per token"
    )
    try:
        layers, kv_heads, head_dim = cache_shape(getattr(model, "config", None))
    except WhatIfError:
        return text
    k, v = tensors[0].element_size(), tensors[min(1, len(tensors) - 1)].element_size()
    sizes = f"2 x {k} B" if k == v else f"({k} B keys + {v} B values)"
    formula = layers * kv_heads * head_dim * (k + v)
    return (
        f"{text} (formula: {layers} layers x {kv_heads} KV heads x {head_dim} x {sizes} "
        f"= {formula:,} B)"
    )
