"""Reading a snapshot file without running its code.

``torch.cuda.memory._dump_snapshot`` writes a pickle, and a pickle can name any Python callable
(``os.system``) for the loader to call. A memory snapshot holds only dicts, lists, strings,
numbers, booleans and ``None``, so `SafeUnpickler` refuses every global a file names, and every
persistent id and out-of-band buffer, before anything is called. ``pickle``'s C loader does the
rest, at its own speed.
"""

from __future__ import annotations

import gzip
import os
import pickle
import zlib
from pathlib import Path
from typing import Any, NoReturn

from memlab.core.collector import hold_collector
from memlab.core.frames import users_traceback


class SnapshotError(ValueError):
    """A file that is not a memory snapshot memlab can read, and why."""


class SafeUnpickler(pickle.Unpickler):
    """An unpickler that builds plain containers, strings, bytes and numbers only."""

    @users_traceback()
    def __init__(self, file: Any, name: str) -> None:
        if not (
            callable(getattr(file, "read", None)) and callable(getattr(file, "readline", None))
        ):
            raise TypeError(
                f"SafeUnpickler: file is a {type(file).__name__}: pass a binary file open for "
                "reading (open(path, 'rb')), with the name to give it in errors."
            )
        super().__init__(file)
        self.name = name

    def find_class(self, module: str, name: str) -> NoReturn:
        raise SnapshotError(
            f"{self.name} names the Python global {module}.{name}, which memlab refuses to load: "
            "a memory snapshot holds only dicts, lists, strings and numbers, and a pickle that "
            "names a global can run code. Load only snapshots written by "
            "torch.cuda.memory._dump_snapshot (or memlab's to_snapshot) from a source you trust."
        )

    def persistent_load(self, pid: Any) -> NoReturn:
        raise SnapshotError(
            f"{self.name} holds a persistent id ({type(pid).__name__}), which no memory snapshot "
            "has: memlab refuses it. Pass a file written by torch.cuda.memory._dump_snapshot."
        )


#: Bytes of memory a snapshot takes once read, per byte of its pickle (measured 7 to 10: each
#: event is a dict and a list of frames).
EXPANSION = 10


def available_memory() -> int | None:
    """What the system can still give this process (Linux's MemAvailable), or None elsewhere."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def read(path: str | os.PathLike[str], check_memory: bool = True) -> dict[str, Any]:
    """The snapshot dict in ``path`` (a pickle, gzipped or not), built by `SafeUnpickler`.

    A file too big for the memory left is refused before reading (the kernel would be killed
    otherwise); ``check_memory=False`` reads it anyway. Python's cyclic garbage collector is
    paused while the pickle is read (millions of new containers would trigger it again and
    again, for nothing) and restarted after, if it was running."""
    p = check_path(path)
    with p.open("rb") as raw:
        gzipped = raw.read(2) == b"\x1f\x8b"
        raw.seek(0)
        if check_memory:
            _check_memory(p, p.stat().st_size * (4 if gzipped else 1))
        f: Any = gzip.GzipFile(fileobj=raw) if gzipped else raw
        release = hold_collector()
        try:
            data = SafeUnpickler(f, str(p)).load()
            read_to_the_end(f, p)
        except SnapshotError:
            raise
        except (pickle.UnpicklingError, EOFError, ValueError, TypeError, OSError) as e:
            raise SnapshotError(
                f"{p} is not a readable pickle ({type(e).__name__}: {e}): pass a file written by "
                "torch.cuda.memory._dump_snapshot."
            ) from e
        finally:
            release()
    if not isinstance(data, dict) or "segments" not in data:
        raise SnapshotError(
            f"{p} holds a {type(data).__name__} without 'segments', not a memory snapshot: pass "
            "a file written by torch.cuda.memory._dump_snapshot."
        )
    return data


def check_path(path: str | os.PathLike[str]) -> Path:
    """``path`` (a str or os.PathLike) as a Path to a regular file that exists, or an error that
    says what to pass."""
    name = os.fspath(path) if isinstance(path, os.PathLike) else path
    if not isinstance(name, str):
        raise TypeError(
            f"path={path!r} is a {type(path).__name__}: pass the path of a file written by "
            "torch.cuda.memory._dump_snapshot, as a str or pathlib.Path."
        )
    p = Path(name)
    if p.is_dir():
        raise IsADirectoryError(
            f"path={name!r} is a directory: pass the path of the snapshot file in it, "
            "written by torch.cuda.memory._dump_snapshot(path)."
        )
    if not p.exists():
        raise FileNotFoundError(
            f"path={name!r}: no such file. Pass the path of a file written by "
            "torch.cuda.memory._dump_snapshot(path) on the GPU machine."
        )
    if not p.is_file():  # (a device, a pipe, a socket: reading one may never end)
        raise SnapshotError(
            f"path={name!r} is not a regular file but {_kind(p)}: pass the path of a file "
            "written by torch.cuda.memory._dump_snapshot(path)."
        )
    return p


def _kind(p: Path) -> str:
    if p.is_char_device():
        return "a character device"
    if p.is_block_device():
        return "a block device"
    if p.is_fifo():
        return "a named pipe"
    return "a socket" if p.is_socket() else "another kind of file"


def read_to_the_end(f: Any, p: Path) -> None:
    """Reads what is left of ``f`` when the pickle has ended, if it is a gzip stream: only at
    its end does gzip check the data's CRC and length, so a file cut short, or damaged, is
    refused (pickle stops at its own end, before the gzip trailer)."""
    if not isinstance(f, gzip.GzipFile):
        return
    try:
        while f.read(2**20):
            pass
    except (EOFError, OSError, zlib.error) as e:
        raise SnapshotError(
            f"{p} is a gzip file cut short or damaged ({type(e).__name__}: {e}): its pickle "
            "ends, but the gzip check of what was read (CRC and length) fails. Pass the whole "
            "file written by torch.cuda.memory._dump_snapshot (copy it again)."
        ) from e


def _check_memory(p: Path, pickled: int) -> None:
    free = available_memory()
    if free is not None and pickled * EXPANSION > free:
        raise SnapshotError(
            f"{p} is a {pickled / 2**30:.1f} GiB pickle and reading it takes about "
            f"{pickled * EXPANSION / 2**30:.1f} GiB of memory; {free / 2**30:.1f} GiB are "
            "available. Read it on a machine with more memory, record fewer events "
            "(torch.cuda.memory._record_memory_history(max_entries=...)), or pass "
            "check_memory=False to try anyway."
        )
