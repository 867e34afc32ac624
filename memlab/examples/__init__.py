"""Models for notebooks, tests and benchmarks, built from torch.nn alone (no downloads, no
torchvision): the ResNet-18 and ResNet-50 layouts, a GPT-2-small-sized decoder, a BERT-base-wide
encoder, a ViT-S/16-sized vision transformer, an LSTM tagger, a small CNN and MLPs.

``import memlab.examples`` imports torch and nothing else heavy. The cases the estimator is
checked on (models, inputs, configurations, stored traces' names) are in `memlab.examples.cases`.
"""

from __future__ import annotations

from typing import Any

from memlab.core.parts import part
from memlab.examples.dense import dense_stack, mlp
from memlab.examples.language import GPT, Encoder, LSTMTagger
from memlab.examples.vision import BasicBlock, Bottleneck, ViT, resnet18, resnet50, small_cnn

__all__ = [
    "GPT",
    "BasicBlock",
    "Bottleneck",
    "Encoder",
    "LSTMTagger",
    "ViT",
    "dense_stack",
    "mlp",
    "resnet18",
    "resnet50",
    "small_cnn",
]


def __getattr__(name: str) -> Any:  # (its modules, imported when first asked for)
    return part(__name__, __file__, name)
