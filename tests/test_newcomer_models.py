"""Hugging Face models the rest of the suite never builds (T5, BART, ConvNeXt, Mixtral,
ViT), tiny and from their configs, through memlab's front ends; each figure checked against
what the model itself says (its parameters' bytes, its own ``generate()``, the formula)."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F  # noqa: N812

from memlab import whatif
from memlab.core.categories import Category
from memlab.estimate import estimate
from memlab.step.config import RunConfig
from memlab.step.generate import generate
from memlab.step.user import UserStep

T = pytest.importorskip("transformers")


def param_bytes(model: torch.nn.Module) -> int:
    return sum(p.nbytes for p in model.parameters())


def t5(decoder_layers: int = 2) -> torch.nn.Module:
    config = T.T5Config(
        vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
        num_decoder_layers=decoder_layers, decoder_start_token_id=0, pad_token_id=0,
    )  # fmt: skip
    return T.T5ForConditionalGeneration(config)


def bart() -> torch.nn.Module:
    config = T.BartConfig(
        vocab_size=64, d_model=32, encoder_layers=2, decoder_layers=2, encoder_ffn_dim=64,
        decoder_ffn_dim=64, encoder_attention_heads=2, decoder_attention_heads=2,
        max_position_embeddings=32, forced_eos_token_id=None,
    )  # fmt: skip
    return T.BartForConditionalGeneration(config)


def text(batch: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(3, 64, (batch, 8))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids[:, :4] + 0}


def mixtral() -> torch.nn.Module:
    config = T.MixtralConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
        num_experts_per_tok=2, max_position_embeddings=32,
    )  # fmt: skip
    return T.MixtralForCausalLM(config)


def test_mixture_of_experts_estimates_in_float32() -> None:
    # transformers 5's experts multiply through F.grouped_mm, whose meta kernel refused fp32
    e = estimate(mixtral, lambda b: torch.randint(0, 64, (b, 8)), batch_size=2, gpu="A100 80GB")
    highest = e.report.breakdown.highest
    assert highest[Category.PARAMETER] == param_bytes(mixtral())
    assert highest[Category.GRADIENT] == param_bytes(mixtral())
    gen = estimate(mixtral, lambda b: torch.randint(0, 64, (b, 8)), batch_size=2,
                   gpu="A100 80GB", mode="generate", new_tokens=4)  # fmt: skip
    assert gen.report.breakdown.at_end[Category.KV_CACHE] > 0


@pytest.mark.parametrize("a_shape,b_shape", [((10, 8), (4, 8, 4)), ((4, 5, 8), (4, 8, 4))])
def test_grouped_product_on_meta_matches_the_cpu(a_shape: tuple, b_shape: tuple) -> None:
    from memlab.estimate.kernels.grouped import grouped_mm_kernels

    if not hasattr(F, "grouped_mm"):
        pytest.skip("no F.grouped_mm in this torch")
    offs = torch.tensor([3, 5, 8, 10], dtype=torch.int32) if len(a_shape) == 2 else None
    real = F.grouped_mm(torch.randn(a_shape), torch.randn(b_shape), offs=offs)
    meta = [torch.empty(s, device="meta") for s in (a_shape, b_shape)]
    with grouped_mm_kernels():
        out = F.grouped_mm(*meta, offs=None if offs is None else offs.to("meta"))
    assert (out.shape, out.dtype) == (real.shape, real.dtype)
    with pytest.raises(RuntimeError):  # torch's own meta kernel is back after the block
        F.grouped_mm(*meta, offs=None if offs is None else offs.to("meta"))


def test_attention_mask_estimates_as_measured() -> None:
    # transformers' SDPA mask skip reads the attention mask's values (.all()): meta has none
    e = estimate(bart, text, batch_size=2, gpu=None, cuda_kernels=False, mode="no_grad")
    r = whatif.run(bart, text, batch_size=2, device="cpu", mode="no_grad")
    assert "assumed the attention mask pads no token (not checked on meta)" in e.report.notes
    assert r.report is not None
    for cat in (Category.PARAMETER, Category.INPUT):
        assert e.report.breakdown.at_peak[cat] == r.report.breakdown.at_peak[cat]
    assert e.report.breakdown.at_end[Category.PARAMETER] == param_bytes(bart())


def test_construction_that_reads_cpu_values_builds_on_meta() -> None:
    # ConvNeXt's drop-path rates: torch.linspace(..., device="cpu").tolist() in __init__
    def convnext() -> torch.nn.Module:
        config = T.ConvNextConfig(num_stages=2, hidden_sizes=[8, 16], depths=[1, 1], num_labels=3)
        return T.ConvNextForImageClassification(config)

    e = estimate(convnext, lambda b: torch.randn(b, 3, 32, 32), batch_size=2, gpu="T4")
    assert e.report.breakdown.highest[Category.PARAMETER] == param_bytes(convnext())


@pytest.mark.parametrize("make", [t5, bart])
def test_encoder_decoder_generates_what_hugging_face_generates(make: type) -> None:
    torch.manual_seed(0)
    model = make().eval()
    model.generation_config.eos_token_id = None  # memlab's loop never stops early
    prompt = {k: v for k, v in text(2).items() if k != "labels"}
    user = UserStep(model, lambda b: prompt, None, None, torch.device("cpu"))
    config = RunConfig(mode="generate", new_tokens=4, batch_size=2, device="cpu")
    tokens, _, length = generate(user, config, lambda t, c: None)
    expected = model.generate(**prompt, max_new_tokens=4, do_sample=False, num_beams=1)
    assert torch.equal(torch.cat(tokens, dim=1), expected[:, 1:5])  # after the start token
    assert length == 4  # the start token and 3 fed back; the 4th is never fed back


def test_encoder_decoder_cache_note_counts_the_decoder() -> None:
    # 3 decoder layers beside 2 encoder layers: the per-token figure is the decoder's
    r = whatif.run(lambda: t5(decoder_layers=3), text, batch_size=2, device="cpu",
                   mode="generate", new_tokens=4)  # fmt: skip
    assert r.report is not None
    note = next(n for n in r.report.notes if n.startswith("KV cache"))
    per_token = 3 * 4 * 8 * 2 * 4  # layers x heads x d_kv x (keys, values) x fp32
    assert f"{per_token:,} B per token" in note and f"= {per_token:,} B)" in note
    cross = 3 * 2 * 4 * 8 * 4 * 8 * 2  # ... x the encoder's 8 positions x 2 sequences
    assert re.search(rf"cross-attention .*: {cross:,} B more", note)
    e = estimate(lambda: t5(decoder_layers=3), text, batch_size=2, gpu="A100 80GB",
                 mode="generate", new_tokens=4)  # fmt: skip
    measured = r.report.breakdown.at_end[Category.KV_CACHE]
    assert e.report.breakdown.at_end[Category.KV_CACHE] == measured == 4 * 2 * per_token + cross


def test_encoder_decoder_checkpoints_its_decoder() -> None:
    # T5's decoder stack holds its own copy of the config, use_cache on: a cache filled in
    # the forward and read in the recomputation failed checkpoint's check
    def batch(b: int) -> dict[str, torch.Tensor]:
        return {"input_ids": torch.randint(1, 64, (b, 16)), "labels": torch.randint(1, 64, (b, 16))}

    model = t5()
    before = [getattr(m.config, "use_cache", None) for m in model.modules() if hasattr(m, "config")]
    plain = whatif.run(t5, batch, batch_size=2, device="cpu")
    auto = whatif.run(lambda: model, batch, batch_size=2, device="cpu", checkpoint="auto")
    assert plain.report is not None and auto.report is not None
    assert "decoder.block.1" in auto.report.notes[0]
    highest = Category.ACTIVATION
    assert auto.report.breakdown.highest[highest] < plain.report.breakdown.highest[highest]
    after = [getattr(m.config, "use_cache", None) for m in model.modules() if hasattr(m, "config")]
    assert after == before and True in before  # each config's use_cache given back


def test_users_own_loop_on_a_dict_batch() -> None:
    def vit() -> torch.nn.Module:
        config = T.ViTConfig(
            hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
            image_size=16, patch_size=8, num_labels=3,
        )  # fmt: skip
        return T.ViTForImageClassification(config)

    def batch(b: int) -> dict[str, torch.Tensor]:
        return {"pixel_values": torch.randn(b, 3, 16, 16), "labels": torch.randint(0, 3, (b,))}

    def step(model: torch.nn.Module, b: dict[str, torch.Tensor]) -> torch.Tensor:
        return F.cross_entropy(model(pixel_values=b["pixel_values"]).logits, b["labels"])

    own = whatif.run(vit, batch, batch_size=2, device="cpu", optimizer="adam", step_fn=step)
    kwargs = whatif.run(vit, batch, batch_size=2, device="cpu", optimizer="adam")
    size = param_bytes(vit())
    for r in (own, kwargs):
        assert r.report is not None
        highest = r.report.breakdown.highest
        assert highest[Category.PARAMETER] == highest[Category.GRADIENT] == size
        assert 2 * size <= highest[Category.OPTIMIZER_STATE] <= 2 * size + 4096  # + step counts
