"""What a user meets first when estimating their own model: Hugging Face checkpointing and
``use_cache``, a validation loop with grad on, ``checkpoint="auto"`` on a plain Sequential, and
AMP's ``cross_entropy`` as CUDA runs it. Each checked against a real CPU run of the same step
(the tensor bytes memlab counts there) or the tensors the test made."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

from memlab.core import _torch
from memlab.core.ledger import default_ledger
from memlab.estimate import estimate
from memlab.estimate.autocast import emulated
from memlab.region import track
from memlab.step import RunConfig, StepHooks, WhatIfError, run
from memlab.step.checkpoint import checkpointed, repeated_runs

transformers = pytest.importorskip("transformers")

VOCAB, SEQ = 500, 32


def gpt2(**config: Any) -> nn.Module:
    return transformers.GPT2LMHeadModel(
        transformers.GPT2Config(
            n_layer=2,
            n_embd=64,
            n_head=4,
            vocab_size=VOCAB,
            n_positions=64,
            attn_implementation="eager",  # the same ops on the CPU and on meta (no kernel choice)
            **config,
        )
    )


def llama(**config: Any) -> nn.Module:  # grouped-query attention: 4 heads, 2 key/value heads
    return transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            num_hidden_layers=2,
            hidden_size=64,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=128,
            vocab_size=VOCAB,
            max_position_embeddings=64,
            attn_implementation="eager",
            **config,
        )
    )


def with_hf_checkpointing(build: Callable[[], nn.Module]) -> Callable[[], nn.Module]:
    def model_fn() -> nn.Module:
        model = build()
        kwargs = {"use_reentrant": False}
        if hasattr(model, "activation_checkpointing_enable"):  # its name in newer transformers
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        return model

    return model_fn


def tokens(batch: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, VOCAB, (batch, SEQ))
    return {"input_ids": ids, "labels": ids}


def predicted_and_measured(model_fn: Callable[[], nn.Module], config: RunConfig) -> tuple[Any, Any]:
    """The estimate with the CPU's own kernels (no CUDA differences), and a real CPU run."""
    predicted = estimate(model_fn, tokens, None, config, gpu=None, workspace=0, cuda_kernels=False)
    real = run(model_fn, tokens, None, config.with_(device="cpu"), hooks=StepHooks(foreach=True))
    assert real.report is not None
    return predicted, real.report


CASES = {
    "gpt2-hf-checkpointing": with_hf_checkpointing(gpt2),
    "llama-gqa-hf-checkpointing": with_hf_checkpointing(llama),
    "gpt2-use-cache-off": lambda: gpt2(use_cache=False),
}


@pytest.mark.parametrize("name", list(CASES))
def test_hugging_face_models_without_a_cache_estimate_as_a_cpu_run_measures(name: str) -> None:
    # Without a KV cache (HF's checkpointing turns it off in training), transformers reads the
    # position ids' values to detect packed sequences: on meta that used to stop the estimate.
    config = RunConfig(batch_size=4, optimizer="sgd_momentum")
    predicted, real = predicted_and_measured(CASES[name], config)
    # the CPU run also makes the check's own few integer tensors (position differences and
    # their running sum, batch x sequence each), which the estimate skips with the check
    check = 3 * 4 * SEQ * 8
    assert 0 <= real.peak_allocated - predicted.tensors.peak_allocated <= check
    assert predicted.tensors.allocated_after == real.allocated_after
    assert "assumed sequences are not packed (not checked on meta)" in predicted.notes


def test_memlab_checkpointing_turns_use_cache_off_as_hugging_face_does() -> None:
    config = RunConfig(batch_size=4, optimizer="sgd", checkpoint="auto")
    ours, real = predicted_and_measured(gpt2, config)
    hf, _ = predicted_and_measured(with_hf_checkpointing(gpt2), config.with_(checkpoint="off"))
    # the same blocks recomputed, and no key/value cache kept across them: the same bytes
    assert ours.tensors.peak_allocated == real.peak_allocated == hf.tensors.peak_allocated
    assert "use_cache off while checkpointing, as Hugging Face does in training" in ours.notes
    assert any(
        n.startswith("checkpoint='auto' chose 2 blocks (transformer.h.0") for n in ours.notes
    )
    model = gpt2()
    run(lambda: model, tokens, None, config.with_(device="cpu"))
    assert model.config.use_cache is True  # the user's config as it was


