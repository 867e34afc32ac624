"""Replaying allocator traces through the model: agreement and the first divergence.

The traces here are written by hand in the snapshot's format, each event following the caching
allocator's documented rules (2 MiB segments for small requests, 20 MiB for requests under
10 MiB, larger ones rounded up to 2 MiB; best-fit reuse of freed blocks; segments released only
by empty_cache).

Real traces, recorded on a GPU by ``benchmarks/record_traces.py`` from the cases of
`memlab.examples.cases`, are stored in ``tests/data/trace-*.json.gz``; each is replayed through
the allocator model, and each recorded training step is predicted by the estimator, here on the
CPU, against the real allocator's peaks.
"""

from __future__ import annotations

import functools
import json
import statistics
from pathlib import Path
from typing import Any

import pytest

from memlab.estimate import GPU, estimate
from memlab.estimate.gpus import matching
from memlab.estimate.trace import diff, events_of, load, read, replay, synthetic
from memlab.examples.cases import MODELS, RUNS, case_file, config

MiB = 2**20


def rules_trace() -> list[dict]:
    return synthetic(
        [
            ("segment_alloc", 0x1000_0000, 2 * MiB),  # a small request gets a 2 MiB segment
            ("alloc", 0x1000_0000, 1000),
            ("alloc", 0x1000_0400, 3000),  # the same segment: no new one
            ("segment_alloc", 0x2000_0000, 20 * MiB),  # 5 MiB < 10 MiB: a 20 MiB segment
            ("alloc", 0x2000_0000, 5 * MiB),
            ("free_requested", 0x2000_0000, 5 * MiB),
            ("free_completed", 0x2000_0000, 5 * MiB),
            ("alloc", 0x2000_0000, 4 * MiB),  # reuses the cached 20 MiB segment
            ("segment_alloc", 0x4000_0000, 30 * MiB),  # 30 MiB: its own segment, 2 MiB multiple
            ("alloc", 0x4000_0000, 30 * MiB - 100),
            ("free_completed", 0x4000_0000, 30 * MiB - 100),
            ("segment_free", 0x4000_0000, 30 * MiB),  # empty_cache(): the wholly free segment
        ]
    )


def test_a_trace_that_follows_the_rules_replays_exactly() -> None:
    r = replay(rules_trace())
    assert r.exact and r.first_divergence is None
    assert (r.allocations, r.agreed) == (5, 5)
    assert r.real_reserved == r.model_reserved == 22 * MiB
    assert r.real_requested == 1000 + 3000 + 4 * MiB
    assert r.model_allocated == 512 * 2 + 3072 + 4 * MiB  # blocks: 1000 and 3000 B round up
    assert "agreed on 5" in str(r)


def test_the_first_divergence_is_named() -> None:
    trace = rules_trace()
    # pretend the real allocator took a new segment where the rules reuse the cached one
    trace.insert(7, {"action": "segment_alloc", "addr": 0x3000_0000, "size": 20 * MiB})
    r = replay(trace)
    assert not r.exact and r.agreed == 3
    d = r.first_divergence
    assert d is not None and d.index == 8 and d.event["size"] == 4 * MiB
    assert "reserved a 20,971,520 B segment" in d.real and d.model == "reused"
    assert "first divergence: event 8 (alloc of 4,194,304 B)" in str(r)


def test_snapshots_and_files_load(tmp_path: Path) -> None:
    snapshot = {"segments": [], "device_traces": [[], rules_trace()]}
    assert events_of(snapshot) == rules_trace()  # the device with events
    path = tmp_path / "snapshot.json"
    path.write_text(json.dumps(snapshot))
    assert replay(load(path)).exact
    with pytest.raises(ValueError, match="_record_memory_history"):
        events_of({"segments": []})


