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
  where a framework's fixed cost per step shows;
- `null`: one Linear(16, 16), batch 8, AdamW lr 1e-4: next to no compute and no traffic,
  so the step is the framework's fixed cost (and the optimizer's call).

Every replica starts from the same weights (seed 0) and trains its own batches, a function
of (replica, step) only, so a recovered replica sees what it would have seen.

Shapes (`BENCH_SHAPE`, set by the benchmark for every worker of a run):
- `cpu_bound` (default): the forward and backward passes compute on the CPU, as above;
- `accelerator_shaped`: the way a process drives an accelerator. The same model, the
  same parameters, gradients, exchange, vote and optimizer step, but each batch is one
  row (one sequence for tinygpt), so the host's own arithmetic is small, and every module
  that holds parameters ends its forward, and starts its backward, with a wait that
  releases the CPU (`time.sleep`, no GIL held), as a host thread blocks on a CUDA stream
  with blocking synchronisation. The waits are split over the modules by their share of
  the parameters, and sum to `BENCH_WAIT_FWD_S` and `BENCH_WAIT_BWD_S` per step. The
  benchmarks calibrate them (benchmarks/_rounds.py `shape_env`) so that the step takes as
  long as the CPU-bound one does in the same setting: two short runs, CPU-bound and
  one-row without waits, and the waits make up the difference, split between forward and
  backward as `calibrate` finds the passes split their time. Not modelled: a
  host that runs ahead of the device (kernels queued asynchronously, one wait per step
  rather than per module), copies between device and host, the device's own memory
  bandwidth, and the optimizer step, which still computes on the CPU here.

`BENCH_DEVICE=cuda` puts the model and its batches on the GPU (the shape is then the
device's own; the waits stay 0).

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
import functools
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
MLP_DIM, MLP_LAYERS, BATCH = 2048, 6, 32
SMALL_DIM, SMALL_LAYERS, SMALL_BATCH = 512, 4, 96  # small15
NULL_DIM, NULL_LAYERS, NULL_BATCH = 16, 1, 8  # null
GPT_DIM, GPT_LAYERS, GPT_CONTEXT = 128, 2, 64
MODELS = ("mlp", "tinygpt", "small15", "null")
_MLPS = {"mlp": (MLP_DIM, MLP_LAYERS, BATCH), "small15": (SMALL_DIM, SMALL_LAYERS, SMALL_BATCH),
         "null": (NULL_DIM, NULL_LAYERS, NULL_BATCH)}
SHAPES = ("cpu_bound", "accelerator_shaped")


def shape_env(shape: str, kind: str) -> dict[str, str]:
    """The environment that gives a benchmark's workers `shape` (calibrated here, for `kind`)."""
    if shape == "cpu_bound":
        return {"BENCH_SHAPE": shape}
    fwd_s, bwd_s = calibrate(kind)
    return {"BENCH_SHAPE": shape, "BENCH_WAIT_FWD_S": f"{fwd_s:.6f}", "BENCH_WAIT_BWD_S": f"{bwd_s:.6f}"}


def setup() -> argparse.Namespace:
    """The worker's arguments (`--steps`, `--model`), and torch's threads (BENCH_THREADS, default 1)."""
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--model", choices=MODELS, default="mlp")
    torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "1")))
    return p.parse_args()


