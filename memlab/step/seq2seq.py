"""``mode="generate"`` for an encoder-decoder model (Hugging Face's T5, BART, Whisper, ...: a
config with ``is_encoder_decoder``): the prefill encodes the input once and reads the decoder's
first token(s), whose logits give the first new token; each of the ``new_tokens - 1`` decode
steps then reads the token before, the encoder's output and the cache, as ``generate()`` does
(the last token is never fed back). The cache holds the decoder's self-attention keys and
values (growing a token a step) and the cross-attention's (the encoder's length, made once)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from memlab.core.categories import Category
from memlab.step.config import RunConfig, WhatIfError
from memlab.step.decoding import (
    cache_of,
    check_prompt,
    mark_cache,
    model_output,
    within_positions,
)
from memlab.step.kvcache import viewed_bytes
from memlab.step.outputs import tensors_in

Mark = Callable[[torch.Tensor, Category], None]
#: How errors name the model (an encoder-decoder has its own messages).
WHAT = "the encoder-decoder model"


def is_encoder_decoder(model: Any) -> bool:
    return bool(getattr(getattr(model, "config", None), "is_encoder_decoder", False))


def encoder_decoder(
    model: Any, prompt: Any, config: RunConfig, mark: Mark, stage: Any, cache_name: str
) -> list[Any]:
    """Prefill and decode an encoder-decoder model; returns what stays alive after, as
    `memlab.step.generate.generate` does: the tokens, the cache, and the decoder's tokens it
    holds; and the keys' and values' bytes after the prefill (its self-attention part)."""
    main = getattr(model, "main_input_name", "input_ids")
    kwargs = dict(prompt) if isinstance(prompt, Mapping) else {main: prompt}
    kwargs.pop("labels", None)  # a loss is not part of generating
    decoder_ids = kwargs.pop("decoder_input_ids", None)
    kwargs = {k: v for k, v in kwargs.items() if not k.startswith("decoder_")}
    given = tensors_in(kwargs)
    if not given:
        got = type(prompt).__name__
        if isinstance(prompt, Mapping):  # e.g. only labels, or only the decoder's ids
            keys = ", ".join(repr(k)[:40] for k in list(prompt)[:5])
            got = f"a {got} with only {keys}" if keys else f"an empty {got}"
        raise WhatIfError(
            f"mode='generate' with an encoder-decoder model ({type(model).__name__}) needs "
            f"input_fn to return the encoder's input ({main}, or a mapping with it), not "
            f"{got}."
        )
    check_prompt(kwargs)
    if decoder_ids is None:  # generate() starts the decoder from its start token
        start = _start_token(model)
        decoder_ids = torch.full((given[0].shape[0], 1), start, device=given[0].device)
    check_prompt({"decoder_input_ids": decoder_ids})
    mask = kwargs.get("attention_mask")
    with within_positions(model, config, decoder_ids.shape[1]):
        with stage("prefill"):
            out = model_output(
                model(**kwargs, decoder_input_ids=decoder_ids, use_cache=True), model
            )
        prefilled = viewed_bytes(cache_of(out, WHAT))
        encoded = (out.encoder_last_hidden_state,)  # kept for every step, as generate() does
        mark(encoded[0], Category.ACTIVATION)
        tokens = [out.logits[:, -1:].argmax(-1)]  # the prefill's logits give the first token
        for _ in range(config.new_tokens - 1):  # the last token is never fed back
            cache = cache_of(out, WHAT)
            mark_cache(cache, mark)
            del out  # the last step's logits go before the next step's come
            with stage("decode"):
                out = model(
                    encoder_outputs=encoded, attention_mask=mask, decoder_input_ids=tokens[-1],
                    use_cache=True, **{cache_name: cache},
                )  # fmt: skip
            out = model_output(out, model)
            tokens.append(out.logits[:, -1:].argmax(-1))
    cache = cache_of(out, WHAT)
    mark_cache(cache, mark)
    return [tokens, cache, decoder_ids.shape[1] + config.new_tokens - 1, prefilled]


def _start_token(model: Any) -> int:
    for source in (getattr(model, "config", None), getattr(model, "generation_config", None)):
        for name in ("decoder_start_token_id", "bos_token_id", "pad_token_id"):
            value = getattr(source, name, None)
            if isinstance(value, int) and not isinstance(value, bool):
                return value
    return 0
