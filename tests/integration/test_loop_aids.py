"""What a loop ported from a DDP script relies on (ft/loop_aids.py, ft/script_state.py), with
replicas as threads of this process, a real coordinator and real Gloo groups
(test_trainer_api.run_replicas): DDP's `require_backward_grad_sync` switch accumulates as
`trainer.no_sync()` does; a replica that works outside the steps for longer than the
collective timeout stays a member while the other trains on; per-step generators;
one writer; a start step from the script's own checkpoint; script values as replica state.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest
import torch

from test_trainer_api import _batch, run_replicas
from transom import contract
from transom.errors import UsageError
from transom.ft import ScriptState, wire
from transom.ft.loop_aids import step_seed
from transom.ft.script_state import StateBundle, bundle
from transom.launch import summary

pytestmark = pytest.mark.timeout(120)


def _accumulate(switch: str):
    """Two micro batches per step, the first only accumulated, by `switch`."""
    def body(r, trainer, model):
        optimizer = trainer.optimizer
        for step in trainer.steps(3):
            x, y = _batch(r, step)
            if switch == "ddp":
                model.require_backward_grad_sync = False  # DDP's own switch, as nanoGPT sets it
                torch.nn.functional.mse_loss(model(x[:4]), y[:4]).backward()
                model.require_backward_grad_sync = True
            else:
                with trainer.no_sync():
                    torch.nn.functional.mse_loss(model(x[:4]), y[:4]).backward()
            torch.nn.functional.mse_loss(model(x[4:]), y[4:]).backward()
            optimizer.step()
            optimizer.zero_grad()
        return [p.detach().clone() for p in model.parameters()]
    return body


def test_ddp_require_backward_grad_sync_accumulates_like_no_sync():
    by_switch = run_replicas(2, _accumulate("ddp"))
    by_no_sync = run_replicas(2, _accumulate("no_sync"))
    for a, b, c in zip(by_switch[0], by_switch[1], by_no_sync[0]):
        assert torch.equal(a, b) and torch.equal(a, c)


def test_a_replica_aside_for_twice_the_collective_timeout_stays_a_member(monkeypatch):
    # No launcher forwards signal rows here, so nobody could vouch for the catch-up's snapshot
    # (ft/snapshot_check.py): the detectors are off, as a job without detection runs.
    monkeypatch.setenv(contract.ENV_DETECTION, json.dumps({"enabled": False}))
    collective_timeout_s, aside_s = 2.0, 4.0
    progress: dict[int, list[tuple[float, int]]] = {0: [], 1: []}

    def body(r, trainer, model):
        optimizer = trainer.optimizer
        aside = None
        for step in trainer.steps(60):  # about 6 s: replica 1 is still training when replica 0 is back
            if r == 0 and step == 3 and aside is None:
                with trainer.aside():  # at the top of the loop, before the forward pass (nanoGPT's eval)
                    t0 = time.monotonic()
                    time.sleep(aside_s)
                    aside = (t0, time.monotonic())
            x, y = _batch(r, step)
            torch.nn.functional.mse_loss(model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()
            progress[r].append((time.monotonic(), trainer.step))
            time.sleep(0.1)
        return aside, trainer.step, [p.detach().clone() for p in model.parameters()]

    (window, step0, p0), (_, step1, p1) = run_replicas(2, body, min_replicas=1,
                                                       collective_timeout_s=collective_timeout_s)
    assert step0 == step1 == 60  # replica 0 was never evicted: it finished the job with the other
    t0, t1 = window
    during = [s for t, s in progress[1] if t0 < t < t1]
    assert len(during) >= 5, f"replica 1 waited for the one aside: {during}"
    assert all(torch.equal(a, b) for a, b in zip(p0, p1))  # it caught up


def test_aside_after_the_forward_pass_is_refused():
    def body(r, trainer, model):
        for step in trainer.steps(1):
            x, y = _batch(r, step)
            loss = torch.nn.functional.mse_loss(model(x), y)
            with pytest.raises(UsageError, match="before the forward pass"):
                with trainer.aside():
                    pass
            loss.backward()
            trainer.optimizer.step()
        return True

    assert run_replicas(2, body) == [True, True]


def test_generators_differ_across_replicas_and_repeat_within_a_step():
    def body(r, trainer, model):
        draws = []
        for step in trainer.steps(2):
            a = torch.randint(1000, (4,), generator=trainer.generator(0))
            again = torch.randint(1000, (4,), generator=trainer.generator(0))
            other = torch.randint(1000, (4,), generator=trainer.generator(1))
            assert torch.equal(a, again) and not torch.equal(a, other)
            draws.append(a)
            x, y = _batch(r, step)
            torch.nn.functional.mse_loss(model(x), y).backward()
            trainer.optimizer.step()
        return trainer.data_rank, trainer.data_world_size, draws, trainer.is_writer

    (rank0, world, d0, w0), (rank1, _, d1, w1) = run_replicas(2, body)
    assert (rank0, rank1, world) == (0, 1, 2)
    assert not torch.equal(d0[0], d1[0]) and not torch.equal(d0[0], d0[1])
    assert [w0, w1] == [True, False]  # one writer for the job


def test_step_seed_is_stable_and_spreads():
    assert step_seed(0, 5, 1, 3) == step_seed(0, 5, 1, 3)
    seeds = {step_seed(s, st, m, r) for s in range(2) for st in range(4) for m in range(3) for r in range(4)}
    assert len(seeds) == 2 * 4 * 3 * 4 and all(0 <= x < 1 << 63 for x in seeds)


def test_a_start_step_from_the_scripts_own_checkpoint():
    def body(r, trainer, model):
        first = None
        for step in trainer.steps(8):
            first = step if first is None else first
            x, y = _batch(r, step)
            torch.nn.functional.mse_loss(model(x), y).backward()
            trainer.optimizer.step()
        return first, trainer.step

    assert run_replicas(2, body, start_step=5) == [(5, 8), (5, 8)]


def test_script_values_and_several_objects_are_one_replica_state():
    script = ScriptState(best_val_loss=1e9, seen=[1, 2])
    model = torch.nn.Linear(2, 2)
    scheduler = torch.optim.lr_scheduler.StepLR(torch.optim.SGD(model.parameters(), lr=1.0), step_size=1)
    scheduler.step()
    extra = bundle({"lr": scheduler, "script": script})
    assert isinstance(extra, StateBundle)
    script["best_val_loss"] = 2.5
    carried = wire.decode(wire.encode(extra.state_dict()))  # as a peer or a checkpoint carries it
    fresh_script = ScriptState(best_val_loss=1e9)
    fresh_sched = torch.optim.lr_scheduler.StepLR(torch.optim.SGD(model.parameters(), lr=1.0), step_size=1)
    bundle({"lr": fresh_sched, "script": fresh_script}).load_state_dict(carried)
    assert fresh_script == {"best_val_loss": 2.5, "seen": [1, 2]}
    assert fresh_sched.last_epoch == scheduler.last_epoch == 1
    with pytest.raises(UsageError, match="pickle"):
        script["model"] = model
    with pytest.raises(UsageError, match="state_dict"):
        bundle({"value": 3})


SCRIPTS = Path(__file__).resolve().parent / "scripts"


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_ddp_switches_inside_a_replica_of_two_processes_train_alike(transom_run):
    """Real DDP inside a replica (two processes): DDP's require_backward_grad_sync and its
    model.no_sync() accumulate exactly as trainer.no_sync() does. (One replica: that replicas
    of DDP processes end alike is test_fault_tolerance's and test_docs_diff's.)"""
    digests = {}
    for switch in ("ddp-attribute", "ddp-no-sync", "trainer-no-sync"):
        result = transom_run(["--replicas", "1", "--nproc-per-replica", "2"], ["--switch", switch],
                             script=SCRIPTS / "ddp_accumulate.py", timeout_s=120)
        assert result.returncode == 0, result.output[-3000:]
        _, finals = summary.load(result.stats_dir)
        digests[switch] = {(f["rank"], f["digest"]) for f in finals}
    assert digests["ddp-attribute"] == digests["ddp-no-sync"] == digests["trainer-no-sync"]
    ranks = digests["ddp-attribute"]
    assert len(ranks) == 2 and len({d for _, d in ranks}) == 1  # a digest per rank, the ranks agree (DDP)


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("accumulate", [1, 3])
def test_under_fsdp2_the_gradients_after_backward_are_the_replicas_average(transom_run, accumulate):
    """FSDP2 inside each replica of two processes: what the script clips after `backward()`
    is already the cross-replica average (every replica's shard of each rank alike after
    clipping), also with micro batches accumulated in `trainer.no_sync()`."""
    result = transom_run(["--replicas", "2", "--nproc-per-replica", "2"], ["--accumulate", str(accumulate)],
                         script=SCRIPTS / "fsdp_grads.py", timeout_s=150)
    assert result.returncode == 0, result.output[-3000:]
    seen: dict[tuple[int, int], set[str]] = {}
    line = r"grads replica (\d) rank (\d) step (\d+): ([0-9a-f]{16})"  # lines of processes may run together
    for replica, rank, step, digest in re.findall(line, result.output):
        seen.setdefault((int(rank), int(step)), set()).add(f"{replica}:{digest}")
    assert sorted(seen) == [(rank, step) for rank in range(2) for step in range(3)], result.output[-3000:]
    for (rank, step), digests in seen.items():
        assert len({d.split(":")[1] for d in digests}) == 1 and len(digests) == 2, (rank, step, digests)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_an_evaluation_aside_under_fsdp2_costs_one_catch_up_and_no_retries(transom_run):
    """Replica 0 evaluates in `trainer.aside()` and comes back behind: it catches up from
    replica 1 while FSDP2's root keeps its parameters unsharded between a forward and a
    backward pass. The catch-up names the sharded parameters the optimizer holds (taken on the
    training thread), so it needs no retry, and the replicas end bit-identical."""
    result = transom_run(["--replicas", "2", "--nproc-per-replica", "2", "--end-on", "caught_up:0"],
                         ["--steps", "400", "--aside-at", "3"], script=SCRIPTS / "fsdp_grads.py", timeout_s=200)
    result.assert_finished_together(2)
    assert "trying again" not in result.output, result.output[-3000:]
