"""A generation's timeline: the prompt's forward labelled "prefill", each new token's "decode",
the token picked between them "other"; so the decode steps are counted against the run's own
``new_tokens``, and the phase of the peak read off the timeline."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn

import memlab
from memlab.estimate import estimate
from memlab.reports.report import Timeline
from memlab.step import RunConfig, run

transformers = pytest.importorskip("transformers")

PROMPT, BATCH = 20, 3


def stretches(timeline: Timeline) -> list[str]:
    return [phase for phase, _ in itertools.groupby(timeline.phases)]


def peak_phase(timeline: Timeline) -> str:
    i = max(range(len(timeline)), key=timeline.allocated.__getitem__)
    return timeline.phases[i]


def gpt2(vocab: int) -> nn.Module:
    return transformers.GPT2LMHeadModel(
        transformers.GPT2Config(
            n_layer=2, n_embd=64, n_head=4, vocab_size=vocab, n_positions=128,
            bos_token_id=0, eos_token_id=0, attn_implementation="eager",
        )
    )  # fmt: skip


def test_the_prefill_spike_of_full_vocabulary_logits_and_one_stretch_per_decode_step() -> None:
    vocab, new = 5000, 6
    config = RunConfig(mode="generate", new_tokens=new, batch_size=BATCH, device="cpu")
    tokens = lambda b: torch.randint(0, vocab, (b, PROMPT))  # noqa: E731
    report = run(lambda: gpt2(vocab), tokens, None, config.with_(logits="all")).report
    assert report is not None and report.timeline is not None
    tl = report.timeline
    assert peak_phase(tl) == "prefill"
    assert max(tl.allocated) == report.peak_allocated
    # the prefill's float32 logits for every prompt position are in the peak
    assert report.peak_allocated - report.allocated_before >= BATCH * PROMPT * vocab * 4
    assert stretches(tl).count("prefill") == 1
    assert stretches(tl).count("decode") == new - 1  # the last token is not fed back
    assert "forward" not in tl.phases
    # the prediction on meta labels its timeline the same way
    predicted = estimate(
        lambda: gpt2(vocab), tokens, None, config.with_(logits="all", device=None),
        gpu=None, workspace=0, cuda_kernels=False,
    )  # fmt: skip
    ptl = predicted.tensors.timeline
    assert ptl is not None and stretches(ptl).count("decode") == new - 1
    assert peak_phase(ptl) == "prefill"


class Growing(nn.Module):
    """``model(tokens, cache) -> (logits, cache)``: the cache every token's hidden state, copied
    whole at each step (as a concatenating cache does), so the last step is the peak."""

    def __init__(self, width: int = 256) -> None:
        super().__init__()
        self.embed, self.head = nn.Embedding(50, width), nn.Linear(width, 50)

    def forward(self, tokens: torch.Tensor, cache: torch.Tensor | None) -> object:
        h = self.embed(tokens)
        cache = h if cache is None else torch.cat([cache, h], dim=1)
        return self.head(h[:, -1:]), cache


def test_a_growing_cache_peaks_in_the_last_decode_step() -> None:
    new = 12
    config = RunConfig(mode="generate", new_tokens=new, batch_size=BATCH, device="cpu")
    report = run(Growing, lambda b: torch.randint(0, 50, (b, 4)), None, config).report
    assert report is not None and report.timeline is not None
    tl = report.timeline
    assert stretches(tl).count("decode") == new - 1  # the last token is not fed back
    assert peak_phase(tl) == "decode"
    # at the last step's concatenation, the old cache (4 + new - 2 tokens) and the new one
    # (4 + new - 1 tokens) are alive together: float32 rows of 256
    row = BATCH * 256 * 4
    cache_peak = (4 + new - 2) * row + (4 + new - 1) * row
    assert report.peak_allocated - report.allocated_before >= cache_peak


def test_track_labels_a_stretch_and_keeps_backward_its_own() -> None:
    w = torch.randn(64, 64, requires_grad=True)
    with memlab.track("cpu", timeline=True) as t:
        a = torch.ones(1000)
        with t.phase("decode"):
            b = torch.ones(2000)
            (w @ w).sum().backward()
        c = torch.ones(3000)
    tl = t.report.timeline
    assert tl is not None
    labels = dict(zip(tl.allocated, tl.phases, strict=True))
    before = t.report.allocated_before
    assert labels[before + a.nbytes] == "other"
    assert labels[before + a.nbytes + b.nbytes] == "decode"
    assert "backward" in tl.phases
    assert tl.phases[-1] == "other"  # c's allocation, after the block
    assert tl.allocated[-1] - tl.allocated[-2] == c.nbytes
    wrong = "phase must be one of 'prefill', 'decode', not 'fwd'"
    with pytest.raises(ValueError, match=wrong), t.phase("fwd"):
        pass
    del w
