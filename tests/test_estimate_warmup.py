"""What the estimator learned from the recorded traces about the steps before the measured one
and about where segments land: the model's arrival (cuDNN's flat LSTM weights), cuDNN's RNN
workspace and reserve space in order, the warm-up step's in-place sums (a GPU runs it without
a dispatch mode), the driver's top-down segment addresses, and torchvision's ResNet-50 rebuilt
from torch.nn. Each against the H100 traces in tests/data/validation."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from memlab.estimate import estimate
from memlab.estimate.trace import diff, events_of, read, replay
from memlab.examples.cases import MODELS, OPTIONAL, REBUILT, case_file, config

VALIDATION = Path(__file__).parent / "data" / "validation"


def recorded(model: str, case: str) -> dict[str, Any]:
    trace: dict[str, Any] = read(VALIDATION / f"{case_file(model, case)}.json.gz")
    return trace


def sequence(events: list[dict[str, Any]]) -> list[tuple[str, int]]:
    """Allocations and frees in order, as (action, size)."""
    keep = ("alloc", "free_completed")
    return [(e["action"], int(e["size"])) for e in events if e["action"] in keep]


def predict(model: str, case: str) -> Any:
    model_fn, input_fn, _, _ = {**MODELS, **REBUILT}[model]
    return estimate(model_fn, input_fn, None, config(model, case), gpu="H100 80GB", trace=True)


def test_an_lstm_arrives_as_on_the_gpu_and_its_step_reaches_the_recorded_peaks() -> None:
    # the separate weights are freed as flatten_parameters replaces them, before the head's
    # weights arrive; cuDNN's forward holds its workspace until the reserve space is taken
    e, real = predict("lstm", "fp32 adam"), recorded("lstm", "fp32 adam")
    stats = real["stats"]
    mine, theirs = sequence(events_of(e.trace)), sequence(events_of(real))
    arrival = theirs.index(("alloc", 32768))  # the optimizer's first state: after the model
    assert mine[:arrival] == theirs[:arrival]
    workspace = next(c for c in e.causes if "workspace" in c.cause)
    ours = [i for i, (_, size) in enumerate(mine) if size == workspace.size][:2]
    assert [a for a, _ in mine[ours[0] : ours[1] + 1]] == ["alloc", "alloc", "free_completed"]
    assert mine[ours[0] + 1] == theirs[ours[0] + 1]  # the reserve space, while it is held
    assert e.peak_allocated == stats["peak_allocated"]
    assert e.peak_reserved == stats["peak_reserved"]  # was 11.5 % low


@pytest.mark.parametrize(
    "name",
    [
        "mlp-fp32-sgd",
        "encoder-bert-base-width-checkpoint-adam",
        "bert-base-transformers-fp32-sgd",
        "resnet18-checkpoint-adam",
    ],
)
def test_without_the_drivers_addresses_segments_land_as_the_driver_put_them(name: str) -> None:
    # the driver handed out each new segment below the others; with increasing addresses the
    # model took other blocks among equal ones: -4.3 %, +12.6 %, +3.1 %, -2.3 % peak reserved
    trace = read(VALIDATION / f"{name}.json.gz")
    stats = trace["stats"]
    step = replay(trace, stats["measured_from"], stats["measured_to"], addresses=False)
    assert step.model_peak_reserved == stats["peak_reserved"]
    # a block taken whole (its rest too small to split) counts as allocated: within 0.2 %
    assert (
        abs(step.model_peak_allocated - stats["peak_allocated"]) <= 0.002 * stats["peak_allocated"]
    )


@pytest.mark.slow
def test_the_warm_up_sums_in_place_and_the_checkpointed_encoder_reaches_its_peak() -> None:
    # on a GPU the warm-up runs without memlab's dispatch mode: linear adds its bias into the
    # product and autograd sums a gradient that arrives twice in place (kernels/plain.py)
    model, case = "encoder (bert-base width)", "checkpoint adam"
    e, real = predict(model, case), recorded(model, case)
    stats = real["stats"]
    start, _ = e.trace["measured"]
    warm = diff(events_of(e.trace)[:start], events_of(real)[: stats["measured_from"]])
    assert warm.same, warm.text()
    assert e.peak_reserved == stats["peak_reserved"]  # was 11.2 % low
    assert abs(e.peak_allocated - stats["peak_allocated"]) <= 0.005 * stats["peak_allocated"]


def test_the_warm_up_emulation_ends_with_the_estimate() -> None:
    from memlab.estimate.kernels.plain import STATE

    def model() -> torch.nn.Module:
        return torch.nn.MultiheadAttention(32, 4, batch_first=True)

    e = estimate(
        model,
        lambda b: torch.randn(b, 16, 32),
        step_fn=lambda m, x: m(x, x, x, need_weights=False)[0].sum(),
        gpu="H100 80GB",
        batch_size=4,
    )
    assert not STATE.active and e.peak_allocated > 0
    x = torch.randn(4, 16, 32, device="meta").transpose(0, 1)
    w, b = torch.randn(8, 32, device="meta"), torch.randn(8, device="meta")
    assert torch.nn.functional.linear(x, w, b).shape == (16, 4, 8)


def test_the_rebuilt_resnet50_arrives_as_torchvisions_did() -> None:
    model_fn = REBUILT["resnet-50 (torchvision)"].model_fn
    with torch.device("meta"):
        model = model_fn()
    sizes = [
        t.numel() * t.element_size()
        for m in model.modules()
        for t in [*m._parameters.values(), *m._buffers.values()]
        if t is not None
    ]
    allocs = [
        size
        for action, size in sequence(events_of(recorded("resnet-50 (torchvision)", "fp32 sgd")))
        if action == "alloc"
    ]
    assert sum(p.numel() for p in model.parameters()) == 25_557_032
    assert sizes == allocs[: len(sizes)]


@pytest.mark.slow
def test_the_rebuilt_resnet50_with_checkpointing_is_within_its_range() -> None:
    model = "resnet-50 (torchvision)"
    e, stats = predict(model, "checkpoint adam"), recorded(model, "checkpoint adam")["stats"]
    for figure, target in (("peak_allocated", 0.05), ("peak_reserved", 0.10)):
        low, high = e.bounds[figure]
        truth = stats[figure]
        assert abs(getattr(e, figure) - truth) <= target * truth or low <= truth <= high


@pytest.mark.slow
def test_gpt2_checkpointed_with_use_cache_left_on_makes_the_stored_measurement() -> None:
    # the stored GPU run of this case came from a runner that left use_cache on under
    # checkpointing; the estimator's runner turns it off, so its row in RESULTS.md is 4 % low.
    # With the cache kept on, as in that run, the estimate is the measurement.
    transformers = pytest.importorskip("transformers")
    model_fn, input_fn, _, _ = OPTIONAL["transformers"]["gpt-2 small (transformers)"]

    def cache_kept_on() -> torch.nn.Module:
        model = model_fn()
        kind = type(model.config)
        assert issubclass(kind, transformers.PretrainedConfig)
        # a subclass of this one model's configuration, whose use_cache stays on
        model.config.__class__ = type(
            "KeptOn", (kind,), {"use_cache": property(lambda _: True, lambda _, v: None)}
        )
        return model

    case = config("gpt-2 small (transformers)", "checkpoint adam")
    e = estimate(cache_kept_on, input_fn, None, case, gpu="H100 80GB")
    stats = recorded("gpt-2 small (transformers)", "checkpoint adam")["stats"]
    assert e.peak_allocated == stats["peak_allocated"]
    assert e.peak_reserved == stats["peak_reserved"]
