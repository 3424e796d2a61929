"""The spare launcher's reading of its downward-API labels file (transom.launch.spare)."""

from __future__ import annotations

import threading
import time

from transom import contract
from transom.launch import spare


def test_parse_labels_reads_the_kubelet_format_and_skips_garbage():
    text = ('transom.io/job="demo"\ntransom.io/replica="3"\nweird="a\\"b\\n"\n'
            'no-equals-sign\nbad="unterminated\n=""\n')
    assert spare.parse_labels(text) == {"transom.io/job": "demo", "transom.io/replica": "3", "weird": 'a"b\n'}


def test_assignment_needs_replica_and_generation_and_no_spare_label():
    base = {contract.LABEL_REPLICA: "2", contract.LABEL_GENERATION: "5"}
    assert spare.assignment(base) == spare.Assignment(2, 5)
    assert spare.assignment({**base, contract.LABEL_SPARE: "0"}) is None  # not promoted yet
    assert spare.assignment({contract.LABEL_REPLICA: "2"}) is None
    assert spare.assignment({**base, contract.LABEL_GENERATION: "x"}) is None


def test_wait_returns_once_the_labels_name_a_replica(tmp_path):
    labels = tmp_path / "labels"
    labels.write_text(f'{contract.LABEL_SPARE}="0"\n{contract.LABEL_GENERATION}="0"\n')
    found: list = []
    t = threading.Thread(target=lambda: found.append(spare.wait_for_assignment(tmp_path, lambda: False, 0.01)))
    t.start()
    time.sleep(0.1)
    assert t.is_alive() and not found
    # The kubelet replaces the file atomically (a symlink swap); a rename does the same here.
    tmp = tmp_path / "labels.new"
    tmp.write_text(f'{contract.LABEL_REPLICA}="1"\n{contract.LABEL_GENERATION}="4"\n')
    tmp.rename(labels)
    t.join(timeout=5)
    assert found == [spare.Assignment(1, 4)]


def test_wait_ends_when_stopped_and_tolerates_a_missing_file(tmp_path):
    stop = threading.Event()
    threading.Timer(0.1, stop.set).start()
    assert spare.wait_for_assignment(tmp_path / "absent", stop.is_set, 0.01) is None


def test_promoted_environ_replaces_the_spare_id_with_the_identity():
    env = spare.promoted_environ({contract.ENV_SPARE_ID: "0", "PATH": "/bin"}, spare.Assignment(3, 7))
    assert env == {"PATH": "/bin", contract.ENV_REPLICA_ID: "3", contract.ENV_REPLICA_GENERATION: "7"}
