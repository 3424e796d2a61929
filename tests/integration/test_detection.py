"""Anomalies really happening in real runs: each is detected, acted on, survived.

The faults are injected in the workers (transom/inject.py): a rank that sleeps half its
step again (1.5x), a worker that hangs in Python mid-step, NaN gradients on one replica, a
flipped bit in one replica's weights, a replica that lies about its step times, replicas
seeded so that they train on the same data. The other replicas keep training, the faulty
one is replaced (restarted) by the detectors' verdict, and every replica ends
bit-identical. A job with a verdict ends a few steps after the replaced replica caught up
(`--end-on`); its step count is only a cap.

Where a process is the point (a hang, which a thread cannot leave; a step time measured
against another process's; a replica's own credential; the CLI's trace and replay) the job
is `transom run` with the tiny GPT example. Where only the logic is (non-finite gradients,
silent data corruption, duplicate data), the replicas are threads of this process
(threaded_job.py) with the same coordinator, detectors, forwarder and trainer.
"""

from __future__ import annotations

import csv
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from test_fault_tolerance import CAP
from threaded_job import TinyGPT
from transom.checkpoint import layout
from transom.checkpoint.engine import CheckpointConfig
from transom.ft import FaultTolerant

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def verdicts(result) -> list[str]:
    """The verdicts that acted. FailSlow verdicts are reported only by default (slowAction), and
    on this shared 2-core machine the CPU scheduler alone can make a replica look slow."""
    return [e for e in result.summary["events"] if e.startswith("verdict:") and "(Replace)" in e]


def test_a_slow_rank_is_found_and_replaced(transom_run, tmp_path):
    trace = tmp_path / "trace.csv"
    # A 3x slowdown against a 1.6x threshold: under load the sleeping replica frees CPU for the
    # other's compute, so a slowdown shows as less than it is (1.5x as 1.2-1.7x), and a loaded
    # shared machine's noise alone reached 1.26x for 6 steps (a false verdict at the default
    # 1.15x). The threshold's own behaviour is the unit tests' (test_detect.py).
    detection = {"warmupSteps": 10, "slowSteps": 6, "slowFactorPercent": 160, "slowAction": "Replace"}
    # Two replicas, one per core: with three on two cores, the sleeping replica frees CPU for
    # the others' compute and the slowdown it shows is much less than it is.
    result = transom_run(["--replicas", "2", "--detection", json.dumps(detection), "--trace-out", str(trace),
                          "--inject", "slow:replica=1,step=20,factor=3",
                          "--end-on", "verdict:1", "--end-on", "caught_up:1"], CAP)
    result.assert_finished_together(2)
    found = verdicts(result)
    # Named once, for the slowdown. The run of slow steps that made the verdict need not start
    # at step 20: on this shared machine a noisy step below the threshold can restart it later,
    # and one or two noisy steps just before step 20 can start it earlier (seen: step 18). But
    # it must reach into the slowdown: a run of `slowSteps` that ends before step 20 would be a
    # false alarm on clean steps.
    assert len(found) == 1 and "replica 1: FailSlow from step " in found[0], found
    assert int(found[0].split("from step ")[1].split()[0]) > 20 - detection["slowSteps"], found
    assert result.incarnations(1) == 2 and result.incarnations(0) == 1
    # The trace holds what the detectors saw; replaying it finds the same rank.
    with open(trace, newline="") as f:
        rows = list(csv.DictReader(f))
    assert {r["replica"] for r in rows} == {"0", "1"}
    out = subprocess.run([sys.executable, "-m", "transom", "detect", "replay", str(trace), "--json",
                          "--detection", json.dumps(detection)], capture_output=True, text=True, timeout=60, check=True)
    replayed = json.loads(out.stdout)["verdicts"]
    assert [(v["replica"], v["kind"]) for v in replayed][:1] == [(1, "slow")], replayed


def test_a_hang_dumps_every_thread_and_restarts_the_replica(transom_run):
    result = transom_run(["--replicas", "2", "--detection", '{"hangTimeoutSeconds": 5}',
                          "--inject", "hang:replica=1,step=12", "--end-on", "verdict:1", "--end-on", "caught_up:1"],
                         CAP)
    result.assert_finished_together(2)
    assert result.incarnations(0) == 1 and result.incarnations(1) == 2
    found = verdicts(result)
    assert len(found) == 1 and "replica 1: Hang" in found[0]
    # The stacks name where it hung (the injected sleep inside the step) and its other threads.
    assert "in maybe_fire" in result.output and "_heartbeat_loop" in result.output
    assert "stacks:" in found[0]


