"""An ordinary DataLoader loop (ft.ReplicaSampler, trainer.batches, worker processes) through
a real SIGKILL of one replica: the replicas end bit-identical, every committed step trained
on exactly the batch the sampler gives that replica at that step, and no sample was trained
on twice in an epoch's committed steps."""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "scripts"))

from dataloader_job import BATCH, SAMPLES  # noqa: E402
from transom.ft.data import ReplicaSampler  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]
JOB = Path(__file__).parent / "scripts" / "dataloader_job.py"
REPLICAS, STEPS = 3, 60


class _Ctx:
    def __init__(self, replica: int):
        self.replica_id, self.num_replicas, self.rank, self.world_size = replica, REPLICAS, 0, 1


def test_dataloader_loop_survives_a_sigkill_without_training_a_sample_twice(transom_run, tmp_path):
    logs = tmp_path / "logs"
    logs.mkdir()
    result = transom_run(["--replicas", str(REPLICAS), "--inject", "kill:replica=1,step=12"],
                         ["--steps", str(STEPS), "--log-dir", str(logs), "--workers", "2",
                          "--step-seconds", "0.15"], script=JOB)
    assert result.returncode == 0, result.output[-4000:]
    s = result.summary
    assert s["completed_step"] == STEPS and s["replicas_bit_identical"] is True
    assert s["replica_restarts"] >= 1, "the kill must have happened"

    records = [json.loads(line) for f in logs.glob("*.jsonl") for line in f.read_text().splitlines()]
    committed = [r for r in records if r["committed"]]
    per_epoch = (SAMPLES // REPLICAS) // BATCH
    # Each committed step trained on that replica's batch of that step, however it got there.
    for r in committed:
        sampler = ReplicaSampler(range(SAMPLES), _Ctx(r["replica"]), seed=5)
        sampler.set_step(r["step"], BATCH)
        assert r["indices"] == list(sampler)[:BATCH], r
    # No sample twice within an epoch's committed steps (a replica commits a step once).
    steps_of = Counter((r["replica"], r["step"]) for r in committed)
    assert max(steps_of.values()) == 1
    for epoch in range(STEPS // per_epoch):
        used = [i for r in committed if r["step"] // per_epoch == epoch for i in r["indices"]]
        assert len(used) == len(set(used)), f"epoch {epoch}: a sample trained twice"
    # The killed replica's share of the steps it missed was skipped, not trained later.
    missed = {step for step in range(STEPS) if (1, step) not in steps_of}
    assert missed, "replica 1 was killed: some steps went on without it"
    assert all(step >= 12 for step in missed)


EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "train_dataloader.py"


def test_the_dataloader_example_survives_a_sigkill(transom_run):
    """examples/train_dataloader.py (sampler, worker processes, AdamW with a cosine schedule
    as extra state, clipping on the averaged gradients) through a real SIGKILL."""
    # 1,500 steps (~25 s): long enough that the killed replica (~5 s to restart) rejoins.
    result = transom_run(["--replicas", "3", "--inject", "kill:replica=1,step=30"],
                         ["--steps", "1500", "--workers", "2"], script=EXAMPLE)
    assert result.returncode == 0, result.output[-4000:]
    s = result.summary
    assert s["completed_step"] == 1500 and s["replicas_bit_identical"] is True and s["replica_restarts"] >= 1
    assert s["final_loss"] < 0.5, s
