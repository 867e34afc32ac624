"""What a generation fits on a GPU: the largest batch for a context length, or the longest
context for a batch (`fit_generation`), each confirmed by estimates at the edge.

A generation's peak, at a fixed context, grows by the same bytes with each sequence added;
at a fixed batch it grows with the context, mostly by its key/value cache. So a few estimates
draw a line, the line's answer is estimated, and the search stops at a whole number that fits
whose next one does not (`memlab.estimate.search.predicted_batch`). Design and limits:
docs/generation.md."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from memlab.core.categories import Category
from memlab.core.frames import users_traceback
from memlab.estimate.fit_result import GenerationFit
from memlab.estimate.gpus import GPU
from memlab.estimate.gpus import gpu as find_gpu
from memlab.estimate.predict import estimate
from memlab.estimate.redirect import build_on_meta
from memlab.estimate.result import Estimate
from memlab.estimate.search import MAX_BATCH, predicted_batch
from memlab.step.config import RunConfig, WhatIfError
from memlab.step.kvcache import cache_shape, kv_cache_bytes
from memlab.step.model import config_of
from memlab.step.user import ModelFn

#: Bytes per element of the cache dtypes `fit_generation` models.
CACHE_DTYPES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1}
#: The longest context searched when the model's config names no limit.
MAX_CONTEXT = 1 << 20

PromptFn = Callable[[int, int], Any]


@users_traceback()
def fit_generation(
    model_fn: ModelFn,
    input_fn: PromptFn | None = None,
    gpu: str | GPU | int = "L4",
    *,
    context: int | None = None,
    batch: int | None = None,
    config: RunConfig | None = None,
    cache_dtype: str | None = None,
    **settings: Any,
) -> GenerationFit:
    """The largest batch that fits at ``context`` tokens, or the longest context that fits at
    ``batch`` sequences, when generating on ``gpu`` (give one of the two).

    model_fn: the model, as for `memlab.estimate.estimate` (built on meta: no weights needed).
    input_fn(batch, length): the prompt, ``length`` tokens per sequence (token ids, or a
        mapping with input_ids); default: token id 0 everywhere (the ids do not change memory).
    context: tokens per sequence at the end: the prompt (``context - new_tokens``) and the new
        tokens (``config.new_tokens``). The cache holds ``context - 1`` of them: as Hugging
        Face's ``generate()``, the last new token is picked and never fed back.
    config: the generation's settings (mode "generate" is set); ``settings`` override fields.
    cache_dtype: "fp32", "bf16", "fp16" or "fp8": the key/value cache kept in that type while
        the model computes in its own. Hugging Face offers no such cache for a float32 model
        (its static cache copies keys in with their own dtype), so it is modelled here only:
        each estimate's cache bytes at the peak are scaled to the type (a Hugging Face config
        is needed to know the cache's shape).
    A fit judges an estimate's peak reserved against ``gpu``'s usable memory (`Estimate.fits`).
    """
    if (context is None) == (batch is None):
        raise WhatIfError(
            "fit_generation answers one question at a time: pass context=N (the largest batch "
            "at N tokens) or batch=B (the longest context at B sequences), not both or neither."
        )
    card = find_gpu(gpu)
    if card is None:
        raise WhatIfError("fit_generation needs a GPU to fit on: pass gpu='L4', a GPU or bytes.")
    if "batch_size" in settings:
        raise WhatIfError(
            f"fit_generation searches the batch itself: pass batch={settings['batch_size']!r} "
            "(the longest context at that batch) or context=N (the largest batch), not "
            "batch_size."
        )
    config = _generating(config_of(config, settings))
    new = config.new_tokens
    if cache_dtype is not None and (
        not isinstance(cache_dtype, str) or cache_dtype not in CACHE_DTYPES
    ):
        raise WhatIfError(
            f"cache_dtype must be one of {', '.join(map(repr, CACHE_DTYPES))}, not {cache_dtype!r}."
        )
    for name, value, least in (("context", context, new + 1), ("batch", batch, 1)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise WhatIfError(f"{name} must be a whole number, not {value!r}.")
        if value is not None and value < least:
            why = "leaves no prompt" if name == "context" else "has no sequence"
            raise WhatIfError(f"{name}={value} {why}: pass at least {least} (new_tokens is {new}).")
    if input_fn is not None and not callable(input_fn):
        raise WhatIfError(
            f"input_fn got {type(input_fn).__name__} {input_fn!r:.60}: pass a function "
            "input_fn(batch, length) that returns the prompt's token ids, or None for zeros."
        )
    model = build_on_meta(model_fn)
    model_config = getattr(model, "config", None)
    if cache_dtype is not None:
        _check_rescalable(model, model_config)
    longest = _positions(model_config)
    _check_positions(context, new, longest, longest != MAX_CONTEXT)
    prompt_fn = input_fn if input_fn is not None else _zeros
    # the allocator model must not stop at the card's memory: a cheaper cache may still fit
    roomy = dataclasses.replace(card, memory=1 << 60)
    tried: dict[tuple[int, int], int | None] = {}
    cached: dict[tuple[int, int], int] = {}  # the cache's bytes at the end (context - 1 tokens)

    def measure(b: int, length: int) -> tuple[bool, int | None]:
        e = estimate(
            model_fn, lambda n: prompt_fn(n, length), None, config.with_(batch_size=b), gpu=roomy
        )
        saved, kv = _in_cache_dtype(e, model_config, cache_dtype, length + new - 1)
        peak = None if e.oom else e.peak_reserved - saved
        tried[(b, length + new)], cached[(b, length + new)] = peak, kv
        return peak is not None and peak <= card.usable, peak

    if context is not None:
        prompt = context - new
        found = predicted_batch(lambda b: measure(b, prompt), card.usable, limit=MAX_BATCH)
        key, other, top = (found, context), (found + 1, context), MAX_BATCH
    else:
        assert batch is not None
        top = longest - new
        a = max(1, min(64, top // 2))
        found = predicted_batch(
            lambda p: measure(batch, p), card.usable, limit=top, first=(a, min(2 * a, top))
        )
        found = found + new if found else 0
        key, other, top = (batch, found), (batch, found + 1), longest
    size = CACHE_DTYPES[cache_dtype] if cache_dtype else _parameter_size(model)
    per_token = _per_token(model_config, size)
    return GenerationFit(
        gpu=card.describe(),
        usable=card.usable,
        searched="batch" if context is not None else "context",
        batch=key[0],
        context=key[1],
        new_tokens=new,
        peak=tried.get(key),
        next_peak=tried.get(other),
        limit=top,
        cache_per_token=per_token,
        cache_bytes=cached.get(key),
        cache_dtype=cache_dtype,
        estimates=len(tried),
        config=config.with_(batch_size=max(1, key[0])).describe(),
    )


def _generating(config: RunConfig) -> RunConfig:
    """``config`` as a generation, or an error naming the training setting that stops it."""
    try:
        return config.with_(mode="generate", device=None)
    except WhatIfError as e:
        for name in ("retention", "world_size", "sharding", "offload"):
            value, default = getattr(config, name), RunConfig.__dataclass_fields__[name].default
            if value != default:
                got, plain = (str(v) if isinstance(v, str) else v for v in (value, default))
                raise WhatIfError(
                    f"fit_generation estimates a generation (mode='generate'), and {name}="
                    f"{got!r} is a setting of a training step: leave it out, or pass "
                    f"{name}={plain!r}."
                ) from e
        raise


def _check_positions(context: int | None, new: int, longest: int, named: bool) -> None:
    """A context the model's position table holds, and room in it for a prompt."""
    where = "the model's config" if named else "fit_generation's search"
    if context is not None and context > longest:
        raise WhatIfError(
            f"context={context:,} is longer than {where} allows ({longest:,} positions): pass "
            f"context={longest:,} or less."
        )
    if longest - new < 1:
        raise WhatIfError(
            f"new_tokens={new:,} leaves no prompt in {where}'s {longest:,} positions: pass "
            f"new_tokens={longest - 1:,} or less."
        )


