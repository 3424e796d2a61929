"""Per-step statistics written by each replica's leader, read by `transom run`'s summary.

One JSON line per step attempt in `<dir>/steps-r<replica>-g<generation>-a<attempt>.jsonl`
(the first also says when the process started: a hot spare's started before it took
over), and one `final-r<replica>-k<rank>.json` per rank with a digest of its parameters when it
finishes, so the runner can check that replicas ended bit-identical without loading torch.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any


def process_started() -> float | None:
    """The wall time at which this process started (Linux /proc), or None."""
    try:
        start_ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return time.time() - (uptime - start_ticks / os.sysconf("SC_CLK_TCK"))


class StatsWriter:
    def __init__(self, directory: str | None, replica_id: int, generation: int, attempt: int, rank: int):
        self.dir = Path(directory) if directory else None
        self.replica_id, self.rank = replica_id, rank
        self._file = None
        if self.dir is not None and rank == 0:
            self.dir.mkdir(parents=True, exist_ok=True)
            name = f"steps-r{replica_id}-g{generation}-a{attempt}.jsonl"
            self._file = open(self.dir / name, "a", buffering=1)

    def step(self, **record: Any) -> None:
        if self._file is not None:
            if self._file.tell() == 0:
                record["process_started"] = process_started()
            self._file.write(json.dumps(record) + "\n")

    def final(self, step: int, digest: str) -> None:
        if self.dir is None:
            return
        path = self.dir / f"final-r{self.replica_id}-k{self.rank}.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"replica": self.replica_id, "rank": self.rank, "step": step, "digest": digest}))
        os.replace(tmp, path)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
