"""What-if runs over several ranks (``world_size``, ``sharding``): one rank's figures in the
run's report, in `Comparison`'s per-rank table and in the panel, checked against the bytes of
the tensors the test made itself."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

import memlab
from memlab.core.categories import Category
from memlab.panel.ranks import fit_and_peak, overhead
from memlab.reports.units import fmt_bytes
from memlab.step import Comparison, RunConfig, RunResult, WhatIfError, run
from memlab.step.rank_view import HEAD

WIDTH, DEPTH, BATCH = 127, 4, 16  # an odd width: a shard of 2 is rounded up
MiB = 1024**2


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(DEPTH)])


def inputs(batch: int) -> torch.Tensor:
    return torch.randn(batch, WIDTH)


def loss(out: torch.Tensor) -> torch.Tensor:
    return out.sum()


def storages(tensors: list[torch.Tensor]) -> int:
    return sum(
        {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values()
    )


def truth() -> tuple[int, int, int]:
    """The test's own parameter bytes, Adam state bytes after a step, and one block's bytes."""
    m = model()
    opt = torch.optim.Adam(m.parameters(), lr=1e-3)
    loss(m(inputs(BATCH))).backward()
    opt.step()
    state = [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    params = list(m.parameters())
    return storages(params), storages(state), storages(list(m[0].parameters()))


def ceil_half(n: int) -> int:
    return -(-n // 2)  # the rule's padding: each rank holds the larger half


def sharded(sharding: str, **settings: object) -> RunResult:
    return run(
        model,
        inputs,
        loss,
        RunConfig(device="cpu", batch_size=BATCH),
        world_size=2,
        sharding=sharding,
        **settings,
    )


def test_zero1_over_two_ranks_halves_the_optimizer_state() -> None:
    params, state, _ = truth()
    r = sharded("zero1")
    assert r.ranks is not None and r.ranks.world_size == 2 and r.ranks.strategy == "zero1"
    held = r.ranks.by_category
    assert held[Category.OPTIMIZER_STATE] == ceil_half(state)
    assert held[Category.PARAMETER] == params  # not sharded by zero1
    assert held[Category.GRADIENT] == params  # nor are the gradients
    assert r.ranks.extra == params  # DDP's buckets: as large as the gradients
    assert r.ranks.moment == "optimizer step"
    assert r.rank_peak == r.ranks.total == sum(held.values()) + r.ranks.extra
    # the report itself is this process's step, whole
    assert r.report is not None and r.report.breakdown is not None
    assert r.report.breakdown.at_peak[Category.OPTIMIZER_STATE] == state


def test_fsdp_shards_parameters_and_gathers_two_units() -> None:
    params, state, unit = truth()
    r = sharded("fsdp")
    assert r.ranks is not None and r.ranks.moment == "forward and backward"
    assert r.ranks.by_category[Category.PARAMETER] == ceil_half(params)
    assert r.ranks.by_category[Category.OPTIMIZER_STATE] == ceil_half(state)
    # two units gathered, two all-gather buffers: each one Linear's parameters
    assert r.ranks.extra == 4 * unit
    keep = sharded("fsdp_no_reshard")
    assert keep.ranks is not None and keep.ranks.extra == params + 2 * unit  # every unit kept


def test_the_report_and_the_comparison_show_one_ranks_figures() -> None:
    one = run(model, inputs, loss, RunConfig(device="cpu", batch_size=BATCH))
    two = sharded("zero2")
    text, html = str(two), two._repr_html_()
    assert "batch 16 a rank, adam, zero2 over 2 ranks" in text
    assert "per rank (2 × zero2, derived from the measured step)" in text
    assert "not measured on N ranks" in text and "derived from the measured step" in html
    c = Comparison([one, two])
    table = c.to_dict()["per_rank"]
    assert [row["ranks"] for row in table] == ["1", "2 × zero2"]
    assert [row["source"] for row in table] == ["measured", "derived from the measured step"]
    assert one.report is not None and one.report.breakdown is not None
    at_peak = one.report.breakdown.at_peak
    assert table[0]["optimizer state"] == at_peak[Category.OPTIMIZER_STATE]
    assert table[0]["peak"] == one.peak
    assert two.ranks is not None and table[1]["peak"] == two.ranks.total
    names = ["parameters", "gradients", "optimizer state", "activations", "communication"]
    for row in table:  # a row adds up to its peak
        assert sum(row[n] for n in names) + row["the rest"] == row["peak"]
    assert table[1]["gradients"] == ceil_half(truth()[0])  # zero2 shards the gradients
    for name in HEAD[2:]:
        assert name in str(c) and name in c._repr_html_()
    json.dumps(c.to_dict())
    # the chart draws one rank's bytes for a run over ranks (what its budget judges)
    fig = c.plot()
    drawn = [t.get_text() for t in fig.axes[0].texts]
    assert drawn == [fmt_bytes(one.peak), fmt_bytes(two.ranks.total)]
    alone = Comparison([one])  # one rank only: no per-rank table
    assert "peak a rank" not in str(alone) and "peak a rank" not in alone._repr_html_()


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"world_size": 0}, "world_size must be a whole number ≥ 1, not 0"),
        ({"world_size": True}, "world_size must be a whole number ≥ 1, not True"),
        ({"world_size": 2, "sharding": "zero4"}, "sharding='zero4' is not one of 'none', 'ddp'"),
        ({"sharding": "zero1"}, "sharding='zero1' needs ranks .* pass world_size=2 or more"),
        ({"world_size": 4}, "world_size=4 with sharding='none': pass .* sharding='ddp'"),
        (
            {"world_size": 2, "sharding": "fsdp", "mode": "no_grad"},
            "world_size=2 .* mode='no_grad' is not one: use mode='train'",
        ),
    ],
)
def test_bad_ranks_name_the_argument_and_what_to_pass(
    settings: dict[str, object], message: str
) -> None:
    with pytest.raises(WhatIfError, match=message):
        RunConfig(**settings)  # type: ignore[arg-type]


def test_the_configuration_keeps_its_ranks() -> None:
    c = RunConfig(world_size=8, sharding="fsdp_no_reshard")
    assert c.to_dict()["world_size"] == 8 and c.to_dict()["sharding"] == "fsdp_no_reshard"
    assert RunConfig(**c.to_dict()) == c
    assert RunConfig().describe() == "train, batch 8, adam"  # one rank: as before


def test_the_panel_runs_over_ranks_and_judges_the_budget_per_rank() -> None:
    ex = memlab.Explorer(model, inputs, loss, config=RunConfig(device="cpu", batch_size=BATCH))
    assert ex.world_size.value == 1 and ex.sharding.layout.display == "none"
    assert ex.config.sharding == "none"
    ex.world_size.value = 2
    assert ex.sharding.layout.display == "" and ex.config.sharding == "ddp"
    ex.sharding.value = "fsdp"
    assert ex.world_size in ex._work.controls and ex.sharding in ex._work.controls
    r = ex.run()
    assert r is not None and r.ranks is not None and r.peak is not None
    assert "fsdp over 2 ranks" in ex.message
    assert ex.message.endswith(f"one rank peaks at {fmt_bytes(r.ranks.total)} (derived)")
    assert "per rank" in ex.table.value and "derived from the measured step" in ex.table.value
    # a budget between one rank's peak and the whole step's: fits over 2 ranks, not on one
    assert r.ranks.total < r.peak
    ex.budget.value = round((r.ranks.total + r.peak) / 2 / MiB, 3)
    budget = int(ex.budget.value * MiB)
    assert r.ranks.total < budget < r.peak
    fits = ex.run()
    assert fits is not None and not fits.oom and fit_and_peak(fits)[1] == fits.rank_peak
    ex.world_size.value = 1
    alone = ex.run()
    assert alone is not None and alone.oom and alone.ranks is None
    assert "exceeds the budget" in (alone.error or "")


def test_a_simulated_gpu_predicts_one_ranks_figures() -> None:
    params, _, _ = truth()
    ex = memlab.Explorer(
        model, inputs, loss, config=RunConfig(batch_size=BATCH, world_size=2, sharding="zero1")
    )
    assert ex.world_size.value == 2 and ex.sharding.value == "zero1"
    ex.simulate.value = "T4"
    r = ex.run()
    assert r is not None and r.predicted_for is not None and r.ranks is not None
    # Adam's exp_avg and exp_avg_sq, halved; its step counters stay on the CPU, off the GPU
    assert r.ranks.by_category[Category.OPTIMIZER_STATE] == ceil_half(2 * params)
    assert r.report is not None and overhead(r.report) > 0  # the cuBLAS workspace at least
    assert fit_and_peak(r) == (True, r.ranks.total + overhead(r.report))
    assert "derived from the prediction for T4" in ex.table.value


def test_a_model_too_big_for_one_gpu_fits_sharded_over_eight() -> None:
    # 24 layers of 8192 × 8192 on meta: 6 GiB of parameters, 30 GiB at the step's peak
    def big() -> nn.Module:
        return nn.Sequential(*[nn.Linear(8192, 8192) for _ in range(24)])

    def batch(n: int) -> torch.Tensor:
        return torch.randn(n, 8192)

    params = 24 * (8192 * 8192 + 8192) * 4
    ex = memlab.Explorer(big, batch, config=RunConfig(batch_size=8))
    ex.simulate.value = "T4"
    alone = ex.run()
    assert alone is not None and alone.oom and "predicted not to fit on T4" in ex.message
    ex.world_size.value, ex.sharding.value = 8, "fsdp"
    r = ex.run()
    assert r is not None and r.ranks is not None and not r.oom
    assert r.ranks.by_category[Category.PARAMETER] == -(-params // 8)
    assert r.ranks.by_category[Category.OPTIMIZER_STATE] == -(-2 * params // 8)
    assert r.report is not None and "would not fit on one T4" in str(r)


@pytest.mark.slow  # a search: about a dozen steps
def test_the_largest_batch_is_searched_for_one_rank() -> None:
    budget = 3 * MiB
    ex = memlab.Explorer(
        model,
        inputs,
        loss,
        config=RunConfig(device="cpu", batch_size=BATCH, world_size=2, sharding="fsdp"),
    )
    ex.budget.value = budget / MiB
    best = ex.largest_batch()
    assert best is not None and best > 0 and ex.batch_size.value == best

    def per_rank(batch: int) -> int:
        r = sharded("fsdp", batch_size=batch)
        assert r.rank_peak is not None
        return r.rank_peak

    assert per_rank(best) <= budget < per_rank(best + 1)
    one = run(model, inputs, loss, RunConfig(device="cpu", batch_size=best))
    assert one.peak is not None and one.peak > budget  # on one rank, that batch would not fit


def test_estimate_predicts_one_process_and_says_how_to_get_a_ranks_share() -> None:
    from memlab.estimate import estimate

    with pytest.raises(WhatIfError, match=r"world_size=1, then per_rank\(e, 4, \.\.\.\)"):
        estimate(model, inputs, loss, batch_size=BATCH, world_size=4, sharding="zero2", gpu="T4")
