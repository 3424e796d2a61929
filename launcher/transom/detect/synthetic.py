"""Synthetic traces with the properties that fool simple detectors, for benchmarks/detect_eval.py
and the tests.

Each rank trains on packed batches of `tokens_per_batch` tokens cut from documents whose
lengths are long-tailed (log-normal, most a few hundred tokens, some as long as the batch).
Its busy time follows the workload as measured on real models (ResiHP): a part linear in the
tokens, a part in the sum of squared sequence lengths (attention), a fixed part, and a few
percent of noise. A batch holding one long document so takes several times as long as one
of short documents, on a perfectly healthy GPU.

Faults are injected as the detectors would see them: a rank slowed by a factor from some
step on, a hang (a step that never ends: as long as the watchdog's timeout), non-finite
losses on one replica, and a flipped bit in one replica's parameters (its fingerprint
differs from the next fingerprint step on).
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator
from dataclasses import dataclass, field

from transom.detect.step_rows import Signal


@dataclass(frozen=True)
class Injection:
    kind: str  # slow | hang | nan | sdc
    replica: int
    rank: int
    step: int
    factor: float = 1.0  # slow: the slowdown
    steps: int = 3  # nan: consecutive non-finite steps


@dataclass
class TraceSpec:
    replicas: int = 4
    ranks: int = 4
    steps: int = 2000
    seed: int = 0
    tokens_per_batch: int = 8192
    median_doc: float = 300.0  # tokens
    doc_sigma: float = 1.4  # of log(length): a long tail
    seconds_per_token: float = 20e-6
    seconds_per_len_sq: float = 40e-9  # attention: sum of squared lengths
    fixed_seconds: float = 0.05
    noise: float = 0.015  # relative, per step
    fingerprint_interval: int = 50
    injections: list[Injection] = field(default_factory=list)


def packed_batch(rng: random.Random, spec: TraceSpec) -> tuple[int, float]:
    """(tokens, sum of squared lengths) of one packed batch (the last document is cut)."""
    left, sum_sq = spec.tokens_per_batch, 0.0
    while left > 0:
        n = min(left, max(1, int(rng.lognormvariate(math.log(spec.median_doc), spec.doc_sigma))))
        sum_sq += n * n
        left -= n
    return spec.tokens_per_batch, sum_sq


def generate(spec: TraceSpec) -> Iterator[Signal]:
    """The trace's rows in step order."""
    rng = random.Random(spec.seed)
    by_kind: dict[str, list[Injection]] = {}
    for inj in spec.injections:
        by_kind.setdefault(inj.kind, []).append(inj)
    for step in range(spec.steps):
        base_loss = 2.0 + 8.0 * math.exp(-step / 400)
        for replica in range(spec.replicas):
            nan = any(i.replica == replica and i.step <= step < i.step + i.steps for i in by_kind.get("nan", ()))
            for rank in range(spec.ranks):
                tokens, sum_sq = packed_batch(rng, spec)
                seconds = (spec.seconds_per_token * tokens + spec.seconds_per_len_sq * sum_sq + spec.fixed_seconds)
                seconds *= math.exp(rng.gauss(0.0, spec.noise))
                for i in by_kind.get("slow", ()):
                    if (i.replica, i.rank) == (replica, rank) and step >= i.step:
                        seconds *= i.factor
                if any((i.replica, i.rank, i.step) == (replica, rank, step) for i in by_kind.get("hang", ())):
                    seconds = 1e6  # never ended: the watchdog's report
                loss = float("nan") if nan else base_loss * math.exp(rng.gauss(0.0, 0.02))
                fingerprint = None
                if spec.fingerprint_interval and step % spec.fingerprint_interval == 0:
                    fingerprint = 1000 * step + rank  # what identical parameters give
                    if any((i.replica, i.rank) == (replica, rank) and step >= i.step for i in by_kind.get("sdc", ())):
                        fingerprint += 1
                yield Signal(step=step, replica=replica, rank=rank, step_seconds=seconds, tokens=tokens,
                             sum_len_sq=sum_sq, loss=loss, grad_norm=1.0, finite=not nan, fingerprint=fingerprint)
