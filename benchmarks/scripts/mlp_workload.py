"""The recovery benchmark's workload, shared by its Transom and torchft workers: torchft's
own kind of test model (a ~100 MB MLP, AdamW) on synthetic data, and the per-step log both
workers write, so one analysis reads both (benchmarks/recovery.py).

Each process writes `<out>/<system>-r<replica>-<pid>.jsonl`: a first line
`{"start": t}` with the wall time at which the process started (taken before torch is
imported), then one line per step attempt: `{"step", "t" (end), "seconds", "committed",
"contributing"}`. `step` is the number of committed steps after the attempt.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch

DIM, LAYERS, BATCH = 2048, 6, 32  # 6 x 2048^2 weights: 25.2 M parameters, 100.7 MB in float32


def setup() -> argparse.Namespace:
    """The worker's arguments (`--steps`), and torch's threads (BENCH_THREADS, default 1)."""
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, required=True)
    torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "1")))
    return p.parse_args()


def build_model() -> torch.nn.Module:
    torch.manual_seed(0)  # every replica starts identical
    layers: list[torch.nn.Module] = []
    for _ in range(LAYERS):
        layers += [torch.nn.Linear(DIM, DIM), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers[:-1])


def batch(replica: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(replica * 1_000_003 + step)
    return torch.randn(BATCH, DIM, generator=g), torch.randn(BATCH, DIM, generator=g)


class StepLog:
    def __init__(self, system: str, replica: int, started: float):
        out = Path(os.environ["BENCH_OUT"])
        self._file = open(out / f"{system}-r{replica}-{os.getpid()}.jsonl", "a", buffering=1)
        self._file.write(json.dumps({"start": started}) + "\n")

    def step(self, step: int, t: float, seconds: float, committed: bool, contributing: bool) -> None:
        self._file.write(json.dumps({"step": step, "t": t, "seconds": round(seconds, 6), "committed": committed,
                                     "contributing": contributing}) + "\n")

    def close(self) -> None:
        self._file.close()
