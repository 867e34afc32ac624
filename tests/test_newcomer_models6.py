"""A newcomer's own models and habits (round 6): activation checkpointing the model does itself
under AMP, and a step written for a GPU with its own ``torch.autocast("cuda")``, estimated."""

from __future__ import annotations

import traceback
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint  # imported by name, as libraries do

import memlab
from memlab import Category
from memlab.estimate import estimate
from memlab.step import WhatIfError

MEMLAB = str(Path(memlab.__file__).parent)


def _small(config: Any, vocab: int, hidden: int, layers: int, heads: int, **more: Any) -> Any:
    """A transformers config of a small model (the feed-forward twice the hidden size)."""
    return config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        **more,
    )


class Block(nn.Module):
    def __init__(self, reentrant: bool | None) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(128, 512), nn.Linear(512, 128)
        self.reentrant = reentrant

    def inner(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(nn.functional.gelu(self.fc1(x)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.reentrant is None:
            return x + self.inner(x)
        return x + checkpoint(self.inner, x, use_reentrant=self.reentrant)


def _batch(n: int) -> torch.Tensor:
    return torch.randn(n, 64, 128, requires_grad=True)


@pytest.mark.parametrize("reentrant", [False, True])
def test_a_model_s_own_checkpointing_estimates_under_amp(reentrant: bool) -> None:
    def own(n: int) -> nn.Module:
        return nn.Sequential(*[Block(reentrant) for _ in range(n)])

    def plain(n: int) -> nn.Module:
        return nn.Sequential(*[Block(None) for _ in range(n)])

    found = {}
    for name, make in (("own", own), ("plain", plain)):
        for amp in ("off", "bf16", "fp16"):
            e = estimate(lambda m=make: m(3), _batch, batch_size=8, gpu="T4", amp=amp)
            found[name, amp] = e.report.breakdown.highest[Category.ACTIVATION]
    for amp in ("bf16", "fp16"):
        # the recomputation casts as the forward did (it raised CheckpointError before)
        assert found["own", amp] < found["plain", amp]
        # saved through the forward: each block's input, the float32 residual stream, as without
        # AMP; the recomputation's own (reentrant: saved again in backward) are 16-bit
        assert found["own", amp] <= found["own", "off"]
        if not reentrant:
            assert found["own", amp] == 3 * 8 * 64 * 128 * 4


def test_a_hugging_face_model_s_gradient_checkpointing_estimates_under_amp() -> None:
    transformers = pytest.importorskip("transformers")
    config = _small(transformers.LlamaConfig, 256, 64, 2, 4, num_key_value_heads=2)

    def model(checkpointed: bool) -> Any:
        m = transformers.LlamaForCausalLM(config)
        if checkpointed:
            m.gradient_checkpointing_enable()
        return m

    def ids(n: int) -> dict[str, torch.Tensor]:
        x = torch.randint(0, 256, (n, 32))
        return {"input_ids": x, "labels": x}

    with_ckpt = estimate(lambda: model(True), ids, batch_size=4, gpu="T4", amp="bf16")
    without = estimate(lambda: model(False), ids, batch_size=4, gpu="T4", amp="bf16")
    assert (
        with_ckpt.report.breakdown.highest[Category.ACTIVATION]
        < without.report.breakdown.highest[Category.ACTIVATION]
    )


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 256)).to("cuda")


def _x(n: int) -> torch.Tensor:
    return torch.randn(n, 64, 256, device="cuda")


def _plain(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).float().square().mean()


def _own_autocast(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y = model(x)
    return y.float().square().mean()


def _old_spelling(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.autocast(device_type="cuda", dtype=torch.bfloat16):
        with torch.autocast("cuda", enabled=False):  # a part kept in float32 inside
            h = model[0](x.float())
        y = model[2](model[1](h))
    return y.float().square().mean()


def test_a_step_s_own_autocast_for_cuda_is_estimated_as_the_amp_setting_is() -> None:
    own = estimate(_mlp, _x, batch_size=8, step_fn=_own_autocast, gpu="T4")
    setting = estimate(_mlp, _x, batch_size=8, step_fn=_plain, gpu="T4", amp="bf16")
    fp32 = estimate(_mlp, _x, batch_size=8, step_fn=_plain, gpu="T4")
    assert own.peak_allocated == setting.peak_allocated < fp32.peak_allocated
    assert own.report.breakdown.highest == setting.report.breakdown.highest
    assert any("own torch.autocast('cuda', torch.bfloat16)" in n for n in own.report.notes)
    assert not any("own torch.autocast" in n for n in fp32.report.notes)
    # enabled=False inside: the first layer in float32, as CUDA would run it
    mixed = estimate(_mlp, _x, batch_size=8, step_fn=_old_spelling, gpu="T4")
    assert setting.peak_allocated < mixed.peak_allocated < fp32.peak_allocated
    # and the class is as it was afterwards: autocast on the CPU still works for real
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.bfloat16
    assert not hasattr(torch.autocast("cpu"), "memlab_emulated")


def _tiny_bert() -> Any:
    transformers = pytest.importorskip("transformers")
    config = _small(transformers.BertConfig, 128, 32, 1, 2, max_position_embeddings=32)
    return transformers.BertModel(config)


def _frames(e: BaseException) -> list[str]:
    return [f.filename for f in traceback.extract_tb(e.__traceback__)]


@pytest.mark.parametrize("front", ["run", "estimate", "graph"])
def test_a_library_model_s_own_error_keeps_its_lines_and_loses_memlab_s(front: str) -> None:
    def no_ids(n: int) -> dict[str, torch.Tensor]:  # forgot input_ids
        return {"attention_mask": torch.ones(n, 8, dtype=torch.long)}

    with pytest.raises(ValueError, match="input_ids") as caught:
        if front == "run":
            memlab.whatif.run(_tiny_bert, no_ids, batch_size=2, device="cpu")
        elif front == "estimate":
            estimate(_tiny_bert, no_ids, batch_size=2, gpu="T4")
        else:
            memlab.graph(_tiny_bert(), **no_ids(2))
    frames = _frames(caught.value)
    assert not [f for f in frames if f.startswith(MEMLAB)], frames
    assert "transformers" in frames[-1]  # where the library raised it, as without memlab


def test_a_step_fn_that_takes_other_arguments_is_told_how_it_is_called() -> None:
    with pytest.raises(WhatIfError, match=r"step_fn is called as step_fn\(model, batch\)"):
        memlab.whatif.run(
            lambda: nn.Linear(4, 4),
            lambda n: torch.randn(n, 4),
            batch_size=2,
            device="cpu",
            step_fn=lambda batch: batch.sum(),
        )

    def raises_inside(model: nn.Module, batch: torch.Tensor) -> Any:
        return len(5)  # type: ignore[arg-type]  # the user's own TypeError, from inside

    with pytest.raises(TypeError, match="has no len") as caught:
        memlab.whatif.run(
            lambda: nn.Linear(4, 4),
            lambda n: torch.randn(n, 4),
            batch_size=2,
            device="cpu",
            step_fn=raises_inside,
        )
    assert not [f for f in _frames(caught.value) if f.startswith(MEMLAB)]


def test_a_model_that_looks_for_padding_in_its_ids_estimates_without_a_mask() -> None:
    transformers = pytest.importorskip("transformers")
    config = _small(
        transformers.DebertaV2Config,
        128,
        32,
        1,
        2,
        max_position_embeddings=32,
        pad_token_id=0,
        num_labels=3,
    )

    def ids(n: int) -> dict[str, torch.Tensor]:  # no attention_mask: the model reads the ids
        return {"input_ids": torch.randint(1, 128, (n, 16))}

    e = estimate(
        lambda: transformers.DebertaV2ForSequenceClassification(config),
        ids,
        batch_size=2,
        gpu="T4",
    )
    assert e.peak_allocated > 0
    assert any("input_ids without an attention mask hold no padding" in n for n in e.report.notes)


def test_a_model_fn_returning_its_optimizer_and_a_negative_lr_are_refused_by_name() -> None:
    def with_optimizer() -> Any:
        m = nn.Linear(4, 4)
        return m, torch.optim.SGD(m.parameters(), lr=0.1)

    with pytest.raises(WhatIfError, match="return the model alone, not a tuple with an optim"):
        memlab.whatif.run(with_optimizer, lambda n: torch.randn(n, 4), batch_size=2, device="cpu")
    for lr in (-1, float("nan"), "1e-3"):
        with pytest.raises(WhatIfError, match=r"lr must be a learning rate ≥ 0 \(e\.g\. 1e-3\)"):
            memlab.whatif.run(
                lambda: nn.Linear(4, 4), lambda n: torch.randn(n, 4), batch_size=2, lr=lr
            )


@pytest.mark.parametrize("native", ["1", "0"])
def test_a_real_generate_in_a_b_cell_names_its_kv_cache(
    ip: Any, monkeypatch: pytest.MonkeyPatch, native: str
) -> None:
    pytest.importorskip("transformers")
    from conftest import run

    monkeypatch.setenv("MEMLAB_NATIVE", native)
    setup = (
        "import transformers, transformers.cache_utils as cu\n"
        "cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64,"
        " num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)\n"
        "model = transformers.LlamaForCausalLM(cfg).eval()\n"
        "ids = torch.randint(0, 128, (2, 10))\n"
        "before = cu.DynamicLayer.update"
    )
    assert run(ip, setup).success
    cell = (
        "%%gpumem -q -b -o r\n"
        "out = model.generate(ids, max_new_tokens=5, min_new_tokens=5, do_sample=False, "
        "return_dict_in_generate=True)"
    )
    assert run(ip, cell).success
    ns = ip.user_ns
    length = ns["out"].past_key_values.get_seq_length()  # the prompt and 4 tokens fed back
    held = 2 * 2 * 2 * 2 * length * 8 * 4  # keys and values, layers, batch, KV heads, head size
    breakdown = ns["r"].breakdown
    assert length == 14 and breakdown.at_end[Category.KV_CACHE] == held
    assert breakdown.highest[Category.KV_CACHE] >= held
    import transformers.cache_utils as cu  # put back as it was

    assert cu.DynamicLayer.update is ns["before"] and not hasattr(cu.Cache.update, "__wrapped__")


def test_autocast_objects_made_in_a_pre_flight_cell_are_plain_after_it(ip: Any) -> None:
    from conftest import run

    cell = (
        "%%gpumem --gpu 24GB -q\n"
        "ctx = torch.autocast('cuda', dtype=torch.bfloat16)\n"
        "lin = torch.nn.Linear(8, 8)\n"
        "def gen():\n"
        "    with torch.autocast('cuda', dtype=torch.bfloat16):\n"
        "        yield lin(torch.randn(2, 8)).dtype\n"
        "g = gen()\n"
        "inside = next(g)  # left suspended inside its autocast"
    )
    assert run(ip, cell).success
    assert ip.user_ns["inside"] == torch.bfloat16  # as CUDA would cast
    later = run(ip, "with ctx:\n    pass\nafter = torch.nn.Linear(8, 8)(torch.randn(2, 8)).dtype")
    assert later.success and ip.user_ns["after"] == torch.float32
    assert not torch.is_autocast_enabled("cuda")
    assert not hasattr(torch.nn.functional.linear, "__wrapped__")


def test_a_checkpoint_inside_autocast_disabled_recomputes_as_its_forward_ran() -> None:
    def step(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            with torch.autocast("cuda", enabled=False):
                h = checkpoint(model, x.float(), use_reentrant=False)
            return h.float().square().mean()

    e = estimate(_mlp, _x, batch_size=4, step_fn=step, gpu="T4")
    assert e.peak_allocated > 0


def test_a_learning_rate_torch_takes_is_taken() -> None:
    import numpy as np

    for lr in (np.float32(1e-3), torch.tensor(1e-3), 1e-3, 0):
        r = memlab.whatif.run(
            lambda: nn.Linear(4, 4), lambda n: torch.randn(n, 4), batch_size=2, lr=lr, device="cpu"
        )
        assert r.report is not None and r.config.lr == float(lr)


def _repeat_by_brute_force(layers: list[nn.Module]) -> tuple[int, int, int, int] | None:
    kinds = [type(m) for m in layers]
    best = None
    for length in range(1, len(layers) // 2 + 1):
        for start in range(len(layers) - 2 * length + 1):
            count = 1
            while (
                kinds[start + count * length : start + (count + 1) * length]
                == kinds[start : start + length]
            ):
                count += 1
            group = layers[start : start + length]
            if count >= 2 and any(p.requires_grad for m in group for p in m.parameters()):
                key = (count * length, -length, -start, count)
                best = key if best is None or key > best else best
    return best


def test_the_repeated_run_search_finds_what_comparing_every_slice_finds() -> None:
    import random

    from memlab.step.checkpoint import _longest_repeat

    rng = random.Random(0)
    makers = [lambda: nn.Linear(2, 2), nn.ReLU, nn.GELU, lambda: nn.LayerNorm(2)]
    for _ in range(150):
        kinds = rng.randint(1, 4)
        pattern = [makers[rng.randrange(kinds)] for _ in range(rng.randint(1, 3))]
        layers = [makers[rng.randrange(kinds)]() for _ in range(rng.randint(0, 6))]
        layers += [make() for _ in range(rng.randint(0, 4)) for make in pattern]
        layers += [makers[rng.randrange(kinds)]() for _ in range(rng.randint(0, 6))]
        for m in layers:
            for p in m.parameters():
                p.requires_grad_(rng.random() < 0.7)
        assert _longest_repeat(layers) == _repeat_by_brute_force(layers)


def test_a_graph_from_an_earlier_cell_is_read_where_torch_can_and_left_where_not(ip: Any) -> None:
    from conftest import run

    from memlab.core._torch_autograd import raw_saved_readable

    setup = (
        "net = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU())\n"
        "x = torch.randn(4, 16)\n"
        "y = net(x)"
    )
    assert run(ip, setup).success
    assert run(ip, "%%gpumem -q -b -o r\nz = 1").success
    activation = ip.user_ns["r"].breakdown.at_end.get(Category.ACTIVATION, 0)
    # x and the ReLU's output (y itself), saved; before 2.11 nothing is read
    assert activation == (2 * 4 * 16 * 4 if raw_saved_readable() else 0)
