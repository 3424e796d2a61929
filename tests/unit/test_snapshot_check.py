"""A joiner's check of a snapshot against the replicas' own fingerprints (ft/snapshot_check.py),
and the detectors' record it reads (detect/detectors.py, coordinator/detection.py)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import cast

import pytest
import torch

from transom.coordinator.detection import Detection
from transom.coordinator.membership import Membership, Settings
from transom.coordinator.models import FingerprintRecord, Identity, RegisterRequest, SignalBatch, SignalRow
from transom.detect.step_rows import DetectionSettings
from transom.ft.catchup import Shadow
from transom.ft.guard import fingerprint
from transom.ft.snapshot_check import SnapshotCheck
from transom.ft.transfer import SnapshotManifest

PARAMS = [torch.arange(6, dtype=torch.float32).reshape(2, 3), torch.ones(4)]
OPTIMIZER = torch.optim.Adam([torch.nn.Parameter(p.clone()) for p in PARAMS])  # its state: moments and steps
OPTIMIZER.state[OPTIMIZER.param_groups[0]["params"][0]] = {"step": torch.tensor(3.0), "exp_avg": torch.ones(2, 3)}
MINE = int(fingerprint([*PARAMS, torch.tensor(3.0), torch.ones(2, 3)]).item())  # parameters and optimizer state


class Records:
    """A coordinator that answers with `answers` in turn (the last one again and again)."""

    def __init__(self, *answers: FingerprintRecord):
        self.answers = list(answers)
        self.asked: list[tuple[int, int]] = []

    def fingerprint(self, committed: int, rank: int, timeout_s: float) -> FingerprintRecord:
        self.asked.append((committed, rank))
        return self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]


def check(client, **kw) -> bool:
    return SnapshotCheck(client, rank=1, wait_s=kw.pop("wait_s", 2.0), **kw)(
        cast(SnapshotManifest, SimpleNamespace(step=40)),
        cast(Shadow, SimpleNamespace(model_params=PARAMS, optimizer=OPTIMIZER)))


@pytest.mark.parametrize("record, used", [
    (FingerprintRecord(state="agreed", value=MINE), True),
    (FingerprintRecord(state="agreed", value=MINE + 1), False),  # zeros, or another lineage: refused
    (FingerprintRecord(state="disputed"), False),
    (FingerprintRecord(state="single", value=MINE), True),
    (FingerprintRecord(state="single", value=MINE - 1), False),  # not even what its one source said
])
def test_a_snapshot_is_used_only_if_it_is_what_the_replicas_committed(record, used):
    client = Records(FingerprintRecord(state="unknown"), record)
    assert check(client) is used
    assert client.asked[0] == (40, 1)  # the state after 40 committed steps, this rank's shard


def test_nothing_on_record_in_time_is_used_unchecked_and_detection_off_asks_nothing():
    assert check(Records(FingerprintRecord(state="unknown")), wait_s=0.6) is True
    client = Records(FingerprintRecord(state="agreed", value=MINE + 1))
    assert check(client, enabled=False) is True and client.asked == []


def test_the_coordinator_keeps_the_majority_fingerprint_of_each_step_and_rank():
    m = Membership(Settings(job="t", num_replicas=3))
    for r in range(3):
        m.register(RegisterRequest(identity=Identity(replica_id=r, generation=0, attempt=0), store_addr="h:1",
                                   state_endpoints=["x"], step=50), now=0.0)
    d = Detection(DetectionSettings(action="Report"), m)
    for r, value in enumerate((7, 7, 9)):  # the row of step 39 describes the state after 40 steps
        d.observe(SignalBatch(identity=Identity(replica_id=r, generation=0, attempt=0),
                              rows=[SignalRow(step=39, rank=0, step_seconds=0.5, fingerprint=value)]), now=1.0)
    assert d.fingerprint(40, 0) == FingerprintRecord(state="agreed", value=7)
    assert d.fingerprint(40, 1).state == d.fingerprint(41, 0).state == "unknown"
