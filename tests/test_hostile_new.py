"""Hostile and newcomer inputs to the newer public APIs: `fit_generation`, `load_snapshot`,
`memlab.distributed.launch`, `RunConfig`'s newer fields, ``%%gpumem --gpu`` and
`AllocationRecord`. Each bad input must get an error that names the argument, what it got and
what to pass; the user's own values, exceptions and profiler must come through untouched."""

from __future__ import annotations

import faulthandler
import gzip
import io
import json
import os
import pickle
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import bounded, run
from IPython.core.error import UsageError
from torch import nn

from memlab.core.allocations import AllocationRecord
from memlab.distributed import RankError, launch
from memlab.estimate import fit_generation
from memlab.snapshot import SnapshotError, load_snapshot
from memlab.snapshot.synthetic import training_snapshot
from memlab.step import RunConfig, WhatIfError

MiB = 1024**2
GPU = 512 * MiB + 160 * MiB
HOSTILE = "<script>alert(1)</script><img src=x onerror=alert(2)>"


# -- fit_generation ---------------------------------------------------------------------------


def llama() -> nn.Module:
    transformers = pytest.importorskip("transformers")
    model: nn.Module = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            num_hidden_layers=1, hidden_size=32, num_attention_heads=2, num_key_value_heads=2,
            intermediate_size=32, vocab_size=64, max_position_embeddings=256,
        )
    )  # fmt: skip
    return model


def _never_built() -> nn.Module:
    raise AssertionError("the model was built before the arguments were checked")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"context": 0}, r"context=0 leaves no prompt: pass at least 17"),
        ({"context": -1}, r"context=-1 leaves no prompt: pass at least 17"),
        ({"context": 64.0}, r"context must be a whole number, not 64\.0"),
        ({"context": "64"}, r"context must be a whole number, not '64'"),
        ({"batch": 0}, r"batch=0 has no sequence: pass at least 1"),
        ({"batch": True}, r"batch must be a whole number, not True"),
        ({"context": 64, "cache_dtype": ["fp8"]}, r"cache_dtype must be one of 'fp32'.*\['fp8'\]"),
        ({"context": 64, "input_fn": 5}, r"input_fn got int 5: pass a function input_fn\(batch"),
    ],
)
def test_fit_generation_checks_its_arguments_before_building_the_model(
    kwargs: dict[str, Any], message: str
) -> None:
    with pytest.raises(WhatIfError, match=message):
        fit_generation(_never_built, gpu=GPU, **kwargs)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"world_size": 2, "sharding": "ddp"}, r"world_size=2 is a setting of a training step"),
        ({"offload": "activations"}, r"offload='activations' is a .*pass offload='off'"),
        ({"retention": "attached"}, r"retention='attached' is a .*pass retention='off'"),
        ({"batch_size": 4}, r"searches the batch itself: pass batch=4 .* not batch_size"),
    ],
)
def test_fit_generation_names_a_training_setting_it_cannot_take(
    settings: dict[str, Any], message: str
) -> None:
    with pytest.raises(WhatIfError, match=message):
        fit_generation(_never_built, gpu=GPU, context=64, **settings)
    if "batch_size" not in settings:  # the same through config=
        with pytest.raises(WhatIfError, match=message):
            fit_generation(_never_built, gpu=GPU, context=64, config=RunConfig(**settings))


def test_fit_generation_refuses_a_context_beyond_the_models_positions() -> None:
    config: Any = llama().config
    positions = int(config.max_position_embeddings)  # the model's own limit
    with pytest.raises(WhatIfError, match=rf"context={positions + 1:,} is longer than the model"):
        fit_generation(llama, gpu=GPU, context=positions + 1)
    with pytest.raises(WhatIfError, match=r"context=1,000,000,000,000 is longer"):
        fit_generation(llama, gpu=GPU, context=10**12)
    with pytest.raises(WhatIfError, match=rf"new_tokens={positions:,} leaves no prompt"):
        fit_generation(llama, gpu=GPU, batch=1, new_tokens=positions)


