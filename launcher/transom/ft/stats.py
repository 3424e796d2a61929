"""Per-step statistics written by each replica's leader, read by `transom run`'s summary.

One JSON line per step attempt in `<dir>/steps-r<replica>-g<generation>-a<attempt>.jsonl`,
and one `final-r<replica>-k<rank>.json` per rank with a digest of its parameters when it
finishes, so the runner can check that replicas ended bit-identical without loading torch.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


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
