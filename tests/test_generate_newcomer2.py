"""``mode="generate"`` as Hugging Face's ``generate(max_new_tokens=n)`` runs it: n forwards
(the prefill's logits give the first token, the last token is never fed back), so the cache
ends with the prompt and n - 1 tokens; counted with a forward pre-hook against transformers'
own ``generate()`` on tiny models built from configs, and the cache's bytes against
2 x layers x kv_heads x head_dim x 4 B x tokens x batch worked out by hand. And a plain
``model(tokens, cache) -> (logits, cache)`` whose keys and values are views of one fused qkv
output: each storage counted once, the cache seen to grow, the prefill's output let go."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

import memlab
from memlab import whatif
from memlab.core.categories import Category
from memlab.estimate import generation
from memlab.step.config import RunConfig
from memlab.step.generate import generate
from memlab.step.kvcache import cache_tensors, held_bytes, viewed_bytes
from memlab.step.user import UserStep

T = pytest.importorskip("transformers")

VOCAB, PROMPT, NEW, BATCH = 300, 12, 5, 2
GPU = (512 + 200) * 2**20  # 200 MiB left after the CUDA context allowance: 200 sequences


class FusedGPT(nn.Module):
    """Two layers of 4 heads of 16; q, k and v are views of one ``qkv`` output, and the cache
    a list of (k, v) grown with ``torch.cat``."""

    def __init__(self, width: int = 64, heads: int = 4) -> None:
        super().__init__()
        self.heads, self.emb, self.head = heads, nn.Embedding(VOCAB, width), nn.Linear(width, VOCAB)
        self.qkv = nn.ModuleList(nn.Linear(width, 3 * width) for _ in range(2))

    def forward(self, x: torch.Tensor, cache: Any = None) -> Any:
        h, new = self.emb(x), []
        b, t, d = h.shape
        for i, qkv in enumerate(self.qkv):
            q, k, v = qkv(h).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
            if cache is not None:
                k, v = torch.cat([cache[i][0], k], 2), torch.cat([cache[i][1], v], 2)
            new.append((k, v))
            a = F.scaled_dot_product_attention(q, k, v, is_causal=cache is None)
            h = h + a.transpose(1, 2).reshape(b, t, d)
        return self.head(h), new


FUSED_TOKEN = 2 * 2 * 4 * 16 * 4  # layers x (k, v) x heads x head size x float32, a sequence


def ids(batch: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, PROMPT), generator=torch.Generator().manual_seed(0))


def test_views_of_one_storage_count_it_once() -> None:
    fused = torch.zeros(3, BATCH, 4, PROMPT, 16)  # q, k and v of one layer, one storage
    _, k, v = fused
    own = torch.zeros(BATCH, 4, PROMPT, 16)
    cache = [(k, v), (own, own)]  # a tensor twice is one tensor too
    assert held_bytes(cache) == fused.nbytes + own.nbytes  # the whole fused storage stays alive
    assert viewed_bytes(cache) == k.nbytes + v.nbytes + own.nbytes  # keys and values alone


def test_a_fused_qkv_cache_grows_a_token_at_a_time() -> None:
    r = whatif.run(FusedGPT, ids, mode="generate", new_tokens=NEW, batch_size=BATCH, device="cpu")
    assert r.report is not None and r.report.breakdown is not None
    tokens = PROMPT + NEW - 1  # the last new token is never fed back
    assert r.report.breakdown.at_end[Category.KV_CACHE] == FUSED_TOKEN * tokens * BATCH
    note = next(n for n in r.report.notes if n.startswith("KV cache"))
    assert f"for {tokens} tokens x {BATCH} sequences, {FUSED_TOKEN:,} B per token" in note
    assert "fixed size" not in note


def test_one_new_token_keeps_the_prefill_s_views_and_says_what_they_hold() -> None:
    r = whatif.run(FusedGPT, ids, mode="generate", new_tokens=1, batch_size=BATCH, device="cpu")
    assert r.report is not None and r.report.breakdown is not None
    whole = 2 * 3 * 64 * PROMPT * BATCH * 4  # each layer's qkv output, queries included
    assert r.report.breakdown.at_end[Category.KV_CACHE] == whole
    note = next(n for n in r.report.notes if n.startswith("KV cache"))
    assert f"{whole:,} B for {PROMPT} tokens x {BATCH} sequences, {FUSED_TOKEN:,} B" in note
    assert f"{whole // 3:,} B of it are no keys or values" in note  # the queries' third


def test_a_plain_model_peaks_as_the_user_s_own_loop() -> None:
    r = whatif.run(FusedGPT, ids, mode="generate", new_tokens=NEW, batch_size=BATCH, device="cpu")
    torch.manual_seed(0)
    model, prompt = FusedGPT().eval(), ids(BATCH)
    with memlab.track("cpu") as t, torch.no_grad():
        logits, cache = model(prompt, None)
        tokens = [logits[:, -1:].argmax(-1)]
        for _ in range(NEW - 1):
            del logits
            logits, cache = model(tokens[-1], cache)
            tokens.append(logits[:, -1:].argmax(-1))
    assert r.report is not None and t.report is not None
    # the run makes its prompt inside the region; the loop's was made before
    assert r.report.peak_delta == t.report.peak_delta + prompt.nbytes


class Counted:
    """Each forward's input length, from a pre-hook on the model."""

    def __init__(self, model: nn.Module, name: str) -> None:
        self.lengths: list[int] = []
        model.register_forward_pre_hook(
            lambda m, a, kw: self.lengths.append((kw.get(name) if name in kw else a[0]).shape[1]),
            with_kwargs=True,
        )


