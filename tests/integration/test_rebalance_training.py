"""Rebalance in a real multi-process run: a replica made slow (its steps take twice their
compute, by sleeping) is found by the fail-slow detector and, with `slowAction: Rebalance`,
kept training with a smaller share of each global batch while the other takes more. The
global batch stays whole, no sample is trained twice, the replicas end bit-identical, and
the weights are those of plain SGD on each step's whole global batch: the update stays the
mean over every sample, whatever the shares."""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent / "scripts"))

from dataloader_job import BATCH, SAMPLES, dataset  # noqa: E402
from test_dataloader import JOB, _committed  # noqa: E402
from test_fault_tolerance import assert_consistent_finish  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
REPLICAS, STEPS = 2, 80


def _replay(global_batches: dict[int, list[int]], weighted: bool, by_replica: dict[int, dict[int, list[int]]]):
    """The job's model trained by plain SGD in this process: on each step's whole global batch
    (`weighted`), or on the average of the replicas' own means (what dividing by the number of
    replicas would have given)."""
    _, x, y = dataset().tensors
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in sorted(global_batches):
        if weighted:
            idx = torch.tensor(global_batches[step])
            torch.nn.functional.mse_loss(model(x[idx]), y[idx]).backward()
        else:
            for r in sorted(by_replica):
                idx = torch.tensor(by_replica[r][step])
                (torch.nn.functional.mse_loss(model(x[idx]), y[idx]) / len(by_replica)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 10.0)
        opt.step()
        opt.zero_grad()
    return torch.cat([model.weight.detach().flatten(), model.bias.detach()])


def test_a_slow_replica_gets_a_smaller_share_and_the_update_stays_exact(transom_run, tmp_path):
    logs = tmp_path / "logs"
    logs.mkdir()
    # Two replicas, one per core. A high threshold: the 2x slowdown shows as ~2x, while the
    # other replica's larger batch after the rebalance must not look slow.
    detection = {"warmupSteps": 10, "slowSteps": 6, "slowFactorPercent": 140, "slowAction": "Rebalance"}
    result = transom_run(["--replicas", str(REPLICAS), "--detection", json.dumps(detection),
                          "--inject", "slow:replica=1,step=15,factor=2"],
                         ["--steps", str(STEPS), "--log-dir", str(logs), "--workers", "0",
                          "--sample-seconds", "0.02"], script=JOB)
    assert_consistent_finish(result, STEPS, REPLICAS)
    events = result.summary["events"]
    assert any(e.startswith("verdict:") and "replica 1: FailSlow" in e and "(Rebalance)" in e for e in events), events
    assert any(e.startswith("rebalance:") and "replica 1 0." in e for e in events), events
    assert result.incarnations(1) == 1 and result.incarnations(0) == 1  # nobody was replaced

    committed = _committed(logs)
    by_replica: dict[int, dict[int, list[int]]] = defaultdict(dict)
    for r in committed:
        by_replica[r["replica"]][r["step"]] = r["indices"]
    assert all(len(by_replica[r]) == STEPS for r in range(REPLICAS))
    sizes = [(len(by_replica[0][s]), len(by_replica[1][s])) for s in range(STEPS)]
    assert sizes[0] == (BATCH, BATCH) and sizes[-1][0] > BATCH > sizes[-1][1], sizes
    assert all(a + b == REPLICAS * BATCH for a, b in sizes), sizes  # the global batch stays whole
    global_batches = {s: by_replica[0][s] + by_replica[1][s] for s in range(STEPS)}
    per_epoch = (SAMPLES // REPLICAS) // BATCH
    for epoch in range(STEPS // per_epoch):
        used = [i for s, b in global_batches.items() if s // per_epoch == epoch for i in b]
        assert len(used) == len(set(used)) == per_epoch * REPLICAS * BATCH, f"epoch {epoch}"

    final = [json.loads((logs / f"final-{r}-0.json").read_text()) for r in range(REPLICAS)]
    got = torch.tensor(final[0]["weight"] + final[0]["bias"])
    exact = _replay(global_batches, True, by_replica)
    unweighted = _replay(global_batches, False, by_replica)
    assert torch.allclose(got, exact, atol=1e-5), (got, exact)
    assert not torch.allclose(got, unweighted, atol=1e-4), "the shares made no difference to the update"
