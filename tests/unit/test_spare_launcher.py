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


def test_a_spare_pod_environment_has_no_replica_until_promoted():
    pod = {contract.ENV_SPARE_ID: "1", contract.ENV_NUM_REPLICAS: "4", contract.ENV_COORDINATOR_URL: "http://c:8080"}
    env = contract.ReplicaEnv.from_environ(pod)
    assert env.is_spare and env.spare_id == 1 and env.replica_id == contract.UNASSIGNED
    taken = env.promoted(3, 2)
    assert not taken.is_spare and (taken.replica_id, taken.generation, taken.spare_id) == (3, 2, None)
    assert taken.num_replicas == 4 and taken.coordinator_url == "http://c:8080"
    # A replica pod is never a spare, whatever else its environment holds.
    replica = contract.ReplicaEnv.from_environ({**pod, contract.ENV_REPLICA_ID: "0"})
    assert not replica.is_spare and replica.spare_id is None


def test_the_launcher_of_a_spare_takes_the_identity_its_labels_name(tmp_path):
    from transom.launch.config import LaunchConfig
    from transom.launch.supervisor import Launcher

    (tmp_path / "labels").write_text(f'{contract.LABEL_SPARE}="0"\n')
    pod = {contract.ENV_SPARE_ID: "0", contract.ENV_NUM_REPLICAS: "2", contract.ENV_COORDINATOR_URL: "http://c:1",
           contract.ENV_PODINFO_DIR: str(tmp_path)}
    launcher = Launcher(LaunchConfig(command=["true"], nproc_per_node=1), contract.ReplicaEnv.from_environ(pod), pod)
    launcher._promote_if_assigned()
    assert launcher.env.is_spare and launcher.who == "spare 0"
    (tmp_path / "labels").write_text(f'{contract.LABEL_REPLICA}="1"\n{contract.LABEL_GENERATION}="3"\n')
    launcher._promote_if_assigned()
    assert launcher.who == "replica 1" and launcher.identity(2).replica_id == 1 and launcher.identity(2).key() == (3, 2)
    # Its workers from now on start as that replica's.
    assert launcher._environ[contract.ENV_REPLICA_ID] == "1" and contract.ENV_SPARE_ID not in launcher._environ