def test_gzipped_snapshots_load_and_a_window_has_its_own_peaks(tmp_path: Path) -> None:
    import gzip

    path = tmp_path / "trace.json.gz"
    path.write_bytes(gzip.compress(json.dumps({"device_traces": [rules_trace()]}).encode()))
    assert load(path) == rules_trace()
    whole = replay(read(path))
    assert whole.real_peak_reserved == whole.model_peak_reserved == 52 * MiB  # 2 + 20 + 30
    assert whole.model_peak_allocated == 512 * 2 + 3072 + 4 * MiB + 30 * MiB
    # events 0-4: the 2 MiB and 20 MiB segments, and the first 5 MiB tensor
    head = replay(rules_trace(), 0, 5)
    assert head.real_peak_reserved == head.model_peak_reserved == 22 * MiB
    assert head.model_peak_allocated == 512 * 2 + 3072 + 5 * MiB


def test_a_predicted_stream_is_compared_allocation_by_allocation() -> None:
    real = synthetic([("alloc", 1, 1000), ("alloc", 2, 4096), ("alloc", 3, 8192)])
    same = diff(real, real)
    assert same.same and same.first is None and "same sizes in the same order" in str(same)
    other = synthetic([("alloc", 1, 1000), ("alloc", 2, 512), ("alloc", 3, 8192)])
    d = diff(other, real)
    assert not d.same and d.first == 1
    assert d.counts == ((4096, 0, 1), (512, 1, 0))  # the larger difference in bytes first
    assert "first difference at allocation 1: predicted [512, 8192], real [4096, 8192]" in str(d)


# -- traces recorded on a GPU ---------------------------------------------------------------
DATA = Path(__file__).parent / "data"
RECORDED = sorted(DATA.glob("trace-*.json.gz"))


def gpu_for(trace: dict[str, Any]) -> GPU:
    """The estimator's GPU for the card a trace was recorded on."""
    return matching(trace["device"], trace["memory"], int(trace["capability"].split(".")[0]))


@pytest.mark.parametrize("path", RECORDED, ids=[p.name for p in RECORDED])
def test_a_real_trace_replays_through_the_allocator_model(path: Path) -> None:
    trace: dict[str, Any] = read(path)
    assert trace["format"] == "memlab-trace/1"
    stats = trace["stats"]
    r = replay(trace)
    # every allocation served as the real allocator served it: from the cache, or from a new
    # segment of the same size; and the same bytes reserved at the end
    assert r.first_divergence is None, f"{trace['device']}, torch {trace['torch']}:\n{r}"
    assert r.model_reserved == r.real_reserved == stats["final_reserved"]
    if "measured_from" in stats:  # a what-if step: its peaks are the allocator's counters'
        step = replay(trace, stats["measured_from"], stats["measured_to"])
        assert step.real_peak_reserved == stats["peak_reserved"]  # the trace agrees with them
        assert step.model_peak_reserved == stats["peak_reserved"]
        assert step.model_peak_allocated == stats["peak_allocated"]


RUN_TRACES = [p for p in RECORDED if p.name != "trace-rules.json.gz"]


@functools.cache
def predicted(path: Path) -> tuple[float, float, str]:
    """The estimator, run here on the CPU, against one recorded step: the relative errors of its
    peak allocated and peak reserved, and where its allocation stream parts from the GPU's."""
    trace: dict[str, Any] = read(path)
    model_fn, input_fn, step = RUNS[trace["case"]]
    e = estimate(model_fn, input_fn, None, step, gpu=gpu_for(trace), trace=True)
    stats = trace["stats"]
    allocated = (e.peak_allocated - stats["peak_allocated"]) / stats["peak_allocated"]
    reserved = (e.peak_reserved - stats["peak_reserved"]) / stats["peak_reserved"]
    assert e.trace is not None
    mine = events_of(e.trace)[slice(*e.trace["measured"])]
    real = events_of(trace)[stats["measured_from"] : stats["measured_to"]]
    where = f"{trace['case']} on {trace['device']}, torch {trace['torch']}:\n" + str(
        diff(mine, real)
    )
    return allocated, reserved, where


@pytest.mark.parametrize("path", RUN_TRACES, ids=[p.name for p in RUN_TRACES])
def test_the_estimator_predicts_a_recorded_step_on_the_cpu(path: Path) -> None:
    allocated, reserved, where = predicted(path)
    # issue 19's bounds on every case (cuDNN's convolution and RNN workspaces, the reductions'
    # staging buffers and the embedding backward's temporaries are modelled); medians below
    assert abs(allocated) <= 0.05, f"peak allocated off by {allocated:+.1%}; {where}"
    assert abs(reserved) <= 0.10, f"peak reserved off by {reserved:+.1%}; {where}"


