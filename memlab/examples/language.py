"""Sequence models from torch.nn: a GPT-2-small-sized decoder, a BERT-base-wide encoder and an
LSTM tagger; transformers' GPT-2 and BERT where transformers is installed."""

from __future__ import annotations

import importlib

import torch
from torch import nn


class GPT(nn.Module):
    """A GPT-2-small-sized decoder from torch.nn: 12 layers, width 768, 12 heads."""

    def __init__(self, vocab: int = 50257, ctx: int = 1024, width: int = 768, layers: int = 12):
        super().__init__()
        self.tok = nn.Embedding(vocab, width)
        self.pos = nn.Embedding(ctx, width)
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(
                width,
                width // 64,
                4 * width,
                dropout=0.1,
                activation="gelu",
                batch_first=True,
                norm_first=True,
            )
            for _ in range(layers)
        )
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        n = idx.shape[1]
        mask = nn.Transformer.generate_square_subsequent_mask(n, device=idx.device)
        h = self.tok(idx) + self.pos(torch.arange(n, device=idx.device))
        for layer in self.layers:
            h = layer(h, src_mask=mask, is_causal=True)
        out: torch.Tensor = self.head(self.norm(h))
        return out


class Encoder(nn.Module):
    """A BERT-base-shaped encoder (fewer layers): post-norm, width 768, 12 heads, two classes."""

    def __init__(self, vocab: int = 30522, ctx: int = 256, width: int = 768, layers: int = 4):
        super().__init__()
        self.tok = nn.Embedding(vocab, width)
        self.pos = nn.Embedding(ctx, width)
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(width, 12, 4 * width, batch_first=True)
            for _ in range(layers)
        )
        self.head = nn.Linear(width, 2)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.tok(ids) + self.pos(torch.arange(ids.shape[1], device=ids.device))
        for block in self.blocks:
            h = block(h)
        out: torch.Tensor = self.head(h[:, 0])
        return out


class LSTMTagger(nn.Module):
    """An LSTM over token ids, a prediction per token: cuDNN's RNN kernels on a GPU."""

    def __init__(self, vocab: int = 10000, width: int = 512, layers: int = 2):
        super().__init__()
        self.emb = nn.Embedding(vocab, width)
        self.rnn = nn.LSTM(width, width, layers, batch_first=True)
        self.head = nn.Linear(width, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(self.rnn(self.emb(ids))[0])
        return out


def transformers_gpt2() -> nn.Module:
    """transformers' GPT-2 small with SDPA attention, untrained (no download). Needs
    transformers, imported here."""
    hf = importlib.import_module("transformers")
    model: nn.Module = hf.GPT2LMHeadModel(hf.GPT2Config(attn_implementation="sdpa"))
    return model


def transformers_bert() -> nn.Module:
    """transformers' BERT-base classifier with SDPA attention, untrained (no download). Needs
    transformers, imported here."""
    hf = importlib.import_module("transformers")
    model: nn.Module = hf.BertForSequenceClassification(hf.BertConfig(attn_implementation="sdpa"))
    return model
