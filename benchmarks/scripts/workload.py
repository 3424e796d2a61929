"""The workloads the comparison benchmarks train, shared by their Transom, torchft and DDP
workers, and the per-step log all of them write, so one analysis reads every system
(benchmarks/recovery.py, benchmarks/ftar_overhead.py).

Models (`--model`):
- `mlp`: torchft's own kind of test model, a ~100 MB MLP (6 x 2048², 25.2 M parameters,
  float32) on synthetic data, AdamW lr 1e-4, batch 32;
- `tinygpt`: the tiny GPT of examples/train_tiny_gpt.py (dim 128, 2 layers, context 64) on
  its synthetic corpus, AdamW lr 3e-3, batch 32 x 64 tokens;
- `small15`: a toy MLP (4 x 512², 1.05 M parameters, 4 MB) on synthetic data, AdamW lr
  1e-4, batch 96: a failure-free DDP step of about 15 ms on the 2-core development box,
  where a framework's fixed cost per step shows.

Every replica starts from the same weights (seed 0) and trains its own batches, a function
of (replica, step) only, so a recovered replica sees what it would have seen.

Each process writes `<BENCH_OUT>/<system>-r<replica>-<pid>.jsonl`: a first line
`{"start": t, "imported": t, "built": t, "joined": t}` with the wall times at which the
process started (taken by the worker before torch is imported), had imported torch and its
system, had built the model and optimizer, and had set up its fault tolerance (Transom's
FaultTolerant, torchft's Manager: registered, for a spare taken over), then one line per
step attempt: `{"step", "t" (end), "seconds", "committed", "contributing"}`, where `step` is
the number of committed steps after it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
MLP_DIM, MLP_LAYERS, BATCH = 2048, 6, 32
SMALL_DIM, SMALL_LAYERS, SMALL_BATCH = 512, 4, 96  # small15
GPT_DIM, GPT_LAYERS, GPT_CONTEXT = 128, 2, 64
MODELS = ("mlp", "tinygpt", "small15")


def setup() -> argparse.Namespace:
    """The worker's arguments (`--steps`, `--model`), and torch's threads (BENCH_THREADS, default 1)."""
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--model", choices=MODELS, default="mlp")
    torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "1")))
    return p.parse_args()


class Workload:
    """A model, its optimizer and its batches: `loss(replica, step)` runs the forward pass."""

    def __init__(self, kind: str):
        torch.manual_seed(0)  # every replica starts identical
        if kind in ("mlp", "small15"):
            dim, depth, self._batch = (MLP_DIM, MLP_LAYERS, BATCH) if kind == "mlp" else \
                (SMALL_DIM, SMALL_LAYERS, SMALL_BATCH)
            self._dim = dim
            layers: list[torch.nn.Module] = []
            for _ in range(depth):
                layers += [torch.nn.Linear(dim, dim), torch.nn.ReLU()]
            self.model: torch.nn.Module = torch.nn.Sequential(*layers[:-1])
            self.lr = 1e-4
            self._loss = self._mlp_loss
        else:
            sys.path.insert(0, str(REPO / "examples"))
            import train_tiny_gpt as tg

            text = tg.make_corpus()
            chars = sorted(set(text))
            self._tg, self._data = tg, torch.tensor([chars.index(c) for c in text], dtype=torch.long)
            self.model = tg.TinyGPT(len(chars), dim=GPT_DIM, layers=GPT_LAYERS, context=GPT_CONTEXT)
            self.lr = 3e-3
            self._loss = self._gpt_loss

    def optimizer(self, model: torch.nn.Module | None = None) -> torch.optim.Optimizer:
        return torch.optim.AdamW((model or self.model).parameters(), lr=self.lr)

    def loss(self, replica: int, step: int, model: torch.nn.Module | None = None) -> torch.Tensor:
        """The forward pass of `replica`'s batch of `step` (through `model`, e.g. a DDP wrapper)."""
        return self._loss(model or self.model, replica, step)

    def _mlp_loss(self, model: Callable, replica: int, step: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(replica * 1_000_003 + step)
        dim = self._dim
        x, y = torch.randn(self._batch, dim, generator=g), torch.randn(self._batch, dim, generator=g)
        return torch.nn.functional.mse_loss(model(x), y)

    def _gpt_loss(self, model: Callable, replica: int, step: int) -> torch.Tensor:
        x, y = self._tg.batch(self._data, step, replica, 0, 1, BATCH, GPT_CONTEXT)
        return model(x, y)


class StepLog:
    def __init__(self, system: str, replica: int, started: float, **phases: float):
        """`phases`: wall times the process reached its start-up's milestones (imported,
        built, joined), written into the first line beside `start`."""
        out = Path(os.environ["BENCH_OUT"])
        self._file = open(out / f"{system}-r{replica}-{os.getpid()}.jsonl", "a", buffering=1)
        self._file.write(json.dumps({"start": started, **phases}) + "\n")

    def step(self, step: int, t: float, seconds: float, committed: bool, contributing: bool) -> None:
        self._file.write(json.dumps({"step": step, "t": t, "seconds": round(seconds, 6), "committed": committed,
                                     "contributing": contributing}) + "\n")

    def close(self) -> None:
        self._file.close()