@pytest.mark.parametrize("gpu", ["Z80", "", "<b>"])
def test_fit_generation_names_an_unknown_gpu_and_the_choices(gpu: str) -> None:
    with pytest.raises(
        ValueError, match=rf"gpu got {re.escape(repr(gpu))}, an unknown GPU: pass one of T4, L4"
    ):
        fit_generation(_never_built, gpu=gpu, context=64)


def test_fit_generation_says_model_fn_must_build_the_model() -> None:
    with pytest.raises(WhatIfError, match=r"model_fn got int 5: pass a function that builds"):
        fit_generation(5, gpu=GPU, context=64)  # type: ignore[arg-type]
    built = nn.Linear(2, 2)
    with pytest.raises(WhatIfError, match=r"model_fn got a model already built \(Linear\)"):
        fit_generation(built, gpu=GPU, context=64)
    with pytest.raises(WhatIfError, match=r"model_fn must return a torch\.nn\.Module, not int"):
        fit_generation(lambda: 5, gpu=GPU, context=64)  # type: ignore[arg-type, return-value]


def test_fit_generation_passes_the_model_fns_own_error() -> None:
    class BrokenError(Exception):
        pass

    def model_fn() -> nn.Module:
        raise BrokenError("the user's own")

    with pytest.raises(BrokenError, match="the user's own"):
        fit_generation(model_fn, gpu=GPU, context=64)