def test_eval_with_grad_keeps_the_forward_s_graph_as_the_retention_run_does() -> None:
    mode = RunConfig(batch_size=4, mode="eval_with_grad")
    predicted, real = predicted_and_measured(gpt2, mode)
    assert predicted.tensors.peak_allocated == real.peak_allocated
    assert predicted.tensors.allocated_after == real.allocated_after
    retention = RunConfig(batch_size=4, retention="attached", iterations=1)
    same, _ = predicted_and_measured(gpt2, retention)
    assert same.tensors.peak_allocated == predicted.tensors.peak_allocated
    no_grad, _ = predicted_and_measured(gpt2, RunConfig(batch_size=4, mode="no_grad"))
    # what the forgotten no_grad costs: the saved activations, kept with the output
    assert real.allocated_after - real.allocated_before > 0
    assert predicted.tensors.peak_allocated > no_grad.tensors.peak_allocated
    assert not mode.training


def mlp() -> nn.Sequential:
    return nn.Sequential(
        nn.Flatten(),
        *(layer for _ in range(16) for layer in (nn.Linear(256, 256), nn.ReLU())),
        nn.Linear(256, 10),
    )


def test_auto_checkpoint_finds_the_repeated_layers_of_a_plain_sequential() -> None:
    (found,) = repeated_runs(mlp())
    assert (found.path, found.start, found.length, found.count) == ("", 1, 2, 16)
    assert found.per_segment == 4
    assert found.pattern == ("Linear", "ReLU")
    images = lambda b: torch.randn(b, 16, 16)  # noqa: E731
    config = RunConfig(batch_size=1024, optimizer="sgd", device="cpu")
    plain = run(mlp, images, None, config).report
    ckpt = run(mlp, images, None, config.with_(checkpoint="auto")).report
    assert plain is not None and ckpt is not None
    # kept: 16 ReLU outputs without; 4 segment inputs + the last segment's 8 + one segment
    # recomputed (8) at most with; each 1024 x 256 float32
    activation = 1024 * 256 * 4
    assert plain.peak_allocated - ckpt.peak_allocated >= 3 * activation
    assert any(
        n.startswith("checkpoint='auto' chose 16 runs of (Linear, ReLU) in the model, layers 1-32")
        for n in ckpt.notes
    )


def test_checkpointed_runs_give_the_same_gradients_and_leave_the_model_as_it_was() -> None:
    torch.manual_seed(0)
    model, x = mlp(), torch.randn(8, 16, 16)
    model(x).square().mean().backward()
    expected = [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]
    model.zero_grad(set_to_none=True)
    with checkpointed(model, "auto") as notes:
        assert "forward" in vars(model)
        model(x).square().mean().backward()
    assert notes and "forward" not in vars(model)
    for p, want in zip(model.parameters(), expected, strict=True):
        assert torch.equal(p.grad, want)  # type: ignore[arg-type]


def test_auto_checkpoint_that_finds_nothing_says_what_to_pass() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Dropout())
    with pytest.raises(WhatIfError, match=r"checkpoint='auto' found nothing.*checkpoint=\("):
        run(lambda: model, lambda b: torch.randn(b, 4), None, device="cpu", checkpoint="auto")