def hf_bytes(cache: Any) -> int:
    return sum(
        t.untyped_storage().nbytes() for t in {id(t): t for t in cache_tensors(cache)}.values()
    )


def qwen2() -> nn.Module:
    config = T.Qwen2Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    return T.Qwen2ForCausalLM(config).eval()


@pytest.mark.parametrize("new", [1, NEW])
def test_a_decoder_makes_as_many_forwards_as_hugging_face_s_generate(new: int) -> None:
    torch.manual_seed(0)
    model, prompt = qwen2(), ids(BATCH)
    ours, theirs = Counted(model, "input_ids"), []
    user = UserStep(model, lambda b: prompt, None, None, torch.device("cpu"))
    config = RunConfig(mode="generate", new_tokens=new, batch_size=BATCH, device="cpu")
    tokens, cache, length = generate(user, config, lambda t, c: None)
    made, ours.lengths = ours.lengths, theirs
    out = model.generate(prompt, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                         return_dict_in_generate=True, pad_token_id=0)  # fmt: skip
    assert made == theirs == [PROMPT] + [1] * (new - 1)
    assert torch.equal(torch.cat(tokens, dim=1), out.sequences[:, PROMPT:])
    assert length == PROMPT + new - 1 == out.past_key_values.get_seq_length()
    by_hand = 2 * 2 * 2 * 16 * 4 * (PROMPT + new - 1) * BATCH  # layers, k/v, kv heads, 16, fp32
    assert hf_bytes(cache) == hf_bytes(out.past_key_values) == by_hand


def test_a_plain_model_makes_a_forward_a_token() -> None:
    model, prompt = FusedGPT().eval(), ids(BATCH)
    seen = Counted(model, "x")
    user = UserStep(model, lambda b: prompt, None, None, torch.device("cpu"))
    config = RunConfig(mode="generate", new_tokens=NEW, batch_size=BATCH, device="cpu")
    tokens, cache, length = generate(user, config, lambda t, c: None)
    assert seen.lengths == [PROMPT] + [1] * (NEW - 1) and len(tokens) == NEW
    assert length == PROMPT + NEW - 1 and cache[0][0].shape[2] == length


def test_an_encoder_decoder_feeds_its_start_token_and_new_tokens_less_one() -> None:
    config = T.T5Config(
        vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
        num_decoder_layers=2, decoder_start_token_id=0, pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    model = T.T5ForConditionalGeneration(config).eval()
    model.generation_config.eos_token_id = None  # memlab's loop never stops early
    prompt = {"input_ids": torch.randint(3, 64, (BATCH, 8))}
    ours, theirs = Counted(model, "decoder_input_ids"), []
    user = UserStep(model, lambda b: prompt, None, None, torch.device("cpu"))
    run = RunConfig(mode="generate", new_tokens=NEW, batch_size=BATCH, device="cpu")
    tokens, cache, length = generate(user, run, lambda t, c: None)
    made, ours.lengths = ours.lengths, theirs
    out = model.generate(**prompt, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False,
                         num_beams=1, return_dict_in_generate=True)  # fmt: skip
    assert len(made) == len(theirs) == NEW  # the start token, then NEW - 1
    assert torch.equal(torch.cat(tokens, dim=1), out.sequences[:, 1:])
    assert length == NEW == out.past_key_values.self_attention_cache.get_seq_length()
    by_hand = 2 * 2 * 4 * 8 * 4 * NEW * BATCH  # layers, k/v, heads, d_kv, fp32, tokens, batch
    assert held_bytes(cache) == by_hand


def test_the_fit_s_cache_in_bf16_holds_context_less_one_token(monkeypatch: Any) -> None:
    # each estimate stands in: its float32 cache holds the prompt and new_tokens - 1 tokens
    per_token = 2 * 2 * 2 * 16  # layers x (k, v) x kv heads x head size: elements a token

    def estimated(model_fn: Any, input_fn: Any, _: Any, config: RunConfig, gpu: Any) -> Any:
        tokens = input_fn(1).shape[1] + config.new_tokens - 1
        kv = {Category.KV_CACHE: per_token * 4 * tokens * config.batch_size}
        breakdown = SimpleNamespace(at_end=kv, at_peak=kv)
        peak = config.batch_size * 2**20
        return SimpleNamespace(oom=False, peak_reserved=peak, config=config,
                               tensors=SimpleNamespace(breakdown=breakdown))  # fmt: skip

    monkeypatch.setattr(generation, "estimate", estimated)
    fit = generation.fit_generation(qwen2, gpu=GPU, context=24, new_tokens=NEW, cache_dtype="bf16")
    assert fit.batch > 0 and fit.cache_bytes == per_token * 2 * (24 - 1) * fit.batch