@pytest.mark.skipif(not RUN_TRACES, reason="no recorded traces in tests/data")
def test_the_estimators_median_errors_over_the_recorded_steps_meet_the_targets() -> None:
    errors = [predicted(p) for p in RUN_TRACES]
    allocated = statistics.median(abs(a) for a, _, _ in errors)
    reserved = statistics.median(abs(r) for _, r, _ in errors)
    # the targets: median 3 % for peak allocated, 8 % for peak reserved
    assert allocated <= 0.03 and reserved <= 0.08, [e[:2] for e in errors]


def test_a_window_that_starts_with_a_free_keeps_what_was_there_as_its_peak() -> None:
    # torch.cuda.reset_peak_memory_stats() sets the peak to what is allocated at that moment
    trace = synthetic(
        [
            ("segment_alloc", 0x2000_0000, 20 * MiB),
            ("alloc", 0x2000_0000, 8 * MiB),
            ("free_completed", 0x2000_0000, 8 * MiB),  # the window starts here
            ("alloc", 0x2000_0000, MiB * 2),
        ]
    )
    r = replay(trace, 2)
    assert r.model_peak_allocated == 8 * MiB and r.real_peak_reserved == 20 * MiB


def test_compact_keeps_what_replay_reads_and_drops_the_stack_frames() -> None:
    from memlab.estimate.trace import compact

    frames = [{"filename": "train.py", "line": 3, "name": "step"}]
    events = [dict(e, frames=frames, time_us=i) for i, e in enumerate(rules_trace())]
    blocks = [{"size": 4 * MiB, "requested_size": 4 * MiB, "state": "active_allocated"}]
    segment = {"address": 1, "total_size": 20 * MiB, "stream": 0, "segment_type": "large"}
    snapshot = {
        "device_traces": [events],
        "segments": [dict(segment, blocks=[dict(b, frames=frames) for b in blocks])],
    }
    small = compact(snapshot)
    assert small["device_traces"][0] == [dict(e, time_us=i) for i, e in enumerate(rules_trace())]
    assert small["segments"] == [dict(segment, blocks=blocks)]
    assert replay(small).exact


# -- the validation's runs (benchmarks/validate_estimator.py --traces), one step of each case --
VALIDATION = sorted((DATA / "validation").glob("*.json.gz"))


@pytest.mark.parametrize(
    "path", VALIDATION, ids=[p.name.removesuffix(".json.gz") for p in VALIDATION]
)
def test_the_allocator_model_replays_every_validation_run(path: Path) -> None:
    # ten models, seven configurations, recorded on a GPU (benchmarks/results/estimator-gpu.md)
    trace: dict[str, Any] = read(path)
    stats = trace["stats"]
    whole = replay(trace)
    assert whole.first_divergence is None, f"{trace['model']}, {trace['config']}:\n{whole}"
    assert whole.model_reserved == whole.real_reserved
    step = replay(trace, stats["measured_from"], stats["measured_to"])
    assert step.model_peak_allocated == stats["peak_allocated"]
    assert step.model_peak_reserved == stats["peak_reserved"]


#: Validation runs of models from torch.nn whose steps go through the kernels memlab emulates
#: (the transformer layers' fused path, pre-norm and post-norm; cuDNN's LSTM out of training).
EMULATED = [
    ("encoder (bert-base width)", "no_grad"),
    ("vit-s/16", "no_grad"),
    ("lstm", "eval with grad"),
]


@pytest.mark.parametrize(("model", "case"), EMULATED)
def test_the_estimator_predicts_validation_runs_through_the_emulated_kernels(
    model: str, case: str
) -> None:
    trace: dict[str, Any] = read(DATA / "validation" / f"{case_file(model, case)}.json.gz")
    model_fn, input_fn, _, _ = MODELS[model]
    e = estimate(model_fn, input_fn, None, config(model, case), gpu="H100 80GB")
    real = trace["stats"]["peak_allocated"]
    assert abs(e.peak_allocated - real) <= 0.01 * real, (e.peak_allocated, real)