def test_amp_cross_entropy_runs_cuda_s_composite_without_an_extra_float32_copy() -> None:
    # the premise, from the installed torch's dispatcher: on CUDA, autocast does not cast at
    # cross_entropy_loss (it does on the CPU), but at nll_loss, inside its composite
    assert not _torch.has_kernel("cross_entropy_loss", "AutocastCUDA")
    assert _torch.has_kernel("nll_loss", "AutocastCUDA")
    rows, vocab = 256, 1000
    with torch.device("meta"):
        logits = torch.randn(rows, vocab, dtype=torch.float16, requires_grad=True)
        target = torch.zeros(rows, dtype=torch.long)
    with emulated(torch.float16), track("meta") as region:
        loss = F.cross_entropy(logits, target)
    default_ledger().settle()
    # 16-bit log-probabilities (log_softmax with the input's dtype), then nll_loss's float32
    # copy of them; the loss itself is a scalar
    half, single = rows * vocab * 2, rows * vocab * 4
    report = region.report
    assert half + single <= report.peak_allocated - report.allocated_before < half + single + 64
    assert loss.dtype == torch.float32
    grad = torch.autograd.grad(loss, logits)[0]
    assert grad.dtype == torch.float16 and grad.is_meta


class LossInForward(nn.Module):
    """A model whose forward computes its own loss and returns ``(loss, logits)``."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> Any:
        logits = self.net(x)
        return F.cross_entropy(logits, y), logits


def test_a_forward_that_returns_its_loss_is_trained_on_that_loss() -> None:
    into_loss: list[torch.Tensor] = []
    model = LossInForward()

    def watch(module: nn.Module, args: Any, out: Any) -> None:
        out[0].register_hook(into_loss.append)

    model.register_forward_hook(watch)
    batch = lambda b: (torch.randn(b, 64), torch.randint(0, 10, (b,)))  # noqa: E731
    run(lambda: model, batch, None, device="cpu", optimizer="sgd", warmup=False)
    # backward started at the model's own loss (d loss / d loss = 1), not at a default loss
    # built on top of it (the mean square would send 2 x loss into it)
    (grad,) = into_loss
    assert grad.item() == 1.0
    assert model.net.weight.grad is None  # taken off again: the run leaves the model as it was


@pytest.mark.slow
def test_a_model_fn_that_imports_transformers_itself_estimates_too() -> None:
    # transformers is first imported inside model_fn, after the estimate has begun: its value
    # check is answered all the same (in a fresh process, where nothing imported it before)
    import subprocess
    import sys

    code = """if True:
        import torch, sys
        from memlab.estimate import estimate
        assert "transformers" not in sys.modules
        def model_fn():
            import transformers
            config = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=100,
                                             use_cache=False)
            return transformers.GPT2LMHeadModel(config)
        e = estimate(model_fn, lambda b: torch.randint(0, 100, (b, 16)), batch_size=2)
        print(e.notes[-1])
    """
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().endswith("assumed sequences are not packed (not checked on meta)")


class FloatRotary(nn.Module):
    """A layer that computes in float32 as transformers 4's rotary embeddings do: inside
    ``torch.autocast(x.device.type, enabled=False)``, which PyTorch refuses for ``meta``."""

    def __init__(self, force: bool) -> None:
        super().__init__()
        self.force = force
        self.proj = nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.force:
            with torch.autocast(device_type=x.device.type, enabled=False):
                x = x.float() * 2
        else:
            x = x.float() * 2
        return self.proj(x)


def test_library_code_that_turns_autocast_off_on_the_tensors_device_estimates() -> None:
    """On meta, ``torch.autocast("meta")`` raises 'unsupported scalarType' in every PyTorch: the
    estimate makes it a null context for its run (as transformers 5 does), so such a model
    estimates, to the byte as the same model without the block; after it, PyTorch's own."""
    original = torch.autocast
    with pytest.raises(RuntimeError, match="scalarType"):
        torch.autocast("meta", enabled=False)
    figures = [
        estimate(lambda f=force: FloatRotary(f), lambda b: torch.randn(b, 32), batch_size=4)
        for force in (True, False)
    ]
    assert figures[0].peak_allocated == figures[1].peak_allocated > 0
    assert torch.autocast is original and torch.amp.autocast is original
