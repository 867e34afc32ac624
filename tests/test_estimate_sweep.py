"""A sweep of torch.nn's layers: the estimate without CUDA's kernels (gpu=None, workspace=0,
cuda_kernels=False) counts the tensor bytes a real CPU run of the same step counts.

Each case is a tiny model; each mode a step configuration. Every (case, mode) pair either
matches a CPU run byte for byte (peak, bytes after, and every category at the peak, at the end
and at its highest) or differs by exactly the bytes `EXPECTED` lists, under the causes named in
`CAUSES`. A difference not listed, or a listed one that changed, fails.

The CPU run is measured as the estimate counts: under memlab's dispatch mode
(MEMLAB_NATIVE=0). A dispatch mode changes what some CPU kernels do (an RNN's or an attention
layer's fused path gives way to its composite one, with other temporaries), and the estimate
runs its model under one; the native record measures the program as it runs without one, so
against it those layers differ by their temporaries, which says nothing about the estimate.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

from memlab.estimate import estimate
from memlab.whatif import RunConfig, StepHooks, run


@pytest.fixture(autouse=True)
def _dispatch_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MEMLAB_NATIVE", "0")  # see the module's doc


def conv1d():
    return nn.Sequential(
        nn.Conv1d(4, 8, 3, stride=2, padding=1),
        nn.ReLU(),
        nn.Conv1d(8, 8, 3, groups=4, dilation=2, padding=2, padding_mode="reflect"),
    )


def conv2d():
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, stride=2, padding=1),
        nn.ReLU(),
        nn.Conv2d(8, 8, 3, groups=8, padding=1, padding_mode="circular"),
        nn.SiLU(),
        nn.Conv2d(8, 8, 3, dilation=2, padding="same", padding_mode="replicate"),
        nn.Conv2d(8, 4, 1, bias=False),
    )


def conv3d():
    return nn.Sequential(
        nn.Conv3d(2, 4, 3, stride=(1, 2, 2), padding=1),
        nn.GELU(),
        nn.Conv3d(4, 4, 3, groups=2, padding=1, padding_mode="zeros"),
    )


def conv_transpose():
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, stride=2, padding=1),
        nn.ReLU(),
        nn.ConvTranspose2d(8, 4, 4, stride=2, padding=1),
        nn.ConvTranspose2d(4, 4, 3, groups=2, padding=1),
    )


def norms():
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.GroupNorm(2, 8),
        nn.InstanceNorm2d(8, affine=True),
        nn.Conv2d(8, 4, 1),
    )


class BN1(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(16, 32)
        self.bn = nn.BatchNorm1d(32)
        self.ln = nn.LayerNorm(32)
        self.b = nn.Linear(32, 8)

    def forward(self, x):
        return self.b(self.ln(torch.relu(self.bn(self.a(x)))))


class Emb(nn.Module):
    def __init__(self):
        super().__init__()
        self.e = nn.Embedding(100, 16, padding_idx=0)
        self.bag = nn.EmbeddingBag(100, 16, mode="mean")
        self.out = nn.Linear(16, 100)

    def forward(self, ids):
        h = self.e(ids) + self.bag(ids).unsqueeze(1)
        logits = self.out(h)
        y = ids.roll(1, dims=1)
        return F.cross_entropy(
            logits.reshape(-1, 100), y.reshape(-1), label_smoothing=0.1, ignore_index=0
        )


class RNNs(nn.Module):
    def __init__(self, kind, **kw):
        super().__init__()
        self.r = getattr(nn, kind)(8, 16, **kw)
        self.kw = kw

    def forward(self, x):
        if not self.kw.get("batch_first"):
            x = x.transpose(0, 1)
        return self.r(x)[0]


class MHA(nn.Module):
    def __init__(self, batch_first, need_weights):
        super().__init__()
        self.m = nn.MultiheadAttention(16, 4, batch_first=batch_first)
        self.bf = batch_first
        self.nw = need_weights

    def forward(self, x):
        if not self.bf:
            x = x.transpose(0, 1)
        out, w = self.m(x, x, x, need_weights=self.nw)
        return out if w is None else out.sum() + w.sum()


def enc(norm_first):
    layer = nn.TransformerEncoderLayer(
        16, 4, 32, dropout=0.1, batch_first=True, norm_first=norm_first
    )
    return nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)


class Dec(nn.Module):
    def __init__(self, norm_first):
        super().__init__()
        layer = nn.TransformerDecoderLayer(
            16, 4, 32, dropout=0.1, batch_first=True, norm_first=norm_first
        )
        self.d = nn.TransformerDecoder(layer, 2)

    def forward(self, x):
        mask = nn.Transformer.generate_square_subsequent_mask(x.shape[1])
        return self.d(x, x[:, :3], tgt_mask=mask)


class Pools(nn.Module):
    def __init__(self):
        super().__init__()
        self.c = nn.Conv2d(3, 8, 3, padding=1)
        self.mp = nn.MaxPool2d(2, return_indices=True)
        self.ap = nn.AdaptiveAvgPool2d(3)
        self.up = nn.Upsample(scale_factor=2, mode="nearest")
        self.ps = nn.PixelShuffle(2)
        self.c2 = nn.Conv2d(2, 4, 3, padding=1)

    def forward(self, x):
        h, idx = self.mp(torch.relu(self.c(x)))
        a = self.ap(h)
        u = self.up(h) + F.interpolate(h, scale_factor=2, mode="bilinear", align_corners=False)
        return self.c2(self.ps(u)).sum() + a.sum() + idx.float().sum() * 0


def drops():
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.Dropout2d(0.2),
        nn.GELU(approximate="tanh"),
        nn.Flatten(),
        nn.Dropout(0.3),
        nn.Linear(8 * 64, 32),
        nn.AlphaDropout(0.1),
        nn.Mish(),
        nn.PReLU(),
        nn.Linear(32, 10),
        nn.LogSoftmax(-1),
    )


class Acts(nn.Module):
    def __init__(self):
        super().__init__()
        self.l = nn.Linear(16, 16)
        self.p = nn.PReLU(16)

    def forward(self, x):
        h = self.l(x)
        return torch.softmax(F.silu(h), -1) + F.mish(self.p(h)) + F.gelu(h, approximate="tanh")


class SDPA(nn.Module):
    def __init__(self, causal):
        super().__init__()
        self.qkv = nn.Linear(16, 48)
        self.o = nn.Linear(16, 16)
        self.causal = causal

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, 4, 4).permute(2, 0, 3, 1, 4).unbind(0)
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=self.causal, dropout_p=0.1 if self.training else 0.0
        )
        return self.o(y.transpose(1, 2).contiguous().view(b, t, 16))


class Shapes(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(16, 32)
        self.b = nn.Linear(16, 16)

    def forward(self, x):
        h = self.a(x)
        p, q = h.split(16, -1)
        c1, c2 = h.chunk(2, -1)
        s = torch.stack([p, q, c1], 0).sum(0)
        cat = torch.cat([s, c2], 1)
        e = x[:, :1].expand(-1, cat.shape[1], -1)
        z = cat.permute(0, 2, 1).contiguous().permute(0, 2, 1) + e
        z = z.contiguous().view(-1, 16).view(x.shape[0], -1, 16)
        r = self.b(z)
        r = r + z  # residual
        return r


class Inplace(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(16, 16)
        self.b = nn.Linear(16, 16)

    def forward(self, x):
        h = self.a(x) * 2
        h.add_(1.0)
        h.relu_()
        g = self.b(h)
        g = torch.nn.functional.relu(g, inplace=True)
        return g


class Index(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(16, 16)

    def forward(self, x):
        h = self.a(x)  # (b, t, 16)
        idx = torch.arange(0, h.shape[1], 2, device=h.device)
        s = h.index_select(1, idx)
        g = torch.gather(h, 2, torch.zeros_like(h, dtype=torch.long))
        sc = torch.zeros_like(h).scatter(
            2, torch.zeros_like(h, dtype=torch.long)[..., :1], h[..., :1]
        )
        m = h.masked_fill(h > 0, 0.0)
        c = torch.cumsum(m, 1)
        e = torch.einsum("btd,bsd->bts", h, c)
        b = torch.bmm(e, h)
        return s.sum() + g.sum() + sc.sum() + b.sum()


class Losses(nn.Module):
    def __init__(self, kind):
        super().__init__()
        self.a = nn.Linear(16, 10)
        self.kind = kind

    def forward(self, x):
        out = self.a(x.view(-1, 16))
        y = torch.arange(out.shape[0], device=out.device) % 10
        if self.kind == "ce":
            return F.cross_entropy(out, y, label_smoothing=0.2, ignore_index=3)
        if self.kind == "mse":
            return F.mse_loss(out, torch.zeros_like(out))
        return F.nll_loss(F.log_softmax(out, -1), y)


class Blocks(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(
            [
                nn.Sequential(nn.LayerNorm(16), nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))
                for _ in range(3)
            ]
        )
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        for layer in self.layers:
            x = x + layer(x)
        return self.head(x)


def seq(b: int) -> torch.Tensor:
    return torch.randn(b, 6, 16)


def img(b: int) -> torch.Tensor:
    return torch.randn(b, 3, 8, 8)


def vec(b: int) -> torch.Tensor:
    return torch.randn(b, 16)


def ids(b: int) -> torch.Tensor:
    return torch.randint(0, 100, (b, 6))


def mk(f, *a, **k):
    def model_fn():
        torch.manual_seed(0)
        return f(*a, **k)

    return model_fn


CASES = {
    "conv1d": (mk(conv1d), lambda b: torch.randn(b, 4, 12)),
    "conv2d": (mk(conv2d), img),
    "conv3d": (mk(conv3d), lambda b: torch.randn(b, 2, 4, 6, 6)),
    "convT": (mk(conv_transpose), img),
    "norms2d": (mk(norms), img),
    "bn1d-ln": (mk(BN1), vec),
    "embedding-ce": (mk(Emb), ids),
    "lstm-bi2-bf": (
        mk(RNNs, "LSTM", num_layers=2, bidirectional=True, batch_first=True),
        lambda b: torch.randn(b, 5, 8),
    ),
    "gru-2": (mk(RNNs, "GRU", num_layers=2), lambda b: torch.randn(b, 5, 8)),
    "rnn-bi": (
        mk(RNNs, "RNN", bidirectional=True, batch_first=True),
        lambda b: torch.randn(b, 5, 8),
    ),
    "mha-bf-w": (mk(MHA, True, True), seq),
    "mha-sf-now": (mk(MHA, False, False), seq),
    "mha-bf-now": (mk(MHA, True, False), seq),
    "enc-post": (mk(enc, False), seq),
    "enc-prenorm": (mk(enc, True), seq),
    "dec-post": (mk(Dec, False), seq),
    "dec-prenorm": (mk(Dec, True), seq),
    "pools-up": (mk(Pools), img),
    "dropouts": (mk(drops), img),
    "acts": (mk(Acts), vec),
    "sdpa": (mk(SDPA, False), seq),
    "sdpa-causal": (mk(SDPA, True), seq),
    "shapes": (mk(Shapes), seq),
    "inplace": (mk(Inplace), seq),
    "index": (mk(Index), seq),
    "ce": (mk(Losses, "ce"), seq),
    "mse": (mk(Losses, "mse"), seq),
    "nll": (mk(Losses, "nll"), seq),
    "blocks": (mk(Blocks), seq),
}

MODES: dict[str, dict[str, Any]] = {
    "sgd": {"optimizer": "sgd"},
    "adam": {"optimizer": "adam"},
    "no_grad": {"mode": "no_grad"},
    "eval_with_grad": {"mode": "eval_with_grad"},
    "ckpt": {"optimizer": "sgd", "checkpoint": "auto"},
    "accum": {"optimizer": "sgd_momentum", "accumulation": 2},
}
#: The cases with blocks that repeat, which checkpoint="auto" finds.
REPEATING = ("enc-post", "enc-prenorm", "dec-post", "dec-prenorm", "blocks")

#: Why a CPU run and the estimate differ, where they do: CPU kernels that allocate otherwise
#: than the meta (and CUDA) ones. None of these is memlab's to change without emulating the CPU.
CAUSES = {
    "ADAM_STEPS": "a CPU Adam keeps each parameter's float32 step counter on the parameters' "
    "device, 4 B a parameter tensor of optimizer state (CUDA and meta keep them on the host)",
    "EMBEDDING_BAG": "the CPU's _embedding_bag returns offset2bag with one element more (8 B) "
    "and max_indices of one int64 per bag in mean mode (4 bags: 32 B); meta, as CUDA, returns "
    "an empty max_indices: 40 B while saved",
    "RNN_CPU": "a CPU RNN/GRU/LSTM computes the input projection of the whole sequence in one "
    "product (RNN.cpp, FullLayer on a CPU input) and saves it; meta runs the cells step by step "
    "(a GPU runs cuDNN, emulated only with cuda_kernels)",
    "BATCH_NORM_EVAL": "in eval the CPU's native_batch_norm returns empty save_mean and "
    "save_invstd; meta, as CUDA's batch_norm_cuda, returns C floats each (2 x 4 B x C)",
    "CPU_FAST_PATH": "without grad, nn.MultiheadAttention and nn.TransformerEncoderLayer take "
    "the native fast path on a CPU; on meta they take the separate ops unless cuda_kernels "
    "emulates the fast path (scaled_dot_product_attention itself takes the CPU's kernel choice "
    "on meta: kernels/cpu_attention.py)",
    "UNDIAGNOSED": "a decoder block (in eval, or recomputed) holds 144 B of temporaries more on "
    "the CPU, one (6, 6) float32 mask's worth; not yet traced to its op",
}

EXPECTED: dict[tuple[str, str], tuple[tuple[str, ...], dict[str, int]]] = {
    ("conv1d", "adam"): (
        ("ADAM_STEPS",),
        {
            "peak": -16,
            "after": -16,
            "at_peak.optimizer_state": -16,
            "at_end.optimizer_state": -16,
            "highest.optimizer_state": -16,
        },
    ),
    ("conv2d", "adam"): (
        ("ADAM_STEPS",),
        {
            "peak": -28,
            "after": -28,
            "at_peak.optimizer_state": -28,
            "at_end.optimizer_state": -28,
            "highest.optimizer_state": -28,
        },
    ),
    ("conv3d", "adam"): (
        ("ADAM_STEPS",),
        {
            "peak": -16,
            "after": -16,
            "at_peak.optimizer_state": -16,
            "at_end.optimizer_state": -16,
            "highest.optimizer_state": -16,
        },
    ),
    ("convT", "adam"): (
        ("ADAM_STEPS",),
        {
            "peak": -24,
            "after": -24,
            "at_peak.optimizer_state": -24,
            "at_end.optimizer_state": -24,
            "highest.optimizer_state": -24,
        },
    ),
    ("norms2d", "adam"): (
        ("ADAM_STEPS",),
        {
            "peak": -40,
            "after": -40,
            "at_peak.optimizer_state": -40,
            "at_end.optimizer_state": -40,
            "highest.optimizer_state": -40,
        },
    ),
    ("norms2d", "eval_with_grad"): (
        ("BATCH_NORM_EVAL",),
        {
            "peak": 64,
            "after": 64,
            "at_peak.activation": 64,
            "at_end.activation": 64,
            "highest.activation": 64,
        },
    ),
    ("bn1d-ln", "adam"): (
        ("ADAM_STEPS",),
        {
            "peak": -32,
            "after": -32,
            "at_peak.optimizer_state": -32,
            "at_end.optimizer_state": -32,
            "highest.optimizer_state": -32,
        },
    ),
    ("bn1d-ln", "no_grad"): (
        ("BATCH_NORM_EVAL",),
        {"peak": 224, "at_peak.temporary": 224, "highest.temporary": 224},
    ),
    ("bn1d-ln", "eval_with_grad"): (
        ("BATCH_NORM_EVAL",),
        {
            "peak": 256,
            "after": 256,
            "at_peak.activation": 256,
            "at_end.activation": 256,
            "highest.activation": 256,
        },
    ),
    ("embedding-ce", "sgd"): (
        ("EMBEDDING_BAG",),
        {"peak": -40, "at_peak.activation": -40, "highest.activation": -40},
    ),
    ("embedding-ce", "adam"): (
        ("ADAM_STEPS", "EMBEDDING_BAG"),
        {
            "peak": -16,
            "after": -16,
            "at_peak.optimizer_state": -16,
            "at_end.optimizer_state": -16,
            "highest.optimizer_state": -16,
            "highest.activation": -40,
        },
    ),
    ("embedding-ce", "eval_with_grad"): (
        ("EMBEDDING_BAG",),
        {
            "peak": -40,
            "after": -40,
            "at_peak.activation": -40,
            "at_end.activation": -40,
            "highest.activation": -40,
        },
    ),
    ("embedding-ce", "accum"): (
        ("EMBEDDING_BAG",),
        {"peak": -24, "at_peak.activation": -24, "highest.activation": -24},
    ),
    ("lstm-bi2-bf", "sgd"): (
        ("RNN_CPU",),
        {
            "peak": -110848,
            "at_peak.input": 640,
            "at_peak.temporary": 29952,
            "at_peak.activation": -141440,
            "highest.temporary": -14592,
            "highest.activation": -129664,
        },
    ),
    ("lstm-bi2-bf", "adam"): (
        ("ADAM_STEPS", "RNN_CPU"),
        {
            "peak": -110912,
            "after": -64,
            "at_peak.input": 640,
            "at_peak.optimizer_state": -64,
            "at_peak.temporary": 29952,
            "at_peak.activation": -141440,
            "at_end.optimizer_state": -64,
            "highest.optimizer_state": -64,
            "highest.temporary": -13832,
            "highest.activation": -129664,
        },
    ),
    ("lstm-bi2-bf", "no_grad"): (
        ("RNN_CPU",),
        {"peak": 1408, "at_peak.temporary": 1408, "highest.temporary": 640},
    ),
    ("lstm-bi2-bf", "eval_with_grad"): (
        ("RNN_CPU",),
        {
            "peak": -127104,
            "after": -129024,
            "at_peak.temporary": 2560,
            "at_peak.activation": -129664,
            "at_end.input": 640,
            "at_end.activation": -129664,
            "highest.other": -43264,
            "highest.temporary": 2560,
            "highest.activation": -129664,
        },
    ),
    ("lstm-bi2-bf", "accum"): (
        ("RNN_CPU",),
        {
            "peak": -87040,
            "at_peak.input": 320,
            "at_peak.temporary": 16000,
            "at_peak.activation": -103360,
            "highest.temporary": -11648,
            "highest.activation": -101696,
        },
    ),
    ("gru-2", "sgd"): (
        ("RNN_CPU",),
        {
            "peak": 2752,
            "at_peak.input": 640,
            "at_peak.temporary": 2752,
            "at_peak.activation": -640,
            "highest.temporary": 2240,
            "highest.activation": -640,
        },
    ),
    ("gru-2", "adam"): (
        ("ADAM_STEPS", "RNN_CPU"),
        {
            "peak": 2720,
            "after": -32,
            "at_peak.input": 640,
            "at_peak.optimizer_state": -32,
            "at_peak.temporary": 2752,
            "at_peak.activation": -640,
            "at_end.optimizer_state": -32,
            "highest.optimizer_state": -32,
            "highest.temporary": 2240,
            "highest.activation": -640,
        },
    ),
    ("gru-2", "no_grad"): (
        ("RNN_CPU",),
        {
            "peak": -3328,
            "at_peak.other": -1280,
            "at_peak.temporary": -2048,
            "highest.temporary": -3072,
        },
    ),
    ("gru-2", "eval_with_grad"): (
        ("RNN_CPU",),
        {
            "peak": -3968,
            "at_peak.temporary": -3328,
            "at_peak.activation": -640,
            "at_end.input": 640,
            "at_end.activation": -640,
            "highest.temporary": -6400,
            "highest.activation": -640,
        },
    ),
    ("gru-2", "accum"): (
        ("RNN_CPU",),
        {
            "peak": 3008,
            "at_peak.input": 320,
            "at_peak.temporary": 3008,
            "at_peak.activation": -320,
            "highest.temporary": 2752,
            "highest.activation": -320,
        },
    ),
    ("rnn-bi", "sgd"): (
        ("RNN_CPU",),
        {
            "peak": -640,
            "at_peak.input": 640,
            "at_peak.activation": -1280,
            "highest.activation": -1280,
        },
    ),
    ("rnn-bi", "adam"): (
        ("ADAM_STEPS", "RNN_CPU"),
        {
            "peak": -672,
            "after": -32,
            "at_peak.input": 640,
            "at_peak.optimizer_state": -32,
            "at_peak.activation": -1280,
            "at_end.optimizer_state": -32,
            "highest.optimizer_state": -32,
            "highest.activation": -1280,
        },
    ),
    ("rnn-bi", "no_grad"): (
        ("RNN_CPU",),
        {"peak": -1280, "at_peak.temporary": -1280, "highest.temporary": -1280},
    ),
    ("rnn-bi", "eval_with_grad"): (
        ("RNN_CPU",),
        {
            "peak": -2560,
            "after": -640,
            "at_peak.temporary": -1280,
            "at_peak.activation": -1280,
            "at_end.input": 640,
            "at_end.activation": -1280,
            "highest.temporary": -2560,
            "highest.activation": -1280,
        },
    ),
    ("rnn-bi", "accum"): (
        ("RNN_CPU",),
        {
            "peak": -320,
            "at_peak.input": 320,
            "at_peak.activation": -640,
            "highest.temporary": 64,
            "highest.activation": -640,
        },
    ),
    ("mha-bf-w", "adam"): (
        ("ADAM_STEPS",),
        {
            "peak": -16,
            "after": -16,
            "at_peak.optimizer_state": -16,
            "at_end.optimizer_state": -16,
            "highest.optimizer_state": -16,
        },
    ),
    ("mha-bf-w", "no_grad"): (
        ("CPU_FAST_PATH",),
        {"peak": 7860, "at_peak.other": -4, "at_peak.temporary": 7864, "highest.temporary": 7864},
    ),
    ("mha-sf-now", "adam"): (
        ("ADAM_STEPS",),
        {
            "peak": -16,
            "after": -16,
            "at_peak.optimizer_state": -16,
            "at_end.optimizer_state": -16,
            "highest.optimizer_state": -16,
        },
    ),
    ("mha-bf-now", "adam"): (
        ("ADAM_STEPS",),
        {
            "peak": -16,
            "after": -16,
            "at_peak.optimizer_state": -16,
            "at_end.optimizer_state": -16,
            "highest.optimizer_state": -16,
        },
    ),
    ("mha-bf-now", "no_grad"): (
        ("CPU_FAST_PATH",),
        {
            "peak": 7680,
            "at_peak.other": -1536,
            "at_peak.temporary": 9216,
            "highest.temporary": 9216,
        },
    ),
    ("enc-post", "adam"): (
        ("ADAM_STEPS",),
        {
            "peak": -96,
            "after": -96,
            "at_peak.optimizer_state": -96,
            "at_end.optimizer_state": -96,
            "highest.optimizer_state": -96,
        },
    ),
    ("enc-post", "no_grad"): (
        ("CPU_FAST_PATH",),
        {
            "peak": 7680,
            "at_peak.other": -1536,
            "at_peak.temporary": 9216,
            "highest.temporary": 9216,
        },
    ),
    ("enc-prenorm", "adam"): (
        ("ADAM_STEPS",),
        {
            "peak": -96,
            "after": -96,
            "at_peak.optimizer_state": -96,
            "at_end.optimizer_state": -96,
            "highest.optimizer_state": -96,
        },
    ),
    ("enc-prenorm", "no_grad"): (
        ("CPU_FAST_PATH",),
        {
            "peak": 9216,
            "at_peak.other": -1536,
            "at_peak.temporary": 10752,
            "highest.temporary": 10752,
        },
    ),
    ("dec-post", "adam"): (
        ("ADAM_STEPS",),
        {
            "peak": -144,
            "after": -144,
            "at_peak.optimizer_state": -144,
            "at_end.optimizer_state": -144,
            "highest.optimizer_state": -144,
        },
    ),
    ("dec-post", "no_grad"): (
        ("UNDIAGNOSED",),
        {"peak": -144, "at_peak.temporary": -144, "highest.temporary": -144},
    ),
    ("dec-post", "eval_with_grad"): (
        ("UNDIAGNOSED",),
        {"peak": -144, "at_peak.temporary": -144, "highest.temporary": -144},
    ),
    ("dec-post", "ckpt"): (
        ("UNDIAGNOSED",),
        {"peak": -144, "at_peak.temporary": -144, "highest.temporary": -144},
    ),
    ("dec-prenorm", "adam"): (
        ("ADAM_STEPS",),
        {
            "peak": -144,
            "after": -144,
            "at_peak.optimizer_state": -144,
            "at_end.optimizer_state": -144,
            "highest.optimizer_state": -144,
        },
    ),
    ("dec-prenorm", "no_grad"): (
        ("UNDIAGNOSED",),
        {"peak": -144, "at_peak.temporary": -144, "highest.temporary": -144},
    ),
    ("dec-prenorm", "eval_with_grad"): (
        ("UNDIAGNOSED",),
        {"peak": -144, "at_peak.temporary": -144, "highest.temporary": -144},
    ),
    ("dec-prenorm", "ckpt"): (
        ("UNDIAGNOSED",),
        {"peak": -144, "at_peak.temporary": -144, "highest.temporary": -144},
    ),
    ("pools-up", "adam"): (
        ("ADAM_STEPS",),
        {
            "peak": -16,
            "after": -16,
            "at_peak.optimizer_state": -16,
            "at_end.optimizer_state": -16,
            "highest.optimizer_state": -16,
        },
    ),
    ("dropouts", "adam"): (
        ("ADAM_STEPS",),
        {
            "peak": -28,
            "after": -28,
            "at_peak.optimizer_state": -28,
            "at_end.optimizer_state": -28,
            "highest.optimizer_state": -28,
        },
    ),
    ("acts", "adam"): (
        ("ADAM_STEPS",),
        {
            "peak": -12,
            "after": -12,
            "at_peak.optimizer_state": -12,
            "at_end.optimizer_state": -12,
            "highest.optimizer_state": -12,
        },
    ),
    ("sdpa", "adam"): (
        ("ADAM_STEPS",),
        {
            "peak": -16,
            "after": -16,
            "at_peak.optimizer_state": -16,
            "at_end.optimizer_state": -16,
            "highest.optimizer_state": -16,
        },
    ),
    ("sdpa-causal", "adam"): (
        ("ADAM_STEPS",),
        {
            "peak": -16,
            "after": -16,
            "at_peak.optimizer_state": -16,
            "at_end.optimizer_state": -16,
            "highest.optimizer_state": -16,
        },
    ),
    ("shapes", "adam"): (
        ("ADAM_STEPS",),
        {
            "peak": -16,
            "after": -16,
            "at_peak.optimizer_state": -16,
            "at_end.optimizer_state": -16,
            "highest.optimizer_state": -16,
        },
    ),
    ("inplace", "adam"): (
        ("ADAM_STEPS",),
        {
            "peak": -16,
            "after": -16,
            "at_peak.optimizer_state": -16,
            "at_end.optimizer_state": -16,
            "highest.optimizer_state": -16,
        },
    ),
    ("index", "adam"): (
        ("ADAM_STEPS",),
        {
            "peak": -8,
            "after": -8,
            "at_peak.optimizer_state": -8,
            "at_end.optimizer_state": -8,
            "highest.optimizer_state": -8,
        },
    ),
    ("ce", "adam"): (
        ("ADAM_STEPS",),
        {
            "peak": -8,
            "after": -8,
            "at_peak.optimizer_state": -8,
            "at_end.optimizer_state": -8,
            "highest.optimizer_state": -8,
        },
    ),
    ("mse", "adam"): (
        ("ADAM_STEPS",),
        {
            "peak": -8,
            "after": -8,
            "at_peak.optimizer_state": -8,
            "at_end.optimizer_state": -8,
            "highest.optimizer_state": -8,
        },
    ),
    ("nll", "adam"): (
        ("ADAM_STEPS",),
        {
            "peak": -8,
            "after": -8,
            "at_peak.optimizer_state": -8,
            "at_end.optimizer_state": -8,
            "highest.optimizer_state": -8,
        },
    ),
    ("blocks", "adam"): (
        ("ADAM_STEPS",),
        {
            "peak": -80,
            "after": -80,
            "at_peak.optimizer_state": -80,
            "at_end.optimizer_state": -80,
            "highest.optimizer_state": -80,
        },
    ),
}


def differences(case: str, mode: str) -> dict[str, int]:
    """The estimate's figures less the CPU run's, where they differ: "peak", "after", and
    "<at_peak|at_end|highest>.<category>"."""
    model_fn, input_fn = CASES[case]
    config = RunConfig(batch_size=4, **MODES[mode])
    p = estimate(model_fn, input_fn, None, config, gpu=None, workspace=0, cuda_kernels=False)
    predicted = p.tensors
    real = run(
        model_fn, input_fn, None, config.with_(device="cpu"), hooks=StepHooks(foreach=True)
    ).report
    assert real is not None and real.breakdown is not None
    assert predicted.breakdown is not None
    out = {
        "peak": predicted.peak_allocated - real.peak_allocated,
        "after": predicted.allocated_after - real.allocated_after,
    }
    for what in ("at_peak", "at_end", "highest"):
        mine, theirs = getattr(predicted.breakdown, what), getattr(real.breakdown, what)
        for c in set(mine) | set(theirs):
            out[f"{what}.{c.value}"] = mine.get(c, 0) - theirs.get(c, 0)
    return {k: v for k, v in out.items() if v}


PAIRS = [(case, mode) for case in CASES for mode in MODES if mode != "ckpt" or case in REPEATING]


@pytest.mark.parametrize(("case", "mode"), PAIRS, ids=[f"{c}-{m}" for c, m in PAIRS])
def test_the_estimate_counts_what_a_cpu_run_counts(case: str, mode: str) -> None:
    causes, expected = EXPECTED.get((case, mode), ((), {}))
    assert all(c in CAUSES for c in causes)
    assert differences(case, mode) == expected


def test_adam_step_counters_are_4_bytes_a_parameter_tensor() -> None:
    # the named ADAM_STEPS difference, checked against the model rather than only recorded
    for case in ("conv2d", "blocks", "lstm-bi2-bf"):
        tensors = len(list(CASES[case][0]().parameters()))
        assert EXPECTED[(case, "adam")][1]["after"] == -4 * tensors


def test_the_meta_kernels_allocate_as_the_cpu_kernels_do() -> None:
    # the ops memlab gives meta kernels (kernels/device.py): a scalar loss keeps its storage
    x, y = torch.randn(6, 5), torch.rand(6, 5)
    calls: list[Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = [
        F.mse_loss,
        F.smooth_l1_loss,
        F.soft_margin_loss,
        lambda a, b: F.binary_cross_entropy(b, b),
        lambda a, b: F.mse_loss(a, b, reduction="sum"),
        lambda a, b: F.smooth_l1_loss(a, b, beta=0.0),
    ]
    for call in calls:
        cpu = call(x, y).untyped_storage().nbytes()
        est = estimate(
            lambda: nn.Identity(),
            lambda b: (torch.randn(6, 5), torch.rand(6, 5)),
            None,
            RunConfig(mode="no_grad"),
            step_fn=lambda model, batch, call=call: call(*batch),
            gpu=None,
            workspace=0,
            cuda_kernels=False,
        )
        assert est.tensors.allocated_after - est.tensors.allocated_before == cpu
