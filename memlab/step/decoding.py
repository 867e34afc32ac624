"""What ``mode="generate"`` checks of a Hugging Face model's prompt and outputs, for
`memlab.step.generate` and `memlab.step.seq2seq`: a prompt with no tokens, an output that is
a tuple (``return_dict=False``), and a generation longer than the model's position table."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from memlab.core.categories import Category
from memlab.core.frames import message_of
from memlab.step.config import RunConfig, WhatIfError
from memlab.step.kvcache import cache_tensors
from memlab.step.tables import position_tables


def check_prompt(kwargs: Mapping[str, Any]) -> None:
    """A WhatIfError for a prompt without tokens (a tensor of shape ``(batch, 0)``): the model
    has nothing to read, and its own error would come from deep inside it."""
    for name, value in kwargs.items():
        if isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[1] == 0:
            raise WhatIfError(
                f"mode='generate': input_fn returned an empty prompt ({name} of shape "
                f"{tuple(value.shape)}): pass at least one token per sequence, e.g. "
                "torch.full((batch, 1), bos_token_id)."
            )


def model_output(out: Any, model: Any) -> Any:
    """``out``, a model output with ``.logits``; a WhatIfError for a tuple (a config with
    ``return_dict=False``) or anything else without logits."""
    if getattr(out, "logits", None) is None:
        got = f"a tuple of {len(out)}" if isinstance(out, tuple) else type(out).__name__
        raise WhatIfError(
            f"mode='generate' reads .logits and the cache from the model's output, and "
            f"{type(model).__name__} returned {got}"
            + (" (its config has return_dict=False)" if isinstance(out, tuple) else "")
            + ": set model.config.return_dict = True in model_fn (or leave it at its default)."
        )
    return out


def positions(model: Any) -> int | None:
    """The longest sequence the model's position table holds (the decoder's, for an
    encoder-decoder), or None where its config names none."""
    config = getattr(model, "config", None)
    for name in ("max_target_positions", "max_position_embeddings", "n_positions"):
        value = getattr(config, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


@contextlib.contextmanager
def within_positions(model: Any, config: RunConfig, prompt: int) -> Iterator[None]:
    """An IndexError raised while feeding ``prompt`` + new_tokens - 1 tokens (the last new
    token is never fed back) past the model's position table, explained with what to pass;
    any other error as it is. On ``meta`` (an estimate), where a lookup past a table reads
    nothing and fails nowhere, a model with a learned position table of that length is refused
    before it runs, as the GPU would fail it (a model with computed positions, RoPE, runs)."""
    limit, fed = positions(model), prompt + config.new_tokens - 1
    if limit is not None and fed > limit and _on_meta(model) and _learned(model, limit):
        raise WhatIfError(_past(model, config, prompt, fed, limit, "a lookup past its rows"))
    try:
        yield
    except IndexError as e:
        if limit is None or fed <= limit:
            raise
        raise WhatIfError(_past(model, config, prompt, fed, limit, message_of(e))) from e


def _learned(model: Any, limit: int) -> bool:
    """Whether ``model`` has a learned position table of ``limit`` rows (not RoPE's)."""
    return any(n == limit for _, _, n in position_tables(model).values())


def _on_meta(model: Any) -> bool:
    p = next(iter(model.parameters()), None) if hasattr(model, "parameters") else None
    return p is not None and p.is_meta


def _past(model: Any, config: RunConfig, prompt: int, fed: int, limit: int, why: str) -> str:
    return (
        f"new_tokens={config.new_tokens:,} with a prompt of {prompt:,} token(s) feeds the "
        f"model {fed:,} tokens (the last new token is not fed back), past the {limit:,} "
        f"positions {type(model).__name__}'s config allows ({why}): pass "
        f"new_tokens ≤ {max(limit - prompt + 1, 1):,}, or a shorter prompt."
    )


def cache_of(out: Any, what: str = "the model") -> Any:
    """The cache a Hugging Face model's output holds; a WhatIfError naming ``what`` where it
    holds none."""
    # "cache" first: newer transformers warn when the old name, past_key_values, is read
    cache = getattr(out, "cache", None)
    cache = cache if cache is not None else getattr(out, "past_key_values", None)
    if cache is None:
        raise WhatIfError(
            f"{what} returned no cache (past_key_values) with use_cache=True: "
            "mode='generate' needs a model that keeps a key/value cache."
        )
    return cache


def mark_cache(cache: Any, mark: Callable[..., None]) -> None:
    """Each of the cache's tensors marked as ``kv_cache``."""
    for t in cache_tensors(cache):
        mark(t, Category.KV_CACHE)
