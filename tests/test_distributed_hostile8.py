"""`memlab.distributed.launch` under hostile round 8: an interrupt and a time limit stop every
rank (none is left running, an orphan holding its GPU); rank 0's value comes home as it was
returned, or is refused naming what JSON would change, without posing as fn's error."""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import textwrap
import time
import traceback
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import bounded

from memlab.distributed import RankError, RankTable, launch
from memlab.distributed.value import UnsendableError, decode, encode


def _write_pid(folder: str, rank: int) -> None:
    Path(folder, f"rank{rank}.pid").write_text(str(os.getpid()))


def _hangs_on_rank_one(rank: int, world_size: int, folder: str) -> str:
    _write_pid(folder, rank)
    if rank == 1:
        time.sleep(120)  # a rank that hangs (a deadlock, a collective that never completes)
    return "done"  # rank 0 waits for rank 1 in launch's final barrier


def _returns(rank: int, world_size: int, value: Any) -> Any:
    return value


def _returns_tables(rank: int, world_size: int) -> Any:
    import memlab
    from memlab.distributed import gather

    with memlab.track("cpu") as t:
        kept = torch.ones(256)  # noqa: F841  (alive at the region's end)
    table = gather(t)
    return {"plain": [1, 2.5, None, True, "s"], "by_strategy": {"ddp": table}, "runs": [table]}


def _takes_one_argument(rank: int) -> int:
    return rank


def _pids(folder: Path, world_size: int, seconds: float = 20) -> list[int]:
    """The ranks' process ids, once every rank has written its own."""
    end = time.monotonic() + seconds
    files = [folder / f"rank{r}.pid" for r in range(world_size)]
    while not all(f.exists() and f.read_text() for f in files):
        assert time.monotonic() < end, "the ranks did not start"
        time.sleep(0.05)
    return [int(f.read_text()) for f in files]


def _alive(pids: list[int]) -> list[int]:
    alive = []
    for pid in pids:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            continue
        alive.append(pid)
    return alive


def _kill(pids: list[int]) -> None:
    """The test's own ranks, where the fix failed and left them running."""
    for pid in _alive(pids):
        os.kill(pid, signal.SIGKILL)


_INTERRUPTED = textwrap.dedent(
    """
    import sys, time
    import torch.distributed as dist
    from pathlib import Path
    from memlab.distributed import launch

    def hangs(rank, world_size, folder):
        Path(folder, f"rank{rank}.pid").write_text(str(__import__("os").getpid()))
        if rank == 1:
            time.sleep(120)
        dist.barrier()

    launch(hangs, 2, args=(sys.argv[1],))  # fork: fn is __main__'s, as a notebook's
    """
)


