"""A joiner's check of a snapshot against the replicas' own fingerprints (ft/snapshot_check.py),
and the detectors' record it reads (detect/detectors.py, coordinator/detection.py)."""

from __future__ import annotations

import concurrent.futures
import logging
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
from transom.ft.sources import SnapshotUse
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


def check(client, serving: int = 1, others: int = 0, **kw) -> SnapshotUse:
    return SnapshotCheck(client, rank=1, wait_s=kw.pop("wait_s", 2.0), **kw)(
        cast(SnapshotManifest, SimpleNamespace(step=40)),
        cast(Shadow, SimpleNamespace(model_params=PARAMS, optimizer=OPTIMIZER)), serving, others)


USE, REFUSE, ELSEWHERE = SnapshotUse.USE, SnapshotUse.REFUSE, SnapshotUse.ELSEWHERE


@pytest.mark.parametrize("record, used", [
    (FingerprintRecord(state="agreed", value=MINE), USE),
    (FingerprintRecord(state="agreed", value=MINE + 1), REFUSE),  # zeros, or another lineage: refused
    (FingerprintRecord(state="disputed"), REFUSE),
    (FingerprintRecord(state="single", value=MINE), USE),  # its one source, and no other left
    (FingerprintRecord(state="single", value=MINE - 1), REFUSE),  # not even what its one source said
])
def test_a_snapshot_is_used_only_if_it_is_what_the_replicas_committed(record, used):
    client = Records(FingerprintRecord(state="unknown"), record)
    assert check(client) is used
    assert client.asked[0] == (40, 1)  # the state after 40 committed steps, this rank's shard


@pytest.mark.parametrize("record", [FingerprintRecord(state="single", value=MINE), FingerprintRecord(state="unknown")])
def test_a_snapshot_only_its_source_vouches_for_is_set_aside_while_another_source_is_left(record):
    # A lone fingerprint (maybe the source's own row) or none within the wait confirms nothing:
    # the joiner tries another source before it takes one replica's word.
    assert check(Records(record), others=1, wait_s=0.3) is ELSEWHERE
    assert check(Records(record), serving=2, others=1, wait_s=0.3) is USE  # two sources serve it byte for byte
    assert check(Records(record), wait_s=0.3) is USE  # no other source: its word, and the log says so


def test_an_unconfirmed_snapshot_is_never_used_silently(caplog):
    caplog.set_level(logging.WARNING, logger="transom.ft")
    assert check(Records(FingerprintRecord(state="unknown")), wait_s=0.3) is USE
    client = Records(FingerprintRecord(state="agreed", value=MINE + 1))
    assert check(client, enabled=False) is USE and client.asked == []  # detection off: nothing to ask
    assert check(client, enabled=False, others=1) is ELSEWHERE
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 3 and "no fingerprint on record within 0s" in said[0], said
    assert "anomaly detection is off" in said[1] and "no other source is left" in said[1], said
    assert "set aside" in said[2], said


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


def test_a_sources_fingerprint_summed_beside_the_next_step_is_in_its_row_once_there(tmp_path):
    """The source's side: the fingerprint of the snapshot's state is summed on a thread of its
    own (ft/state_print.py), and the guard holds that step's row until the value is there;
    a sum that failed leaves the row without one (the joiner then says nothing is on record)."""
    from transom.detect.step_rows import read_trace
    from transom.ft.guard import Guard, state_tensors
    from transom.ft.state_print import PrintLater

    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    guard = Guard(DetectionSettings(fingerprint_interval=0), str(tmp_path), 0, 0, 0, 0)
    later = PrintLater(state_tensors(model.parameters(), optimizer))
    failed: concurrent.futures.Future[int] = concurrent.futures.Future()

    def commit(step: int, print_later=None) -> None:
        guard.committed(step, 0.1, 1.0, 1.0, False, print_later is not None, False, (model, optimizer), None,
                        print_later=print_later)

    def rows() -> dict[int, int | None]:
        return {s.step: s.fingerprint for s in read_trace(next(tmp_path.glob("signals-*.csv")))}

    held: concurrent.futures.Future[int] = concurrent.futures.Future()  # a sum not finished yet
    commit(4, held)
    commit(5)
    assert rows() == {5: None}  # step 4's row waits for its fingerprint
    later.wait(30)
    held.set_result(later.future.result())
    commit(6, failed)
    assert rows() == {5: None, 4: int(fingerprint(state_tensors(model.parameters(), optimizer)).item())}
    failed.set_exception(RuntimeError("the device is gone"))
    guard.close()
    assert rows()[6] is None
