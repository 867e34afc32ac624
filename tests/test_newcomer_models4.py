"""Models a newcomer brings that the rest of the suite never builds (Swin, Falcon, Mamba,
Jamba, Wav2Vec2, and torch.nn models with parametrizations or mixed blocks), tiny and from
their configs, through memlab's front ends. Each figure is checked against a truth of its
own: a CPU run's measured bytes, the bytes of the tensors the model's own forward returns, or
the bytes of its parameters."""

from __future__ import annotations

import gc
import re
import weakref
from collections.abc import Iterator

import pytest
import torch
from torch import nn

from memlab import whatif
from memlab.core.categories import Category
from memlab.estimate import estimate
from memlab.estimate.kernels.device import device_kernels
from memlab.step import leftovers
from memlab.step.kvcache import kv_cache_bytes
from memlab.whatif import StepHooks

T = pytest.importorskip("transformers")
V = 64  # every vocabulary


def ids(b: int, n: int = 8) -> torch.Tensor:
    return torch.randint(3, V, (b, n))


def on_cpu_and_predicted(model_fn, input_fn, **settings):  # type: ignore[no-untyped-def]
    """(a CPU run's report, the estimate without CUDA's kernels): the same step twice."""
    settings = {"batch_size": 2, **settings}
    real = whatif.run(model_fn, input_fn, device="cpu", hooks=StepHooks(foreach=True), **settings)
    guess = estimate(model_fn, input_fn, gpu=None, workspace=0, cuda_kernels=False, **settings)
    assert real.report is not None
    return real.report, guess.tensors


# -- a LayerNorm handed a transposed gradient (Swin, SegFormer, Wav2Vec2) ----------------------


class NormThenMix(nn.Module):
    """A LayerNorm over (batch, positions, channels) whose output is read transposed, as
    (batch, channels, positions), to mix the positions: backward hands the norm a transposed
    gradient, and the Linear before it reshapes what the norm's backward returns (Swin's and
    SegFormer's layers lay their tensors out this way)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(32, 32)
        self.norm = nn.LayerNorm(32)
        self.mix = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mix(self.norm(self.proj(x)).transpose(1, 2).contiguous())


def test_norm_backward_on_meta_is_laid_out_as_on_the_cpu() -> None:
    # LayerNorm's and log_softmax's backward write a contiguous gradient on the CPU and on
    # CUDA; meta's kernels followed a transposed gradient's strides
    results = {}
    for device in ("cpu", "meta"):
        x = torch.randn(2, 16, 32, device=device)
        w = torch.ones(32, device=device)
        grad = torch.randn(2, 32, 16, device=device).transpose(1, 2)
        _, mean, rstd = torch.ops.aten.native_layer_norm(x, [32], w, w, 1e-5)
        with device_kernels() if device == "meta" else torch.no_grad():
            dx, dw, db = torch.ops.aten.native_layer_norm_backward(
                grad, x, [32], mean, rstd, w, w, [True, True, True]
            )
            ls = torch.ops.aten._log_softmax_backward_data(grad, x, -1, torch.float32)
        results[device] = [(t.shape, t.stride(), t.dtype) for t in (dx, dw, db, ls)]
    assert results["meta"] == results["cpu"]
    assert results["cpu"][0][1] == (512, 32, 1)  # the premise: the CPU's is contiguous


def swin() -> nn.Module:
    config = T.SwinConfig(
        image_size=32, patch_size=4, embed_dim=16, depths=[1, 1], num_heads=[2, 2],
        window_size=4, num_labels=3,
    )  # fmt: skip
    return T.SwinForImageClassification(config)


@pytest.mark.parametrize(
    ("model_fn", "input_fn"),
    [(NormThenMix, lambda b: torch.randn(b, 16, 32)), (swin, lambda b: torch.randn(b, 3, 32, 32))],
    ids=["norm-then-mix", "swin"],
)
def test_a_layer_norm_given_a_transposed_gradient_estimates_as_measured(
    model_fn, input_fn, monkeypatch
) -> None:  # type: ignore[no-untyped-def]
    # measured as the estimate counts, under the dispatch mode (see test_estimate_sweep's doc)
    monkeypatch.setenv("MEMLAB_NATIVE", "0")
    torch.manual_seed(0)
    real, guess = on_cpu_and_predicted(model_fn, input_fn, optimizer="sgd")
    assert guess.peak_allocated == real.peak_allocated
    assert guess.breakdown is not None and real.breakdown is not None
    assert guess.breakdown.at_peak == real.breakdown.at_peak
    # allocation by allocation: no copy of the norm's gradient that the CPU does not make
    assert guess.timeline is not None and real.timeline is not None
    assert guess.timeline.allocated == real.timeline.allocated


# -- the key/value cache of models whose config names its heads otherwise ---------------------


def falcon() -> nn.Module:
    config = T.FalconConfig(
        vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        multi_query=True, new_decoder_architecture=False, alibi=True, bias=False,
    )  # fmt: skip
    return T.FalconForCausalLM(config)


def own_cache(model: nn.Module, prompt: torch.Tensor) -> list[torch.Tensor]:
    """The tensors of the cache the model's own forward returns for ``prompt``."""
    with torch.no_grad():
        out = model.eval()(input_ids=prompt, use_cache=True)
    cache = out.past_key_values if "past_key_values" in out else out["cache"]
    found = []
    for layer in cache.layers:
        for value in vars(layer).values():
            tensors = value.values() if isinstance(value, dict) else [value]
            found += [t for t in tensors if isinstance(t, torch.Tensor) and t.dim()]
    return found


