"""Problems found reviewing 306f9e0..62810f1, each checked first against that code.

- estimate's model construction kept every ``device="cpu"`` factory on the CPU: a model whose
  layers are built with ``device="cpu"`` (a ``device="cpu"`` default argument) was refused as
  "a model that already exists", and a big one was allocated and initialised on the host;
- the optimizer step pre-hook that refuses a step_fn's own optimizer is process-global: a
  what-if run on the panel's thread refused the user's own ``opt.step()`` on the main thread;
- ``restored()`` failed after the run for a model made under ``torch.inference_mode()`` (set
  ``requires_grad`` and copied into its inference tensors outside inference mode);
- GPU names matched any substring of a preset's: ``H20`` (96 GB) was taken for the H200
  (141 GiB), ``H10`` for the H100; ``A10`` was said to be one of the two A100s.
- checkpointing turned ``use_cache`` off only where it ``is True`` and put back ``True``: a
  truthy ``use_cache`` (``1``) stayed on, and the original value was not what came back.
"""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

import memlab.whatif as whatif
from memlab.estimate import estimate
from memlab.estimate.gpus import gpu, parse
from memlab.estimate.redirect import build_on_meta
from memlab.step.checkpoint import checkpointed
from memlab.step.user import watching


class _CpuBuilt(nn.Module):
    """Layers built with ``device=`` a constructor argument that defaults to the CPU."""

    def __init__(self, width: int = 8, device: str = "cpu") -> None:
        super().__init__()
        self.a = nn.Linear(width, width, device=device)
        self.b = nn.Linear(width, 2, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


def test_estimate_takes_a_model_built_with_device_cpu() -> None:
    result = estimate(lambda: _CpuBuilt(), lambda b: torch.randn(b, 8), batch_size=2)
    assert result.to_dict()  # it ran, not "a model that already exists"
    model = build_on_meta(lambda: _CpuBuilt())
    assert all(p.is_meta for p in model.parameters())


def test_a_big_device_cpu_factory_is_not_made_on_the_host() -> None:
    # 2**36 float32 elements: 256 GiB, far beyond this machine; on meta it costs nothing
    model = build_on_meta(lambda: _CpuBuilt(width=2**18))
    assert model.a.weight.is_meta and model.a.weight.shape == (2**18, 2**18)


def test_small_device_cpu_values_are_still_readable_while_building() -> None:
    class Rates(nn.Module):  # transformers' ConvNeXt: drop-path rates read with .tolist()
        def __init__(self) -> None:
            super().__init__()
            rates = torch.linspace(0, 0.5, 4, device="cpu").tolist()
            self.blocks = nn.ModuleList(nn.Dropout(r) for r in rates)
            self.head = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(x)

    model = build_on_meta(Rates)
    assert [m.p for m in model.blocks] == pytest.approx([0, 0.5 / 3, 1 / 3, 0.5])
    assert model.head.weight.is_meta


def test_a_run_on_another_thread_does_not_refuse_the_users_own_optimizer() -> None:
    mine = nn.Linear(4, 4)
    opt = torch.optim.SGD(mine.parameters(), lr=0.1)
    inside, done = threading.Event(), threading.Event()

    def run_elsewhere() -> None:  # as the panel's search does, while the kernel trains
        with watching(nn.Linear(4, 4)):
            inside.set()
            done.wait(10)

    thread = threading.Thread(target=run_elsewhere)
    thread.start()
    try:
        assert inside.wait(10)
        mine(torch.randn(2, 4)).sum().backward()
        opt.step()  # the user's own step on the main thread: not refused
    finally:
        done.set()
        thread.join()


def test_a_step_fn_stepping_its_own_optimizer_is_still_refused() -> None:
    model = nn.Linear(4, 4)
    own = torch.optim.SGD(model.parameters(), lr=0.1)

    def step_fn(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
        loss = m(x).sum()
        loss.backward()
        own.step()
        return loss

    with pytest.raises(whatif.WhatIfError, match="optimizer of its own"):
        whatif.run(lambda: model, lambda b: torch.randn(b, 4), step_fn=step_fn, device="cpu")


def test_a_model_made_in_inference_mode_is_restored_without_error() -> None:
    with torch.inference_mode():
        model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    weight, mean = model[0].weight, model[1].running_mean.clone()
    result = whatif.run(
        lambda: model, lambda b: torch.randn(b, 4), mode="inference_mode", device="cpu"
    )
    assert result.peak > 0
    assert model[0].weight is weight and torch.equal(model[1].running_mean, mean)


@pytest.mark.parametrize("name", ["H20", "H10", "A10", "A1008", "100"])
def test_a_gpu_name_is_not_matched_inside_another(name: str) -> None:
    for front in (gpu, parse):
        with pytest.raises(ValueError, match=repr(name)) as e:
            front(name)
        assert "could be" not in str(e.value)  # no preset holds it as a whole word


@pytest.mark.parametrize(
    ("name", "want"),
    [("H100", "H100 80GB"), ("4090", "RTX 4090"), ("rtx", "RTX 4090"), ("a100-80gb", "A100 80GB"),
     ("h200", "H200"), ("T4", "T4"), ("a100_40GB", "A100 40GB"), ("rtx-4090", "RTX 4090"),
     ("A100 40", "A100 40GB"), ("h100-80", "H100 80GB")],
)  # fmt: skip
def test_gpu_names_people_type_still_match(name: str, want: str) -> None:
    assert gpu(name).name == parse(name).name == want  # type: ignore[union-attr]


def test_a100_alone_still_names_its_two_choices() -> None:
    with pytest.raises(ValueError, match="A100 40GB' or 'A100 80GB"):
        gpu("A100")


class _Config:
    def __init__(self, use_cache: object) -> None:
        self.use_cache = use_cache


class _Cached(nn.Module):
    def __init__(self, use_cache: object) -> None:
        super().__init__()
        self.config = _Config(use_cache)
        self.blocks = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
        self.blocks[0].config = _Config(use_cache)  # a copy, as T5's decoder stack holds

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(x)


@pytest.mark.parametrize("value", [True, 1])
def test_checkpointing_turns_a_truthy_use_cache_off_and_puts_back_the_same(value: object) -> None:
    model = _Cached(value)
    configs = [model.config, model.blocks[0].config]
    with checkpointed(model, ("blocks.0",)) as notes:
        assert [c.use_cache for c in configs] == [False, False]
        assert any("use_cache off" in n for n in notes)
    assert all(c.use_cache is value for c in configs)
    with pytest.raises(KeyboardInterrupt), checkpointed(model, ("blocks.0",)):
        raise KeyboardInterrupt
    assert all(c.use_cache is value for c in configs)


def test_a_model_that_already_exists_is_still_refused() -> None:
    existing = _CpuBuilt()

    def model_fn() -> nn.Module:
        torch.zeros(3, device="cpu")  # something small made on the CPU meanwhile
        return existing

    with pytest.raises(whatif.WhatIfError, match="already exists"):
        build_on_meta(model_fn)
    assert not existing.a.weight.is_meta
