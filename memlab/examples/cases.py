"""The cases the estimator is checked on: each a model, its inputs, a batch and a configuration.

- `MODELS` × `CONFIGS`: the validation against a real GPU (``benchmarks/validate_estimator.py``),
  six models from torch.nn in seven configurations; `OPTIONAL` adds four from torchvision and
  transformers configurations where those are installed (`installed`).
- `RUNS`: small steps whose allocator traces are stored in ``tests/data``
  (``benchmarks/record_traces.py``).

A case's name keys its stored trace (`case_file`), so the names, sizes and configurations here
are those the traces were recorded with. Inputs are made on "cuda": the estimator puts them on
the meta device.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import nn

from memlab.examples.dense import dense_stack
from memlab.examples.language import (
    GPT,
    Encoder,
    LSTMTagger,
    transformers_bert,
    transformers_gpt2,
)
from memlab.examples.vision import (
    TorchvisionResNet50,
    ViT,
    resnet18,
    small_cnn,
    torchvision_resnet50,
    torchvision_vit_b_16,
)
from memlab.step import Amp, Mode, Optimizer, RunConfig


# -- inputs: a batch size in, a batch out -------------------------------------------------------
def ids(vocab: int, length: int, device: str = "cuda") -> Callable[[int], torch.Tensor]:
    """Batches of ``length`` token ids below ``vocab``."""
    return lambda b: torch.randint(0, vocab, (b, length), device=device)


def images(size: int, device: str = "cuda") -> Callable[[int], torch.Tensor]:
    """Batches of RGB images, ``size`` × ``size``."""
    return lambda b: torch.randn(b, 3, size, size, device=device)


def rows(width: int, device: str = "cuda") -> Callable[[int], torch.Tensor]:
    """Batches of ``width`` features."""
    return lambda b: torch.randn(b, width, device=device)


# -- the validation: models × configurations ----------------------------------------------------
#: What to checkpoint: "auto", module paths, or None for a model without blocks worth it.
Checkpoint = str | tuple[str, ...] | None


class Case(NamedTuple):
    """A validation model: how to build it and its inputs, its batch, what to checkpoint."""

    model_fn: Callable[[], nn.Module]
    input_fn: Callable[[int], Any]
    batch: int
    checkpoint: Checkpoint

    def config(self, name: str) -> RunConfig | None:
        """The configuration ``name`` of `CONFIGS` for this model, or None where it does not
        apply (checkpointing a model without blocks)."""
        changes = dict(CONFIGS[name])
        if "checkpoint" in changes:
            if self.checkpoint is None:
                return None
            changes["checkpoint"] = self.checkpoint
        return RunConfig(batch_size=self.batch, **changes)


MODELS: dict[str, Case] = {
    "mlp": Case(lambda: dense_stack(2048, 8), rows(2048), 512, "auto"),
    # the BasicBlocks of resnet18 sit at 4..11 of its Sequential
    "resnet18": Case(resnet18, images(224), 32, tuple(str(i) for i in range(4, 12))),
    "vit-s/16": Case(ViT, images(224), 32, "auto"),
    "encoder (bert-base width)": Case(Encoder, ids(30522, 256), 16, "auto"),
    "decoder (gpt-2 small)": Case(lambda: GPT(vocab=50257, ctx=512), ids(50257, 512), 4, "auto"),
    "lstm": Case(LSTMTagger, ids(10000, 128), 32, None),
}

#: Models from other libraries' configurations (no weights), by the module they need: built
#: only where it imports (`installed`), and never imported with memlab.
OPTIONAL: dict[str, dict[str, Case]] = {
    "torchvision.models": {
        "resnet-50 (torchvision)": Case(torchvision_resnet50, images(224), 32, "auto"),
        "vit-b/16 (torchvision)": Case(torchvision_vit_b_16, images(224), 32, "auto"),
    },
    "transformers": {
        "gpt-2 small (transformers)": Case(transformers_gpt2, ids(50257, 512), 4, "auto"),
        "bert-base (transformers)": Case(transformers_bert, ids(30522, 256), 16, "auto"),
    },
}

#: `OPTIONAL` models rebuilt from torch.nn, to predict their recorded cases again where their
#: library does not import (the rebuild's parameters match the recorded model's arrival).
REBUILT: dict[str, Case] = {
    "resnet-50 (torchvision)": Case(TorchvisionResNet50, images(224), 32, "auto"),
}

CONFIGS: dict[str, dict[str, Any]] = {
    "fp32 sgd": {"optimizer": "sgd"},
    "fp32 adam": {"optimizer": "adam"},
    "amp fp16 adam": {"optimizer": "adam", "amp": "fp16"},
    "amp bf16 adam": {"optimizer": "adam", "amp": "bf16"},
    "checkpoint adam": {"optimizer": "adam", "checkpoint": "auto"},
    "no_grad": {"mode": "no_grad"},
    "eval with grad": {"mode": "train", "retention": "attached", "iterations": 1},
}


def every_model() -> dict[str, Case]:
    """`MODELS` and every `OPTIONAL` model, installed or not (building one needs its library)."""
    return {**MODELS, **{n: c for named in OPTIONAL.values() for n, c in named.items()}}


def installed() -> dict[str, Case]:
    """The `OPTIONAL` models whose library imports here."""
    found: dict[str, Case] = {}
    for module, named in OPTIONAL.items():
        try:
            importlib.import_module(module)
        except Exception:  # missing, or built for another torch
            continue
        found.update(named)
    return found


def config(model: str, name: str) -> RunConfig | None:
    """The validation case ``model`` × ``name``, or None where it does not apply."""
    return every_model()[model].config(name)


def case_file(model: str, name: str) -> str:
    """A file name for the case: letters, digits, '-' and '.' only."""
    return re.sub(r"[^A-Za-z0-9.]+", "-", f"{model} {name}").strip("-")


# -- small steps, their allocator traces stored in tests/data -----------------------------------
class Run(NamedTuple):
    """A recorded step: how to build the model and its inputs, and the configuration."""

    model_fn: Callable[[], nn.Module]
    input_fn: Callable[[int], torch.Tensor]
    config: RunConfig


def _seeded(build: Callable[[], nn.Module]) -> Callable[[], nn.Module]:
    """``build`` after ``torch.manual_seed(0)``, as the traces were recorded."""

    def seeded() -> nn.Module:
        torch.manual_seed(0)
        return build()

    return seeded


_mlp = _seeded(lambda: dense_stack(1024, 4))
_gpt = _seeded(lambda: GPT(vocab=1000, ctx=128, width=128, layers=2))
_cnn = _seeded(small_cnn)
_tagger = _seeded(lambda: LSTMTagger(vocab=1000, width=128, layers=1))

#: name → the step whose trace is ``tests/data/trace-<name>.json.gz``.
RUNS: dict[str, Run] = {
    "mlp-sgd": Run(_mlp, rows(1024), RunConfig(batch_size=256, optimizer=Optimizer.SGD)),
    "mlp-adam-checkpoint": Run(_mlp, rows(1024), RunConfig(batch_size=256, checkpoint="auto")),
    "mlp-no-grad": Run(_mlp, rows(1024), RunConfig(batch_size=256, mode=Mode.NO_GRAD)),
    "gpt-adam": Run(_gpt, ids(1000, 128), RunConfig(batch_size=8)),
    "gpt-adam-bf16": Run(_gpt, ids(1000, 128), RunConfig(batch_size=8, amp=Amp.BF16)),
    "gpt-adamw-fp16": Run(
        _gpt, ids(1000, 128), RunConfig(batch_size=8, amp=Amp.FP16, optimizer=Optimizer.ADAMW)
    ),
    "cnn-adam": Run(_cnn, images(64), RunConfig(batch_size=16)),
    "lstm-sgd": Run(_tagger, ids(1000, 128), RunConfig(batch_size=8, optimizer=Optimizer.SGD)),
}
