"""`trainer.batches()` over data Transom cannot position (ft/iterable.py), as a script ported
from torchtitan feeds it: a `callable_iterator` of synthetic batches (`iter(make_batch,
None)`). Replicas as threads train through a failure: the survivor's retried step runs
on the batch it failed on, the restarted replica goes on with its iterator's next batch
after it caught up (and says so), and the job ends bit-identical. A generator that runs
out before the target is a usage error: a real `transom run` ends after one attempt with
the message and exit 4, where an AttributeError inside Transom used to be retried as a
crash (23 restarts over 100 s)."""

from __future__ import annotations

import pytest
import torch

from transom import contract

# Steps: only a cap, the job ends a few steps after replica 1 caught up. The catch-up takes
# a second or two (its snapshot check waits for the source's fingerprint row, posted once a
# second), and under a quorum lease this model trains hundreds of steps a second.
CAP = 3000


def build(replica: int):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    return model, torch.optim.SGD(model.parameters(), lr=0.05)


def synthetic_batches(replica: int, trainer, model) -> list[tuple[int, int]]:
    """Train on `iter(make_batch, None)`; return (step, batch number) of every step run."""
    g = torch.Generator().manual_seed(trainer.data_rank)
    made = iter(range(1 << 30))

    def make_batch():
        return next(made), torch.randn(8, 4, generator=g)

    seen = []
    for step, (number, x) in trainer.batches(iter(make_batch, None), CAP):
        seen.append((step, number))
        model(x).pow(2).mean().backward()
        trainer.optimizer.step()
    return seen


@pytest.mark.timeout(120)
def test_a_callable_iterator_of_synthetic_batches_trains_through_a_failure(threaded_job):
    result = threaded_job(2, synthetic_batches, build, faults={1: ["raise:step=5"]}, end_on=["caught_up:1"])
    result.assert_finished_together(2)
    survivor = result.results[0]
    retried = [i for i in range(1, len(survivor)) if survivor[i][0] == survivor[i - 1][0]]
    assert retried, "replica 1's failure must have failed a step of replica 0's"
    for i in retried:
        assert survivor[i][1] == survivor[i - 1][1]  # the same batch again
    numbers = [n for _, n in survivor]
    assert numbers[0] == 0 and all(b - a in (0, 1) for a, b in zip(numbers, numbers[1:]))  # else the next one
    # The restarted replica jumped to the survivors' step and went on with its next batch.
    rejoined = result.results[1]
    assert rejoined[1][0] > rejoined[0][0] + 1 and rejoined[1][1] == rejoined[0][1] + 1, rejoined[:3]
    assert "jumped from step" in result.output and "cannot be positioned" in result.output


RUNS_OUT = '''
import torch
from transom import ft

ctx = ft.init()
torch.manual_seed(0)
model = torch.nn.Linear(4, 1)
with ft.FaultTolerant(model, torch.optim.SGD(model.parameters(), lr=0.1), ctx) as trainer:
    for step, x in trainer.batches((torch.randn(8, 4) for _ in range(3)), 10):
        model(x).pow(2).mean().backward()
        trainer.optimizer.step()
'''


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_generator_that_runs_out_ends_the_run_at_once_as_a_script_error(transom_run):
    result = transom_run(["--replicas", "1", "--max-restarts", "3"], [RUNS_OUT], script="-c", timeout_s=100)
    assert result.returncode == contract.EXIT_SCRIPT_ERROR, result.output[-3000:]
    assert result.summary["script_error"].startswith(
        "ScriptError: UsageError: trainer.batches(): the iterator ran out after 3 batches, at step 3 of 10"), \
        result.summary
    assert result.incarnations(0) == 1 and result.summary["replica_restarts"] == 0
    assert result.summary["steps_committed"] == 3
