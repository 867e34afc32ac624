"""The user's own training step: ``step_fn(model, batch) -> loss`` for a loss that needs
targets, measured by `run` and predicted by `estimate` alike, with a tuple, a dict and a Hugging
Face batch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

from memlab import Category, Explorer
from memlab.estimate import estimate
from memlab.whatif import RunConfig, StepHooks, WhatIfError, run


def net() -> nn.Module:
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10))


def labelled(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(n, 32), torch.randint(0, 10, (n,))


def cross_entropy(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(x), y)


def test_a_criterion_with_targets_runs_and_its_inputs_are_counted() -> None:
    r = run(net, labelled, step_fn=cross_entropy, device="cpu", batch_size=16, optimizer="sgd")
    assert r.report is not None and r.report.breakdown is not None
    # the batch's two tensors, as inputs: 16 × 32 float32 and 16 int64 targets
    assert r.report.breakdown.highest[Category.INPUT] == 16 * 32 * 4 + 16 * 8
    params = sum(p.numel() * 4 for p in net().parameters())
    assert r.report.breakdown.highest[Category.GRADIENT] == params


def test_without_step_fn_a_tuple_the_forward_refuses_says_to_use_step_fn() -> None:
    with pytest.raises(WhatIfError, match=r"refused the 2 argument.*step_fn=lambda model, batch"):
        run(net, labelled, device="cpu")


def test_a_dict_batch_with_keyword_arguments() -> None:
    class Tagger(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(100, 16)
            self.out = nn.Linear(16, 5)

        def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
            return self.out(self.emb(ids) * mask[..., None])

    def batch(n: int) -> dict[str, torch.Tensor]:
        return {
            "ids": torch.randint(0, 100, (n, 12)),
            "mask": torch.ones(n, 12),
            "tags": torch.randint(0, 5, (n, 12)),
        }

    def step(model: nn.Module, b: dict[str, torch.Tensor]) -> torch.Tensor:
        logits = model(b["ids"], b["mask"])
        return F.cross_entropy(logits.flatten(0, 1), b["tags"].flatten())

    r = run(Tagger, batch, step_fn=step, device="cpu", batch_size=4)
    assert r.report is not None and r.report.breakdown is not None
    assert r.report.breakdown.highest[Category.INPUT] == 4 * 12 * (8 + 4 + 8)


def test_a_hugging_face_model_s_own_loss() -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=500, n_positions=64)

    def model() -> nn.Module:
        return transformers.GPT2LMHeadModel(config)

    def batch(n: int) -> dict[str, torch.Tensor]:
        ids = torch.randint(0, 500, (n, 32))
        return {"input_ids": ids, "labels": ids}

    step = run(model, batch, step_fn=lambda m, b: m(**b).loss, device="cpu", batch_size=2)
    own = run(model, batch, device="cpu", batch_size=2)  # the default: the output's loss
    assert step.report is not None and own.report is not None
    assert step.report.breakdown is not None and own.report.breakdown is not None
    mine, theirs = step.report.breakdown.highest, own.report.breakdown.highest
    for c in (Category.PARAMETER, Category.GRADIENT, Category.OPTIMIZER_STATE, Category.INPUT):
        assert mine[c] == theirs[c]
    assert mine[Category.ACTIVATION] == theirs[Category.ACTIVATION]
    # the step returns the loss alone, so the output (its logits) is freed before backward,
    # where memlab's default keeps the output until backward is done
    assert mine[Category.TEMPORARY] < theirs[Category.TEMPORARY]


def test_the_estimate_runs_the_same_step_on_meta() -> None:
    config = RunConfig(batch_size=16, optimizer="sgd")
    predicted = estimate(
        net, labelled, config=config, step_fn=cross_entropy, gpu=None, workspace=0
    ).tensors
    real = run(
        net,
        labelled,
        None,
        config.with_(device="cpu"),
        step_fn=cross_entropy,
        hooks=StepHooks(foreach=True),
    ).report
    assert real is not None and real.breakdown is not None and predicted.breakdown is not None
    assert predicted.peak_allocated == real.peak_allocated
    assert predicted.breakdown.highest == real.breakdown.highest


def test_code_written_for_cuda_in_the_step_and_the_loss_runs_on_meta() -> None:
    def on_gpu(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(n, 32, device="cuda"), torch.randint(0, 10, (n,), device="cuda")

    def step(model: nn.Module, b: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        weights = torch.ones(10, device="cuda")  # a loss that names the GPU
        return F.cross_entropy(model(b[0]), b[1].to("cuda"), weight=weights)

    e = estimate(lambda: net().cuda(), on_gpu, step_fn=step, gpu="T4", batch_size=8)
    assert e.fits() and e.peak_allocated > 0

    def loss(out: torch.Tensor) -> torch.Tensor:
        return (out - torch.zeros(out.shape, device="cuda")).pow(2).mean()

    e = estimate(lambda: net().cuda(), lambda n: torch.randn(n, 32, device="cuda"), loss, gpu="T4")
    assert e.fits()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"step_fn": cross_entropy, "loss_fn": lambda out: out.sum()}, "give loss_fn or step_fn"),
        ({"step_fn": 3}, "step_fn must be a function of \\(model, batch\\), not int"),
        (
            {"step_fn": lambda m, b: m(b[0])},
            "step_fn must return the scalar loss .* not \\(8, 10\\)",
        ),
    ],
)
def test_step_fn_mistakes_name_the_argument(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(WhatIfError, match=message):
        run(net, labelled, device="cpu", batch_size=8, **kwargs)  # type: ignore[arg-type]


def test_a_batch_given_for_input_fn_says_to_pass_a_function() -> None:
    """A tensor where the function that makes one belongs: the run and the estimate name the
    argument, what it got (not its values) and what to pass, before anything runs."""
    said = r"input_fn must be a function, not a tensor of shape \(8, 32\): e\.g\. input_fn=lambda n"
    x = torch.randn(8, 32)
    with pytest.raises(WhatIfError, match=said):
        run(net, x, device="cpu", batch_size=8)  # type: ignore[arg-type]
    with pytest.raises(WhatIfError, match=said):
        estimate(net, x, batch_size=8, gpu="T4")  # type: ignore[arg-type]
    with pytest.raises(WhatIfError, match=r"loss_fn must be a function, not int 3: e\.g\."):
        estimate(net, labelled, loss_fn=3, batch_size=8, gpu="T4")  # type: ignore[arg-type]


def test_a_dict_with_a_name_the_forward_does_not_take_names_both() -> None:
    said = r"refused the keyword argument\(s\) input_fn returned \(inp: .*forward takes \(input\)"
    with pytest.raises(WhatIfError, match=said):
        run(net, lambda n: {"inp": torch.randn(n, 32)}, device="cpu", batch_size=8)


def test_the_panel_takes_a_step_fn() -> None:
    ex = Explorer(net, labelled, step_fn=cross_entropy, config=RunConfig(device="cpu"))
    result = ex.run()
    assert result is not None and result.error is None and result.peak


def test_no_grad_with_step_fn_returns_the_output() -> None:
    r = run(net, labelled, step_fn=lambda m, b: m(b[0]), device="cpu", mode="no_grad")
    assert r.report is not None and r.error is None
