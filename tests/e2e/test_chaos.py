"""Faults a cluster throws, on real pods: the CI subset of `make chaos` (hack/chaos).

Each test runs one scenario of hack/chaos/scenarios.py exactly as `make chaos` does: a
TrainingJob (examples/trainingjob-cpu.yaml with the test image) on the session's three
real nodes, the operator installed by its chart as two replicas, the fault done for real
(a node's kubelet, containerd and containers killed; a node's links cut; `kubectl
drain`; a node whose compute check fails before the job's first step), and the same
judgement for every scenario (hack/chaos/job.py): Succeeded at its target step, the
committed step never back, every checkpoint verifying against its manifest, the replicas'
final parameter digests equal, the expected reason in status and Events, nothing left
running. The others run in `make chaos` (docs/failure-model.md).
"""

from __future__ import annotations

import json

import pytest

from chaos.catalog import run_named
from chaos.world import World

pytestmark = [pytest.mark.slow, pytest.mark.real_nodes, pytest.mark.timeout(1500)]

CI_SUBSET = ["node_loss", "partition", "drain", "bad_node"]
EXPECTED_REASON = {"node_loss": "NodeNotReady", "partition": "NodeNotReady", "drain": "PodEvicted",
                   "bad_node": "PreflightFailed"}


@pytest.fixture(scope="module")
def world(control_plane):
    if len(control_plane.real_nodes) < 3:
        pytest.fail("the chaos scenarios need three real nodes: `hack/testenv.sh down`, then let the tests start "
                    "the environment (or `hack/testenv.sh up --real-nodes 3`)", pytrace=False)
    w = World(control_plane, log=lambda line: print(line, flush=True))
    w.install_operator(replicas=2)
    yield w
    w.uninstall_operator()
    w.close()


@pytest.mark.parametrize("name", CI_SUBSET)
def test_the_job_survives_the_fault_on_real_pods(world, name):
    verdict = run_named(world, name)
    print(json.dumps(verdict.row()), *verdict.notes, sep="\n")
    assert verdict.survived, verdict.problems
    assert verdict.steps_lost == 0 and verdict.bit_identical
    assert verdict.reason == EXPECTED_REASON[name]
    assert verdict.detect_s is not None and verdict.recover_s is not None and verdict.detect_s < verdict.recover_s
