"""``mode="generate"``: a prompt read at once (prefill), then ``new_tokens`` tokens one at a
time, each step reading the key/value cache the earlier ones filled: what inference with a
language model holds in memory. Greedy decoding (the argmax token), no stopping early, so every
run generates the same number of tokens. As Hugging Face's ``generate(max_new_tokens=n)``:
``n`` forwards, the prefill's logits giving the first token and each of the ``n - 1`` decode
steps feeding the token before; the last token is picked, never fed back, so the cache ends
with the prompt and ``n - 1`` tokens.

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
from memlab.core.frames import message_of
from memlab.step.config import RunConfig, WhatIfError
from memlab.step.decoding import (
    cache_of,
    check_prompt,
    mark_cache,
    model_output,
    within_positions,
)
from memlab.step.kvcache import (
    cache_shape,
    cache_tensors,
    kv_cache_bytes,
    static_cache,
    viewed_bytes,
)
from memlab.step.model import call, check_device, check_keywords, cpu_to
from memlab.step.outputs import tensors_in
from memlab.step.seq2seq import encoder_decoder, is_encoder_decoder
from memlab.step.user import UserStep, refused_arguments

#: Their home is `memlab.step.kvcache`; kept importable from here.
__all__ = ["cache_shape", "cache_tensors", "generate", "kv_cache_bytes", "unstaged"]

Mark = Callable[[torch.Tensor, Category], None]
#: Labels the timeline's events inside a block ("prefill", "decode"): `memlab.track.phase`.
Stage = Callable[[str], contextlib.AbstractContextManager[Any]]


def unstaged(name: str) -> contextlib.AbstractContextManager[Any]:
    """A `Stage` that labels nothing (a warm-up, which is not measured)."""
    return contextlib.nullcontext()


def generate(user: UserStep, config: RunConfig, mark: Mark, stage: Stage = unstaged) -> list[Any]:
    """Prefill and decode under ``torch.no_grad()``; marks the prompt as input and the cache's
    tensors as ``kv_cache``; returns what stays alive after: the generated tokens and the
    cache (kept as a chat keeps it for its next turn), and the number of tokens it holds.
    Each call of the model is labelled in the timeline, "prefill" for the prompt's and
    "decode" for each new token's; picking the token between them stays "other", so the
    decode steps stand apart."""
    if user.step_fn is not None:
        raise WhatIfError(
            "mode='generate' runs its own decoding loop and cannot take a step_fn: pass the "
            "model and an input_fn that returns the prompt (token ids, or a mapping with "
            "input_ids and attention_mask)."
        )
    prompt = call("input_fn", user.input_fn, config.batch_size)
    if user.device.type == "meta":  # an estimate: a prompt from the CPU is on the GPU
        prompt = cpu_to(prompt, user.device)
    check_keywords(prompt)  # (a mapping: the model's keyword arguments)
    check_device("input_fn's result", tensors_in(prompt), user.device)
    for t in tensors_in(prompt):
        mark(t, Category.INPUT)
    model = user.model
    with torch.no_grad():
        # "cache" in newer transformers, which warn at the old name while they still take it
        name = next((n for n in ("cache", "past_key_values") if _takes(model, n)), None)
        if hasattr(model, "generate") and name is not None:
            kept = _hugging_face(model, prompt, config, mark, stage, name)
        else:
            kept = _plain(model, prompt, config, mark, stage)
    user.prefilled = kept.pop()  # keys' and values' bytes after the prefill, for the note
    return kept


def _hugging_face(
    model: Any, prompt: Any, config: RunConfig, mark: Mark, stage: Stage, cache_name: str
) -> list[Any]:
    if is_encoder_decoder(model):  # T5, BART, Whisper: the encoder once, then the decoder
        return encoder_decoder(model, prompt, config, mark, stage, cache_name)
    kwargs = dict(prompt) if isinstance(prompt, Mapping) else {"input_ids": prompt}
    kwargs.pop("labels", None)  # a loss is not part of generating
    if config.logits == "last" and _takes(model, "logits_to_keep"):
        kwargs["logits_to_keep"] = 1  # as Hugging Face's generate() asks in its prefill
    check_prompt(kwargs)
    mask = kwargs.get("attention_mask")
    ids = kwargs.get("input_ids", kwargs.get("inputs_embeds"))
    given = ids.shape[1] if isinstance(ids, torch.Tensor) and ids.dim() >= 2 else 0
    length = given + config.new_tokens - 1  # the last token is never fed back (generate()'s)
    if config.cache == "static":  # room for every token fed, taken in the prefill
        kwargs[cache_name] = static_cache(model, config.batch_size, length)
    with within_positions(model, config, given):
        with stage("prefill"):
            out = model_output(model(**kwargs, use_cache=True), model)
        prefilled = viewed_bytes(cache_of(out))
        tokens = [out.logits[:, -1:].argmax(-1)]  # the prefill's logits give the first token
        for _ in range(config.new_tokens - 1):
            cache = cache_of(out)
            mark_cache(cache, mark)
            step: dict[str, Any] = {"input_ids": tokens[-1], cache_name: cache, "use_cache": True}
            if mask is not None:
                mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=1)
                step["attention_mask"] = mask
            del out  # the last step's logits go before the next step's come
            with stage("decode"):
                out = model_output(model(**step), model)
            tokens.append(out.logits[:, -1:].argmax(-1))
    cache = cache_of(out)
    mark_cache(cache, mark)
    return [tokens, cache, length, prefilled]


def _plain(model: Any, prompt: Any, config: RunConfig, mark: Mark, stage: Stage) -> list[Any]:
    if not isinstance(prompt, torch.Tensor):
        raise WhatIfError(
            f"mode='generate' with a model that is not a Hugging Face one needs input_fn to "
            f"return the prompt's token ids as one tensor, not {type(prompt).__name__}."
        )
    if config.cache == "static":
        raise WhatIfError(
            "cache='static' is Hugging Face's StaticCache, and this model is not a Hugging Face "
            "one (it keeps its own cache): use cache='dynamic'."
        )
    try:
        with stage("prefill"):
            first = model(prompt, None)
    except TypeError as e:
        if not refused_arguments(e):
            raise
        raise WhatIfError(
            f"mode='generate' calls model(tokens, cache) for a model that is not a Hugging "
            f"Face one, and this one refused ({message_of(e)}): give its forward a cache "
            "argument (None for the prompt) and return (logits, cache)."
        ) from e
    logits, cache = _pair(first)
    del first  # the prefill's output goes as in a user's loop: only its cache stays
    prefilled = viewed_bytes(cache)
    tokens = [logits[:, -1:].argmax(-1)]  # the prefill's logits give the first token
    for _ in range(config.new_tokens - 1):  # the last token is never fed back
        mark_cache(cache, mark)
        del logits  # the last step's logits go before the next step's come
        with stage("decode"):
            logits, cache = _pair(model(tokens[-1], cache))
        tokens.append(logits[:, -1:].argmax(-1))
    mark_cache(cache, mark)
    return [tokens, cache, prompt.shape[1] + config.new_tokens - 1, prefilled]


def _pair(out: Any) -> tuple[torch.Tensor, Any]:
    if not (isinstance(out, tuple) and len(out) == 2 and isinstance(out[0], torch.Tensor)):
        got = type(out).__name__ if not isinstance(out, tuple) else f"a tuple of {len(out)}"
        raise WhatIfError(
            f"mode='generate' calls model(tokens, cache) and expects (logits, cache) back, "
            f"not {got}: return the logits and the updated cache (None in, for the prompt)."
        )
    return out[0], out[1]


def _takes(model: Any, name: str) -> bool:
    """Whether the model's forward names the argument ``name``. A wrapper whose forward takes
    its arguments through ``**kwargs`` and hands them to the model it wraps (a peft model's
    ``get_base_model()``, a LoRA Llama's) is asked about that model's forward."""
    base = getattr(model, "get_base_model", None)
    if callable(base):  # (one that fails to give it: asked about its own forward)
        with contextlib.suppress(Exception):
            model = base()
    try:
        return name in inspect.signature(model.forward).parameters
    except (TypeError, ValueError, AttributeError):
        return False