class Workload:
    """A model, its optimizer and its batches: `loss(replica, step)` runs the forward pass.

    `shape` and the waits default to BENCH_SHAPE, BENCH_WAIT_FWD_S and BENCH_WAIT_BWD_S."""

    def __init__(self, kind: str, shape: str | None = None, waits: tuple[float, float] | None = None):
        torch.manual_seed(0)  # every replica starts identical
        self.shape = shape or os.environ.get("BENCH_SHAPE", "cpu_bound")
        if self.shape not in SHAPES:
            raise SystemExit(f"BENCH_SHAPE={self.shape!r}: choose one of {', '.join(SHAPES)}")
        self.device = torch.device(os.environ.get("BENCH_DEVICE", "cpu"))
        one_row = self.shape == "accelerator_shaped"
        self._rows = 1 if one_row else BATCH
        if kind in _MLPS:
            dim, depth, self._batch = _MLPS[kind]
            self._batch = 1 if one_row else self._batch
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
        self.model.to(self.device)
        if waits is None:
            waits = (float(os.environ.get("BENCH_WAIT_FWD_S", "0")), float(os.environ.get("BENCH_WAIT_BWD_S", "0")))
        if one_row and any(waits):
            add_waits(self.model, *waits)

    def optimizer(self, model: torch.nn.Module | None = None) -> torch.optim.Optimizer:
        return torch.optim.AdamW((model or self.model).parameters(), lr=self.lr)

    def loss(self, replica: int, step: int, model: torch.nn.Module | None = None) -> torch.Tensor:
        """The forward pass of `replica`'s batch of `step` (through `model`, e.g. a DDP wrapper)."""
        return self._loss(model or self.model, replica, step)

    def _mlp_loss(self, model: Callable, replica: int, step: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(replica * 1_000_003 + step)
        dim = self._dim
        x, y = torch.randn(self._batch, dim, generator=g), torch.randn(self._batch, dim, generator=g)
        return torch.nn.functional.mse_loss(model(x.to(self.device)), y.to(self.device))

    def _gpt_loss(self, model: Callable, replica: int, step: int) -> torch.Tensor:
        x, y = self._tg.batch(self._data, step, replica, 0, 1, self._rows, GPT_CONTEXT)
        return model(x.to(self.device), y.to(self.device))


def add_waits(model: torch.nn.Module, fwd_s: float, bwd_s: float) -> None:
    """Every module that holds parameters waits at the end of its forward, and at the start of
    its backward (a hook on its output's gradient), for its share of `fwd_s` and `bwd_s` by
    parameter count: the time a device would spend on its kernels."""
    holders = [m for m in model.modules() if any(True for _ in m.parameters(recurse=False))]
    sizes = [sum(p.numel() for p in m.parameters(recurse=False)) for m in holders]
    for module, size in zip(holders, sizes):
        share = size / sum(sizes)
        module.register_forward_hook(functools.partial(_wait, fwd_s * share, bwd_s * share))


def _wait(fwd_s: float, bwd_s: float, module: torch.nn.Module, inputs: object, output: object) -> None:
    time.sleep(fwd_s)
    if isinstance(output, torch.Tensor) and output.requires_grad:
        output.register_hook(lambda grad: time.sleep(bwd_s))  # returns None: the gradient is unchanged


def calibrate(kind: str, steps: int = 6) -> tuple[float, float]:
    """The waits of the accelerator-shaped step: per step, the CPU-bound forward and backward
    passes' median times less the one-row passes' (this process alone, BENCH_THREADS threads)."""
    def passes(work: Workload) -> tuple[float, float]:
        fwd, bwd = [], []
        for step in range(steps + 1):
            t0 = time.perf_counter()
            loss = work.loss(0, step)
            t1 = time.perf_counter()
            loss.backward()
            t2 = time.perf_counter()
            if step:  # the first pass warms up the allocator
                fwd.append(t1 - t0)
                bwd.append(t2 - t1)
        return statistics.median(fwd), statistics.median(bwd)

    full = passes(Workload(kind, "cpu_bound"))
    light = passes(Workload(kind, "accelerator_shaped", waits=(0.0, 0.0)))
    return max(0.0, full[0] - light[0]), max(0.0, full[1] - light[1])


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


if __name__ == "__main__":  # the benchmarks ask a fresh process: python workload.py --env SHAPE --model KIND
    cli = argparse.ArgumentParser()
    cli.add_argument("--env", choices=SHAPES, required=True)
    cli.add_argument("--model", choices=MODELS, default="mlp")
    ns = cli.parse_args()
    torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "1")))
    print(json.dumps(shape_env(ns.env, ns.model)))
