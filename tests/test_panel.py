"""The what-if panel, driven from Python through the same path as its buttons."""

from __future__ import annotations

import torch
from torch import nn

import memlab
from memlab.whatif import RunConfig, run

WIDTH = 256


def stack() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.GELU()) for _ in range(8)])


def inputs(batch: int) -> torch.Tensor:
    return torch.randn(batch, WIDTH)


BASE = RunConfig(device="cpu", batch_size=64)


def explorer() -> memlab.Explorer:
    return memlab.Explorer(stack, inputs, config=BASE)


def test_runs_add_rows_and_redraw_the_charts() -> None:
    ex = explorer()
    first = ex.run()
    assert first is not None and first.peak == run(stack, inputs, None, BASE).peak
    ex.checkpoint.value = "auto"
    ex.run_button.click()  # the button takes the same path, on a thread of its own
    ex.wait()
    assert [r.config.describe() for r in ex.results] == [
        "train, batch 64, adam",
        "train, checkpoint auto, batch 64, adam",
    ]
    html = ex.table.value
    assert html.count("<tr>") == 3 and "checkpoint auto" in html
    assert ex.chart.value[:4] == b"\x89PNG" and ex.timeline.value[:4] == b"\x89PNG"


def test_each_control_reaches_the_configuration() -> None:
    ex = explorer()
    ex.amp.value, ex.mode.value, ex.optimizer.value = "bf16", "no_grad", "sgd"
    ex.batch_size.value, ex.budget.value = 32, 100.0
    c = ex.config
    assert (c.amp, c.mode, c.optimizer, c.batch_size, c.budget) == (
        "bf16",
        "no_grad",
        "sgd",
        32,
        100 * 1024**2,
    )
    ex.mode.value, ex.retention.value = "train", "attached"
    r = ex.run()
    assert r is not None and len(r.series) == BASE.iterations


def test_errors_show_in_one_line_and_the_panel_keeps_working() -> None:
    ex = explorer()
    ex.accumulation.value = 3  # 64 does not split into 3
    assert ex.run() is None and "divisible" in ex.status.value and not ex.results
    ex.accumulation.value = 4
    assert ex.run() is not None and len(ex.results) == 1
    broken = memlab.Explorer(lambda: 1 / 0, inputs, config=BASE)
    broken.run_button.click()
    broken.wait()
    assert "model_fn raised ZeroDivisionError" in broken.status.value and not broken.results


def test_largest_batch_that_fits_the_budget() -> None:
    ex = explorer()
    ex.budget.value = 12.0  # MiB
    best = ex.largest_batch()
    assert best is not None and best > 0 and ex.batch_size.value == best
    budget = 12 * 1024**2
    assert not run(stack, inputs, None, BASE.with_(batch_size=best, budget=budget)).oom
    assert run(stack, inputs, None, BASE.with_(batch_size=best + 1, budget=budget)).oom
    assert ex.results[-1].config.batch_size == best  # the winning run joins the comparison


def test_largest_batch_needs_a_budget() -> None:
    ex = explorer()
    assert ex.largest_batch() is None and "set a budget" in ex.status.value


def test_clear_and_display() -> None:
    ex = explorer()
    ex.run()
    ex.clear_button.click()
    assert not ex.results and ex.table.value == ""
    bundle = ex._repr_mimebundle_()
    assert "application/vnd.jupyter.widget-view+json" in bundle