def test_nan_gradients_are_applied_nowhere_and_repeated_ones_replace_the_replica(threaded_job):
    gpt = TinyGPT()
    result = threaded_job(3, gpt.steps(500), gpt.build, faults={1: ["nan:step=12,count=3"]},
                          end_on=["verdict:1", "caught_up:1"])
    result.assert_finished_together(3)
    found = verdicts(result)
    assert len(found) == 1 and "replica 1: NonFinite" in found[0], found
    assert result.incarnations(1) == 2
    # NaN went into the all-reduce: had any replica applied the averaged update, its weights
    # would be NaN and its loss too; the others finished with finite losses, bit-identical.
    assert "step 12 applied on no replica" in result.output


def test_one_nan_step_is_skipped_everywhere_without_a_verdict(threaded_job):
    gpt = TinyGPT()
    result = threaded_job(2, gpt.steps(30), gpt.build, faults={0: ["nan:step=8"]})
    result.assert_finished_together(2)
    assert verdicts(result) == [] and result.incarnations(0) == 1
    assert result.output.count("step 8 applied on no replica") == 2  # one line per replica


def test_a_flipped_bit_is_caught_at_the_next_fingerprint_and_the_replica_replaced(threaded_job):
    gpt = TinyGPT()
    result = threaded_job(3, gpt.steps(500), gpt.build, detection={"fingerprintInterval": 10},
                          faults={0: ["bitflip:step=13"]}, end_on=["verdict:0", "caught_up:0"])
    result.assert_finished_together(3)  # bit-identical: the corrupt copy did not survive
    found = verdicts(result)
    assert len(found) == 1 and "replica 0: SilentDataCorruption from step 19" in found[0], found
    assert result.incarnations(0) == 2


def unregistered_schedule(gpt: TinyGPT, num_steps: int):
    """The build and body of the tiny GPT's loop with an LR schedule that the script steps but
    never gave to Transom (an easy mistake): a restarted replica takes its peer's weights and
    optimizer state, and starts its schedule over."""
    optimizers: dict[int, torch.optim.Optimizer] = {}

    def build(replica: int):
        model, optimizer = gpt.build(replica)
        optimizers[replica] = optimizer
        return model, optimizer

    def body(replica: int, trainer: FaultTolerant, model: torch.nn.Module) -> None:
        schedule = TinyGPT.schedule(optimizers[replica])  # not extra_state: not replica state
        for step in trainer.steps(num_steps):
            x, y = tg_batch(gpt, step, replica)
            model(x, y).backward()
            if trainer.finish_step():
                schedule.step()

    return build, body


def tg_batch(gpt: TinyGPT, step: int, replica: int):
    from threaded_job import _data, _example

    return _example().batch(_data(), step, replica, 0, 1, gpt.batch_size, gpt.context)


def test_replicas_that_diverge_without_a_majority_stop_the_job_and_are_never_checkpointed_together(
        threaded_job, tmp_path):
    gpt, ckpt = TinyGPT(), tmp_path / "ckpt"
    build, body = unregistered_schedule(gpt, 500)
    result = threaded_job(2, body, build, detection={"fingerprintInterval": 5}, faults={1: ["raise:step=6"]},
                          checkpoint=CheckpointConfig(str(ckpt), interval_steps=5, keep=100), timeout_s=120)
    assert result.returncode != 0
    stopped = [e for e in result.summary["events"] if e.startswith("diverged:")]
    assert len(stopped) == 1 and "replicas 0, 1 hold different parameters or optimizer state" in stopped[0], \
        result.summary["events"]
    at = int(re.search(r"at step (\d+)", stopped[0]).group(1))
    assert at < 500
    # Both replicas stopped with the reason (a ScriptError: no restart), none completed.
    assert "replica 0: Diverged: replica 0 stops at step" in result.output
    assert "replica 1: Diverged: replica 1 stops at step" in result.output
    assert result.summary.get("completed_step") is None
    # No checkpoint is assembled from both once they disagreed (one written by replica 0
    # alone, while replica 1 still caught up, holds replica 0's state only).
    both = sorted(step for p in ckpt.iterdir() if (p / layout.MANIFEST).exists()
                  and (step := layout.parse_step_dir(p.name)) is not None
                  and layout.Manifest.from_json((p / layout.MANIFEST).read_text()).num_parts == 2)
    assert all(step < at for step in both), (both, at)


def test_replicas_that_differ_at_the_last_step_fail_the_job_though_it_completed(threaded_job, tmp_path):
    # A bit of replica 1's weights flips after step 25 of 30; no fingerprint is due before the
    # end (interval 1000), but the job's last step is always compared: the job completed, and
    # failed, and its final checkpoint is not assembled from the two.
    gpt, ckpt = TinyGPT(), tmp_path / "ckpt"
    result = threaded_job(2, gpt.steps(30), gpt.build, detection={"fingerprintInterval": 1000},
                          faults={1: ["bitflip:step=25"]}, checkpoint=CheckpointConfig(str(ckpt), interval_steps=1000))
    assert result.summary["completed_step"] == 30 and result.returncode != 0
    assert "replicas 0, 1 hold different parameters or optimizer state at step 29" in str(result.summary["diverged"])
    assert not (ckpt / layout.step_dir(30) / layout.MANIFEST).exists()
    assert "checkpoint of step 30 not committed: the replicas that wrote shard 0 hold different" in result.output


