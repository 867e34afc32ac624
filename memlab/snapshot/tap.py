"""The file the snapshot's loader reads through: it counts the bytes, calls the drain every so
many (`memlab.snapshot.stream`), and keeps the reading from taking the memory the kernel needs.

A gzipped pickle can unpack to a thousand times its size (a "decompression bomb": one huge
string, or a list of a billion ``None``), and a memory snapshot's events are drained as they are
read, so its size on disk says little about the memory it takes. The tap therefore looks at the
memory the system has left every ``every`` bytes, inside a big read too, and stops the reading
with a `SnapshotError` once it has taken three quarters of what was available when it began.
"""

from __future__ import annotations

from typing import Any

from memlab.reports.units import fmt_bytes
from memlab.snapshot.unpickle import SnapshotError, available_memory

#: The reading stops when the memory available falls below this share of what it was at the start.
FLOOR = 0.25


class Tap:
    """A file that calls ``hook`` after every ``every`` bytes read, and checks the memory left
    as often (``name``, ``size``: the file's, for the error)."""

    def __init__(self, raw: Any, every: int, name: str = "the file", size: int = 0) -> None:
        self.raw, self.every, self.next = raw, every, every
        self.read_bytes = 0
        self.hook: Any = None
        self.name, self.size = name, size
        self.start = available_memory()
        self.checked = 0  # bytes read at the last look at the memory

    def read(self, n: int = -1) -> bytes:
        if n is None or n < 0 or n <= self.every:
            data: bytes = self.raw.read(n)
            self._count(len(data))
        else:  # one big object: read a piece at a time, the memory looked at in between
            parts = []
            while n > 0:
                part = self.raw.read(min(n, self.every))
                if not part:
                    break
                parts.append(part)
                n -= len(part)
                self._count(len(part))
            data = b"".join(parts)
        if self.read_bytes >= self.next and self.hook is not None:
            self.next = self.read_bytes + self.every
            self.hook()
        return data

    def readinto(self, b: Any) -> int:
        view, done = memoryview(b).cast("B"), 0
        while done < len(view):
            n: int = self.raw.readinto(view[done : done + self.every])
            if not n:
                break
            done += n
            self._count(n)
        return done

    def readline(self) -> bytes:
        line: bytes = self.raw.readline()
        self._count(len(line))
        return line

    def _count(self, n: int) -> None:
        self.read_bytes += n
        if self.start is None or self.read_bytes - self.checked < self.every:
            return
        self.checked = self.read_bytes
        left = available_memory()
        if left is not None and left < self.start * FLOOR:
            raise SnapshotError(
                f"{self.name}: reading it took the memory available from "
                f"{fmt_bytes(self.start)} down to {fmt_bytes(left)} after "
                f"{fmt_bytes(self.read_bytes)} of pickle ({fmt_bytes(self.size)} on disk), and "
                "memlab stopped before the kernel ran out. A memory snapshot's events are "
                "drained as they are read: this file unpacks to something else (a "
                "decompression bomb?). Pass a file written by torch.cuda.memory._dump_snapshot."
            )