def test_an_interrupt_stops_every_rank(tmp_path: Path) -> None:
    # The kernel's stop button: SIGINT to the launching process only, not to its ranks.
    script = tmp_path / "interrupted.py"
    script.write_text(_INTERRUPTED)
    child = subprocess.Popen(
        [sys.executable, str(script), str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    pids: list[int] = []
    try:
        pids = _pids(tmp_path, 2)
        child.send_signal(signal.SIGINT)
        _, err = child.communicate(timeout=10)
        assert child.returncode != 0 and "KeyboardInterrupt" in err, err[-2000:]
        assert _alive(pids) == [], "a rank outlived the interrupted launch"
    finally:
        child.kill()
        child.wait()
        _kill(pids)


def test_a_time_limit_stops_the_ranks_and_names_the_one_still_running(tmp_path: Path) -> None:
    started = time.monotonic()
    pids: list[int] = []
    try:
        with pytest.raises(TimeoutError) as caught:
            bounded(
                lambda: launch(
                    _hangs_on_rank_one, 2, args=(str(tmp_path),), start_method="fork", timeout=3
                )
            )
        pids = _pids(tmp_path, 2, seconds=0)
        took = time.monotonic() - started
        message = str(caught.value)
        assert "timeout=3 s passed" in message
        assert "rank 1 still in fn" in message
        assert "rank 0 done with fn, waiting for the others at the final barrier" in message
        assert "timeout=None for no limit" in message
        assert _alive(pids) == []
        assert 3 <= took < 3 + 2 + 3  # the limit, SIGTERM's grace at most, and some slack
    finally:
        _kill(pids)


@pytest.mark.parametrize(
    ("timeout", "error", "message"),
    [
        ("5", TypeError, r"timeout must be a number of seconds, or None .*got str '5'"),
        (True, TypeError, r"timeout must be a number of seconds, or None .*got bool True"),
        (0, ValueError, r"timeout must be a number of seconds > 0, or None .*got 0"),
        (-1.5, ValueError, r"> 0, or None for no limit, got -1.5: e.g. timeout=600"),
        (math.nan, ValueError, r"> 0, or None for no limit, got nan"),
        (-(10**400), ValueError, r"> 0, or None for no limit"),
    ],
)
def test_a_bad_timeout_is_named(timeout: Any, error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message):
        launch(_returns, 2, args=(1,), start_method="fork", timeout=timeout)


def test_an_endless_timeout_is_no_limit() -> None:
    for endless in (math.inf, 10**400, None):
        assert launch(_returns, 2, args=([1],), start_method="fork", timeout=endless) == [1]


def test_rank_zeros_value_comes_home_as_it_was_returned() -> None:
    value = {
        "ints": [0, -7, 2**100],
        "floats": [2.5, -0.0, math.inf],
        "others": [None, True, False, "é\u2028", [], {}],
        "nested": {"a": {"b": [[1], {"c": "d"}]}},
    }
    got = bounded(lambda: launch(_returns, 2, args=(value,), start_method="fork"))
    assert got == value
    assert [type(x) for x in got["ints"] + got["floats"]] == [int] * 3 + [float] * 3
    assert math.copysign(1, got["floats"][1]) == -1  # -0.0 stays negative
    assert list(got["nested"]) == ["a"] and type(got["others"][4]) is list

    import memlab

    with memlab.track("cpu"):  # its first use loads what it needs once: the forks inherit it
        pass
    tables = bounded(lambda: launch(_returns_tables, 2, start_method="fork"))
    assert tables["plain"] == [1, 2.5, None, True, "s"]
    for table in (tables["by_strategy"]["ddp"], tables["runs"][0]):
        assert isinstance(table, RankTable) and table.world_size == 2
        assert [row.after for row in table.rows] == [256 * 4] * 2  # the tensor kept on each


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ({0: (1, 2)}, r"the value itself has the key 0 \(int\), which JSON brings back as the "),
        ({"a": [1, (1, 2)]}, r"the value\['a'\]\[1\] is a tuple: return a list instead"),
        (torch.ones(2), r"the value itself is a Tensor: return v\.tolist\(\)"),
        ([torch.tensor(1.5).numpy().sum()], r"value\[0\] is a float32: return v\.item\(\)"),
        ({"s": {1, 2}}, r"value\['s'\] is a set: return a list"),
    ],
)
def test_a_value_json_would_change_is_refused_naming_where(value: Any, message: str) -> None:
    with pytest.raises(UnsendableError, match=message):
        encode(value)
    shared: list[Any] = []
    shared.append(shared)  # holds itself
    with pytest.raises(UnsendableError, match="nested too deep, or holds itself"):
        encode(shared)
    assert decode(encode({"k": [1, None]})) == {"k": [1, None]}


def test_an_unsendable_value_says_so_not_that_fn_raised() -> None:
    with pytest.raises(TypeError, match=r"the value itself has the key 0 \(int\)"):
        bounded(lambda: launch(_returns, 2, args=({0: (1, 2)},), start_method="fork"))
    with pytest.raises(TypeError) as caught:
        bounded(lambda: launch(_returns, 2, args=(torch.ones(2),), start_method="fork"))
    e = caught.value
    message = str(e)
    assert not isinstance(e, RankError) and "raised" not in message
    assert message.startswith(
        "rank 0's fn returned, but its value cannot come back to this process: the value itself "
        "is a Tensor: return v.tolist()"
    )
    assert "lists and dicts with str keys, with RankTables" in message
    shown = "".join(traceback.format_exception(e))
    assert "memlab/distributed" not in shown and "launch.py" not in shown


def test_a_failed_call_of_fn_shows_no_memlab_frames_as_the_ranks_own() -> None:
    with pytest.raises(RankError) as caught:
        bounded(lambda: launch(_takes_one_argument, 2, start_method="fork"))
    message = str(caught.value)
    assert "raised TypeError: _takes_one_argument() takes 1 positional argument" in message
    assert "no line of fn's ran: the call fn(rank, world_size, *args) itself failed" in message
    assert "launch.py" not in message and "memlab/distributed" not in message