def test_falcon_multi_query_cache_is_one_head_by_the_formula() -> None:
    model = falcon()
    held = sum(t.nbytes for t in own_cache(model, ids(2, 5)))  # keys and values: 1 head each
    assert kv_cache_bytes(model.config, 5, 2, torch.float32) == held
    r = whatif.run(falcon, lambda b: ids(b), device="cpu", batch_size=2, mode="generate",
                   new_tokens=3)  # fmt: skip
    assert r.report is not None
    note = next(n for n in r.report.notes if n.startswith("KV cache"))
    per_token = held // (2 * 5)
    assert f"{per_token:,} B per token" in note
    assert f"1 KV heads x 8 x 2 x 4 B = {per_token:,} B)" in note


# -- caches that keep a state of fixed size (Mamba) or partly (Jamba) -------------------------


def mamba() -> nn.Module:
    config = T.MambaConfig(
        vocab_size=V, hidden_size=32, state_size=8, num_hidden_layers=2, expand=2,
        conv_kernel=4, use_mambapy=False,
    )  # fmt: skip
    return T.MambaForCausalLM(config)


def jamba() -> nn.Module:
    config = T.JambaConfig(
        vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_experts=2, num_experts_per_tok=1,
        expert_layer_period=2, expert_layer_offset=1, attn_layer_period=2, attn_layer_offset=1,
        mamba_d_state=8, mamba_d_conv=4, mamba_expand=2, use_mamba_kernels=False,
        max_position_embeddings=64,
    )  # fmt: skip
    return T.JambaForCausalLM(config)


def test_a_mamba_cache_is_said_to_be_a_state_not_bytes_per_token() -> None:
    state = sum(t.nbytes for t in own_cache(mamba(), ids(2)))  # the same for any length
    assert state == sum(t.nbytes for t in own_cache(mamba(), ids(2, 3)))
    r = whatif.run(mamba, lambda b: ids(b), device="cpu", batch_size=2, mode="generate",
                   new_tokens=3)  # fmt: skip
    assert r.report is not None and r.report.breakdown is not None
    assert r.report.breakdown.at_end[Category.KV_CACHE] == state
    note = next(n for n in r.report.notes if n.startswith("KV cache"))
    assert f"{state:,} B for 2 sequences, a state of fixed size" in note
    assert "per token" not in note


def test_a_hybrid_cache_says_its_state_apart_from_its_keys_and_values() -> None:
    model = jamba()
    short, long = own_cache(model, ids(2, 5)), own_cache(model, ids(2, 9))
    grown = sum(t.nbytes for t in long) - sum(t.nbytes for t in short)
    per_token = grown // (2 * 4)  # the attention layer's keys and values, a token
    state = sum(t.nbytes for t in long) - per_token * 9 * 2
    assert per_token == 2 * 8 * 2 * 4  # the premise: 1 attention layer, 2 KV heads of 8
    assert kv_cache_bytes(model.config, 9, 2, torch.float32) == per_token * 9 * 2
    r = whatif.run(jamba, lambda b: ids(b), device="cpu", batch_size=2, mode="generate",
                   new_tokens=3)  # fmt: skip
    assert r.report is not None
    note = next(n for n in r.report.notes if n.startswith("KV cache"))
    assert f"{per_token:,} B per token, and {state:,} B of state" in note
    assert f"(formula: 1 of 2 layers x 2 KV heads x 8 x 2 x 4 B = {per_token:,} B)" in note


# -- checkpoint="auto" over a stack of layers of more than one kind --------------------------


class Block(nn.Module):
    pass


