"""`gather`: every rank's report to one rank, as JSON, into a `RankTable`.

Each rank encodes its row (`RankRow.to_dict()`: its report's figures in the report's own
``to_dict()`` keys, with the phase of the peak worked out on the rank, so that no timeline
travels) as JSON bytes; the lengths are all-gathered, the padded bytes gathered to ``dst`` in
uint8 tensors, and ``dst`` parses them with ``json.loads`` and checks every field
(`RankRow.from_dict`). Nothing is pickled: ``gather_object`` would unpickle whatever another
process sent.
"""

from __future__ import annotations

import json
from typing import Any

import torch

from memlab.core.frames import users_traceback
from memlab.distributed.table import RankRow, RankTable
from memlab.region.measure import track
from memlab.reports.report import MemoryReport


def _dist() -> Any:
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "memlab.distributed.gather needs a process group: call "
            "torch.distributed.init_process_group(...) first, or run the function with "
            "memlab.distributed.launch(fn, world_size=2)."
        )
    return dist


@users_traceback()
def gather(region: track | MemoryReport, *, dst: int = 0) -> RankTable | None:
    """Every rank calls it with its measured region (the ``track`` object or its ``report``);
    rank ``dst`` gets the `RankTable` of all ranks, the others ``None``. A collective: every
    rank of the default group must call it."""
    report = region.report if isinstance(region, track) else region
    if not isinstance(report, MemoryReport):
        raise TypeError(
            "memlab.distributed.gather takes a memlab.track object or its .report, got "
            f"{type(region).__name__}."
        )
    dist = _dist()
    rank, world = dist.get_rank(), dist.get_world_size()
    if not isinstance(dst, int) or isinstance(dst, bool) or not 0 <= dst < world:
        raise ValueError(f"dst must be a rank from 0 to {world - 1}, got {dst!r}.")
    backend = str(dist.get_backend())
    on = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else "cpu"
    payload = json.dumps(RankRow.from_report(report, rank).to_dict()).encode()
    sizes = [torch.zeros(1, dtype=torch.int64, device=on) for _ in range(world)]
    dist.all_gather(sizes, torch.tensor([len(payload)], dtype=torch.int64, device=on))
    lengths = [int(s.item()) for s in sizes]
    mine = torch.zeros(max(lengths), dtype=torch.uint8)
    mine[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    bufs = [torch.empty_like(mine, device=on) for _ in range(world)] if rank == dst else None
    dist.gather(mine.to(on), bufs, dst=dst)
    if bufs is None:
        return None
    rows = []
    for r, (buf, n) in enumerate(zip(bufs, lengths, strict=True)):
        data = json.loads(buf[:n].cpu().numpy().tobytes().decode())
        rows.append(RankRow.from_dict(data, r))
    return RankTable(tuple(rows), backend)