def test_fit_generation_asks_for_a_config_where_the_cache_dtype_needs_one() -> None:
    class Plain(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(4, 4)

        def forward(self, tokens: torch.Tensor, cache: Any) -> Any:
            return self.proj(tokens.float()), cache

    with pytest.raises(WhatIfError, match="cannot size its cache"):
        fit_generation(Plain, gpu=GPU, context=64, cache_dtype="fp8")


# -- load_snapshot ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def snapshot() -> dict[str, Any]:
    return training_snapshot(20)[0]


def _write(path: Path, obj: Any) -> Path:
    path.write_bytes(pickle.dumps(obj))
    return path


class _Evil:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> Any:
        return (os.system, (f"touch {self.marker}",))


def test_a_malicious_pickle_runs_nothing(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    evil = _Evil(marker)
    cases = {
        "top": {"segments": [], "x": evil},
        "nested": {"segments": [{"total_size": 1, "blocks": [{"size": 1, "frames": [evil]}]}]},
        "protocol0": None,
    }
    for name, obj in cases.items():
        path = tmp_path / name
        if obj is None:  # a hand-written protocol-0 pickle: the global named by text
            path.write_bytes(f"cos\nsystem\n(S'touch {marker}'\ntR.".encode())
        else:
            _write(path, obj)
        with pytest.raises(SnapshotError, match=r"names the Python global (os|posix)\.system"):
            load_snapshot(path)
    buf = io.BytesIO()
    pickler = pickle.Pickler(buf)
    pickler.persistent_id = lambda o: "pid" if o == "X" else None  # type: ignore[method-assign]
    pickler.dump({"segments": [], "k": "X"})
    (tmp_path / "pid").write_bytes(buf.getvalue())
    with pytest.raises(SnapshotError, match=r"holds a persistent id \(str\)"):
        load_snapshot(tmp_path / "pid")
    assert not marker.exists()


def test_files_that_are_not_snapshots_are_named_with_what_to_pass(
    tmp_path: Path, snapshot: dict[str, Any]
) -> None:
    whole = pickle.dumps(snapshot)
    (tmp_path / "empty").write_bytes(b"")
    (tmp_path / "truncated").write_bytes(whole[: len(whole) // 2])
    (tmp_path / "gzip-junk").write_bytes(gzip.compress(b"not a pickle at all"))
    (tmp_path / "bad-gzip").write_bytes(b"\x1f\x8b" + b"\x00" * 40)
    for name in ("empty", "truncated", "gzip-junk", "bad-gzip"):
        with pytest.raises(SnapshotError, match=r"is not a readable pickle .*: pass a file"):
            load_snapshot(tmp_path / name)
    with pytest.raises(SnapshotError, match=r"holds a list without 'segments'"):
        load_snapshot(_write(tmp_path / "list", [1, 2, 3]))
    with pytest.raises(FileNotFoundError, match=r"no such file\. Pass the path"):
        load_snapshot(tmp_path / "missing")
    with pytest.raises(IsADirectoryError, match=r"is a directory: pass the path of the snapshot"):
        load_snapshot(tmp_path)


@pytest.mark.parametrize(
    "data",
    [
        {"segments": 5},
        {"segments": None},
        {"segments": [1, 2]},
        {"segments": [{"total_size": "x", "blocks": [{"size": "big", "state": "active"}]}]},
    ],
    ids=["number", "none", "not-dicts", "strings-for-sizes"],
)
def test_plain_data_in_the_wrong_layout_is_a_snapshot_error(
    tmp_path: Path, data: dict[str, Any]
) -> None:
    path = _write(tmp_path / "odd.pickle", data)
    with pytest.raises(SnapshotError, match=r"is not laid out as a memory snapshot .*: pass a"):
        load_snapshot(path)
    with pytest.raises(SnapshotError, match=r"is not laid out as a memory snapshot"):
        load_snapshot(path, first_view=lambda s: None)


def test_from_dict_names_a_dict_of_the_wrong_layout() -> None:
    from memlab.snapshot import from_dict

    with pytest.raises(TypeError, match=r"data=\[1, 2\] is a list: pass the dict"):
        from_dict([1, 2], "mine")  # type: ignore[arg-type]
    with pytest.raises(SnapshotError, match=r"mine is not laid out as a memory snapshot"):
        from_dict({"segments": [{"total_size": 1, "blocks": [{"size": "big"}]}]}, "mine")


def test_bad_callbacks_and_devices_name_what_to_pass(
    tmp_path: Path, snapshot: dict[str, Any]
) -> None:
    path = _write(tmp_path / "s.pickle", snapshot)
    with pytest.raises(TypeError, match=r"first_view=5 is a int: pass a function"):
        load_snapshot(path, first_view=5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"progress='x' is a str: pass a function"):
        load_snapshot(path, progress="x")  # type: ignore[arg-type]
    for device in (99, -1):
        with pytest.raises(ValueError, match=rf"device={re.escape(repr(device))}: the snapshot"):
            load_snapshot(path, device=device)
    for device, kind in ((True, "bool"), ("0", "str")):  # the wrong type, said as such
        with pytest.raises(ValueError, match=rf"device={re.escape(repr(device))} is a {kind}"):
            load_snapshot(path, device=device)  # type: ignore[arg-type]
    segments_only = _write(tmp_path / "no-trace.pickle", {"segments": snapshot["segments"]})
    with pytest.raises(ValueError, match=r"device=99: the snapshot has no trace and holds .* 0"):
        load_snapshot(segments_only, device=99)
    assert load_snapshot(segments_only, device=0).device == 0


def test_a_callback_that_raises_reaches_the_caller_as_it_is(
    tmp_path: Path, snapshot: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    from memlab.snapshot import stream

    monkeypatch.setattr(stream, "EVERY", 4096)  # drains (and progress calls) in a small file
    path = _write(tmp_path / "s.pickle", snapshot)

    class MineError(Exception):
        pass

    def boom(*_: Any) -> None:
        raise MineError("from the callback")

    for kwargs in ({"first_view": boom}, {"progress": boom}):
        with pytest.raises(MineError, match="from the callback"):
            load_snapshot(path, **kwargs)  # type: ignore[arg-type]


def test_user_strings_in_frames_are_escaped_in_the_html_and_the_chart(
    tmp_path: Path, snapshot: dict[str, Any]
) -> None:
    data = pickle.loads(pickle.dumps(snapshot))
    for trace in data["device_traces"]:
        for event in trace:
            for frame in event.get("frames") or ():
                if frame["filename"].endswith("train.py"):
                    frame["filename"], frame["name"] = HOSTILE, HOSTILE
    s = load_snapshot(_write(tmp_path / "xss.pickle", data))
    assert "<script>alert" not in s.html() and "<img" not in s.html()
    assert "&lt;script&gt;alert(1)" in s.html()
    page = s.chart().html()
    assert page.count("<script>") == page.count("</script>") == 2  # bokeh's and the embedding
    assert "<img" not in page
    # the chart still carries the text itself, for the browser to show as text
    item = json.loads(re.search(r"const item=(\{.*?\});let tries", page, re.S)[1])  # type: ignore[index]
    assert HOSTILE in json.dumps(item, ensure_ascii=False)


# -- memlab.distributed -----------------------------------------------------------------------


def _fails_on_rank_one(rank: int, world_size: int) -> int:
    import torch.distributed as dist

    if rank == 1:
        raise KeyError("rank one's own error")
    dist.barrier()  # rank 0 waits for rank 1 here, and sees the group broken
    return rank


def _exits_on_rank_one(rank: int, world_size: int) -> int:
    import sys

    import torch.distributed as dist

    if rank == 1:
        sys.exit("rank one leaves")
    dist.barrier()
    return rank


def _aborts_at_exit_on_rank_one(rank: int, world_size: int) -> dict[str, int]:
    if rank == 1:
        import atexit

        faulthandler.disable()  # pytest's, inherited: no stack dump for an abort on purpose
        atexit.register(os.abort)  # the process dies in its teardown, after the job is done
    return {"rank": rank, "world_size": world_size}


def _aborts_on_rank_one(rank: int, world_size: int) -> int:
    import torch.distributed as dist

    if rank == 1:
        faulthandler.disable()
        os.abort()
    dist.barrier()
    return rank


def _gathers_to_true(rank: int, world_size: int) -> Any:
    import memlab
    from memlab.distributed import gather

    with memlab.track("cpu") as t:
        torch.ones(8)
    return gather(t, dst=True)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"world_size": 0}, ValueError, r"world_size must be a whole number ≥ 1, got 0"),
        ({"world_size": -1}, ValueError, r"world_size must be .*, got -1"),
        ({"world_size": "2"}, ValueError, r"world_size must be .*, got '2'"),
        ({"backend": "<junk>"}, ValueError, r"backend must be one of gloo, nccl, got '<junk>'"),
        ({"args": 5}, TypeError, r"args must be a tuple of fn's further arguments.*got int 5"),
        ({"start_method": "x"}, ValueError, r"start_method must be one of .*got 'x'"),
        (
            {"world_size": 64, "backend": "nccl"},
            ValueError,
            r"world_size=64 needs 64 .*backend='gloo'",
        ),
    ],
)
def test_launch_names_a_bad_argument(
    kwargs: dict[str, Any], error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        launch(_fails_on_rank_one, **kwargs)
    with pytest.raises(TypeError, match=r"fn must be a function fn\(rank, world_size\), got int"):
        launch(42)  # type: ignore[arg-type]


def test_the_failing_ranks_own_error_reaches_the_caller_with_its_rank() -> None:
    with pytest.raises(RankError) as caught:
        bounded(lambda: launch(_fails_on_rank_one, 2, start_method="fork"))
    e = caught.value
    assert (e.rank, e.kind) == (1, "KeyError")
    assert 'rank 1 of 2 raised KeyError: "rank one\'s own error"' in str(e)
    assert "_fails_on_rank_one" in str(e) and "memlab/distributed" not in str(e)


def test_a_rank_that_exits_is_named_not_the_rank_it_left_waiting() -> None:
    with pytest.raises(RankError, match=r"rank 1 of 2 raised SystemExit: rank one leaves"):
        bounded(lambda: launch(_exits_on_rank_one, 2, start_method="fork"))


def test_a_rank_lost_in_its_teardown_after_the_job_keeps_the_jobs_answer() -> None:
    """PyTorch rarely aborts a rank's process as Python exits ("terminate called without
    an active exception"): every fn has returned by then, so the answer is whole and comes home,
    with a warning that says what happened. Spawn: the rank exits through Python's finalization
    (atexit), as a real one does."""
    with pytest.warns(RuntimeWarning, match=r"every rank's fn returned, then .*SIGABRT"):
        value = bounded(lambda: launch(_aborts_at_exit_on_rank_one, 2, start_method="spawn"))
    assert value == {"rank": 0, "world_size": 2}


def test_a_rank_lost_before_the_job_finished_is_still_an_error() -> None:
    from torch.multiprocessing import ProcessExitedException

    with pytest.raises(ProcessExitedException, match="process 1 terminated with signal SIGABRT"):
        bounded(lambda: launch(_aborts_on_rank_one, 2, start_method="fork"))


def test_gather_and_check_name_what_they_got() -> None:
    from memlab.distributed import check, gather

    with pytest.raises(TypeError, match=r"takes a memlab\.track object or its \.report, got int"):
        gather(5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"measured must be a RankTable \(gather\), got str"):
        check("table", None)  # type: ignore[arg-type]
    with pytest.raises(RankError, match=r"ValueError: dst must be a rank from 0 to 1, got True"):
        bounded(lambda: launch(_gathers_to_true, 2, start_method="fork"))


# -- RunConfig's newer fields -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"world_size": "2"}, r"world_size must be a whole number ≥ 1, not '2'"),
        ({"world_size": 2}, r"world_size=2 with sharding='none': pass how the ranks share"),
        ({"sharding": "ddp"}, r"sharding='ddp' needs ranks .* pass world_size=2"),
        ({"world_size": 2, "sharding": "zero9"}, r"sharding='zero9' is not one of 'none'"),
        ({"world_size": 2, "sharding": "ddp", "mode": "no_grad"}, r"use mode='train'"),
        ({"offload": True}, r"offload=True is not one of 'off', 'activations'"),
        ({"offload": "activations", "mode": "generate"}, r"use mode='train'.*or offload='off'"),
        ({"offload": "optimizer", "optimizer_in_backward": True}, r"pass offload='activations'"),
        ({"base_weights": "int4"}, r"base_weights='int4' is not one of 'as_built', 'int8'"),
        ({"cache": ["static"], "mode": "generate"}, r"cache must be 'dynamic' or 'static'"),
        ({"cache": "static"}, r"cache='static' is .* use mode='generate'"),
        ({"optimizer_state_bits": "8"}, r"optimizer_state_bits must be 32 or 8, not '8'"),
        ({"optimizer_state_bits": 8, "optimizer": "sgd"}, r"use optimizer 'adam' or 'adamw'"),
        ({"optimizer_in_backward": 1}, r"optimizer_in_backward must be True or False, not 1"),
        ({"optimizer_in_backward": True, "accumulation": 2, "batch_size": 8}, r"accumulation=1"),
        ({"checkpoint_saves": "all", "checkpoint": "auto"}, r"checkpoint_saves must be 'nothing'"),
        ({"checkpoint_saves": "matmuls"}, r"also pass checkpoint='auto'"),
        ({"expandable_segments": "True"}, r"expandable_segments must be True or False"),
        ({"new_tokens": 1.5}, r"new_tokens must be a whole number ≥ 1, not 1\.5"),
        ({"logits": "first"}, r"logits must be 'last' or 'all', not 'first'"),
    ],
)
def test_run_config_names_the_field_the_value_and_what_to_pass(
    fields: dict[str, Any], message: str
) -> None:
    with pytest.raises(WhatIfError, match=message):
        RunConfig(**fields)


