"""`launch`: run a function on N ranks of one process group, from a notebook or a script.

``torch.multiprocessing`` starts the ranks. With ``spawn`` each child imports the function by
its module and name, which a function defined in a notebook cannot give (its module,
``__main__``, is the kernel, not a file). So a function from ``__main__`` is run with ``fork``
(the child is a copy of the kernel, the function included), where the platform has it and
CUDA is not yet initialised in the parent (CUDA does not survive a fork); any other function
is run with ``spawn``, the safe default. Pass ``start_method`` to choose.

Rank 0's return value comes home as JSON through a file (never pickled), unchanged: None,
numbers, strings, lists, dicts with string keys, and `RankTable`s anywhere in them
(`memlab.distributed.value`); anything JSON would change is refused with what to return instead.
An interrupt (Ctrl-C, the stop button) or ``timeout`` stops every rank (`memlab.distributed.ranks`).
Under ``torchrun`` the same call runs the function in this process (the ranks already exist) and
returns rank 0's value on rank 0, ``None`` on the others.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from memlab.core.frames import users_traceback
from memlab.distributed.ranks import mark, marked, seconds, start, stop, timed_out, wait
from memlab.distributed.value import received, send

BACKENDS = ("gloo", "nccl")
#: This file's frames are left out of a rank's traceback: the user's code is what it shows.
_HERE = __file__


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _worker(
    rank: int,
    fn: Callable[..., Any],
    world_size: int,
    backend: str,
    init_method: str,
    out: str,
    args: Sequence[Any],
) -> None:
    import torch.distributed as dist

    if backend == "nccl":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size)
    mark(out, rank, "started")
    try:
        try:
            value = fn(rank, world_size, *args)
        except BaseException as e:  # SystemExit too: the rank that stopped first is the cause
            _record_failure(out, rank, e)
            raise
        if rank == 0:
            send(out, value)
        mark(out, rank, "returned")
        dist.barrier()  # no rank tears the group down while another still uses it
        mark(out, rank, "done")  # past the barrier: every rank's fn has returned
    finally:
        dist.destroy_process_group()


class RankError(RuntimeError):
    """A rank's ``fn`` raised: ``rank``, the error's type name and message, and the traceback
    of the rank's own code (the error itself stayed in the rank's process)."""

    def __init__(self, rank: int, world_size: int, kind: str, message: str, trace: str) -> None:
        where = (
            f"rank {rank}'s traceback:)\n{trace}"
            if trace
            else "no line of fn's ran: the call fn(rank, world_size, *args) itself failed)"
        )
        super().__init__(
            f"rank {rank} of {world_size} raised {kind}: {message}\n"
            f"(the other ranks were stopped; {where}"
        )
        self.rank, self.kind, self.message = rank, kind, message


def _record_failure(out: str, rank: int, e: BaseException) -> None:
    """What ``fn`` raised on this rank, as JSON beside rank 0's value, stamped with the time:
    the first rank to fail is the cause, the others' errors (a collective cut short) follow."""
    tb = traceback.extract_tb(e.__traceback__)
    mine = [f for f in tb if f.filename != _HERE]  # none: fn's own call failed (its arguments)
    record = {
        "rank": rank,
        "time": time.time_ns(),
        "kind": type(e).__name__,
        "message": str(e),
        "trace": "".join(traceback.format_list(mine)),
    }
    with contextlib.suppress(OSError):
        Path(f"{out}.rank{rank}.error").write_text(json.dumps(record))


def _first_failure(out: str, world_size: int, stopped: Exception) -> RankError | None:
    """The error of the rank that failed first, or None where the first to stop was a rank
    that exited without one (killed, ``os._exit``): torch's own error says which."""
    found = []
    for r in range(world_size):
        with contextlib.suppress(OSError, ValueError):
            found.append(json.loads(Path(f"{out}.rank{r}.error").read_text()))
    exited = getattr(stopped, "exit_code", None) is not None
    if not found or (
        exited and getattr(stopped, "error_index", None) not in {d["rank"] for d in found}
    ):
        return None
    d = min(found, key=lambda d: (d["time"], d["rank"]))
    return RankError(d["rank"], world_size, d["kind"], d["message"], d["trace"])


def _finished(out: str, world_size: int) -> bool:
    """Whether the job itself finished: rank 0's value is written and a rank passed the final
    barrier, which no rank reaches before every rank's ``fn`` has returned. A rank can still be
    lost after that, in PyTorch's own teardown (an abort at exit, rarely): the job's
    answer is whole all the same."""
    sent = Path(out).exists() or Path(f"{out}.unsendable").exists()
    return sent and any(marked(out, r, "done") for r in range(world_size))


def _warn_exit(stopped: str) -> None:
    import warnings

    warnings.warn(
        f"memlab.distributed.launch: every rank's fn returned, then a rank's process stopped "
        f"while PyTorch tore it down ({stopped}); the job's answer is whole, and is returned.",
        RuntimeWarning,
        stacklevel=3,
    )


def _under_torchrun() -> bool:
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