def test_a_replica_that_lies_about_itself_condemns_no_one_and_speaks_for_no_one_else(transom_run, tmp_path):
    """Issue 28, findings 1 and 3 in a real run: replica 2's script says every one of its steps
    took 10 us (before, with three replicas, that made the other two "2x slow, blame Node"
    and, with slowAction Replace, restarted them), and with its own credential tries to post a
    failure in replica 0's name and to read the job's status."""
    script = Path(__file__).parent / "scripts" / "hostile_replica.py"
    detection = {"warmupSteps": 5, "slowSteps": 5, "slowAction": "Replace"}
    result = transom_run(["--replicas", "3", "--detection", json.dumps(detection)],
                         ["--steps", "60", "--liar", "2", "--out", str(tmp_path)], script=script)
    assert result.returncode == 0, result.output[-3000:]
    assert json.loads((tmp_path / "attempts.json").read_text()) == {"status": 403, "failure_as_replica_0": 403}
    framed = [e for e in result.summary["events"] if e.startswith(("verdict:", "failed:")) and "replica 2" not in e]
    assert framed == [], framed
    assert result.incarnations(0) == result.incarnations(1) == 1


def seeded_batches(seed_by: str, indices: bool):
    """The build and body of a loop whose batches are drawn from a generator seeded the way a
    first port often seeds it: by the rank alone (`seed_by` "rank", nanoGPT's `seed_offset =
    ddp_rank`; every replica is a world of its own with ranks 0..world_size-1, so rank k of
    every replica draws the same batches), or by the replica and the rank ("replica-rank").
    `indices`: the model's input is not the data; the loop names the sample indices with
    `trainer.fingerprint_input` instead."""
    data = torch.randn(4096, 4, generator=torch.Generator().manual_seed(1))

    def build(replica: int):
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 1)
        return model, torch.optim.SGD(model.parameters(), lr=0.01)

    def body(replica: int, trainer: FaultTolerant, model: torch.nn.Module) -> None:
        ctx = trainer.ctx
        offset = ctx.rank if seed_by == "rank" else replica * ctx.world_size + ctx.rank
        for step in trainer.steps(8):
            g = torch.Generator().manual_seed(1000 * step + offset)
            drawn = torch.randint(len(data), (16,), generator=g)
            if indices:
                trainer.fingerprint_input(drawn.tolist())
                x = torch.ones(16, 4)  # the model's first argument says nothing about the data
                loss = (model(x).squeeze(1) - data[drawn, 0]).pow(2).mean()
            else:
                loss = model(data[drawn]).pow(2).mean()
            loss.backward()
            trainer.finish_step(loss)

    return body, build


def test_replicas_seeded_by_rank_alone_are_told_they_train_on_the_same_data(threaded_job):
    """nanoGPT's port: batches seeded by ctx.rank, so both replicas draw the same ones. The job
    still succeeds (a warning, not a verdict), and says so once in its events, in its status
    and in the coordinator's and a launcher's log."""
    result = threaded_job(2, *seeded_batches("rank", indices=False))
    assert result.returncode == 0, result.output[-3000:]
    found = result.summary["duplicate_data"]
    assert found is not None and found["step"] == 0 and found["replicas"] == [0, 1], found
    # "at step 0", or "at steps 0 to N" once later steps showed it too
    told = "replicas 0 and 1 trained on identical inputs at step"
    assert found["message"].startswith(told) and ": seed or shard" in found["message"]
    assert "trainer.data_rank" in found["message"] and "not by ctx.rank alone" in found["message"]
    events = [e for e in result.summary["events"] if e.startswith("duplicate_data:")]
    assert len(events) == 1 and events[0].startswith(f"duplicate_data: {told}"), events
    assert result.output.count(f"transom.coordinator WARNING duplicate data: {told}") == 1
    assert f"transom.launch WARNING duplicate data: {told}" in result.output
    assert result.incarnations(0) == result.incarnations(1) == 1  # nobody restarted


@pytest.mark.parametrize("indices", [False, True], ids=["model-input", "fingerprint-input"])
def test_replicas_seeded_by_replica_and_rank_are_not_flagged(threaded_job, indices):
    result = threaded_job(2, *seeded_batches("replica-rank", indices))
    assert result.returncode == 0, result.output[-3000:]
    assert result.summary["duplicate_data"] is None
    assert not any(e.startswith("duplicate_data:") for e in result.summary["events"])


def test_sample_indices_named_by_the_script_are_what_is_compared(threaded_job):
    """The model's input is a constant here; the indices the script names show the duplicate."""
    result = threaded_job(2, *seeded_batches("rank", indices=True))
    assert result.returncode == 0, result.output[-3000:]
    assert result.summary["duplicate_data"]["replicas"] == [0, 1]
