"""The rank processes of one `launch`: started, waited for up to a time limit, and stopped.

torch's ``start_processes`` waits for the ranks in a loop that only a rank's own failure ends
early. An interrupt in the caller (Ctrl-C, a notebook's stop button) left the ranks running as
orphans, holding their GPUs under nccl; a hung rank had no limit but the backend's (30 minutes
for gloo). Here the ranks are started without that loop and the caller waits itself: whatever
ends the wait early, an interrupt or the time limit, every rank is stopped (SIGTERM, then
SIGKILL after `GRACE`) and reaped before the caller goes on.

Each rank marks its progress with empty files beside rank 0's value (`mark`): joined the
group (``started``), ``fn`` returned (``returned``), past the final barrier (``done``); the
time limit's error says from them where each rank was.
"""

from __future__ import annotations

import contextlib
import math
import multiprocessing
import numbers
import time
from collections.abc import Callable, Iterable, Sequence
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

#: Seconds a rank has to exit after SIGTERM before it gets SIGKILL.
GRACE = 2.0


def mark(out: str, rank: int, what: str) -> None:
    with contextlib.suppress(OSError):
        Path(f"{out}.rank{rank}.{what}").touch()


def marked(out: str, rank: int, what: str) -> bool:
    return Path(f"{out}.rank{rank}.{what}").exists()


def start(worker: Callable[..., None], args: Sequence[Any], nprocs: int, method: str) -> Any:
    """The ranks, started (torch's ``ProcessContext``); an interrupt while they start stops
    those already started (the ones that were not this process's children before)."""
    from torch.multiprocessing.spawn import start_processes

    before = set(multiprocessing.active_children())
    try:
        return start_processes(
            worker, args=tuple(args), nprocs=nprocs, start_method=method, join=False
        )
    except BaseException:
        stop([p for p in multiprocessing.active_children() if p not in before])
        raise


def wait(ranks: Any, deadline: float | None) -> bool:
    """Waits for every rank to exit: True, or False where ``deadline`` (``time.monotonic``)
    came first. A rank that failed raises torch's error, the others stopped by torch."""
    while True:
        left = None if deadline is None else min(3600.0, max(0.0, deadline - time.monotonic()))
        if ranks.join(timeout=left):
            return True
        if deadline is not None and time.monotonic() >= deadline:
            return False


def stop(processes: Iterable[BaseProcess]) -> None:
    """SIGTERM to every rank still running, SIGKILL to any left after `GRACE`; each is reaped.
    A second interrupt during the grace cuts the grace short, not the stop."""
    processes = list(processes)
    try:
        for p in processes:
            if p.is_alive():
                p.terminate()
        end = time.monotonic() + GRACE
        for p in processes:
            p.join(max(0.0, end - time.monotonic()))
    finally:
        for p in processes:
            if p.is_alive():
                p.kill()
        for p in processes:
            p.join()


def seconds(timeout: Any) -> float | None:
    """``timeout`` in seconds, None for no limit (infinity too)."""
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real):
        raise TypeError(
            f"timeout must be a number of seconds, or None for no limit, got "
            f"{type(timeout).__name__} {timeout!r:.40}: e.g. timeout=600."
        )
    try:
        seconds = float(timeout)
    except OverflowError:  # an int too big for a float
        seconds = math.inf if str(timeout)[0] != "-" else -math.inf
    if not seconds > 0:  # NaN too
        raise ValueError(
            f"timeout must be a number of seconds > 0, or None for no limit, got {timeout!r}: "
            "e.g. timeout=600."
        )
    return None if math.isinf(seconds) else seconds


def _ranks(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def timed_out(out: str, world_size: int, timeout: float) -> TimeoutError:
    """The time limit's error: which ranks were still in ``fn``, which waited for them."""
    where = {
        "still joining the process group": [
            r for r in range(world_size) if not marked(out, r, "started")
        ],
        "still in fn": [
            r
            for r in range(world_size)
            if marked(out, r, "started") and not marked(out, r, "returned")
        ],
        "done with fn, waiting for the others at the final barrier": [
            r for r in range(world_size) if marked(out, r, "returned")
        ],
    }
    said = "; ".join(f"{_ranks(rs)} {what}" for what, rs in where.items() if rs)
    return TimeoutError(
        f"memlab.distributed.launch: timeout={timeout:g} s passed with the job unfinished "
        f"({world_size} ranks: {said}); every rank was stopped. Pass a longer timeout, or "
        "timeout=None for no limit."
    )