def test_import_memlab_stays_light_until_the_panel_is_asked_for() -> None:
    import subprocess
    import sys

    code = (
        "import sys, memlab; before = 'ipywidgets' in sys.modules; memlab.Explorer; "
        "print(before, 'ipywidgets' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False True"


def test_simulate_a_gpu_predicts_instead_of_measuring() -> None:
    from memlab.estimate import GPUS, estimate

    ex = explorer()
    ex.simulate.value = "T4"
    ex.optimizer.value = "sgd"
    r = ex.run()
    expected = estimate(stack, inputs, None, ex.config, gpu="T4")
    assert r is not None and r.predicted_for == "T4" and not r.oom
    assert r.peak == expected.peak_allocated
    assert r.report is not None and r.report.source == "estimate"
    assert "predicted for T4" in ex.table.value and "predicted" in ex.status.value

    # a budget below the predicted reserved memory: marked, and the panel goes on
    ex.budget.value = expected.peak_reserved / 1024**2 - 1
    too_big = ex.run()
    assert too_big is not None and too_big.oom and "predicted not to fit" in ex.table.value
    assert "exceeds" in ex.status.value

    # the search for the largest batch predicts each step on the simulated GPU
    ex.budget.value = 64
    ex.simulate.value = "L4"
    best = ex.largest_batch()
    assert best is not None and best > 0
    card, budget = GPUS["L4"], 64 * 1024**2
    config = ex.config.with_(batch_size=best)
    assert estimate(stack, inputs, None, config, gpu=card).fits(budget)
    over = estimate(stack, inputs, None, config.with_(batch_size=best + 1), gpu=card)
    assert not over.fits(budget)
    # without a budget it searches the GPU's memory: here all of the search's range fits
    ex.budget.value = 0
    assert ex.largest_batch() == 1 << 16 and "search stops" in ex.status.value

    # AMP is predicted too, with CUDA's autocast policy emulated
    ex.amp.value = "bf16"
    amp = ex.run()
    assert amp is not None and amp.predicted_for == "L4" and "amp bf16" in ex.table.value


def test_predictions_are_compared_with_predictions_and_measurements_with_measurements() -> None:
    import re

    ex = explorer()
    ex.optimizer.value = "sgd"
    measured = ex.run()
    ex.simulate.value = "T4"
    first = ex.run()
    ex.batch_size.value *= 2
    second = ex.run()
    ex.simulate.value = ex.simulate.options[0]  # measure here again
    third = ex.run()
    assert all(r is not None and r.peak is not None for r in (measured, first, second, third))
    assert first is not None and first.predicted_for == "T4"
    rows = ex.table.value.split("<tr>")[2:]  # after the header row
    signed = [re.findall(r'title="(-?[\d,]+) B"', row) for row in rows]
    # each row: peak, before the step, [change], activations; a baseline row has no change
    assert len(signed[0]) == len(signed[1]) == 3
    assert second is not None and third is not None and measured is not None
    assert int(signed[2][2].replace(",", "")) == second.peak - first.peak  # type: ignore[operator]
    assert int(signed[3][2].replace(",", "")) == third.peak - measured.peak  # type: ignore[operator]
    assert third.report is not None
    assert int(signed[3][1].replace(",", "")) == third.report.allocated_before
    assert "baselines: run 1 (measured), run 2 (predicted for T4)" in ex.table.value


def test_simulate_a_custom_size_of_gpu() -> None:
    from memlab.estimate import estimate
    from memlab.estimate.gpus import HOPPER_WORKSPACE
    from memlab.panel.controls import CUSTOM

    ex = explorer()
    ex.optimizer.value = "sgd"
    assert ex.custom_gib.layout.display == "none"  # only with "custom size"
    ex.simulate.value = CUSTOM
    assert ex.custom_gib.layout.display == ""
    ex.custom_gib.value = 12
    assert ex.card is not None and ex.card.memory == 12 * 1024**3
    assert ex.card.workspace == HOPPER_WORKSPACE
    r = ex.run()
    assert r is not None and r.predicted_for == "custom 12 GiB"
    assert r.peak == estimate(stack, inputs, None, ex.config, gpu=12 * 1024**3).peak_allocated
    # the largest batch searches that card's memory (less the CUDA context allowance)
    ex.custom_gib.value = 1
    best = ex.largest_batch()
    card = ex.card
    assert best is not None and card is not None and card.usable == 512 * 1024**2
    assert estimate(stack, inputs, None, ex.config.with_(batch_size=best), gpu=card).fits()


def test_a_simulated_gpu_sets_the_budget_unless_one_was_typed() -> None:
    from memlab.estimate import GPUS

    ex = explorer()
    assert "limit: none" in ex.limit.value
    ex.simulate.value = "T4"
    usable = GPUS["T4"].usable
    assert ex.budget.value == round(usable / 1024**2, 1)  # rounded for people
    assert "the simulated T4" in ex.limit.value
    ex.simulate.value = "L4"  # follows the card while the user has not typed a budget
    assert ex.budget.value == round(GPUS["L4"].usable / 1024**2, 1)
    ex.simulate.value = ex.simulate.options[0]
    assert ex.budget.value == 0 and "limit: none" in ex.limit.value
    ex.budget.value = 98.8  # typed: it wins over a card chosen later
    ex.simulate.value = "T4"
    assert ex.budget.value == 98.8 and "your budget" in ex.limit.value
    assert ex.config.budget == int(98.8 * 1024**2)


def test_the_search_shows_progress_and_cancel_keeps_the_best_so_far() -> None:
    import time

    def slow() -> torch.nn.Module:
        time.sleep(0.15)  # each step takes a while
        return stack()

    ex = memlab.Explorer(slow, inputs, config=BASE)
    ex.budget.value = 64.0
    assert ex.cancel_button.layout.display == "none"
    ex.fit_button.click()  # on a thread: the kernel stays free, the controls wait
    deadline = time.time() + 20
    while "trying" not in ex.status.value and time.time() < deadline:
        time.sleep(0.05)
    assert "largest batch under 64.0 MiB: trying" in ex.status.value
    assert ex.run_button.disabled and ex.batch_size.disabled
    assert ex.cancel_button.layout.display == ""
    while "fits: " not in ex.status.value and time.time() < deadline:
        time.sleep(0.05)
    ex.cancel_button.click()
    ex.wait(30)
    assert "cancelled: the largest found so far" in ex.status.value
    assert not ex.run_button.disabled and ex.cancel_button.layout.display == "none"
    assert ex.batch_size.value >= 1


def test_no_empty_image_is_shown() -> None:
    ex = explorer()
    assert ex.chart.layout.display == "none" and ex.timeline.layout.display == "none"
    ex.run()
    assert ex.chart.layout.display == "" and ex.chart.value
    ex.clear()
    assert ex.chart.layout.display == "none" and ex.timeline.layout.display == "none"


def test_the_status_line_as_plain_text() -> None:
    ex = explorer()
    ex.run()
    assert ex.message == "ran train, batch 64, adam" and "<div" in ex.status.value