def _zeros(batch: int, length: int) -> torch.Tensor:
    return torch.zeros(batch, length, dtype=torch.long)


def _positions(model_config: Any) -> int:
    """The longest context the model's config allows (its position table), else MAX_CONTEXT."""
    for name in ("max_position_embeddings", "n_positions"):
        value = getattr(model_config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return MAX_CONTEXT


def _per_token(model_config: Any, size: int) -> int | None:
    """The cache's bytes per token of one sequence by the formula, below any sliding window
    (None without a config)."""
    try:
        return kv_cache_bytes(model_config, 1, 1, torch.int8, sliding=False) * size
    except WhatIfError:
        return None


def _parameter_size(model: Any) -> int:
    """Bytes of an element of the model's first floating-point parameter (4 without one)."""
    sizes = (p.element_size() for p in model.parameters() if p.is_floating_point())
    return next(sizes, 4)


def _check_rescalable(model: Any, model_config: Any) -> None:
    """``cache_dtype`` rescales keys and values: a model whose cache keeps a state of fixed
    size instead (a state-space model: Mamba's convolution and SSM states) has none to rescale."""
    try:
        cache_shape(model_config)
    except WhatIfError as e:
        kind = type(model).__name__
        if model_config is not None and any(
            hasattr(model_config, n) for n in ("state_size", "ssm_state_size", "d_state")
        ):
            raise WhatIfError(
                f"cache_dtype: {kind}'s cache keeps a state of fixed size (a state-space model), "
                "not keys and values a token at a time, so there is nothing to rescale: leave "
                "cache_dtype out."
            ) from None
        raise WhatIfError(f"cache_dtype needs the key/value cache's shape: {e}") from None


def _in_cache_dtype(
    e: Estimate, model_config: Any, cache_dtype: str | None, cached: int
) -> tuple[int, int]:
    """(bytes the peak would shrink by, the cache's bytes at the end) with the cache kept in
    ``cache_dtype``: the cache's bytes scaled by the ratio of the type's size to the size the
    estimate's cache had (its bytes at the end over its elements by the formula, for the
    ``cached`` tokens it holds)."""
    b = e.tensors.breakdown
    if b is None:
        return 0, 0
    kv_end, kv_peak = b.at_end.get(Category.KV_CACHE, 0), b.at_peak.get(Category.KV_CACHE, 0)
    if cache_dtype is None or not kv_end:
        return 0, kv_end
    elements = kv_cache_bytes(model_config, cached, e.config.batch_size, torch.int8)
    ratio = CACHE_DTYPES[cache_dtype] / (kv_end / elements)
    return int(kv_peak * (1 - ratio)), int(kv_end * ratio)
