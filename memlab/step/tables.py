"""A model's learned position tables: ``nn.Embedding``s of one row a position, sized by a
config field (``max_position_embeddings``, ``n_positions``; Whisper's
``max_target_positions`` and ``max_source_positions``). A sequence longer than such a table
reads past its rows, and fails on a GPU or the CPU whatever its positions are; on ``meta``
nothing is read, so an estimate checks lengths against them (`memlab.estimate.positions`,
`memlab.step.decoding.within_positions`). Models whose positions are computed (RoPE: Llama,
Qwen2, ...) have no such table."""

from __future__ import annotations

from typing import Any

from torch import nn

#: The config fields that give a learned position table's rows (Hugging Face's names).
_LENGTH_FIELDS = (
    "max_position_embeddings",
    "n_positions",
    "max_target_positions",  # an encoder-decoder's decoder (Whisper's)
    "max_source_positions",  # and its encoder
)
#: Rows a table may keep above the longest sequence (BART's and OPT's learned positions: 2).
_OFFSETS = (0, 2)


def _input_table(model: nn.Module) -> Any:
    getter = getattr(model, "get_input_embeddings", None)
    try:
        return getter() if callable(getter) else None
    except (NotImplementedError, AttributeError):  # a model without one
        return None


def position_tables(model: nn.Module) -> dict[nn.Embedding, tuple[str, str, int]]:
    """Each learned position table of ``model``: its path, the config field that sized it and
    the longest sequence it takes. A table is an ``nn.Embedding`` under a module whose config
    gives the length, with that many rows (or two more), which is not the token table."""
    found: dict[nn.Embedding, tuple[str, str, int]] = {}
    for path, module in model.named_modules():
        config = getattr(module, "config", None)
        if config is None:
            continue
        fields = sorted(_LENGTH_FIELDS, key=lambda f: f not in vars(config))  # its own name first
        lengths = [
            (f, n) for f in fields if isinstance(n := getattr(config, f, None), int) and n > 0
        ]
        if not lengths:
            continue
        tokens = _input_table(module)
        vocab = getattr(config, "vocab_size", None)
        for name, table in module.named_modules():
            if not isinstance(table, nn.Embedding) or table is tokens or table in found:
                continue
            if tokens is None and table.num_embeddings == vocab:  # can't tell it from the tokens
                continue
            for field, n in lengths:
                if table.num_embeddings - n in _OFFSETS:
                    found[table] = (f"{path}.{name}" if path else name, field, n)
                    break
    return found