def test_run_config_budget_of_the_wrong_type_is_named() -> None:
    with pytest.raises(WhatIfError, match=r"budget"):
        RunConfig(budget="1GiB")  # type: ignore[arg-type]


def test_run_config_optimizer_state_bits_must_be_a_whole_number() -> None:
    with pytest.raises(WhatIfError, match=r"optimizer_state_bits must be 32 or 8, not 8\.0"):
        RunConfig(optimizer_state_bits=8.0)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "fields",
    [
        {"optimizer_in_backward": True, "mode": "no_grad"},
        {"optimizer_state_bits": 8, "mode": "generate"},
    ],
)
def test_run_config_refuses_optimizer_levers_without_an_optimizer(fields: dict[str, Any]) -> None:
    with pytest.raises(WhatIfError, match=r"mode='train'"):
        RunConfig(**fields)


# -- %%gpumem --gpu ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "got"),
    [('""', "''"), ("-1GiB", "'-1GiB'"), ("1e30", "'1e30'"), ('"<script>"', "'<script>'")],
)
def test_a_bad_gpu_is_a_usage_error_that_says_what_it_got(ip: Any, spec: str, got: str) -> None:
    with pytest.raises(UsageError, match=rf"%gpumem --gpu got {re.escape(got)}: pass one of T4"):
        ip.run_cell_magic("gpumem", f"--gpu {spec}", "x = 1")
    assert "x" not in ip.user_ns  # the cell did not run
    assert not any("<script>" in h for h in ip.rec.html())


