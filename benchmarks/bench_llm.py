"""How long the estimator takes for an 8B-parameter language model built from its config on
meta (no weights, no GPU): a LoRA fine-tuning step (its base in bf16, and in bitsandbytes'
NF4 layout: QLoRA) and a generation with a KV cache. The anchor
is the same estimate for a 1/16-depth model (2 layers), measured in the same run.

    python benchmarks/bench_llm.py [--out benchmarks/results/llm-cpu.md]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import torch

from benchmarks.common import emit, header
from memlab.estimate import estimate
from memlab.reports.units import fmt_bytes
from memlab.step import RunConfig

VOCAB, CONTEXT = 128_256, 1024


def llama_8b(layers: int = 32) -> Any:  # the shape of Llama-3-8B
    import transformers

    return transformers.LlamaConfig(
        num_hidden_layers=layers, hidden_size=4096, num_attention_heads=32, num_key_value_heads=8,
        intermediate_size=14336, vocab_size=VOCAB, max_position_embeddings=8192,
        torch_dtype="bfloat16",
    )  # fmt: skip


def lora(layers: int) -> Callable[[], torch.nn.Module]:
    def model_fn() -> torch.nn.Module:
        import peft
        import transformers

        base = transformers.LlamaForCausalLM(llama_8b(layers)).to(torch.bfloat16)
        adapters = peft.LoraConfig(r=16, lora_alpha=32, target_modules=["q_proj", "v_proj"])
        return peft.get_peft_model(base, adapters)

    return model_fn


def plain(layers: int) -> Callable[[], torch.nn.Module]:
    def model_fn() -> torch.nn.Module:
        import transformers

        return transformers.LlamaForCausalLM(llama_8b(layers)).to(torch.bfloat16)

    return model_fn


def batch(b: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, VOCAB, (b, CONTEXT))
    return {"input_ids": ids, "labels": ids}


def prompt(b: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (b, CONTEXT))


CASES: dict[str, tuple[Callable[[int], Callable[[], torch.nn.Module]], Any, RunConfig]] = {
    "LoRA r=16 fine-tune, bf16, batch 1 x 1024, checkpointing": (
        lora, batch, RunConfig(batch_size=1, optimizer="adamw", checkpoint="auto"),
    ),
    "QLoRA r=16 (NF4 base, double quantization), batch 1 x 1024, checkpointing": (
        lora, batch, RunConfig(batch_size=1, optimizer="adamw", checkpoint="auto",
                               base_weights="nf4_double"),
    ),
    "generate 32 tokens after 1024, bf16, batch 4": (
        plain, prompt, RunConfig(mode="generate", new_tokens=32, batch_size=4),
    ),
}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="write the Markdown table here")
    args = parser.parse_args()
    lines = header("Estimating an 8B language model on a CPU")
    lines += [
        "| work | 8B (32 layers) | 2 layers (anchor) | ratio | predicted peak allocated |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for name, (build, inputs, config) in CASES.items():
        seconds = {}
        for layers in (2, 32):
            t0 = time.perf_counter()
            e = estimate(build(layers), inputs, None, config, gpu="H100 80GB")
            seconds[layers] = time.perf_counter() - t0
        ratio = seconds[32] / seconds[2]
        lines.append(
            f"| {name} | {seconds[32]:.1f} s | {seconds[2]:.1f} s | {ratio:.1f}x "
            f"| {fmt_bytes(e.peak_allocated)} |"
        )
    emit(lines, args.out)


if __name__ == "__main__":
    main()