@users_traceback()
def launch(
    fn: Callable[..., Any],
    world_size: int = 2,
    backend: str = "gloo",
    *,
    args: Sequence[Any] = (),
    start_method: str | None = None,
    timeout: float | None = None,
) -> Any:
    """Runs ``fn(rank, world_size, *args)`` on ``world_size`` ranks joined in one process group
    (``backend``: ``"gloo"`` for CPUs, ``"nccl"`` for one GPU per rank) and returns what rank 0's
    ``fn`` returned. Under ``torchrun`` the ranks exist already: ``fn`` runs here, with the
    launcher's world size (``timeout`` is then the launcher's to keep).

    ``timeout``: seconds the job may take, start included (None: no limit); past it, or on an
    interrupt (Ctrl-C, a notebook's stop button), every rank is stopped: the time limit's
    ``TimeoutError`` names the ranks still in ``fn``."""
    if not callable(fn):
        raise TypeError(f"fn must be a function fn(rank, world_size), got {type(fn).__name__}.")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}.")
    limit = seconds(timeout)
    if _under_torchrun():
        return _here(fn, backend, args)
    if type(world_size) is not int or world_size < 1:
        raise ValueError(f"world_size must be a whole number ≥ 1, got {world_size!r}.")
    gpus = torch.cuda.device_count() if backend == "nccl" else world_size
    if gpus < world_size:
        raise ValueError(
            f"backend='nccl' gives each rank a GPU of its own: world_size={world_size} needs "
            f"{world_size} and this machine has {gpus}: pass "
            + (f"world_size={gpus} or less, or " if gpus else "")
            + "backend='gloo' to run the ranks on the CPU."
        )
    if isinstance(args, (str, bytes)) or not isinstance(args, Sequence):
        raise TypeError(
            f"args must be a tuple of fn's further arguments (fn(rank, world_size, *args)), "
            f"got {type(args).__name__} {args!r:.60}: e.g. args=({args!r:.40},)."
        )
    args = tuple(args)
    method = start_method or _start_method(fn)
    if method not in multiprocessing.get_all_start_methods():
        raise ValueError(
            f"start_method must be one of {', '.join(multiprocessing.get_all_start_methods())}, "
            f"got {method!r}."
        )
    deadline = None if limit is None else time.monotonic() + limit
    with tempfile.TemporaryDirectory(prefix="memlab-launch-") as tmp:
        out = str(Path(tmp) / "rank0.json")
        init = f"tcp://127.0.0.1:{_free_port()}"
        with _main_described():
            ranks = start(_worker, (fn, world_size, backend, init, out, args), world_size, method)
        try:
            done = wait(ranks, deadline)
        except BaseException as e:  # torch stops the ranks after one's failure; nothing else does
            stop(ranks.processes)  # an interrupt: no rank outlives the call, or the folder
            if not isinstance(e, Exception):
                raise
            if _finished(out, world_size):
                _warn_exit(str(e))
                return received(out)
            failure = _first_failure(out, world_size, e)
            if failure is None:  # not fn's error (a rank killed, the group not formed)
                raise
            raise failure from None  # its message holds the rank's own traceback
        if not done:  # only a time limit ends the wait early
            assert limit is not None
            stop(ranks.processes)
            if not _finished(out, world_size):
                raise timed_out(out, world_size, limit) from None
            _warn_exit(f"it had not exited when timeout={limit:g} s passed, and was stopped")
        return received(out)


@contextlib.contextmanager
def _main_described() -> Iterator[None]:
    """multiprocessing's spawn reads ``__main__.__spec__``, which IPython's stand-in for
    ``__main__`` (a shell's user module) lacks: for the start only, it reads as ``None`` (no
    module to re-import in the child), and the attribute is taken away again after."""
    main = sys.modules.get("__main__")
    if main is None or hasattr(main, "__spec__"):
        yield
        return
    main.__spec__ = None
    try:
        yield
    finally:
        with contextlib.suppress(AttributeError):
            del main.__spec__


def _start_method(fn: Callable[..., Any]) -> str:
    if getattr(fn, "__module__", None) != "__main__":
        return "spawn"
    if "fork" not in multiprocessing.get_all_start_methods():
        raise ValueError(
            "a function defined in a notebook cannot be started with spawn on this platform "
            "(no fork): put it in a module (%%writefile steps.py, then import it) and pass that."
        )
    if torch.cuda.is_initialized():
        raise RuntimeError(
            "this kernel has initialised CUDA, which does not survive fork: put the function in "
            "a module (%%writefile steps.py, then import it), or launch before using CUDA."
        )
    return "fork"


def _here(fn: Callable[..., Any], backend: str, args: Sequence[Any]) -> Any:
    import torch.distributed as dist

    created = not dist.is_initialized()
    if created:
        dist.init_process_group(backend)
    try:
        value = fn(dist.get_rank(), dist.get_world_size(), *args)
        return value if dist.get_rank() == 0 else None
    finally:
        if created:  # leave the process as it was found
            dist.destroy_process_group()