def test_the_cells_value_and_exception_are_kept_under_gpu(
    ip: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    r = run(ip, "%%gpumem --gpu T4\nkept = torch.ones(4)\nkept.sum() + 1\n")
    assert r.success and torch.equal(r.result, torch.tensor(5.0))
    assert torch.equal(ip.user_ns["kept"], torch.ones(4))
    capsys.readouterr()
    r = run(ip, "%%gpumem --gpu T4\ndef f():\n    raise KeyError('mine')\nbefore = 1\nf()\n")
    assert isinstance(r.error_in_exec, KeyError) and r.error_in_exec.args == ("mine",)
    assert ip.user_ns["before"] == 1
    shown = re.sub(r"\x1b\[[0-9;]*m", "", capsys.readouterr().out)
    assert "KeyError: 'mine'" in shown and "raise KeyError('mine')" in shown
    assert "memlab" not in shown.replace("%%gpumem", "").replace("'gpumem'", ""), shown


def test_the_cell_source_and_label_are_escaped_in_the_preflight(ip: Any) -> None:
    cell = (
        f"%%gpumem --gpu 1GiB {HOSTILE}\nnote = {HOSTILE!r}\nbig = torch.ones(2**28)  # {HOSTILE}\n"
    )
    assert run(ip, cell).success
    shown = ip.rec.html()
    assert shown and not any("<script>alert" in h or "<img" in h for h in shown)
    assert any("&lt;script&gt;alert(1)" in h for h in shown)
    assert ip.user_ns["note"] == HOSTILE


# -- AllocationRecord -------------------------------------------------------------------------


def _profiling() -> bool:
    return bool(torch.autograd._profiler_enabled())  # type: ignore[attr-defined]


def test_an_exception_in_the_block_passes_and_the_profiler_is_stopped() -> None:
    rec = AllocationRecord()
    with pytest.raises(ValueError, match="the user's"), rec:
        kept = torch.empty(1000)
        raise ValueError("the user's")
    assert not _profiling()
    assert rec.result is not None and rec.result.net == kept.untyped_storage().nbytes()


def test_a_nested_record_is_refused_and_the_outer_one_keeps_recording() -> None:
    with AllocationRecord() as outer:
        a = torch.empty(100)
        with pytest.raises(RuntimeError, match="profiler is already running"), AllocationRecord():
            pass
        assert _profiling()
        b = torch.empty(200)
    assert not _profiling()
    assert outer.result is not None
    assert outer.result.net == a.untyped_storage().nbytes() + b.untyped_storage().nbytes()


def test_under_a_users_profiler_it_refuses_and_leaves_the_profiler_running() -> None:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        with pytest.raises(RuntimeError, match="profiler is already running"), AllocationRecord():
            pass
        assert _profiling()
        torch.ones(3).sum()
    assert not _profiling()
    assert any(e.name == "aten::sum" for e in prof.events())


def test_a_profiler_started_inside_the_block_is_not_a_silent_empty_record() -> None:
    rec = AllocationRecord()
    ended = "ended by a PyTorch profiler started inside it"
    with pytest.raises(RuntimeError, match=ended), rec, torch.profiler.profile():
        torch.empty(1000)
    assert rec.result is None and not torch.autograd._profiler_enabled()
    with pytest.raises(KeyError), rec.__class__(), torch.profiler.profile():
        raise KeyError("the block's own error is the one that reaches the caller")
