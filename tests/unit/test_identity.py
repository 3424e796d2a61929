"""Who a credential names (coordinator/identity.py, kube_identity.py), without I/O."""

from __future__ import annotations

import pytest

from transom import contract
from transom.coordinator.identity import ReplicaKeys
from transom.coordinator.kube_identity import principal_of
from transom.coordinator.models import Identity
from transom.errors import Forbidden


def test_a_replica_key_names_one_replica_generation_and_node_of_one_job():
    keys = ReplicaKeys("job", b"s" * 32)
    p = keys.principal(keys.mint(2, 5, 1))
    assert (p.replica_id, p.generation, p.node_rank, p.admin) == (2, 5, 1, False)
    p.check(Identity(replica_id=2, generation=5, attempt=9), node_rank=1)  # any attempt: its own restarts
    for identity, node in ((Identity(replica_id=1, generation=5, attempt=0), None),
                           (Identity(replica_id=2, generation=4, attempt=0), None),
                           (Identity(replica_id=2, generation=5, attempt=0), 0)):
        with pytest.raises(Forbidden):
            p.check(identity, node_rank=node)
    assert ReplicaKeys("other", b"s" * 32).principal(keys.mint(2, 5, 1)) is None
    assert ReplicaKeys("job", b"t" * 32).principal(keys.mint(2, 5, 1)) is None
    with pytest.raises(ValueError):
        ReplicaKeys("job", b"short")


def test_a_pods_labels_make_its_principal_and_a_spare_speaks_for_no_replica():
    labels = {contract.LABEL_JOB: "tj", contract.LABEL_REPLICA: "3", contract.LABEL_GENERATION: "7",
              contract.LABEL_NODE_RANK: "2"}
    p = principal_of(labels, "tj", "tj-r3-n2-g7", "uid-1")
    assert (p.replica_id, p.generation, p.node_rank, p.pod) == (3, 7, 2, ("tj-r3-n2-g7", "uid-1"))
    assert principal_of(labels, "another-job", "tj-r3-n2-g7", "uid-1") is None
    spare = principal_of({contract.LABEL_JOB: "tj", contract.LABEL_SPARE: "0"}, "tj", "tj-s0-n0-g0", "uid-2")
    assert spare.replica_id is None and spare.pod == ("tj-s0-n0-g0", "uid-2")
    with pytest.raises(Forbidden):
        spare.check(Identity(replica_id=0, generation=0, attempt=0))


@pytest.mark.parametrize("digit", ["\u00b2", "\u0663", "\uff11", "\U0001d7d9"],
                         ids=["superscript", "arabic-indic", "fullwidth", "math-double-struck"])
def test_a_replica_key_with_a_non_ascii_digit_names_nobody(digit):
    # str.isdigit() takes these; int() refuses some (a 400 with its message) and reads others
    # (another spelling of a key): either way not a key this coordinator minted.
    keys = ReplicaKeys("job", b"s" * 32)
    key = keys.mint(1, 0, 0)
    forged = key.replace(".1.0.0.", f".{digit}.0.0.", 1)
    assert forged != key and keys.principal(forged) is None