class Mixer(Block):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(32, 128), nn.Linear(128, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.b(torch.tanh(self.a(x)))


class Gate(Block):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.g = nn.Linear(32, 32), nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.a(x) * torch.sigmoid(self.g(x))


class Hybrid(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Mixer(), Gate(), Mixer(), Gate()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


@pytest.mark.parametrize(
    ("model_fn", "input_fn", "layers"),
    [
        (Hybrid, lambda b: torch.randn(b, 16, 32), [f"layers.{i}" for i in range(4)]),
        (
            jamba,
            lambda b: {"input_ids": ids(b), "labels": ids(b)},
            ["model.layers.0", "model.layers.1"],
        ),
    ],
    ids=["blocks", "jamba"],
)
def test_checkpoint_auto_takes_a_stack_of_mixed_layers(model_fn, input_fn, layers) -> None:  # type: ignore[no-untyped-def]
    plain = whatif.run(model_fn, input_fn, device="cpu", batch_size=2)
    auto = whatif.run(model_fn, input_fn, device="cpu", batch_size=2, checkpoint="auto")
    named = whatif.run(model_fn, input_fn, device="cpu", batch_size=2, checkpoint=tuple(layers))
    assert plain.report is not None and auto.report is not None and named.report is not None
    shown = layers if len(layers) <= 3 else [layers[0], layers[1], "...", layers[-1]]
    assert f"chose {len(layers)} blocks ({', '.join(shown)})" in auto.report.notes[0]
    activation = Category.ACTIVATION
    highest = [r.report.breakdown.highest[activation] for r in (plain, auto, named)]
    assert highest[1] == highest[2] < highest[0]


# -- a library's own check of its input's values, met on meta --------------------------------


def wav2vec() -> nn.Module:
    config = T.Wav2Vec2Config(
        vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=64, conv_dim=(16, 16), conv_stride=(5, 2), conv_kernel=(10, 3),
        num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=2, mask_time_prob=0.0,
    )  # fmt: skip
    return T.Wav2Vec2ForCTC(config)


def test_a_value_check_in_library_code_is_named_with_what_to_leave_out() -> None:
    def speech(b: int) -> dict[str, torch.Tensor]:
        return {"input_values": torch.randn(b, 400), "labels": torch.randint(3, V, (b, 5))}

    with pytest.raises(whatif.WhatIfError) as caught:
        estimate(wav2vec, speech, batch_size=2, gpu="T4")
    said = str(caught.value)
    assert re.search(r"modeling_wav2vec2.py, line \d+: if labels is not None", said)
    assert "that line is in transformers, an installed library, not in your code" in said
    assert "Leave out `labels` in what input_fn returns" in said
    # what it advises runs: the same step without the labels, with a loss of one's own
    e = estimate(wav2vec, lambda b: {"input_values": torch.randn(b, 400)}, batch_size=2,
                 gpu="T4", loss_fn=lambda out: out.logits.logsumexp(-1).mean())  # fmt: skip
    params = sum(p.nbytes for p in wav2vec().parameters())
    assert e.report.breakdown is not None
    assert e.report.breakdown.highest[Category.PARAMETER] == params


# -- models whose modules form a reference cycle (torch's parametrizations) -------------------


class WeightNormed(nn.Module):
    """A model as audio models and GAN discriminators write it: weight normalization through
    torch's parametrizations, which tie the module into a reference cycle."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.utils.parametrizations.weight_norm(nn.Linear(16, 128))
        self.b = nn.Linear(128, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


def rows(b: int) -> torch.Tensor:
    return torch.randn(b, 16)


@pytest.fixture
def cyclic_garbage_stays(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Python's cyclic collector off for the test (its timing is not the test's), and no models
    given to other tests' runs."""
    monkeypatch.setattr(leftovers, "GIVEN", weakref.WeakSet())
    gc.collect()
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()
        gc.collect()


def test_the_premise_a_parametrized_model_outlives_its_last_reference() -> None:
    gc.collect()
    was = gc.isenabled()
    gc.disable()
    try:
        model = WeightNormed()
        top, normed = weakref.ref(model), weakref.ref(model.a)
        del model
        assert top() is None and normed() is not None  # the parametrized layer lingers
    finally:
        if was:
            gc.enable()


@pytest.mark.usefixtures("cyclic_garbage_stays")
def test_repeated_estimates_of_a_cyclic_model_count_its_parameters_once() -> None:
    params = sum(p.nbytes for p in WeightNormed().parameters())
    for _ in range(3):
        e = estimate(WeightNormed, rows, batch_size=4, gpu="T4")
        assert e.report.breakdown is not None
        assert e.report.breakdown.at_peak[Category.PARAMETER] == params
        assert e.report.breakdown.highest[Category.PARAMETER] == params


@pytest.mark.usefixtures("cyclic_garbage_stays")
def test_an_earlier_runs_model_still_alive_is_not_this_runs_memory() -> None:
    """A model from an earlier run kept alive (here by a reference cycle, as a user's own
    variable would) existed before this run: on the CPU its figures leave it out, and so no
    note is needed (on a GPU the device's peak holds it, and a note says so)."""
    params = sum(p.nbytes for p in WeightNormed().parameters())
    first = whatif.run(WeightNormed, rows, device="cpu", batch_size=4)
    second = whatif.run(WeightNormed, rows, device="cpu", batch_size=4)
    assert first.report is not None and second.report is not None
    for r in (first, second):
        assert not any("earlier runs" in n for n in r.report.notes)
    at_peak = [r.report.breakdown.at_peak[Category.PARAMETER] for r in (first, second)]
    assert at_peak == [params, params]


@pytest.mark.usefixtures("cyclic_garbage_stays")
def test_one_model_every_run_reuses_is_not_left_behind() -> None:
    model = WeightNormed()
    params = sum(p.nbytes for p in model.parameters())
    for _ in range(2):
        again = whatif.run(lambda: model, rows, device="cpu", batch_size=4)
        assert again.report is not None and again.report.breakdown is not None
        assert not any("earlier runs" in n for n in again.report.notes)
        assert again.report.breakdown.at_peak[Category.PARAMETER] == params
