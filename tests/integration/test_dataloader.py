"""An ordinary DataLoader loop (ft.ReplicaSampler, trainer.batches, worker processes, the
wrapped optimizer, GradScaler) through a real SIGKILL of one replica, and through a whole-job
restart from a checkpoint: the replicas end bit-identical, every committed step trained on
exactly the batch the sampler gives that replica at that step, no sample was trained on
twice in an epoch's committed steps, and an overflow on one replica skipped the update on
all of them. Each job with a kill ends a few steps after the killed replica caught up
(`--end-on`); its step count is only a cap."""

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
REPLICAS = 2
# Steps: only a cap, each job with a kill ends a few steps after its replica caught up. The
# survivors run 15-100 steps a second here and a restart takes 3-30 s with the machine's
# load, and a catch-up's serving threads run at the lowest CPU priority (docs/recovery.md):
# the cap must be far beyond the loaded case, where 600 once ended a slow catch-up.
CAP = "3000"


class _Ctx:
    def __init__(self, replica: int):
        self.replica_id, self.num_replicas, self.rank, self.world_size = replica, REPLICAS, 0, 1


def _committed(logs: Path) -> list[dict]:
    records = [json.loads(line) for f in logs.glob("*.jsonl") for line in f.read_text().splitlines()]
    return [r for r in records if r["committed"]]


def _check_samples(committed: list[dict], steps: int) -> Counter:
    """Each committed step trained on that replica's batch of that step, however it got there,
    and no sample twice within an epoch's committed steps. Returns the (replica, step) counts."""
    per_epoch = (SAMPLES // REPLICAS) // BATCH
    for r in committed:
        sampler = ReplicaSampler(range(SAMPLES), _Ctx(r["replica"]), seed=5)
        sampler.set_step(r["step"], BATCH)
        assert r["indices"] == list(sampler)[:BATCH], r
    steps_of = Counter((r["replica"], r["step"]) for r in committed)
    assert max(steps_of.values()) == 1  # a replica commits a step once
    for epoch in range(steps // per_epoch):
        used = [i for r in committed if r["step"] // per_epoch == epoch for i in r["indices"]]
        assert len(used) == len(set(used)), f"epoch {epoch}: a sample trained twice"
    return steps_of


def _check_overflow(committed: list[dict], inf_step: int) -> None:
    """GradScaler: the overflow on one replica skipped the update on every replica at that
    step and halved the scale everywhere, a rejoined replica included (the scale is replica state)."""
    at = [r for r in committed if r["step"] == inf_step]
    assert at and not any(r["updated"] for r in at), at
    assert all(r["updated"] for r in committed if r["step"] != inf_step)
    assert {r["scale"] for r in committed if r["step"] < inf_step} <= {1024.0}
    assert {r["scale"] for r in committed if r["step"] >= inf_step} == {512.0}


def test_dataloader_loop_survives_a_sigkill_without_training_a_sample_twice(transom_run, tmp_path):
    logs = tmp_path / "logs"
    logs.mkdir()
    result = transom_run(["--replicas", str(REPLICAS), "--inject", "kill:replica=1,step=12", "--end-on", "caught_up:1"],
                         ["--steps", CAP, "--log-dir", str(logs), "--workers", "2", "--inf-at", "0:5"], script=JOB)
    result.assert_finished_together(REPLICAS)
    steps = result.end_step()
    assert result.summary["replica_restarts"] >= 1, "the kill must have happened"
    committed = _committed(logs)
    steps_of = _check_samples(committed, steps)
    _check_overflow(committed, 5)
    # The killed replica's share of the steps it missed was skipped, not trained later.
    missed = {step for step in range(steps) if (1, step) not in steps_of}
    assert missed, "replica 1 was killed: some steps went on without it"
    assert all(step >= 12 for step in missed)
    assert any(r["replica"] == 1 and r["step"] > max(missed) for r in committed), "replica 1 never rejoined"


def test_dataloader_loop_goes_on_from_a_checkpoint_where_it_left_off(transom_run, tmp_path):
    """A whole job stopped at step 30 and started again from its checkpoint: the second run
    starts at step 30 with the sampler there and the GradScaler's scale restored, and the two
    runs together train no sample twice; a SIGKILL in the second run too."""
    logs, uri = tmp_path / "logs", tmp_path / "checkpoints"
    logs.mkdir()
    common = ["--replicas", str(REPLICAS), "--checkpoint-uri", str(uri), "--checkpoint-interval", "10",
              "--job-name", "loader"]  # the second run continues the first's job
    first = transom_run(common, ["--steps", "30", "--log-dir", str(logs), "--workers", "2", "--inf-at", "1:20"],
                        script=JOB)
    assert first.returncode == 0 and first.summary["completed_step"] == 30, first.output[-4000:]
    # The kill lands between two checkpoints: one whose writer dies is not committed, and its
    # committer waits out CHECKPOINT_COMMIT_TIMEOUT_S for the lost part before the next one.
    second = transom_run([*common, "--inject", "kill:replica=1,step=45", "--end-on", "caught_up:1"],
                         ["--steps", CAP, "--log-dir", str(logs), "--workers", "2"], script=JOB)
    second.assert_finished_together(REPLICAS)
    assert second.summary["replica_restarts"] >= 1
    committed = _committed(logs)
    steps_of = _check_samples(committed, second.end_step())
    assert all(steps_of[(r, step)] == 1 for r in range(REPLICAS) for step in range(30)), "the first run is whole"
    _check_overflow(committed, 20)  # the second run's steps at 512: the scale came from the checkpoint
    assert any(r["step"] >= 30 for r in committed)


EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "train_dataloader.py"


def test_the_dataloader_example_survives_a_sigkill(transom_run):
    """examples/train_dataloader.py (sampler, worker processes, AdamW with a cosine schedule
    as extra state, clipping on the averaged gradients) through a real SIGKILL."""
    result = transom_run(["--replicas", "3", "--inject", "kill:replica=1,step=30", "--end-on", "caught_up:1"],
                         ["--steps", "3000", "--workers", "2"], script=EXAMPLE)
    result.assert_finished_together(3)
    s = result.summary
    assert s["replica_restarts"] >= 1
    first = [r["loss"] for r in result.records(0) if r["committed"]][:10]
    assert s["final_loss"] < 0.5 * sum(first) / len(first), s  # it trained through the kill
